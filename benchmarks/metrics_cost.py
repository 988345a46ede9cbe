"""What counting every transfer (tensorwire.metrics) costs a small message's round trip.

    python benchmarks/metrics_cost.py [--transports inproc tcp ucx] [--trips 3000] [--rounds 5]

Two nodes in this process, one peer pair per transport: 16 float32 out on one tag and back on
another, --trips round trips per run. Each round runs once with counting as shipped and once
with ``_metrics.moved`` swapped for a function that does nothing (the baseline), in alternating
order, so both see the same machine; the table gives the median microseconds of each and their
ratio. A round trip counts four transfers (two sends, two recvs). Also the cost of one counted
transfer on its own. Nothing is asserted; the script exits 0 unless something failed.
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
from tensorwire import _metrics
from tensorwire.transports import Receipt


def _nothing(*_: Any) -> None:
    return None


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


async def _measure(transport: str, trips: int, rounds: int) -> tuple[float, float] | None:
    options: dict[str, Any] = {} if transport == "inproc" else {"transports": (transport,)}
    try:
        async with tensorwire.start("127.0.0.1:0", **options) as na, tensorwire.start("127.0.0.1:0", **options) as nb:
            a = await na.connect(nb.address)
            b = await nb.accept()
            if a.path.transport != transport:
                print(f"{transport}: not available here ({a.path})", file=sys.stderr)
                return None
            await _trips(a, b, 200)  # warm up
            counted, bare = [], []
            shipped = _metrics.moved
            for i in range(rounds):
                for off in (i % 2 == 1, i % 2 == 0):
                    _metrics.moved = _nothing if off else shipped  # type: ignore[assignment]
                    try:
                        (bare if off else counted).append(await _trips(a, b, trips))
                    finally:
                        _metrics.moved = shipped  # type: ignore[assignment]
            return statistics.median(counted), statistics.median(bare)
    except tensorwire.TensorWireError as exc:
        print(f"{transport}: {exc}", file=sys.stderr)
        return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transports", nargs="+", default=["inproc", "tcp", "ucx"])
    parser.add_argument("--trips", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    receipt = Receipt("tcp", ("tcp x1",), 64, 2e-5, "eager", True, False, False, "host")
    n = 100_000
    one = min(timeit.repeat(lambda: _metrics.transferred("send", receipt), number=n, repeat=5)) / n * 1e6
    print(f"one counted transfer: {one:.2f} us (best of 5 x {n})")
    print(f"{'transport':>10} {'counted us':>11} {'baseline us':>12} {'ratio':>7}")
    for transport in args.transports:
        got = asyncio.run(_measure(transport, args.trips, args.rounds))
        if got is not None:
            counted, bare = got
            print(f"{transport:>10} {counted:11.1f} {bare:12.1f} {counted / bare:6.3f}x")
    print("ratio: a round trip counted over the same without counting, same process, same run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
