"""Latency of a small message behind a bulk send on the same channel (head-of-line blocking).

    python benchmarks/tcp_hol.py [--big-mib 256] [--pings 200] [--rounds 3] [--chunk-kib N] [--against DIR]
                                 [--transport tcp|ucx] [--tls default|tcp|...]

Two processes on loopback over tcp (or ucx, with ``--tls`` for UCX_TLS: ``default`` is UCX's
own choice of lanes). The child serves an ``echo`` method, answers 8-byte pings
on one tag and takes bulk tensors on another (``recv(out=)``). The parent measures:

  bulk          --big-mib sends alone, back to back: GB/s of delivered bytes, and the CPU
                time per GB of the sending process and of both (steadier than GB/s under load; on
                loopback the kernel's work moves between the two with the send queue's length)
  ping idle     8 bytes out on one tag and back on another, nothing else on the channel
  ping bulk     the same while bulk sends run on the channel without pause
  ping bulk rndv
                the share of those pings whose send went rendezvous (their receipts): a ping
                that finds the credit spent by the bulk waits for its CTS
  call bulk     ``peer.call("echo", x)`` with an 8-byte tensor while bulk sends run

Latencies are medians (and maxima) of --pings round trips. With ``--against DIR`` (a checkout
of another tensorwire, the old code say) each round measures that tree and this one, in turns,
each in a fresh pair of processes, and the table gives the median and range over --rounds
rounds, with this tree's median over the other's. Speed is never asserted; exit 0 unless
something crashed or came back wrong.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
from _against import in_turns, print_table, trees
from _two_process import stop_child

MiB = 1 << 20
HERE = Path(__file__).resolve()


def _options(args: argparse.Namespace) -> dict[str, Any]:
    import tensorwire

    opts: dict[str, Any] = {"transports": (args.transport,)}
    if args.chunk_kib:
        opts["limits"] = tensorwire.Limits(chunk_bytes=args.chunk_kib << 10)
    return opts


def _config(args: argparse.Namespace) -> contextlib.AbstractContextManager[Any]:
    """UCX_TLS for a ucx run (``default``: UCX's own choice); nothing for tcp."""
    if args.transport != "ucx" or args.tls == "default":
        return contextlib.nullcontext()
    from tensorwire.transports.ucx import ucx_config

    return ucx_config(TLS=args.tls)


def _cpu(pid: int) -> float:
    """CPU seconds (user and system) process ``pid`` has used; 0 where /proc cannot say."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _child(args: argparse.Namespace) -> None:
    with _config(args):
        await _serve(args)


async def _serve(args: argparse.Namespace) -> None:
    import tensorwire

    async with tensorwire.start("127.0.0.1:0", **_options(args)) as node:

        @node.method("echo")
        async def echo(x: np.ndarray) -> np.ndarray:
            return x

        print(json.dumps({"node": node.address}), flush=True)
        peer = await node.accept()
        out = np.empty(args.big_mib * MiB, dtype=np.uint8)

        async def pings() -> None:
            while True:
                await peer.send(await peer.recv(tag="ping"), tag="pong")

        async def bulk() -> None:
            while True:
                await peer.recv(tag="bulk", out=out)
                await peer.send(True, tag="bulk-ack")

        try:
            await asyncio.gather(pings(), bulk())
        except tensorwire.TensorWireError:
            pass


async def _measure(args: argparse.Namespace) -> dict[str, float]:
    cmd = [sys.executable, str(HERE), "--child", "--big-mib", str(args.big_mib), "--chunk-kib", str(args.chunk_kib)]
    cmd += ["--transport", args.transport, "--tls", args.tls]
    child = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE)
    assert child.stdout is not None
    addr = json.loads(await child.stdout.readline())["node"]
    try:
        with _config(args):
            return await _run(args, child.pid, addr)
    finally:
        await stop_child(child)


async def _run(args: argparse.Namespace, child_pid: int, addr: str) -> dict[str, float]:
    import tensorwire

    big = np.full(args.big_mib * MiB, 7, dtype=np.uint8)
    small = np.arange(1, dtype=np.float64)
    pong = np.empty_like(small)
    res: dict[str, float] = {}
    protocols: list[str] = []  # the pings' receipts behind bulk
    async with tensorwire.start("127.0.0.1:0", **_options(args)) as node:
        peer = await node.connect(addr)

        async def send_big() -> None:
            await peer.send(big, tag="bulk")
            await peer.recv(tag="bulk-ack")

        async def ping() -> None:
            protocols.append((await peer.send(small, tag="ping")).protocol)
            await peer.recv(tag="pong", out=pong)
            if pong[0] != small[0]:
                raise RuntimeError("ping came back wrong")

        async def call() -> None:
            y = await peer.call("echo", small)
            if y.shape != small.shape:
                raise RuntimeError("echo came back wrong")

        async def times(fn: Callable[[], Awaitable[None]], n: int) -> list[float]:
            ts = []
            for _ in range(n):
                t0 = time.perf_counter()
                await fn()
                ts.append(time.perf_counter() - t0)
                await asyncio.sleep(0.001)  # spread over the bulk sends, not one burst
            return ts

        await send_big()  # warm-up: both sides' memory touched
        for _ in range(20):
            await ping()
            await call()
        t0, c0, k0 = time.perf_counter(), time.process_time(), _cpu(child_pid)
        for _ in range(args.bulk_sends):
            await send_big()
        gb = args.bulk_sends * big.nbytes / 1e9
        res["bulk GB/s"] = gb / (time.perf_counter() - t0)
        sender = time.process_time() - c0
        res["sender cpu ms/GB"] = sender / gb * 1e3
        res["both cpu ms/GB"] = (sender + _cpu(child_pid) - k0) / gb * 1e3
        idle = await times(ping, args.pings)
        res["ping idle us"] = statistics.median(idle) * 1e6

        stop = asyncio.Event()

        async def flood() -> None:
            while not stop.is_set():
                await send_big()

        task = asyncio.create_task(flood())
        await asyncio.sleep(0.05)
        try:
            protocols.clear()
            busy = await times(ping, args.pings)
            rndv = protocols.count("rendezvous") / len(protocols)
            calls = await times(call, args.pings)
        finally:
            stop.set()
            await task
        res["ping bulk us"] = statistics.median(busy) * 1e6
        res["ping bulk max us"] = max(busy) * 1e6
        res["ping bulk rndv"] = rndv
        res["call bulk us"] = statistics.median(calls) * 1e6
        res["call bulk max us"] = max(calls) * 1e6
    return res


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--big-mib", type=int, default=256, help="bulk message size, MiB")
    parser.add_argument("--bulk-sends", type=int, default=8, help="bulk sends timed alone")
    parser.add_argument("--pings", type=int, default=200, help="round trips per latency row")
    parser.add_argument("--transport", default="tcp", choices=["tcp", "ucx"], help="the channel's transport")
    parser.add_argument("--tls", default="default", help="UCX_TLS for ucx ('default': UCX's choice)")
    parser.add_argument("--chunk-kib", type=int, default=0, help="Limits.chunk_bytes, KiB (0: the default)")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each tree, in turns")
    parser.add_argument("--against", type=Path, help="another checkout of tensorwire to compare with")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        asyncio.run(_child(args))
        return 0
    if args.one:
        print(json.dumps(asyncio.run(_measure(args))), flush=True)
        return 0
    argv = ["--big-mib", str(args.big_mib), "--pings", str(args.pings)]
    argv += ["--bulk-sends", str(args.bulk_sends), "--chunk-kib", str(args.chunk_kib)]
    argv += ["--transport", args.transport, "--tls", args.tls]
    runs = in_turns(HERE, trees(args.against), argv, args.rounds)
    lanes = f" (UCX_TLS={args.tls})" if args.transport == "ucx" else ""
    print(f"{args.transport}{lanes} loopback, {args.big_mib} MiB bulk sends, ", end="")
    print(f"{args.pings} round trips a row, {args.rounds} rounds")
    print_table(runs, width=18)
    return 0


if __name__ == "__main__":
    sys.exit(main())
