"""tensorwire's verbs transport against perftest (ib_write_bw / ib_read_bw) on the same RDMA
device, in the same boot. Meant for the Soft-RoCE guest, where only the ratio means anything
(the guest is emulated, so absolute numbers are the emulator's):

    bash scripts/rxe-vm.sh run . -- python3 benchmarks/verbs_bw.py
    bash scripts/rxe-vm.sh run . -- python3 benchmarks/verbs_bw.py --sizes 65536,1048576 --mib 64

On a machine with a real RDMA NIC run it directly (``--dev mlx5_0 --ip <its address>``).

Rows: perftest's BW average for each size, and tensorwire between two processes:
two-sided (``peer.send`` -> ``peer.recv(out=)``, which moves the payload by RDMA READ into
``out=``: compared with ib_read_bw), one-sided ``peer.write`` (RDMA WRITE: ib_write_bw) and
``peer.read`` (RDMA READ: ib_read_bw). tensorwire keeps ``--depth`` operations in flight, as
perftest keeps its queue full. Ratio = tensorwire / perftest.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tensorwire
from tensorwire.transports.verbs import choose_port

PORT = 7711
OPTS = {"transports": ("verbs",), "lease_seconds": 120.0, "connect_timeout": 120.0}


def perftest(tool: str, dev: str, gid: int, ip: str, size: int, iters: int) -> float:
    """BW average in MB/s (10**6 bytes) of ``tool`` over ``dev`` talking to itself; a run that
    reports nothing moved (perftest does so now and then) is repeated."""
    for _ in range(3):
        bw = _perftest_once(tool, dev, gid, ip, size, iters)
        if bw > 0:
            return bw
    raise RuntimeError(f"{tool} kept reporting 0 MB/s")


def _perftest_once(tool: str, dev: str, gid: int, ip: str, size: int, iters: int) -> float:
    args = [tool, "-d", dev, "-x", str(gid), "-s", str(size), "-n", str(iters), "-F"]
    server = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for _ in range(50):
            time.sleep(0.5)
            client = subprocess.run([*args, ip], capture_output=True, text=True, timeout=600)
            if client.returncode == 0:
                break
        else:
            raise RuntimeError(f"{tool} client failed: {client.stdout[-500:]}{client.stderr[-500:]}")
    finally:
        server.wait(timeout=60)
    m = re.search(rf"^\s*{size}\s+{iters}\s+([\d.]+)\s+([\d.]+)", client.stdout, re.M)
    if m is None:
        raise RuntimeError(f"cannot parse {tool}: {client.stdout[-500:]}")
    return float(m.group(2))


async def serve(ip: str, max_size: int, depth: int) -> None:
    """The other process: exposes a buffer and receives into pre-posted out= buffers."""
    async with tensorwire.start(f"{ip}:{PORT}", **OPTS) as node:
        exposed = np.zeros(max_size, np.uint8)
        node.expose(exposed, name="buf")
        peer = await node.accept()
        outs = [np.empty(max_size, np.uint8) for _ in range(depth)]
        while True:
            cmd = await peer.recv(tag="cmd")
            if cmd["op"] == "stop":
                break
            size, count = cmd["size"], cmd["count"]

            async def lane(i: int, n: int, size: int = size) -> None:
                view = outs[i][:size]
                for _ in range(n):
                    await peer.recv(tag=f"bw{i}", out=view)

            per = [count // depth + (1 if i < count % depth else 0) for i in range(depth)]
            await asyncio.gather(*[lane(i, n) for i, n in enumerate(per)])
            await peer.send("done", tag="ack")


async def measure(ip: str, sizes: list[int], total: int, depth: int) -> dict[tuple[str, int], float]:
    """The measuring process (the serving one was started by ``run``)."""
    results: dict[tuple[str, int], float] = {}
    async with tensorwire.start(f"{ip}:0", **OPTS) as node:
        for _ in range(240):
            try:
                peer = await node.connect(f"{ip}:{PORT}")
                break
            except tensorwire.TensorWireError:
                await asyncio.sleep(0.5)
        else:
            raise RuntimeError("the serving process never came up")
        h = await peer.lookup("buf")
        assert h.direct, "the exposed buffer is not reachable one-sided"
        for size in sizes:
            count = max(depth, total // size)
            src = [np.full(size, i, np.uint8) for i in range(depth)]
            # warm-up: registrations, first touches
            await peer.send({"op": "run", "size": size, "count": depth}, tag="cmd")
            await asyncio.gather(*[peer.send(src[i], tag=f"bw{i}") for i in range(depth)])
            await peer.recv(tag="ack")
            # two-sided: send -> recv(out=)
            await peer.send({"op": "run", "size": size, "count": count}, tag="cmd")
            per = [count // depth + (1 if i < count % depth else 0) for i in range(depth)]

            async def sender(i: int, n: int, src: list[np.ndarray] = src) -> None:
                for _ in range(n):
                    await peer.send(src[i], tag=f"bw{i}")

            t0 = time.perf_counter()
            await asyncio.gather(*[sender(i, n) for i, n in enumerate(per)])
            await peer.recv(tag="ack")
            results[("send/recv", size)] = count * size / (time.perf_counter() - t0) / 1e6
            # one-sided: whole-tensor writes and reads of the exposed buffer (size bytes)
            for op in ("write", "read"):
                bufs = [np.full(h.nbytes, 7, np.uint8) for _ in range(depth)]

                async def one(i: int, n: int, op: str = op, bufs: list[np.ndarray] = bufs) -> None:
                    for _ in range(n):
                        if op == "write":
                            await peer.write(h, bufs[i])
                        else:
                            await peer.read(h, out=bufs[i])

                n_ops = max(depth, total // h.nbytes)
                per = [n_ops // depth + (1 if i < n_ops % depth else 0) for i in range(depth)]
                await asyncio.gather(*[one(i, 1) for i in range(depth)])  # warm-up
                t0 = time.perf_counter()
                await asyncio.gather(*[one(i, n) for i, n in enumerate(per)])
                results[(op, h.nbytes)] = n_ops * h.nbytes / (time.perf_counter() - t0) / 1e6
        await peer.send({"op": "stop"}, tag="cmd")
    return results


def run(ip: str, sizes: list[int], total: int, depth: int) -> dict[tuple[str, int], float]:
    child = subprocess.Popen(
        [sys.executable, __file__, "--serve", "--ip", ip, "--max", str(max(sizes)), "--depth", str(depth)]
    )
    try:
        return asyncio.run(measure(ip, sizes, total, depth))
    finally:
        try:
            child.wait(timeout=60)
        except subprocess.TimeoutExpired:
            child.kill()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dev", default=os.environ.get("RXE_DEV", "rxe0"))
    ap.add_argument("--ip", default=os.environ.get("RXE_IP", "10.0.2.15"))
    ap.add_argument("--sizes", default="65536,1048576,4194304", help="message sizes in bytes")
    ap.add_argument("--mib", type=int, default=48, help="MiB moved per measurement")
    ap.add_argument("--depth", type=int, default=4, help="tensorwire operations in flight")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--max", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        asyncio.run(serve(args.ip, args.max, args.depth))
        return 0
    sizes = [int(s) for s in args.sizes.split(",")]
    port = choose_port(args.ip, want=args.dev)
    if isinstance(port, str):
        print(f"no RDMA port: {port}")
        return 1
    total = args.mib << 20
    print(f"device {port.describe()}; {args.mib} MiB per measurement; tensorwire depth {args.depth}", flush=True)
    base: dict[tuple[str, int], float] = {}
    for size in sizes:
        iters = max(16, total // size)
        for tool in ("ib_write_bw", "ib_read_bw"):
            base[(tool, size)] = perftest(tool, port.device, port.gid_index, args.ip, size, iters)
            print(f"  {tool} {size}: {base[(tool, size)]:.1f} MB/s", flush=True)
    # one pass per size: the serving process exposes a buffer of that size
    tw: dict[tuple[str, int], float] = {}
    for size in sizes:
        tw.update(run(args.ip, [size], total, args.depth))
        done = ", ".join(f"{k[0]} {v:.1f}" for k, v in tw.items() if k[1] == size)
        print(f"  tensorwire {size}: {done}", flush=True)
    print()
    print("| size | tensorwire op | MB/s | perftest | MB/s | ratio |")
    print("|---:|---|---:|---|---:|---:|")
    pairs = (("send/recv", "ib_read_bw"), ("read", "ib_read_bw"), ("write", "ib_write_bw"))
    for size in sizes:
        for op, tool in pairs:
            v, b = tw[(op, size)], base[(tool, size)]
            print(f"| {_human(size)} | {op} | {v:.1f} | {tool} | {b:.1f} | {v / b:.2f}x |")
    return 0


def _human(n: int) -> str:
    for unit, k in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k and n % k == 0:
            return f"{n // k} {unit}"
    return f"{n} B"


if __name__ == "__main__":
    sys.exit(main())
