"""Copy engines: who moves bytes between device memory and host memory, and in what order.

tensorwire stages device tensors through host memory on transports that cannot read device
memory (staged TCP). The staging pipeline (``_pipeline.py``) is written against this small
interface, so the same chunking, overlap and ordering logic runs with two engines:

* :class:`~tensorwire.memory._cuda.CudaEngine`: CUDA streams and events through CuPy's runtime
  bindings; host chunks are page-locked (``cudaHostAlloc``), so copies run asynchronously on
  the GPU's copy engines.
* :class:`HostEngine`: "device" memory is host memory and each lane is a worker thread that
  runs its copies in order; events are set as the worker passes them. It stands in for a GPU
  in CPU-only tests (optionally slow, to make overlap and ordering matter) and is what a
  reader can check the pipeline's logic against.

Vocabulary (CUDA's): a *lane* is an ordered queue of copies (a stream); an *event* marks the
point of a lane's queue where it was recorded and completes when everything before it has run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import ClosedResourceError, TransferError, fresh

log = logging.getLogger(__name__)

__all__ = [
    "CopyEngine",
    "DeviceBuffer",
    "Event",
    "HostChunk",
    "HostEngine",
    "Lane",
    "out_of_memory",
    "wait_event",
]


class Event(ABC):
    """A point in a lane's queue; done once every copy enqueued before it has finished."""

    @abstractmethod
    def query(self) -> bool:
        """True once the event has completed (never blocks)."""

    @abstractmethod
    def synchronize(self) -> None:
        """Block the calling thread until the event completes (only ever called in a worker thread)."""


class DoneEvent(Event):
    """An event with nothing before it."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


DONE = DoneEvent()


@dataclass(eq=False, slots=True)
class DeviceBuffer:
    """A C-contiguous run of ``nbytes`` bytes in an engine's device memory, at ``ptr``.

    ``owner`` keeps the memory alive (the framework tensor, a CuPy array, a numpy array for the
    host engine); ``device`` is the device index.
    """

    engine: CopyEngine
    ptr: int
    nbytes: int
    device: int
    owner: Any = field(repr=False, default=None)


@dataclass(eq=False, slots=True)
class HostChunk:
    """A staging buffer in host memory (page-locked where the engine can), ``size`` bytes."""

    view: memoryview
    ptr: int
    size: int
    owner: Any = field(repr=False, default=None)
    # the same bytes as one numpy array, made once: what a one-sided transport is handed (its
    # registration cache finds a chunk again by this array's owner)
    array: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.array = np.frombuffer(self.view, np.uint8) if self.size else np.empty(0, np.uint8)


class Lane(ABC):
    """An ordered queue of asynchronous copies on one device (a CUDA stream)."""

    engine: CopyEngine
    # the events of other queues this lane waits for that had not completed when it was made to
    # (``wait``): the engine hands it to another transfer only once they have (``lane``)
    waits: tuple[Event, ...] = ()

    @abstractmethod
    def to_host(self, dst: HostChunk, dst_off: int, src: DeviceBuffer, src_off: int, n: int) -> None:
        """Enqueue a copy of ``n`` bytes from device memory into a host chunk."""

    @abstractmethod
    def to_device(self, dst: DeviceBuffer, dst_off: int, src: HostChunk, src_off: int, n: int) -> None:
        """Enqueue a copy of ``n`` bytes from a host chunk into device memory."""

    @abstractmethod
    def device_copy(self, dst: DeviceBuffer, dst_off: int, src: DeviceBuffer, src_off: int, n: int) -> None:
        """Enqueue a device-to-device copy."""

    @abstractmethod
    def record(self) -> Event:
        """An event that completes once everything enqueued so far has run."""

    def wait(self, event: Event) -> None:
        """Make later work on this lane wait for ``event`` (which may belong to another queue)."""
        if event.query():
            return
        self._wait(event)
        self.waits = (*(e for e in self.waits if not e.query()), event)

    @abstractmethod
    def _wait(self, event: Event) -> None:
        """Enqueue a wait for ``event``, not yet completed."""

    @abstractmethod
    def close(self) -> None:
        """Free the lane once what is queued on it has run (a lane the engine does not keep)."""


class CopyEngine(ABC):
    """Device memory of one kind and device, and the lanes that copy to and from it."""

    kind: str
    device: int

    def __init__(self) -> None:
        self._lanes: list[Lane] = []
        self._pools: dict[str, Any] = {}
        self._poller = _Poller(f"tensorwire-{self.kind}-wait", self._poller_started)
        self._lock = threading.Lock()

    @property
    def name(self) -> str:
        return f"{self.kind}:{self.device}"

    def _poller_started(self) -> None:
        """Run first in each new thread of the engine's poller, before it queries any event
        (nothing for an engine whose events need no device current)."""
        return None

    # -- lanes ------------------------------------------------------------------------------
    @abstractmethod
    def _new_lane(self) -> Lane: ...

    def lane(self) -> Lane:
        """A lane of this engine's, from a free list; give it back with :meth:`give_back`.

        A lane given back while it still waits for another queue (a producer's or consumer's
        stream that is busy, or stuck: a transfer cancelled meanwhile) is handed out again only
        once that wait is over, so that no transfer queues behind another one's streams."""
        with self._lock:
            for i in range(len(self._lanes) - 1, -1, -1):
                lane = self._lanes[i]
                if all(e.query() for e in lane.waits):
                    del self._lanes[i]
                    lane.waits = ()
                    return lane
        return self._new_lane()

    def give_back(self, lane: Lane) -> None:
        with self._lock:
            if len(self._lanes) < 16:
                self._lanes.append(lane)
                return
        lane.close()

    # -- memory -----------------------------------------------------------------------------
    @abstractmethod
    def host_chunk(self, nbytes: int) -> HostChunk:
        """A new staging chunk in host memory (page-locked where this engine can)."""

    @abstractmethod
    def free_chunk(self, chunk: HostChunk) -> None:
        """Free a chunk from :meth:`host_chunk`."""

    @abstractmethod
    def empty(self, nbytes: int, stream: int | None = None) -> DeviceBuffer:
        """A new device buffer of tensorwire's own (freed with the returned object), allocated for
        use on ``stream`` (the producer's or consumer's; None: the current one). A caching
        allocator hands a freed block to the next allocation on the same stream without waiting,
        so the buffer must belong to the stream that orders every use of it. No memory for it:
        TransferError (``allocating``)."""

    @contextlib.contextmanager
    def allocating(self, nbytes: int, what: str, advice: str = "free device memory") -> Iterator[None]:
        """Device memory of this engine's allocated inside (by CuPy, torch or the engine itself):
        no memory for it (``out_of_memory``) is a TransferError saying so, not the framework's
        own error, so that a recv that needed it fails alone and leaves its message queued for
        a recv with ``out=`` (the mailbox keeps a message on any error of the tree), and a send
        fails before anything has moved. ``what``: what the memory was for; ``advice``: what
        the caller can do, in words."""
        try:
            yield
        except Exception as exc:
            if not out_of_memory(exc):
                raise
            raise TransferError(
                f"out of memory on {self.name}: could not allocate {nbytes} bytes for {what} ({exc}); {advice}"
            ) from exc

    def pool(self, direction: str) -> Any:
        """The process-wide staging pool of this engine for ``direction`` ("out" or "in")."""
        from ._pinned import PinnedPool

        with self._lock:
            pool = self._pools.get(direction)
            if pool is None:
                pool = self._pools[direction] = PinnedPool(self)
            return pool

    # -- streams of frameworks ----------------------------------------------------------------
    @abstractmethod
    def record_on(self, stream: int | None) -> Event:
        """An event recorded on a framework's stream (``None``: nothing to wait for)."""

    @abstractmethod
    def stream_wait(self, stream: int | None, event: Event) -> bool:
        """Make a framework's ``stream`` wait for ``event`` without blocking the host.

        Returns False if this engine has no such streams, and the caller must wait on the host.
        """


def out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocation that found no memory: a MemoryError (numpy's, and CuPy's
    ``cupy.cuda.memory.OutOfMemoryError``, which is one), torch's ``OutOfMemoryError`` (a
    RuntimeError: ``torch.OutOfMemoryError``, also named ``torch.cuda.OutOfMemoryError``), or
    CuPy's ``CUDARuntimeError`` for cudaErrorMemoryAllocation (2), which a CUDA call outside
    CuPy's memory pool raises. Told by class name and module: nothing is imported for it."""
    if isinstance(exc, MemoryError):
        return True
    cls = type(exc)
    if any(c.__name__ == "OutOfMemoryError" and c.__module__.partition(".")[0] == "torch" for c in cls.__mro__):
        return True
    return cls.__name__ == "CUDARuntimeError" and getattr(exc, "status", None) == 2


_SPIN_SECONDS = 200e-6


async def wait_event(engine: CopyEngine, event: Event, until: asyncio.Future[Any] | None = None) -> None:
    """Wait for ``event`` without blocking the event loop.

    Asks once; then lets the loop run a few times (a chunk copy usually finishes within tens of
    microseconds of being asked for); then leaves it to the engine's poller thread, which polls
    every event waited for with short sleeps, so that it never holds the interpreter while the
    copy runs. Each wait is one entry of the poller's, not a thread: an event that takes long or
    never completes (a busy or stuck producer stream) holds up no other wait, and a wait that
    is cancelled is dropped.

    ``until``: a future whose end cuts the wait short, raising its exception (a channel's
    ``ended``: a send waiting for its producer stream must not outlive its channel, and a
    stream may stay busy for as long as the caller's device work runs). The event may then
    still be pending, and what was queued behind it stays queued.
    """
    if event.query():
        return
    start = time.perf_counter()
    while time.perf_counter() - start < _SPIN_SECONDS:
        await asyncio.sleep(0)
        if event.query():
            return
        if until is not None and until.done():
            _cut_short(until)
    poller = engine._poller
    fut = poller.watch(event)
    try:
        if until is None:
            await fut
            return
        await asyncio.wait((fut, until), return_when=asyncio.FIRST_COMPLETED)
        if not fut.done():
            _cut_short(until)
        fut.result()
    finally:
        poller.forget(fut)


def _cut_short(until: asyncio.Future[Any]) -> None:
    """Raise what ended ``until`` (a wait's ``until``, done), a copy of its own to each wait
    (``fresh``): every wait on a channel's ``ended`` raises its one failure, whose traceback
    would grow by each raiser's frames, and the channel would keep their tensors alive."""
    exc = None if until.cancelled() else until.exception()
    if exc is not None:
        raise fresh(exc)
    raise ClosedResourceError("the wait for a device event was cut short: its channel closed")


class _Poller:
    """An engine's thread that polls the events its ``wait_event`` calls are waiting for, and
    completes each wait's future in that wait's loop once its event has. It sleeps between
    rounds (10 us, doubling to 500 us while nothing completes) and is woken by a new wait; it
    ends after a second with nothing to wait for and starts again with the next wait."""

    IDLE_SECONDS = 1.0

    def __init__(self, name: str, started: Callable[[], None] = lambda: None) -> None:
        self._name = name
        self._started = started  # run first in each new thread (the engine's device made current)
        self._cv = threading.Condition()
        self._waits: dict[asyncio.Future[None], Event] = {}
        self._running = False
        self._fresh = False  # a wait came since the last round

    def watch(self, event: Event) -> asyncio.Future[None]:
        """A future of the running loop's, done once ``event`` has completed."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        with self._cv:
            self._waits[fut] = event
            self._fresh = True
            if not self._running:
                threading.Thread(target=self._run, name=self._name, daemon=True).start()
                self._running = True
            self._cv.notify()
        return fut

    def forget(self, fut: asyncio.Future[None]) -> None:
        """Stop polling for ``fut`` (done, or its wait cancelled)."""
        with self._cv:
            self._waits.pop(fut, None)

    def _run(self) -> None:
        try:
            self._started()
        except Exception as err:  # the queries below then say what is wrong, for each wait
            log.debug("%s: starting failed: %s", self._name, err)
        delay = 10e-6
        while True:
            with self._cv:
                if not self._waits and not self._cv.wait(self.IDLE_SECONDS) and not self._waits:
                    self._running = False
                    return
                self._fresh = False
                waits = list(self._waits.items())
            for fut, event in waits:
                try:
                    if not event.query():
                        continue
                    exc: BaseException | None = None
                except BaseException as e:  # a device error (TransferError): the wait raises it
                    exc = e
                with self._cv:
                    if self._waits.pop(fut, None) is None:
                        continue  # cancelled meanwhile
                delay = 10e-6
                with contextlib.suppress(RuntimeError):  # its loop is closed: nobody waits any more
                    fut.get_loop().call_soon_threadsafe(_complete, fut, exc)
            with self._cv:
                if self._waits and not self._fresh:
                    self._cv.wait(delay)
                if self._fresh:  # a new wait: polled at once, then soon
                    self._fresh = False
                    delay = 10e-6
                else:
                    delay = min(delay * 2, 500e-6)


def _complete(fut: asyncio.Future[None], exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is None:
        fut.set_result(None)
    else:
        fut.set_exception(exc)


# --------------------------------------------------------------------------- the host engine


class _HostEvent(Event):
    __slots__ = ("_flag",)

    def __init__(self) -> None:
        self._flag = threading.Event()

    def set(self) -> None:
        self._flag.set()

    def query(self) -> bool:
        return self._flag.is_set()

    def synchronize(self) -> None:
        self._flag.wait()


class _HostLane(Lane):
    """A worker thread that runs its queue in order, like a CUDA stream."""

    engine: HostEngine

    def __init__(self, engine: HostEngine) -> None:
        self.engine = engine
        self._queue: deque[Callable[[], None]] = deque()
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="tensorwire-host-lane", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue:
                    self._cv.wait()
                op = self._queue.popleft()
            if op is _STOP:
                return
            op()

    def _put(self, op: Callable[[], None]) -> None:
        with self._cv:
            self._queue.append(op)
            self._cv.notify()

    def close(self) -> None:
        self.stop()
        with contextlib.suppress(ValueError):
            self.engine._all_lanes.remove(self)

    def stop(self) -> None:
        self._put(_STOP)

    def _copy(self, dst: memoryview, src: memoryview) -> Callable[[], None]:
        engine = self.engine
        delay = engine.copy_delay
        engine.copy_queued(+1)

        def op() -> None:
            if delay:
                time.sleep(delay)
            # np.copyto lets go of the GIL for the copy, as a GPU's copy engine leaves the CPU
            # free; a memoryview assignment would hold it and stall the event loop meanwhile
            np.copyto(np.frombuffer(dst, np.uint8), np.frombuffer(src, np.uint8))
            engine.copy_queued(-1)

        return op

    def to_host(self, dst: HostChunk, dst_off: int, src: DeviceBuffer, src_off: int, n: int) -> None:
        self._put(self._copy(dst.view[dst_off : dst_off + n], _bytes(src)[src_off : src_off + n]))

    def to_device(self, dst: DeviceBuffer, dst_off: int, src: HostChunk, src_off: int, n: int) -> None:
        self._put(self._copy(_bytes(dst)[dst_off : dst_off + n], src.view[src_off : src_off + n]))

    def device_copy(self, dst: DeviceBuffer, dst_off: int, src: DeviceBuffer, src_off: int, n: int) -> None:
        self._put(self._copy(_bytes(dst)[dst_off : dst_off + n], _bytes(src)[src_off : src_off + n]))

    def record(self) -> Event:
        ev = _HostEvent()
        self._put(ev.set)
        return ev

    def _wait(self, event: Event) -> None:
        self._put(event.synchronize)


def _STOP() -> None:  # noqa: N802 - a sentinel
    return None


def _bytes(buf: DeviceBuffer) -> memoryview:
    arr = buf.owner
    if not isinstance(arr, np.ndarray):
        arr = arr.array  # an EngineArray
    assert isinstance(arr, np.ndarray), "host-engine buffers are numpy arrays"
    return arr.reshape(-1).view(np.uint8).data


class HostEngine(CopyEngine):
    """Host memory posing as device memory; each lane a thread. For tests and as a reference.

    ``copy_delay`` seconds are slept before every copy, so that copies are slower than the
    network and the pipeline's overlap and ordering are put to the test. ``poison`` fills a
    staging chunk with 0xA5 whenever it goes back to its pool, so that a chunk reused before
    its copy finished shows up as corrupted data.
    """

    kind = "host-engine"

    def __init__(self, device: int = 0, *, copy_delay: float = 0.0, poison: bool = True) -> None:
        super().__init__()
        self.device = device
        self.copy_delay = copy_delay
        self.poison = poison
        self.chunks_allocated = 0
        self.max_queued = 0  # most copies queued and not yet run at once (read-ahead, overlap)
        self._queued = 0
        self._all_lanes: list[_HostLane] = []
        self._streams: dict[int, _HostLane] = {}

    def copy_queued(self, delta: int) -> None:
        with self._lock:
            self._queued += delta
            self.max_queued = max(self.max_queued, self._queued)

    def close(self) -> None:
        """Stop every lane's thread (after what is queued on it), streams' too."""
        for lane in self._all_lanes:
            lane.stop()
        self._all_lanes.clear()
        self._lanes.clear()
        self._streams.clear()

    def _new_lane(self) -> _HostLane:
        lane = _HostLane(self)
        self._all_lanes.append(lane)
        return lane

    def host_chunk(self, nbytes: int) -> HostChunk:
        arr = np.empty(nbytes, np.uint8)
        self.chunks_allocated += 1
        return HostChunk(arr.data, int(arr.ctypes.data), nbytes, arr)

    def free_chunk(self, chunk: HostChunk) -> None:
        return None

    def empty(self, nbytes: int, stream: int | None = None) -> DeviceBuffer:
        with self.allocating(nbytes, "a buffer of tensorwire's"):
            arr = np.empty(nbytes, np.uint8)
        return DeviceBuffer(self, int(arr.ctypes.data), nbytes, self.device, arr)

    def buffer(self, arr: np.ndarray) -> DeviceBuffer:
        """A device buffer over a C-contiguous numpy array (no copy)."""
        if not arr.flags.c_contiguous:
            raise ValueError("host-engine buffers must be C-contiguous")
        return DeviceBuffer(self, int(arr.ctypes.data) if arr.size else 0, int(arr.nbytes), self.device, arr)

    def stream(self) -> int:
        """A new stream of this engine's, as a handle for ``EngineArray(..., stream=)``: a lane
        that plays a framework's stream (a producer's or a consumer's), so that the staging code's
        ordering against such streams runs here as on a GPU. Tensors without one have none, and a
        recv into them waits for its copies on the host."""
        lane = self._new_lane()
        self._streams[id(lane)] = lane
        return id(lane)

    def stream_lane(self, stream: int) -> Lane:
        """The lane behind a handle from :meth:`stream` (to queue work of the framework's on it)."""
        return self._streams[stream]

    def record_on(self, stream: int | None) -> Event:
        lane = None if stream is None else self._streams.get(stream)
        return DONE if lane is None else lane.record()

    def stream_wait(self, stream: int | None, event: Event) -> bool:
        lane = None if stream is None else self._streams.get(stream)
        if lane is None:
            return False
        lane.wait(event)
        return True

    def scrub(self, chunk: HostChunk) -> None:
        if self.poison:
            with contextlib.suppress(ValueError, TypeError):
                chunk.view[:] = b"\xa5" * chunk.size
