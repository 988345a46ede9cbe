"""CUDA tensors at the edges, on a GPU: a channel that closes while a producer's or consumer's
stream is busy, and a device with no memory left for a received tensor.

tests/test_device_edges.py runs the same code without a GPU (the host engine standing in for
one, its out-of-memory errors stand-ins named as CuPy's and torch's); this file is where it
meets CUDA streams, CuPy's and torch's allocators and their real errors. A busy stream here is
held by a kernel of one thread that spins until the test lets it go, so that "the stream is still
busy" is true for as long as a test needs it, however fast the GPU. Skips with a reason without
CuPy or a CUDA device, and its torch and ucx tests without torch or ucxx.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import importlib.util
import sys
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from _gpu_skip import cupy_with_a_device, most_of_the_device
from _polling import eventually

cp = cupy_with_a_device("the CUDA edge tests")

from tensorwire.errors import ClosedResourceError, PeerDisconnected, TransferError  # noqa: E402
from tensorwire.memory import CHUNK_BYTES, DEPTH  # noqa: E402
from tensorwire.memory._cuda import CudaEngine  # noqa: E402
from tensorwire.testing import connected_pair  # noqa: E402
from tensorwire.transports import Limits  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]
MiB = 1 << 20
GiB = 1 << 30
HOLD_SECONDS = 30  # the longest a held stream spins if the test never lets it go
TRANSPORTS = ["tcp", "inproc", "ucx"]


def _torch() -> Any:
    return pytest.importorskip("torch", reason="torch is not installed: the torch CUDA tests need it")


def _ucx(cuda_lanes: bool = False) -> None:
    """Skip unless ucx runs here (and, with ``cuda_lanes``, has cuda transports)."""
    if importlib.util.find_spec("ucxx") is None:
        pytest.skip("ucxx is not installed here (docs/gpu.md: scripts/gpu_wheels.sh carries it)")
    from tensorwire.transports.ucx import UcxTransport

    caps = UcxTransport.probe()
    if caps is None:
        pytest.skip(f"ucx cannot run here: {UcxTransport.unavailable_reason()}")
    if cuda_lanes and "cuda" not in caps.memory_kinds:
        pytest.skip(f"this libucx has no cuda transports (lanes: {', '.join(caps.lanes)})")


def _tid(tag: str) -> int:
    from tensorwire._peer import tag_id

    return tag_id(tag)


def _holds(peer: Any, tag: str) -> bool:
    """Whether ``peer``'s mailbox has a message on ``tag`` (its header at least)."""
    mailbox, tid = peer.channel.mailbox, _tid(tag)
    return bool(mailbox._arrived.get(tid)) or any(m.tag == tid for m in mailbox._held)


def _pattern(n: int) -> Any:
    """``n`` bytes (a multiple of 4) on the device that differ with their place: a chunk that
    lands at the wrong offset shows."""
    return (cp.arange(n // 4, dtype=cp.uint32) * cp.uint32(2654435761)).view(cp.uint8)


# -- a stream held busy until the test lets it go -------------------------------------------------
_HOLD_SOURCE = r"""
extern "C" __global__ void hold(const volatile int* gate, unsigned long long limit_ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        if (*gate != 0) return;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < limit_ns);
}
"""
_hold_kernel: list[Any] = []


@contextlib.contextmanager
def held_stream() -> Iterator[tuple[Any, Callable[[], None]]]:
    """A new CuPy stream (non-blocking: the legacy default stream does not wait for it) that
    stays busy until the test calls the function yielded with it: a kernel of one thread spins
    on a flag in page-locked host memory, which the device reads through its mapping (unified
    addressing). Let go on the way out in any case, and by the kernel itself after HOLD_SECONDS,
    so that a failing test never leaves the GPU spinning.

    Every kernel the test queues while the stream is held must have run once in this process
    before: CUDA loads a module at its kernel's first launch (lazy loading, the default since
    CUDA 12.2), and that load may wait for the whole context, the spinning kernel
    included, so the host would block until the hold gives up by itself (HOLD_SECONDS) and the
    stream would be free before the operation under test began."""
    if not _hold_kernel:
        _hold_kernel.append(cp.RawKernel(_HOLD_SOURCE, "hold"))
    rt = cp.cuda.runtime
    ptr = int(rt.hostAlloc(8, getattr(rt, "hostAllocPortable", 1) | getattr(rt, "hostAllocMapped", 2)))
    gate = ctypes.c_int.from_address(ptr)
    gate.value = 0
    stream = cp.cuda.Stream(non_blocking=True)
    try:
        with stream:
            _hold_kernel[0]((1,), (1,), (np.uint64(ptr), np.uint64(HOLD_SECONDS * 10**9)))

        def release() -> None:
            gate.value = 1

        yield stream, release
    finally:
        gate.value = 1
        stream.synchronize()
        rt.freeHost(ptr)


def _still_held(stream: Any) -> None:
    """Fail, saying why, where the held stream let go before the test did: the host waited for
    it (a kernel loaded at its first launch while the stream spun, see ``held_stream``), and
    what follows would test nothing."""
    assert not stream.done, (
        "the held stream ran out before the operation began: the host waited for it (a kernel "
        "first launched while it was held? CUDA's lazy loading may wait for the whole context)"
    )


# -- a send waiting for its producer stream -------------------------------------------------------
@pytest.mark.parametrize("protocol", ["eager", "rendezvous"])
@pytest.mark.parametrize("closer", ["peer", "own"])
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_cuda_send_waiting_for_its_producer_stream_ends_with_its_channel(
    transport: str, closer: str, protocol: str
) -> None:
    """A send of a CuPy array whose producer stream stays busy, when the receiving peer or the
    sender's own peer closes: the send raises PeerDisconnected (ClosedResourceError for our own
    close) while the stream is still busy, and nothing of the message reaches the receiver once
    the stream frees. tcp and inproc copy the array down through the pinned chunks after the
    stream's work (a wait cut short by the close); ucx with cuda lanes posts the pointer once
    that work is done (its header out first, eager; after the receiver's go-ahead, rendezvous)."""
    if transport == "ucx":
        _ucx()
    n = 8 * MiB
    limits = Limits(recv_buffer_bytes=32 * MiB if protocol == "eager" else 0)
    x = cp.zeros(n, cp.uint8)
    out = cp.zeros(n, cp.uint8)
    async with connected_pair(transport, limits=limits) as (a, b):
        # the same transfer first: the staging chunks and copy lanes exist before the stream is
        # held (a page-locked allocation while it spins could wait for it); and the producer's
        # fill kernel is loaded before (``held_stream``: its first launch could wait for the hold)
        x.fill(7)
        recv = asyncio.ensure_future(b.recv(tag="w", out=out))
        await a.send(x, tag="w")
        await recv
        cp.cuda.Device().synchronize()
        with held_stream() as (stream, release):
            posted = None
            if protocol == "rendezvous":  # the go-ahead comes at once, then the stream is waited for
                posted = asyncio.ensure_future(b.recv(tag="x", out=out))
                await eventually(lambda: b.channel.mailbox.has_posted(_tid("x")))
            with stream:
                x.fill(7)  # the producer's last write, queued behind its held work
                _still_held(stream)
                send = asyncio.ensure_future(a.send(x, tag="x"))
                await asyncio.sleep(0)  # the send takes its event while the held stream is current
            await asyncio.sleep(0.2)
            assert not send.done(), "a send moved device memory before its producer stream's work"
            await (b.aclose if closer == "peer" else a.aclose)()
            want = PeerDisconnected if closer == "peer" else ClosedResourceError
            with pytest.raises(want):
                async with asyncio.timeout(10):
                    await send
            assert not stream.done, "the send ended only once its producer stream had (a wait for it?)"
            release()
            stream.synchronize()
        # not delivered, then or later: the receiver has no whole message on the tag
        with pytest.raises((PeerDisconnected, ClosedResourceError)):
            async with asyncio.timeout(10):
                await b.recv(tag="x")
        if posted is not None:
            with pytest.raises((PeerDisconnected, ClosedResourceError)):
                await posted


# -- a one-sided read or write waiting for its stream ---------------------------------------------
@pytest.mark.parametrize("closer", ["peer", "own"])
@pytest.mark.parametrize("op", ["read", "write"])
@pytest.mark.parametrize("path", ["pointer", "staged"])
async def test_a_one_sided_cuda_operation_waiting_for_its_stream_ends_with_its_channel(
    path: str, op: str, closer: str
) -> None:
    """A one-sided ucx write from a CuPy array whose producer stream stays busy, or a read into
    one whose consumer stream does, when the owner's peer or the requester's own closes: the
    operation raises PeerDisconnected (ClosedResourceError for our own close) while the stream
    is still busy, and a write's bytes never reach the owner's tensor. By device pointer (ucx
    with cuda lanes) the wait comes before anything is posted; staged (the channel told to take
    no CUDA pointers, as verbs) a write waits before its copies down, and a read of more than
    the staging ring waits to reuse a chunk whose copies up wait for the consumer's stream."""
    _ucx(cuda_lanes=path == "pointer")
    engine = CudaEngine.get(cp.cuda.Device().id)
    pools = [engine.pool("in"), engine.pool("out")]
    for pool in pools:
        pool.configure(256 << 10, 3)
    n = 4 * MiB  # 16 chunks of the pool's 3
    try:
        async with connected_pair("ucx") as (a, b):
            if path == "staged":
                b.channel.device_kinds = frozenset()  # as verbs: no CUDA pointers in one-sided operations
            target = np.zeros(n, np.uint8)
            a.node.expose(target, name="t")
            h = await b.lookup("t")
            assert h.direct, h
            dev = cp.zeros(n, cp.uint8)
            dev.fill(7)  # its kernel loaded before the stream is held (``held_stream``)
            # the same operations first: staging chunks and lanes exist before the stream is held
            await b.read(h, out=dev)
            await b.write(h, dev)
            cp.cuda.Device().synchronize()
            with held_stream() as (stream, release):
                with stream:
                    dev.fill(7)  # a write's source, or the read's consumer's earlier work on out=
                    _still_held(stream)
                    task = asyncio.ensure_future(b.read(h, out=dev) if op == "read" else b.write(h, dev))
                    await asyncio.sleep(0)  # it takes the held stream now
                await asyncio.sleep(0.2)
                assert not task.done(), f"a {op} did not wait for its stream's earlier work"
                await (a.aclose if closer == "peer" else b.aclose)()
                want = PeerDisconnected if closer == "peer" else ClosedResourceError
                with pytest.raises(want):
                    async with asyncio.timeout(10):
                        await task
                assert not stream.done, f"the {op} ended only once its stream had (a wait for it?)"
                release()
                stream.synchronize()
            cp.cuda.Device().synchronize()
            await asyncio.sleep(0.05)
            if op == "write":
                assert not target.any(), "a write's bytes reached the owner after its channel closed"
    finally:
        cp.cuda.Device().synchronize()  # no copy still queued into a chunk the pool frees now
        for pool in pools:
            pool.configure(CHUNK_BYTES, DEPTH)


# -- no device memory for a received tensor -------------------------------------------------------
@contextlib.contextmanager
def _cupy_pool_limited(headroom: int) -> Iterator[Any]:
    """CuPy allocations on this thread (the event loop's, where tensorwire allocates a received
    array) from a new CuPy memory pool of its own, limited to ``headroom`` bytes: an allocation
    beyond that is refused with CuPy's OutOfMemoryError, in this process alone (the GPU's other
    test processes are not starved). Not the default pool under a limit just above what it
    holds: arrays of earlier tests kept by reference cycles (a ``pytest.raises`` block's
    traceback holds the test's frame, its arrays with it) go back to that pool whenever the
    garbage collector runs, during the recv too, and a received array can take one of those
    blocks without a new allocation for the limit to refuse."""
    pool = cp.cuda.MemoryPool()
    pool.set_limit(size=headroom)
    try:
        with cp.cuda.using_allocator(pool.malloc):
            yield pool
    finally:
        pool.free_all_blocks()


_CUPY_CASES = [
    *(pytest.param("tcp", when, id=f"tcp-{when}") for when in ("posted", "queued", "rendezvous")),
    pytest.param("inproc", "rendezvous", id="inproc-rendezvous"),
    pytest.param("ucx", "rendezvous", id="ucx-rendezvous"),
]


@pytest.mark.parametrize(("transport", "when"), _CUPY_CASES)
async def test_cupy_out_of_memory_for_a_received_tensor_keeps_the_message(transport: str, when: str) -> None:
    """A recv with device="cuda:0" whose CuPy array CuPy's pool refuses (a pool of this test's
    own, limited to half the array: ``_cupy_pool_limited``), posted before the message
    ("posted": tcp places device tensors as the header arrives), after it ("queued"), or for a
    rendezvous message: TransferError "out of memory" from CuPy's own OutOfMemoryError, the
    message stays for a recv with out=, which gets it whole, and the channel goes on."""
    if transport == "ucx":
        _ucx()
    n = 64 * MiB
    x = _pattern(n)
    credit = 0 if when == "rendezvous" else 256 * MiB
    async with connected_pair(transport, limits=Limits(recv_buffer_bytes=credit)) as (a, b):
        with contextlib.ExitStack() as limit:
            if when == "posted":
                pool = limit.enter_context(_cupy_pool_limited(n // 2))
                recv = asyncio.ensure_future(b.recv(tag="x", device="cuda:0"))
                await eventually(lambda: b.channel.mailbox.has_posted(_tid("x")))
                send = asyncio.ensure_future(a.send(x, tag="x"))
            else:
                send = asyncio.ensure_future(a.send(x, tag="x"))
                await eventually(lambda: _holds(b, "x"))
                pool = limit.enter_context(_cupy_pool_limited(n // 2))
                recv = asyncio.ensure_future(b.recv(tag="x", device="cuda:0"))
            assert pool.free_bytes() < n, f"CuPy's pool keeps {pool.free_bytes()} bytes it cannot free"
            async with asyncio.timeout(30):
                with pytest.raises(TransferError, match="out of memory on cuda:0") as err:
                    await recv
        assert type(err.value.__cause__).__name__ == "OutOfMemoryError", repr(err.value.__cause__)
        out = cp.zeros(n, cp.uint8)
        async with asyncio.timeout(30):
            assert await b.recv(tag="x", out=out) is out
            await send
            await asyncio.gather(a.send(np.arange(7), tag="y"), b.recv(tag="y"))
        assert bool(cp.array_equal(out, x)), "the message kept for recv(out=) came in wrong"


@pytest.mark.parametrize(
    ("transport", "when"), [pytest.param("tcp", "queued", id="tcp"), pytest.param("ucx", "rendezvous", id="ucx")]
)
async def test_torch_out_of_memory_for_a_received_tensor_keeps_the_message(transport: str, when: str) -> None:
    """A torch CUDA tensor received without out= whose allocation torch's caching allocator
    refuses (this process's memory fraction, set just above what it holds): TransferError "out
    of memory" from torch's own OutOfMemoryError, and the message stays for a recv with out=."""
    torch = _torch()
    if transport == "ucx":
        _ucx()
    n = 64 * MiB
    x = torch.as_tensor(_pattern(n), device="cuda").clone()
    torch.cuda.synchronize()
    credit = 0 if when == "rendezvous" else 256 * MiB
    async with connected_pair(transport, limits=Limits(recv_buffer_bytes=credit)) as (a, b):
        send = asyncio.ensure_future(a.send(x, tag="x"))
        await eventually(lambda: _holds(b, "x"))
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved(0) + n // 2) / total, 0)
        try:
            async with asyncio.timeout(30):
                with pytest.raises(TransferError, match="out of memory on cuda:0") as err:
                    await b.recv(tag="x", device="cuda:0")
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0, 0)
        oom = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError  # torch.cuda's before 2.5
        assert isinstance(err.value.__cause__, oom), repr(err.value.__cause__)
        out = torch.zeros_like(x)
        async with asyncio.timeout(30):
            assert await b.recv(tag="x", out=out) is out
            await send
        assert torch.equal(out, x), "the message kept for recv(out=) came in wrong"


def _fill_device(leave: int) -> list[int]:
    """Take the device's free memory in plain cudaMalloc blocks (outside CuPy's pool, so its
    retry after a failed allocation cannot give them back), big ones first, until less than
    ``leave`` plus the smallest block is free; their pointers, for ``cudaFree``."""
    rt = cp.cuda.runtime
    held: list[int] = []
    try:
        for block in (8 * GiB, 1 * GiB, 128 * MiB):
            while rt.memGetInfo()[0] - block >= leave:
                try:
                    held.append(int(rt.malloc(block)))
                except rt.CUDARuntimeError:
                    break
    except BaseException:
        for ptr in held:
            rt.free(ptr)
        raise
    return held


async def _refused(peer: Any, n: int) -> BaseException | None:
    """The cause of the TransferError that a recv(device="cuda:0") of the ``n``-byte message
    "big" gets from a full device; skips where another process freed so much meanwhile that
    the tensor fit after all."""
    try:
        async with asyncio.timeout(30):
            got = await peer.recv(tag="big", device="cuda:0")
    except TransferError as exc:
        if "out of memory on cuda:0" not in str(exc):
            raise
        return exc.__cause__
    left = cp.cuda.runtime.memGetInfo()[0]
    del got
    if left >= n:
        pytest.skip(f"another process freed GPU memory during the test ({left >> 20} MiB free)")
    pytest.fail(f"a recv of {n >> 20} MiB succeeded with {left >> 20} MiB of the device free")


async def test_a_recv_finding_the_device_full_keeps_the_message() -> None:
    """The device itself full: its free memory taken in big blocks until 2 GiB are left, a
    recv(device="cuda:0") of a 4 GiB message (rendezvous, its payload still at the sender) fails
    with TransferError "out of memory", through CuPy's pool (its OutOfMemoryError, after it gave
    back what it cached) and without it (cudaMalloc's cudaErrorMemoryAllocation, CUDA error 2),
    and once the blocks are freed a recv with out= gets the message whole. The 2 GiB left are for
    the GPU's other test processes meanwhile (their tensors are at most a few hundred MiB); should
    one of them free so much that 4 GiB fit after all, the test skips, saying so."""
    n = 4 * GiB
    rt = cp.cuda.runtime
    gc.collect()  # earlier tests' arrays kept by reference cycles: back to CuPy's pool, then freed
    pool = cp.get_default_memory_pool()
    pool.free_all_blocks()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()  # nothing cached here that an allocation could fall back on
    free, _ = rt.memGetInfo()
    if free < 3 * n:
        pytest.skip(f"needs {3 * n >> 30} GiB of free GPU memory, {free >> 30} GiB free")
    src = np.arange(n // 4, dtype=np.uint32)
    async with connected_pair("tcp", limits=Limits(recv_buffer_bytes=0)) as (a, b):
        send = asyncio.ensure_future(a.send(src, tag="big"))
        await eventually(lambda: _holds(b, "big"))
        causes = []
        with most_of_the_device():  # (test_pack.py's 40 GiB meanwhile would find 2 GiB left)
            held = _fill_device(n // 2)
            try:
                allocator = cp.cuda.get_allocator()
                causes.append(await _refused(b, n))
                cp.cuda.set_allocator(None)  # cudaMalloc for every array: its own error
                try:
                    causes.append(await _refused(b, n))
                finally:
                    cp.cuda.set_allocator(allocator)
            finally:
                for ptr in held:
                    rt.free(ptr)
        pooled_cause, raw_cause = causes
        assert type(pooled_cause).__name__ == "OutOfMemoryError", repr(pooled_cause)
        # CuPy's Memory without its pool: runtime.malloc's CUDARuntimeError, cudaErrorMemoryAllocation
        assert type(raw_cause).__name__ == "CUDARuntimeError" and raw_cause.status == 2, repr(raw_cause)
        out = cp.empty(src.shape, cp.uint32)  # as the message: 2**30 uint32, 4 GiB
        async with asyncio.timeout(60):
            assert await b.recv(tag="big", out=out) is out
            await send
        # compared on the device (a copy of 4 GiB to the host would hold the loop for seconds):
        # src is arange, so each element is its own index
        want = cp.arange(src.size, dtype=cp.uint32)
        assert bool(cp.array_equal(out, want)), "the message kept for recv(out=) came in wrong"
