"""tensorwire's counters and histograms, for Prometheus.

Every transfer is counted as it happens, by transport and by how it went (protocol, direct or
staged, host or CUDA memory), in every process that runs a node; so are the peers opened (with
the transports passed over on the way: a fallback shows), failed connects and refused requests.
``snapshot()`` reads them with no other package; the rest needs ``prometheus-client``
(``pip install 'tensorwire[metrics]'``)::

    import tensorwire.metrics
    tensorwire.metrics.register()                    # into prometheus_client's default registry
    server = tensorwire.metrics.serve("0.0.0.0:9464")  # or serve them at http://HOST:PORT/metrics

``tensorwire serve --metrics HOST:PORT`` and ``tensorwire stage --metrics HOST:PORT`` do the latter.
``count_transfers(False)`` stops counting transfers where their cost (1-3 us each) matters.

The metrics (counters end in ``_total``):

- ``tensorwire_transfers_total`` and ``tensorwire_transfer_bytes_total`` {op, traffic,
  transport, protocol, direct, staged, memory}: op "send"/"recv" for messages, "read"/"write"
  for one-sided operations as their caller sees them. traffic says what a message was for:
  "messages" (on the user's own tags; pipeline activations are messages too), "rpc" (calls'
  requests, arguments, replies and stream items), "one-sided" (the requests and replies of an
  owner-assisted operation: its bytes are counted there too, as the owner's send and the
  reader's recv, besides the read or write itself, whose traffic is "one-sided" as well),
  "pipeline" (a pipeline stage's hellos to its neighbours and its aborts) or "bench"
  (``tensorwire bench``). So ``traffic="messages"`` is exactly what ``send``/``recv``
  moved for the user. A send is counted once it completed: one cancelled after the transport
  took its bytes (ucx hands a large one over and cannot take it back) may still arrive, and is
  then counted by its receiver only.
- ``tensorwire_transfer_seconds`` {op, transport}: a histogram of how long each send, read and
  write took, as its receipt says. Recvs are not timed: a recv's time runs from its call, so it
  is mostly its wait for the sender (tensorwire's own listening loops wait as long as they serve).
- ``tensorwire_peers_opened_total`` {transport, side, passed_over}: side "connect" or "accept";
  passed_over names the transports preferred over the one taken, sorted and comma-separated
  ("inproc,verbs"; "" when none was; "other"
  for a name tensorwire does not know, which a peer of another build may send), except inproc
  for a peer in another process, which it never carries: that is no fallback (the peer's path
  still names it).
- ``tensorwire_peers_open`` {transport}: peers open now, over the nodes of this process.
- ``tensorwire_connect_failures_total`` {error}: ``Node.connect`` calls that raised, by error.
- ``tensorwire_refusals_total`` {kind}: requests this process refused or connections it
  dropped ("control" for the control plane, a handshake refused for ``require=`` or for no
  shared transport among them; else the data transport's name), and "accept":
  peers that left before anyone accepted them, dropped with the messages they left by a node
  that has never called ``accept()`` once it holds more than ``Node.MAX_DEPARTED`` of them.
- ``tensorwire_stranded_requests`` and ``tensorwire_stranded_bytes`` {transport}: requests of
  closed channels the transport could not finish, over the nodes of this process, and the bytes
  of memory kept for them now (ucx: requests UCX has not completed, mostly rendezvous sends to
  peers that died, which UCX without peer error handling never completes and which go once the
  peer's process is known to have ended where that can be known, see docs/ucx.md; and receives
  cut off while their message was landing). A number that keeps growing on a long-lived node is
  memory it will not get back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import socketserver
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from . import _metrics
from ._checks import check_arguments, check_bool, split_address
from .errors import ConfigurationError

__all__ = ["MetricsServer", "Snapshot", "collector", "count_transfers", "register", "serve", "snapshot", "text"]

log = logging.getLogger(__name__)

#: seconds the metrics endpoint waits on a connection for a request (or a client's read) before
#: it drops the connection: each one is served on a thread of its own while it lasts
IDLE_SECONDS = 10.0


@dataclass(frozen=True)
class Snapshot:
    """Every count at one moment, as plain numbers (no prometheus_client needed).

    transfers: (op, traffic, transport, protocol, direct, staged, memory) -> (transfers, bytes)
    seconds: (op, transport) -> (transfers timed, their seconds in all); recvs are not timed
    peers_opened: (transport, side, passed_over) -> count; peers_open: transport -> count now
    connect_failures: error class name -> count; refusals: kind -> count
    stranded: transport -> (requests it could not finish and keeps memory for, those bytes) now
    """

    transfers: dict[tuple[str, str, str, str, bool, bool, str], tuple[int, int]] = field(default_factory=dict)
    seconds: dict[tuple[str, str], tuple[int, float]] = field(default_factory=dict)
    peers_opened: dict[tuple[str, str, str], int] = field(default_factory=dict)
    peers_open: dict[str, int] = field(default_factory=dict)
    connect_failures: dict[str, int] = field(default_factory=dict)
    refusals: dict[str, int] = field(default_factory=dict)
    stranded: dict[str, tuple[int, int]] = field(default_factory=dict)

    @check_arguments
    def bytes(self, op: str, transport: str | None = None, traffic: str | None = None) -> int:
        """Bytes of ``op`` ("send", "recv", "read", "write"), over one transport or all, of one
        kind of traffic ("messages", "rpc", "one-sided", "pipeline", "bench") or all."""
        _check_query(op, transport, traffic)
        return sum(n for k, (_, n) in self.transfers.items() if _matches(k, op, transport, traffic))

    @check_arguments
    def count(self, op: str, transport: str | None = None, traffic: str | None = None) -> int:
        """Transfers of ``op``, over one transport or all, of one kind of traffic or all."""
        _check_query(op, transport, traffic)
        return sum(c for k, (c, _) in self.transfers.items() if _matches(k, op, transport, traffic))


_OPS = ("send", "recv", "read", "write")
_TRAFFIC = ("messages", "rpc", "one-sided", "pipeline", "bench")


def _check_query(op: object, transport: object, traffic: object) -> None:
    """A misspelt op or traffic kind matches nothing, and its count stays 0 however much moves
    (``bytes("sned")``): refuse it. A transport is any string (one of another build counts too)."""
    if op not in _OPS:
        raise ConfigurationError(f"op must be one of {', '.join(_OPS)}, not {op!r}")
    if transport is not None and not isinstance(transport, str):
        raise ConfigurationError(
            f"transport must be a transport's name, e.g. 'tcp', or None for all, not {transport!r}"
        )
    if traffic is not None and traffic not in _TRAFFIC:
        raise ConfigurationError(f"traffic must be one of {', '.join(_TRAFFIC)}, or None for all, not {traffic!r}")


def _matches(key: tuple[Any, ...], op: str, transport: str | None, traffic: str | None) -> bool:
    return key[0] == op and transport in (None, key[2]) and traffic in (None, key[1])


def snapshot() -> Snapshot:
    """The counts so far in this process."""
    s = _metrics.snapshot()
    seconds = {k: (int(sum(v[:-1])), float(v[-1])) for k, v in s["seconds"].items()}
    return Snapshot(
        s["transfers"],
        seconds,
        s["peers_opened"],
        s["peers_open"],
        s["connect_failures"],
        s["refusals"],
        s["stranded"],
    )


def count_transfers(on: bool = True) -> None:
    """Count every transfer (the default), or stop counting them (``False``) and give back
    their cost: 0.7-0.8 us a transfer with hot caches, about 1-3 us in a real round trip of 4
    transfers (``benchmarks/metrics_cost.py`` on this project's 2-core machine: 6.3 us of a
    95 us inproc round trip, 1.07x; 11 us of a 166 us tcp one, 1.07x; 3.4 us of a 234 us ucx
    one, 1.02x). The counts so far stay;
    peers, failed connects and refusals are counted either way."""
    _metrics.count_transfers(check_bool("count_transfers(on)", on))  # ("no" or None: not a switch)


def _prometheus() -> Any:
    try:
        import prometheus_client
    except ImportError as exc:
        raise ConfigurationError(
            "tensorwire's Prometheus metrics need prometheus-client: pip install 'tensorwire[metrics]'"
        ) from exc
    return prometheus_client


def _flag(b: bool) -> str:
    return "true" if b else "false"


_LABELS = ["op", "traffic", "transport", "protocol", "direct", "staged", "memory"]


class _Collector:
    """Builds the metric families from the counts at each scrape."""

    def describe(self) -> list[Any]:
        """The families, empty: their names, for the registry's checks and filtered scrapes."""
        return list(self._families())

    def _families(self) -> tuple[Any, ...]:
        _prometheus()
        from prometheus_client import core

        return (
            core.CounterMetricFamily("tensorwire_transfers", "Transfers, by how they went.", labels=_LABELS),
            core.CounterMetricFamily(
                "tensorwire_transfer_bytes", "Bytes transferred, by how they went.", labels=_LABELS
            ),
            core.HistogramMetricFamily(
                "tensorwire_transfer_seconds",
                "How long sends and one-sided reads and writes took, as their receipts say.",
                labels=["op", "transport"],
            ),
            core.CounterMetricFamily(
                "tensorwire_peers_opened", "Peers whose data path opened.", labels=["transport", "side", "passed_over"]
            ),
            core.GaugeMetricFamily("tensorwire_peers_open", "Peers open now.", labels=["transport"]),
            core.CounterMetricFamily(
                "tensorwire_connect_failures", "Node.connect calls that raised.", labels=["error"]
            ),
            core.CounterMetricFamily(
                "tensorwire_refusals", "Requests refused and connections dropped.", labels=["kind"]
            ),
            core.GaugeMetricFamily(
                "tensorwire_stranded_requests",
                "Requests of closed channels the transport could not finish and keeps memory for.",
                labels=["transport"],
            ),
            core.GaugeMetricFamily(
                "tensorwire_stranded_bytes", "Bytes kept for stranded requests.", labels=["transport"]
            ),
        )

    def collect(self) -> Iterator[Any]:
        count, size, hist, opened, open_now, failed, refused, stranded, stranded_bytes = self._families()
        s = _metrics.snapshot()
        for (op, traffic, transport, protocol, direct, staged, memory), (n, nbytes) in sorted(s["transfers"].items()):
            values = [op, traffic, transport, protocol, _flag(direct), _flag(staged), memory]
            count.add_metric(values, n)
            size.add_metric(values, nbytes)
        for key, counts in sorted(s["seconds"].items()):
            buckets, running = [], 0.0
            for bound, n in zip([*_metrics.BUCKETS, float("inf")], counts[:-1], strict=True):
                running += n
                buckets.append((repr(bound) if bound != float("inf") else "+Inf", running))
            hist.add_metric(list(key), buckets, counts[-1])
        for key, n in sorted(s["peers_opened"].items()):
            opened.add_metric(list(key), n)
        for transport, n in sorted(s["peers_open"].items()):
            open_now.add_metric([transport], n)
        for name, n in sorted(s["connect_failures"].items()):
            failed.add_metric([name], n)
        for kind, n in sorted(s["refusals"].items()):
            refused.add_metric([kind], n)
        for transport, (n, nbytes) in sorted(s["stranded"].items()):
            stranded.add_metric([transport], n)
            stranded_bytes.add_metric([transport], nbytes)
        yield from (count, size, hist, opened, open_now, failed, refused, stranded, stranded_bytes)


_COLLECTOR = _Collector()


def collector() -> Any:
    """tensorwire's collector, to register in a prometheus_client registry of your own."""
    _prometheus()
    return _COLLECTOR


def register(registry: Any = None) -> None:
    """Add tensorwire's metrics to ``registry`` (prometheus_client's default one when None); a
    second call for a registry that has them does nothing. ConfigurationError if the registry
    holds other metrics of the same names."""
    prometheus = _prometheus()
    registry = prometheus.REGISTRY if registry is None else _registry(registry)
    try:
        registry.register(_COLLECTOR)
    except ValueError as exc:
        if _COLLECTOR in getattr(registry, "_collector_to_names", {}):
            return  # registered already
        raise ConfigurationError(f"cannot register tensorwire's metrics: {exc}") from exc


def _registry(registry: object) -> Any:
    """A registry to register in or serve from: anything else failed in prometheus_client (an
    AttributeError at ``register``; at ``serve``, every scrape, in the server's thread)."""
    if not (callable(getattr(registry, "register", None)) and callable(getattr(registry, "collect", None))):
        raise ConfigurationError(
            f"registry must be a prometheus_client.CollectorRegistry, or None for the default one, not {registry!r}"
        )
    return registry


def text() -> str:
    """tensorwire's metrics alone, in Prometheus' text format."""
    prometheus = _prometheus()
    registry = prometheus.CollectorRegistry(auto_describe=False)
    registry.register(_COLLECTOR)
    return str(prometheus.generate_latest(registry).decode())


def _http_server(host: str, port: int, registry: Any) -> tuple[Any, threading.Thread]:
    """prometheus_client's HTTP endpoint (``start_http_server``), but one whose connections do
    not outlive it: it served each on a thread of its own for as long as the client kept it,
    idle or not, and its close left them open, with their threads, until their clients let go.
    Here an idle connection is dropped after ``IDLE_SECONDS`` (quietly: a timeout is no error
    to print), and the server drops those left as it closes (``_Server.drop_connections``)."""
    from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

    from prometheus_client import make_wsgi_app

    family, _, _, _, where = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]

    class Handler(WSGIRequestHandler):
        def setup(self) -> None:
            self.request.settimeout(IDLE_SECONDS)  # (read at each connection)
            super().setup()

        def log_message(self, format: str, *args: Any) -> None:
            """Log no request."""

    class Server(socketserver.ThreadingMixIn, WSGIServer):
        daemon_threads = True
        address_family = family

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self._open: set[socket.socket] = set()
            self._open_lock = threading.Lock()
            super().__init__(*args, **kwargs)

        def process_request(self, request: Any, client_address: Any) -> None:
            with self._open_lock:
                self._open.add(request)
            super().process_request(request, client_address)

        def shutdown_request(self, request: Any) -> None:
            with self._open_lock:
                self._open.discard(request)
            super().shutdown_request(request)

        def handle_error(self, request: Any, client_address: Any) -> None:
            # a client that timed out, reset or went (socketserver printed each to stderr)
            log.debug("metrics request from %s failed", client_address, exc_info=True)

        def drop_connections(self) -> None:
            """End the connections still served: their threads' reads return, and they close."""
            with self._open_lock:
                connections = list(self._open)
            for connection in connections:
                with contextlib.suppress(OSError):
                    connection.shutdown(socket.SHUT_RDWR)

    httpd = make_server(str(where[0]), port, make_wsgi_app(registry), Server, handler_class=Handler)
    thread = threading.Thread(target=httpd.serve_forever, name="tensorwire-metrics", daemon=True)
    thread.start()
    return httpd, thread


class MetricsServer:
    """An HTTP endpoint serving ``/metrics`` from a thread of its own; close it with
    ``aclose()`` (or ``close()`` outside an event loop), or use it as an async context manager."""

    def __init__(self, httpd: Any, thread: threading.Thread, address: str) -> None:
        self._httpd, self._thread = httpd, thread
        #: where it serves, "host:port" (the port picked where 0 was asked for)
        self.address = address
        self._closed = False
        self._closing = threading.Lock()  # a second close waits for the first

    def __repr__(self) -> str:
        return f"<MetricsServer http://{self.address}/metrics{' closed' if self._closed else ''}>"

    def close(self) -> None:
        """Stop serving; idempotent. Blocks until the server's thread is done (well under a second)."""
        with self._closing:
            if self._closed:
                return
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd.drop_connections()
            self._thread.join()
            self._closed = True

    async def aclose(self) -> None:
        """Stop serving; idempotent, and never blocks the event loop."""
        await asyncio.to_thread(self.close)

    async def __aenter__(self) -> MetricsServer:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


@check_arguments
def serve(address: str = "127.0.0.1:0", *, registry: Any = None) -> MetricsServer:
    """Serve ``registry`` (prometheus_client's default one, with tensorwire's metrics
    registered in it, when None) at ``http://address/metrics``. Port 0 picks a free port: read
    ``server.address``. ConfigurationError for a bad address or one that cannot be bound. It
    resolves the host and binds before it returns: from async code, ``await
    asyncio.to_thread(serve, address)`` keeps a name lookup off the event loop."""
    host, port = split_address(address)
    prometheus = _prometheus()
    if registry is None:
        register()
        registry = prometheus.REGISTRY
    else:
        registry = _registry(registry)
    try:
        httpd, thread = _http_server(host, port, registry)
    except OSError as exc:
        raise ConfigurationError(f"cannot serve metrics at {address}: {exc.strerror or exc}") from exc
    bound = httpd.server_address[1]
    shown = f"[{host}]" if ":" in host else host
    return MetricsServer(httpd, thread, f"{shown}:{bound}")
