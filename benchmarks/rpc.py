"""Tensor RPC against the transport's own round trip and against a plain grpc.aio unary call.

    python benchmarks/rpc.py [--calls 3000] [--big-mib 64] [--repeat 5] [--concurrency 32]
    python benchmarks/rpc.py --against OLD_CHECKOUT [--rounds 3] [--calls 3000]

Two processes on loopback over tcp. A child process (started here) serves four things: a
tensorwire node with an ``echo`` method, a ping-pong loop on two tags of the same peer, a
grpc.aio server whose ``Echo`` unary method returns its request bytes, and a plain asyncio
Protocol that writes back what it reads. This process measures, in the same run:

  raw asyncio 8 bytes out and back over a plain asyncio Protocol on its own socket: the floor
              that two asyncio processes on this machine set (tensorwire's rows are read
              against it, as ratios)
  send/recv   8 bytes out on one tag, back on another: the transport's own round trip
  tw call     await peer.call("echo", x) with an 8-byte tensor
  gRPC unary  the same 8 bytes as one protobuf-bytes message through grpc.aio

and the same for a --big-mib tensor echoed back whole (GB/s counts both directions), plus
``peer.call("echo", x, _out=buf)``, whose result lands in a buffer the caller keeps (as the
send/recv row's does). Latency is the median of --calls round trips; calls/s is also measured
with --concurrency calls in flight.
With ``--against DIR`` (another checkout of tensorwire, the old code say) only the 8-byte rows
are measured, each round in a fresh pair of processes for that tree and then this one, and the
table gives each row's median and range over --rounds, with this tree's median over the other's.
Every echo is checked. Speed is never asserted: the table ends with PASS/MISS against the
issue's goals, and the script exits 0 unless something crashed or came back wrong.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import grpc
import numpy as np
from _against import in_turns, print_table, trees

import tensorwire

MiB = 1 << 20
T = TypeVar("T")
_GRPC_OPTIONS = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]


def _same(b: bytes) -> bytes:
    return b


# -- the raw asyncio baseline ------------------------------------------------------------------
class _Echo(asyncio.Protocol):
    """The child's side of the raw baseline: writes back whatever it reads."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.transport.write(data)


class _Pinger(asyncio.Protocol):
    """The parent's side: ``ping`` writes ``n`` bytes and returns once ``n`` came back."""

    def __init__(self) -> None:
        self.got = 0
        self.want = 0
        self.waiter: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.got += len(data)
        if self.got >= self.want and self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError("raw echo connection lost"))

    async def ping(self, data: bytes) -> None:
        self.got, self.want = 0, len(data)
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(data)
        await self.waiter


# -- the serving child --------------------------------------------------------------------------
async def _child() -> None:
    async def echo_bytes(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return request

    server = grpc.aio.server(options=_GRPC_OPTIONS)
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                "bench.Bytes", {"Echo": grpc.unary_unary_rpc_method_handler(echo_bytes, _same, _same)}
            )
        ]
    )
    gport = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    raw = await asyncio.get_running_loop().create_server(_Echo, "127.0.0.1", 0)
    rport = raw.sockets[0].getsockname()[1]
    async with tensorwire.start("127.0.0.1:0", transports=("tcp",)) as node:

        @node.method("echo")
        async def echo(x: np.ndarray) -> np.ndarray:
            return x

        print(json.dumps({"node": node.address, "grpc": gport, "raw": rport}), flush=True)
        peer = await node.accept()
        try:
            while True:
                await peer.send(await peer.recv(tag="ping"), tag="pong")
        except tensorwire.TensorWireError:
            pass
    raw.close()
    await server.stop(None)


# -- the measuring parent -----------------------------------------------------------------------
async def _median(fn: Callable[[], Awaitable[object]], n: int) -> float:
    for _ in range(min(50, n)):
        await fn()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        await fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


async def _rate(fn: Callable[[], Awaitable[object]], n: int, concurrency: int) -> float:
    """Calls per second with ``concurrency`` calls in flight."""
    per = max(1, n // concurrency)

    async def worker() -> None:
        for _ in range(per):
            await fn()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return per * concurrency / (time.perf_counter() - t0)


async def _best(fn: Callable[[], Awaitable[T]], repeat: int, check: Callable[[T], bool], wrong: list[str]) -> float:
    """The fastest of ``repeat`` runs after a warm-up; every result checked, outside the timing."""
    ts = []
    for i in range(repeat + 1):
        t0 = time.perf_counter()
        got = await fn()
        if i:
            ts.append(time.perf_counter() - t0)
        if not check(got):
            wrong.append(f"{getattr(fn, '__name__', fn)}")
    return min(ts)


async def parent(args: argparse.Namespace) -> int:
    child = await asyncio.create_subprocess_exec(sys.executable, __file__, "--child", stdout=asyncio.subprocess.PIPE)
    assert child.stdout is not None
    addrs = json.loads(await child.stdout.readline())
    wrong: list[str] = []
    try:
        async with (
            tensorwire.start("127.0.0.1:0", transports=("tcp",)) as node,
            grpc.aio.insecure_channel(f"127.0.0.1:{addrs['grpc']}", options=_GRPC_OPTIONS) as channel,
        ):
            peer = await node.connect(addrs["node"])
            gecho = channel.unary_unary("/bench.Bytes/Echo", request_serializer=_same, response_deserializer=_same)
            small = np.arange(1, dtype=np.float64)
            small_bytes = small.tobytes()
            pong = np.empty_like(small)
            _, pinger = await asyncio.get_running_loop().create_connection(_Pinger, "127.0.0.1", addrs["raw"])

            async def raw_small() -> None:
                await pinger.ping(small_bytes)

            async def ping() -> None:
                await peer.send(small, tag="ping")
                await peer.recv(tag="pong", out=pong)

            async def call_small() -> None:
                y = await peer.call("echo", small)
                if y.shape != small.shape:
                    wrong.append("tw call 8 B")

            async def grpc_small() -> None:
                if await gecho(small_bytes, timeout=10) != small_bytes:
                    wrong.append("gRPC 8 B")

            lat = {
                "raw asyncio": await _median(raw_small, args.calls),
                "send/recv": await _median(ping, args.calls),
                "tw call": await _median(call_small, args.calls),
                "gRPC unary": await _median(grpc_small, min(args.calls, 2000)),
            }
            if args.one:  # (a round of --against: the 8-byte rows alone)
                await peer.aclose()
                pinger.transport.close()
                row = {f"{k} us": v * 1e6 for k, v in lat.items()}
                row |= {f"{k} / raw": v / lat["raw asyncio"] for k, v in lat.items() if k != "raw asyncio"}
                print(json.dumps(row), flush=True)
                return 1 if wrong else 0
            rate = {
                "tw call": await _rate(call_small, args.calls * 2, args.concurrency),
                "gRPC unary": await _rate(grpc_small, min(args.calls, 2000) * 2, args.concurrency),
            }

            big = np.random.default_rng(0).integers(0, 255, args.big_mib * MiB, dtype=np.uint8)
            big_bytes = big.tobytes()
            nbytes = 2 * big.nbytes  # out and back

            big_out = np.empty_like(big)

            async def ping_big() -> np.ndarray:
                await peer.send(big, tag="ping")
                return await peer.recv(tag="pong", out=big_out)  # type: ignore[no-any-return]

            async def call_big() -> np.ndarray:
                return await peer.call("echo", big)  # type: ignore[no-any-return]

            async def call_big_out() -> np.ndarray:
                big_out[:1] = ~big[:1]
                return await peer.call("echo", big, _out=big_out)  # type: ignore[no-any-return]

            async def grpc_big() -> bytes:
                return await gecho(big_bytes, timeout=120)  # type: ignore[no-any-return]

            def same(y: np.ndarray) -> bool:
                return bool(np.array_equal(y, big))

            gbps = {
                "send/recv": nbytes / await _best(ping_big, args.repeat, same, wrong) / 1e9,
                "tw call": nbytes / await _best(call_big, args.repeat, same, wrong) / 1e9,
                "tw call _out=": nbytes / await _best(call_big_out, args.repeat, same, wrong) / 1e9,
                "gRPC unary": nbytes / await _best(grpc_big, args.repeat, big_bytes.__eq__, wrong) / 1e9,
            }
            await peer.aclose()
            pinger.transport.close()
    finally:
        if child.returncode is None:
            child.terminate()
        await child.wait()

    _report(args, lat, rate, gbps)
    if wrong:
        print(f"WRONG echoes: {sorted(set(wrong))}")
        return 1
    print("every echo verified")
    return 0


def _report(args: argparse.Namespace, lat: dict[str, float], rate: dict[str, float], gbps: dict[str, float]) -> None:
    def cell(table: dict[str, float], name: str, fmt: str) -> str:
        return format(table[name], fmt) if name in table else "-"

    head = ["", "8 B median RTT", "8 B calls/s", f"x{args.concurrency} calls/s", f"{args.big_mib} MiB echo"]
    widths = [13, 15, 12, 13, 15]
    print(f"tensor RPC, two processes on loopback (tcp); the {args.big_mib} MiB echo counts bytes both ways")
    print(" | ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(head, widths, strict=True))))
    print("-" * (sum(widths) + 3 * (len(widths) - 1)))
    for name in ("raw asyncio", "send/recv", "tw call", "tw call _out=", "gRPC unary"):
        us = {k: v * 1e6 for k, v in lat.items()}
        per_s = {k: 1 / v for k, v in lat.items()}
        row = [
            name.ljust(widths[0]),
            (cell(us, name, ".1f") + " us" if name in us else "-").rjust(widths[1]),
            cell(per_s, name, ".0f").rjust(widths[2]),
            cell(rate, name, ".0f").rjust(widths[3]),
            (cell(gbps, name, ".3f") + " GB/s" if name in gbps else "-").rjust(widths[4]),
        ]
        print(" | ".join(row))
    print()
    vs_transport = lat["tw call"] / lat["send/recv"]
    vs_grpc = lat["gRPC unary"] / lat["tw call"]
    big_ratio = gbps["tw call"] / gbps["gRPC unary"]
    out_ratio = gbps["tw call _out="] / gbps["gRPC unary"]
    goals = [
        (f"8 B call within 2x of the send/recv round trip: {vs_transport:.2f}x", vs_transport <= 2),
        (f"8 B call >= 10x faster than the gRPC unary call: {vs_grpc:.1f}x", vs_grpc >= 10),
        (f"{args.big_mib} MiB echo >= 5x the gRPC-bytes call: {big_ratio:.1f}x", big_ratio >= 5),
        (f"{args.big_mib} MiB echo with _out= >= 5x the gRPC-bytes call: {out_ratio:.1f}x", out_ratio >= 5),
    ]
    for text, ok in goals:
        print(f"goal {text:<64} {'PASS' if ok else 'MISS'}")
    raw = lat["raw asyncio"]
    print(
        f"8 B round trip over the raw asyncio one: send/recv {lat['send/recv'] / raw:.2f}x, "
        f"tw call {lat['tw call'] / raw:.2f}x, gRPC unary {lat['gRPC unary'] / raw:.2f}x"
    )
    print(
        f"x{args.concurrency} in flight: tw call {rate['tw call'] / rate['gRPC unary']:.1f}x the gRPC unary calls/s; "
        f"{args.big_mib} MiB echo at {gbps['tw call _out='] / gbps['send/recv']:.2f}x the send/recv echo"
    )


def main() -> int:
    if "--child" in sys.argv:
        asyncio.run(_child())
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=3000, help="8-byte round trips per contender")
    p.add_argument("--big-mib", type=int, default=64)
    p.add_argument("--repeat", type=int, default=5, help="large echoes per contender (best is kept)")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--against", type=Path, help="another checkout to compare the 8-byte rows with, in turns")
    p.add_argument("--rounds", type=int, default=3, help="with --against: runs of each tree, in turns")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.against is None or args.one:
        return asyncio.run(parent(args))
    runs = in_turns(Path(__file__), trees(args.against), ["--calls", str(args.calls)], args.rounds)
    print(f"8-byte round trips, two processes on loopback (tcp), median of {args.calls} each; {args.rounds} rounds")
    print_table(runs, width=20)
    return 0


if __name__ == "__main__":
    sys.exit(main())
