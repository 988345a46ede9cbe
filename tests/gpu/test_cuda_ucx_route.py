"""What UCX says it did with CUDA memory between two processes on one GPU, in the receipt
(``Receipt.route`` and ``lanes``, from ``ucp_request_query``): a 64 MiB send, and a one-sided
read of a 64 MiB CUDA tensor the other process exposes into a CUDA ``out=``, should each name a
zero-copy protocol over ``cuda_ipc/cuda`` (docs/gpu.md, "To check on the first GPU run", item
25). The child process moves the bytes and reports its receipt; its UCX's own account
(``UCX_PROTO_INFO=used``, the ``cuda_ipc_child`` fixture) must agree that cuda_ipc moved them.

tests/test_ucx_route.py holds the same receipts to host memory without a GPU, and
tests/test_ucx_route_info.py the parser to the strings UCX writes for CUDA memory. Skips with
a reason without CuPy, a CUDA device, torch, ucxx, or a libucx with cuda transports; and where
the endpoint has no cuda_ipc lane, saying which lanes it has.
"""

from __future__ import annotations

import asyncio
import textwrap
from typing import Any

import pytest
from _gpu_skip import cupy_with_a_device, ucx_with_cuda

cp = cupy_with_a_device("the CUDA route tests")
ucx_with_cuda()

import tensorwire  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]
MiB = 1 << 20
N = 64 * MiB // 4  # int32 elements: 64 MiB, past the size from which UCX is asked (4 MiB)

# argv: "send" (a 64 MiB CUDA tensor to the parent) or "read" (the parent's exposed one, into a
# CUDA out=); then the receipt and the endpoint's lanes go to the parent
_CHILD = textwrap.dedent(
    """
    import asyncio, json, sys
    import torch
    import tensorwire

    async def main():
        async with tensorwire.start("127.0.0.1:0", transports=("ucx",)) as node:
            print(json.dumps(node.address), flush=True)
            peer = await node.accept()
            if sys.argv[1] == "send":
                g = torch.Generator(device="cuda").manual_seed(25)
                x = torch.randint(-1000, 1000, (int(sys.argv[2]),), generator=g, device="cuda", dtype=torch.int32)
                receipt = await peer.send(x, tag="x")
            else:
                await peer.recv(tag="exposed")
                h = await peer.lookup("kv")
                x = torch.empty(h.shape, dtype=torch.int32, device="cuda")
                _, receipt = await peer.read_with_receipt(h, out=x)
            await peer.send({
                "route": receipt.route, "lanes": list(receipt.lanes), "endpoint": list(peer.channel.lanes),
                "protocol": receipt.protocol, "memory": receipt.memory, "staged": receipt.staged,
                "sum": int(x.sum(dtype=torch.int64)),
            }, tag="report")
            await peer.recv(tag="bye")

    asyncio.run(main())
    """
)


def _torch() -> Any:
    return pytest.importorskip("torch", reason="torch is not installed: the torch CUDA tests need it")


@pytest.mark.parametrize("op", ["send", "read"])
async def test_a_64_mib_cuda_transfer_between_two_processes_names_cuda_ipc_in_its_route(
    cuda_ipc_child: Any, op: str
) -> None:
    torch = _torch()
    async with cuda_ipc_child(_CHILD, op, str(N)) as address:
        async with tensorwire.start("127.0.0.1:0", transports=("ucx",)) as node:
            peer = await node.connect(address)
            if op == "send":
                got = await asyncio.wait_for(peer.recv(tag="x", device="cuda:0"), 60)
                want = int(got.sum(dtype=torch.int64))
            else:
                kv = torch.randint(-1000, 1000, (N,), dtype=torch.int32, device="cuda")
                torch.cuda.synchronize()  # ready before the reader is told of it
                node.expose(kv, name="kv")
                await peer.send("exposed", tag="exposed")
                want = int(kv.sum(dtype=torch.int64))
            r = await asyncio.wait_for(peer.recv(tag="report"), 60)
            await peer.send("bye", tag="bye")
            assert r["sum"] == want, f"{op}: the bytes differ between the processes ({r})"
            assert r["memory"] == "cuda" and not r["staged"], r
            if op == "read":
                assert r["protocol"] == "one-sided", r
            # UCX named a protocol, and lanes of this endpoint (docs/ucx.md, "Which protocols
            # UCX used"): an empty route is a CUDA answer _ucp._route could not read
            assert r["route"], f"{op}: no route in the receipt (UCX's answer not read?): {r}"
            assert r["lanes"] and set(r["lanes"]) <= set(r["endpoint"]), r
            if not any(lane.startswith("cuda_ipc") for lane in r["endpoint"]):
                pytest.skip(
                    f"the endpoint has no cuda_ipc lane (lanes: {', '.join(r['endpoint'])}); UCX said "
                    f"{r['route']!r} over {', '.join(r['lanes'])}"
                )
            if op == "read" and r["route"] == "software emulation":
                # the first H200 run (2026-11-30, UCX 1.21): every one-sided read of CUDA memory
                # between two processes went so (64 MiB in ~140 ms; torch or CuPy memory on either
                # side; ucp_mem_map given the memory type or not), while the same processes' tag
                # rendezvous moved CUDA memory over cuda_ipc. A known gap (docs/gpu.md, "GPU
                # runs"), not yet understood; the bytes arrived right (checked above)
                pytest.xfail(f"UCX emulated a one-sided read of CUDA memory over {', '.join(r['lanes'])}")
            # CUDA IPC maps the other process's memory: one zero-copy transfer over cuda_ipc,
            # not cuda_copy staging through host fragments nor a host lane
            assert any(lane.startswith("cuda_ipc") for lane in r["lanes"]), r
            assert "zero-copy" in r["route"] and "cuda_copy" not in r["route"], r
