"""What the two-process staging benchmarks (staged_p2p, gpu_p2p) share: their command line, the
receiving child started from the same script, and how a receipt is printed."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from _sizes import MiB, parse_size


def make_parser(doc: str | None, sizes: str) -> argparse.ArgumentParser:
    """--sizes, --chunk, --depth, --json, and the hidden --child that the receiving child gets."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default=sizes, help="comma-separated sizes, e.g. 1M,16M,1G")
    parser.add_argument("--chunk", type=parse_size, default=4 * MiB, help="staging chunk size")
    parser.add_argument("--depth", type=int, default=8, help="staging chunks per direction")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
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


async def start_child(script: str, args: argparse.Namespace, *extra: str) -> tuple[asyncio.subprocess.Process, Any]:
    """This script again as the receiving child, with the same staging; the child and the first
    line it prints (JSON: where it listens)."""
    cmd = [sys.executable, script, "--child", "--chunk", str(args.chunk), "--depth", str(args.depth), *extra]
    proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE)
    assert proc.stdout is not None
    first = await proc.stdout.readline()
    if not first:
        raise RuntimeError(f"the receiving child exited before it listened (exit status {await proc.wait()})")
    return proc, json.loads(first)


async def stop_child(proc: asyncio.subprocess.Process) -> None:
    """Wait for the child to end after its last message; kill it if it does not within 30 s."""
    try:
        await asyncio.wait_for(proc.wait(), 30)
    except TimeoutError:
        proc.kill()


def receipt_text(receipt: Any) -> str:
    return (
        f"{receipt.transport} memory={receipt.memory} staged={receipt.staged} "
        f"direct={receipt.direct} lanes={', '.join(receipt.lanes) or '-'}"
    )
