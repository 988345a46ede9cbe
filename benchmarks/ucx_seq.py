"""The fixed cost of a ucx transfer: tensorwire against raw ucxx, one transfer after another.

    python benchmarks/ucx_seq.py [--sizes 64K,1M,16M] [--memory host|cuda] [--repeat 3] [--credit 2G] [--json out.json]
    python benchmarks/ucx_seq.py --against OLD_CHECKOUT [--rounds 5] [--sizes ...]

Issue #8's goal for CUDA tensors over cuda_ipc (0.7x of the device's own copy at 1 GiB) was
missed on the first H200 run (0.31-0.46x) where raw ucxx reached 0.90x: each tensorwire
transfer cost about 0.5 ms more than a raw one, whatever its size (docs/gpu.md, "Measured").
This measures that cost on any machine with ucxx, host memory by default: the pattern of
``gpu_p2p.py``'s ucx rows (batches of back-to-back ``peer.send``, each received with
``recv(out=)`` into one array, one answer per batch; ``_two_process.py``) between two
processes, against ``gpu_ucx_raw.py``'s "raw seq" row (the same batches over raw ucxx, each
worker progressed by a busy loop), which runs first in each turn of the same run. ``--memory
cuda`` sends CuPy arrays on a GPU (the receiver waits for its current stream after each, as in
gpu_p2p). ``--credit`` sets the receiver's ``recv_buffer_bytes`` (64 MiB by default): a message
over 7/8 of it goes rendezvous (MSG, then the receiver's CTS, then the payload), one within it
eager (MSG and payload back to back), so the same sizes with and without a credit above them say
what tensorwire's CTS round trip costs.

Per size: microseconds per transfer, raw and tensorwire; their difference (what tensorwire
adds to every transfer); and tensorwire's bandwidth over raw's. Raw and tensorwire take turns
(``--repeat``) and each cell keeps its best: the 2-core machines this runs on move a cell by
2x between minutes. ``--against DIR`` compares this checkout with another (the old code, say):
each runs a turn of raw and one of tensorwire in a process of its own, the checkouts in turns
(``--rounds``), and the table gives each one's median and range of the added microseconds and of
tensorwire's time over raw's in that same turn (which takes the machine's swings out), and
this/other. Speed is never asserted: exit 0 unless a transfer broke.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

# this checkout's tensorwire, or the one ``--against`` runs (``_against.run_tree`` names it)
sys.path.insert(0, os.environ.get("TENSORWIRE_TREE") or str(Path(__file__).resolve().parent.parent))

import _timeline
import numpy as np
from _against import in_turns, print_table, trees
from _sizes import fmt_size, parse_size
from _two_process import host_byte_sum, make_parser, receive_batches, run, send_batches, start_child, stop_child
from gpu_ucx_raw import plan

import tensorwire

HERE = Path(__file__).resolve().parent


def _xp(memory: str) -> Any:
    if memory == "cuda":
        import cupy

        return cupy
    return np


async def _stream_done() -> None:
    """Until the work queued so far on CuPy's current stream is done, off the loop (the
    library's own wait), as gpu_p2p's receiver does after each CUDA transfer."""
    import cupy

    from tensorwire.memory import wait_event
    from tensorwire.memory._cuda import CudaEngine

    engine = CudaEngine.get(cupy.cuda.Device().id)
    await wait_event(engine, engine.record_on(int(cupy.cuda.get_current_stream().ptr)))


async def _sum(xp: Any, out: Any) -> int:
    if xp is np:
        return await host_byte_sum(out)
    return int(out.sum(dtype=xp.int64))


# -- the receiving child ----------------------------------------------------------------------------
async def child(args: argparse.Namespace) -> None:
    xp = _xp(args.memory)
    _timeline.child_begins(args)
    limits = tensorwire.Limits(recv_buffer_bytes=args.credit) if args.credit is not None else tensorwire.Limits()
    async with tensorwire.start("127.0.0.1:0", transports=("ucx",), limits=limits) as node:
        print(json.dumps([node.address]), flush=True)
        peer = await node.accept()
        while True:
            cmd = await peer.recv(tag="cmd")
            if cmd == "next":
                break
            _, nbytes, schedule = cmd
            out = xp.empty(nbytes, xp.uint8)
            landed = _stream_done if xp is not np else None
            await receive_batches(peer, out, schedule, functools.partial(_sum, xp, out), landed)
            del out
    _timeline.child_ends(args)


# -- the sending parent -----------------------------------------------------------------------------
def raw_turn(args: argparse.Namespace) -> dict[int, float]:
    """One run of gpu_ucx_raw.py: seconds per transfer of its "raw seq" row, per size."""
    with tempfile.TemporaryDirectory() as tmp:
        rows = Path(tmp) / "raw.json"
        cmd = [sys.executable, str(HERE / "gpu_ucx_raw.py"), "--memory", args.memory, "--sizes", args.sizes]
        done = subprocess.run([*cmd, "--json", str(rows)], capture_output=True, text=True, timeout=600)
        if done.returncode != 0 or not rows.exists():
            said = done.stderr[-2000:] or done.stdout[-2000:]
            raise RuntimeError(f"gpu_ucx_raw.py failed ({done.returncode}): {said}")
        return {int(n): int(n) / (row["raw seq"] * 1e9) for n, row in json.loads(rows.read_text()).items()}


async def tensorwire_turn(args: argparse.Namespace, sizes: list[int], *child_args: str) -> tuple[dict[int, float], str]:
    """One turn of tensorwire's: seconds per transfer (median over the batches), per size, and
    the last receipt (which path the bytes took)."""
    xp = _xp(args.memory)
    credit = ["--credit", str(args.credit)] if args.credit is not None else []
    proc, (address,) = await start_child(__file__, args, "--memory", args.memory, *credit, *child_args)
    seconds: dict[int, float] = {}
    how = ""
    try:
        async with tensorwire.start("127.0.0.1:0", transports=("ucx",)) as node:
            peer = await node.connect(address)
            for n in sizes:
                window, batches = plan(n)
                x = xp.asarray(np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8))
                want = await _sum(xp, x)
                times, receipt, landed = await send_batches(peer, args.memory, x, n, [1] + [window] * batches, want)
                seconds[n] = statistics.median(times)
                how = (
                    f"{receipt.transport} {receipt.protocol} direct={receipt.direct} "
                    f"lanes={', '.join(receipt.lanes)}; the receiver's: {landed}"
                )
            await peer.send("next", tag="cmd")
            await peer.aclose()
    finally:
        await stop_child(proc)
    return seconds, how


async def one_turn(args: argparse.Namespace) -> dict[str, float]:
    """One turn of raw and of tensorwire, as a row for ``--against``: per size, the microseconds
    tensorwire added and its time over raw's (that same turn's: the machine's swings fall on both)."""
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    raw = await asyncio.to_thread(raw_turn, args)
    tw, _ = await tensorwire_turn(args, sizes)
    row: dict[str, float] = {}
    for n in sizes:
        row[f"{fmt_size(n)} added us"] = (tw[n] - raw[n]) * 1e6
        row[f"{fmt_size(n)} time over raw"] = tw[n] / raw[n]
    return row


async def parent(args: argparse.Namespace) -> int:
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    raw: dict[int, float] = {}
    tw: dict[int, float] = {}
    how = ""
    for turn in range(args.repeat):
        for n, t in (await asyncio.to_thread(raw_turn, args)).items():
            raw[n] = min(raw.get(n, t), t)
        got, how = await tensorwire_turn(args, sizes)
        for n, t in got.items():
            tw[n] = min(tw.get(n, t), t)
        print(
            f"turn {turn + 1}: "
            + ", ".join(f"{fmt_size(n)} raw {raw[n] * 1e6:.0f} us, tensorwire {got[n] * 1e6:.0f} us" for n in sizes),
            flush=True,
        )
    print(f"\ntensorwire's last receipt: {how}\n")
    head = "| size     | raw ucxx us | tensorwire us | added us | bandwidth of raw |"
    print(head)
    print("|" + "|".join("-" * len(c) for c in head.split("|")[1:-1]) + "|")
    for n in sizes:
        print(
            f"| {fmt_size(n):8} | {raw[n] * 1e6:11.1f} | {tw[n] * 1e6:13.1f} | {(tw[n] - raw[n]) * 1e6:8.1f} "
            f"| {raw[n] / tw[n]:15.2f}x |"
        )
    print(
        f"\nus: microseconds per transfer ({args.memory} memory), median over batches of back-to-back "
        f"transfers each answered once, best of {args.repeat} turns; added: tensorwire's cost per "
        "transfer over raw ucxx's; bandwidth of raw: tensorwire's bandwidth over raw's."
    )
    if args.json:
        args.result = {str(n): {"raw_s": raw[n], "tensorwire_s": tw[n]} for n in sizes}
    if args.timeline:
        await timeline_turn(args, sizes)
    return 0


async def timeline_turn(args: argparse.Namespace, sizes: list[int]) -> None:
    """One turn more of tensorwire's with both processes marked (``_timeline.py``), last: the
    marks stay installed in this process. A table per size."""
    marked = _timeline.Marked(True)
    got, _ = await tensorwire_turn(args, sizes, *marked.child_args)
    cells = []
    for n in sizes:
        window, batches = plan(n)
        cells.append((f"{fmt_size(n)} ({got[n] * 1e6:.0f} us a transfer in this turn)", 1 + window * batches))
    marked.report(f"timeline turn, {args.memory} memory", cells)


def main() -> int:
    parser = make_parser(__doc__, "64K,1M,16M")
    parser.add_argument("--memory", choices=("host", "cuda"), default="host")
    parser.add_argument("--repeat", type=int, default=3, help="turns of raw and tensorwire; each cell keeps its best")
    parser.add_argument("--against", type=Path, help="another checkout of tensorwire to compare with, in turns")
    parser.add_argument("--rounds", type=int, default=5, help="with --against: runs of each checkout, in turns")
    parser.add_argument(
        "--credit",
        type=parse_size,
        help="the receiver's recv_buffer_bytes (default: Limits'); a message over 7/8 of it goes rendezvous",
    )
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    try:
        import ucxx  # noqa: F401
    except ImportError as exc:
        print(f"ucx_seq: needs ucxx ({exc})", file=sys.stderr)
        return 2
    if args.memory == "cuda" and not args.child:
        from tensorwire.memory._cuda import cuda_device_count

        if cuda_device_count() == 0:
            print("ucx_seq: --memory cuda needs a CUDA GPU and CuPy", file=sys.stderr)
            return 2
    if args.one:
        print(json.dumps(asyncio.run(one_turn(args))), flush=True)
        return 0
    if args.against is not None and not args.child:
        argv = ["--sizes", args.sizes, "--memory", args.memory]
        if args.credit is not None:
            argv += ["--credit", str(args.credit)]
        runs = in_turns(Path(__file__).resolve(), trees(args.against), argv, args.rounds)
        print(f"\n{args.memory} memory, {args.rounds} rounds of each checkout in turns (raw, then tensorwire)")
        print_table(runs, width=26)
        return 0
    with contextlib.suppress(KeyboardInterrupt):
        return run(args, child, parent)
    return 130


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
