"""What the two-process staging benchmarks (staged_p2p, gpu_p2p) share: their command line, the
receiving child started from the same script, the timed batches of transfers between the two,
and how a receipt is printed."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from _sizes import MiB, fmt_size, parse_size


def make_parser(doc: str | None, sizes: str) -> argparse.ArgumentParser:
    """--sizes, --chunk, --depth, --json, --timeline (``_timeline.py``), and the hidden --child
    (and --timeline-dir) that the receiving child gets."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default=sizes, help="comma-separated sizes, e.g. 1M,16M,1G")
    parser.add_argument("--chunk", type=parse_size, default=4 * MiB, help="staging chunk size")
    parser.add_argument("--depth", type=int, default=8, help="staging chunks per direction")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--timeline",
        action="store_true",
        help="mark both processes and print where each transfer's time went, span by span (slower)",
    )
    parser.add_argument("--timeline-dir", help=argparse.SUPPRESS)  # (the child's: where its marks go)
    return parser


def run(
    args: argparse.Namespace,
    child: Callable[[argparse.Namespace], Awaitable[None]],
    parent: Callable[[argparse.Namespace], Awaitable[int]],
) -> int:
    """The child's side or the parent's; the parent's rows (``args.result``) to ``--json``."""
    if args.child:
        asyncio.run(child(args))
        return 0
    rc = asyncio.run(parent(args))
    if args.json:
        Path(args.json).write_text(json.dumps(args.result))
    return rc


async def start_child(
    script: str, args: argparse.Namespace, *extra: str, env: dict[str, str] | None = None
) -> tuple[asyncio.subprocess.Process, Any]:
    """This script again as the receiving child, with the same staging (and ``env``, else ours);
    the child and the first line it prints (JSON: where it listens)."""
    cmd = [sys.executable, script, "--child", "--chunk", str(args.chunk), "--depth", str(args.depth), *extra]
    proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE, env=env)
    assert proc.stdout is not None
    first = await proc.stdout.readline()
    if not first:
        raise RuntimeError(f"the receiving child exited before it listened (exit status {await proc.wait()})")
    return proc, json.loads(first)


async def stop_child(proc: asyncio.subprocess.Process) -> str:
    """Wait for the child to end after its last message; kill it if it does not within 30 s.
    Returns what it printed after its first line (UCX's reports, when asked for)."""
    rest = b""
    try:
        if proc.stdout is not None:
            rest = await asyncio.wait_for(proc.stdout.read(), 30)
        await asyncio.wait_for(proc.wait(), 30)
    except TimeoutError:
        proc.kill()
        await proc.wait()
    return rest.decode(errors="replace")


async def send_batches(
    peer: Any, kind: str, x: Any, nbytes: int, schedule: list[int], want: int
) -> tuple[list[float], Any, dict[str, int]]:
    """The parent's side: tell the child to expect ``kind`` tensors of ``nbytes`` in batches of
    ``schedule[i]`` back-to-back transfers (the first batch a warm-up), send ``x`` so, and wait
    for the child's one answer per batch. Returns the time per transfer of each timed batch,
    the last send's receipt (which path the bytes took) and how the child's timed receives
    landed (``receive_batches``). After the last batch, untimed, the child says the byte sum it
    holds, which must be ``want``: summing a large tensor takes longer than
    sending it, so it stays out of every batch's time."""
    await peer.send((kind, nbytes, schedule), tag="cmd")
    if await peer.recv(tag="ack") != "ready":
        raise RuntimeError("the receiver did not get ready")
    times = []
    receipt = None
    for b, count in enumerate(schedule):
        t0 = time.perf_counter()
        for _ in range(count):
            receipt = await peer.send(x, tag="data")
        await peer.recv(tag="ack")
        dt = time.perf_counter() - t0
        if b:
            times.append(dt / count)
    total, landed = await peer.recv(tag="sum")
    if total != want:
        raise RuntimeError(f"{kind} {fmt_size(nbytes)}: receiver holds byte sum {total}, sent {want}")
    return times, receipt, landed


async def receive_batches(
    peer: Any,
    out: Any,
    schedule: list[int],
    total: Callable[[], Awaitable[int]],
    landed: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """The child's side of :func:`send_batches`: say ready, then receive each batch into ``out``
    (``await landed()`` after each transfer, if given) and answer it once; after the last, say
    ``await total()`` (the byte sum it holds) and how the timed transfers landed, by their
    receipts: ``direct`` into ``out``, ``staged`` through a buffer of tensorwire's (the message
    came before its recv, or device memory through host staging), ``copied`` on its way."""
    await peer.send("ready", tag="ack")
    how = {"direct": 0, "staged": 0, "copied": 0}
    for b, window in enumerate(schedule):
        for _ in range(window):
            _, receipt = await peer.recv_with_receipt(tag="data", out=out)
            if b:  # (the first batch is the warm-up)
                how["direct" if receipt.direct else "staged" if receipt.staged else "copied"] += 1
            if landed is not None:
                await landed()
        await peer.send(True, tag="ack")
    await peer.send((await total(), how), tag="sum")


async def host_byte_sum(arr: Any) -> int:
    """The sum of a host array's bytes (the check that every byte arrived), off the event loop:
    seconds at GiB sizes would stall the loop and look like a dead node to the peer's lease."""
    return await asyncio.to_thread(lambda: int(arr.sum(dtype="int64")))


def receipt_text(receipt: Any, landed: dict[str, int] | None = None) -> str:
    """The sender's last receipt, and how the receiver's timed transfers landed."""
    return (
        f"{receipt.transport} memory={receipt.memory} staged={receipt.staged} "
        f"direct={receipt.direct} lanes={', '.join(receipt.lanes) or '-'}"
        + (f"; the receiver's: {', '.join(f'{k} {v}' for k, v in landed.items() if v)}" if landed else "")
    )
