"""What counting every transfer (tensorwire.metrics) costs a small message's round trip.

    python benchmarks/metrics_cost.py [--transports inproc tcp ucx] [--trips 500] [--rounds 20]

Two nodes in this process, one peer pair per transport: 16 float32 out on one tag and back on
another, --trips round trips per run. Each round runs once with counting on and once with it
off (``tensorwire.metrics.count_transfers(False)``, the baseline), in alternating order, so
both see the same machine. The table gives, in microseconds per round trip, the fastest run of
each (the one least disturbed by other work on the machine) and the median, and the ratio of
the fastest. A round trip counts four transfers (two sends, two recvs). Also the cost of one
counted transfer on its own. Nothing is asserted; the script exits 0 unless something failed.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import timeit
from typing import Any

import numpy as np

import tensorwire
import tensorwire.metrics
from tensorwire import _metrics
from tensorwire.transports import Receipt


async def _trips(a: tensorwire.Peer, b: tensorwire.Peer, n: int) -> float:
    x = np.zeros(16, np.float32)

    async def echo() -> None:
        for _ in range(n):
            await b.send(await b.recv(tag=1), tag=2)

    task = asyncio.ensure_future(echo())
    t0 = time.perf_counter()
    for _ in range(n):
        await a.send(x, tag=1)
        got = await a.recv(tag=2)
    seconds = time.perf_counter() - t0
    await task
    assert np.array_equal(got, x)
    return seconds / n * 1e6


async def _measure(transport: str, trips: int, rounds: int) -> tuple[list[float], list[float]] | None:
    options: dict[str, Any] = {} if transport == "inproc" else {"transports": (transport,)}
    try:
        async with tensorwire.start("127.0.0.1:0", **options) as na, tensorwire.start("127.0.0.1:0", **options) as nb:
            a = await na.connect(nb.address)
            b = await nb.accept()
            if a.path.transport != transport:
                print(f"{transport}: not available here ({a.path})", file=sys.stderr)
                return None
            await _trips(a, b, 200)  # warm up
            counted: list[float] = []
            bare: list[float] = []
            try:
                for i in range(rounds):
                    for on in (i % 2 == 0, i % 2 == 1):
                        tensorwire.metrics.count_transfers(on)
                        (counted if on else bare).append(await _trips(a, b, trips))
            finally:
                tensorwire.metrics.count_transfers(True)
            return counted, bare
    except tensorwire.TensorWireError as exc:
        print(f"{transport}: {exc}", file=sys.stderr)
        return None


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--transports", nargs="+", default=["inproc", "tcp", "ucx"])
    parser.add_argument("--trips", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    receipt = Receipt("tcp", ("tcp x1",), 64, 2e-5, "eager", True, False, False, "host")
    n = 100_000
    one = min(timeit.repeat(lambda: _metrics.transferred("send", receipt, 1), number=n, repeat=5)) / n * 1e6
    print(f"one counted transfer: {one:.2f} us (best of 5 x {n}, hot caches)")
    print(f"{'transport':>10} {'counted us':>11} {'baseline us':>12} {'ratio':>7} {'medians us':>16}")
    for transport in args.transports:
        got = asyncio.run(_measure(transport, args.trips, args.rounds))
        if got is not None:
            counted, bare = got
            fast, base = min(counted), min(bare)
            medians = f"{statistics.median(counted):.1f} / {statistics.median(bare):.1f}"
            print(f"{transport:>10} {fast:11.1f} {base:12.1f} {fast / base:6.3f}x {medians:>16}")
    print("ratio: the fastest counted round trip over the fastest uncounted one, same process, same run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
