"""One UCX context and worker per node, progressed from the asyncio loop.

Blocking progress mode: the worker's epoll descriptor is registered with ``loop.add_reader``;
after every burst of progress the worker is *armed* (``ucp_worker_arm``) so that the next event
wakes the loop. While requests that expect to finish soon are in flight (sends, payload
receives, one-sided operations) the loop keeps progressing between its other callbacks for a
short while, then arms and falls back to a 1 ms timer; when only passive receives are posted
(the per-channel header receive, the hello receive) nothing runs until the descriptor fires, so
an idle node costs no CPU.

Importing ucxx edits ``os.environ`` (it sets UCX_MEMTYPE_CACHE, UCX_RNDV_THRESH and others).
tensorwire restores the environment right after that import and passes the options it wants to
the UCX context directly, so using the ucx transport never leaves the environment changed. Where
something else imported ucxx first, its values are already in the environment; tensorwire tells
them from the user's own and keeps them out of its contexts (see :func:`import_ucxx`).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import ctypes
import functools
import logging
import os
import re
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterator, Mapping
from pathlib import Path
from typing import Any

from ..._loops import Pledge
from ...errors import ClosedResourceError, ConfigurationError, TensorWireError, TransportUnavailable
from ._process import ProcessId, cpus_of, gone, this_cpu, waiting_on
from ._ucp import UCS_INPROGRESS, UCS_OK, CompletingUcp, Ucp, load, quiet

log = logging.getLogger(__name__)

__all__ = ["RawRecv", "Worker", "context_cuda_support", "context_resources", "import_ucxx", "ucx_config", "ucx_options"]

# Options every tensorwire UCX context gets, unless the caller says otherwise: ucx_config() or a
# node's ucx_options, or a UCX_* environment variable of the same name.
# MEMTYPE_CACHE=n: UCX learns that an address is CUDA memory from its memory-type cache, which is
# filled by intercepting CUDA allocations; an allocation it missed (a driver entry point reached
# through cuGetProcAddress, a statically linked runtime) is then taken for host memory. UCX's own
# GPU notes and ucx-py's configuration page list it; each send and receive then asks the driver
# instead. ucxx sets UCX_MEMTYPE_CACHE=n in the environment on import, but libucs has read its
# global options by then, so that edit does nothing (and tensorwire undoes it); this option, set
# through the context's config, is what turns the cache off (UCS keeps it process-wide).
_BASE_OPTIONS: dict[str, str] = {"WARN_UNUSED_ENV_VARS": "n", "MEMTYPE_CACHE": "n"}
_OPTIONS: contextvars.ContextVar[tuple[tuple[str, str], ...]] = contextvars.ContextVar(
    "tensorwire_ucx_options", default=()
)
_SPIN_ACTIVE = 0.002  # keep progressing this long after UCX last made progress
_SPIN_IDLE = 250e-6  # and this long after an operation was posted or completed (latency)
# Spinning with nothing to do, the loop looks this often whether the process of a peer on this
# machine waits for this very CPU (at most _LOOK_PEERS of them a look, ~8 us each), and gives the
# CPU up to it (sched_yield) if so: two processes that share a CPU otherwise answer each other
# only when the spinner is preempted (every operation took about 4 ms; see docs/ucx.md). Only for
# a peer's process: a yield to any other process that wants the CPU made a busy neighbour cost
# every call 4 ms. Not before _YIELD_AFTER of idle spinning (a quick answer from another CPU
# pays no look), and never while UCX moves anything. A peer whose affinity leaves this CPU out
# (read again every _AFFINITY_AGE) is not looked at: processes pinned apart pay no /proc reads.
_YIELD_AFTER = 50e-6
_LOOK_EVERY = 200e-6
_LOOK_PEERS = 4
_AFFINITY_AGE = 1.0
_FALLBACK = 0.001  # poll period while armed with work in flight (a missed wake-up costs at most this)
_ROUNDS = 64  # progress rounds per loop callback before yielding to the loop
# and at most this long: a round of a cma transfer copies 512 KiB (UCX's CMA_SEG_SIZE), 0.1 ms
# into warm pages and up to 2.5 ms into pages never touched, so 64 rounds held the loop 0.1-0.15 s
# here, and the loop's other callbacks come only after the next run or two (0.4 s gaps); a turn
# of the loop between runs costs tens of microseconds, 1% of this
_BURST = 0.005
# While UCX moves bytes round after round and nothing has reported a completion (a raw request's
# callback, an operation just posted), the requests that can only be asked (a message's payload
# receives, ucxx's requests) are looked at once per this long, not after every round: a
# look (``_dispatch``) took 5 us here, and a cma transfer's 512 KiB rounds ~60 us, so looking
# after each cost 12% of a 16 MiB receive (240 us of 2.2 ms). A transfer's own end is seen at
# once all the same (the round after its last moves nothing, and is looked at); another request
# that ends while a large one moves is seen up to this much later.
_LOOK_MOVING = 200e-6
# UCX refuses to arm (work pending) yet has moved nothing for this long: stop spinning (poll every
# _FALLBACK) and say so. A peer may be stalled; or one that died in the middle of a send over
# shared memory has left a FIFO slot it claimed unwritten, which blocks this worker's shared-memory
# receive queue for good (see docs/ucx.md)
_STALL = 5.0
_INLINE_ROUNDS = 4  # progress rounds a one-sided operation spends inline before going async
# While sends of closed channels wait in the graveyard for UCX: how often to look whether their
# peers' processes have ended (a /proc read per such peer), and how often at most to warn of the
# payloads held for sends UCX never completed (only when they have grown since)
_SWEEP = 1.0
_WARN_EVERY = 60.0
# the raw requests (watch_raw's ``what``) that send from their ``keep``; keep_raw's are payload sends
_SENDS = frozenset({"ucx payload send", "ucx control send", "ucx goodbye"})
# What UCX reports of a close tensorwire made right (see close_endpoint, _release): the failed
# flush of an endpoint whose peer is gone, requests to such a peer left in a destroyed worker
_CLOSING_FLUSH = frozenset({b"flush.c"})
_DESTROY_LEAKS = frozenset({b"mpool.c", b"rcache.c"})
_ALREADY_CLOSED = frozenset({b"ucp_ep.c"})
_CANCELED = -16  # UCS_ERR_CANCELED: a payload receive the worker's shutdown took back

_import_lock = threading.RLock()
# What importing ucxx puts into os.environ where the variable is unset (ucxx/__init__.py, 0.4x-0.52;
# PROTO_ENABLE only for UCX 1.12-1.17, CUDA_COPY_MAX_REG_RATIO only on some GPUs)
_UCXX_IMPORT_DEFAULTS: dict[str, str] = {
    "UCX_MEMTYPE_CACHE": "n",
    "UCX_RNDV_THRESH": "8192",
    "UCX_RNDV_FRAG_MEM_TYPE": "cuda",
    "UCX_MAX_RNDV_RAILS": "1",
    "UCX_PROTO_ENABLE": "n",
    "UCX_CUDA_COPY_MAX_REG_RATIO": "1.0",
}
_libucxx: Any = None
# ucxx's import-time values found in the environment when ucxx had been imported before tensorwire
# first needed it: not the user's choice, so hidden from the contexts tensorwire creates
_leftovers: frozenset[str] = frozenset()


def import_ucxx() -> Any:
    """Import ucxx's binding module, undoing the environment edits ucxx makes on import.

    Where ucxx was imported earlier (by dask, RAPIDS, the program itself), its edits are already in
    the environment and look like the user's. A variable is taken for ucxx's when it holds exactly
    the value ucxx sets and the process did not start with it (``/proc/self/environ``); such
    variables are hidden while tensorwire creates a UCX context (``_without_leftovers``). A user
    who wants one of those values passes it with ``ucx_config()`` or a node's ``ucx_options``.
    """
    global _libucxx, _leftovers
    with _import_lock:
        if _libucxx is not None:
            return _libucxx
        earlier = "ucxx" in sys.modules
        before = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}
        try:
            from ucxx._lib import libucxx
        finally:
            after = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}
            for k, v in after.items():
                if before.get(k) != v:
                    if k in before:
                        os.environ[k] = before[k]
                    else:
                        del os.environ[k]
                    log.debug("ucxx set %s=%s on import; restored", k, v)
        if earlier:
            _leftovers = _ucxx_leftovers(before, _initial_environment())
            if _leftovers:
                log.info(
                    "ucxx was imported before tensorwire and left %s in the environment; tensorwire's "
                    "UCX contexts do not take them (pass them with ucx_config() to keep them)",
                    ", ".join(f"{k}={before[k]}" for k in sorted(_leftovers)),
                )
        _libucxx = libucxx
    return libucxx


def _ucxx_leftovers(env: Mapping[str, str], initial: Mapping[str, str] | None) -> frozenset[str]:
    """The variables of ``env`` that ucxx's import put there: ucxx's exact value, and not in the
    environment the process started with (``initial``; None where it cannot be read)."""
    return frozenset(
        k for k, v in _UCXX_IMPORT_DEFAULTS.items() if env.get(k) == v and (initial is None or initial.get(k) != v)
    )


def _initial_environment() -> dict[str, str] | None:
    """The environment this process was started with: ``os.environ`` edits (putenv) never reach
    the block the kernel shows in /proc/self/environ."""
    try:
        raw = Path("/proc/self/environ").read_bytes()
    except OSError:
        return None
    pairs = (os.fsdecode(item).partition("=") for item in raw.split(b"\0") if item)
    return {k: v for k, _, v in pairs}


def _leftovers_now() -> list[str]:
    """ucxx's leftovers still in the environment with ucxx's value (one changed since is the user's)."""
    return [k for k in _leftovers if os.environ.get(k) == _UCXX_IMPORT_DEFAULTS[k]]


@contextlib.contextmanager
def _without_leftovers() -> Iterator[None]:
    """While a UCX context and worker are created: ucxx's leftovers hidden from the environment
    (UCX reads UCX_* variables then), put back right after. Holds the import lock."""
    with _import_lock:
        hidden = {k: os.environ.pop(k) for k in _leftovers_now()}
        try:
            yield
        finally:
            for k, v in hidden.items():
                os.environ.setdefault(k, v)


@contextlib.contextmanager
def ucx_config(**options: str) -> Iterator[None]:
    """UCX options (``TLS="tcp"``, ``RNDV_THRESH="16k"``, ...) for nodes started inside this block.

    Keys are UCX configuration names without the ``UCX_`` prefix; they are passed to the UCX
    context when a node's ucx transport starts, never through the environment. Environment
    variables the user set (``UCX_TLS=...``) still apply where no option overrides them.
    """
    for k, v in options.items():
        if k.startswith("UCX_"):  # (this said "pass TLS='...' as a string" of a string)
            raise ConfigurationError(f"ucx_config takes names without the UCX_ prefix: {k[4:]}={v!r}, not {k}")
        if not isinstance(v, str) or "\0" in v:
            raise ConfigurationError(f"ucx_config: pass {k}='...' as a string (without NUL), not {v!r}")
    token = _OPTIONS.set(tuple(sorted({**dict(_OPTIONS.get()), **options}.items())))
    try:
        yield
    finally:
        _OPTIONS.reset(token)


def chosen_options() -> dict[str, str]:
    """The UCX options set on purpose here and now: the node's ``ucx_options`` and enclosing
    :func:`ucx_config` blocks (not tensorwire's defaults, nor ``UCX_*`` variables)."""
    return dict(_OPTIONS.get())


def ucx_options() -> dict[str, str]:
    """The UCX options a context created here and now would get (on top of UCX_* variables)."""
    env = set(os.environ).difference(_leftovers_now())
    base = {k: v for k, v in _BASE_OPTIONS.items() if f"UCX_{k}" not in env}
    return {**base, **dict(_OPTIONS.get())}


_RESOURCE = re.compile(r"resource\s+\d+\s*:\s*md\s+\d+\s+dev\s+\d+\s+flags\s+\S+\s+(\S+)/(\S+)")


@functools.lru_cache(maxsize=16)
def _context_facts(options: tuple[tuple[str, str], ...]) -> tuple[tuple[tuple[str, str], ...], bool]:
    lib = import_ucxx()
    with _without_leftovers():
        ctx = lib.UCXContext(dict(options), feature_flags=(lib.Feature.TAG,))
    try:
        resources = tuple(dict.fromkeys((m.group(1), m.group(2)) for m in _RESOURCE.finditer(ctx.info)))
        return resources, bool(getattr(ctx, "cuda_support", False))
    finally:
        del ctx


def context_resources(options: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
    """(transport, device) pairs a UCX context with ``options`` can use on this machine."""
    return _context_facts(options)[0]


def context_cuda_support(options: tuple[tuple[str, str], ...]) -> bool:
    """Whether ucxx will post device buffers with a context of ``options``: its TLS must not
    leave out cuda/cuda_copy (ucxx refuses device buffers otherwise, with a ValueError, even
    where UCX lists a cuda transport). Not whether UCX has CUDA: ucxx 0.52's memory-type test
    reads the host bit (``memory_types & UCS_MEMORY_TYPE_CUDA``, a bitmap tested with the enum
    value 1), so it is true without any cuda transport; the caller also needs a cuda lane among
    ``context_resources``."""
    return _context_facts(options)[1]


class _Watch:
    __slots__ = ("callback", "keep", "owner", "passive")

    def __init__(self, callback: Callable[..., None], keep: object, owner: object, passive: bool) -> None:
        self.callback = callback
        self.keep = keep  # buffers UCX reads or writes until the request completes
        self.owner = owner
        self.passive = passive


class _Group:
    """Requests watched together (``Worker.watch_each``): a dispatch looks at the first one not
    yet reported (``at``) and, where it has completed, reports it and those after it that have,
    in order; never at the others. ``reqs`` and ``keeps`` drop each one reported, as ``_watch``
    drops its entry."""

    __slots__ = ("at", "callback", "keeps", "owner", "reqs")

    def __init__(self, reqs: list[Any], keeps: list[object], callback: Callable[[Any], None], owner: object) -> None:
        self.reqs = reqs
        self.keeps = keeps  # the buffers UCX writes through each request until it completes
        self.callback = callback
        self.owner = owner
        self.at = 0


class _Wait:
    """A ``when_done`` wait: ``reqs[:at]`` have completed (a request never goes back)."""

    __slots__ = ("at", "callback", "reqs")

    def __init__(self, reqs: list[Any], callback: Callable[[], None]) -> None:
        self.reqs = reqs
        self.callback = callback
        self.at = 0


class RawRecv:
    """A payload's tag receive posted through the libucp bindings (``Worker.payload_recv``): to
    the worker's watches (``watch_each``, ``when_done``, ``hold``, ``cancel``) a request as
    ucxx's are, and it says how many bytes came (``length``), which a ucxx request does not: a
    message shorter than the buffer completes a tag receive without error (UCX fails only a
    longer one, truncated).

    ``completed`` asks UCX, on the loop's thread, until the receive has completed; then it reads
    its status and length and frees the request. From then on (and once the worker has shut,
    which takes back every receive still posted) it answers from those, asking nothing."""

    __slots__ = ("_ptr", "_worker", "length", "nbytes", "status")

    def __init__(self, worker: Worker, ptr: int | None, nbytes: int, status: int, length: int = 0) -> None:
        self._worker = worker
        self._ptr = ptr  # the request, until its completion has been seen (None: no request)
        self.nbytes = nbytes  # the buffer's size
        self.status = status  # UCS_INPROGRESS until completed; then UCS_OK or its error
        self.length = length  # the bytes that came (once completed with UCS_OK)

    @property
    def completed(self) -> bool:
        ptr = self._ptr
        if ptr is None:
            return True
        w = self._worker
        ucp = w._ucp
        status = ucp.recv_test(ptr)
        if status == UCS_INPROGRESS:
            return False
        if status == UCS_OK:
            self.length = ucp.tested_length()
        self.status = status
        self._ptr = None
        del w._payload_recvs[ptr]
        ucp.free_unpolled(ptr)
        return True

    @property
    def ended(self) -> bool:
        """Whether its completion has been seen, without asking UCX (from any thread)."""
        return self._ptr is None

    @property
    def cancelled(self) -> bool:
        """Whether it completed as cancelled (UCS_ERR_CANCELED): taken back before it matched,
        nothing written."""
        return self.completed and self.status == _CANCELED

    def cancel(self) -> None:
        """``ucp_request_cancel``: one that has not matched completes as cancelled at once; one
        whose message is arriving runs on to its end (and one that has completed stays as it
        is: UCX leaves a completed request alone)."""
        if self._ptr is not None:
            w = self._worker
            w._ucp.cancel_raw(w.handle, self._ptr)


class Worker:
    """A node's UCX context and worker, and the loop integration that progresses them."""

    def __init__(self, options: Mapping[str, str]) -> None:
        self.lib = import_ucxx()
        feats = self.lib.Feature
        try:
            with _without_leftovers():
                self.context = self.lib.UCXContext(dict(options), feature_flags=(feats.TAG, feats.WAKEUP, feats.RMA))
                self.worker = self.lib.UCXWorker(self.context)
            self.worker.init_blocking_progress_mode()
            self.address = bytes(self.worker.address)
            self.handle = int(self.worker.handle)  # the raw ucp_worker_h (raw receives)
        except Exception as exc:
            raise TransportUnavailable(f"ucx: could not start a UCX worker: {exc}") from exc
        self.options = dict(options)
        self.loop = asyncio.get_running_loop()
        self._fd = self.worker.epoll_file_descriptor
        self._watch: dict[Any, _Watch] = {}
        # requests watched as groups (a message's payload receives: see watch_each), in order
        self._groups: dict[_Group, None] = {}
        # ucp request pointer -> (waiter, the memory UCX reads or writes, owner, what it is); the
        # waiter None once its caller has settled it (``let_go``)
        self._raw: dict[int, tuple[asyncio.Future[None] | None, object, object, str]] = {}
        # raw receives (channels' control receives: see listen_raw), each with its callback; and
        # those cancelled (their channel shut) while their message was arriving, with their memory
        self._raw_recv: dict[int, _Watch] = {}
        self._raw_recv_gone: dict[int, object] = {}
        # payload receives posted raw (payload_recv) whose completion has not been seen yet: the
        # worker's shutdown takes them back (their memory is kept by their watches, or ``hold``)
        self._payload_recvs: dict[int, RawRecv] = {}
        self._ucp: Any = None  # the libucp bindings bound to this worker (see bind)
        # How a dispatch finds the raw requests that have completed (Ucp.completing_into): it
        # asks UCX about those the bindings posted to be polled (a few: _polled), and looks at
        # those that UCX has reported complete since the last dispatch (_done, appended by the
        # bindings' completion callback: hints, each looked up and its status asked before it
        # is acted on). Never at every request in flight: asking UCX about each one per
        # dispatch, a batch of 250 -> 1000 gets over tcp lanes ran 74,000 -> 934,000 lines of
        # this module (quadratic; 90 per get now)
        self._done: list[int] = []
        self._polled: set[int] = set()
        # cancelled requests UCX may still hold, with the memory it may still write (see
        # _release_buried), each there once (_buried). Never let go with their peer's process, as
        # raw sends are (see sweep)
        self._graveyard: deque[tuple[Any, object]] = deque()
        self._buried: set[Any] = set()
        # raw requests of closed channels (sends UCX cannot take back), with their memory: freed
        # once UCX completes them, or with the worker; a send's memory also once its peer's
        # process has certainly ended (see sweep). Not polled for: to a peer that died, a
        # rendezvous send never completes
        self._raw_graveyard: dict[int, object] = {}
        # the sends among those whose memory (host memory) may go once this process has ended:
        # their channel's peer (UcxChannel.payload_peer); and each such peer whose end was seen,
        # with the count of progress runs then (see sweep)
        self._payload_peers: dict[int, ProcessId] = {}
        self._ended: dict[ProcessId, int] = {}
        self._runs = 0  # progress runs so far that ended with UCX finding nothing more to do
        self._sweeper: asyncio.TimerHandle | None = None
        self._aged: set[Any] = set()  # graveyard requests with memory at the last sweep
        self._warned = (0, 0, 0.0)  # requests and bytes held at the last warning, and its time
        self.released = (0, 0)  # sends let go with their peer's process, and their bytes
        # raw requests taken in charge (keep_raw) that their caller will wait for one by one, with
        # their memory and owner; not polled until then
        self._raw_kept: dict[int, tuple[object, object]] = {}
        # callbacks due once every one of their requests has completed (see when_done)
        self._awaited: list[_Wait] = []
        # remote keys of closed channels, each destroyed once the raw requests that may use it
        # (those in flight when its channel closed) have completed: UCX forbids destroying an
        # rkey that outstanding operations use
        self._retired: list[tuple[set[int], list[Any]]] = []
        self._tasks: set[asyncio.Task[None]] = set()
        # endpoint closes UCX has not finished, each resolved once it has, or the worker shut
        # (``close_endpoint``'s ``released``)
        self._releasing: set[asyncio.Future[None]] = set()
        # raw endpoint closes in the graveyard (not polled: one to a peer that died never ends),
        # each with the wait resolved once UCX completes it
        self._closes: dict[int, asyncio.Future[None]] = {}
        self._scheduled = False
        self._fallback: asyncio.TimerHandle | None = None
        self._last = time.monotonic()  # UCX last made progress
        self.stalled = False  # see _STALL
        self._last_event = 0.0  # an operation was last posted or completed
        # the processes of this node's peers on this machine, each with its count of channels,
        # looked at while the loop spins idle (see _YIELD_AFTER); when each one's affinity was
        # read, and the CPUs it allows; where the next look starts, and when
        self._neighbours: dict[ProcessId, int] = {}
        self._affinity: dict[ProcessId, tuple[float, frozenset[int] | None]] = {}
        self._look_at = 0
        self._next_look = 0.0
        self.yields = 0  # times the loop gave the CPU up to a peer's process
        self._closed = False
        self._stuck = 0  # raw requests still in flight when the worker shut (see _release)
        # one-sided operations and recvs finished inline since the last progress run (the loop
        # has not turned meanwhile: their callers yield to it now and then)
        self.inline_streak = 0
        self._fresh = False  # requests were added since the last dispatch
        self._soon: list[Callable[[], None]] = []  # due at the end of the next progress run (see soon)
        self.inline = False  # a recv's inline wait is progressing: dispatching what it found (see soon)
        self.loop.add_reader(self._fd, self._on_readable)

    @property
    def closed(self) -> bool:
        """Whether the worker has shut: its UCX worker is (being) destroyed, and nothing may be
        posted on it, or on ``handle``, any more."""
        return self._closed

    # -- requests --------------------------------------------------------------------------
    def bind(self, ucp: Ucp) -> CompletingUcp:
        """The libucp bindings ``ucp`` (``_ucp.load()``) bound to this worker, the same every
        time: raw requests on this worker are posted through them, which tell it how to learn of
        their completions. A request posted through other bindings would never be dispatched."""
        if self._ucp is None:
            self._ucp = ucp.completing_into(self._done)
            self._polled = self._ucp.polled
        bound: CompletingUcp = self._ucp
        return bound

    def bindings(self) -> CompletingUcp:
        """This worker's bindings (``bind(load())`` the first time): raises TensorWireError
        where libucp cannot be bound."""
        return self.bind(self._ucp if self._ucp is not None else load())

    def watch(
        self,
        req: Any,
        callback: Callable[[Any], None],
        *,
        keep: object = None,
        owner: object = None,
        passive: bool = False,
    ) -> None:
        """Call ``callback(req)`` from the loop once ``req`` completes (successfully or not)."""
        self._watch[req] = _Watch(callback, keep, owner, passive)
        self._fresh = True  # it may have completed when posted: the next run dispatches
        self.kick()

    def watch_each(
        self, reqs: list[Any], callback: Callable[[Any], None], *, keeps: list[object], owner: object = None
    ) -> None:
        """Call ``callback(req)`` from the loop for each of ``reqs`` once it completes, in their
        order: as ``watch`` of each (``keeps[i]`` kept for ``reqs[i]``), but a dispatch looks
        only at the first request not yet reported, so that its work does not grow with the
        number of requests. Watched one by one, the n payload receives of a message of n
        tensors were each looked at in every dispatch: receiving 250 -> 4,000 tensors of 512
        bytes over shared memory ran 39,710 -> 1,558,422 lines of tensorwire (quadratic; 31,383
        -> 529,121 now), and sending and receiving 4,000 took 0.27-0.32 s (0.10 s now).

        A request that completes before one ahead of it is reported once that one has. For the
        receives of one message that changes nothing: its callbacks count them down, and the
        message lands with the last one either way; a failure behind a receive still in flight
        is told once that one ends, or cancelled as its channel shuts (``abandon``)."""
        if not reqs:
            return
        self._groups[_Group(list(reqs), list(keeps), callback, owner)] = None
        self._fresh = True  # (some may have completed when posted: the next run dispatches)
        self.kick()

    def future(self, req: Any, *, keep: object = None, owner: object = None) -> asyncio.Future[Any]:
        """A future that resolves to ``req`` when it completes."""
        fut: asyncio.Future[Any] = self.loop.create_future()

        def done(r: Any) -> None:
            if not fut.done():
                fut.set_result(r)

        self.watch(req, done, keep=keep, owner=owner)
        return fut

    def watch_raw(
        self,
        ucp: Any,
        request: int,
        keep: object = None,
        *,
        owner: object = None,
        what: str = "one-sided operation",
        pledge: bool = False,
    ) -> asyncio.Future[None]:
        """A future for a raw ``ucp_*_nbx`` request pointer (one-sided operations, control frames,
        payload sends), which fails with the request's error status, ``what`` naming it. ``keep``
        (the memory UCX reads or writes) stays referenced until the request has completed, or the
        worker is destroyed; ``abandon(owner)`` stops the wait but keeps the request and ``keep``
        so. The request is freed by the worker, never by the caller. ``pledge``: the future is a
        ``Pledge`` (its cancel refused), for a caller that waits it out whatever cancellations
        come (a payload send, a get or put): awaited directly, it wakes that caller a loop turn
        sooner than a shielded future."""
        assert ucp is self._ucp, "a raw request posted through bindings not bound to this worker"
        fut: asyncio.Future[None] = Pledge(loop=self.loop) if pledge else self.loop.create_future()
        self._raw[request] = (fut, keep, owner, what)
        self._fresh = True
        self.kick()
        return fut

    def let_go(self, futs: Collection[asyncio.Future[None]]) -> None:
        """Stop holding ``futs``, waits of ``watch_raw`` whose caller has settled them itself (a
        channel's gets and puts that UCX had not completed a grace after it shut): their
        requests and memory stay until UCX completes them, or the worker closes, as before; the
        waits go. A failure raised from a wait keeps in its traceback the frames that awaited
        it (a read's: its channel and peer), and a get from an owner that died over lanes that
        emulate gets (tcp) never completes: the worker kept the gone peer, with its channel and
        mailbox, until the node closed."""
        gone = set(futs)
        if not gone:
            return
        for ptr, (fut, keep, owner, what) in self._raw.items():
            if fut is not None and fut in gone:
                self._raw[ptr] = (None, keep, owner, what)

    def listen_raw(
        self, ucp: Any, request: int, callback: Callable[[int, int], None], *, keep: object, owner: object
    ) -> None:
        """Call ``callback(status, length)`` from the loop once the raw receive ``request`` (posted
        and not yet completed) completes: UCS_OK and the bytes received, or its error (and 0).
        Passive, as a control receive: an idle worker does not poll for it. The request is freed
        by the worker; ``keep`` (the memory it receives into) stays referenced until UCX is done
        with it, and ``abandon(owner)`` cancels it. Lighter than ucxx's ``tag_recv`` and ``watch``: no ucxx
        request, no future, no ``completed`` property scan per dispatch."""
        assert ucp is self._ucp, "a raw request posted through bindings not bound to this worker"
        self._raw_recv[request] = _Watch(callback, keep, owner, True)
        self.kick()

    def payload_recv(self, ucp: Any, address: int, nbytes: int, tag: int) -> RawRecv:
        """A tag receive of exactly ``tag`` into the ``nbytes`` at ``address`` (host or device
        memory, kept alive by the caller until it has completed), posted raw
        (``ucp_tag_recv_nbx``), as ucxx posts its receives. Watched and cancelled as a ucxx
        request is (``watch_each``, ``cancel``, ``hold``); unlike one it says how many bytes came
        (``RawRecv.length``). One that failed at once, or was posted on a shut worker, is
        completed with its error."""
        assert ucp is self._ucp, "a raw request posted through bindings not bound to this worker"
        if self._closed:  # (a raw call on a destroyed worker would crash the process)
            return RawRecv(self, None, nbytes, _CANCELED)
        ptr, status = ucp.payload_recv(self.handle, address, nbytes, tag)
        if ptr is None:
            return RawRecv(self, None, nbytes, status, ucp.received() if status == UCS_OK else 0)
        recv = self._payload_recvs[ptr] = RawRecv(self, ptr, nbytes, status)
        return recv

    def keep_raw(self, ucp: Any, request: int, keep: object, owner: object) -> None:
        """Take charge of a raw request whose caller waits for it later (``wait_raw``): it and
        ``keep`` are kept until it completes or the worker is destroyed, as ``watch_raw`` keeps
        them, but its completion is not acted on meanwhile. For the payload sends of a message,
        waited for one by one: polled from the start, each was looked at in every dispatch, and
        a message of many tensors took work quadratic in their number."""
        assert ucp is self._ucp, "a raw request posted through bindings not bound to this worker"
        self._raw_kept[request] = (keep, owner)

    def wait_raw(self, request: int, what: str) -> asyncio.Future[None] | None:
        """For a request of ``keep_raw``: None if it has completed (it is freed, its failure
        raised), else a ``Pledge`` as of ``watch_raw``."""
        entry = self._raw_kept.pop(request, None)
        if entry is None:  # (given up: its owner was abandoned, or the worker closed)
            raise ClosedResourceError(f"{what}: the ucx channel or transport closed")
        ucp = self._ucp
        status = ucp.request_status(request)
        if status == UCS_INPROGRESS:
            return self.watch_raw(ucp, request, entry[0], owner=entry[1], what=what, pledge=True)
        ucp.request_release(request)
        if status:
            raise ucp.error(status, what)
        return None

    def drop_raw(self, requests: list[int]) -> None:
        """Nobody will wait for these requests of ``keep_raw`` (their caller failed or was
        cancelled): each is freed once it completes, or with the worker."""
        for request in requests:
            entry = self._raw_kept.pop(request, None)
            if entry is None:
                continue
            if self._ucp.request_status(request) != UCS_INPROGRESS:
                # (its completion was seen while it was kept, and passed over: nothing more comes)
                self._ucp.request_release(request)
            else:
                self._bury_send(request, entry[0], entry[1])

    def _bury_send(self, request: int, keep: object, owner: object) -> None:
        """Into the graveyard: a send whose wait has been given up (its channel closed, or its
        caller went). Its payload stays there until UCX completes it, the worker closes, or
        (host memory, a peer known by its process) that process has certainly ended (``sweep``)."""
        self._raw_graveyard[request] = keep
        peer = getattr(owner, "payload_peer", None)
        if isinstance(peer, ProcessId) and isinstance(keep, (memoryview, bytes, bytearray)):
            self._payload_peers[request] = peer
        self._sweep_soon()

    def _sweep_soon(self) -> None:
        if self._sweeper is None and not self._closed:
            self._sweeper = self.loop.call_later(_SWEEP, self.sweep)

    def finish_inline(self, ucp: Any, request: int, rounds: int = _INLINE_ROUNDS) -> bool:
        """Progress right here, a few rounds, for a raw request that usually completes within
        microseconds (a get or put over shared memory). True if it completed: it is freed, and
        its error raised. False: nothing was decided, wait for it with ``watch_raw``.

        Completions of other requests that this progress finds are dispatched by the progress
        run it schedules; ``inline_streak`` tells a caller when to yield to the loop."""
        worker = self.worker
        done = False
        for _ in range(rounds):
            worker.progress_once()
            done = ucp.request_done(request)
            if done:
                break
        self.kick()
        if not done:
            return False
        self.inline_streak += 1
        status = ucp.request_finish(request)
        if status:
            raise ucp.error(status, "one-sided operation")
        return True

    def progress_until(self, fut: asyncio.Future[Any], seconds: float) -> bool:
        """Progress right here until ``fut`` is done or ``seconds`` have passed; True if done.

        For a recv whose answer is due within microseconds (a ping-pong): taking it here saves
        the trips through the event loop (its selector, the callbacks, the task's wake-up)
        that would otherwise cost more than the wait itself. Completions found are dispatched
        as the loop would dispatch them. Bounded, and only used right after this side sent."""
        if self._closed:
            return False
        worker = self.worker
        clock = time.perf_counter
        deadline = clock() + seconds
        self.inline = True
        try:
            while not fut.done():
                if worker.progress_once() or self._fresh or self._done:
                    self._dispatch()
                # (checked whether UCX moved or not: a cma transfer moves in every round, and ran
                # to its end here when only an idle round looked at the clock)
                if clock() >= deadline:
                    break
        finally:
            self.inline = False
        self.kick()
        if fut.done():
            self.inline_streak += 1
            return True
        return False

    def soon(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` from the loop once the callbacks already due have run (the task a
        completion just woke among them): ``loop.call_soon``. From a completion that a recv's
        inline wait dispatched, whose caller goes on at once, it costs a list append instead:
        the next progress run calls it after its own dispatches, and what it posts is
        dispatched by the run after that, which the loop queues behind the callbacks due by
        then (a control receive is re-posted so after every frame; ``call_soon`` costs a
        handle, on the round trip's path)."""
        if self.inline:
            self._soon.append(callback)
        else:
            self.loop.call_soon(callback)

    def cancel(self, req: Any) -> None:
        """Ask UCX to cancel ``req`` (a receive that has not matched completes as cancelled at
        once; one that has matched, or a send, runs to completion)."""
        if type(req) is RawRecv:
            req.cancel()
            return
        if req.completed:
            return
        try:
            load().cancel_request(req)
        except Exception as exc:  # no binding: dropping the last reference cancels it too
            log.debug("ucx request cancel: %s", exc)

    def abandon(self, owner: object) -> None:
        """Cancel every request of ``owner`` and stop reporting them; their buffers stay
        referenced until UCX is done with them (or the worker closes). Its raw requests (sends:
        UCX cannot take one back) are left to finish, and their waits are not resolved."""
        self._forsake([r for r, w in self._watch.items() if w.owner is owner])
        for g in [g for g in self._groups if g.owner is owner]:
            del self._groups[g]
            for r, keep in zip(g.reqs[g.at :], g.keeps[g.at :], strict=True):
                self.cancel(r)
                self.hold(r, keep)
            g.reqs, g.keeps = [], []
        if self._raw_recv:
            for ptr in [p for p, w in self._raw_recv.items() if w.owner is owner]:
                self._cancel_raw_recv(ptr, self._raw_recv.pop(ptr).keep)
        if self._raw:
            for ptr in [p for p, entry in self._raw.items() if entry[2] is owner]:
                _, keep, _, what = self._raw.pop(ptr)
                if what in _SENDS:
                    self._bury_send(ptr, keep, owner)
                else:  # (a get may still write into its memory: it goes only when UCX is done)
                    self._raw_graveyard[ptr] = keep
        if self._raw_kept:
            self.drop_raw([p for p, entry in self._raw_kept.items() if entry[1] is owner])
        self.kick()

    def _forsake(self, reqs: list[Any]) -> None:
        """Stop reporting the watched requests ``reqs`` and cancel them; each is held with its
        buffer (``hold``) until UCX is done with it (one that has matched runs on to its end)."""
        for r in reqs:
            w = self._watch.pop(r, None)
            self.cancel(r)
            if w is not None:
                self.hold(r, w.keep)

    def _cancel_raw_recv(self, ptr: int, keep: object) -> None:
        """Cancel a raw receive nobody waits for any more; freed at once if that ended it (it
        had not matched), else once its message has landed (``keep`` held until then)."""
        ucp = self._ucp
        ucp.cancel_raw(self.handle, ptr)
        if ucp.request_status(ptr) == UCS_INPROGRESS:
            self._raw_recv_gone[ptr] = keep
        else:
            ucp.request_release(ptr)

    def hold(self, req: Any, keep: object) -> None:
        """Keep ``req`` and ``keep`` (the buffer UCX reads or writes through it) until UCX is done
        with them, or the worker closes: a request whose caller has stopped waiting for it. Once,
        however often it is held (a payload send that ``abandon`` took from its wait, which the
        channel's ``_send_payload_ucxx`` then holds with the others)."""
        if req.completed or req in self._buried:
            return
        self._buried.add(req)
        self._graveyard.append((req, keep))
        if keep is not None:
            self._sweep_soon()  # (the warning of those held too long)

    def when_done(self, reqs: list[Any], callback: Callable[[], None]) -> object:
        """Call ``callback()`` from the loop once every one of ``reqs`` has completed (finished,
        failed or cancelled), whether watched or abandoned: from then on UCX writes no more into
        their buffers. A token for ``forget_wait``. The worker polls while any such wait is
        registered (a cancelled receive that had matched ends when its transfer does)."""
        entry = _Wait(list(reqs), callback)
        self._awaited.append(entry)
        self._fresh = True
        self.kick()
        return entry

    def forget_wait(self, token: object) -> None:
        """Drop a ``when_done`` wait (its caller gave up on it); its callback is not called."""
        self._awaited = [e for e in self._awaited if e is not token]

    async def all_done(self, reqs: list[Any]) -> None:
        """Until every one of ``reqs`` has completed (``when_done``, awaited; a cancelled wait
        is forgotten)."""
        if not reqs:
            return
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        token = self.when_done(reqs, lambda: None if done.done() else done.set_result(None))
        try:
            await done
        finally:
            self.forget_wait(token)

    def retire(self, keys: list[Any]) -> None:
        """Close ``keys`` (objects with ``close()``: remote keys) once none of the raw requests
        in flight now (those that may use them, and others') is any more; at once if none is."""
        self._retired.append((set(self._raw), keys))
        self._close_retired()

    def _close_retired(self) -> None:
        """Close the retired keys none of whose requests is in flight any more."""
        keep = []
        for inflight, keys in self._retired:
            inflight.intersection_update(self._raw)
            if inflight:
                keep.append((inflight, keys))
            else:
                for key in keys:
                    key.close()
        self._retired = keep

    def track(self, task: asyncio.Task[None]) -> None:
        """Keep a background task (an endpoint close) until it ends; close() waits for them."""
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def neighbour(self, process: ProcessId) -> None:
        """A channel's peer runs in ``process``, on this machine (``_process.visible``)."""
        self._neighbours[process] = self._neighbours.get(process, 0) + 1

    def forget_neighbour(self, process: ProcessId) -> None:
        """That channel has shut."""
        left = self._neighbours.pop(process, 0) - 1
        if left > 0:
            self._neighbours[process] = left
        else:
            self._affinity.pop(process, None)

    # -- progress --------------------------------------------------------------------------
    def kick(self) -> None:
        """Progress soon (after posting an operation); an answer is likely, so spin a little."""
        self._last_event = time.monotonic()
        if not self._scheduled and not self._closed:
            self._scheduled = True
            self.loop.call_soon(self._progress)

    def _on_readable(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            self._progress()

    def _dispatch(self) -> int:
        self._fresh = False
        n = 0
        if self._graveyard:
            self._release_buried()
        if self._watch:
            done = [(r, w) for r, w in self._watch.items() if r.completed]
            for r, w in done:
                if self._watch.pop(r, None) is None:
                    continue
                n += 1
                try:
                    w.callback(r)
                except Exception:  # a bug in a callback must not stop progress for everyone
                    log.exception("ucx completion callback failed")
        if self._groups:
            n += self._dispatch_groups()
        if self._polled or self._done:
            status_of = self._ucp.request_status
            found = [p for p in self._polled if status_of(p) != UCS_INPROGRESS]
            if self._done:
                found += self._done  # (the callback appends to this very list: emptied in place)
                self._done.clear()
            if found:
                n += self._dispatch_raw(found)
        if self._awaited:
            awaited, self._awaited = self._awaited, []
            for entry in awaited:
                # (from where the last dispatch stopped: asking about every request again,
                # a wait on a message's n receives took work quadratic in n)
                reqs, at = entry.reqs, entry.at
                while at < len(reqs) and reqs[at].completed:
                    at += 1
                entry.at = at
                if at < len(reqs):
                    self._awaited.append(entry)
                    continue
                n += 1
                try:
                    entry.callback()
                except Exception:
                    log.exception("ucx completion callback failed")
        return n

    def _release_buried(self) -> None:
        """Let go of the graveyard's requests that UCX has completed, with their memory: those
        at its head, after which the first one still in flight moves to the back. A dispatch thus
        asks UCX about one request in flight, and about each completed one once. Rescanned whole
        in every dispatch, 4,000 held requests (a channel cut in the middle of a message of
        4,000 tensors) ran 4,020 lines per dispatch until UCX was done with them (23 now). A
        request goes only once UCX says it has completed, never before: at most as many
        dispatches later as the graveyard holds requests, and in the next one once all have
        completed (the head is then completed all the way down)."""
        graveyard = self._graveyard
        while graveyard and graveyard[0][0].completed:
            self._buried.discard(graveyard.popleft()[0])
        if graveyard:
            graveyard.rotate(-1)

    def _dispatch_groups(self) -> int:
        """Report the requests of ``watch_each`` that have completed, each group's in order from
        its first not yet reported, up to the first still in flight."""
        n = 0
        for g in list(self._groups):
            reqs, keeps = g.reqs, g.keeps
            while g.at < len(reqs) and g in self._groups:  # (a callback may abandon its owner's)
                r = reqs[g.at]
                if not r.completed:
                    break
                reqs[g.at] = keeps[g.at] = None  # (UCX is done with them: nothing here holds them)
                g.at += 1
                n += 1
                try:
                    g.callback(r)
                except Exception:  # a bug in a callback must not stop progress for everyone
                    log.exception("ucx completion callback failed")
            if g.at >= len(reqs):
                self._groups.pop(g, None)
        return n

    def _dispatch_raw(self, done: list[int]) -> int:
        """Act on the raw requests ``done`` that have completed: those polled that UCX says are
        done, and those UCX has reported complete since the last dispatch (``_done``).

        Each is looked up among the requests this worker holds (one it does not hold yet, or
        any more, was posted and not handed over, kept for a later wait, finished by its caller,
        or freed unfinished), and its status asked: the memory of a request freed since it was
        reported may belong to a new request already, which completes later (and is reported
        again then, or polled)."""
        ucp = self._ucp
        status_of = ucp.request_status
        n = 0
        raw = False
        for ptr in done:
            if ptr in self._raw:
                status = status_of(ptr)
                if status == UCS_INPROGRESS:
                    continue
                fut, _, _, what = self._raw.pop(ptr)
                raw = True
                n += 1
                ucp.request_free(ptr)
                if fut is not None and not fut.done():
                    if status == 0:
                        fut.set_result(None)
                    else:
                        fut.set_exception(ucp.error(status, what))
                        fut.exception()
            elif ptr in self._raw_recv:
                status = status_of(ptr)
                if status == UCS_INPROGRESS:
                    continue
                w = self._raw_recv.pop(ptr)
                length = ucp.recv_length(ptr) if status == 0 else 0  # (asked before it is freed)
                ucp.request_free(ptr)
                n += 1
                try:
                    w.callback(status, length)
                except Exception:  # a bug in a callback must not stop progress for everyone
                    log.exception("ucx completion callback failed")
            elif ptr in self._raw_graveyard:
                if status_of(ptr) != UCS_INPROGRESS:
                    del self._raw_graveyard[ptr]
                    if (closed := self._closes.pop(ptr, None)) is not None:
                        closed.set_result(None)
                    self._payload_peers.pop(ptr, None)
                    ucp.request_release(ptr)
            elif ptr in self._raw_recv_gone:
                if status_of(ptr) != UCS_INPROGRESS:
                    del self._raw_recv_gone[ptr]
                    ucp.request_release(ptr)
        if raw and self._retired:
            self._close_retired()
        return n

    def _progress(self) -> None:
        self._scheduled = False
        self.inline_streak = 0
        if self._closed:
            return
        if self._fallback is not None:
            self._fallback.cancel()
            self._fallback = None
        worker = self.worker
        looked = time.monotonic()
        until = looked + _BURST
        for _ in range(_ROUNDS):
            moved = worker.progress_once()
            if moved and not (self._fresh or self._done):
                now = time.monotonic()
                if now - looked < _LOOK_MOVING and not self.stalled:  # bytes move, nothing ended: look later
                    self._last = now
                    if now >= until:
                        break
                    continue
            # a request completes inside progress, or when it is posted (then it is fresh); a raw
            # one posted with a callback is put on _done as it completes (inside progress, or a
            # cancel)
            busy = moved or self._fresh or self._done or self._graveyard or self._awaited
            completed = self._dispatch() if busy else 0
            looked = time.monotonic()
            if moved or completed:
                self._last = time.monotonic()  # UCX moved something: keep going while it does
                if self.stalled:
                    self.stalled = False
                    log.warning("ucx: UCX makes progress again")
            if completed:
                self._last_event = self._last
                break  # let the tasks those completions woke run before progressing more
            if not moved:
                self._runs += 1  # (drained: what peers had sent before now has been taken)
                break
            if self._last >= until:
                break
        # ucxx's own bookkeeping (the cancellations it scheduled), which its progress() also
        # does; what that completed is dispatched now, or the wake-up for it would be gone. Not
        # progress() itself: it progresses until nothing moves, and a cma transfer moves 512 KiB
        # a round, so a 256 MiB payload ran to its end inside one call, the loop blocked 0.05 s
        # (1.2 s into pages never touched: a node missed its lease renewals, and a 2 GiB tensor
        # lost its session). The rounds above move at most _ROUNDS of them per loop turn.
        worker.cancel_inflight_requests()
        if self._dispatch():
            self._last = self._last_event = time.monotonic()
        if self._soon:  # (after this run's dispatches: what they post is dispatched by the next run)
            soon, self._soon = self._soon, []
            for callback in soon:
                try:
                    callback()
                except Exception:
                    log.exception("ucx callback failed")
        now = time.monotonic()
        spin = now - self._last < _SPIN_ACTIVE or now - self._last_event < _SPIN_IDLE
        if self._scheduled:  # a completion callback posted work and kicked: that run comes next
            return
        if spin or not worker.arm():
            self._scheduled = True
            if (
                spin
                and self._neighbours
                and now >= self._next_look
                and now - max(self._last, self._last_event) >= _YIELD_AFTER
            ):
                self._make_way(now)
            if spin or now - self._last < _STALL:
                self.loop.call_soon(self._progress)
            else:  # busy, yet nothing has moved for seconds: poll instead of spinning
                self._stall(now)
                self._fallback = self.loop.call_later(_FALLBACK, self._progress)
            return
        if self._raw or self._awaited or self._groups or any(not w.passive for w in self._watch.values()):
            self._fallback = self.loop.call_later(_FALLBACK, self.kick)

    def _make_way(self, now: float) -> None:
        """Give this CPU up (``sched_yield``) if a peer's process waits to run on it: the answer
        this loop spins for can come only from it. A few peers a look, taking turns."""
        self._next_look = now + _LOOK_EVERY
        cpu = this_cpu()
        if cpu < 0:
            return
        peers = list(self._neighbours)
        at = self._look_at % len(peers)
        self._look_at = at + _LOOK_PEERS
        for process in (peers[at:] + peers[:at])[:_LOOK_PEERS]:
            read, cpus = self._affinity.get(process, (-_AFFINITY_AGE, None))
            if now - read >= _AFFINITY_AGE:
                cpus = cpus_of(process)
                self._affinity[process] = (now, cpus)
            if cpus is not None and cpu not in cpus:
                continue
            if waiting_on(process, cpu):
                os.sched_yield()
                self.yields += 1
                return

    def _stall(self, now: float) -> None:
        if self.stalled:
            return
        self.stalled = True
        log.warning(
            "ucx: UCX has had work pending for %.0f s without moving anything; polling every %.0f ms "
            "instead of spinning. A peer may be stalled, or one that died in the middle of a send over "
            "shared memory has blocked this node's shared-memory receive queue: then nothing more "
            "arrives over it until the node restarts (a UCX limitation; see docs/ucx.md)",
            now - self._last,
            _FALLBACK * 1000,
        )

    # -- sends UCX never completes ----------------------------------------------------------
    def stranded(self) -> tuple[int, int]:
        """Requests of closed channels (sends, mostly; or given up by their callers) that UCX
        has not completed, and the bytes of the memory this node keeps for them (see ``sweep``):
        the raw requests' graveyard, the raw control receives cut off while their message was
        landing (UCX writes into their buffers until it has), and the graveyard of ucxx requests
        (``hold``, ``abandon``: the sends of a node whose libucp bindings did not load, handshake
        replies, matched receives cut off), less those UCX has completed that the next
        dispatches let go."""
        n = size = 0
        # (a metrics scrape may call from a thread: copies)
        for keep in [*self._raw_graveyard.values(), *self._raw_recv_gone.values()]:
            if keep is not None:
                n += 1
                size += _nbytes(keep)
        for req, keep in list(self._graveyard):
            if keep is not None and not (req.ended if type(req) is RawRecv else req.completed):
                n += 1
                size += _nbytes(keep)
        return n, size

    def sweep(self) -> None:
        """Let go of the raw sends in the graveyard whose peer's process has certainly ended,
        and warn (rate limited) of the requests held (raw, or ucxx: ``hold``) that stay longer
        than a sweep; again in ``_SWEEP`` seconds while any is there.

        To a peer that died, a rendezvous send never completes, and UCX 1.21 gives no way to
        end it on an endpoint without peer error handling: it refuses the forced close that
        would purge it (``ucp_ep_close_nbx``: ``UCS_ERR_INVALID_PARAM``), takes back only
        receives (``ucp_request_cancel``), and a failed lane purges only the requests listed
        with their endpoint (``ucp_ep_reqs_purge``), which those with direct ids, as without
        error handling, never are (``ucp_send_request_id_alloc``). Its payload stayed with the
        node until the worker closed: never, for a hub whose peers come and go.

        The payload goes once no lane can reach it any more, which is when the peer's process
        has ended (``_process.gone``): nothing is left to read it or to ask this node's UCX for
        it. A peer that is only stopped reads it when it runs again and delivers the message, so
        its payload stays. The request goes back to UCX (``ucp_request_free``), which frees it
        should it ever complete (an answer the peer sent before it died) and otherwise with the
        worker. A progress run that found nothing left to do lies between seeing the end and
        letting go (``_runs``), so that whatever the peer sent before it died (a request for the
        data, which over tcp would have UCX copy from the payload by hand) has been taken first.

        Not a ucxx send (``_send_payload_ucxx``): those are posted only where the libucp bindings
        did not load, and without them the lanes of its endpoint cannot be asked
        (``ucp_ep_query``: ``UcxChannel.lanes`` is ``("ucx",)``), so no kernel-copy lane is known
        (``payload_peer`` is None), and UCX may still copy from the payload by hand. ucxx's
        cancel (``ucp_request_cancel``) takes back no send either. They stay until UCX completes
        them or the worker closes, and are warned of."""
        self._sweeper = None
        if self._closed:
            return
        if self._payload_peers:
            for peer in set(self._payload_peers.values()).difference(self._ended):
                if gone(peer):
                    self._ended[peer] = self._runs
                    self.kick()  # (a progress run before the next sweep)
            ended = [p for p, peer in self._payload_peers.items() if self._ended.get(peer, self._runs) < self._runs]
            size = 0
            for ptr in ended:
                del self._payload_peers[ptr]
                size += _nbytes(self._raw_graveyard.pop(ptr, None))
                self._ucp.request_release(ptr)
                self._stuck += 1  # (UCX warns of it as the worker is destroyed: see _release)
            if ended:
                self.released = (self.released[0] + len(ended), self.released[1] + size)
                log.info(
                    "ucx: let go of %d sends UCX never completed (%s): their peer's process has ended",
                    len(ended),
                    _size(size),
                )
            left = set(self._payload_peers.values())
            self._ended = {p: n for p, n in self._ended.items() if p in left}
        held: set[Any] = {p for p, keep in self._raw_graveyard.items() if keep is not None}
        held.update(p for p, keep in self._raw_recv_gone.items() if keep is not None)
        held.update(r for r, keep in self._graveyard if keep is not None and not r.completed)
        aged = held & self._aged
        self._aged = held
        if aged:
            self._warn_held(aged)
        if held:
            self._sweeper = self.loop.call_later(_SWEEP, self.sweep)

    def _warn_held(self, aged: set[Any]) -> None:
        """Warn of the requests held over a whole sweep: once they have grown since the last
        warning, at most every ``_WARN_EVERY`` seconds."""
        n, size = self.stranded()
        last_n, last_size, at = self._warned
        now = time.monotonic()
        if (n <= last_n and size <= last_size) or (at and now - at < _WARN_EVERY):
            self._warned = (min(n, last_n), min(size, last_size), at)  # (what went lowers the mark)
            return
        self._warned = (n, size, now)
        running = sum(1 for p in aged if p in self._payload_peers)
        log.warning(
            "ucx: %d sends (or one-sided operations, receives cut off) of closed channels were never "
            "completed by UCX, and this node keeps their memory (%s) until UCX completes them or the node "
            "closes. %d of them go once their peer's process ends (it still runs: stopped, or slow); the "
            "others' peers run on another machine, in another pid namespace or without a cma lane (or the "
            "libucp bindings did not load: sends through ucxx), and are never known gone. "
            "Without peer error handling UCX cannot fail them (docs/ucx.md, 'Sends to a peer that died')",
            n,
            _size(size),
            running,
        )

    # -- lifecycle -------------------------------------------------------------------------
    async def close_endpoint(
        self,
        ep: Any,
        grace: float = 1.0,
        released: asyncio.Future[None] | None = None,
        first: list[Any] | None = None,
    ) -> None:
        """Close a UCX endpoint without ever blocking the loop (a dead peer's flush times out).

        ``released`` is resolved once UCX has let go of the endpoint: its close has completed (and
        the flush in it: every get of this node's memory it was answering and put it was landing
        has ended), or failed, or the worker has shut (nothing progresses it any more). That may
        be long after this returns: a close that gave up waiting (``grace``) goes on in UCX, and
        over lanes that emulate gets and puts the worker still served a peer's get from memory
        through it, and landed its puts (the owner that let the memory go then died of SIGSEGV).

        Where UCX has found the peer gone (a tcp lane reset) the endpoint's lanes have failed, and
        its closing flush fails on each, at once: UCX logs "error during flush" per lane (twice
        for tcp lanes) at error level, on stdout, right after tensorwire said the peer missed its
        lease. There is no flush-free close: UCX refuses ``UCP_EP_CLOSE_FLAG_FORCE`` for an
        endpoint without peer error handling (``ucp_ep_close_nbx``, v1.21), and ucxx asks for it
        only where that is on. Those lines, printed inside this call, go to tensorwire's debug
        log instead.

        The endpoint is flushed first, and a flush that has not ended within ``grace`` is taken
        for one that never will (see ``_close_stuck``). A close cancelled meanwhile (the node's
        close cut short as its loop ends), or one the worker's shutdown overtakes, closes the
        endpoint at once the same way: ucxx's close left to its endpoint's destructor progressed
        the worker until the flush ended (for ever, to a peer that died during a first
        rendezvous send: the process hung as its loop shut down), and ucxx's close posted on a
        shut worker held the endpoint and the worker (2 listening sockets, 3 mappings).

        ``first``: tag receives (a closed channel's, of messages it dropped unread) to wait for,
        within ``grace``, before the flush: UCX answers the sender of a rendezvous message only
        through the endpoint its RTS names, and one whose RTS comes once that endpoint has gone
        completes its receive as cancelled and never answers (the sender's send stays in its
        UCX). Those still posted then are cancelled (unmatched: their payload never came)."""
        deadline = self.loop.time() + grace
        try:
            if first:
                try:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout_at(deadline):
                            await self.all_done(first)
                finally:
                    if not self._closed:  # (its shutdown cancelled them)
                        # not done within the grace: its payload never came (cancelled), or it
                        # matched a message whose sender died inside it, which UCX never ends;
                        # nobody is told of it now (its callback held the closed channel)
                        self._forsake(first)
                deadline = self.loop.time() + grace
            flushed = await self._flushed(ep, deadline, released)
        except BaseException:  # (cancelled: nothing may wait now, and nothing may be left to ucxx)
            self._close_stuck(ep, released)
            raise
        if not flushed:
            return
        fut = None
        try:
            try:
                with quiet(_CLOSING_FLUSH, "closing an endpoint whose peer is gone"):
                    req = ep.close()
            except Exception as exc:
                log.debug("ucx endpoint close failed: %s", exc)
                return
            if req is None:
                return
            fut = self.future(req)
            async with asyncio.timeout_at(max(deadline, self.loop.time() + 0.1)):
                await asyncio.shield(fut)
        except TimeoutError:  # (still watched: ``released`` waits for it)
            log.debug("ucx endpoint close did not finish in %.1f s (peer gone?)", grace)
        finally:
            self._released_with(released, fut)

    def _released_with(self, released: asyncio.Future[None] | None, end: asyncio.Future[Any] | None) -> None:
        """Resolve ``released`` once ``end`` (the wait for an endpoint's close request) is done,
        or the worker shuts; at once where ``end`` is None (nothing of the close left in UCX)."""
        if released is None or released.done():
            return
        if end is None or end.done() or self._closed:
            released.set_result(None)
            return
        self._releasing.add(released)

        def done(_end: object) -> None:
            self._releasing.discard(released)
            if not released.done():
                released.set_result(None)

        end.add_done_callback(done)

    async def _flushed(self, ep: Any, deadline: float, released: asyncio.Future[None] | None = None) -> bool:
        """Flush ``ep`` (raw ``ucp_ep_flush_nbx``) until ``deadline``. True: it ended, or failed,
        and ucxx's close follows. False: it had not ended (or the worker shut meanwhile: nothing
        would progress it), and the endpoint has been closed here (``_close_stuck``, which sees
        to ``released``)."""
        if self._closed:
            self._close_stuck(ep, released)
            return False
        try:
            ucp = self.bindings()
            with quiet(_CLOSING_FLUSH, "flushing an endpoint whose peer is gone"):
                req = ucp.flush(ep.handle)
        except TensorWireError as exc:  # (a lane that failed: the close's flush fails at once too)
            log.debug("ucx endpoint flush before its close: %s", exc)
            return True
        if req is None:
            return True
        fut = self.watch_raw(ucp, req, what="ucx endpoint flush")
        try:
            async with asyncio.timeout_at(deadline):
                await fut
            return True
        except TimeoutError:
            pass
        except Exception as exc:  # (failed; or the worker shut, which gave the request back to UCX)
            if not self._closed:
                log.debug("ucx endpoint flush before its close: %s", exc)
                return True
        finally:
            if req in self._raw:  # (still in flight: freed once UCX completes it, or with the worker)
                self._raw_graveyard[req] = self._raw.pop(req)[1]
        self._close_stuck(ep, released)
        return False

    def _close_stuck(self, ep: Any, released: asyncio.Future[None] | None = None) -> None:
        """Close ``ep``, whose flush has not ended, here and now, so that nothing of it keeps
        this worker.

        A first rendezvous send to a peer that died waits for UCX to learn the peer's endpoint
        id, which only the peer's answer brings. Until it comes, the endpoint's lane is a wireup
        endpoint that queues every send (a BYE too) and refuses every flush, the close's
        included (``ucp_wireup_ep_flush``, v1.21), and UCX fails that wait neither in bounded
        time (no timeout; keepalive only with peer error handling) nor on request
        (``ucp_request_cancel`` takes back receives only, and a forced close is refused). ucxx's
        close request and the endpoint then held each other, and the node's worker with them,
        until the process exited (2 listening sockets, 16 descriptors and 3 /dev/shm mappings
        per closed node, over shared memory).

        So the endpoint is closed here, raw (``ucp_ep_close_nbx``; its request is freed once UCX
        completes it, or with the worker, whose destruction destroys every endpoint it still
        has), and ucxx's close after it finds the endpoint closed and fails at once ("has already
        been closed", sent to the debug log), holding nothing. ucxx's close must still run: an
        endpoint ucxx never closed is closed by its destructor, which progresses the worker until
        that close ends, for ever here.

        The raw close goes first only where it cannot end at once: a close whose flush ends at
        once may destroy the endpoint then and there (``ucp_ep_close_nbx`` calls
        ``ucp_ep_disconnected``, which keeps only an endpoint that has sent or answered a
        wireup request), and ucxx's close after it would touch freed memory. A flush posted
        now ends at once exactly where the close's would (both are ``ucp_ep_flush_internal``
        with the same flags, and nothing progresses the worker in between), except that a
        flush that has begun its remote-memory phase (``ucp_ep_flush_mem_start``: puts to
        memory behind another device) takes that phase away from the next one. So two flushes
        are posted: where either ends at once, ucxx closes the endpoint itself, and its close
        ends at once too. Should the raw close end at once all the same (not seen, and not
        possible by the source), ucxx's close is skipped and its endpoint object is kept for
        good: its destructor would close the endpoint again. That keeps this worker (a leak, said
        in a warning) rather than touch freed memory.

        The close goes on in UCX, and its flush with it: ``released`` waits for the raw close's
        request (or, without one, for the worker's shutdown)."""
        # the wait for the close's end; None: nothing of it is left in UCX (without bindings
        # ucxx's close is not watched: only the worker's shutdown ends it)
        end: asyncio.Future[Any] | None = self.loop.create_future()
        try:
            ucp = self.bindings()
        except TensorWireError as exc:  # (no binding: ucxx's close alone)
            log.debug("ucx endpoint close: %s", exc)
            closed = False
        else:
            closed = self._flush_pending(ucp, ep) and self._flush_pending(ucp, ep)
            if not closed:  # (a flush ended at once: so does ucxx's close below)
                end = None
        try:
            if closed:
                try:
                    req = ucp.ep_close(ep.handle)
                except TensorWireError as exc:
                    log.debug("ucx endpoint close failed: %s", exc)
                    req = None
                if req is None:
                    _keep_for_good(ep)
                    end = None
                    return
                self._raw_graveyard[req] = None
                if self._closed:
                    self._release_if_shut(ucp, req)
                    end = None
                else:
                    self._closes[req] = end = self.loop.create_future()
                log.debug("ucx: an endpoint's flush had not ended (its peer gone?); closed it raw")
            try:
                with quiet(_ALREADY_CLOSED if closed else _CLOSING_FLUSH, "ucxx closing an endpoint"):
                    ucxx_req = ep.close()
            except Exception as exc:
                log.debug("ucx endpoint close failed: %s", exc)
                return
            if ucxx_req is not None and not ucxx_req.completed:  # (not expected)
                self.hold(ucxx_req, None)
        finally:
            self._released_with(released, end)

    def _flush_pending(self, ucp: Ucp, ep: Any) -> bool:
        """Post a flush of ``ep``: True if it has not ended (its request is freed once it does,
        or with the worker), False if it ended or failed at once."""
        try:
            with quiet(_CLOSING_FLUSH, "flushing an endpoint whose peer is gone"):
                req = ucp.flush(ep.handle)
        except TensorWireError as exc:
            log.debug("ucx endpoint flush before its close: %s", exc)
            return False
        if req is None:
            return False
        self._raw_graveyard[req] = None
        self._release_if_shut(ucp, req)
        return True

    def _release_if_shut(self, ucp: Ucp, req: int) -> None:
        """A raw request posted after the worker shut: ``_shut`` has freed the graveyard's, so
        this one goes back to UCX now (to its pool once it completes, or with the worker)."""
        if self._closed:
            del self._raw_graveyard[req]
            ucp.request_release(req)

    def forget_request(self, req: Any) -> None:
        self._watch.pop(req, None)

    async def drain(self) -> None:
        """Wait for background endpoint closes (each bounded by its own timeout)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def close(self) -> None:
        """Stop progressing and free the worker and context, here and now; idempotent."""
        _release(self._shut(), self._stuck)

    async def aclose(self) -> None:
        """Stop progressing, and free the worker and context on a thread; idempotent. Destroying
        a UCX worker closes its sockets and shared memory: 2.5 ms on an idle machine, up to 60 ms
        on a busy one, which the loop would wait out. (ucxx lets go of the GIL meanwhile.) Freed
        by the time this returns, even if it is cancelled meanwhile."""
        native = self._shut()
        if not native:
            return
        try:
            await asyncio.to_thread(_release, native, self._stuck)
        except RuntimeError:  # no thread to run it (the loop's executor is shut down)
            _release(native, self._stuck)

    def _shut(self) -> list[Any]:
        """Stop progressing; the worker, the context and what must outlive the worker, in the order
        they are to be let go (empty if closed already)."""
        if self._closed:
            return []
        self._closed = True
        if self._fallback is not None:
            self._fallback.cancel()
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        with contextlib.suppress(Exception):
            self.loop.remove_reader(self._fd)
        # one-sided operations still in flight fail (a cancel would raise CancelledError in a
        # caller nobody cancelled: a get from an owner that stopped serving it, say)
        for fut, _, _, what in self._raw.values():
            if fut is not None and not fut.done():
                fut.set_exception(ClosedResourceError(f"ucx transport closed while a {what} was in flight"))
                fut.exception()
        for ptr, w in self._raw_recv.items():  # (channels not shut yet: their control receives)
            self._ucp.cancel_raw(self.handle, ptr)
            self._raw_recv_gone[ptr] = w.keep
        self._raw_recv.clear()
        payload_recvs = list(self._payload_recvs)  # (their buffers are kept below: watched or held)
        for ptr, recv in self._payload_recvs.items():
            self._ucp.cancel_raw(self.handle, ptr)
            recv._ptr, recv.status = None, _CANCELED
        self._payload_recvs.clear()
        if self._ucp is not None:  # (every raw request is released below: no more dispatches)
            self._ucp.release_completions()
        try:
            self.worker.progress()
            self.worker.cancel_inflight_requests()
        except Exception as exc:
            log.debug("ucx worker cleanup: %s", exc)
        # every raw request goes back to UCX: one that has completed (the progress above may have
        # finished some) to its pool now, one still in flight when it completes. Dropped unfreed,
        # each stayed UCX's, and UCX warned of it as the worker was destroyed
        for ptr in [*self._raw, *self._raw_kept, *self._raw_graveyard, *self._raw_recv_gone, *payload_recvs]:
            if not self._ucp.request_done(ptr):
                self._stuck += 1
            self._ucp.request_release(ptr)
        if self._stuck:
            # (a get or put UCX emulates over tcp lanes, whose owner died, or a rendezvous send
            # to a peer that died: without peer error handling UCX never fails them; their
            # memory is let go with the worker, below)
            log.debug("ucx: %d operations still in flight as the worker closed; freed with it", self._stuck)
        # the buffers of sends UCX never finished (to a peer that died) are let go only once the
        # worker is gone: the progress above may still have touched them, and a cuda transport's
        # copies may still be running until the worker is destroyed
        held = [*self._raw.values(), *self._raw_kept.values(), *self._raw_graveyard.values()]
        held += self._raw_recv_gone.values()
        held += [*self._watch.values(), *self._graveyard, *(g.keeps for g in self._groups)]
        awaited, self._awaited = self._awaited, []
        for entry in awaited:  # UCX is done with their buffers: its requests are cancelled
            try:
                entry.callback()
            except Exception:
                log.exception("ucx completion callback failed")
        self._raw.clear()
        self._raw_kept.clear()
        self._raw_graveyard.clear()
        self._raw_recv_gone.clear()
        self._done.clear()
        self._payload_peers.clear()
        self._ended.clear()
        self._aged.clear()
        self._watch.clear()
        self._groups.clear()
        self._graveyard.clear()
        self._buried.clear()
        self._soon.clear()
        # nothing progresses the worker's endpoints any more: UCX reads and writes no memory
        # through them (see close_endpoint)
        self._closes.clear()
        releasing, self._releasing = self._releasing, set()
        for released in releasing:
            if not released.done():
                released.set_result(None)
        for _, keys in self._retired:  # before the worker they belong to
            for key in keys:
                key.close()
        self._retired.clear()
        native = [self.worker, self.context, held]
        del self.worker
        del self.context
        return native


def _nbytes(keep: object) -> int:
    """The bytes of memory a request keeps (a payload's memoryview or DeviceTensor, a frame)."""
    if keep is None:
        return 0
    if isinstance(keep, bytes):
        return len(keep)
    try:
        return int(getattr(keep, "nbytes", 0) or 0)
    except ValueError:  # (a memoryview released meanwhile)
        return 0


def _size(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.1f} MiB" if nbytes >= 1 << 20 else f"{nbytes} bytes"


def _keep_for_good(ep: Any) -> None:
    """Keep ucxx's endpoint object ``ep`` until the process exits, its destructor never run: UCX
    may have freed the endpoint it names (see ``Worker._close_stuck``). A reference held in
    Python would be dropped as the interpreter finalizes; this one never is."""
    log.warning(
        "ucx: an endpoint's close ended at once where it could not; its UCX worker is kept until the "
        "process exits (a leak, rather than a use of freed memory; please report it)"
    )
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(ep))


def _release(native: list[Any], stuck: int = 0) -> None:
    """Let go of ``native`` (from ``Worker._shut``) one by one: the UCX worker is destroyed with its
    last reference, the one dropped here unless a request or endpoint of it is still held.

    ``stuck``: requests of the worker that had not completed as it closed (to a peer that died,
    which UCX cannot fail without peer error handling). UCX warns of each as it destroys the
    worker and context ("mpool.c ... was not returned to mpool ucp_requests", "rcache.c ...
    destroying inuse region"); those lines go to tensorwire's debug log, as tensorwire knows
    why."""
    with quiet(_DESTROY_LEAKS, "requests in flight as the worker closed") if stuck else contextlib.nullcontext():
        while native:
            native.pop(0)
