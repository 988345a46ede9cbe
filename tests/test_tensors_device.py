"""Device tensors without a GPU: ``device=`` parsing and errors, and the staging pipeline run
for real with the host copy engine (a worker thread per lane standing in for a CUDA stream,
optionally slow, chunks poisoned on reuse) over real sockets.

The CUDA engine runs the same pipeline code; tests/gpu/test_cuda_p2p.py checks it on a GPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import itertools
import time
import warnings
from typing import Any

import numpy as np
import pytest

import tensorwire
from tensorwire.errors import ConfigurationError, ShapeMismatchError, TransferError, UnsupportedTensorError
from tensorwire.memory import DeviceBuffer, HostChunk, HostEngine, StageIn, download, scatter, stage_out, wait_event
from tensorwire.tensors import Device, EngineArray, parse_device, prepare
from tensorwire.testing import (
    CHECKS,
    busy_stream,
    cancel_recv_at_every_step,
    connected_pair,
    exchange,
    host_engine_by_pointer,
)
from tensorwire.transports import Limits

CHUNK = 64 * 1024
DEPTH = 3
_NO_UCXX = importlib.util.find_spec("ucxx") is None


@pytest.fixture
def engine() -> HostEngine:
    e = HostEngine(copy_delay=0.0002)
    e.pool("out").configure(CHUNK, DEPTH)
    e.pool("in").configure(CHUNK, DEPTH)
    yield e
    e.close()


def _bytes(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


# -- device= ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("spec", "want"),
    [
        (None, None),
        ("cpu", Device("cpu")),
        ("cpu:0", Device("cpu")),
        ("cuda", Device("cuda")),
        ("cuda:0", Device("cuda", 0)),
        (" cuda:3 ", Device("cuda", 3)),
        (2, Device("cuda", 2)),
        (np.int64(1), Device("cuda", 1)),
    ],
)
def test_parse_device(spec: object, want: Device | None) -> None:
    assert parse_device(spec) == want


def test_parse_torch_device() -> None:
    torch = pytest.importorskip("torch")
    assert parse_device(torch.device("cuda", 1)) == Device("cuda", 1)
    assert parse_device(torch.device("cuda")) == Device("cuda")
    assert parse_device(torch.device("cpu")) == Device("cpu")
    with pytest.raises(ConfigurationError, match="meta"):
        parse_device(torch.device("meta"))


@pytest.mark.parametrize(
    "bad", ["gpu", "cuda:", "cuda:-1", "mps", "cuda:0:1", "", True, -1, 1.5, b"cuda", "cpu:1", " cpu:01 "]
)
def test_bad_devices_are_configuration_errors(bad: object) -> None:
    with pytest.raises(ConfigurationError):
        parse_device(bad)


async def test_recv_device_errors_come_from_the_call() -> None:
    async with connected_pair("tcp") as (a, b):
        with pytest.raises(ConfigurationError, match="mps"):
            await b.recv(tag="t", device="mps")
        with pytest.raises(ConfigurationError, match="not both"):
            await b.recv(tag="t", device="cpu", out=np.empty(3))
        with pytest.raises(ConfigurationError, match="unknown device 'cpu:1'"):  # was taken for "cpu"
            async with asyncio.timeout(5):  # (it waited for a message)
                await b.recv(tag="t", device="cpu:1")
        if importlib.util.find_spec("cupy") is None:
            with pytest.raises(UnsupportedTensorError, match="CuPy"):
                await b.recv(tag="t", device="cuda:0")
        # nothing was consumed by the failed calls
        await a.send(np.arange(3), tag="t")
        got = await b.recv(tag="t", device="cpu")
        assert np.array_equal(got, np.arange(3))


@pytest.mark.parametrize("transport", ["tcp", "inproc"])
async def test_cupy_without_a_gpu_leaves_receivers_host_only(transport: str) -> None:
    """CuPy installed on a machine with no usable GPU (a CPU box, a CI runner): importing it must
    not make receives look for a current CUDA device; device="cuda" fails with what is missing."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pytest.importorskip("cupy", reason="CuPy is not installed here (it is in the dev extra)", exc_type=ImportError)
    from tensorwire.memory._cuda import cuda_device_count

    if cuda_device_count():
        pytest.skip("this machine has a CUDA device: tests/gpu cover it")
    async with connected_pair(transport) as (a, b):
        recv = asyncio.ensure_future(b.recv(tag="h"))
        await a.send({"x": np.arange(10), "n": 3}, tag="h")
        got = await recv
        assert isinstance(got["x"], np.ndarray) and np.array_equal(got["x"], np.arange(10)) and got["n"] == 3
        with pytest.raises(UnsupportedTensorError, match="no CUDA device"):
            await b.recv(tag="h", device="cuda")
        await a.send(np.ones(4), tag="h")  # the failed call consumed nothing
        assert np.array_equal(await b.recv(tag="h", out=np.zeros(4)), np.ones(4))


class _Interface:
    """Another library's CUDA array, as far as its ``__cuda_array_interface__`` goes."""

    def __init__(self, cai: dict[str, object]) -> None:
        self._cai = cai

    @property
    def __cuda_array_interface__(self) -> dict[str, object]:
        return self._cai


@pytest.mark.parametrize(
    ("cai", "match"),
    [
        ({"shape": (4,), "typestr": "<f4", "version": 3}, "no usable __cuda_array_interface__"),
        ({"data": (0, False), "shape": (4,), "typestr": "<f4", "mask": object(), "version": 3}, "masked"),
        ({"data": (0, False), "shape": (4,), "typestr": "<f4", "stream": "s", "version": 3}, "stream must be"),
        ({"data": (0, False), "shape": (4,), "typestr": "<f4", "stream": 0, "version": 3}, "stream must be"),
        ({"data": (0, False), "shape": (2,), "typestr": "<U4", "version": 3}, "not supported"),
    ],
    ids=["no-data", "masked", "bad-stream", "stream-0", "bad-dtype"],
)
async def test_bad_cuda_array_interfaces_fail_the_send_alone(cai: dict[str, object], match: str) -> None:
    """Objects exposing a broken ``__cuda_array_interface__`` get a clear error from the send
    (read without CuPy importing them, which would synchronize on the host), and nothing is sent."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pytest.importorskip("cupy", reason="CuPy is not installed here (it is in the dev extra)", exc_type=ImportError)
    async with connected_pair("tcp") as (a, b):
        with pytest.raises(UnsupportedTensorError, match=match):
            await a.send({"x": _Interface(cai)}, tag="i")
        await a.send(7, tag="i")
        assert await b.recv(tag="i") == 7


@pytest.mark.parametrize(("own", "want"), [(True, 5), (False, 111)], ids=["interface-stream", "framework-stream"])
def test_a_recv_target_keeps_the_stream_its_object_names(own: bool, want: int) -> None:
    """A recv's out= is written in order with its consumer stream: CuPy's current stream, taken at
    the call, for CuPy arrays; but the stream a ``__cuda_array_interface__`` names (v3 ``stream``:
    where its owner uses the memory) for another library's array, which CuPy's current stream
    must not replace (it did once: the copies then raced the owner's pending work on its stream)."""
    from tensorwire.tensors._device import DeviceSource, Streams

    engine = HostEngine()
    engine.kind = "cuda"  # target() takes the caller's streams only for CUDA memory
    data = np.zeros(4, np.float32)
    src = DeviceSource(data, "cupy", engine, "float32", (4,), int(data.ctypes.data), (4,), True, 5, own_stream=own)
    target = src.target(Streams(device=0, torch=None, cupy=111))
    assert target.stream == want and target.buf.ptr == src.ptr
    assert src.target(Streams(device=1, torch=None, cupy=111)).stream == 5  # another device's: not taken


@pytest.mark.parametrize(
    ("shape", "strides"),
    [((2, 3), (0, 4)), ((3, 4), (4, 4)), ((4, 4), (8, 4)), ((2, 2, 2), (4, 16, 4))],
    ids=["expand", "windows", "rows-overlap", "interleaved"],
)
def test_a_device_out_whose_elements_share_memory_is_refused(shape: tuple[int, ...], strides: tuple[int, ...]) -> None:
    """A device out= laid out so that two elements share bytes (not only a zero stride, which
    was all that was refused: as_strided windows went on to a scatter that kept the last of
    each shared element) is refused before anything is written."""
    from tensorwire.tensors._device import DeviceSource

    engine = HostEngine()
    data = np.zeros(64, np.float32)
    src = DeviceSource(data, "cupy", engine, "float32", shape, int(data.ctypes.data), strides, False, 0)
    with pytest.raises(UnsupportedTensorError, match="elements that share memory"):
        src.target()


@pytest.mark.parametrize(
    ("shape", "strides", "want"),
    [
        ((3, 4), (16, 4), False),
        ((3, 4), (4, 12), False),
        ((4, 3), (4, 16), False),  # gaps between rows
        ((2, 3), (-12, 4), False),
        ((5,), (0,), True),
        ((1, 5), (0, 4), False),  # a zero stride over one element shares nothing
        ((0, 5), (0, 0), False),
        ((3, 4), (4, 4), True),
        ((2, 2, 2), (4, 16, 4), True),  # interleaved: 0,4,16,20 / 4,8,20,24 collide
        ((2, 2, 2), (4, 16, 8), False),  # interleaved and disjoint: 0,4,8,12,16,...
    ],
)
def test_overlapping_layouts_agree_with_a_brute_force_count(
    shape: tuple[int, ...], strides: tuple[int, ...], want: bool
) -> None:
    from tensorwire.tensors._device import overlapping

    offsets = [sum(i * s for i, s in zip(idx, strides, strict=True)) for idx in np.ndindex(*shape)]
    brute = any(abs(a - b) < 4 for k, a in enumerate(offsets) for b in offsets[k + 1 :])
    assert brute == want
    assert overlapping(shape, strides, 4) == want


class _FakeCudaRuntime:
    """The few CuPy runtime calls the CUDA engine's events make, recording which device was
    current at each (CUDA's default streams, handle 0, are the current device's)."""

    eventDisableTiming = 2  # noqa: N815 - CuPy's names
    CUDARuntimeError = RuntimeError

    def __init__(self) -> None:
        self.current = 0
        self.calls: list[tuple[str, int, int]] = []  # (call, stream, current device)
        self.idle = False  # what cudaStreamQuery says of every stream (busy: events are recorded)

    def streamQuery(self, stream: int) -> int:  # noqa: N802
        self.calls.append(("query", stream, self.current))
        return 0 if self.idle else 600  # cudaSuccess, or cudaErrorNotReady

    def check_status(self, status: int) -> None:
        if status:
            raise self.CUDARuntimeError(f"status {status}")

    def eventCreateWithFlags(self, flags: int) -> int:  # noqa: N802
        return 0x1000 + len(self.calls)

    def eventRecord(self, event: int, stream: int) -> None:  # noqa: N802
        self.calls.append(("record", stream, self.current))

    def streamWaitEvent(self, stream: int, event: int, flags: int) -> None:  # noqa: N802
        self.calls.append(("wait", stream, self.current))

    def eventDestroy(self, event: int) -> None:  # noqa: N802
        return None


class _FailingCudaRuntime(_FakeCudaRuntime):
    """A runtime whose every call to queue work fails as CUDA's do after a device fault (the
    error is sticky: cudaErrorIllegalAddress, 700)."""

    streamNonBlocking = 1  # noqa: N815 - CuPy's names
    memcpyDeviceToHost, memcpyHostToDevice, memcpyDeviceToDevice = 2, 1, 3  # noqa: N815

    def __init__(self, fail: str) -> None:
        super().__init__()
        self.fail = fail

    def _maybe_fail(self, call: str) -> None:
        if call == self.fail:
            raise self.CUDARuntimeError("cudaErrorIllegalAddress: an illegal memory access was encountered")

    def streamCreateWithFlags(self, flags: int) -> int:  # noqa: N802
        self._maybe_fail("streamCreate")
        return 0x77

    def eventCreateWithFlags(self, flags: int) -> int:  # noqa: N802
        self._maybe_fail("eventCreate")
        return super().eventCreateWithFlags(flags)

    def eventRecord(self, event: int, stream: int) -> None:  # noqa: N802
        self._maybe_fail("eventRecord")
        super().eventRecord(event, stream)

    def streamWaitEvent(self, stream: int, event: int, flags: int) -> None:  # noqa: N802
        self._maybe_fail("streamWaitEvent")
        super().streamWaitEvent(stream, event, flags)

    def memcpyAsync(self, dst: int, src: int, n: int, kind: int, stream: int) -> None:  # noqa: N802
        self._maybe_fail("memcpyAsync")

    def eventQuery(self, event: int) -> int:  # noqa: N802
        return 600  # cudaErrorNotReady: the stream it was recorded on is busy

    def check_status(self, status: int) -> None:
        raise self.CUDARuntimeError(f"status {status}")


@pytest.mark.parametrize("fail", ["streamCreate", "eventCreate", "eventRecord", "streamWaitEvent", "memcpyAsync"])
def test_cuda_refusing_to_queue_work_is_a_transfer_error(monkeypatch: pytest.MonkeyPatch, fail: str) -> None:
    """A sticky device error surfaces at the next call that queues work: the staging pipeline
    sees a TransferError (it returns or retires the chunk involved), not CuPy's own error."""
    import types

    from tensorwire.memory import _cuda
    from tensorwire.memory._engine import DeviceBuffer, HostChunk

    rt = _FailingCudaRuntime(fail)
    cp = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=rt, Device=lambda n: contextlib.nullcontext()))
    monkeypatch.setattr(_cuda, "cupy_module", lambda: cp)
    engine = _cuda.CudaEngine(0)
    chunk = HostChunk(memoryview(bytearray(16)), 0x2000, 16, None)
    buf = DeviceBuffer(engine, 0x3000, 16, 0, None)

    def work() -> None:
        lane = engine.lane()
        lane.to_host(chunk, 0, buf, 0, 16)
        lane.wait(engine.record_on(5))
        engine.stream_wait(5, lane.record())

    with pytest.raises(TransferError, match=r"CUDA could not .* on device 0: cudaErrorIllegalAddress"):
        work()


def _engine_on_device_1(monkeypatch: pytest.MonkeyPatch) -> tuple[_FakeCudaRuntime, Any]:
    """A CUDA engine of device 1 over the stand-in runtime, whose ``cupy.cuda.Device`` makes a
    device current the way CuPy's does (and back after): the runtime and the engine."""
    import types

    from tensorwire.memory import _cuda

    rt = _FakeCudaRuntime()

    @contextlib.contextmanager
    def device(n: int) -> Any:
        before, rt.current = rt.current, n
        try:
            yield
        finally:
            rt.current = before

    cp = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=rt, Device=device))
    monkeypatch.setattr(_cuda, "cupy_module", lambda: cp)
    return rt, _cuda.CudaEngine(1)


def test_cuda_events_are_recorded_and_waited_for_with_their_device_current(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tensor on cuda:1 while cuda:0 is current, on its device's default stream (handle 0, as
    torch.cuda.current_stream(1).cuda_stream gives it): the event must be recorded, and the
    stream made to wait, with cuda:1 current, else handle 0 is cuda:0's stream (CUDA refuses an
    event of device 1 there, or a wait orders the wrong device's work)."""
    rt, engine = _engine_on_device_1(monkeypatch)
    event = engine.record_on(0)
    assert engine.stream_wait(0, event)
    assert rt.calls == [("query", 0, 1), ("record", 0, 1), ("wait", 0, 1)]
    assert rt.current == 0  # and the caller's device is current again


def test_an_idle_cuda_stream_gets_no_event(monkeypatch: pytest.MonkeyPatch) -> None:
    """``record_on`` asks the stream first (cudaStreamQuery, its device current): one with nothing
    queued needs no event (DONE), and none is created or recorded. An event recorded there and
    asked at once may not have been reached by the device yet, and its waiter polled (a loop turn
    or the poller thread) for work all done; a stream with work queued gets its event."""
    from tensorwire.memory._engine import DONE

    rt, engine = _engine_on_device_1(monkeypatch)
    rt.idle = True
    assert engine.record_on(7) is DONE
    assert rt.calls == [("query", 7, 1)]
    assert engine.record_on(None) is DONE  # (no stream: nothing asked)
    assert rt.calls == [("query", 7, 1)]
    rt.idle = False
    event = engine.record_on(7)
    assert event is not DONE
    assert rt.calls[1:] == [("query", 7, 1), ("record", 7, 1)]


async def test_the_cuda_engines_poller_thread_makes_its_device_current_before_it_queries(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The thread that polls a waited-for event starts with device 0 current, as every new thread
    does; its first cudaEventQuery would make GPU 0's context current there, giving a process that
    uses only cuda:1 a context (half a GiB) on GPU 0. The engine's device is made current first."""
    import threading
    import types

    from tensorwire.memory import _cuda

    loop_thread = threading.get_ident()

    class Runtime(_FakeCudaRuntime):
        def __init__(self) -> None:
            super().__init__()
            self.devices: dict[int, int] = {}  # thread -> its current device (each starts at 0)
            self.queries: list[tuple[bool, int]] = []  # (in the loop's thread?, its device current)

        def setDevice(self, device: int) -> None:  # noqa: N802
            self.devices[threading.get_ident()] = device

        def eventQuery(self, event: int) -> int:  # noqa: N802
            me = threading.get_ident()
            self.queries.append((me == loop_thread, self.devices.get(me, 0)))
            # "not ready" to the loop however often it asks in its spin (any fixed count of asks
            # could all fit in the spin on a fast machine): the wait goes to the poller
            return 600 if me == loop_thread else 0

        def check_status(self, status: int) -> None:
            raise self.CUDARuntimeError(f"status {status}")

    rt = Runtime()
    cp = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=rt, Device=lambda n: contextlib.nullcontext()))
    monkeypatch.setattr(_cuda, "cupy_module", lambda: cp)
    engine = _cuda.CudaEngine(1)
    async with asyncio.timeout(10):
        await wait_event(engine, engine.record_on(0))
    polled = [device for on_loop, device in rt.queries if not on_loop]
    assert polled, "the wait never reached the poller thread"
    assert set(polled) == {1}, f"the poller queried with device {polled[0]} current"


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [((5, 3, 4), np.int32), ((7,), np.float64), ((), np.float16), ((1, 1, 9), np.uint8), ((2, 1, 3), np.complex128)],
)
def test_c_strides_are_those_of_a_c_contiguous_array(shape: tuple[int, ...], dtype: type) -> None:
    """The strides a CUDA view of an exposed tensor's rows is built with (``DeviceSource.region``)
    and that a ``__cuda_array_interface__``'s are compared against. Numpy 2 gives a zero-size
    array zero strides, so they cannot be read off ``np.empty((0, ...))`` (they were, once)."""
    from tensorwire.tensors._device import _c_strides

    assert _c_strides(shape, np.dtype(dtype)) == np.zeros(shape, dtype).strides
    assert _c_strides((4, 0, 3), np.dtype(np.int32)) == (12, 12, 4)


@pytest.mark.parametrize(
    ("shape", "given", "want"),
    [
        ((5, 3, 4), None, ((48, 16, 4), True)),
        ((5, 3, 4), (48, 16, 4), ((48, 16, 4), True)),
        ((3, 5), (4, 12), ((4, 12), False)),  # a transpose
        ((5, 4), (32, 4), ((32, 4), False)),  # every other row
        ((1, 4), (999, 4), ((999, 4), True)),  # a dimension of 1 has any stride
        ((4, 1), (4, 0), ((4, 0), True)),
        ((0, 4), (7, 3), ((7, 3), True)),  # no elements
    ],
)
def test_cuda_array_interface_layouts(
    shape: tuple[int, ...], given: tuple[int, ...] | None, want: tuple[tuple[int, ...], bool]
) -> None:
    from tensorwire.tensors._device import _layout

    assert _layout(shape, np.dtype(np.int32), given) == want


def test_cuda_array_interface_with_strides_of_another_rank_is_refused() -> None:
    from tensorwire.tensors._device import _layout

    with pytest.raises(UnsupportedTensorError, match="2 strides for 3 dimensions"):
        _layout((2, 3, 4), np.dtype(np.int32), (16, 4))


async def test_device_cpu_gives_host_tensors_of_the_senders_framework() -> None:
    torch = pytest.importorskip("torch")
    async with connected_pair("tcp") as (a, b):
        await a.send({"t": torch.arange(5.0)}, tag="t")
        got = await b.recv(tag="t", device="cpu")
        assert isinstance(got["t"], torch.Tensor) and got["t"].device.type == "cpu"
        assert torch.equal(got["t"], torch.arange(5.0))


# -- the pipeline alone ---------------------------------------------------------------------------
@pytest.mark.parametrize(("start", "end"), [(0, 1), (0, CHUNK), (5, CHUNK * 7 + 3), (CHUNK - 1, CHUNK * 2 + 1)])
async def test_stage_out_yields_the_range_in_order(engine: HostEngine, start: int, end: int) -> None:
    data = _bytes(CHUNK * 8, start)
    buf = engine.buffer(data)
    seen = []
    gen = stage_out(buf, start, end)
    async for off, view in gen:
        assert len(view) <= CHUNK
        seen.append((off, bytes(view)))
    assert [o for o, _ in seen] == sorted(o for o, _ in seen)
    assert b"".join(v for _, v in seen) == data[start:end].tobytes()
    assert engine.chunks_allocated <= DEPTH


async def test_stage_out_copies_ahead_of_the_consumer(engine: HostEngine) -> None:
    """While the consumer holds chunk k, the copies of the chunks after it are already queued."""
    data = _bytes(CHUNK * 10, 1)
    out = np.zeros_like(data)
    await download(engine.buffer(data), out.data)
    assert np.array_equal(out, data)
    assert engine.max_queued >= 2


async def test_stage_out_closed_early_returns_its_chunks(engine: HostEngine) -> None:
    data = _bytes(CHUNK * 10, 2)
    gen = stage_out(engine.buffer(data), 0, data.nbytes)
    async for _ in gen:
        break
    await gen.aclose()
    pool = engine.pool("out")
    assert pool.free == DEPTH
    out = np.zeros_like(data)  # the pool still works, and poisoned chunks never leak through
    await download(engine.buffer(data), out.data)
    assert np.array_equal(out, data)


async def test_stage_in_overlaps_and_lands_every_byte(engine: HostEngine) -> None:
    src = _bytes(CHUNK * 9 + 17, 3)
    dst = engine.empty(src.nbytes)
    st = StageIn(engine)
    fills = []

    async def fill(view: memoryview, pos: int) -> None:
        fills.append(pos)
        await asyncio.sleep(0)
        view[:] = src[pos : pos + len(view)].data

    await st.write(lambda: dst, 0, src.nbytes, fill)
    event = st.finish()
    assert event is not None
    await wait_event(engine, event)
    assert np.array_equal(dst.owner, src)
    assert fills == list(range(0, src.nbytes, CHUNK))
    assert engine.max_queued >= 2  # chunk k+1 was filled while chunk k's copy was queued
    assert engine.chunks_allocated <= DEPTH


async def test_stage_in_fill_failure_gives_the_chunk_back(engine: HostEngine) -> None:
    dst = engine.empty(CHUNK * 2)

    def fill(view: memoryview, pos: int) -> None:
        raise RuntimeError("socket gone")

    with pytest.raises(RuntimeError):
        await StageIn(engine).write(lambda: dst, 0, dst.nbytes, fill)
    assert engine.pool("in").free == DEPTH


# -- pieces: one-sided operations through the staging chunks ----------------------------------
_SIZES = [1, 100, CHUNK * 2 + 5, 0, CHUNK - 3, 7, CHUNK * 4]


class _Mover:
    """``fetch``/``push`` for ``StageIn.gather`` and ``scatter`` as a one-sided transport does
    them: each call a batch of copies between a chunk and "remote" arrays, finished after a
    short wait; it records how many run at once, and can be told to fail one call."""

    def __init__(self, remote: list[np.ndarray], *, fail_at: int | None = None, hold: float = 0.002) -> None:
        self.remote = remote
        self.fail_at = fail_at
        self.hold = hold
        self.calls: list[list[tuple[int, int, int, int]]] = []
        self.running = 0
        self.most = 0
        self.running_when_failed: int | None = None
        self.broken = 0  # calls that failed or were stopped

    async def _go(self, pieces: list[tuple[int, int, int, int]]) -> int:
        n = len(self.calls)
        self.calls.append(pieces)
        self.running += 1
        self.most = max(self.most, self.running)
        try:
            if n == self.fail_at:
                await asyncio.sleep(self.hold / 2)
                self.running_when_failed = self.running
                self.broken += 1
                raise TransferError("remote gone")
            try:
                await asyncio.sleep(self.hold)
            except asyncio.CancelledError:
                self.broken += 1
                await asyncio.sleep(self.hold)  # what was posted finishes first, as UCX and verbs do
                raise
            return n
        finally:
            self.running -= 1

    async def fetch(self, chunk: HostChunk, pieces: list[tuple[int, int, int, int]]) -> None:
        await self._go(pieces)
        for i, pos, off, k in pieces:
            chunk.array[off : off + k] = self.remote[i][pos : pos + k]

    async def push(self, chunk: HostChunk, pieces: list[tuple[int, int, int, int]]) -> None:
        for i, pos, off, k in pieces:
            self.remote[i][pos : pos + k] = chunk.array[off : off + k]
        await self._go(pieces)


async def _gathered(engine: HostEngine, dsts: list[DeviceBuffer], mover: _Mover) -> None:
    """``gather`` into ``dsts``, and wait until every copy has landed."""
    st = StageIn(engine)
    await st.gather(dsts, mover.fetch, spoiled=lambda: False)
    event = st.finish()
    assert event is not None
    await wait_event(engine, event)


async def test_gather_lays_tensors_end_to_end_across_chunks(engine: HostEngine) -> None:
    """Small tensors share a chunk, large ones span several, empty ones take none; several
    chunks are fetched at once (at most the pool's depth) and every byte lands."""
    src = [_bytes(n, 10 + n) for n in _SIZES]
    dsts = [engine.empty(n) for n in _SIZES]
    mover = _Mover(src)
    await _gathered(engine, dsts, mover)
    for d, s in zip(dsts, src, strict=True):
        assert np.array_equal(d.owner, s)
    assert [i for i, *_ in mover.calls[0]] == [0, 1, 2]  # 1 and 100 bytes share the first chunk
    for pieces in mover.calls:
        assert sum(k for *_, k in pieces) <= CHUNK
        assert all(k > 0 for *_, k in pieces)
    assert sum(k for pieces in mover.calls for *_, k in pieces) == sum(_SIZES)
    assert len(mover.calls) == -(-sum(_SIZES) // CHUNK)  # no chunk left part empty but the last
    assert 2 <= mover.most <= DEPTH
    assert engine.pool("in").free == DEPTH and engine.chunks_allocated <= DEPTH


@pytest.mark.parametrize("spoiled", [False, True], ids=["open", "closing"])
async def test_gather_failure_settles_every_fetch_first(engine: HostEngine, spoiled: bool) -> None:
    """A failed fetch is raised once every other fetch in flight has ended; the chunks go back
    to the pool, unless the transport no longer waits for what it posted (``spoiled``): the
    failed and stopped fetches' chunks are then retired, never handed out again."""
    src = [_bytes(CHUNK * 6, 4)]
    dsts = [engine.empty(CHUNK * 6)]
    mover = _Mover(src, fail_at=1, hold=0.01)
    pool = engine.pool("in")
    with pytest.raises(TransferError, match="remote gone"):
        await StageIn(engine).gather(dsts, mover.fetch, spoiled=lambda: spoiled)
    assert mover.running == 0  # nothing still writes into a chunk
    assert mover.running_when_failed is not None and mover.running_when_failed >= 2
    assert pool.free == DEPTH
    # the failed fetch's chunk, and those of fetches stopped (begun or not)
    if spoiled:
        assert pool.retired >= mover.broken >= 1
    else:
        assert pool.retired == 0
    await _gathered(engine, dsts, _Mover(src))
    assert np.array_equal(dsts[0].owner, src[0])
    assert engine.chunks_allocated == DEPTH + pool.retired  # retired ones were replaced, not reused


async def test_gather_cancelled_returns_after_its_fetches(engine: HostEngine) -> None:
    src = [_bytes(CHUNK * 6, 5)]
    dsts = [engine.empty(CHUNK * 6)]
    mover = _Mover(src, hold=0.05)
    task = asyncio.ensure_future(StageIn(engine).gather(dsts, mover.fetch, spoiled=lambda: False))
    await asyncio.sleep(0.02)  # the first fetches are under way (each holds 50 ms)
    assert mover.running >= 2
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert mover.running == 0  # every fetch ended before the cancel returned
    assert engine.pool("in").free == DEPTH and engine.pool("in").retired == 0


async def test_scatter_copies_after_the_producer_and_pushes_every_byte(engine: HostEngine) -> None:
    """The copies down wait for the producers' events (here: a busy stream that then writes the
    source); each chunk is pushed once its copies are done, several at once."""
    final = [_bytes(n, 20 + n) for n in _SIZES]
    srcs = [engine.buffer(np.zeros(n, np.uint8)) for n in _SIZES]
    remote = [np.zeros(n, np.uint8) for n in _SIZES]
    mover = _Mover(remote)
    with busy_stream(engine) as (stream, gate):
        lane = engine.stream_lane(stream)
        for s, f in zip(srcs, final, strict=True):
            if f.nbytes:
                lane.device_copy(s, 0, engine.buffer(f), 0, f.nbytes)
        ready = engine.record_on(stream)
        task = asyncio.ensure_future(scatter(srcs, mover.push, after=[ready], spoiled=lambda: False))
        await asyncio.sleep(0.05)
        assert not mover.calls  # nothing pushed before the producer's work
        gate.set()
        await task
    for r, f in zip(remote, final, strict=True):
        assert np.array_equal(r, f)
    assert [0, 1, 2] in [[i for i, *_ in pieces] for pieces in mover.calls]  # pushed in any order
    assert 2 <= mover.most <= DEPTH
    assert engine.pool("out").free == DEPTH


@pytest.mark.parametrize("spoiled", [False, True], ids=["open", "closing"])
async def test_scatter_failure_settles_every_push_first(engine: HostEngine, spoiled: bool) -> None:
    srcs = [engine.buffer(_bytes(CHUNK * 6, 6))]
    mover = _Mover([np.zeros(CHUNK * 6, np.uint8)], fail_at=1, hold=0.01)
    with pytest.raises(TransferError, match="remote gone"):
        await scatter(srcs, mover.push, spoiled=lambda: spoiled)
    assert mover.running == 0
    pool = engine.pool("out")
    assert pool.free == DEPTH
    if spoiled:
        assert pool.retired >= mover.broken >= 1
    else:
        assert pool.retired == 0


@pytest.mark.parametrize("spoiled", [False, True], ids=["open", "closing"])
@pytest.mark.parametrize("way", ["gather", "scatter"])
async def test_a_single_chunk_move_that_fails_gives_its_chunk_back_or_retires_it(
    engine: HostEngine, way: str, spoiled: bool
) -> None:
    """A move of one chunk is awaited in place (no task); failed, its chunk is handled alike."""
    mover = _Mover([np.zeros(1000, np.uint8)], fail_at=0)
    buf = engine.buffer(_bytes(1000, 7))
    if way == "gather":
        move = StageIn(engine).gather([buf], mover.fetch, spoiled=lambda: spoiled)
    else:
        move = scatter([buf], mover.push, spoiled=lambda: spoiled)
    with pytest.raises(TransferError, match="remote gone"):
        await move
    pool = engine.pool("in" if way == "gather" else "out")
    assert pool.free == DEPTH and pool.retired == int(spoiled)


@pytest.mark.parametrize("way", ["gather", "scatter"])
async def test_a_copy_that_cannot_be_queued_loses_no_chunk(way: str) -> None:
    """A copy to or from the device that fails to queue (on a GPU: a CUDA error) fails the move,
    and the pool keeps count: the chunk whose copies were queued in part is retired, one with
    none queued goes back."""

    class Failing(HostEngine):
        def _new_lane(self) -> Any:
            lane = super()._new_lane()

            def refuse(*_: object) -> None:
                raise RuntimeError("copy refused")

            lane.to_device = refuse  # type: ignore[method-assign]
            lane.to_host = refuse  # type: ignore[method-assign]
            return lane

    engine = Failing()
    try:
        pool = engine.pool("in" if way == "gather" else "out")
        pool.configure(CHUNK, DEPTH)
        bufs = [engine.buffer(_bytes(CHUNK * 5, 9))]
        mover = _Mover([np.zeros(CHUNK * 5, np.uint8)])
        if way == "gather":
            move = StageIn(engine).gather(bufs, mover.fetch, spoiled=lambda: False)
        else:
            move = scatter(bufs, mover.push, spoiled=lambda: False)
        with pytest.raises(RuntimeError, match="copy refused"):
            await move
        assert mover.running == 0
        assert pool.free == DEPTH and pool.retired == (1 if way == "gather" else 0)
    finally:
        engine.close()


async def test_a_retired_chunk_is_freed_once_nothing_holds_it() -> None:
    """Its memory goes back once the transport drops its last reference (a finalizer)."""
    freed: list[int] = []

    class Counting(HostEngine):
        def free_chunk(self, chunk: HostChunk) -> None:
            freed.append(chunk.ptr)

    engine = Counting()
    try:
        pool = engine.pool("in")
        chunk = await pool.acquire()
        held = chunk.array[10:20]  # what a transport still holds
        ptr = chunk.ptr
        pool.retire(chunk)
        del chunk
        assert freed == [] and pool.free == pool.depth
        del held
        assert freed == [ptr]
    finally:
        engine.close()


def test_lanes_beyond_the_free_list_are_closed(engine: HostEngine) -> None:
    """An engine keeps 16 idle lanes (streams on a GPU); one given back beyond that is closed
    (its thread ends here, its stream is destroyed on a GPU), not dropped while still alive."""
    lanes = [engine.lane() for _ in range(20)]
    for lane in lanes:
        engine.give_back(lane)
    closed = [lane for lane in lanes if not lane._thread.is_alive()]  # type: ignore[attr-defined]
    deadline = time.monotonic() + 5
    while len(closed) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
        closed = [lane for lane in lanes if not lane._thread.is_alive()]  # type: ignore[attr-defined]
    assert len(closed) == 4
    assert engine.lane() in lanes[:16]  # the kept ones are handed out again, still working


# -- end to end over real transports ----------------------------------------------------------
def _arr(engine: HostEngine, data: np.ndarray) -> EngineArray:
    return EngineArray(engine, data)


@pytest.mark.parametrize("checksum", [False, True], ids=["plain", "crc32c"])
@pytest.mark.parametrize("nbytes", [1, 1000, CHUNK * 5 + 7, 3 << 20])
@pytest.mark.parametrize("order", ["recv-first", "send-first"])
async def test_tcp_staged_roundtrip(engine: HostEngine, nbytes: int, order: str, checksum: bool) -> None:
    limits = Limits(recv_buffer_bytes=1 << 20)  # 3 MiB goes rendezvous
    data = _bytes(nbytes, nbytes).view(np.uint8)
    async with connected_pair("tcp", limits=limits, checksum=checksum) as (a, b):
        out = _arr(engine, np.zeros(nbytes, np.uint8))
        got, sent, receipt = await exchange(a, b, _arr(engine, data), out, order)
        assert got is out
        assert np.array_equal(out.array, data)
        assert sent.staged and sent.memory == "host-engine" and not sent.direct
        assert receipt.staged and receipt.memory == "host-engine"


async def test_tcp_mixed_pytree_with_host_and_device_tensors(engine: HostEngine) -> None:
    rng = np.random.default_rng(7)
    dev = rng.standard_normal((300, 70)).astype(np.float32)
    host = rng.integers(0, 1 << 30, (1000,), dtype=np.int64)
    dev2 = rng.integers(0, 255, (CHUNK * 2 + 1,), dtype=np.uint8)
    async with connected_pair("tcp") as (a, b):
        msg = {"d": _arr(engine, dev), "h": host, "s": "text", "l": [_arr(engine, dev2), 3]}
        out = {
            "d": _arr(engine, np.zeros_like(dev)),
            "h": np.zeros_like(host),
            "s": "text",
            "l": [_arr(engine, np.zeros_like(dev2)), 3],
        }
        await asyncio.gather(a.send(msg, tag=1), b.recv(tag=1, out=out))
        assert np.array_equal(out["d"].array, dev)
        assert np.array_equal(out["h"], host)
        assert np.array_equal(out["l"][0].array, dev2)
        # without out=: an engine's memory is not CUDA, so the tensors come back on the host
        await a.send(msg, tag=2)
        got = await b.recv(tag=2)
        assert np.array_equal(got["d"], dev) and np.array_equal(got["l"][0], dev2)


@pytest.mark.parametrize("nbytes", [CHUNK * 5 + 7, 3 << 20], ids=["eager", "rendezvous"])
async def test_a_recv_into_another_device_takes_what_a_cancelled_one_left(engine: HostEngine, nbytes: int) -> None:
    """A recv into one device's memory cancelled while the bytes land leaves the message in a
    buffer of ours on that device; the next recv, into another device's memory (two GPUs, two
    engines), gets it through the host. The code before this failed that recv with
    UnsupportedTensorError ("cannot copy between host-engine:0 and host-engine:1 directly") and
    lost the message, 5 times of 5 over tcp."""
    other = HostEngine(device=1, copy_delay=0.0002)
    other.pool("out").configure(CHUNK, DEPTH)
    other.pool("in").configure(CHUNK, DEPTH)
    engines = itertools.cycle([engine, other])  # the cancelled recv's, then the next one's
    data = _bytes(nbytes, 21)
    try:
        async with connected_pair("tcp", limits=Limits(recv_buffer_bytes=1 << 20)) as (a, b):
            cancelled = await cancel_recv_at_every_step(
                a,
                b,
                _arr(engine, data),
                lambda: _arr(next(engines), np.zeros_like(data)),
                lambda t: t.array.copy(),
            )
        assert cancelled >= 3, f"only {cancelled} of 10 recvs were cancelled before they completed"
    finally:
        other.close()


@pytest.mark.parametrize(
    "transport",
    ["tcp", "inproc", pytest.param("ucx", marks=pytest.mark.skipif(_NO_UCXX, reason="ucxx is not installed"))],
)
async def test_empty_device_tensors_are_not_staged(engine: HostEngine, transport: str) -> None:
    """An empty device tensor passes through no buffer of ours: its send's receipt says direct,
    not staged, as its receiver's does (the code before this said staged on every transport),
    and one beside a host tensor does not make that one's bytes staged."""
    empty = np.zeros((0, 3), np.float32)
    host = _bytes(1000, 5)
    async with connected_pair(transport) as (a, b):
        _, sent, receipt = await exchange(a, b, _arr(engine, empty), _arr(engine, np.zeros_like(empty)), "recv-first")
        assert sent.memory == "host-engine"
        assert (sent.staged, sent.direct) == (False, True), sent
        assert (receipt.staged, receipt.direct) == (False, True), receipt
        src = {"d": _arr(engine, empty), "h": host}
        _, sent, _ = await exchange(a, b, src, None, "recv-first", tag="mixed")
        assert not sent.staged, sent
        assert sent.direct == (sent.protocol != "inline"), sent  # (inline bytes are copied into the frame)


@pytest.mark.parametrize("nbytes", [1000, CHUNK * 3 + 5], ids=["small", "eager"])
@pytest.mark.parametrize(
    "transport",
    ["tcp", "inproc", pytest.param("ucx", marks=pytest.mark.skipif(_NO_UCXX, reason="ucxx is not installed"))],
)
async def test_an_empty_device_out_lets_the_host_bytes_beside_it_land_in_place(
    engine: HostEngine, transport: str, nbytes: int
) -> None:
    """A recv whose out= holds an empty device tensor beside a host one: the host bytes land in
    their out= as they do with a host out= alone, and the receipt says so. Before, inproc took
    the whole message into buffers of ours for want of a way to write the empty tensor (ucx a
    small, inline one), and copied the host bytes out of them: the receipt said staged and not
    direct, where tcp landed them in place."""
    host = _bytes(nbytes, 9)
    async with connected_pair(transport) as (a, b):
        src = {"d": _arr(engine, np.zeros((0, 3), np.float32)), "h": host}
        out = {"d": _arr(engine, np.zeros((0, 3), np.float32)), "h": np.zeros_like(host)}
        got, _, receipt = await exchange(a, b, src, out, "recv-first")
        assert got["h"] is out["h"] and np.array_equal(out["h"], host)
        plain = {"d": np.zeros((0, 3), np.float32), "h": np.zeros_like(host)}
        _, _, alone = await exchange(a, b, src, plain, "recv-first", tag="plain")  # a host out= alone
        assert not receipt.staged, receipt
        assert receipt.direct == alone.direct, (receipt, alone)


@pytest.mark.parametrize(
    "transport",
    ["inproc", pytest.param("ucx", marks=pytest.mark.skipif(_NO_UCXX, reason="ucxx is not installed"))],
)
async def test_transports_without_device_lanes_stage_through_host(engine: HostEngine, transport: str) -> None:
    data = _bytes(CHUNK * 3 + 5, 11)
    async with connected_pair(transport) as (a, b):
        out = _arr(engine, np.zeros_like(data))
        recv = asyncio.ensure_future(b.recv_with_receipt(tag="x", out=out))
        sent = await a.send(_arr(engine, data), tag="x")
        _, receipt = await recv
        assert np.array_equal(out.array, data)
        assert sent.staged and sent.memory == "host-engine"
        assert receipt.staged and receipt.memory == "host-engine"


@pytest.mark.skipif(_NO_UCXX, reason="ucxx is not installed")
@pytest.mark.parametrize("nbytes", [100, CHUNK * 3 + 5, 3 << 20], ids=["small", "eager", "rendezvous"])
@pytest.mark.parametrize("order", ["recv-first", "send-first"])
async def test_ucx_device_pointer_path(engine: HostEngine, nbytes: int, order: str) -> None:
    data = _bytes(nbytes, nbytes)
    async with connected_pair("ucx", limits=Limits(recv_buffer_bytes=1 << 20)) as (a, b):
        host_engine_by_pointer(a, b)
        out = _arr(engine, np.zeros(nbytes, np.uint8))
        got, sent, receipt = await exchange(a, b, _arr(engine, data), out, order)
        assert got is out and np.array_equal(out.array, data)
        # the sender posts the tensor's own memory: no staging copy, whatever the receiver does
        assert sent.memory == "host-engine" and not sent.staged and sent.direct
        assert receipt.memory == "host-engine"
        if order == "recv-first" or nbytes > 1 << 20:  # posted (or rendezvous): UCX writes into out=
            assert not receipt.staged and receipt.direct
            assert engine.max_queued == 0, "a lane copied bytes that UCX should have moved by pointer"
        else:  # an eager message that came first was buffered in host memory: said so
            assert receipt.staged and not receipt.direct


_MIXES = {
    # name: (what is sent, the out= given), built from (engine, x, h)
    "device->device": lambda e, x, h: (EngineArray(e, x), EngineArray(e, np.zeros_like(x))),
    "device->host": lambda e, x, h: (EngineArray(e, x), np.zeros_like(x)),
    "host->device": lambda e, x, h: (x, EngineArray(e, np.zeros_like(x))),
    "tree->tree": lambda e, x, h: (
        {"d": EngineArray(e, x), "h": h},
        {"d": EngineArray(e, np.zeros_like(x)), "h": np.zeros_like(h)},
    ),
    "device->no out": lambda e, x, h: (EngineArray(e, x), None),
    "tree->no out": lambda e, x, h: ({"d": EngineArray(e, x), "h": h}, None),
}


def _host(v: Any) -> np.ndarray:
    return v.array if isinstance(v, EngineArray) else np.asarray(v)


@pytest.mark.skipif(_NO_UCXX, reason="ucxx is not installed")
@pytest.mark.parametrize("mix", list(_MIXES))
@pytest.mark.parametrize("nbytes", [0, 100, CHUNK - 16, 3 << 20], ids=["empty", "inline", "eager", "rendezvous"])
@pytest.mark.parametrize("order", ["recv-first", "send-first"])
async def test_ucx_by_pointer_mixes_of_host_and_device(engine: HostEngine, mix: str, nbytes: int, order: str) -> None:
    """Every mix of host and device memory on the two sides of ucx's device-pointer path (the
    path CUDA memory takes where UCX has cuda lanes), at each protocol's size: the bytes arrive
    whole and the channel stays usable.

    A host message small enough to ride in the control frame (inline) into a device out= arrives
    as host bytes: it reaches the device by the recv's own copy and says staged. The code before
    515a0b0 wrote it into the device tensor as if it were host memory, the control handler
    failed, and the recv hung."""
    x, h = _bytes(nbytes, 3), _bytes(37, 4)
    src, out = _MIXES[mix](engine, x, h)
    async with connected_pair("ucx", limits=Limits(recv_buffer_bytes=1 << 20)) as (a, b):
        host_engine_by_pointer(a, b)
        async with asyncio.timeout(10):
            got, sent, receipt = await exchange(a, b, src, out, order)
            if isinstance(got, dict):
                assert np.array_equal(_host(got["d"]), x) and np.array_equal(_host(got["h"]), h)
            else:
                assert np.array_equal(_host(got), x)
            if mix == "host->device":
                assert got is out
                assert sent.memory == "host" and receipt.memory == "host-engine"
                if receipt.protocol == "inline":  # host bytes of ours, then copied to the device
                    assert receipt.staged and not receipt.direct
                assert b.channel.state.value == "open"
            await asyncio.gather(a.send(h, tag="after"), b.recv(tag="after"))


@pytest.mark.skipif(_NO_UCXX, reason="ucxx is not installed")
async def test_a_recv_never_outlives_its_channel(monkeypatch: pytest.MonkeyPatch) -> None:
    """A message matched to a recv that no transport tracks any more (here: ucx's control
    handler fails on it, as it did on an inline message into device memory) fails with the
    channel: the mailbox fails every message it handed a recv. The old code left the recv
    waiting for good."""

    def broken_fill(self: Any, data: memoryview) -> None:
        raise RuntimeError("a transport bug")

    async with connected_pair("ucx") as (a, b):
        out = {"x": np.zeros(100, np.uint8)}  # a pytree out=: not the express path
        recv = asyncio.ensure_future(b.recv(tag="x", out=out))
        await asyncio.sleep(0.05)
        monkeypatch.setattr("tensorwire.transports._mailbox.Arrival.fill", broken_fill)
        await a.send({"x": np.ones(100, np.uint8)}, tag="x")
        with pytest.raises(tensorwire.errors.BrokenResourceError, match="control handler failed"):
            await asyncio.wait_for(recv, 10)


@pytest.mark.skipif(_NO_UCXX, reason="ucxx is not installed")
async def test_ucx_device_send_cancelled_while_its_stream_is_busy() -> None:
    """The conformance check, on ucx's device-pointer path: the payload is posted once the
    producer's event has completed, so a send cancelled before that posts nothing, and must
    tell its receiver (ABORT), which has its header and waits for the payload."""
    async with connected_pair("ucx", limits=Limits(recv_buffer_bytes=1 << 20)) as (a, b):
        host_engine_by_pointer(a, b)
        await CHECKS["device_send_cancelled_while_its_stream_is_busy"](a, b)


@pytest.mark.skipif(_NO_UCXX, reason="ucxx is not installed")
@pytest.mark.parametrize("nbytes", [CHUNK * 3 + 5, 3 << 20], ids=["eager", "rendezvous"])
async def test_ucx_device_out_cancelled_at_every_step_loses_nothing(engine: HostEngine, nbytes: int) -> None:
    """A recv into device memory over ucx's device-pointer path cancelled after 0..14 loop
    iterations (before the header, while waiting for the consumer's work, while UCX writes):
    once the cancel returns its out= is never written again, and the next recv gets the message."""
    data = _bytes(nbytes, 9)
    async with connected_pair("ucx", limits=Limits(recv_buffer_bytes=1 << 20)) as (a, b):
        host_engine_by_pointer(a, b)
        cancelled = await cancel_recv_at_every_step(
            a, b, _arr(engine, data), lambda: _arr(engine, np.zeros_like(data)), lambda t: t.array.copy()
        )
    assert cancelled >= 3, f"only {cancelled} of 10 recvs were cancelled before they completed"


@pytest.mark.skipif(_NO_UCXX, reason="ucxx is not installed")
@pytest.mark.parametrize("nbytes", [CHUNK * 3 + 5, 3 << 20], ids=["eager", "rendezvous"])
async def test_ucx_device_recv_cancelled_while_its_stream_is_busy(engine: HostEngine, nbytes: int) -> None:
    """UCX writes outside every stream, so ucx posts a receive into device memory only once the
    consumer stream's earlier work is done. A recv cancelled while it waits for that posts
    nothing into its out=, and the message goes whole to the next recv (an eager one is taken
    into a buffer of ours as soon as the stream allows, without any recv)."""
    data = _bytes(nbytes, 3)
    with busy_stream(engine) as (stream, gate):  # the consumer's stream is busy until the gate opens
        async with connected_pair("ucx", limits=Limits(recv_buffer_bytes=1 << 20)) as (a, b):
            host_engine_by_pointer(a, b)
            out = EngineArray(engine, np.zeros_like(data), stream=stream)
            recv = asyncio.ensure_future(b.recv(tag="x", out=out))
            send = asyncio.ensure_future(a.send(_arr(engine, data), tag="x"))
            await asyncio.sleep(0.1)  # matched; the recv waits for its stream
            assert not recv.done() and not send.done()
            recv.cancel()
            with pytest.raises(asyncio.CancelledError):
                await recv
            gate.set()
            if nbytes <= 1 << 20:  # eager: received into a buffer of ours, no recv needed
                await asyncio.wait_for(send, 10)
            second = _arr(engine, np.zeros_like(data))
            async with asyncio.timeout(10):
                await asyncio.gather(send, b.recv(tag="x", out=second))
            assert np.array_equal(second.array, data)
            await wait_event(engine, engine.record_on(stream))  # the stream's work done
            assert not out.array.any(), "out= was written after its recv was cancelled"


@pytest.mark.skipif(_NO_UCXX, reason="ucxx is not installed")
@pytest.mark.parametrize("cancel_first", [False, True], ids=["pending", "cancelled"])
async def test_ucx_close_does_not_wait_for_a_busy_stream(engine: HostEngine, cancel_first: bool) -> None:
    """Closing while ucx waits for a consumer stream that stays busy (a recv into its tensor, or
    the buffer of ours that a cancelled recv's message went to) ends promptly: the recv fails
    with ClosedResourceError, and the close waits for no stream."""
    data = _bytes(CHUNK * 3 + 5, 5)
    with busy_stream(engine) as (stream, _):  # never free before the nodes are closed
        async with asyncio.timeout(10):
            async with connected_pair("ucx", limits=Limits(recv_buffer_bytes=1 << 20)) as (a, b):
                host_engine_by_pointer(a, b)
                out = EngineArray(engine, np.zeros_like(data), stream=stream)
                recv = asyncio.ensure_future(b.recv(tag="x", out=out))
                send = asyncio.ensure_future(a.send(_arr(engine, data), tag="x"))
                await asyncio.sleep(0.1)
                if cancel_first:  # the message then goes to a buffer of ours, on the same stream
                    recv.cancel()
                    await asyncio.gather(recv, return_exceptions=True)
                    await asyncio.sleep(0.05)
            await asyncio.sleep(0.01)
            assert recv.done() and send.done()
            if not cancel_first:
                with pytest.raises(tensorwire.ClosedResourceError):
                    recv.result()
            assert not out.array.any()
            with contextlib.suppress(BaseException):
                send.result()


async def test_recv_orders_the_consumer_stream_after_its_copies(engine: HostEngine) -> None:
    """A recv into a tensor of a stream returns without waiting on the host: the copies wait
    for the stream's earlier work, and the stream's later work waits for the copies (as on a
    GPU). The message fits the staging ring: a larger one would wait for the stream, since a
    chunk is reused only after its copy."""
    data = _bytes(CHUNK * (DEPTH - 1) + 5, 4)
    with busy_stream(engine) as (stream, gate):  # earlier work of the consumer, not done yet
        async with connected_pair("tcp") as (a, b):
            out = EngineArray(engine, np.zeros_like(data), stream=stream)
            await asyncio.wait_for(asyncio.gather(a.send(_arr(engine, data), tag="x"), b.recv(tag="x", out=out)), 10)
            await asyncio.sleep(0.05)
            assert not out.array.any(), "copies into out= ran before the stream's earlier work"
            gate.set()
            await wait_event(engine, engine.record_on(stream))
            assert np.array_equal(out.array, data)


async def test_out_mismatch_on_a_device_tensor(engine: HostEngine) -> None:
    async with connected_pair("tcp") as (a, b):
        await a.send(_arr(engine, np.zeros(10, np.float32)), tag="x")
        with pytest.raises(ShapeMismatchError, match="float32"):
            await b.recv(tag="x", out=_arr(engine, np.zeros(10, np.float64)))
        out = _arr(engine, np.ones(10, np.float32))
        await b.recv(tag="x", out=out)  # still queued after the mismatch
        assert not out.array.any()


async def test_cancelled_recv_stops_writing_into_its_device_out() -> None:
    """A recv into device memory cancelled part way: nothing lands in its out= after the cancel
    returns, and the message reaches the next recv whole."""
    slow = HostEngine(copy_delay=0.004)
    slow.pool("in").configure(CHUNK, DEPTH)
    slow.pool("out").configure(CHUNK, DEPTH)
    try:
        data = _bytes(CHUNK * 40, 5)
        async with connected_pair("tcp", limits=Limits(recv_buffer_bytes=1 << 20)) as (a, b):
            first = _arr(slow, np.zeros_like(data))
            recv = asyncio.ensure_future(b.recv(tag="x", out=first))
            send = asyncio.ensure_future(a.send(_arr(slow, data), tag="x"))
            async with asyncio.timeout(30):
                while not first.array.any():  # noqa: ASYNC110 - polling the bytes landing is the point
                    await asyncio.sleep(0.005)
            recv.cancel()
            with pytest.raises(asyncio.CancelledError):
                await recv
            snapshot = first.array.copy()
            assert 0 < np.count_nonzero(snapshot == data) < data.size  # part way, really
            second = _arr(slow, np.zeros_like(data))
            await b.recv(tag="x", out=second)
            await send
            assert np.array_equal(second.array, data)
            assert np.array_equal(first.array, snapshot)
    finally:
        slow.close()


def test_device_views_refuse_host_only_paths(engine: HostEngine) -> None:
    view = tensorwire.tensors.as_view(_arr(engine, np.zeros(4)))
    assert view.dev is not None and view.device == "host-engine:0"
    with pytest.raises(UnsupportedTensorError, match="host tensor"):
        _ = view.array
    msg = prepare(_arr(engine, np.zeros(4)))
    assert msg.on_device and msg.memory == "host-engine"
    with pytest.raises(UnsupportedTensorError, match="device tensors"):
        msg.segments()


# -- device out= a recv may not write into, and out= leaves that share memory ------------------------
@pytest.mark.parametrize("bit", ["conj", "neg"])
def test_a_torch_device_out_with_the_conj_or_neg_bit_is_refused(bit: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA torch view with the conj or neg bit is resolved into a copy: a recv into it wrote
    the copy and returned the caller's tensor untouched. Its DeviceSource says it is read-only
    (CPU tensors, with the host engine standing in for a CUDA one; on a GPU: below)."""
    torch = pytest.importorskip("torch")
    from tensorwire.tensors import _device

    engine = HostEngine()
    monkeypatch.setattr(_device, "_engine", lambda device: engine)
    monkeypatch.setattr(_device, "_stream", lambda framework, device: None)
    try:
        base = torch.zeros(4, dtype=torch.complex64)
        src = _device._torch_source(base.conj() if bit == "conj" else base.conj().imag)
        assert f"torch's {bit} bit" in src.readonly
        with pytest.raises(UnsupportedTensorError, match=f"read-only .*torch's {bit} bit"):
            src.target()
        plain = _device._torch_source(base)
        assert not plain.readonly and plain.target().buf.ptr == base.data_ptr()
    finally:
        engine.close()


@pytest.mark.parametrize("bit", ["conj", "neg"])
def test_a_torch_device_view_with_the_conj_or_neg_bit_is_wired_as_a_copy(
    bit: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its bytes on the wire are a copy torch resolved for tensorwire, so a send says packed (and
    not direct); its wire tensor said it needed no copy (the host engine standing in for CUDA)."""
    torch = pytest.importorskip("torch")
    from tensorwire.tensors import _device

    engine = HostEngine()
    monkeypatch.setattr(_device, "_engine", lambda device: engine)
    monkeypatch.setattr(_device, "_stream", lambda framework, device: None)
    try:
        base = torch.ones(4, dtype=torch.complex64)
        t, copied = _device._torch_source(base.conj() if bit == "conj" else base.conj().imag).wire()
        assert copied and t.buf.ptr != base.data_ptr()
        t, copied = _device._torch_source(base).wire()
        assert not copied and t.buf.ptr == base.data_ptr()
    finally:
        engine.close()


def _torch_cuda() -> Any:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    return torch


async def test_a_cuda_torch_out_with_the_conj_bit_is_refused_on_a_gpu() -> None:
    torch = _torch_cuda()
    src = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64, device="cuda")
    async with connected_pair("tcp") as (a, b):
        await a.send(src, tag="c")
        base = torch.zeros(2, dtype=torch.complex64, device="cuda")
        with pytest.raises(UnsupportedTensorError, match="conj bit"):
            await b.recv(tag="c", out=base.conj())
        assert await b.recv(tag="c", out=base) is base  # the message stayed
        torch.cuda.synchronize()
        assert torch.equal(base, src)


def test_an_engine_array_of_an_ndarray_subclass_holds_the_plain_array(engine: HostEngine) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PendingDeprecationWarning)
        m = np.matrix(np.arange(6.0).reshape(2, 3))
    e = EngineArray(engine, m)
    assert type(e.array) is np.ndarray and np.shares_memory(e.array, m)


async def test_out_leaves_sharing_memory_with_device_leaves_are_refused(engine: HostEngine) -> None:
    """A host leaf and an engine array over the same memory (one address space, as CUDA's unified
    addressing gives host and device pointers), or two engine arrays: refused, and the message
    stays for the next recv."""
    data = _bytes(64, 3)
    async with connected_pair("tcp") as (a, b):
        await a.send([data, data[::-1].copy()], tag="x")
        shared = np.zeros(64, np.uint8)
        for out in ([shared, _arr(engine, shared)], [_arr(engine, shared), _arr(engine, shared)]):
            with pytest.raises(ShapeMismatchError, match="out= tensors 0 and 1 share memory"):
                await b.recv(tag="x", out=out)
        out = [_arr(engine, np.zeros(64, np.uint8)), np.zeros(64, np.uint8)]
        await b.recv(tag="x", out=out)
        assert np.array_equal(out[0].array, data) and np.array_equal(out[1], data[::-1])


def test_a_strided_device_leaf_counts_from_its_lowest_to_its_highest_byte() -> None:
    """Negative strides reach below the pointer; interleaved strided leaves may share memory as
    far as a span can tell, and are refused."""
    from tensorwire.tensors import TensorView
    from tensorwire.tensors._device import DeviceSource
    from tensorwire.tensors._message import _refuse_overlap

    engine = HostEngine()
    try:
        base = 0x10000

        def leaf(ptr: int, shape: tuple[int, ...], strides: tuple[int, ...]) -> TensorView:
            src = DeviceSource(None, "cupy", engine, "float32", shape, ptr, strides, False, None)
            return TensorView(None, "cupy", "cuda:0", src)

        backwards = leaf(base + 28, (4,), (-4,))  # bytes 16..32
        forwards = leaf(base, (4,), (4,))  # bytes 0..16
        _refuse_overlap([backwards, forwards])
        _refuse_overlap([leaf(base + 16, (0, 3), (12, 4)), leaf(base + 16, (4,), (4,))])  # no elements
        with pytest.raises(ShapeMismatchError, match="share memory"):
            _refuse_overlap([forwards, leaf(base + 12, (2,), (-8,))])  # bytes 4..16
        with pytest.raises(ShapeMismatchError, match="share memory"):
            _refuse_overlap([leaf(base, (2, 2), (16, 4)), leaf(base + 8, (2, 2), (16, 4))])  # interleaved
    finally:
        engine.close()
