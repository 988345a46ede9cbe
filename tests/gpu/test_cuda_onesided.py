"""One-sided access to CUDA memory on a GPU: exposed torch and CuPy CUDA tensors read and written
by rows, into and from CUDA tensors, over every transport here (owner-assisted over tcp and
inproc, staged through host memory; one-sided over ucx by device pointer where UCX has cuda
lanes), reads ordered after the consumer stream's earlier work and writes after the producer's,
and between two processes on one GPU UCX's own account saying cuda_ipc moved the bytes.

The conformance check ``one_sided_device_memory`` runs the same code without a GPU (host-engine
memory); this file is where it meets CUDA memory. Skips with a reason without CuPy, a CUDA
device or torch, and its ucx tests without ucxx or a libucx with cuda transports.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import textwrap
from typing import Any

import numpy as np
import pytest
from _gpu_skip import cupy_with_a_device

cp = cupy_with_a_device("the CUDA one-sided tests")

import tensorwire  # noqa: E402
from tensorwire.testing import connected_pair, slow_sends  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]
MiB = 1 << 20
SPIN = 1_000_000_000  # torch.cuda._sleep cycles: about half a second at GPU clocks


def _torch() -> Any:
    return pytest.importorskip("torch", reason="torch is not installed: the torch CUDA tests need it")


def _ucxx() -> None:
    """Skip unless ucxx is installed (not imported here)."""
    if importlib.util.find_spec("ucxx") is None:
        pytest.skip("ucxx is not installed here (docs/gpu.md: scripts/gpu_wheels.sh carries it)")


def _ucx_cuda() -> None:
    """Skip unless ucx runs here with cuda transports."""
    _ucxx()
    from tensorwire.transports.ucx import UcxTransport

    caps = UcxTransport.probe()
    if caps is None:
        pytest.skip(f"ucx cannot run here: {UcxTransport.unavailable_reason()}")
    if "cuda" not in caps.memory_kinds:
        pytest.skip(f"this libucx has no cuda transports (lanes: {', '.join(caps.lanes)})")


TRANSPORTS = ["tcp", "inproc", "ucx"]


def _torch_for(transport: str) -> Any:
    """torch, and a skip unless ``transport`` can run here with CUDA memory."""
    torch = _torch()
    if transport == "ucx":
        _ucx_cuda()
    return torch


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_cuda_exposure_read_and_written_by_rows(transport: str) -> None:
    torch = _torch_for(transport)
    kv = torch.arange(256 * 64 * 16, dtype=torch.int32, device="cuda").reshape(256, 64, 16)
    host = np.arange(256 * 64, dtype=np.float32).reshape(256, 64)
    torch.cuda.synchronize()  # the owner's tensors are ready before anyone is told of them
    async with connected_pair(transport) as (a, b):
        a.node.expose(kv, name="kv")
        a.node.expose(host, name="host")
        h, hh = await b.lookup("kv"), await b.lookup("host")
        assert h.memory == "cuda" and hh.memory == "host", (h, hh)
        direct = transport == "ucx"
        assert h.direct == direct, h
        protocol = "one-sided" if direct else "owner-assisted"
        # rows into a CUDA out=, into a strided one, into host memory, and allocated
        out = torch.full((8, 64, 16), -1, dtype=torch.int32, device="cuda")
        got, receipt = await b.read_with_receipt(h[10:18], out=out)
        assert got is out and torch.equal(out, kv[10:18])
        assert receipt.protocol == protocol and receipt.memory == "cuda", receipt
        assert receipt.staged == (not direct), receipt
        strided = torch.zeros((64, 4, 16), dtype=torch.int32, device="cuda").transpose(0, 1)
        await b.read(h[40:44], out=strided)
        assert torch.equal(strided, kv[40:44])
        y = await b.read(h[-1])  # where the owner's tensor is: CUDA, this process has it
        assert y.is_cuda and torch.equal(y, kv[-1])
        z = await b.read(h[3], device="cpu")
        assert isinstance(z, np.ndarray) and np.array_equal(z, kv[3].cpu().numpy())
        c = cp.zeros((2, 64, 16), dtype=cp.int32)
        await b.read(h[5:7], out=c)
        assert bool((c == cp.asarray(kv[5:7])).all())
        # host memory into CUDA, one batch of both kinds
        outs = [torch.zeros((64, 16), dtype=torch.int32, device="cuda"), torch.zeros(64, device="cuda")]
        got = await b.read_many([h[100], hh[7]], outs=outs)
        assert torch.equal(got[0], kv[100]) and np.array_equal(got[1].cpu().numpy(), host[7])
        # writes from CUDA into both kinds, and from host into CUDA
        before = kv.clone()
        receipt = await b.write(h[20:22], torch.full((2, 64, 16), 7, dtype=torch.int32, device="cuda"))
        assert receipt.protocol == protocol and receipt.memory == "cuda", receipt
        await b.write(hh[0], torch.full((64,), 8.0, device="cuda"))
        await b.write(h[-2], np.full((64, 16), 9, np.int32))
        row = torch.full((64, 16), 10, dtype=torch.int32, device="cuda")
        broadcast = torch.full((1, 64, 16), 11, dtype=torch.int32, device="cuda").expand(2, 64, 16)  # packed
        receipt = await b.write_many([h[30], h[31:33]], [row, broadcast])
        assert receipt.packed, receipt
        torch.cuda.synchronize()
        before[20:22], before[-2], before[30], before[31:33] = 7, 9, 10, 11
        assert torch.equal(kv, before), "a write landed wrong"
        assert (host[0] == 8.0).all()
        if direct:
            assert a.node.exposures.served == 0, "the owner's code took part in a one-sided access"
        await a.node.unexpose("kv")
        with pytest.raises(tensorwire.HandleNotFound):
            await b.read(h[1], out=torch.zeros((64, 16), dtype=torch.int32, device="cuda"))


@pytest.mark.parametrize("slow", [False, True], ids=["", "slow-sends"])
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_cuda_read_waits_for_the_consumer_stream(transport: str, slow: bool) -> None:
    """A read into a CUDA tensor lands after the work its stream had queued at the call (here a
    fill that the read must overwrite), and may be used on that stream at once. The stream is
    the one current at the call, though another is current by the time an owner-served read's
    request has gone (``slow``)."""
    torch = _torch_for(transport)
    kv = torch.arange(64 * MiB // 4, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    consumer = torch.cuda.Stream()
    async with connected_pair(transport) as (a, b):
        a.node.expose(kv, name="kv")
        h = await b.lookup("kv")
        with slow_sends(b) if slow else contextlib.nullcontext():
            out = torch.zeros_like(kv)
            consumer.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(consumer):
                torch.cuda._sleep(SPIN)  # the consumer's earlier work on out=: a slow fill of -1
                out.fill_(-1)
                read = asyncio.ensure_future(b.read(h, out=out))
                await asyncio.sleep(0)  # the read takes the consumer stream now
            await asyncio.wait_for(read, 60)
            with torch.cuda.stream(consumer):
                ok = torch.equal(out, kv)  # on the consumer's stream, right away
            assert ok, "the read landed before the consumer stream's earlier fill (or was not ready on it)"


@pytest.mark.parametrize("slow", [False, True], ids=["", "slow-sends"])
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_cuda_write_waits_for_the_producer_stream(transport: str, slow: bool) -> None:
    """A write from a CUDA tensor carries what its stream wrote into it before the call: the
    stream current at the call, though another is current by the time an owner-served write's
    request has gone (``slow``)."""
    torch = _torch_for(transport)
    kv = torch.zeros(16 * MiB // 4, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    src = torch.zeros_like(kv)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    async with connected_pair(transport) as (a, b):
        a.node.expose(kv, name="kv")
        h = await b.lookup("kv")
        with slow_sends(b) if slow else contextlib.nullcontext():
            with torch.cuda.stream(side):
                torch.cuda._sleep(SPIN)
                src.fill_(7)
                write = asyncio.ensure_future(b.write(h, src))
                await asyncio.sleep(0)  # the write takes its event while the side stream is current
            assert not side.query()
            await asyncio.wait_for(write, 60)
            torch.cuda.synchronize()
            assert int(kv.min()) == 7 and int(kv.max()) == 7, "the write read its source before its stream wrote it"


async def test_staged_one_sided_cuda_goes_through_the_pinned_chunks() -> None:
    """Where a channel cannot take CUDA pointers (verbs, a ucx without cuda lanes; here a ucx
    channel told so), one-sided reads of a host exposure into CUDA tensors land in the pinned
    staging chunks and are copied up from them, and writes go down through them. A pool of
    three 256 KiB chunks, so that a 16 MiB tensor spans 64 of them and a batch of rows shares
    them; the read lands after its consumer stream's earlier work, the write carries what its
    producer stream wrote, and every chunk comes back to its pool."""
    torch = _torch()
    _ucxx()
    from tensorwire.memory import CHUNK_BYTES, DEPTH
    from tensorwire.memory._cuda import CudaEngine

    engine = CudaEngine.get(torch.cuda.current_device())
    pools = [engine.pool("in"), engine.pool("out")]
    for pool in pools:
        pool.configure(256 << 10, 3)
    n = 16 * MiB
    host = np.random.default_rng(3).integers(0, 256, n, dtype=np.uint8)
    want = torch.from_numpy(host.copy()).cuda()
    consumer = torch.cuda.Stream()
    consumer.wait_stream(torch.cuda.current_stream())
    try:
        async with connected_pair("ucx") as (a, b):
            b.channel.device_kinds = frozenset()  # as verbs: no CUDA pointers in one-sided operations
            a.node.expose(host, name="host")
            h = await b.lookup("host")
            assert h.direct, h
            out = torch.zeros(n, dtype=torch.uint8, device="cuda")
            with torch.cuda.stream(consumer):
                torch.cuda._sleep(SPIN)  # the consumer's earlier work on out=: a slow fill
                out.fill_(1)
                got, receipt = await asyncio.wait_for(b.read_with_receipt(h, out=out), 60)
                ok = torch.equal(out, want)  # on the consumer's stream, right away
            assert got is out and ok, "a staged one-sided read into CUDA memory landed wrong or too early"
            assert receipt.protocol == "one-sided" and receipt.staged and receipt.memory == "cuda", receipt
            spans = [(5, 105), (4000, 4001), (MiB, 3 * MiB + 17), (n - 64, n)]
            outs = [torch.zeros(e - s, dtype=torch.uint8, device="cuda") for s, e in spans]
            await asyncio.wait_for(b.read_many([h[s:e] for s, e in spans], outs=outs), 60)
            for o, (s, e) in zip(outs, spans, strict=True):
                assert torch.equal(o, want[s:e]), f"row {s}:{e} of a staged batch landed wrong"
            src = torch.zeros(n, dtype=torch.uint8, device="cuda")
            with torch.cuda.stream(consumer):
                torch.cuda._sleep(SPIN)
                src.fill_(9)
                receipt = await asyncio.wait_for(b.write(h, src), 60)
            assert receipt.staged and receipt.protocol == "one-sided", receipt
            assert (host == 9).all(), "a staged one-sided write read its source before its stream wrote it"
            for pool in pools:
                assert pool.free == 3 and pool.retired == 0, pool
    finally:
        for pool in pools:
            pool.configure(CHUNK_BYTES, DEPTH)


_CHILD = textwrap.dedent(
    """
    import asyncio, json, sys
    import torch
    import tensorwire

    async def main():
        async with tensorwire.start("127.0.0.1:0", transports=("ucx",)) as node:
            print(json.dumps(node.address), flush=True)
            peer = await node.accept()
            await peer.recv(tag="exposed")
            h = await peer.lookup("kv")
            out = torch.empty((64,) + h.shape[1:], dtype=torch.int32, device="cuda")
            got, receipt = await peer.read_with_receipt(h[128:192], out=out)
            rows = [int(r) for r in torch.randperm(h.shape[0])[:32]]
            many = await peer.read_many([h[r] for r in rows])
            w = await peer.write(h[7], torch.full(h.shape[1:], -5, dtype=torch.int32, device="cuda"))
            await peer.send({
                "direct": h.direct, "protocol": receipt.protocol, "memory": receipt.memory,
                "staged": receipt.staged, "sum": int(out.sum(dtype=torch.int64)),
                "rows": rows, "row_sums": [int(m.sum(dtype=torch.int64)) for m in many],
                "write": [w.protocol, w.memory, w.staged],
            }, tag="report")
            await peer.recv(tag="bye")

    asyncio.run(main())
    """
)


async def test_ucx_one_sided_between_two_processes_on_one_gpu_says_cuda_ipc(cuda_ipc_child: Any) -> None:
    """Two processes on one GPU: the reader gets rows of the owner's CUDA tensor into its own
    CUDA memory and writes a row back, one-sided, and UCX's own account of the protocols it used
    (UCX_PROTO_INFO=used) says cuda_ipc moved CUDA memory."""
    torch = _torch()
    _ucx_cuda()
    async with cuda_ipc_child(_CHILD) as address:
        kv = torch.randint(-1000, 1000, (1024, 256, 64), dtype=torch.int32, device="cuda")  # 64 MiB
        torch.cuda.synchronize()
        async with tensorwire.start("127.0.0.1:0", transports=("ucx",)) as node:
            peer = await node.connect(address)
            node.expose(kv, name="kv")
            await peer.send("exposed", tag="exposed")
            report = await asyncio.wait_for(peer.recv(tag="report"), 60)
            assert report["direct"] and report["protocol"] == "one-sided", report
            assert report["memory"] == "cuda" and not report["staged"], report
            assert report["sum"] == int(kv[128:192].sum(dtype=torch.int64)), "the rows read came back wrong"
            assert report["row_sums"] == [int(kv[r].sum(dtype=torch.int64)) for r in report["rows"]]
            assert report["write"] == ["one-sided", "cuda", False], report
            torch.cuda.synchronize()
            assert int(kv[7].min()) == -5 and int(kv[7].max()) == -5, "the one-sided write did not land"
            assert node.exposures.served == 0, "the owner's code took part in one-sided operations"
            await peer.send("bye", tag="bye")
