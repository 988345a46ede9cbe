"""The measuring end of a bench: latency, then each size over tensorwire and over a plain
socket, every batch checked by the crc32c of its last message; the report and its table."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import secrets
import socket
import statistics
import struct
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .._checks import join_address
from ..control._server import bind_targets
from ..errors import (
    ConnectError,
    DeadlineExceeded,
    IntegrityError,
    MethodNotFound,
    ProtocolError,
    RemoteError,
    TransferError,
)
from ..tensors._device import CPU, Device
from ._wire import (
    ANSWER_TAG,
    DATA_TAG,
    MAX_COUNT,
    PING_BYTES,
    PING_TAG,
    PONG_TAG,
    RAW_CRC,
    RAW_HEAD,
    RAW_PING,
    RAW_SINK,
    REQUEST_TAG,
    SERVICE_METHOD,
    STALL_S,
    crc_of,
    cupy,
    fmt_size,
    recv_exact,
    stamp,
)

if TYPE_CHECKING:
    from .._path import Path
    from .._peer import Peer
    from ..transports._base import Receipt

__all__ = ["Report", "Route", "Row", "run_bench"]

_FIRST_ANSWER_S = 10.0  # a node that serves bench requests answers the first at once


@dataclasses.dataclass(frozen=True)
class Route:
    """How some of a batch's sends went, as the transport below named it (``Receipt.route``)."""

    transport: str
    route: str
    lanes: tuple[str, ...]
    sends: int

    def to_json(self) -> dict[str, Any]:
        return {"transport": self.transport, "route": self.route, "lanes": list(self.lanes), "sends": self.sends}


@dataclasses.dataclass
class Row:
    """One size: tensorwire's batch and the baseline's, each ``count`` messages in ``seconds``."""

    size: int
    count: int
    seconds: float
    raw_count: int
    raw_seconds: float
    protocol: str  # the last send's receipt: eager, rendezvous, inline
    staged: bool
    crc32c: int  # of the last message of tensorwire's batch, as the node answered and the sender computed
    # how the node's receives of that batch landed, by their receipts (``_server._receive``):
    # recvs "direct", "staged" and "copied"; None from a node that does not say
    landed: dict[str, int] | None = None
    # what the transport below said it did with the batch's sends (``Receipt.route``), each
    # route and its lanes with how many sends said it; empty where none said (tcp, inproc, a
    # ucx payload under 4 MiB)
    routes: list[Route] = dataclasses.field(default_factory=list)

    @property
    def gbps(self) -> float:
        return self.count * self.size / self.seconds / 1e9

    @property
    def raw_gbps(self) -> float:
        return self.raw_count * self.size / self.raw_seconds / 1e9

    @property
    def ratio(self) -> float:
        return self.gbps / self.raw_gbps

    def to_json(self) -> dict[str, Any]:
        return {
            "size": self.size,
            "count": self.count,
            "seconds": self.seconds,
            "gbps": self.gbps,
            "raw_tcp_count": self.raw_count,
            "raw_tcp_seconds": self.raw_seconds,
            "raw_tcp_gbps": self.raw_gbps,
            "ratio": self.ratio,
            "protocol": self.protocol,
            "staged": self.staged,
            "crc32c": f"{self.crc32c:#010x}",
            "node_recvs": self.landed,
            "routes": [r.to_json() for r in self.routes],
        }


@dataclasses.dataclass
class Report:
    """A run: where to, over which path, the latencies and one row per size."""

    address: str
    device: str
    seconds: float
    path: Path
    baseline: str
    latency: dict[str, float] = dataclasses.field(default_factory=dict)  # median round trip, seconds
    pings: int = 0
    rows: list[Row] = dataclasses.field(default_factory=list)
    local_peer: int | None = None  # the pid of the node this run started, if it did

    def to_json(self) -> dict[str, Any]:
        path = self.path
        return {
            "address": self.address,
            "local_peer_pid": self.local_peer,
            "device": self.device,
            "seconds_per_size": self.seconds,
            "path": {
                "text": str(path),
                "transport": path.transport,
                "lanes": list(path.lanes),
                "how": path.how,
                "rdma": path.rdma,
                "gpudirect": path.gpudirect,
                "passed_over": [{"transport": n, "reason": r} for n, r in path.passed_over],
            },
            "baseline": self.baseline,
            "latency_us": {k: v * 1e6 for k, v in self.latency.items()},
            "pings": self.pings,
            "rows": [r.to_json() for r in self.rows],
            "verified": True,  # a crc32c that does not match ends the run with IntegrityError
        }

    def head_text(self) -> str:
        where = f"{self.address} (a node this run started, pid {self.local_peer})" if self.local_peer else self.address
        memory = "host memory" if self.device == "cpu" else f"{self.device} memory (the baseline sends host memory)"
        lines = [
            f"tensorwire bench to {where}, {memory}, ~{self.seconds:g} s per size",
            f"path: {self.path}",
            f"baseline: {self.baseline}",
        ]
        if self.latency:
            tw, raw = self.latency["tensorwire"], self.latency["raw_tcp"]
            lines.append(
                f"8-byte round trip, median of {self.pings}: tensorwire {tw * 1e6:.1f} us, raw TCP {raw * 1e6:.1f} us"
            )
        return "\n".join(lines)

    @staticmethod
    def table_head() -> str:
        return f"{'size':>9}  {'tensorwire GB/s':>15}  {'raw TCP GB/s':>12}  {'ratio':>6}  protocol"

    @staticmethod
    def row_text(row: Row) -> str:
        proto = row.protocol + (", staged" if row.staged else "")
        if row.landed is not None:
            # the sender's receipt says nothing of the node's copies: a message that came before
            # its recv was copied out of a buffer of tensorwire's there (staged)
            shares = [(n, how) for how, n in row.landed.items() if n]
            proto += "; node: " + ", ".join(f"{_share(n, row.count)} {how}" for n, how in shares)
        line = f"{fmt_size(row.size):>9}  {row.gbps:15.3f}  {row.raw_gbps:12.3f}  {row.ratio:5.2f}x  {proto}"
        # a line of its own under the row, aligned with the protocol: UCX's names are long
        indent = " " * (len(line) - len(proto))
        return "\n".join([line, *(indent + _route_text(r, row.count) for r in row.routes)])

    @staticmethod
    def foot_text() -> str:
        return (
            "every batch verified: the node's crc32c of its last message matched the sender's\n"
            "ratio: tensorwire / raw TCP, same processes, same run (1.00x: as fast as one plain socket)"
        )


class _RawClient:
    """The baseline's near end: one blocking socket, driven from threads."""

    def __init__(self, sock: socket.socket, where: str) -> None:
        self._sock = sock
        self.where = where

    @classmethod
    async def connect(cls, host: str, port: int, secret: bytes) -> _RawClient:
        where = join_address(host, port)

        def dial() -> socket.socket:
            failed: OSError | None = None
            for target in _dialled(host):
                try:
                    sock = socket.create_connection((target, port), timeout=STALL_S)
                except OSError as exc:
                    failed = exc
                    continue
                try:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    sock.sendall(secret)
                except BaseException:
                    sock.close()
                    raise
                return sock
            assert failed is not None
            raise failed

        try:
            return cls(await asyncio.to_thread(dial), where)
        except OSError as exc:
            raise ConnectError(
                f"the raw TCP baseline could not connect to {where} (the node opened it for this run; "
                f"is that port blocked between the machines?): {exc}"
            ) from exc

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()

    async def _in_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return await asyncio.to_thread(fn, *args)
        except OSError as exc:
            raise TransferError(f"raw TCP baseline to {self.where}: {exc}") from exc
        except BaseException:  # cancelled: the thread ends when its socket does
            self.close()
            raise

    async def sink(self, data: np.ndarray, count: int, nonce: bytes) -> tuple[float, int]:
        return await self._in_thread(self._sink, data, count, nonce)  # type: ignore[no-any-return]

    def _sink(self, data: np.ndarray, count: int, nonce: bytes) -> tuple[float, int]:
        sock, view = self._sock, data.data
        sock.sendall(RAW_HEAD.pack(RAW_SINK, data.nbytes, count))
        t0 = time.perf_counter()
        for _ in range(count - 1):
            sock.sendall(view)
        stamp(data, nonce)
        sock.sendall(view)
        answer = bytearray(RAW_CRC.size)
        if not recv_exact(sock, memoryview(answer)):
            raise ConnectionError("the node closed the connection instead of answering")
        return time.perf_counter() - t0, RAW_CRC.unpack(answer)[0]

    async def ping(self, count: int) -> list[float]:
        return await self._in_thread(self._ping, count)  # type: ignore[no-any-return]

    def _ping(self, count: int) -> list[float]:
        sock, buf = self._sock, memoryview(bytearray(PING_BYTES))
        sock.sendall(RAW_HEAD.pack(RAW_PING, PING_BYTES, count))
        times = []
        for _ in range(count):
            t0 = time.perf_counter()
            sock.sendall(buf)
            if not recv_exact(sock, buf):
                raise ConnectionError("the node closed the connection")
            times.append(time.perf_counter() - t0)
        return times


def _dialled(host: str) -> list[str]:
    """Where the baseline dials the node at ``host``: where the control plane reached it.
    gRPC dials "localhost" on both loopbacks whatever /etc/hosts says (control's
    bind_targets), so a node serving on [::1] alone was reached as localhost while the
    baseline, resolved by the system (127.0.0.1 alone where /etc/hosts says so), was refused.
    Any other name as it is (``create_connection`` tries each address it resolves to)."""
    if host.lower() == "localhost":
        return [address for _, address in bind_targets(host) or ()]
    return [host]


async def _answer(peer: Peer, *, first: bool = False) -> Any:
    """The node's answer to the last request; a refusal or failure raised as RemoteError. A
    node that serves bench requests answers the first at once: one that does not, soon, only
    says it does (a node without the service is named before, by ``run_bench``'s first call)."""
    try:
        async with asyncio.timeout(_FIRST_ANSWER_S if first else None):
            answer = await peer._recv_own(tag=ANSWER_TAG)
    except TimeoutError:
        raise DeadlineExceeded(
            f"the node at {peer.remote_address} did not answer a bench request within {_FIRST_ANSWER_S:g} s: "
            "is it `tensorwire serve --bench`?"
        ) from None
    if isinstance(answer, dict) and "error" in answer:
        kind, message = str(answer["error"]), str(answer.get("message", ""))
        what = "refused the bench" if answer.get("refused") else "failed a bench request"
        raise RemoteError(
            f"the node at {peer.remote_address} {what}: {kind}: {message}",
            remote_type=kind,
            remote_message=message,
        )
    return answer


async def _request(peer: Peer, request: dict[str, Any]) -> None:
    """Ask for a sink or pings and wait until the node is ready for them (untimed)."""
    await peer._send_own(request, tag=REQUEST_TAG)
    answer = await _answer(peer)
    if answer != "ready":
        raise ProtocolError(f"the node at {peer.remote_address} answered {answer!r} to {request['op']!r}")


def _nonces() -> Callable[[], bytes]:
    start = secrets.randbits(63)
    counter = iter(range(start, start + (1 << 62)))
    return lambda: struct.pack("<Q", next(counter))


async def _calibrated(batch: Callable[[int], Awaitable[float]], budget: float) -> tuple[int, float]:
    """Run ``batch(n)`` (which returns its seconds) with n growing until one takes a tenth of
    ``budget`` (these are the warm-up), then once with the n that should take ``budget``."""
    n, t = 1, await batch(1)
    while t < budget / 10 and n < MAX_COUNT:
        n = min(MAX_COUNT, n * min(8, max(2, math.ceil(budget / 10 / max(t, 1e-9)))))
        t = await batch(n)
    count = max(2, min(MAX_COUNT, round(budget * n / t)))
    return count, await batch(count)


async def run_bench(
    peer: Peer,
    sizes: Sequence[int],
    *,
    seconds: float = 1.0,
    device: Device = CPU,
    local_peer: int | None = None,
    on_progress: Callable[[Report, Row | None], None] | None = None,
) -> Report:
    """Measure ``peer`` (a node serving bench requests): latency, then each size, tensorwire and
    the plain TCP baseline for about ``seconds / 2`` each. ``on_progress(report, None)`` is
    called once the path and latency are known, ``on_progress(report, row)`` after each size.
    Raises IntegrityError when a crc32c does not match, RemoteError when the node refuses."""
    try:  # (a node without the service would leave the requests unread: the first answer timed out)
        await peer.call(SERVICE_METHOD, _deadline=_FIRST_ANSWER_S)
    except MethodNotFound as exc:
        raise MethodNotFound(
            f"the node at {peer.remote_address} runs no bench service: it is not a `tensorwire serve` (a "
            "`tensorwire stage`, or a program of its own?); start one with `tensorwire serve --bench`",
            remote_type=exc.remote_type,
            remote_message=exc.remote_message,
            method=SERVICE_METHOD,
        ) from None
    await peer._send_own({"op": "open"}, tag=REQUEST_TAG)
    opened = await _answer(peer, first=True)
    if not isinstance(opened, dict) or not isinstance(opened.get("port"), int):
        raise ProtocolError(f"the node at {peer.remote_address} answered {opened!r} to a bench request")
    host = peer.remote_address.rpartition(":")[0].strip("[]")
    raw = await _RawClient.connect(host, int(opened["port"]), bytes.fromhex(opened["secret"]))
    nonce = _nonces()
    try:
        report = Report(
            address=peer.remote_address,
            device=str(device),
            seconds=seconds,
            path=peer.path,
            baseline=f"one plain TCP socket between the same two processes, to {raw.where}, "
            "blocking sendall / recv_into in threads",
            local_peer=local_peer,
        )
        report.pings, report.latency = await _latency(peer, raw, seconds)
        if on_progress is not None:
            on_progress(report, None)
        for size in sizes:
            report.rows.append(await _one_size(peer, raw, size, seconds / 2, device, nonce))
            if on_progress is not None:
                on_progress(report, report.rows[-1])
        return report
    finally:
        raw.close()


async def _latency(peer: Peer, raw: _RawClient, seconds: float) -> tuple[int, dict[str, float]]:
    x, back = np.zeros(PING_BYTES, np.uint8), np.empty(PING_BYTES, np.uint8)

    async def pings(n: int) -> list[float]:
        await _request(peer, {"op": "ping", "count": n})
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            await peer._send_own(x, tag=PING_TAG)
            await peer._recv_own(tag=PONG_TAG, out=back)
            times.append(time.perf_counter() - t0)
        return times

    warm = statistics.median(await pings(20))  # also warms both paths up
    await raw.ping(20)
    n = max(20, min(2000, int(min(0.25, seconds / 4) / 2 / warm)))
    return n, {"tensorwire": statistics.median(await pings(n)), "raw_tcp": statistics.median(await raw.ping(n))}


async def _one_size(
    peer: Peer, raw: _RawClient, size: int, budget: float, device: Device, nonce: Callable[[], bytes]
) -> Row:
    host = await asyncio.to_thread(_payload, size)
    data = host if device.kind == "cpu" else await asyncio.to_thread(_to_device, host, device)
    receipts: list[Any] = [None]
    crcs: list[int] = [0]
    landed: list[dict[str, int] | None] = [None]
    # the last batch's routes (Receipt.route): (transport, route, lanes) -> how many sends said it
    routes: dict[tuple[str, str, tuple[str, ...]], int] = {}

    def note(receipt: Receipt) -> Receipt:
        if receipt.route:
            key = (receipt.transport, receipt.route, receipt.lanes)
            routes[key] = routes.get(key, 0) + 1
        return receipt

    async def tensorwire(count: int) -> float:
        await _request(peer, {"op": "sink", "size": size, "count": count, "device": str(device), "landed": True})
        routes.clear()
        mark = nonce()
        t0 = time.perf_counter()
        for _ in range(count - 1):
            note(await peer._send_own(data, tag=DATA_TAG))
        stamp(data, mark)
        receipts[0] = note(await peer._send_own(data, tag=DATA_TAG))
        got, landed[0] = _landed(await _answer(peer), count)
        dt = time.perf_counter() - t0
        want = await crc_of(data, device)
        if got != want:
            raise IntegrityError(
                f"tensorwire, {fmt_size(size)} x{count}: the node's crc32c of the last message is "
                f"{_hex(got)}, the sender's {want:#010x}: it did not land whole"
            )
        crcs[0] = want
        return dt

    async def baseline(count: int) -> float:
        dt, got = await raw.sink(host, count, nonce())
        want = await crc_of(host, CPU)
        if got != want:
            raise IntegrityError(
                f"raw TCP, {fmt_size(size)} x{count}: the node's crc32c of the last message is "
                f"{got:#010x}, the sender's {want:#010x}: it did not land whole"
            )
        return dt

    count, dt = await _calibrated(tensorwire, budget)
    raw_count, raw_dt = await _calibrated(baseline, budget)
    receipt = receipts[0]
    said = [Route(t, r, lanes, n) for (t, r, lanes), n in sorted(routes.items(), key=lambda kv: -kv[1])]
    return Row(size, count, dt, raw_count, raw_dt, receipt.protocol, receipt.staged, crcs[0], landed[0], said)


def _route_text(route: Route, count: int) -> str:
    """``ucx route: rendezvous zero-copy read from remote over cma/memory``, with the share of
    the batch's sends that said it where that is not all of them (UCX names no protocol for a
    send it completed within the call that posted it)."""
    lanes = ", ".join(route.lanes)
    share = "" if route.sends == count else f" ({_share(route.sends, count)} of sends)"
    return f"{route.transport} route{share}: {route.route} over {lanes}"


def _share(n: int, count: int) -> str:
    """``n`` of ``count`` as a whole percentage, never rounded to 0% or 100% when it is not."""
    pct = 100 * n / count
    return "<1%" if 0 < pct < 1 else ">99%" if 99 < pct < 100 else f"{pct:.0f}%"


def _landed(answer: object, count: int) -> tuple[object, dict[str, int] | None]:
    """A sink's answer: the crc32c, and how the node's ``count`` receives landed (None from a
    node that answers the crc alone)."""
    if not isinstance(answer, dict):
        return answer, None
    landed = answer.get("landed")
    if (
        not isinstance(landed, dict)
        or set(landed) != {"direct", "staged", "copied"}
        or not all(type(n) is int and n >= 0 for n in landed.values())
        or sum(landed.values()) != count
    ):
        raise ProtocolError(f"a node answered {answer!r} to a sink of {count} messages")
    return answer.get("crc32c"), landed


def _hex(value: object) -> str:
    return f"{value:#010x}" if isinstance(value, int) else repr(value)


def _payload(size: int) -> np.ndarray:
    """``size`` random bytes (incompressible, different for every size)."""
    return np.frombuffer(bytearray(np.random.default_rng(size).bytes(size)), np.uint8)


def _to_device(host: np.ndarray, device: Device) -> Any:
    cp = cupy()
    with cp.cuda.Device(device.index):
        return cp.asarray(host)
