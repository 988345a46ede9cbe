"""How long a large strided copy holds up the sender's event loop: copy threads against copies on the loop.

    python benchmarks/loop_stall.py [--sizes 16M,64M,256M] [--transport tcp] [--repeat 3]

A child process receives messages and exposes a float64 tensor. This process sends it a
transposed float64 array (``peer.send``: packed into C order first) and reads the exposed
tensor into a transposed ``out=`` (``peer.read``: copied out of a buffer of ours afterwards),
while a heartbeat task on the same loop wakes every millisecond and notes the longest gap
between two of its turns. That gap is what every other channel, lease renewal and call of
the process waits through.

Baseline, in the same run and the same process: the same transfers with tensorwire's copies
made on the event loop (``_offload.OFF_LOOP_BYTES`` set past every size), as before copy
threads. Rows: the longest heartbeat gap and the time per transfer, each the best of --repeat,
and their ratios to the baseline. Speed is never asserted; the script exits 1 only when bytes
came back wrong or something crashed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
from _sizes import fmt_size, parse_size

import tensorwire
from tensorwire.tensors import _offload


def _strided(nbytes: int, k: int = 0) -> np.ndarray:
    n = nbytes // 8
    return (np.arange(n, dtype=np.float64) + k).reshape(256, n // 256).T


async def _child(args: argparse.Namespace) -> None:
    biggest = max(args.sizes)
    owned = _strided(biggest).copy()  # C order, the transposed shape
    async with tensorwire.start("127.0.0.1:0", transports=(args.transport,)) as node:
        node.expose(owned, name="t")
        print(json.dumps({"address": node.address}), flush=True)
        peer = await node.accept()
        try:
            while True:
                got = await peer.recv(tag="x")
                await peer.send(np.array([float(got.reshape(-1)[-1]), got.shape[0]]), tag="ack")
        except tensorwire.TensorWireError:
            pass


class _Heartbeat:
    """A task that wakes every millisecond and keeps the longest gap between two turns."""

    def __init__(self) -> None:
        self.worst = 0.0
        self._task: asyncio.Task[None] | None = None

    async def _beat(self) -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            self.worst = max(self.worst, now - last)
            last = now

    async def measure(self, fn: Callable[[], Awaitable[Any]]) -> tuple[float, float, Any]:
        """(longest gap, seconds, what fn returned)."""
        self.worst = 0.0
        self._task = asyncio.ensure_future(self._beat())
        await asyncio.sleep(0.005)
        self.worst = 0.0
        t0 = time.perf_counter()
        try:
            got = await fn()
        finally:
            took = time.perf_counter() - t0
            await asyncio.sleep(0.002)  # the gap that ends after fn shows now
            self._task.cancel()
        return self.worst, took, got


async def _parent(args: argparse.Namespace) -> int:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--child", "--transport", args.transport,
        "--sizes", ",".join(str(s) for s in args.sizes), stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None
    where = json.loads(await proc.stdout.readline())
    wrong: list[str] = []
    rows: list[dict[str, Any]] = []
    default = _offload.OFF_LOOP_BYTES
    beat = _Heartbeat()
    try:
        async with tensorwire.start("127.0.0.1:0", transports=(args.transport,)) as node:
            peer = await node.connect(where["address"])
            handle = await peer.lookup("t")
            print(f"# {peer.path}")
            for size in args.sizes:
                x = _strided(size, 1)
                h = handle[: x.shape[0]] if x.shape[0] < handle.shape[0] else handle
                out = np.empty((x.shape[1], x.shape[0])).T
                want = _strided(max(args.sizes))[: x.shape[0], :8]  # the child's tensor's first rows

                async def send(x: np.ndarray = x) -> Any:
                    await peer.send(x, tag="x")
                    return await peer.recv(tag="ack")

                async def read(h: Any = h, out: np.ndarray = out) -> Any:
                    return await peer.read(h, out=out)

                for op, fn in (("send", send), ("read", read)):
                    cells: dict[str, tuple[float, float]] = {}
                    for mode, limit in (("on the loop", 1 << 62), ("copy thread", default)):
                        _offload.OFF_LOOP_BYTES = limit
                        gaps, times = [], []
                        for _ in range(args.repeat):
                            gap, took, got = await beat.measure(fn)
                            gaps.append(gap)
                            times.append(took)
                            if op == "send" and (got[0] != x[-1, -1] or got[1] != x.shape[0]):
                                wrong.append(f"send {size}: the child got {got}")
                            if op == "read" and not np.array_equal(out[:, :8], want):
                                wrong.append(f"read {size}: wrong bytes")
                        cells[mode] = (min(gaps), min(times))
                    base_gap, base_t = cells["on the loop"]
                    gap, t = cells["copy thread"]
                    rows.append(
                        {"op": op, "size": size, "gap_ms": gap * 1e3, "gap_ms_on_loop": base_gap * 1e3,
                         "seconds": t, "seconds_on_loop": base_t}
                    )  # fmt: skip
                    print(
                        f"{op:5} {fmt_size(size):>6}  longest loop gap {gap * 1e3:8.1f} ms "
                        f"(on the loop {base_gap * 1e3:8.1f} ms, x{gap / base_gap:5.2f})  "
                        f"per transfer {t * 1e3:8.1f} ms (on the loop {base_t * 1e3:8.1f} ms, x{t / base_t:5.2f})",
                        flush=True,
                    )
            _offload.OFF_LOOP_BYTES = default
            await peer.aclose()
    finally:
        _offload.OFF_LOOP_BYTES = default
        try:
            await asyncio.wait_for(proc.wait(), 30)
        except TimeoutError:
            proc.kill()
            await proc.wait()
    args.rows = rows
    for w in wrong:
        print(f"WRONG: {w}", file=sys.stderr)
    return 1 if wrong else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="16M,64M,256M", type=lambda s: [parse_size(p) for p in s.split(",")])
    parser.add_argument("--transport", default="tcp")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        asyncio.run(_child(args))
        return 0
    rc = asyncio.run(_parent(args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(args.rows, f)
    return rc


if __name__ == "__main__":
    sys.exit(main())
