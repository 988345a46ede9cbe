"""The CUDA copy engine: streams, events and page-locked chunks through CuPy's runtime bindings.

Every call here takes raw handles (``cudaStream_t``/``cudaEvent_t`` as ints), so streams of
torch and of CuPy are treated alike. CuPy is imported only when a CUDA tensor is first met.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import logging
import threading
from collections.abc import Iterator
from types import ModuleType
from typing import Any

from ..errors import RegistrationError, TransferError, UnsupportedTensorError
from ._engine import DONE, CopyEngine, DeviceBuffer, Event, HostChunk, Lane

__all__ = ["CudaEngine", "CudaEvent", "allocating_on", "cuda_device_count", "cupy_module"]

log = logging.getLogger(__name__)

_NOT_READY = 600  # cudaErrorNotReady


@contextlib.contextmanager
def _queueing(rt: Any, what: str, device: int) -> Iterator[None]:
    """CUDA refusing to queue work (an asynchronous error of an earlier copy or kernel surfaces
    here, sticky; an invalid handle) as the TransferError it is for the transfer, not CuPy's
    CUDARuntimeError."""
    try:
        yield
    except rt.CUDARuntimeError as exc:
        raise TransferError(f"CUDA could not {what} on device {device}: {exc}") from exc


_engines: dict[int, CudaEngine] = {}
_engines_lock = threading.Lock()


class CudaUnavailableError(UnsupportedTensorError):
    """CUDA memory cannot be moved here: CuPy or a CUDA device is missing."""


def cupy_module() -> ModuleType:
    try:
        return importlib.import_module("cupy")
    except ImportError as exc:
        raise CudaUnavailableError(
            "moving CUDA tensors needs CuPy (its streams, events and pinned memory), and it could not "
            f"be imported ({exc}); install the build matching your CUDA, e.g. 'pip install cupy-cuda12x' "
            "or 'pip install cupy-cuda13x' (tensorwire[cuda] for CUDA 12, tensorwire[cuda13] for CUDA 13)"
        ) from exc


def cuda_device_count() -> int:
    """CUDA devices CuPy sees here; 0 without CuPy or a driver (never raises)."""
    try:
        cp = importlib.import_module("cupy")
        return int(cp.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


class CudaEvent(Event):
    __slots__ = ("_cp", "_rt", "device", "ptr")

    def __init__(self, cp: ModuleType, device: int) -> None:
        rt = cp.cuda.runtime
        self._cp = cp
        self._rt = rt
        self.device = device
        self.ptr = 0
        with cp.cuda.Device(device), _queueing(rt, "create an event", device):
            self.ptr = int(rt.eventCreateWithFlags(rt.eventDisableTiming))

    def record(self, stream: int) -> CudaEvent:
        # with this event's device current: the default streams' handles (0, and 2 for the
        # per-thread one) name the current device's stream, and CUDA refuses to record an event
        # on a stream of another device
        with self._cp.cuda.Device(self.device), _queueing(self._rt, "record an event", self.device):
            self._rt.eventRecord(self.ptr, stream)
        return self

    def query(self) -> bool:
        status = int(self._rt.eventQuery(self.ptr))
        if status == 0:
            return True
        if status == _NOT_READY:
            # the runtime may keep "not ready" as this thread's last error, where torch's next
            # launch check (cudaGetLastError) would read it as a failure: clear it, as torch's
            # own event and stream queries do (check_status calls cudaGetLastError, then raises)
            with contextlib.suppress(self._rt.CUDARuntimeError):
                self._rt.check_status(status)
            return False
        # any other status is a sticky CUDA error: let the runtime say which, in our error tree
        self.synchronize()
        return True

    def synchronize(self) -> None:
        try:
            self._rt.eventSynchronize(self.ptr)
        except Exception as exc:  # cupy's CUDARuntimeError: the device failed a copy or kernel
            raise TransferError(f"CUDA reported an error on device {self.device} during a copy: {exc}") from exc

    def __del__(self) -> None:
        if not self.ptr:
            return  # never created
        try:
            self._rt.eventDestroy(self.ptr)
        except Exception:  # interpreter shutdown or a dead context: nothing left to free
            pass


class CudaLane(Lane):
    """A non-blocking CUDA stream of tensorwire's own on one device."""

    engine: CudaEngine

    def __init__(self, engine: CudaEngine) -> None:
        self.engine = engine
        cp = engine.cp
        self._rt = cp.cuda.runtime
        self.stream = 0
        with cp.cuda.Device(engine.device), _queueing(self._rt, "create a stream", engine.device):
            self.stream = int(self._rt.streamCreateWithFlags(self._rt.streamNonBlocking))

    def _memcpy(self, dst: int, src: int, n: int, kind: int) -> None:
        if n:
            with _queueing(self._rt, f"queue a copy of {n} bytes", self.engine.device):
                self._rt.memcpyAsync(dst, src, n, kind, self._live())

    def to_host(self, dst: HostChunk, dst_off: int, src: DeviceBuffer, src_off: int, n: int) -> None:
        self._memcpy(dst.ptr + dst_off, src.ptr + src_off, n, self._rt.memcpyDeviceToHost)

    def to_device(self, dst: DeviceBuffer, dst_off: int, src: HostChunk, src_off: int, n: int) -> None:
        self._memcpy(dst.ptr + dst_off, src.ptr + src_off, n, self._rt.memcpyHostToDevice)

    def device_copy(self, dst: DeviceBuffer, dst_off: int, src: DeviceBuffer, src_off: int, n: int) -> None:
        self._memcpy(dst.ptr + dst_off, src.ptr + src_off, n, self._rt.memcpyDeviceToDevice)

    def record(self) -> Event:
        return CudaEvent(self.engine.cp, self.engine.device).record(self._live())

    def _live(self) -> int:
        if not self.stream:  # closed: never fall through to the legacy default stream (handle 0)
            raise TransferError("a closed CUDA lane of tensorwire's was used")
        return self.stream

    def close(self) -> None:
        stream, self.stream = self.stream, 0
        if stream:
            try:
                self._rt.streamDestroy(stream)  # CUDA frees it once its queued work has run
            except Exception as exc:  # a dead context: nothing left to free
                log.debug("CUDA stream destroy failed: %s", exc)

    def _wait(self, event: Event) -> None:
        if not isinstance(event, CudaEvent):
            raise UnsupportedTensorError("a CUDA stream cannot wait for an event of another engine")
        with _queueing(self._rt, "make a stream wait for an event", self.engine.device):
            self._rt.streamWaitEvent(self._live(), event.ptr, 0)


class CudaEngine(CopyEngine):
    """Copies between one CUDA device and page-locked host chunks, on streams of its own."""

    kind = "cuda"

    def __init__(self, device: int) -> None:
        super().__init__()
        self.cp = cupy_module()
        self.device = device

    @classmethod
    def get(cls, device: int) -> CudaEngine:
        engine = _engines.get(device)
        if engine is None:
            with _engines_lock:
                engine = _engines.get(device)
                if engine is None:
                    engine = _engines[device] = cls(device)
        return engine

    def _poller_started(self) -> None:
        # a new thread's current device is 0, and its first query of an event would give this
        # process a context on GPU 0 (half a GiB there) even where it uses only this device
        self.cp.cuda.runtime.setDevice(self.device)

    def _new_lane(self) -> Lane:
        return CudaLane(self)

    def host_chunk(self, nbytes: int) -> HostChunk:
        rt = self.cp.cuda.runtime
        try:
            ptr = int(rt.hostAlloc(nbytes, rt.hostAllocPortable))
        except Exception as exc:  # cupy's CUDARuntimeError (out of memory, no device, ...)
            raise RegistrationError(
                f"could not page-lock {nbytes} bytes of host memory for CUDA staging: {exc}"
            ) from exc
        raw = (ctypes.c_uint8 * nbytes).from_address(ptr)
        return HostChunk(memoryview(raw).cast("B"), ptr, nbytes, raw)

    def free_chunk(self, chunk: HostChunk) -> None:
        self.cp.cuda.runtime.freeHost(chunk.ptr)

    def empty(self, nbytes: int, stream: int | None = None) -> DeviceBuffer:
        cp = self.cp
        with self.allocating(nbytes, "a buffer of tensorwire's"), allocating_on(cp, self.device, stream):
            arr = cp.empty(nbytes, dtype=cp.uint8)
        return DeviceBuffer(self, int(arr.data.ptr), nbytes, self.device, arr)

    def record_on(self, stream: int | None) -> Event:
        if stream is None or self._idle(stream):
            return DONE
        return CudaEvent(self.cp, self.device).record(stream)

    def _idle(self, stream: int) -> bool:
        """Whether ``stream`` has nothing queued that has yet to run (``cudaStreamQuery``): then
        nothing needs an event to wait for its work so far. An event recorded on such a stream
        and asked at once may not have been reached by the device yet, and its waiter would
        poll (a loop turn or more, or the event poller) for work that was all done; and the
        event costs a create and a record. Any other answer (busy, or a stream under graph
        capture) is left to the event."""
        rt = self.cp.cuda.runtime
        # with the device current: a default stream's handle (0, 2) names the current device's
        with self.cp.cuda.Device(self.device):
            status = int(rt.streamQuery(stream))
        if status == 0:
            return True
        # not ready (or not askable): cleared, so that torch's next launch check does not read
        # it as a failure (as CudaEvent.query does)
        with contextlib.suppress(rt.CUDARuntimeError):
            rt.check_status(status)
        return False

    def stream_wait(self, stream: int | None, event: Event) -> bool:
        if stream is None:
            return False
        if isinstance(event, CudaEvent):
            rt = self.cp.cuda.runtime
            # with the device current: a default stream's handle names the current device's
            with self.cp.cuda.Device(self.device), _queueing(rt, "make a stream wait for an event", self.device):
                rt.streamWaitEvent(stream, event.ptr, 0)
        return True


@contextlib.contextmanager
def allocating_on(cp: ModuleType, device: int, stream: int | None) -> Iterator[None]:
    """CuPy allocations inside come from ``device``, from the pool arena of ``stream`` (None: the
    current one). CuPy hands a freed block to the next allocation on the same stream without
    waiting, so memory must be taken from the stream that orders its uses."""
    with cp.cuda.Device(device):
        if stream is None:
            yield
            return
        from ..native._pack import _resolve_stream

        with _resolve_stream(cp, stream):
            yield


def lane_stream(lane: Lane) -> Any:
    """The raw ``cudaStream_t`` of a CUDA lane (for kernels launched on it)."""
    assert isinstance(lane, CudaLane)
    return lane._live()
