"""The methods a node offers, and the limits that keep their calls in check."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import inspect
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from .._checks import check_arguments, check_int
from .._loops import check_home
from ..errors import ConfigurationError, fresh
from ._protocol import safe_text

if TYPE_CHECKING:
    from .._node import Node
    from .._peer import Peer

__all__ = [
    "RESERVED_KWARGS",
    "ByteBudget",
    "CallLimits",
    "CallerRoom",
    "FifoAdmission",
    "Method",
    "MethodRegistry",
    "PerChannel",
    "SlotLoan",
    "Slots",
    "call_back_room",
    "lending",
    "methods_of",
    "serving",
]

RESERVED_KWARGS = ("_deadline", "_out")  # peer.call's own keywords: no method may take them
_U64 = (1 << 64) - 1  # byte limits are reported in uint64 fields (GetMethods' max_arg_bytes)

F = TypeVar("F", bound=Callable[..., Any])


@check_arguments
@dataclass(frozen=True, slots=True)
class CallLimits:
    """Per-node bounds on the calls it serves (set with ``node.methods.limits = ...``).

    max_concurrent: calls admitted at once, over every peer and the control plane. Past it the
        node stops reading requests, so callers wait (backpressure) instead of piling up. A
        method waiting for a call it made lends its slot meanwhile (``SlotLoan``).
    max_inflight_bytes: tensor bytes of the arguments of admitted calls held at once; a call
        whose arguments do not fit waits for others to finish before its tensors move.
    max_arg_bytes: the largest argument payload one call may carry (None: max_inflight_bytes);
        a method can declare a smaller limit of its own.

    Each is an int (ConfigurationError otherwise, here): max_concurrent and max_inflight_bytes
    at least 1, max_arg_bytes at least 0; byte limits below 2**64.
    """

    max_concurrent: int = 64
    max_inflight_bytes: int = 1 << 30
    max_arg_bytes: int | None = None

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: store the checked values as plain ints
        set_(self, "max_concurrent", check_int("CallLimits.max_concurrent", self.max_concurrent, 1))
        set_(self, "max_inflight_bytes", check_int("CallLimits.max_inflight_bytes", self.max_inflight_bytes, 1, _U64))
        if self.max_arg_bytes is not None:
            set_(self, "max_arg_bytes", check_int("CallLimits.max_arg_bytes", self.max_arg_bytes, 0, _U64))


@dataclass(frozen=True, slots=True)
class Method:
    """One registered method."""

    name: str
    fn: Callable[..., Any]
    streaming: bool  # an async generator: callers use peer.stream
    signature: str
    doc: str
    max_arg_bytes: int | None = None


class _Failing(Protocol):
    def fail(self, exc: BaseException | None) -> None: ...


A = TypeVar("A", bound=_Failing)


class PerChannel(Generic[A]):
    """One admission (``make(peer)``) per open peer's channel, made on first use and failed
    with the channel's error when it closes (``A.fail``), then forgotten. For a peer whose
    channel is closed already, a failed one that nothing keeps. Only open peers' are kept: a
    failed one holds its error, whose traceback may hold the peer, and a WeakKeyDictionary's
    value that refers to its key keeps that key alive for ever. Each admission fails with a
    copy of the channel's error (``fresh``), never the one the channel keeps: an admission
    that raised that one made every raiser's frames (a call's arguments) part of the channel's
    failure for as long as the peer lived."""

    def __init__(self, make: Callable[[Peer], A]) -> None:
        self._make = make
        self._of: weakref.WeakKeyDictionary[Peer, A] = weakref.WeakKeyDictionary()

    def __call__(self, peer: Peer) -> A:
        admission = self._of.get(peer)
        if admission is not None:
            return admission
        from ..transports import ChannelState  # (here, not per call: an import statement costs ~1 us)

        admission = self._make(peer)
        if peer.channel.state is not ChannelState.OPEN:
            failure = peer.channel.mailbox.failure
            admission.fail(None if failure is None else fresh(failure))  # for this use alone: nothing keeps it
            return admission
        self._of[peer] = admission
        ref = weakref.ref(peer)
        of = self._of

        def closed(exc: BaseException | None) -> None:
            admission.fail(None if exc is None else fresh(exc))
            gone = ref()
            if gone is not None:
                of.pop(gone, None)

        peer.channel.add_close_callback(closed)
        return admission

    def __getitem__(self, peer: Peer) -> A:
        """``peer``'s admission, made already (KeyError if none)."""
        return self._of[peer]


class FifoAdmission:
    """FIFO asyncio admission: a waiter gets in once what it asks for fits and nobody is ahead
    of it, so a large request is not starved by small ones. Subclasses say what fits and how it
    is taken and given back (``_fits``, ``_take``, ``_give``)."""

    def __init__(self) -> None:
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    def _fits(self, n: int) -> bool:
        raise NotImplementedError

    def _take(self, n: int) -> None:
        raise NotImplementedError

    def _give(self, n: int) -> None:
        raise NotImplementedError

    def admit_now(self, n: int) -> bool:
        """``_admit(n)`` where it goes in at once, without a coroutine: True, and taken; else
        False, and nothing changed (``_admit`` then waits in line)."""
        if not self._waiters and self._fits(n):
            self._take(n)
            return True
        return False

    async def _admit(self, n: int) -> None:
        if self.admit_now(n):
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (n, fut)
        self._waiters.append(entry)
        try:
            await fut
        except BaseException:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self._give(n)  # granted just as we were cancelled: give it back
            else:
                with contextlib.suppress(ValueError):  # _wake may have dropped it already
                    self._waiters.remove(entry)
            self._wake()  # the head of the line may have left: the next may fit
            raise

    def _release(self, n: int) -> None:
        self._give(n)
        self._wake()

    def _fail_waiters(self, error: Callable[[int], BaseException | None]) -> None:
        """Fail each waiter for which ``error(n)`` gives an exception, with a copy of its own
        (``fresh``): waiters handed one object each added their frames to its traceback."""
        for n, fut in self._waiters:
            exc = error(n)
            if exc is not None and not fut.done():
                fut.set_exception(fresh(exc))

    def _wake(self) -> None:
        while self._waiters:
            n, fut = self._waiters[0]
            if not fut.done():
                if not self._fits(n):
                    return
                self._take(n)
                fut.set_result(None)
            self._waiters.popleft()


class ByteBudget(FifoAdmission):
    """An asyncio byte semaphore (FIFO). Its total can change while it is in use (``resize``)."""

    def __init__(self, total: int) -> None:
        super().__init__()
        self.total = total
        self.free = total

    def _fits(self, n: int) -> bool:
        return n <= self.free

    def _take(self, n: int) -> None:
        self.free -= n

    def _give(self, n: int) -> None:
        self.free += n

    async def acquire(self, n: int) -> None:
        if n > self.total:
            raise ConfigurationError(f"{n} bytes can never fit a budget of {self.total}")
        await self._admit(n)

    def release(self, n: int) -> None:
        self._release(n)

    def resize(self, total: int) -> None:
        """A new total; bytes held now count against it. Waiters that can never fit fail."""
        self.free += total - self.total
        self.total = total
        self._fail_waiters(
            lambda n: ConfigurationError(f"{n} bytes can never fit a budget of {total}") if n > total else None
        )
        self._wake()


class Slots(FifoAdmission):
    """An asyncio semaphore (FIFO) whose size can change while it is in use: calls admitted
    now count against a new ``max_concurrent``, and raising it lets waiters in at once."""

    def __init__(self, total: int) -> None:
        super().__init__()
        self.total = total
        self.used = 0

    def _fits(self, n: int) -> bool:
        return self.used < self.total

    def _take(self, n: int) -> None:
        self.used += 1

    def _give(self, n: int) -> None:
        self.used -= 1

    async def acquire(self) -> None:
        await self._admit(1)

    def acquire_now(self) -> bool:
        """``acquire`` if a slot is free now (True), without awaiting; else False, nothing taken."""
        return self.admit_now(1)

    def release(self) -> None:
        self._release(1)

    def resize(self, total: int) -> None:
        self.total = total
        self._wake()

    def take_back(self) -> None:
        """A lent slot (``SlotLoan``) back at once, without waiting: ``used`` may pass ``total``
        for a while, which only holds up the next admission."""
        self.used += 1


class SlotLoan:
    """The slot of one call being served, lent while its method waits for calls it made.

    Nodes whose methods call each other (A's method calls B, whose method calls A back) filled
    every slot of both with calls waiting for calls the other could not admit, and nothing moved
    until deadlines ran out: with 100 such calls each way and the default limits, all 200 failed,
    or without deadlines hung for good. A method waiting for its own calls (``lending``) gives
    its slot to the next request meanwhile, and takes it back the moment they end, without
    waiting: ``max_concurrent`` bounds the calls a node runs, not those waiting on other nodes,
    and a method never waits for a slot to go on (it may hold what the calls admitted meanwhile
    wait for)."""

    __slots__ = ("lent", "open", "slots")

    def __init__(self, slots: Slots) -> None:
        self.slots = slots
        self.lent = 0  # calls of its own the method waits for; the slot is lent while any does
        self.open = True

    def end(self) -> bool:
        """The call is over: whether its slot is held (to be released), rather than lent to a
        call that outlives it (made by a task the method started), which then keeps it."""
        self.open = False
        return self.lent == 0


class CallerRoom:
    """The room a served call's caller keeps for it, lent to one call back at a time.

    A caller keeps what its calls to one peer may leave unread within bounds (``_client._Budget``:
    at most 256 outstanding, a request each that may wait unread at the peer, a reply each that
    may wait unread here). Nodes whose methods all call back filled those: past 256 calls in
    flight each way, every method waited for room to call back behind calls that waited for
    those methods, and all ran out of their deadlines (260 each way: all 520). But a call being
    served has room kept for it at both ends that it does not use while its method runs: its
    request has been read here, and its final reply (a unary call's result, or the end of a
    stream, which comes after the last item and has a place of its own), which the caller has
    room for, is not sent yet. So one message each way fits there: the request of a call back to
    that caller (and its arguments after GO) where the final reply will go, and its reply where
    the request was. Such a call takes its place in this node's count at once, without waiting
    (``_Budget.ride``): what stays unread on the channel is still bounded by the callers'
    budgets, and the count may pass its limit only by such calls back, which hold up the next
    calls that wait. A stream back needs one place more here, for its final reply after an
    item: it rides only if that fits this node's own room for replies.

    One call back at a time: a second made meanwhile (by the method or a task it started) would
    be a second message each way, which nothing keeps room for, so it waits for whichever comes
    first, this room (``freed``, once the first has ended and nothing more comes for it) or a
    place among the 256. The method's calls back to its caller are then never held up by calls
    waiting for their own methods' calls back; only calls back that must run at the same time
    to end (one waits for what another does) still wait for a place. A call to another node has
    no room kept for it anywhere on its way (the request slot it needs at that node is held by
    no call of its chain), and waits as any call does."""

    __slots__ = ("_waiters", "busy", "channel", "open", "outlived")

    def __init__(self, channel: object) -> None:
        self.channel: object | None = channel  # the caller's: only a call back to it fits the room
        self.busy = False
        self.open = True  # its method runs: the final reply is not sent yet
        self.outlived: Callable[[], None] | None = None  # told if the call riding here outlives the method
        self._waiters: list[asyncio.Future[None]] = []

    def take(self, channel: object) -> bool:
        """Whether a call to ``channel`` made now rides on this room (then held until ``give``)."""
        if self.busy or not self.open or channel is not self.channel:
            return False
        self.busy = True
        return True

    def give(self) -> None:
        """The call that rode has ended and nothing more comes for it: the next may ride."""
        self.busy = False
        self._wake()

    def close(self) -> None:
        """The method ended (its final reply goes next): nothing more rides, and calls waiting
        for the room wait for a place alone. (Tasks the method started keep the context, not
        the room.) A call riding here still (cancelled, its answer being drained; a stream back
        left open; one made by a task that outlives the method) has lost the room it rode on,
        and ``outlived`` is told (``_client._Budget.ride``)."""
        self.open = False
        if self.busy and self.outlived is not None:
            self.outlived()
        # Copies of the method's context outlive the call (a cancelled timer's handle holds
        # one until its time comes, a task it started holds one): what they keep of the room
        # must not keep the caller's channel, and its peer, after the peer is gone
        self.channel = None
        self.outlived = None
        self._wake()

    def freed(self) -> asyncio.Future[None]:
        """Done when the room may be free (given back, or closed); try ``take`` again then.
        Every waiter is woken, and all but one wait again: a room has few (the calls back
        one method makes at once), and none is then missed."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        return fut

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)


_LOAN: contextvars.ContextVar[SlotLoan | None] = contextvars.ContextVar("tensorwire_rpc_loan", default=None)
_ROOM: contextvars.ContextVar[CallerRoom | None] = contextvars.ContextVar("tensorwire_rpc_room", default=None)


class _Serving:
    """``serving``'s block. Classes, not generators (``_blocks.block``), for ``serving`` and
    ``lending``: one of each runs per call made or served, and a generator's block costs ~0.5 us
    more. Like a ``block``, they leave the block's exception as it is."""

    __slots__ = ("_kept", "_loan", "_room", "_token")

    def __init__(self, loan: SlotLoan | None, room: CallerRoom | None) -> None:
        self._loan = loan
        self._room = room
        self._token: contextvars.Token[SlotLoan | None] | None = None
        self._kept: contextvars.Token[CallerRoom | None] | None = None

    def __enter__(self) -> None:
        self._token = _LOAN.set(self._loan)
        self._kept = _ROOM.set(self._room)

    def __exit__(self, *exc: object) -> None:
        assert self._token is not None and self._kept is not None
        _ROOM.reset(self._kept)
        _LOAN.reset(self._token)
        if self._room is not None:
            self._room.close()


def serving(loan: SlotLoan | None, room: CallerRoom | None = None) -> contextlib.AbstractContextManager[None]:
    """Run a served method in the block: the calls it makes lend ``loan`` (None: nothing to
    lend), and one at a time to its caller rides on ``room`` until the method ends (None: none)."""
    return _Serving(loan, room)


def call_back_room(channel: object) -> CallerRoom | None:
    """The room of the call being served here, if a call to ``channel`` made now is a call back
    to its caller made while its method runs (``CallerRoom``); else None. (Not taken yet.)"""
    room = _ROOM.get()
    return room if room is not None and room.open and room.channel is channel else None


class _NotLending:
    """``lending``'s block where no served method's slot is there to lend: nothing (shared)."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


class _Lending:
    """``lending``'s block for a call made by a method being served (see ``_Serving``)."""

    __slots__ = ("_loan",)

    def __init__(self, loan: SlotLoan) -> None:
        self._loan = loan

    def __enter__(self) -> None:
        loan = self._loan
        if loan.lent == 0:
            loan.slots.release()
        loan.lent += 1

    def __exit__(self, *exc: object) -> None:
        loan = self._loan
        loan.lent -= 1
        if loan.lent == 0 and loan.open:
            loan.slots.take_back()


_NOT_LENDING = _NotLending()


def lending() -> contextlib.AbstractContextManager[None]:
    """Around a call made here: if a method being served made it, that method's slot is lent
    until the call ends (``SlotLoan``). Anywhere else, nothing happens."""
    loan = _LOAN.get()
    if loan is None or not loan.open:
        return _NOT_LENDING
    return _Lending(loan)


def _signature(fn: Callable[..., Any]) -> inspect.Signature | None:
    try:
        return inspect.signature(fn, eval_str=True)  # string annotations read better evaluated
    except (TypeError, ValueError):
        return None
    except Exception:  # an annotation that does not evaluate here: keep its text
        return inspect.signature(fn)


def _unpartial(fn: Callable[..., Any]) -> Callable[..., Any]:
    """What a ``functools.partial`` (however nested) calls; anything else as it is."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return fn


def _callable_object(fn: Callable[..., Any]) -> bool:
    """An instance called through its class's ``__call__`` (not a function, method or class)."""
    return not (inspect.isroutine(fn) or inspect.isclass(fn)) and callable(fn)


class MethodRegistry(Mapping[str, Method]):
    """The methods one node offers, by name, with the node's CallLimits.

    ``node.method`` registers into it; ``node.methods`` is this object.
    """

    def __init__(self) -> None:
        self._methods: dict[str, Method] = {}
        self.home: asyncio.AbstractEventLoop | None = None  # the node's loop, once it has started
        self._limits = CallLimits()
        self.slots = Slots(self._limits.max_concurrent)
        self.budget = ByteBudget(self._limits.max_inflight_bytes)

    def __getitem__(self, name: str) -> Method:
        return self._methods[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._methods)

    def __len__(self) -> int:
        return len(self._methods)

    def __repr__(self) -> str:
        return f"<MethodRegistry {sorted(self._methods)} {self._limits}>"

    @property
    def limits(self) -> CallLimits:
        """The node's CallLimits: how many calls run at once and how many argument bytes they
        may hold (settable: new limits apply at once)."""
        return self._limits

    @limits.setter
    def limits(self, limits: CallLimits) -> None:
        """New limits apply at once: calls running now count against them, and requests waiting
        for a slot or for bytes go in as soon as the new limits leave room."""
        # (its slots and byte budget wake the calls waiting in them with futures of that loop)
        check_home(self.home, "node.methods.limits", done="set")
        if not isinstance(limits, CallLimits):
            raise ConfigurationError("limits must be a tensorwire.rpc.CallLimits")
        self._limits = limits
        self.slots.resize(limits.max_concurrent)
        self.budget.resize(limits.max_inflight_bytes)

    def arg_limit(self, method: Method) -> int:
        """The most argument bytes one call of ``method`` may carry here."""
        limit = self._limits.max_inflight_bytes
        if self._limits.max_arg_bytes is not None:
            limit = min(limit, self._limits.max_arg_bytes)
        if method.max_arg_bytes is not None:
            limit = min(limit, method.max_arg_bytes)
        return limit

    def register(self, fn: Callable[..., Any], name: str | None = None, *, max_arg_bytes: int | None = None) -> Method:
        """Offer ``fn`` as ``name`` (its ``__name__`` where None); ``node.method`` is the usual way."""
        check_home(self.home, "node.methods.register")  # (the node's loop serves calls from the registry)
        inner = _unpartial(fn)
        runs = fn
        if not (inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn)) and _callable_object(inner):
            # an object whose class declares ``async def __call__`` is as much an async function
            # as a bound method is (calling it runs none of its body either)
            runs = type(inner).__call__
        streaming = inspect.isasyncgenfunction(runs)
        if not (streaming or inspect.iscoroutinefunction(runs)):
            raise ConfigurationError(
                f"{getattr(fn, '__name__', fn)!r} is not an async function or async generator; "
                "RPC methods must be declared with 'async def'"
            )
        name = name if name is not None else getattr(fn, "__name__", None)
        if name is None:  # a partial or a callable object has no name of its own
            raise ConfigurationError(f"{fn!r} has no __name__: give the method a name, node.method('name')")
        if not isinstance(name, str) or not name or len(name) > 256:
            raise ConfigurationError("a method name is a non-empty string of at most 256 characters")
        try:
            name.encode()
        except UnicodeEncodeError:  # no call could name it, and ListMethods could not list it
            raise ConfigurationError(f"a method name must encode as UTF-8, not {safe_text(name)!r}") from None
        if name in self._methods:
            raise ConfigurationError(f"a method named {name!r} is already registered")
        if max_arg_bytes is not None:
            max_arg_bytes = check_int(f"max_arg_bytes of method {name!r}", max_arg_bytes, 0, _U64)
        sig = _signature(fn)
        named = {} if sig is None else sig.parameters
        var = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        clash = [k for k in RESERVED_KWARGS if k in named and named[k].kind not in var]
        if clash:
            raise ConfigurationError(
                f"method {name!r} takes a parameter named {clash[0]!r}, which peer.call keeps for itself "
                f"(its keywords {', '.join(RESERVED_KWARGS)})"
            )
        text = "(...)" if sig is None else str(sig.replace(return_annotation=inspect.Signature.empty))
        # a partial's own __doc__ is functools.partial's; an object's, its class's (else __call__'s)
        doc = inspect.getdoc(inner) or (inspect.getdoc(runs) if runs is not fn else None) or ""
        # both travel in ListMethods' strings, which must encode: lone surrogates escaped
        method = Method(name, fn, streaming, safe_text(text), safe_text(doc.split("\n\n", 1)[0]), max_arg_bytes)
        self._methods[name] = method
        return method

    def unregister(self, name: str) -> None:
        """Stop offering ``name``; calls already running finish."""
        check_home(self.home, "node.methods.unregister")
        if self._methods.pop(name, None) is None:
            raise ConfigurationError(f"no method named {name!r} is registered")

    def decorator(self, name: str | Callable[..., Any] | None = None, *, max_arg_bytes: int | None = None) -> Any:
        """``@node.method``, ``@node.method()`` or ``@node.method("name", max_arg_bytes=...)``."""
        if callable(name):
            self.register(name)
            return name

        def register(fn: F) -> F:
            self.register(fn, name, max_arg_bytes=max_arg_bytes)
            return fn

        return register


_REGISTRIES: weakref.WeakKeyDictionary[Node, MethodRegistry] = weakref.WeakKeyDictionary()


def methods_of(node: Node) -> MethodRegistry:
    """The registry of ``node`` (created on first use)."""
    reg = _REGISTRIES.get(node)
    if reg is None:
        reg = _REGISTRIES[node] = MethodRegistry()
    return reg
