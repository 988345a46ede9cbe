"""Point-to-point throughput and latency between two processes on loopback:
tensorwire (tcp transport) against a raw-socket baseline and the naive gRPC approach.

    python benchmarks/p2p_tcp.py                   # 4 KiB .. 1 GiB
    python benchmarks/p2p_tcp.py --quick           # 4 KiB .. 64 MiB, less data per trial
    python benchmarks/p2p_tcp.py --sizes 1M,64M --repeat 5 --grpc-max 64M

What runs
    This script is the sender. For each contender it starts one child process (this same file
    with ``--child KIND``) that is the receiver; every listener binds port 0 and the child prints
    its address as the first line of its stdout, which the parent reads through a pipe. All three
    children live for the whole run and the parent interleaves the contenders (all latencies
    first; then per size one verification transfer each and the timed trials round-robin:
    tensorwire, raw, grpc, tensorwire, ...), so a change in the machine's load hits all three
    alike. Same sizes, same sender buffers:

    tensorwire  ``tensorwire.start("127.0.0.1:0", transports=("tcp",))`` on both sides; the parent
                ``node.connect``s, the child ``node.accept``s. ``peer.send(arr, tag=1)`` against
                ``peer.recv(tag=1, out=preallocated)``.
    raw         one blocking TCP socket (TCP_NODELAY on both ends, as tensorwire sets it):
                ``sendall`` of the whole buffer against a ``recv_into`` loop into a preallocated
                buffer, no framing at all since both sides know the size: the single-stream ceiling.
    grpc        grpc.aio with the tensor as protobuf ``bytes`` (google.protobuf's BytesValue, so
                no codegen): a client-streaming call carries the tensor in 4 MiB BytesValue chunks,
                each made with ``arr[a:b].tobytes()``; the server copies every chunk into a
                preallocated buffer. Sizes above --grpc-max (256 MiB) are skipped and shown as "-".

How time is measured (one-way throughput)
    One trial: the sender sends the same buffer N times back to back (N = --target / size, at
    least 1, at most --max-iters) and then waits for a tiny acknowledgement that the receiver
    sends only after its N-th receive completed, i.e. after the last byte landed in its
    preallocated buffer. The clock (time.perf_counter in the sender) starts before the first
    send and stops when the ack has arrived, so the time covers the delivery of every byte plus
    one small one-way message (the ack): the same kind of overhead for every contender, and
    small next to a trial (tens of milliseconds or more). For gRPC a trial is one streaming call
    carrying the N tensors, so it also includes one call setup. Throughput = N * size / time in
    GB/s (1 GB = 1e9 bytes). Every size runs one untimed verification transfer (which also
    warms up connections; receive buffers are allocated once per size and pre-touched, so no
    contender pays first-touch page faults in a timed trial) and then --repeat timed trials;
    the table shows the median trial, and the ratios are ratios of medians.

    Integrity: the verification transfer carries a position-dependent (non-periodic) pattern and
    the receiver answers with the crc32 of what landed in its buffer, which must equal the
    sender's. In timed trials the sender writes a sequence number into the first and last 8 bytes
    of its buffer before every send (allowed once the previous send returned) and the receiver
    checks both after every receive. Any mismatch stops that contender, its remaining cells read
    FAIL and the exit status is 2, so a transfer that is broken, stale or reported complete too
    early cannot report a speed. Any other failure (e.g. a dropped connection) also stops only
    that contender: FAIL cells, the error on stderr, exit status 1.

    The "tensorwire path" column gives the protocol tensorwire chose for the size (eager or
    rendezvous) and how many timed receives were "staged", i.e. arrived before their recv was
    posted and were copied from a tensorwire buffer into out= (from the receive receipts).

Latency
    8-byte ping-pong: the sender sends 8 bytes, the child echoes them, the sender times every
    round trip; median and p99 over --lat-iters round trips after a warm-up, for tensorwire
    send/recv (recv into a preallocated array), a raw blocking socket, and a gRPC unary call
    carrying an 8-byte BytesValue.

Goals (informational: the exit status is 0 unless something crashed or data was corrupted)
    tensorwire >= 0.9x raw at every size >= 64 MiB; tensorwire >= 5x gRPC at 64 MiB.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
import zlib

import numpy as np

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
DEFAULT_SIZES = "4K,64K,1M,16M,64M,256M,1G"
QUICK_SIZES = "4K,64K,1M,16M,64M"
GRPC_CHUNK = 4 * MiB
GRPC_SERVICE = "tensorwire.bench.P2P"
GRPC_OPTIONS = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
U64 = struct.Struct("<Q")
TIMEOUT = 300.0  # no phase comes near this; it only keeps a hung peer from hanging the run


# -- helpers for both processes -----------------------------------------------------------------


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": KiB, "M": MiB, "G": GiB}.get(text[-1:], 1)
    return int(float(text[:-1] if mult > 1 else text) * mult)


def fmt_size(n: int) -> str:
    for unit, name in ((GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB")):
        if n >= unit and n % unit == 0:
            return f"{n // unit} {name}"
    return f"{n} B"


def pattern(size: int) -> np.ndarray:
    """Position-dependent, non-periodic bytes that are quick to make: word i is i * odd ^ salt."""
    words = np.arange(size // 8, dtype=np.uint64)
    words *= np.uint64(0x9E3779B97F4A7C15)
    words ^= np.uint64(size * 0x5851F42D4C957F2D % (1 << 64))
    return words.view(np.uint8)


def prefaulted(size: int) -> np.ndarray:
    """A receive buffer whose pages are already mapped, as a reused buffer's would be."""
    return np.full(size, 0x5A, np.uint8)


def crc(buf: np.ndarray) -> int:
    return zlib.crc32(memoryview(buf).cast("B"))


def stamp(buf: np.ndarray, seq: int) -> None:
    buf[:8].view(np.uint64)[0] = seq
    buf[-8:].view(np.uint64)[0] = seq


def stamps_ok(buf: np.ndarray, seq: int) -> bool:
    return int(buf[:8].view(np.uint64)[0]) == seq and int(buf[-8:].view(np.uint64)[0]) == seq


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("peer closed the connection")
        got += k


def announce(address: str) -> None:
    sys.stdout.write(json.dumps({"address": address}) + "\n")
    sys.stdout.flush()


# -- receivers (the child processes) ------------------------------------------------------------
# A plan is a list of [size, iters, trials]. Each phase is one verification transfer answered by
# the crc32 of what landed, then `trials` trials of `iters` messages, each trial answered by one
# 8-byte ack holding the number of messages whose stamps were wrong.


async def child_tensorwire(plan: list[list[int]], lat_iters: int) -> None:
    import tensorwire

    async with tensorwire.start("127.0.0.1:0", transports=("tcp",)) as node:
        announce(node.address)
        peer = await asyncio.wait_for(node.accept(), TIMEOUT)
        ping = np.zeros(1, np.uint64)
        for _ in range(lat_iters):
            await peer.recv(tag=3, out=ping)
            await peer.send(ping, tag=4)
        ack = np.zeros(2, np.uint64)  # [crc32 or number of bad messages, number of staged recvs]
        for size, iters, trials in plan:
            # the benchmark's own heavy steps run off the loop: tensorwire's node must stay served
            out = await asyncio.to_thread(prefaulted, size)
            await peer.recv(tag=1, out=out)
            ack[:] = await asyncio.to_thread(crc, out), 0
            await peer.send(ack, tag=2)
            seq = 0
            for _ in range(trials):
                bad = staged = 0
                for _ in range(iters):
                    seq += 1
                    _, receipt = await peer.recv_with_receipt(tag=1, out=out)
                    bad += not stamps_ok(out, seq)
                    staged += receipt.staged
                ack[:] = bad, staged
                await peer.send(ack, tag=2)
            del out
        await peer.recv(tag=5)  # the sender is done; close only then


def child_raw(plan: list[list[int]], lat_iters: int) -> None:
    lsock = socket.create_server(("127.0.0.1", 0))
    announce(f"127.0.0.1:{lsock.getsockname()[1]}")
    lsock.settimeout(TIMEOUT)
    sock, _ = lsock.accept()
    lsock.close()
    sock.settimeout(TIMEOUT)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    ping = bytearray(8)
    pview = memoryview(ping)
    for _ in range(lat_iters):
        recv_exact(sock, pview)
        sock.sendall(ping)
    for size, iters, trials in plan:
        out = prefaulted(size)
        view = memoryview(out).cast("B")
        recv_exact(sock, view)
        sock.sendall(U64.pack(crc(out)))
        seq = 0
        for _ in range(trials):
            bad = 0
            for _ in range(iters):
                seq += 1
                recv_exact(sock, view)
                bad += not stamps_ok(out, seq)
            sock.sendall(U64.pack(bad))
        del view, out
    sock.recv(1)  # EOF: the sender is done
    sock.close()


async def child_grpc(plan: list[list[int]], lat_iters: int) -> None:
    import grpc
    from google.protobuf.wrappers_pb2 import BytesValue

    done = asyncio.Event()
    buffers: dict[str, np.ndarray | None] = {}

    async def push(request_iterator, context):  # one call: one verification transfer or one trial
        md = dict(context.invocation_metadata())
        size, iters, seq, verify = int(md["size"]), int(md["iters"]), int(md["seq"]), md["verify"] == "1"
        if buffers.get("out") is None or buffers["out"].nbytes != size:
            buffers["out"] = None
            buffers["out"] = prefaulted(size)  # allocated once per size, like the others
        out = buffers["out"]
        pos = bad = 0
        async for chunk in request_iterator:
            data = chunk.value
            out[pos : pos + len(data)] = np.frombuffer(data, np.uint8)
            pos += len(data)
            if pos == size:
                pos = 0
                iters -= 1
                if not verify:
                    seq += 1
                    bad += not stamps_ok(out, seq)
        if pos or iters:
            bad += 1 << 32  # a short or long stream counts as corrupted
        return BytesValue(value=U64.pack(crc(out) if verify and not bad else bad))

    async def ping(request, context):
        return BytesValue(value=request.value)

    async def finish(request, context):
        done.set()
        return BytesValue()

    def handler(kind, fn):  # type: ignore[no-untyped-def]
        return kind(fn, request_deserializer=BytesValue.FromString, response_serializer=BytesValue.SerializeToString)

    server = grpc.aio.server(options=GRPC_OPTIONS)
    handlers = {
        "Push": handler(grpc.stream_unary_rpc_method_handler, push),
        "Ping": handler(grpc.unary_unary_rpc_method_handler, ping),
        "Finish": handler(grpc.unary_unary_rpc_method_handler, finish),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(GRPC_SERVICE, handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    announce(f"127.0.0.1:{port}")
    await asyncio.wait_for(done.wait(), TIMEOUT * 4)
    await server.stop(grace=1.0)


def child_main(kind: str, plan: list[list[int]], lat_iters: int) -> None:
    if kind == "tensorwire":
        asyncio.run(child_tensorwire(plan, lat_iters))
    elif kind == "raw":
        child_raw(plan, lat_iters)
    elif kind == "grpc":
        asyncio.run(child_grpc(plan, lat_iters))
    else:
        raise SystemExit(f"unknown child kind {kind!r}")


# -- senders (this process) ---------------------------------------------------------------------


class Corrupted(RuntimeError):
    pass


class Child:
    """A receiver: this script run with --child; the first line of its stdout is its address."""

    def __init__(self, kind: str, plan: list[list[int]], lat_iters: int) -> None:
        cmd = [sys.executable, os.path.abspath(__file__), "--child", kind, "--plan", json.dumps(plan)]
        cmd += ["--lat-iters", str(lat_iters)]
        self.kind = kind
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(60)
        if not line or not line[0].strip():
            self.kill()
            raise RuntimeError(f"the {kind} receiver did not start")
        self.address = json.loads(line[0])["address"]

    def finish(self) -> None:
        try:
            rc = self.proc.wait(30)
        except subprocess.TimeoutExpired:
            rc = None
        if rc != 0:
            self.kill()
            raise RuntimeError(f"the {self.kind} receiver exited with status {rc}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class Phase:
    """One size for one contender: the sender's buffer, its crc32, and what was measured."""

    def __init__(self, buf: np.ndarray, want: int, iters: int, trials: int) -> None:
        self.buf, self.want, self.iters, self.trials = buf, want, iters, trials
        self.size = buf.nbytes
        self.seq = 0  # the stamp of the last message sent in a timed trial
        self.rates: list[float] = []
        self.protocol = ""
        self.staged = 0  # tensorwire: timed receives that went through a tensorwire buffer

    def verified(self, kind: str, got: int) -> None:
        if got != self.want:
            raise Corrupted(f"{kind}: {fmt_size(self.size)} arrived corrupted (crc32 {got:#x}, sent {self.want:#x})")

    def trial_done(self, kind: str, bad: int, seconds: float) -> None:
        if bad:
            raise Corrupted(f"{kind}: {bad} of {self.iters} messages of {fmt_size(self.size)} had wrong stamps")
        self.rates.append(self.size * self.iters / seconds / 1e9)

    def next_stamp(self) -> int:
        self.seq += 1
        stamp(self.buf, self.seq)
        return self.seq


# The senders. Every contender keeps its child and connection for the whole run, and the parent
# interleaves them: all latencies first, then per size one verification each and the timed
# trials round-robin (tensorwire, raw, grpc, tensorwire, ...), so that a change in the load of
# the machine hits all three alike. The raw sender's blocking calls run in a worker thread so
# that tensorwire's node (lease renewals) and gRPC's channel stay served meanwhile.


class TensorwireSender:
    name = "tensorwire"

    def __init__(self, plan: list[list[int]], lat_iters: int) -> None:
        self.child = Child(self.name, plan, lat_iters)
        self.ack = np.zeros(2, np.uint64)

    async def start(self) -> None:
        import tensorwire

        self.node = await tensorwire.start("127.0.0.1:0", transports=("tcp",))
        self.peer = await self.node.connect(self.child.address)

    async def latency(self, n: int, rtts: list[float]) -> None:
        ping, pong = np.zeros(1, np.uint64), np.zeros(1, np.uint64)
        for i in range(n):
            ping[0] = i
            t0 = time.perf_counter()
            await self.peer.send(ping, tag=3)
            await self.peer.recv(tag=4, out=pong)
            rtts.append(time.perf_counter() - t0)
            if int(pong[0]) != i:
                raise Corrupted("tensorwire: the ping came back wrong")

    async def verify(self, p: Phase) -> None:
        receipt = await self.peer.send(p.buf, tag=1)
        p.protocol = receipt.protocol
        await self.peer.recv(tag=2, out=self.ack)
        p.verified(self.name, int(self.ack[0]))

    async def trial(self, p: Phase) -> None:
        t0 = time.perf_counter()
        for _ in range(p.iters):
            p.next_stamp()
            await self.peer.send(p.buf, tag=1)
        await self.peer.recv(tag=2, out=self.ack)
        p.trial_done(self.name, int(self.ack[0]), time.perf_counter() - t0)
        p.staged += int(self.ack[1])

    async def close(self) -> None:
        await self.peer.send(self.ack, tag=5)
        await self.node.aclose()
        self.child.finish()

    async def abort(self) -> None:
        self.child.kill()
        if hasattr(self, "node"):
            await self.node.aclose()


class RawSender:
    name = "raw"

    def __init__(self, plan: list[list[int]], lat_iters: int) -> None:
        self.child = Child(self.name, plan, lat_iters)
        self.word = bytearray(8)

    async def start(self) -> None:
        host, port = self.child.address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=TIMEOUT)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def _latency(self, n: int, rtts: list[float]) -> None:
        ping, pong = bytearray(8), bytearray(8)
        pview = memoryview(pong)
        for i in range(n):
            U64.pack_into(ping, 0, i)
            t0 = time.perf_counter()
            self.sock.sendall(ping)
            recv_exact(self.sock, pview)
            rtts.append(time.perf_counter() - t0)
            if pong != ping:
                raise Corrupted("raw: the ping came back wrong")

    def _verify(self, p: Phase) -> None:
        p.protocol = "sendall"
        self.sock.sendall(memoryview(p.buf).cast("B"))
        recv_exact(self.sock, memoryview(self.word))
        p.verified(self.name, U64.unpack(self.word)[0])

    def _trial(self, p: Phase) -> None:
        view = memoryview(p.buf).cast("B")
        t0 = time.perf_counter()
        for _ in range(p.iters):
            p.next_stamp()
            self.sock.sendall(view)
        recv_exact(self.sock, memoryview(self.word))
        p.trial_done(self.name, U64.unpack(self.word)[0], time.perf_counter() - t0)

    async def latency(self, n: int, rtts: list[float]) -> None:
        await asyncio.to_thread(self._latency, n, rtts)

    async def verify(self, p: Phase) -> None:
        await asyncio.to_thread(self._verify, p)

    async def trial(self, p: Phase) -> None:
        await asyncio.to_thread(self._trial, p)

    async def close(self) -> None:
        self.sock.close()
        self.child.finish()

    async def abort(self) -> None:
        self.child.kill()
        if hasattr(self, "sock"):
            self.sock.close()


class GrpcSender:
    name = "grpc"

    def __init__(self, plan: list[list[int]], lat_iters: int) -> None:
        self.child = Child(self.name, [], 0)

    async def start(self) -> None:
        import grpc
        from google.protobuf.wrappers_pb2 import BytesValue

        self.BytesValue = BytesValue
        self.channel = grpc.aio.insecure_channel(self.child.address, options=GRPC_OPTIONS)

        def method(kind, name):  # type: ignore[no-untyped-def]
            return kind(
                f"/{GRPC_SERVICE}/{name}",
                request_serializer=BytesValue.SerializeToString,
                response_deserializer=BytesValue.FromString,
            )

        self.push = method(self.channel.stream_unary, "Push")
        self.ping = method(self.channel.unary_unary, "Ping")
        self.finish = method(self.channel.unary_unary, "Finish")
        await asyncio.wait_for(self.channel.channel_ready(), 60)

    async def latency(self, n: int, rtts: list[float]) -> None:
        for i in range(n):
            req = self.BytesValue(value=U64.pack(i))
            t0 = time.perf_counter()
            resp = await self.ping(req, timeout=TIMEOUT)
            rtts.append(time.perf_counter() - t0)
            if resp.value != req.value:
                raise Corrupted("grpc: the ping came back wrong")

    def _chunks(self, p: Phase, iters: int, stamped: bool):  # type: ignore[no-untyped-def]
        # the naive way: every 4 MiB chunk becomes a bytes object inside a protobuf message
        for _ in range(iters):
            if stamped:
                p.next_stamp()
            for off in range(0, p.size, GRPC_CHUNK):
                yield self.BytesValue(value=p.buf[off : off + GRPC_CHUNK].tobytes())

    async def verify(self, p: Phase) -> None:
        p.protocol = f"{GRPC_CHUNK // MiB} MiB chunks"
        md = (("size", str(p.size)), ("iters", "1"), ("verify", "1"), ("seq", "0"))
        resp = await self.push(self._chunks(p, 1, False), metadata=md, timeout=TIMEOUT)
        p.verified(self.name, U64.unpack(resp.value)[0])

    async def trial(self, p: Phase) -> None:
        md = (("size", str(p.size)), ("iters", str(p.iters)), ("verify", "0"), ("seq", str(p.seq)))
        t0 = time.perf_counter()
        resp = await self.push(self._chunks(p, p.iters, True), metadata=md, timeout=TIMEOUT)
        p.trial_done(self.name, U64.unpack(resp.value)[0], time.perf_counter() - t0)

    async def close(self) -> None:
        await self.finish(self.BytesValue(), timeout=TIMEOUT)
        await self.channel.close()
        self.child.finish()

    async def abort(self) -> None:
        self.child.kill()
        if hasattr(self, "channel"):
            await self.channel.close()


async def run_all(
    contenders: dict[str, tuple[type, list[Phase]]], n_lat: int, rtts: dict[str, list[float]]
) -> dict[str, BaseException]:
    errors: dict[str, BaseException] = {}
    senders = {}

    async def attempt(name: str, step) -> None:  # type: ignore[no-untyped-def]
        if name in errors:
            return
        try:
            await step()
        except Exception as exc:  # keep what was measured, stop this contender, go on
            errors[name] = exc
            print(f"{name} FAILED: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            with contextlib.suppress(Exception):
                await senders[name].abort()

    try:
        for name, (cls, phases) in contenders.items():  # all children first: spawning one blocks
            rtts[name] = []
            try:
                senders[name] = cls([[p.size, p.iters, p.trials] for p in phases], n_lat)
            except Exception as exc:
                errors[name] = exc
                print(f"{name} FAILED: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        for name, sender in senders.items():
            await attempt(name, sender.start)
            await attempt(name, lambda s=sender, r=rtts[name]: s.latency(n_lat, r))
        by_size = {name: {p.size: p for p in contenders[name][1]} for name in senders}
        for size in [p.size for p in next(iter(contenders.values()))[1]]:
            here = [(senders[name], ps[size]) for name, ps in by_size.items() if size in ps]
            for sender, p in here:
                await attempt(sender.name, lambda s=sender, p=p: s.verify(p))
            for _ in range(max((p.trials for _, p in here), default=0)):
                for sender, p in here:
                    await attempt(sender.name, lambda s=sender, p=p: s.trial(p))
        for name, sender in senders.items():
            await attempt(name, sender.close)
    finally:
        for sender in senders.values():
            sender.child.kill()  # only if it is still running, e.g. after a failure
    return errors


# -- report -------------------------------------------------------------------------------------


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def cell(x: float | None, fmt: str, suffix: str = "") -> str:
    return "-" if x is None else format(x, fmt) + suffix


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", help=f"comma-separated sizes, K/M/G suffixes (default {DEFAULT_SIZES})")
    ap.add_argument("--quick", action="store_true", help=f"sizes {QUICK_SIZES} and less data per trial")
    ap.add_argument("--repeat", type=int, default=5, help="timed trials per size; the median is shown (default 5)")
    ap.add_argument("--target", help="bytes per trial for small sizes (default 256M, --quick 128M)")
    ap.add_argument("--max-iters", type=int, default=2000, help="most messages in one trial (default 2000)")
    ap.add_argument("--grpc-max", default="256M", help="largest size sent through gRPC (default 256M)")
    ap.add_argument("--lat-iters", type=int, help="timed 8-byte round trips (default 2000, --quick 500)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--plan", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.child:
        child_main(args.child, json.loads(args.plan or "[]"), args.lat_iters or 0)
        return 0

    sizes = [parse_size(s) for s in (args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES)).split(",")]
    for s in sizes:
        if s < 16 or s % 8:
            ap.error(f"size {s}: sizes must be multiples of 8 bytes, at least 16")
    target = parse_size(args.target or ("128M" if args.quick else "256M"))
    grpc_max = parse_size(args.grpc_max)
    lat_iters = args.lat_iters or (500 if args.quick else 2000)
    lat_warmup = max(50, lat_iters // 10)
    repeat = max(1, args.repeat)

    t_start = time.perf_counter()
    bufs = {s: pattern(s) for s in sizes}
    crcs = {s: crc(b) for s, b in bufs.items()}

    def phases(limit: int | None = None) -> list[Phase]:
        iters = {s: max(1, min(args.max_iters, target // s)) for s in sizes}
        return [Phase(bufs[s], crcs[s], iters[s], repeat) for s in sizes if limit is None or s <= limit]

    load = os.getloadavg()[0]
    print(
        f"p2p on loopback: this process sends, a child process receives; {os.cpu_count()} CPUs, "
        f"load average {load:.2f} at start; {repeat} timed trials per size, median shown",
        flush=True,
    )
    tw_phases, raw_phases, grpc_phases = phases(), phases(), phases(grpc_max)
    n_lat = lat_iters + lat_warmup
    contenders = {
        "tensorwire": (TensorwireSender, tw_phases),
        "raw": (RawSender, raw_phases),
        "grpc": (GrpcSender, grpc_phases),
    }
    rtts: dict[str, list[float]] = {}
    errors = asyncio.run(run_all(contenders, n_lat, rtts))

    def rate(p: Phase | None) -> float | None:
        return median(p.rates) if p is not None and len(p.rates) == p.trials else None

    def rate_cell(p: Phase | None) -> str:
        if p is None:
            return "-"  # not run for this contender (gRPC above --grpc-max)
        return cell(rate(p), ".3f") if len(p.rates) == p.trials else "FAIL"

    by_size_grpc = {p.size: p for p in grpc_phases}
    rows = {}
    print()
    print("one-way throughput, GB/s (1e9 B/s): N sends back to back, clock stops at the receiver's ack")
    head = (
        f"{'size':>8} {'N':>5} {'tensorwire':>10} {'raw':>7} {'grpc':>7} {'tw/raw':>7} {'tw/grpc':>8}  tensorwire path"
    )
    print(head)
    print("-" * len(head))
    for tp, rp in zip(tw_phases, raw_phases, strict=True):
        gp = by_size_grpc.get(tp.size)
        tw, raw, gr = rate(tp), rate(rp), rate(gp)
        rows[tp.size] = (tw, raw, gr)
        path = f"{tp.protocol}, {tp.staged}/{tp.iters * tp.trials} recvs staged" if tp.protocol else ""
        print(
            f"{fmt_size(tp.size):>8} {tp.iters:>5} {rate_cell(tp):>10} {rate_cell(rp):>7} {rate_cell(gp):>7}"
            f" {cell(ratio(tw, raw), '.2f', 'x'):>7} {cell(ratio(tw, gr), '.2f', 'x'):>8}  {path}"
        )

    print()
    print(f"8-byte round trip, microseconds: median and p99 of {lat_iters} after {lat_warmup} warm-up")
    labels = {"tensorwire": "tensorwire tcp", "raw": "raw socket", "grpc": "grpc unary"}
    lat_med = {k: statistics.median(v[lat_warmup:]) if len(v) == n_lat else None for k, v in rtts.items()}
    head = f"{'':<15} {'median':>8} {'p99':>8} {'tw/this':>8}"
    print(head)
    print("-" * len(head))
    for name, lat in rtts.items():
        m = lat_med[name]
        if m is None:
            print(f"{labels[name]:<15} {'FAIL':>8}")
            continue
        p99 = percentile(lat[lat_warmup:], 0.99)
        tw_ratio = cell(ratio(lat_med["tensorwire"], m), ".2f", "x")
        print(f"{labels[name]:<15} {m * 1e6:>8.1f} {p99 * 1e6:>8.1f} {tw_ratio:>8}")

    print()
    print("goals (informational):")
    big = [(s, ratio(rows[s][0], rows[s][1])) for s in sizes if s >= 64 * MiB]
    if big:
        ok = all(r is not None and r >= 0.9 for _, r in big)
        detail = ", ".join(f"{fmt_size(s)}: {cell(r, '.2f', 'x')}" for s, r in big)
        print(f"  tensorwire >= 0.9x raw at >= 64 MiB   {'PASS' if ok else 'MISS'}  ({detail})")
    else:
        print("  tensorwire >= 0.9x raw at >= 64 MiB   n/a (no size >= 64 MiB in --sizes)")
    if 64 * MiB in rows and 64 * MiB <= grpc_max:
        r64 = ratio(rows[64 * MiB][0], rows[64 * MiB][2])
        verdict = "PASS" if r64 is not None and r64 >= 5 else "MISS"
        print(f"  tensorwire >= 5x grpc at 64 MiB       {verdict}  ({cell(r64, '.2f', 'x')})")
    else:
        print("  tensorwire >= 5x grpc at 64 MiB       n/a (64 MiB not measured through both)")
    load = os.getloadavg()[0]
    print(f"\nwall time {time.perf_counter() - t_start:.1f} s, load average {load:.2f} at the end")
    for name, exc in errors.items():
        print(f"{name} FAILED: {type(exc).__name__}: {exc}", file=sys.stderr)
    if any(isinstance(e, Corrupted) for e in errors.values()):
        return 2
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
