"""Two nodes in two Soft-RoCE guests exchanging tensors over RDMA (run by tests/test_verbs_vm.py
through ``scripts/rxe-vm.sh run2``): ``python3 -m tests.verbs.two_node a|b``.

Guest a serves on its address, exposes a tensor and echoes what b sends, doubled; guest b
connects, sends small and large tensors and a pytree, reads and writes a's exposed tensor
one-sided, and checks every byte. Each prints TWO_NODE_OK on success and exits non-zero otherwise.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

import numpy as np

import tensorwire
from tensorwire.errors import ConnectError, ConnectTimeout, ControlPlaneError

PORT = 7700
MiB = 1 << 20
OPTS = {"transports": ("verbs",), "lease_seconds": 60.0, "connect_timeout": 60.0}


def _check_path(peer: tensorwire.Peer, ip: str) -> None:
    assert peer.path.transport == "verbs" and peer.path.rdma, peer.path
    port = peer.node.transports["verbs"].port  # type: ignore[attr-defined]
    assert port.gid == bytes(10) + b"\xff\xff" + bytes(int(x) for x in ip.split(".")), port.describe()
    print(f"path: {peer.path}; local GID {port.describe()}", flush=True)


async def serve(ip: str) -> None:
    async with tensorwire.start(f"{ip}:{PORT}", **OPTS) as node:
        w = np.arange(MiB // 8, dtype=np.float64)  # 1 MiB exposed for one-sided access
        node.expose(w, name="w")
        peer = await node.accept()
        _check_path(peer, ip)
        for _ in range(3):
            x = await peer.recv(tag="x")
            if isinstance(x, dict):
                await peer.send({k: v * 2 for k, v in x.items()}, tag="y")
            else:
                await peer.send(x * 2, tag="y")
        assert await peer.recv(tag="done") == "written"
        assert np.array_equal(w, np.full_like(w, 9.0)), "b's RDMA WRITE did not land"
        await peer.send("bye", tag="bye")
        await asyncio.sleep(0.5)


async def client(ip: str, peer_ip: str) -> None:
    async with tensorwire.start(f"{ip}:0", **OPTS) as node:
        deadline = time.monotonic() + 180
        while True:  # the other guest may still be booting
            try:
                peer = await node.connect(f"{peer_ip}:{PORT}", connect_timeout=30)
                break
            except (ConnectError, ConnectTimeout, ControlPlaneError):
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(1)
        _check_path(peer, ip)
        rng = np.random.default_rng(0)
        small = rng.integers(0, 1000, size=100, dtype=np.int32)
        large = rng.standard_normal(4 * MiB // 4).astype(np.float32)
        tree = {"a": np.arange(10, dtype=np.int16), "b": rng.standard_normal((64, 64))}
        t0 = time.perf_counter()
        for x in (small, large, tree):
            r = await peer.send(x, tag="x")
            y = await peer.recv(tag="y")
            if isinstance(x, dict):
                assert all(np.array_equal(y[k], x[k] * 2) for k in x)
            else:
                assert np.array_equal(y, x * 2)
            print(f"round trip of {r.nbytes} bytes: {r.protocol}", flush=True)
        print(f"exchanged tensors in {time.perf_counter() - t0:.2f} s", flush=True)
        h = await peer.lookup("w")
        assert h.direct and h.transport == "verbs"
        got, receipt = await peer.read_with_receipt(h)
        assert receipt.protocol == "one-sided" and np.array_equal(got, np.arange(MiB // 8, dtype=np.float64))
        await peer.write(h, np.full(MiB // 8, 9.0))
        await peer.send("written", tag="done")
        assert await peer.recv(tag="bye") == "bye"


def main() -> int:
    role = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("RXE_ROLE", "")
    ip = os.environ["RXE_IP"]
    if role == "a":
        asyncio.run(serve(ip))
    elif role == "b":
        asyncio.run(client(ip, os.environ["RXE_PEER"]))
    else:
        print(f"unknown role {role!r}", file=sys.stderr)
        return 2
    print("TWO_NODE_OK", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
