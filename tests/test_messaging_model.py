"""A model-based test of two-sided messaging: random programs of sends and recvs between two
nodes, checked against what the README promises.

A program (drawn by hypothesis) is a list of operations on two peers joined over one transport
(tcp, inproc, ucx), with drawn limits (credit from none to 64 MiB, 3 or 1024 message slots,
64 KiB or 4 MiB payload frames): sends in either direction on two tags (tensors of eight dtypes,
none to 8 MiB, strided, transposed and reversed ones, pytrees with scalars, messages of no
tensors), recvs with and without ``out=``, each awaited, left running, cancelled after some loop
turns, later, or under a short ``asyncio.timeout`` or ``asyncio.wait_for``; then an ending:
every tag drained, or one side closed (with its sends under way cancelled first, or not) or
aborted. The model:

* a send that returned is received exactly once, with its bytes (after an abort: at most once);
  one that was cancelled or failed ("may have arrived") at most once, whole; one cancelled before
  its call began never; sent values are never altered afterwards (the sender overwrites its
  buffers once its send returned or raised);
* recvs posted on a tag take its messages in the order the sends were called, where no recv on
  the tag was cancelled (or refused its message) while another waited behind it (README: such a
  cancel may hand its message to the recv posted next);
* a cancelled recv loses nothing (its message comes to a later recv), and never writes into its
  ``out=`` after the cancel returned; a recv with ``out=`` returns ``out``'s own tensors, or
  raises ShapeMismatchError where a message does not fit it;
* receipts are honest: both ends of a message name the same protocol and size, the size counts
  the tensors' bytes, ``direct`` never with ``staged``, ``packed`` or ``inline``, a strided
  source is ``packed``, a received message never is, nor is a rendezvous one ``staged`` unless a
  recv before it was cancelled;
* after a drain, the receiver's credit and slots are all back with the sender (half the credit
  goes eager, and as many messages as there are slots, with no recv posted);
* after one side closes, what the other was sent before the close (the sends returned) is still
  received; the sends and recvs under way fail with ClosedResourceError on the side that closed
  and PeerDisconnected on the other, and so does a send begun after the close.

``TENSORWIRE_MODEL_EXPLORE=1`` draws fresh programs each run (CI runs the same ones),
``TENSORWIRE_MODEL_EXAMPLES`` and ``TENSORWIRE_MODEL_OPS=min,max`` size the search.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import io
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tensorwire import Peer, Receipt
from tensorwire.errors import ClosedResourceError, PeerDisconnected, ShapeMismatchError, TensorWireError
from tensorwire.testing import connected_pair
from tensorwire.testing._conformance import _same as same  # (bytewise, containers and their order)
from tensorwire.transports import Limits

MiB = 1 << 20
TAGS: tuple[str | int, ...] = ("m0", 41)
DIRECTIONS = ("ab", "ba")
DTYPES = ("uint8", "bool", "int16", "float16", "bfloat16", "float32", "int64", "complex128")
SENTINEL = "end"
# each example runs within this; a hang fails it, naming what waited
RUN_SECONDS = 45.0

_NO_UCXX = importlib.util.find_spec("ucxx") is None
TRANSPORTS = [
    pytest.param("tcp", id="tcp"),
    pytest.param("inproc", id="inproc"),
    pytest.param(
        "ucx",
        id="ucx",
        marks=pytest.mark.skipif(_NO_UCXX, reason="ucxx is not installed (pip install 'tensorwire[ucx]')"),
    ),
]
EXAMPLES = int(os.environ.get("TENSORWIRE_MODEL_EXAMPLES", "60"))
MIN_OPS, MAX_OPS = (int(n) for n in os.environ.get("TENSORWIRE_MODEL_OPS", "2,20").split(","))
# (set to explore: a fresh seed each run, where CI always runs the same examples)
EXPLORE = bool(os.environ.get("TENSORWIRE_MODEL_EXPLORE"))
STATS: dict[str, dict[str, int]] = {}
COVER: dict[str, int] = {}


# == programs ======================================================================================
@dataclass(frozen=True)
class Spec:
    """What a message holds: ``kind`` array, tree, list or scalars; its tensor's dtype, element
    count and layout (``c``, ``strided`` every other element, ``transposed``, ``reversed``)."""

    kind: str
    dtype: str
    elems: int
    layout: str


@dataclass(frozen=True)
class Send:
    direction: str
    tag: str | int
    spec: Spec
    # wait (up to 0.2 s, then left running), bg, cancel (after `arg` loop turns), timeout (under
    # ``asyncio.timeout(arg)``), wait_for (``asyncio.wait_for(..., arg)``)
    how: str
    arg: float


@dataclass(frozen=True)
class Recv:
    direction: str
    tag: str | int
    out: bool
    how: str
    arg: float


@dataclass(frozen=True)
class Turns:
    n: int


@dataclass(frozen=True)
class CancelLater:
    """Cancel the oldest send (or recv) of ``direction`` still under way, if any: a cancel at
    whatever point it has reached (mid-payload, waiting for credit or for its message)."""

    direction: str
    sends: bool


@dataclass(frozen=True)
class Program:
    ops: tuple[Send | Recv | Turns | CancelLater, ...]
    ending: str  # drain, close-a (a closes first: b drains what a sent), close-b
    credit: int  # the receiver's recv_buffer_bytes
    slots: int  # its max_unexpected
    chunk: int  # the payload frames' size


def _elems(nbytes: int, itemsize: int) -> int:
    return nbytes // itemsize


SIZES = st.one_of(
    st.sampled_from([0, 1, 8, 100]),
    st.integers(1, 4096),
    st.integers(4096, 300 * 1024),
    st.integers(300 * 1024, 2 * MiB),
    st.sampled_from([4 * MiB, 8 * MiB]),
)
HOWS = st.sampled_from(["wait", "wait", "bg", "cancel", "timeout", "wait_for"])


@st.composite
def specs(draw: st.DrawFn) -> Spec:
    dtype = draw(st.sampled_from(DTYPES))
    nbytes = draw(SIZES)
    itemsize = np.dtype(_dtype(dtype)).itemsize
    return Spec(
        kind=draw(st.sampled_from(["array", "array", "tree", "list", "scalars"])),
        dtype=dtype,
        elems=_elems(nbytes, itemsize),
        layout=draw(st.sampled_from(["c", "c", "strided", "transposed", "reversed"])),
    )


def _arg(draw: st.DrawFn, how: str) -> float:
    if how == "cancel":
        return draw(st.integers(0, 30))
    if how in ("timeout", "wait_for"):
        return draw(st.sampled_from([0.0, 0.0005, 0.002, 0.01, 0.05]))
    return 0


@st.composite
def operations(draw: st.DrawFn) -> Send | Recv | Turns | CancelLater:
    what = draw(st.sampled_from(["send", "send", "send", "recv", "recv", "recv", "turns", "cancel"]))
    if what == "turns":
        return Turns(draw(st.one_of(st.integers(0, 20), st.just(-1))))  # -1: 5 ms of wall time
    if what == "cancel":
        return CancelLater(draw(st.sampled_from(DIRECTIONS)), draw(st.booleans()))
    direction, tag, how = draw(st.sampled_from(DIRECTIONS)), draw(st.sampled_from(TAGS)), draw(HOWS)
    if what == "send":
        return Send(direction, tag, draw(specs()), how, _arg(draw, how))
    return Recv(direction, tag, draw(st.sampled_from([True, True, False])), how, _arg(draw, how))


PROGRAMS = st.builds(
    Program,
    ops=st.lists(operations(), min_size=MIN_OPS, max_size=MAX_OPS).map(tuple),
    ending=st.sampled_from(
        ["drain", "drain", "close-a", "close-b", "close-a-busy", "close-b-busy", "abort-a", "abort-b"]
    ),
    credit=st.sampled_from([64 * MiB, 1 * MiB, 256 * 1024, 0]),
    slots=st.sampled_from([1024, 1024, 3]),
    chunk=st.sampled_from([4 * MiB, 4 * MiB, 64 * 1024]),
)


# == messages ======================================================================================
def _dtype(name: str) -> Any:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _tensor(spec: Spec, rng: np.random.Generator) -> np.ndarray:
    dt = _dtype(spec.dtype)
    n = spec.elems
    if spec.layout == "strided":
        n *= 2
    raw = rng.integers(0, 256, size=n * dt.itemsize, dtype=np.uint8)
    if dt == np.bool_:
        raw &= 1
    flat = raw.view(dt)
    if spec.layout == "strided":
        return flat[::2]
    if spec.layout == "reversed":
        return flat[::-1]
    if spec.layout == "transposed" and spec.elems % 2 == 0 and spec.elems > 2:
        return flat.reshape(2, spec.elems // 2).T
    return flat.reshape(1, spec.elems) if spec.layout == "transposed" else flat


def message(spec: Spec, ident: int) -> Any:
    """The value a send of ``spec`` carries, told apart from every other by ``ident``."""
    rng = np.random.default_rng(ident)
    if spec.kind == "array" and spec.elems >= 8:  # (a small array alone could equal another)
        t = _tensor(spec, rng)
        return t
    if spec.kind == "list":
        return [ident, _tensor(spec, rng), np.arange(3, dtype=np.int32) + ident]
    if spec.kind == "scalars":
        return {"id": ident, "s": f"m{ident}", "b": bytes([ident % 256]) * 3, "f": 0.5, "n": None, "t": True}
    return {"id": ident, "x": _tensor(spec, rng), "e": np.zeros((0, 2), np.float32), "pair": (1, "two")}


def tensors_of(value: Any) -> list[np.ndarray]:
    if isinstance(value, np.ndarray):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors_of(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors_of(v)]
    return []


def out_for(value: Any) -> Any:
    """A recv's out= for a message shaped like ``value`` (scalars kept), filled with a pattern."""
    if isinstance(value, np.ndarray):
        out = np.empty(value.shape, value.dtype)
        out.view(np.uint8).reshape(-1)[:] = 0xA5
        return out
    if isinstance(value, dict):
        return {k: out_for(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(out_for(v) for v in value)
    return value


def fits(out: Any, value: Any) -> bool:
    """Whether ``out`` can take ``value`` (README, ``out=``: same containers, a list for a tuple
    or the other way round, dict keys in order, tensors of its dtypes and shapes where it has them)."""
    if isinstance(value, np.ndarray):
        return isinstance(out, np.ndarray) and out.dtype == value.dtype and out.shape == value.shape
    if isinstance(value, dict):
        return isinstance(out, dict) and list(out) == list(value) and all(fits(out[k], value[k]) for k in value)
    if isinstance(value, (list, tuple)):
        return (
            isinstance(out, (list, tuple))
            and len(out) == len(value)
            and all(fits(o, v) for o, v in zip(out, value, strict=True))
        )
    return not isinstance(out, (np.ndarray, dict, list, tuple))


# == running a program =============================================================================
@dataclass
class SendRecord:
    ident: int
    direction: str
    tag: str | int
    value: Any  # a copy of what was sent
    src: Any  # what was handed to send
    status: str = "pending"  # ok, maybe (cancelled or failed), never (cancelled before it began), pending
    receipt: Receipt | None = None
    error: BaseException | None = None
    task: asyncio.Future[None] | None = None


@dataclass
class RecvRecord:
    index: int
    direction: str
    tag: str | int
    out: Any
    status: str = "pending"  # ok, cancelled, mismatch, error, never (cancelled before it began), pending
    value: Any = None
    receipt: Receipt | None = None
    error: BaseException | None = None
    after_cancel: list[bytes] = field(default_factory=list)  # out='s bytes as the cancel returned
    others_waiting: bool = False  # (cancelled or refused while another recv on its tag waited)
    task: asyncio.Future[None] | None = None
    ended_by_drain: bool = False  # (cancelled once the sentinel came: nothing was left for it)


class Run:
    def __init__(self, program: Program, a: Peer, b: Peer) -> None:
        self.program = program
        self.peers = {"ab": (a, b), "ba": (b, a)}
        self.sends: list[SendRecord] = []
        self.recvs: list[RecvRecord] = []
        self.closed: set[str] = set()  # directions whose receiver closed
        self.sentinels: list[asyncio.Future[Any]] = []
        self.late: list[str] = []  # what the sends after a close did wrong
        self.log: list[str] = []
        self.counts = {"ops": 0, "sends": 0, "recvs": 0, "cancels": 0, "bytes": 0}

    # -- the operations ----------------------------------------------------------------------
    async def _send(self, rec: SendRecord) -> None:
        sender = self.peers[rec.direction][0]
        try:
            rec.receipt = await sender.send(rec.src, tag=rec.tag)
        except asyncio.CancelledError:
            rec.status = "maybe"
            _clobber(rec.src)
            raise
        except TensorWireError as exc:
            rec.status, rec.error = "maybe", exc
            _clobber(rec.src)
            return
        rec.status = "ok"
        _clobber(rec.src)

    async def _recv(self, rec: RecvRecord) -> None:
        receiver = self.peers[rec.direction][1]
        try:
            rec.value, rec.receipt = await receiver.recv_with_receipt(tag=rec.tag, out=rec.out)
        except asyncio.CancelledError:
            rec.status = "cancelled"
            rec.others_waiting = self._waiting_behind(rec)
            rec.after_cancel = [t.tobytes() for t in tensors_of(rec.out)]
            raise
        except ShapeMismatchError as exc:
            rec.status, rec.error = "mismatch", exc
            rec.others_waiting = self._waiting_behind(rec)
            return
        except TensorWireError as exc:
            rec.status, rec.error = "error", exc
            return
        rec.status = "ok"

    def _waiting_behind(self, rec: RecvRecord) -> bool:
        return any(
            r.direction == rec.direction and r.tag == rec.tag and r.index != rec.index and r.status == "pending"
            for r in self.recvs
        )

    async def _run_how(self, coro: Any, how: str, arg: float, rec: SendRecord | RecvRecord) -> asyncio.Future[None]:
        task = asyncio.ensure_future(coro)

        def unstarted(task: asyncio.Future[None]) -> None:  # cancelled before its call began
            if rec.status == "pending":
                rec.status = "never"

        task.add_done_callback(unstarted)
        if how == "wait":
            await asyncio.wait({task}, timeout=0.2)
        elif how == "cancel":
            for _ in range(int(arg)):
                await asyncio.sleep(0)
            if not task.done():
                self.counts["cancels"] += 1
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        elif how == "timeout":  # as a caller writes it: the timeout cancels the call
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(arg):
                    await task
            if task.cancelled():
                self.counts["cancels"] += 1
        elif how == "wait_for":
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(task, arg)
            if task.cancelled():
                self.counts["cancels"] += 1
        return task

    def _guess_out(self, op: Recv) -> Any:
        """The out= of a recv: shaped as the message it should take, as far as one can tell: the
        first one sent on its tag that no recv took and that the recvs pending before it leave
        (or else the program's next send there), so that most fit and some do not."""
        if not op.out:
            return None
        key = (op.direction, op.tag)
        waiting = sum(1 for r in self.recvs if (r.direction, r.tag) == key and r.status == "pending")
        left = [s for s in self.sends if (s.direction, s.tag) == key and s.status in ("ok", "pending")]
        left = [s for s in left if not any(same(s.value, v) for v in taken_values(self, key))]
        if waiting < len(left):
            shape = left[waiting].value
        else:
            later = [o for o in self.program.ops[self.counts["ops"] :] if isinstance(o, Send)]
            later = [o for o in later if (o.direction, o.tag) == key]
            if not later:
                return None
            shape = message(later[0].spec, 0)
        return out_for(shape) if tensors_of(shape) else None

    async def op(self, op: Send | Recv | Turns | CancelLater) -> None:
        self.counts["ops"] += 1
        if isinstance(op, Turns):
            if op.n < 0:
                await asyncio.sleep(0.005)
            for _ in range(op.n):
                await asyncio.sleep(0)
            return
        if isinstance(op, CancelLater):
            records: list[SendRecord] | list[RecvRecord] = self.sends if op.sends else self.recvs
            going = [r for r in records if r.direction == op.direction and r.task is not None and not r.task.done()]
            self.log.append(f"{op}: {'cancels ' + type(going[0]).__name__ if going else 'nothing to cancel'}")
            if going:
                self.counts["cancels"] += 1
                going[0].task.cancel()  # type: ignore[union-attr]
                with contextlib.suppress(asyncio.CancelledError):
                    await going[0].task  # type: ignore[misc]
            return
        if isinstance(op, Send):
            ident = len(self.sends) + 1
            src = message(op.spec, ident)
            rec = SendRecord(ident, op.direction, op.tag, _copy(src), src)
            self.sends.append(rec)
            self.counts["sends"] += 1
            self.counts["bytes"] += sum(t.nbytes for t in tensors_of(src))
            self.log.append(f"send #{ident} {op}")
            rec.task = await self._run_how(self._send(rec), op.how, op.arg, rec)
            return
        rrec = RecvRecord(len(self.recvs), op.direction, op.tag, self._guess_out(op))
        self.recvs.append(rrec)
        self.counts["recvs"] += 1
        self.log.append(f"recv #{rrec.index} {op}")
        rrec.task = await self._run_how(self._recv(rrec), op.how, op.arg, rrec)

    # -- the ending --------------------------------------------------------------------------
    async def drain(self, direction: str, tag: str | int, closing: bool = False) -> None:
        """Receive on ``tag`` until the sentinel sent after every message came (recvs still
        pending take their messages first; those the sentinel leaves waiting are cancelled).
        ``closing``: its sender closes, and its sentinel may not have gone: then until the
        recvs fail (PeerDisconnected) more often in a row than messages there may be that
        did not arrive whole (each may fail the recv that takes it)."""
        key = (direction, tag)
        first_own = len(self.recvs)
        failed = 0  # the drain's own recvs that failed since one last got a message
        while True:
            mine = [r for r in self.recvs if (r.direction, r.tag) == key]
            pending = [r for r in mine if r.task is not None and not r.task.done()]
            unsure = sum(1 for s in self.sends if (s.direction, s.tag) == key and s.status != "ok")
            if any(r.status == "ok" and _is_sentinel(r.value) for r in mine) or failed > unsure + 1:
                for r in pending:
                    r.ended_by_drain = True
                    r.task.cancel()  # type: ignore[union-attr]
                    with contextlib.suppress(asyncio.CancelledError):
                        await r.task  # type: ignore[misc]
                return
            if not pending:
                rec = RecvRecord(len(self.recvs), direction, tag, None)
                self.recvs.append(rec)
                rec.task = asyncio.ensure_future(self._recv(rec))
                pending = [rec]
            done, _ = await asyncio.wait({r.task for r in pending if r.task}, return_when=asyncio.FIRST_COMPLETED)
            for r in pending:  # (one of the program's may fail once its peer closed; the drain's may not)
                if r.task not in done or r.index < first_own:
                    continue
                if r.status == "error" and not closing:
                    raise AssertionError(f"a recv draining {direction}/{tag} failed: {r.error!r}")
                failed = failed + 1 if r.status == "error" else 0

    async def probe(self, direction: str) -> None:
        """Once every message was received, the receiver's credit and message slots are all
        back with the sender, whatever was cancelled on the way: half the credit goes eager
        (without a recv posted), and so do as many small messages as there are slots."""
        sender, receiver = self.peers[direction]
        await receiver.send("sync", tag="sync")  # (carries the credit it owes back)
        await sender.recv(tag="sync")
        probes = []
        if 0 < self.program.credit <= MiB:
            probes.append(np.zeros(self.program.credit // 2, np.uint8))
        if self.program.slots <= 8:
            probes += [np.zeros(0, np.uint8)] * (self.program.slots - len(probes))  # (no bytes: no credit)
        for i, x in enumerate(probes):
            try:
                async with asyncio.timeout(5):
                    receipt = await sender.send(x, tag="probe")
            except TimeoutError:
                self.late.append(
                    f"{direction}: probe {i} of {len(probes)} ({x.nbytes} B) waited 5 s for credit or a slot"
                )
                return
            if receipt.protocol == "rendezvous":
                self.late.append(f"{direction}: probe {i} ({x.nbytes} B) went rendezvous: credit not all back")
        for x in probes:
            assert same(await sender_recv(receiver), x)

    async def ending(self) -> None:
        """``drain``: every tag of both directions received up to a sentinel sent after all.
        ``close-a`` (``-b``): that side's sends under way are cancelled, it sends its sentinels
        and closes; the other side then receives what it was sent. ``close-a-busy``: the same
        without the cancels, the other side receiving meanwhile, the close as soon as the
        sentinels' sends returned (sends still under way then fail with it). ``abort-a``: as
        ``close-a-busy`` with ``abort()``, 50 ms after the sentinels were sent, gone or not (then
        nothing need arrive, but what does arrives whole, once, in order)."""
        a, b = self.peers["ab"]
        ending = self.program.ending
        closer = {"a": "ab", "b": "ba"}.get(ending.split("-")[1]) if ending != "drain" else None
        aborts = ending.startswith("abort")
        busy = ending.endswith("-busy") or aborts
        for direction in DIRECTIONS:
            if direction == closer and not busy:
                # the closing side's sends under way give up: they may or may not have gone
                for rec in self.sends:
                    if rec.direction == direction and rec.task is not None and not rec.task.done():
                        rec.task.cancel()
                        with contextlib.suppress(asyncio.CancelledError):
                            await rec.task
            for tag in TAGS:
                self.sentinels.append(asyncio.ensure_future(self.peers[direction][0].send(SENTINEL, tag=tag)))
        if closer is None:  # (all at once: messages left on one tag may hold every slot a send on another waits for)
            await asyncio.gather(*(self.drain(direction, tag) for direction in DIRECTIONS for tag in TAGS))
            for rec in self.sends:
                if rec.task is not None and not rec.task.done():
                    await asyncio.wait({rec.task})
            for direction in DIRECTIONS:
                await self.probe(direction)
        else:
            mine = self.sentinels[:2] if closer == "ab" else self.sentinels[2:]
            drains = [asyncio.ensure_future(self.drain(closer, tag, closing=True)) for tag in TAGS] if busy else []
            self.sentinels += drains
            if aborts:
                await asyncio.wait(mine, timeout=0.05)
            elif busy:
                for sent in mine:
                    await sent  # (the other side receives meanwhile: they go)
            else:  # (the sentinels may wait for recvs to free message slots: those come after the close)
                await asyncio.wait(mine, timeout=0.5)
                for sent in mine:
                    sent.cancel()
            if aborts:
                (a if closer == "ab" else b).abort()
                self.closed.add(closer)  # (what its sends handed over may be lost with the connection)
            else:
                await (a if closer == "ab" else b).aclose()
            other = "ba" if closer == "ab" else "ab"
            self.closed.add(other)  # the closer receives no more of what the other side sent
            for rec in self.recvs:  # the closer's recvs under way ended with its close
                if rec.direction == other and rec.task is not None:
                    await asyncio.wait({rec.task})
            for tag in TAGS:
                if busy:
                    await drains[TAGS.index(tag)]
                else:
                    await self.drain(closer, tag, closing=True)
            # once closed, a send fails at once: ClosedResourceError on the side that closed,
            # PeerDisconnected on the other (README, Lifecycle)
            for peer, error in ((self.peers[closer][0], ClosedResourceError), (self.peers[other][0], PeerDisconnected)):
                if aborts:
                    break
                try:
                    async with asyncio.timeout(5):
                        await peer.send(np.zeros(3), tag="late")
                except error:
                    pass
                except (TensorWireError, TimeoutError) as exc:
                    self.late.append(f"a send after the close on {peer!r} raised {exc!r}, not {error.__name__}")
                else:
                    self.late.append(f"a send after the close on {peer!r} succeeded")
        for rec in self.sends:
            if rec.task is not None and not rec.task.done():
                await asyncio.wait({rec.task})
        outcomes = await asyncio.gather(*self.sentinels, return_exceptions=True)
        if any(isinstance(o, AssertionError) for o in outcomes):
            raise next(o for o in outcomes if isinstance(o, AssertionError))
        if closer is None and any(isinstance(o, BaseException) for o in outcomes):
            raise AssertionError(f"a sentinel's send failed: {outcomes}")


async def sender_recv(receiver: Peer) -> Any:
    async with asyncio.timeout(10):
        return await receiver.recv(tag="probe")


def taken_values(run: Run, key: tuple[str, str | int]) -> list[Any]:
    return [r.value for r in run.recvs if (r.direction, r.tag) == key and r.status == "ok"]


def _clobber(src: Any) -> None:
    """Overwrite a send's buffers as its caller may once it returned (or raised: a cancelled
    send that delivers its message has taken the bytes by then, README)."""
    for t in tensors_of(src):
        base = t.base if t.base is not None else t
        if isinstance(base, np.ndarray) and base.size:
            base.view(np.uint8).reshape(-1)[:] = 0x5A


def _copy(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_copy(v) for v in value)
    return value


def _is_sentinel(value: Any) -> bool:
    return isinstance(value, str) and value == SENTINEL


# == the model's verdict ===========================================================================
def verdict(run: Run) -> list[str]:
    """What the run broke of the model; empty if nothing."""
    wrong: list[str] = list(run.late)
    taken: dict[int, int] = {}  # send ident -> recv index
    closer = next((d for d in DIRECTIONS if d not in run.closed), None) if len(run.closed) == 1 else None
    for x in (*run.sends, *run.recvs):
        if x.error is None or isinstance(x.error, ShapeMismatchError) or closer is None:
            continue
        # the closer's own sends and recvs say it closed; the other side's that the peer went
        own = x.direction == closer if isinstance(x, SendRecord) else x.direction != closer
        expected = ClosedResourceError if own else PeerDisconnected
        if not isinstance(x.error, expected):
            wrong.append(
                f"{type(x).__name__} {x.direction}/{x.tag} at the close raised {x.error!r}, not {expected.__name__}"
            )
    for key in [(d, t) for d in DIRECTIONS for t in TAGS]:
        sends = [s for s in run.sends if (s.direction, s.tag) == key]
        recvs = [r for r in run.recvs if (r.direction, r.tag) == key]
        order: list[int] = []
        relaxed = any(r.others_waiting for r in recvs if r.status in ("cancelled", "mismatch") and not r.ended_by_drain)
        for r in recvs:
            if r.status == "mismatch":
                if r.out is None or all(fits(r.out, v) for v in [*(s.value for s in sends), SENTINEL]):
                    wrong.append(f"recv #{r.index} {key}: ShapeMismatchError, but every message fits its out=")
                continue
            if r.status == "error":
                if run.program.ending == "drain":  # (a close fails the recvs under way)
                    wrong.append(f"recv #{r.index} {key} failed: {r.error!r}")
                continue
            if r.status == "cancelled":
                later = [t.tobytes() for t in tensors_of(r.out)]
                if later != r.after_cancel:
                    wrong.append(f"recv #{r.index} {key}: its out= was written after its cancel returned")
                continue
            if r.status != "ok" or _is_sentinel(r.value):
                continue
            match = next((s for s in sends if s.ident not in taken and same(s.value, r.value)), None)
            if match is None:
                again = next((s for s in sends if same(s.value, r.value)), None)
                wrong.append(
                    f"recv #{r.index} {key} got a message received before "
                    f"(#{again.ident}, by recv #{taken[again.ident]})"
                    if again is not None
                    else f"recv #{r.index} {key} got a message nobody sent (corrupt?): {_brief(r.value)}"
                )
                continue
            taken[match.ident] = r.index
            order.append(match.ident)
            wrong += _receipts(r, match)
            given_back = any(x.status == "cancelled" and x.index < r.index for x in recvs)
            if r.receipt is not None and r.receipt.protocol == "rendezvous" and r.receipt.staged and not given_back:
                # (its payload moves once the recv is posted, straight into its buffer; only a
                # recv cancelled part way gives one back through a buffer of tensorwire's)
                wrong.append(f"recv #{r.index} {key}: a rendezvous message staged: {r.receipt}")
        if not relaxed and order != sorted(order):
            wrong.append(f"{key}: recvs in posting order took messages {order} (sent in increasing order)")
        for s in sends:
            if s.status == "never" and s.ident in taken:
                wrong.append(f"send #{s.ident} {key} was cancelled before its call began, and its message came")
            if s.status == "ok" and s.ident not in taken and key[0] not in run.closed:
                wrong.append(f"send #{s.ident} {key} returned, and its message never came")
            if s.status == "pending":
                wrong.append(f"send #{s.ident} {key} never ended")
    return wrong


def _receipts(r: RecvRecord, s: SendRecord) -> list[str]:
    wrong: list[str] = []
    got, sent = r.receipt, s.receipt
    assert got is not None
    where = f"send #{s.ident} -> recv #{r.index}: sent {sent}, received {got}"
    nbytes = sum(t.nbytes for t in tensors_of(s.value))
    if got.nbytes != nbytes:
        wrong.append(f"recv receipt counts {got.nbytes} bytes of {nbytes}: {where}")
    if sent is not None and (sent.protocol, sent.nbytes) != (got.protocol, got.nbytes):
        wrong.append(f"the two ends' receipts disagree: {where}")
    for rc in (sent, got):
        if rc is not None and rc.direct and (rc.staged or rc.packed or rc.protocol == "inline"):
            wrong.append(f"a receipt says direct beside staged, packed or inline: {where}")
    strided = any(not t.flags.c_contiguous and t.size > 1 for t in tensors_of(s.src))
    if sent is not None and sent.packed != strided:
        wrong.append(f"the send receipt says packed={sent.packed} of a {'strided' if strided else 'C'} source: {where}")
    if got.packed:
        wrong.append(f"a recv receipt says packed: {where}")
    if r.out is not None:
        outs, values = tensors_of(r.out), tensors_of(r.value)
        if len(outs) != len(values) or any(o is not v for o, v in zip(outs, values, strict=False)):
            wrong.append(f"recv #{r.index} with out= returned tensors that are not out's: {where}")
    if nbytes == 0 and got.staged:
        wrong.append(f"a message of no bytes was staged: {where}")
    return wrong


def outcomes(run: Run) -> str:
    lines = [
        f"  send #{s.ident} {s.direction}/{s.tag}: {s.status}"
        + (f" {s.receipt.protocol}" if s.receipt else "")
        + (f" {s.error!r}" if s.error else "")
        for s in run.sends
    ]
    lines += [
        f"  recv #{r.index} {r.direction}/{r.tag}: {r.status} {_brief(r.value) if r.status == 'ok' else ''}"
        + (f" {r.receipt.protocol}" if r.receipt else "")
        + (f" {r.error!r}" if r.error else "")
        for r in run.recvs
    ]
    return "\n".join(lines)


def _brief(value: Any) -> str:
    if isinstance(value, np.ndarray):
        return f"array {value.dtype} {value.shape}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_brief(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return type(value).__name__ + "(" + ", ".join(_brief(v) for v in value) + ")"
    return repr(value)[:40]


async def watched(coro: Any) -> Run:
    """``coro``, failed with every task's stack where it outlasts RUN_SECONDS by 30 s (a hang
    outside the program's own timeout: a close, a task that ignores its cancel)."""
    loop = asyncio.get_running_loop()
    main = asyncio.ensure_future(coro)
    stacks: list[str] = []

    def dump() -> None:
        for task in asyncio.all_tasks(loop):
            out = io.StringIO()
            task.print_stack(limit=25, file=out)
            stacks.append(f"{task!r}\n{out.getvalue()}")
        main.cancel()

    handle = loop.call_later(RUN_SECONDS + 30, dump)
    try:
        return await main
    except asyncio.CancelledError:
        raise AssertionError("hung:\n" + "\n".join(stacks)) from None
    finally:
        handle.cancel()


async def run_program(transport: str, program: Program) -> Run:
    limits = Limits(recv_buffer_bytes=program.credit, max_unexpected=program.slots, chunk_bytes=program.chunk)
    async with connected_pair(transport, limits=limits) as (a, b):
        run = Run(program, a, b)
        try:
            async with asyncio.timeout(RUN_SECONDS):
                for op in program.ops:
                    await run.op(op)
                await run.ending()
        except TimeoutError:
            waiting = [f"send #{s.ident} {s.direction}/{s.tag}" for s in run.sends if s.status == "pending"]
            waiting += [f"recv #{r.index} {r.direction}/{r.tag}" for r in run.recvs if r.status == "pending"]
            raise AssertionError(
                f"the program hung {RUN_SECONDS} s; waiting: {waiting}\n" + "\n".join(run.log) + "\n" + outcomes(run)
            ) from None
        finally:
            tasks = [x.task for x in (*run.sends, *run.recvs) if x.task is not None] + run.sentinels
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return run


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_random_programs_keep_the_messaging_promises(transport: str) -> None:
    stats = STATS.setdefault(transport, {"examples": 0, "ops": 0, "sends": 0, "recvs": 0, "cancels": 0, "bytes": 0})

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=not EXPLORE,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(PROGRAMS)
    def check(program: Program) -> None:
        if EXPLORE:
            # (the program under way, to replay one that hangs the process)
            Path(tempfile.gettempdir(), f"tensorwire-model-{transport}.txt").write_text(repr(program))
        run = asyncio.run(watched(run_program(transport, program)))
        stats["examples"] += 1
        for k, v in run.counts.items():
            stats[k] += v
        wrong = verdict(run)
        if EXPLORE:
            for x in run.sends:
                k = f"send:{x.status}:{x.receipt.protocol if x.receipt else ''}"
                COVER[k] = COVER.get(k, 0) + 1
            for r in run.recvs:
                k = f"recv:{r.status}:{'out' if r.out is not None else ''}:{r.receipt.protocol if r.receipt else ''}"
                COVER[k] = COVER.get(k, 0) + 1
        assert not wrong, (
            "\n".join(wrong)
            + "\nprogram:\n"
            + "\n".join(run.log)
            + f"\nending {program.ending}, credit {program.credit}, slots {program.slots}, chunk {program.chunk}\n"
            + "outcomes:\n"
            + outcomes(run)
        )

    check()
    print(f"{transport}: {stats}")
    if EXPLORE:
        print(sorted(COVER.items()))
