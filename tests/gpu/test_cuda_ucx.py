"""CUDA tensors over ucx's device-pointer path on a GPU: payloads posted as device pointers
(between two nodes UCX moves them with cuda_ipc, in one process through its same-process
shortcut, between processes by mapping the other's memory), streams honoured both ways,
cancellation at every step, and between two processes the path naming cuda_ipc and UCX's own
account of the protocols it used (UCX_PROTO_INFO=used) showing cuda_ipc moved the bytes.

tests/test_tensors_device.py runs the same ucx code without a GPU (host-engine memory posted by
pointer); this file is where it meets CUDA memory and UCX's cuda transports. Skips with a reason
without CuPy, a CUDA device, torch, ucxx, or a libucx with cuda transports.
"""

from __future__ import annotations

import asyncio
import textwrap
from typing import Any

import pytest
from _gpu_skip import cupy_with_a_device, ucx_with_cuda

cp = cupy_with_a_device("the CUDA transfer tests")
ucx_with_cuda()

import tensorwire  # noqa: E402
from tensorwire.testing import cancel_recv_at_every_step, connected_pair, exchange  # noqa: E402
from tensorwire.transports import Limits  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(90)]
MiB = 1 << 20
SPIN = 1_000_000_000  # torch.cuda._sleep cycles: about half a second at GPU clocks
LIMITS = Limits(recv_buffer_bytes=1 * MiB)  # above this a message goes rendezvous


def _torch() -> Any:
    return pytest.importorskip("torch", reason="torch is not installed: the torch CUDA tests need it")


def _bytes(torch: Any, n: int, seed: int) -> Any:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g, device="cuda", dtype=torch.uint8)


@pytest.mark.parametrize("nbytes", [100, 256 * 1024 + 5, 8 * MiB], ids=["small", "eager", "rendezvous"])
@pytest.mark.parametrize("order", ["recv-first", "send-first"])
async def test_ucx_moves_device_memory_by_pointer(nbytes: int, order: str) -> None:
    torch = _torch()
    x = _bytes(torch, nbytes, nbytes)
    async with connected_pair("ucx", limits=LIMITS) as (a, b):
        assert "cuda" in a.channel.device_kinds and "cuda" in b.channel.device_kinds
        out = torch.zeros_like(x)
        got, sent, receipt = await exchange(a, b, x, out, order)
        assert got is out and torch.equal(out, x)  # on the current stream: after the bytes landed
        assert sent.memory == "cuda" and not sent.staged and sent.direct, sent
        assert receipt.memory == "cuda", receipt
        if order == "recv-first" or nbytes > LIMITS.recv_buffer_bytes:  # UCX wrote into out= itself
            assert not receipt.staged and receipt.direct, receipt
        else:  # an eager message that came first waited in a buffer of ours: said so
            assert receipt.staged and not receipt.direct, receipt
        # and without out=: allocated on the device, the bytes still moved by UCX
        _, y = await asyncio.gather(a.send(x, tag="y"), b.recv(tag="y", device="cuda:0"))
        assert y.is_cuda and torch.equal(y, x)


async def test_ucx_send_waits_for_the_producer_stream() -> None:
    """UCX reads device memory outside every stream: a send posts the pointer only once the
    producer stream's work is done, so the bytes sent are the ones that stream writes last."""
    torch = _torch()
    x = torch.zeros(8 * MiB, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    async with connected_pair("ucx", limits=LIMITS) as (a, b):
        recv = asyncio.ensure_future(b.recv(tag="p", device="cuda:0"))
        await asyncio.sleep(0)
        with torch.cuda.stream(side):
            torch.cuda._sleep(SPIN)  # the side stream stays busy
            x.fill_(7)
            sending = asyncio.ensure_future(a.send(x, tag="p"))
            await asyncio.sleep(0)  # the send takes its event while the side stream is current
        assert not side.query()
        await sending
        y = await recv
        assert int(y.min()) == 7 and int(y.max()) == 7


@pytest.mark.parametrize("nbytes", [256 * 1024 + 5, 8 * MiB], ids=["eager", "rendezvous"])
async def test_ucx_recv_waits_for_the_consumer_stream_without_blocking_the_loop(nbytes: int) -> None:
    """UCX writes device memory outside every stream: a recv into a tensor whose stream is still
    busy posts its receive once that work is done, waiting on the host without blocking the loop."""
    torch = _torch()
    x = _bytes(torch, nbytes, 3)
    consumer = torch.cuda.Stream()
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    async with connected_pair("ucx", limits=LIMITS) as (a, b):
        out = torch.zeros_like(x)
        consumer.wait_stream(torch.cuda.current_stream())  # out's zeros first
        tick = asyncio.ensure_future(ticker())
        try:
            with torch.cuda.stream(consumer):
                torch.cuda._sleep(SPIN)  # earlier work of the consumer on out's stream
                recv = asyncio.ensure_future(b.recv(tag="c", out=out))
                await asyncio.sleep(0)  # the recv takes the consumer stream now
            async with asyncio.timeout(30):
                await asyncio.gather(a.send(x, tag="c"), recv)
        finally:
            tick.cancel()
        assert consumer.query(), "the receive was posted before the consumer stream's earlier work was done"
        assert ticks >= 10, f"the event loop stalled while the recv waited for its stream ({ticks} ticks)"
        with torch.cuda.stream(consumer):
            ok = torch.equal(out, x)
        assert ok


@pytest.mark.parametrize("nbytes", [256 * 1024 + 5, 8 * MiB], ids=["eager", "rendezvous"])
async def test_ucx_device_out_cancelled_at_every_step_loses_nothing(nbytes: int) -> None:
    """A recv into device memory cancelled after 0..14 loop iterations (before the header, while
    waiting for the consumer stream, while UCX writes): once the cancel returns its out= is never
    written again, and the next recv gets the message whole."""
    torch = _torch()
    x = _bytes(torch, nbytes, 9)
    async with connected_pair("ucx", limits=LIMITS) as (a, b):
        # .cpu() copies on the current stream, after the recv's work on it (UCX writes outside it)
        cancelled = await cancel_recv_at_every_step(a, b, x, lambda: torch.zeros_like(x), lambda t: t.cpu().numpy())
    assert cancelled >= 3, f"only {cancelled} of 10 recvs were cancelled before they completed"


@pytest.mark.parametrize("nbytes", [256 * 1024 + 5, 8 * MiB], ids=["eager", "rendezvous"])
async def test_ucx_recv_cancelled_while_its_stream_is_busy(nbytes: int) -> None:
    """A recv cancelled while it waits for its consumer stream posts nothing into its out=, and
    the message goes whole to the next recv."""
    torch = _torch()
    x = _bytes(torch, nbytes, 4)
    consumer = torch.cuda.Stream()
    async with connected_pair("ucx", limits=LIMITS) as (a, b):
        out = torch.zeros_like(x)
        consumer.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(consumer):
            torch.cuda._sleep(SPIN)
            recv = asyncio.ensure_future(b.recv(tag="x", out=out))
            await asyncio.sleep(0)
        send = asyncio.ensure_future(a.send(x, tag="x"))
        await asyncio.sleep(0.1)  # matched; the recv waits for its stream (half a second)
        assert not recv.done() and not consumer.query()
        recv.cancel()
        with pytest.raises(asyncio.CancelledError):
            await recv
        second = torch.zeros_like(x)
        async with asyncio.timeout(30):
            await asyncio.gather(send, b.recv(tag="x", out=second))
        torch.cuda.synchronize()
        assert torch.equal(second, x)
        assert int(out.count_nonzero()) == 0, "out= was written after its recv was cancelled"


_CHILD = textwrap.dedent(
    """
    import asyncio, json, sys
    import torch
    import tensorwire

    async def main():
        async with tensorwire.start("127.0.0.1:0", transports=("ucx",)) as node:
            print(json.dumps(node.address), flush=True)
            peer = await node.accept()
            for _ in range(int(sys.argv[1])):
                x = await peer.recv(tag="x", device="cuda:0")   # on the current stream
                await peer.send({"y": x * 2, "sum": int(x.sum(dtype=torch.int64))}, tag="y")
            await peer.recv(tag="bye")

    asyncio.run(main())
    """
)


async def test_ucx_between_two_processes_on_one_gpu_says_cuda_ipc(cuda_ipc_child: Any) -> None:
    """Two processes on one GPU: the tensors go by device pointer both ways, and the path names
    UCX's cuda_ipc lanes (the transport that maps the other process's memory); so does the
    child's UCX, in its account of the protocols it used."""
    torch = _torch()
    sizes = [4096, 3 * MiB, 64 * MiB]
    async with cuda_ipc_child(_CHILD, str(len(sizes))) as address:
        async with tensorwire.start("127.0.0.1:0", transports=("ucx",)) as node:
            peer = await node.connect(address)
            assert peer.path.transport == "ucx", peer.path
            assert any(lane.startswith("cuda_ipc") for lane in peer.path.lanes), peer.path
            for i, n in enumerate(sizes):
                g = torch.Generator(device="cuda").manual_seed(i)
                x = torch.randint(-1000, 1000, (n // 4,), generator=g, device="cuda", dtype=torch.int32)
                sent = await peer.send(x, tag="x")
                assert sent.memory == "cuda" and not sent.staged, sent
                got, receipt = await asyncio.wait_for(peer.recv_with_receipt(tag="y"), 60)
                assert receipt.memory == "cuda", receipt
                assert got["sum"] == int(x.sum(dtype=torch.int64)), f"{n} bytes: the child got other bytes"
                assert torch.equal(got["y"], x * 2), f"{n} bytes: the answer came back wrong"
            await peer.send("bye", tag="bye")
