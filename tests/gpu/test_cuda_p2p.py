"""CUDA tensors end to end on a GPU: torch and CuPy over staged TCP (and ucx where ucxx is
installed), streams honoured both ways, device= allocation, strided tensors through the native
kernels, and the CUDA copy engine's pipeline on its own.

Two nodes in one process talk over real loopback sockets; benchmarks/gpu_p2p.py runs two
processes. Skips with a reason without CuPy, a CUDA device or torch.
"""

from __future__ import annotations

import asyncio
import importlib.util
from typing import Any

import numpy as np
import pytest
from _gpu_skip import cupy_with_a_device

cp = cupy_with_a_device("the CUDA transfer tests")

from tensorwire._peer import tag_id  # noqa: E402
from tensorwire.errors import UnsupportedTensorError  # noqa: E402
from tensorwire.memory import StageIn, download  # noqa: E402
from tensorwire.memory._cuda import CudaEngine, cuda_device_count  # noqa: E402
from tensorwire.tensors import DeviceTensor  # noqa: E402
from tensorwire.testing import connected_pair  # noqa: E402
from tensorwire.testing._conformance import _until  # noqa: E402
from tensorwire.transports import Limits  # noqa: E402

pytestmark = pytest.mark.gpu
MiB = 1 << 20
SPIN = 1_000_000_000  # torch.cuda._sleep cycles: about half a second at GPU clocks
_NO_UCXX = importlib.util.find_spec("ucxx") is None


def _torch() -> Any:
    return pytest.importorskip("torch", reason="torch is not installed: the torch CUDA tests need it")


def _rand_torch(torch: Any, shape: tuple[int, ...], dtype: Any, seed: int) -> Any:
    g = torch.Generator(device="cuda").manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, device="cuda", dtype=torch.float32).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g, device="cuda").bool()
    return torch.randint(-100, 100, shape, generator=g, device="cuda").to(dtype)


# -- the CUDA copy engine alone ------------------------------------------------------------------
def test_a_busy_event_query_leaves_no_error_for_the_next_torch_launch() -> None:
    """Waiting on an event polls cudaEventQuery on the caller's thread; "not ready" may stay as
    that thread's last CUDA error, which torch's launch check (cudaGetLastError) would raise as
    "device not ready" at the next kernel. The engine clears it, as torch's own queries do."""
    torch = _torch()
    engine = CudaEngine.get(0)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(SPIN)
    event = engine.record_on(int(side.cuda_stream))
    assert not event.query(), "the side stream finished half a second of spinning at once"
    x = torch.full((4,), 2.0, device="cuda") * 3  # launches on the current stream, checked by torch
    assert float(x.sum()) == 24.0
    event.synchronize()


def test_an_idle_stream_needs_no_event_and_a_busy_one_gets_one_that_ends_with_its_work() -> None:
    """``record_on`` asks the stream first (cudaStreamQuery): with nothing queued there is no
    work to wait for, and no event (one recorded and asked at once may not have been reached by
    the device yet, and its waiter polled for work all done). A stream with work queued gets an
    event that completes with that work, and the stream's "not ready" is not left behind as
    the thread's last CUDA error for torch's next launch check."""
    from tensorwire.memory._engine import DONE

    torch = _torch()
    engine = CudaEngine.get(0)
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    assert engine.record_on(int(side.cuda_stream)) is DONE
    assert engine.record_on(int(torch.cuda.current_stream().cuda_stream)) is DONE
    with torch.cuda.stream(side):
        torch.cuda._sleep(SPIN)
    event = engine.record_on(int(side.cuda_stream))
    assert event is not DONE and not event.query(), "a busy stream was taken for idle"
    x = torch.full((4,), 2.0, device="cuda") * 3  # launches on the current stream, checked by torch
    assert float(x.sum()) == 24.0
    side.synchronize()
    assert event.query()
    assert engine.record_on(int(side.cuda_stream)) is DONE


async def test_cuda_engine_pipeline_roundtrip() -> None:
    engine = CudaEngine.get(0)
    src = cp.asarray(np.random.default_rng(1).integers(0, 256, 9 * MiB + 123, dtype=np.uint8))
    cp.cuda.get_current_stream().synchronize()
    from tensorwire.memory import DeviceBuffer

    host = np.zeros(src.size, np.uint8)
    await download(DeviceBuffer(engine, int(src.data.ptr), int(src.nbytes), 0, src), host.data)
    assert np.array_equal(host, cp.asnumpy(src))
    dst = cp.zeros_like(src)
    cp.cuda.get_current_stream().synchronize()  # the zeros are written before our lane copies in
    st = StageIn(engine)

    def fill(view: memoryview, pos: int) -> None:
        view[:] = host[pos : pos + len(view)].data

    await st.write(lambda: DeviceBuffer(engine, int(dst.data.ptr), int(dst.nbytes), 0, dst), 0, dst.nbytes, fill)
    event = st.finish()
    assert event is not None
    event.synchronize()
    assert bool((dst == src).all())


def test_staging_chunks_are_page_locked() -> None:
    engine = CudaEngine.get(0)
    chunk = engine.host_chunk(1 * MiB)
    try:
        attrs = cp.cuda.runtime.pointerGetAttributes(chunk.ptr)
        assert attrs.type == cp.cuda.runtime.memoryTypeHost
    finally:
        engine.free_chunk(chunk)


# -- torch over staged TCP -------------------------------------------------------------------------
@pytest.mark.parametrize("nbytes", [4, 1000, 5 * MiB + 3, 40 * MiB])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float8_e4m3fn", "int8", "bool", "complex64"])
async def test_torch_cuda_tcp_roundtrip(nbytes: int, dtype: str) -> None:
    torch = _torch()
    dt = getattr(torch, dtype)
    n = max(1, nbytes // torch.empty((), dtype=dt).element_size())
    x = _rand_torch(torch, (n,), dt, n)
    async with connected_pair("tcp", limits=Limits(recv_buffer_bytes=8 * MiB)) as (a, b):
        recv = asyncio.ensure_future(b.recv_with_receipt(tag="x"))
        sent = await a.send({"x": x, "k": 3}, tag="x")
        got, receipt = await recv
        y = got["x"]
        assert isinstance(y, torch.Tensor) and y.is_cuda and y.dtype == dt and got["k"] == 3
        # on the current stream: ordered after the recv's copies; compared as bytes (torch may
        # have no equality for float8 on CUDA)
        assert torch.equal(y.view(torch.uint8), x.view(torch.uint8))
        assert sent.memory == "cuda" and sent.staged and not sent.direct
        assert receipt.memory == "cuda" and receipt.staged


async def test_cuda_message_before_its_recv() -> None:
    torch = _torch()
    x = _rand_torch(torch, (3 * MiB,), torch.float32, 2)
    async with connected_pair("tcp") as (a, b):
        await a.send(x, tag="early")  # eager: lands in host memory before any recv
        await asyncio.sleep(0.05)
        y, receipt = await b.recv_with_receipt(tag="early")
        assert y.is_cuda and torch.equal(y, x) and receipt.staged and receipt.memory == "cuda"


async def test_out_torch_cuda_contiguous_and_strided() -> None:
    torch = _torch()
    x = _rand_torch(torch, (300, 500), torch.float32, 3)
    async with connected_pair("tcp") as (a, b):
        out = torch.zeros_like(x)
        recv = asyncio.ensure_future(b.recv(tag="o", out=out))
        await a.send(x, tag="o")
        assert (await recv) is out and torch.equal(out, x)
        base = torch.zeros(500, 300, device="cuda")
        strided = base.t()  # (300, 500), not contiguous: unpacked by the native kernel
        recv = asyncio.ensure_future(b.recv(tag="o", out=strided))
        await a.send(x, tag="o")
        await recv
        assert torch.equal(strided, x) and torch.equal(base, x.t())


async def test_strided_sends_are_packed_on_the_gpu() -> None:
    torch = _torch()
    x = _rand_torch(torch, (700, 900), torch.float16, 4)
    async with connected_pair("tcp") as (a, b):
        recv = asyncio.ensure_future(b.recv(tag="s"))
        sent = await a.send({"t": x.t(), "s": x[::3, 5:800:7]}, tag="s")
        got = await recv
        assert sent.packed
        assert torch.equal(got["t"], x.t().contiguous()) and torch.equal(got["s"], x[::3, 5:800:7].contiguous())


async def test_send_waits_for_the_producer_stream() -> None:
    """The producer's stream is still busy when send is called: the bytes sent are the ones the
    stream writes last, not what the memory held when send was called."""
    torch = _torch()
    x = torch.zeros(8 * MiB, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    async with connected_pair("tcp") as (a, b):
        recv = asyncio.ensure_future(b.recv(tag="p", device="cuda:0"))
        await asyncio.sleep(0)  # the recv takes its consumer stream (the default one) now
        with torch.cuda.stream(side):
            torch.cuda._sleep(SPIN)  # the side stream stays busy
            x.fill_(7)
            sending = asyncio.ensure_future(a.send(x, tag="p"))
            await asyncio.sleep(0)  # the send's events are taken while the side stream is current
        assert not side.query()  # the side stream is really still busy
        await sending
        y = await recv  # ordered on the default stream, where y.min() runs
        assert int(y.min()) == 7 and int(y.max()) == 7


@pytest.mark.parametrize(
    "transport",
    ["tcp", pytest.param("ucx", marks=pytest.mark.skipif(_NO_UCXX, reason="ucxx is not installed here"))],
)
async def test_a_message_of_cuda_and_large_strided_host_tensors_keeps_both_promises(transport: str) -> None:
    """A CUDA tensor whose producer stream is still busy, beside a host tensor large and strided
    enough to be packed in a copy thread (tensors/_offload.py): the send's event on the producer
    stream is taken at the call, while that stream is current, not after the host packing; the
    host bytes arrive as they were; and a later send on the tag does not overtake it."""
    torch = _torch()
    x = torch.zeros(8 * MiB, dtype=torch.uint8, device="cuda")
    host = np.arange(4 * MiB, dtype=np.float32).reshape(1024, -1).T  # 16 MiB, transposed
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    async with connected_pair(transport) as (a, b):
        with torch.cuda.stream(side):
            torch.cuda._sleep(SPIN)  # the side stream stays busy
            x.fill_(7)
            sending = asyncio.ensure_future(a.send({"dev": x, "host": host}, tag="m"))
            await asyncio.sleep(0)  # the send's events are taken while the side stream is current
        after = asyncio.ensure_future(a.send(np.ones(3), tag="m"))
        assert not side.query()  # the side stream is really still busy
        await sending
        await after
        got = await b.recv(tag="m")  # each where the sender's was
        assert got["dev"].is_cuda and int(got["dev"].min()) == 7 and int(got["dev"].max()) == 7
        assert isinstance(got["host"], np.ndarray) and np.array_equal(got["host"], host)
        assert np.array_equal(await b.recv(tag="m"), np.ones(3))


class _Foreign:
    """A CUDA array of another library (numba, ...): only its ``__cuda_array_interface__`` (v3),
    naming the stream that is still writing it."""

    def __init__(self, t: Any, stream: int, readonly: bool = False) -> None:
        self._t, self._stream, self._readonly = t, stream, readonly

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        cai = dict(self._t.__cuda_array_interface__)
        cai.update(version=3, stream=self._stream, data=(cai["data"][0], self._readonly))
        return cai


async def test_foreign_cuda_array_waits_for_its_stream_without_blocking_the_host() -> None:
    """The interface's stream is the producer's: the send orders its copies after it with an
    event (cupy.asarray would synchronize that stream on the host, stalling the event loop)."""
    from tensorwire.native import pack

    torch = _torch()
    x = torch.zeros((1024, 2048), dtype=torch.float32, device="cuda")
    w = torch.arange(64 * 48, dtype=torch.float32, device="cuda").reshape(64, 48)  # on the legacy stream
    pack(cp.empty((64, 48), cp.float32).T)  # compile the transpose kernel before the clock starts
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    async with connected_pair("tcp") as (a, b):
        recv = asyncio.ensure_future(b.recv(tag="f"))
        await asyncio.sleep(0)
        with torch.cuda.stream(side):
            torch.cuda._sleep(SPIN)
            x.fill_(3)
        sending = asyncio.ensure_future(a.send({"x": _Foreign(x, side.cuda_stream), "v": _Foreign(w.t(), 1)}, tag="f"))
        await asyncio.sleep(0)  # the send has read the interfaces and recorded its events
        assert not side.query()  # ...without waiting for the side stream
        await sending
        got = await recv
        cp.cuda.get_current_stream().synchronize()
        assert bool((got["x"] == 3).all()), "the bytes sent are the ones the side stream wrote"
        assert np.array_equal(cp.asnumpy(got["v"]), w.t().cpu().numpy()), "a strided one, packed on the GPU"


async def test_read_only_foreign_out_is_refused_and_the_message_kept() -> None:
    torch = _torch()
    x = torch.arange(1000, dtype=torch.float32, device="cuda")
    frozen = torch.zeros_like(x)
    async with connected_pair("tcp") as (a, b):
        await a.send(x, tag="ro")
        with pytest.raises(UnsupportedTensorError, match="read-only"):
            await b.recv(tag="ro", out=_Foreign(frozen, 1, readonly=True))
        assert int(frozen.count_nonzero()) == 0
        y = await b.recv(tag="ro")
        assert torch.equal(y, x)


async def test_foreign_out_is_written_in_order_with_the_stream_it_names() -> None:
    """A foreign out= names its owner's stream (v3 ``stream``): the copies come after that
    stream's pending work (here a slow fill the received bytes must overwrite) and that stream is
    ordered after them, whatever CuPy's current stream is."""
    torch = _torch()
    x = torch.arange(1 << 18, dtype=torch.int32, device="cuda")  # 1 MiB: buffered before the recv
    out = torch.zeros_like(x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    async with connected_pair("tcp") as (a, b):
        await a.send(x, tag="fo")
        with torch.cuda.stream(side):
            torch.cuda._sleep(SPIN)
            out.fill_(-1)  # the owner's last write on its stream before it lends the tensor out
        await b.recv(tag="fo", out=_Foreign(out, side.cuda_stream))
        side.synchronize()  # the owner's stream: ordered after the recv's copies
        assert torch.equal(out, x), "the copies raced the owner's stream (ordered on CuPy's instead?)"


class _DLPackOnly:
    """A CUDA array of a library that offers nothing but DLPack (JAX, ...), here a torch tensor's."""

    def __init__(self, t: Any) -> None:
        self._t = t

    def __dlpack__(self, **kw: Any) -> Any:
        return self._t.__dlpack__(**kw)

    def __dlpack_device__(self) -> Any:
        return self._t.__dlpack_device__()


@pytest.mark.parametrize(
    "transport", ["tcp", pytest.param("ucx", marks=pytest.mark.skipif(_NO_UCXX, reason="no ucxx"))]
)
async def test_dlpack_only_cuda_object_is_sent_after_its_producer_stream(transport: str) -> None:
    """Imported through CuPy, which hands the producer its stream: the producer orders its writes
    before it with an event, so the bytes sent are the ones the busy stream writes last, and the
    host does not wait for that stream meanwhile."""
    torch = _torch()
    x = torch.zeros(8 * MiB, dtype=torch.uint8, device="cuda")
    s = torch.arange(3000, dtype=torch.float32, device="cuda").reshape(60, 50)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    async with connected_pair(transport) as (a, b):
        recv = asyncio.ensure_future(b.recv(tag="d"))
        await asyncio.sleep(0)
        with torch.cuda.stream(side):
            torch.cuda._sleep(SPIN)
            x.fill_(9)
            sending = asyncio.ensure_future(a.send({"x": _DLPackOnly(x), "t": _DLPackOnly(s.t())}, tag="d"))
            await asyncio.sleep(0)  # the import and the send's events happen while side is current
        assert not side.query(), "the send waited for the producer's stream on the host"
        await sending
        got = await recv
        cp.cuda.get_current_stream().synchronize()
        assert bool((got["x"] == 9).all()), "the bytes sent are the ones the side stream wrote"
        assert np.array_equal(cp.asnumpy(got["t"]), s.t().cpu().numpy()), "a strided one, packed on the GPU"


async def test_dlpack_only_cuda_object_is_never_written_into() -> None:
    torch = _torch()
    x = torch.arange(1000, dtype=torch.float32, device="cuda")
    frozen = torch.zeros_like(x)
    async with connected_pair("tcp") as (a, b):
        await a.send(x, tag="dl")
        with pytest.raises(UnsupportedTensorError, match="read-only \\(a DLPack-only CUDA object"):
            await b.recv(tag="dl", out=_DLPackOnly(frozen))
        assert int(frozen.count_nonzero()) == 0
        assert torch.equal(await b.recv(tag="dl"), x), "the refused recv lost the message"
        h = a.node.expose(_DLPackOnly(frozen), name="dl")
        assert h.memory == "cuda" and not h.writable


async def test_recv_orders_the_consumer_stream_without_blocking_the_host() -> None:
    torch = _torch()
    x = _rand_torch(torch, (4 * MiB,), torch.float32, 5)
    consumer = torch.cuda.Stream()
    async with connected_pair("tcp") as (a, b):
        with torch.cuda.stream(consumer):
            torch.cuda._sleep(SPIN)  # the consumer stream is busy with earlier work
            recv = asyncio.ensure_future(b.recv(tag="c"))
            await asyncio.sleep(0)  # the recv takes the consumer stream now
        await a.send(x, tag="c")  # from the default stream, which is idle: the bytes go at once
        y = await recv
        assert not consumer.query()  # recv returned without waiting for the consumer stream
        with torch.cuda.stream(consumer):
            z = y * 2  # ordered after the copies on the consumer stream
        consumer.synchronize()
        assert torch.equal(z, x * 2)


# -- CuPy, device=, mixed memories -----------------------------------------------------------------
async def test_cupy_roundtrip_comes_back_as_cupy() -> None:
    x = cp.asarray(np.random.default_rng(6).standard_normal((1000, 1500)).astype(np.float32))
    async with connected_pair("tcp") as (a, b):
        recv = asyncio.ensure_future(b.recv(tag="c"))
        await a.send({"x": x, "v": x[::-1, ::2]}, tag="c")
        got = await recv
        assert isinstance(got["x"], cp.ndarray) and bool((got["x"] == x).all())
        assert bool((got["v"] == x[::-1, ::2]).all())


async def test_device_argument_moves_between_memories() -> None:
    torch = _torch()
    x = _rand_torch(torch, (2 * MiB,), torch.float32, 7)
    host = np.arange(1 << 20, dtype=np.int32)
    async with connected_pair("tcp") as (a, b):
        await a.send(x, tag="d")
        y = await b.recv(tag="d", device="cpu")
        assert isinstance(y, torch.Tensor) and y.device.type == "cpu" and torch.equal(y, x.cpu())
        recv = asyncio.ensure_future(b.recv(tag="d", device="cuda:0"))
        await a.send(host, tag="d")
        z = await recv
        assert isinstance(z, cp.ndarray) and z.device.id == 0 and np.array_equal(cp.asnumpy(z), host)
        recv = asyncio.ensure_future(b.recv(tag="d", device=torch.device("cuda", 0)))
        await a.send(torch.from_numpy(host), tag="d")
        w = await recv
        assert isinstance(w, torch.Tensor) and w.is_cuda and torch.equal(w.cpu(), torch.from_numpy(host))
        with pytest.raises(tensorwire_errors().ConfigurationError, match="device"):
            await b.recv(tag="d", device=f"cuda:{cuda_device_count()}")


@pytest.mark.skipif(cuda_device_count() < 2, reason="needs two CUDA devices")
async def test_tensors_of_a_device_that_is_not_current() -> None:
    """cuda:1's tensors on its default stream (handle 0, like every device's) while cuda:0 is
    current: their events are recorded, and their streams made to wait, on cuda:1's stream."""
    torch = _torch()
    with torch.cuda.device(1):
        x = _rand_torch(torch, (3 * MiB,), torch.float32, 10)
        strided = torch.zeros(1000, 300, device="cuda").t()
    assert torch.cuda.current_device() == 0
    async with connected_pair("tcp") as (a, b):
        recv = asyncio.ensure_future(b.recv(tag="d1", device="cuda:1"))
        await a.send({"x": x}, tag="d1")
        got = await recv
        assert got["x"].device.index == 1 and torch.equal(got["x"], x)
        recv = asyncio.ensure_future(b.recv(tag="d1", out=strided))
        await a.send(x[: 300 * 1000].view(300, 1000), tag="d1")
        await recv
        assert torch.equal(strided, x[: 300 * 1000].view(300, 1000))


def tensorwire_errors() -> Any:
    import tensorwire.errors

    return tensorwire.errors


async def test_empty_and_zero_dim_cuda_tensors() -> None:
    torch = _torch()
    async with connected_pair("tcp") as (a, b):
        msg = {"e": torch.empty(0, 3, device="cuda"), "s": torch.tensor(2.5, device="cuda")}
        recv = asyncio.ensure_future(b.recv(tag="z"))
        await a.send(msg, tag="z")
        got = await recv
        assert got["e"].shape == (0, 3) and got["e"].is_cuda
        assert got["s"].shape == () and float(got["s"]) == 2.5


@pytest.mark.parametrize(
    "transport",
    ["inproc", pytest.param("ucx", marks=pytest.mark.skipif(_NO_UCXX, reason="ucxx is not installed here"))],
)
async def test_other_transports_move_cuda_tensors(transport: str) -> None:
    torch = _torch()
    x = _rand_torch(torch, (3 * MiB,), torch.float32, 8)
    async with connected_pair(transport) as (a, b):
        recv = asyncio.ensure_future(b.recv_with_receipt(tag="u"))
        # posted before the send begins: a task only scheduled is not, and over ucx the
        # receiver's worker, still progressing from the handshake, took the MSG frame before
        # the recv's first step ran (an eager message before its recv: staged, said so)
        assert await _until(lambda: b.channel.mailbox.has_posted(tag_id("u"))), "the recv was never posted"
        sent = await a.send(x, tag="u")
        y, receipt = await recv
        assert y.is_cuda and torch.equal(y, x)
        assert sent.memory == "cuda" and receipt.memory == "cuda"
        if transport == "ucx":
            from tensorwire.transports.ucx import UcxTransport

            caps = UcxTransport.probe()
            assert caps is not None, UcxTransport.unavailable_reason()
            if "cuda" in caps.memory_kinds:  # this libucx has cuda_copy/cuda_ipc: zero-copy, said so
                assert "cuda" in b.channel.device_kinds, caps.lanes
                assert not sent.staged and not receipt.staged, "ucx with cuda transports moves device memory itself"
                assert receipt.direct, receipt
                # sent before its recv: the eager payload waits in device memory of ours (UCX
                # moved it device to device; through host memory before), and a recv without
                # out= is handed that tensor, no copy made (direct, as a host message's buffer
                # is handed over; the first H200 run saw this receipt: direct, not staged)
                sent = await a.send(x, tag="w")
                (waiting,) = b.channel.mailbox._arrived[tag_id("w")]
                assert await _until(lambda: waiting.done.done()), "the early payload never landed"
                assert waiting.dest is not None and all(isinstance(d, DeviceTensor) for d in waiting.dest), waiting.dest
                y, receipt = await b.recv_with_receipt(tag="w")
                assert y.is_cuda and torch.equal(y, x) and receipt.memory == "cuda"
                assert receipt.protocol == "eager" and receipt.direct and not receipt.staged, receipt
                # into an out= of the caller's: copied there on the device, through a buffer of ours
                out = torch.empty_like(x)
                await a.send(x, tag="w")
                assert await _until(lambda: bool(b.channel.mailbox._arrived.get(tag_id("w"))))
                got, receipt = await b.recv_with_receipt(tag="w", out=out)
                assert got is out and torch.equal(out, x)
                assert receipt.staged and not receipt.direct and receipt.memory == "cuda", receipt
                assert any("cuda" in lane for lane in caps.lanes), caps.lanes
            else:  # a libucx without cuda transports: staged through host memory, and the receipt says so
                assert sent.staged and receipt.staged, caps.lanes


async def test_cancelled_cuda_recv_leaves_the_message_whole() -> None:
    torch = _torch()
    x = _rand_torch(torch, (64 * MiB,), torch.float32, 9)
    async with connected_pair("tcp", limits=Limits(recv_buffer_bytes=8 * MiB)) as (a, b):
        first = torch.zeros_like(x)
        recv = asyncio.ensure_future(b.recv(tag="k", out=first))
        send = asyncio.ensure_future(a.send(x, tag="k"))
        await asyncio.sleep(0.02)
        recv.cancel()
        with pytest.raises(asyncio.CancelledError):
            await recv
        second = torch.zeros_like(x)
        await b.recv(tag="k", out=second)
        await send
        assert torch.equal(second, x)
