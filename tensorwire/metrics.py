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

The metrics (counters end in ``_total``):

- ``tensorwire_transfers_total`` and ``tensorwire_transfer_bytes_total`` {op, transport,
  protocol, direct, staged, memory}: op "send"/"recv" for messages (rpc calls and pipeline
  activations are messages too), "read"/"write" for one-sided operations as their caller sees
  them. An owner-assisted one-sided operation's bytes travel as messages and are also counted
  there, on reserved tags (its owner's send, its reader's recv).
- ``tensorwire_transfer_seconds`` {op, transport}: a histogram of how long each took, as its
  receipt says (a recv's time runs from the call, so it includes waiting for the sender).
- ``tensorwire_peers_opened_total`` {transport, side, passed_over}: side "connect" or "accept";
  passed_over names the transports preferred over the one taken ("" when none was).
- ``tensorwire_peers_open`` {transport}: peers open now, over the nodes of this process.
- ``tensorwire_connect_failures_total`` {error}: ``Node.connect`` calls that raised, by error.
- ``tensorwire_refusals_total`` {kind}: requests this process refused or connections it
  dropped ("control" for the control plane, else the data transport's name).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from . import _metrics
from ._node import _split_address
from .errors import ConfigurationError

__all__ = ["MetricsServer", "Snapshot", "collector", "register", "serve", "snapshot", "text"]


@dataclass(frozen=True)
class Snapshot:
    """Every count at one moment, as plain numbers (no prometheus_client needed).

    transfers: (op, transport, protocol, direct, staged, memory) -> (transfers, bytes)
    peers_opened: (transport, side, passed_over) -> count; peers_open: transport -> count now
    connect_failures: error class name -> count; refusals: kind -> count
    """

    transfers: dict[tuple[str, str, str, bool, bool, str], tuple[int, int]] = field(default_factory=dict)
    peers_opened: dict[tuple[str, str, str], int] = field(default_factory=dict)
    peers_open: dict[str, int] = field(default_factory=dict)
    connect_failures: dict[str, int] = field(default_factory=dict)
    refusals: dict[str, int] = field(default_factory=dict)

    def bytes(self, op: str, transport: str | None = None) -> int:
        """Bytes of ``op`` ("send", "recv", "read", "write"), over one transport or all."""
        return sum(n for k, (_, n) in self.transfers.items() if k[0] == op and transport in (None, k[1]))

    def count(self, op: str, transport: str | None = None) -> int:
        """Transfers of ``op``, over one transport or all."""
        return sum(c for k, (c, _) in self.transfers.items() if k[0] == op and transport in (None, k[1]))


def snapshot() -> Snapshot:
    """The counts so far in this process."""
    s = _metrics.snapshot()
    return Snapshot(s["transfers"], s["peers_opened"], s["peers_open"], s["connect_failures"], s["refusals"])


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


class _Collector:
    """Builds the metric families from the counts at each scrape."""

    def describe(self) -> list[Any]:
        return []  # names are fixed; nothing to collect at registration

    def collect(self) -> Iterator[Any]:
        _prometheus()
        from prometheus_client import core
        s = _metrics.snapshot()
        labels = ["op", "transport", "protocol", "direct", "staged", "memory"]
        count = core.CounterMetricFamily("tensorwire_transfers", "Transfers, by how they went.", labels=labels)
        size = core.CounterMetricFamily(
            "tensorwire_transfer_bytes", "Bytes transferred, by how they went.", labels=labels
        )
        for (op, transport, protocol, direct, staged, memory), (n, nbytes) in sorted(s["transfers"].items()):
            values = [op, transport, protocol, _flag(direct), _flag(staged), memory]
            count.add_metric(values, n)
            size.add_metric(values, nbytes)
        yield count
        yield size
        hist = core.HistogramMetricFamily(
            "tensorwire_transfer_seconds", "How long transfers took, as their receipts say.", labels=["op", "transport"]
        )
        for key, counts in sorted(s["seconds"].items()):
            buckets, running = [], 0.0
            for bound, n in zip([*_metrics.BUCKETS, float("inf")], counts[:-1], strict=True):
                running += n
                buckets.append((repr(bound) if bound != float("inf") else "+Inf", running))
            hist.add_metric(list(key), buckets, counts[-1])
        yield hist
        opened = core.CounterMetricFamily(
            "tensorwire_peers_opened", "Peers whose data path opened.", labels=["transport", "side", "passed_over"]
        )
        for key, n in sorted(s["peers_opened"].items()):
            opened.add_metric(list(key), n)
        yield opened
        open_now = core.GaugeMetricFamily("tensorwire_peers_open", "Peers open now.", labels=["transport"])
        for transport, n in sorted(s["peers_open"].items()):
            open_now.add_metric([transport], n)
        yield open_now
        failed = core.CounterMetricFamily(
            "tensorwire_connect_failures", "Node.connect calls that raised.", labels=["error"]
        )
        for name, n in sorted(s["connect_failures"].items()):
            failed.add_metric([name], n)
        yield failed
        refused = core.CounterMetricFamily(
            "tensorwire_refusals", "Requests refused and connections dropped.", labels=["kind"]
        )
        for kind, n in sorted(s["refusals"].items()):
            refused.add_metric([kind], n)
        yield refused


_COLLECTOR = _Collector()
_registered: set[int] = set()
_register_lock = threading.Lock()


def collector() -> Any:
    """tensorwire's collector, to register in a prometheus_client registry of your own."""
    _prometheus()
    return _COLLECTOR


def register(registry: Any = None) -> None:
    """Add tensorwire's metrics to ``registry`` (prometheus_client's default one when None);
    a second call for the same registry does nothing."""
    prometheus = _prometheus()
    registry = prometheus.REGISTRY if registry is None else registry
    with _register_lock:
        if id(registry) not in _registered:
            registry.register(_COLLECTOR)
            _registered.add(id(registry))


def text() -> str:
    """tensorwire's metrics alone, in Prometheus' text format."""
    prometheus = _prometheus()
    registry = prometheus.CollectorRegistry(auto_describe=False)
    registry.register(_COLLECTOR)
    return str(prometheus.generate_latest(registry).decode())


class MetricsServer:
    """An HTTP endpoint serving ``/metrics`` from a thread of its own; close it with
    ``aclose()`` (or ``close()`` outside an event loop), or use it as an async context manager."""

    def __init__(self, httpd: Any, thread: threading.Thread, address: str) -> None:
        self._httpd, self._thread = httpd, thread
        #: where it serves, "host:port" (the port picked where 0 was asked for)
        self.address = address
        self._closed = False

    def __repr__(self) -> str:
        return f"<MetricsServer http://{self.address}/metrics{' closed' if self._closed else ''}>"

    def close(self) -> None:
        """Stop serving; idempotent. Blocks until the server's thread is done (well under a second)."""
        if self._closed:
            return
        self._closed = True
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()

    async def aclose(self) -> None:
        """Stop serving; idempotent, and never blocks the event loop."""
        await asyncio.to_thread(self.close)

    async def __aenter__(self) -> MetricsServer:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


def serve(address: str = "127.0.0.1:0", *, registry: Any = None) -> MetricsServer:
    """Serve ``registry`` (prometheus_client's default one, with tensorwire's metrics
    registered in it, when None) at ``http://address/metrics``. Port 0 picks a free port: read
    ``server.address``. ConfigurationError for a bad address or one that cannot be bound."""
    host, port = _split_address(address)
    prometheus = _prometheus()
    if registry is None:
        register()
        registry = prometheus.REGISTRY
    try:
        httpd, thread = prometheus.start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise ConfigurationError(f"cannot serve metrics at {address}: {exc.strerror or exc}") from exc
    bound = httpd.server_address[1]
    shown = f"[{host}]" if ":" in host else host
    return MetricsServer(httpd, thread, f"{shown}:{bound}")
