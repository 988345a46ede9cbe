"""Latency of a small one-sided read behind a bulk one-sided read or write to the same ucx peer.

    python benchmarks/ucx_hol.py [--tls default tcp] [--op read write] [--big-mib 256]
                                 [--small 32 4096] [--bulks 6] [--reads 100] [--rounds 3] [--against DIR]

Two processes on loopback over ucx. The child exposes a --big-mib region and a small one; the
parent looks both up and measures, for each UCX_TLS setting and bulk operation:

  bulk GB/s     bulk reads (or writes) of the whole region alone, back to back
  idle us       a small ``peer.read`` alone (median)
  behind p50/p99/max us
                the same small read while bulk operations run without pause on the same
                peer: what a KV-cache style lookup waits behind a large transfer
  behind bulks  how many small reads finished per bulk operation (0.5 means every second
                bulk operation let one through)

With ``--against DIR`` (another checkout of tensorwire, the old code say) each round measures
that tree and this one, in turns, each in fresh processes, and the table gives medians over
--rounds rounds and this tree's median over the other's. Speed is never asserted; exit 0
unless something crashed or came back wrong.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from _against import in_turns, print_table, trees
from _two_process import stop_child

MiB = 1 << 20
HERE = Path(__file__).resolve()


def _tls(tls: str) -> dict[str, str]:
    return {} if tls == "default" else {"TLS": tls}


async def _child(args: argparse.Namespace) -> None:
    import tensorwire
    from tensorwire.transports.ucx import ucx_config

    with ucx_config(**_tls(args.tls)):
        async with tensorwire.start("127.0.0.1:0", transports=("ucx",)) as node:
            big = np.full(args.big_mib * MiB, 7, np.uint8)
            small = np.arange(max(args.small), dtype=np.uint8)
            node.expose(big, name="big")
            node.expose(small, name="small")
            print(json.dumps({"node": node.address}), flush=True)
            peer = await node.accept()
            try:
                await peer.recv(tag="done")
            except tensorwire.TensorWireError:
                pass


async def _measure(args: argparse.Namespace) -> dict[str, float]:
    import tensorwire
    from tensorwire.transports.ucx import ucx_config

    cmd = [sys.executable, str(HERE), "--child", "--tls", args.tls, "--big-mib", str(args.big_mib)]
    cmd += ["--small", *map(str, args.small)]
    child = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE)
    assert child.stdout is not None
    addr = json.loads(await child.stdout.readline())["node"]
    res: dict[str, float] = {}
    try:
        with ucx_config(**_tls(args.tls)):
            async with tensorwire.start("127.0.0.1:0", transports=("ucx",)) as node:
                peer = await node.connect(addr)
                hbig, hsmall = await peer.lookup("big"), await peer.lookup("small")
                big = np.zeros(args.big_mib * MiB, np.uint8)

                async def bulk() -> None:
                    if args.op == "read":
                        await peer.read(hbig, out=big)
                    else:
                        await peer.write(hbig, big)

                await bulk()  # warm-up: both sides' memory touched
                await bulk()
                t0 = time.perf_counter()
                for _ in range(args.bulks):
                    await bulk()
                res["bulk GB/s"] = args.bulks * big.nbytes / (time.perf_counter() - t0) / 1e9
                for size in args.small:
                    out = np.zeros(size, np.uint8)
                    h = hsmall[:size]

                    async def small(h: Any = h, out: np.ndarray = out, size: int = size) -> float:
                        t0 = time.perf_counter()
                        await peer.read(h, out=out)
                        dt = time.perf_counter() - t0
                        if out[-1] != (size - 1) % 256:
                            raise RuntimeError("small read came back wrong")
                        return dt

                    idle = [await small() for _ in range(200)]
                    res[f"{size} B idle us"] = statistics.median(idle[20:]) * 1e6
                    stop, count = asyncio.Event(), [0]

                    async def flood(stop: asyncio.Event = stop, count: list[int] = count) -> None:
                        while not stop.is_set():
                            await bulk()
                            count[0] += 1

                    task = asyncio.create_task(flood())
                    await asyncio.sleep(0.05)
                    busy = []
                    b0 = count[0]
                    try:
                        for _ in range(args.reads):
                            busy.append(await small())
                            await asyncio.sleep(0.001)  # spread over the bulk operations
                    finally:
                        stop.set()
                        await task
                    busy.sort()
                    res[f"{size} B behind p50 us"] = statistics.median(busy) * 1e6
                    res[f"{size} B behind p99 us"] = busy[min(len(busy) - 1, int(len(busy) * 0.99))] * 1e6
                    res[f"{size} B behind max us"] = busy[-1] * 1e6
                    res[f"{size} B per bulk"] = len(busy) / max(1, count[0] - b0)
                await peer.send(None, tag="done")
    finally:
        await stop_child(child)
    return res


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tls", nargs="+", default=["default", "tcp"], help="UCX_TLS settings ('default': UCX's)")
    parser.add_argument("--op", nargs="+", default=["read", "write"], choices=["read", "write"], help="bulk operation")
    parser.add_argument("--big-mib", type=int, default=256, help="bulk region size, MiB")
    parser.add_argument("--small", type=int, nargs="+", default=[32, 4096], help="small read sizes, bytes")
    parser.add_argument("--bulks", type=int, default=6, help="bulk operations timed alone")
    parser.add_argument("--reads", type=int, default=100, help="small reads per row behind bulk")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each tree, in turns")
    parser.add_argument("--against", type=Path, help="another checkout of tensorwire to compare with")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child or args.one:
        args.tls, args.op = args.tls[0], args.op[0]
        if args.child:
            asyncio.run(_child(args))
        else:
            print(json.dumps(asyncio.run(_measure(args))), flush=True)
        return 0
    checkouts = trees(args.against)
    for tls in args.tls:
        for op in args.op:
            argv = ["--tls", tls, "--op", op, "--big-mib", str(args.big_mib), "--reads", str(args.reads)]
            argv += ["--bulks", str(args.bulks), "--small", *map(str, args.small)]
            runs = in_turns(HERE, checkouts, argv, args.rounds, label=f"{tls} {op} ")
            print(
                f"\nUCX_TLS={tls}, bulk {op}s of {args.big_mib} MiB, {args.reads} small reads a row, "
                f"{args.rounds} rounds"
            )
            print_table(runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
