"""tensorwire.metrics: what moved and how, counted in every process and served to Prometheus.

The conformance suite checks, over every transport, that each message and one-sided operation
is counted as its receipt says (check_metrics_count_every_transfer_as_its_receipt_says); these
tests check the rest: the peers, failures and refusals, the Prometheus text and its HTTP
endpoint, and the command line's ``--metrics``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _polling import eventually
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

import tensorwire
import tensorwire.metrics as metrics
from tensorwire import _metrics
from tensorwire.testing import connected_pair

pytestmark = pytest.mark.timeout(60)


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _value(text: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    return sum(v for (n, ls), v in _samples(text).items() if n == name and labels.items() <= dict(ls).items())


async def test_prometheus_text_counts_bytes_and_times_of_a_tcp_exchange() -> None:
    async with (
        tensorwire.start("127.0.0.1:0", transports=("tcp",)) as na,
        tensorwire.start("127.0.0.1:0", transports=("tcp",)) as nb,
    ):
        a = await na.connect(nb.address)
        b = await nb.accept()
        before = metrics.text()
        x = np.arange(300_000, dtype=np.float32)
        sent = await a.send(x, tag=1)
        _, received = await b.recv_with_receipt(tag=1)
        after = metrics.text()
    labels = {"transport": "tcp", "protocol": sent.protocol, "direct": "true" if sent.direct else "false"}
    for name, want in (("tensorwire_transfer_bytes_total", x.nbytes), ("tensorwire_transfers_total", 1)):
        got = _value(after, name, op="send", **labels) - _value(before, name, op="send", **labels)
        assert got == want, (name, sent)
    recv = {"transport": "tcp", "protocol": received.protocol, "staged": "false"}
    assert (
        _value(after, "tensorwire_transfer_bytes_total", op="recv", **recv)
        - _value(before, "tensorwire_transfer_bytes_total", op="recv", **recv)
        == x.nbytes
    )
    # the histogram: one more observation, its sum grown by the receipt's seconds, its buckets
    # cumulative up to +Inf (which equals the count)
    hist = {"op": "send", "transport": "tcp"}
    count = _value(after, "tensorwire_transfer_seconds_count", **hist) - _value(
        before, "tensorwire_transfer_seconds_count", **hist
    )
    assert count == 1
    grown = _value(after, "tensorwire_transfer_seconds_sum", **hist) - _value(
        before, "tensorwire_transfer_seconds_sum", **hist
    )
    assert grown == pytest.approx(sent.seconds)
    buckets = sorted(
        (float(dict(ls)["le"]), v)
        for (n, ls), v in _samples(after).items()
        if n == "tensorwire_transfer_seconds_bucket" and dict(ls)["op"] == "send" and dict(ls)["transport"] == "tcp"
    )
    assert [v for _, v in buckets] == sorted(v for _, v in buckets), buckets
    assert buckets[-1] == (float("inf"), _value(after, "tensorwire_transfer_seconds_count", **hist))
    first = next(v for le, v in buckets if le >= sent.seconds)
    last_below = max((v for le, v in buckets if le < sent.seconds), default=0.0)
    assert first > last_below or first == buckets[-1][1]


async def test_traffic_tells_the_users_messages_from_rpc_and_one_sided_and_recvs_are_not_timed() -> None:
    """``traffic`` separates what send/recv moved for the user from what tensorwire's own layers
    moved as messages (an rpc call's request and reply, an owner-assisted read's request and
    reply); and a recv is not in the time histogram: the rpc server's request loop had waited
    for its request for as long as the node was idle, and that wait was observed as a recv's
    time (a 1 ms call after 3 s idle added 3 s)."""

    async def echo(x: np.ndarray) -> np.ndarray:
        return x

    x = np.arange(1000, dtype=np.float64)
    async with (
        tensorwire.start("127.0.0.1:0", transports=("tcp",)) as na,
        tensorwire.start("127.0.0.1:0", transports=("tcp",)) as nb,
    ):
        nb.methods.register(echo)
        nb.expose(x, name="x")
        a = await na.connect(nb.address)
        b = await nb.accept()
        await asyncio.sleep(0.5)  # idle: the request loop waits
        before = metrics.snapshot()
        await a.send(x, tag=1)
        await b.recv(tag=1)
        await a.call("echo", x)
        h = await a.lookup("x")
        assert not h.direct  # tcp: owner-assisted
        await a.read(h)
        empty = await a.read_many_with_receipt([])  # nothing moves: nothing counted
        await asyncio.sleep(0.1)  # the owner's reply send completes
        after = metrics.snapshot()
    assert empty[1].nbytes == 0
    for op in ("send", "recv"):
        assert after.bytes(op, "tcp", "messages") - before.bytes(op, "tcp", "messages") == x.nbytes, op
        assert after.bytes(op, "tcp", "rpc") - before.bytes(op, "tcp", "rpc") >= 2 * x.nbytes, op
        assert after.bytes(op, "tcp", "one-sided") - before.bytes(op, "tcp", "one-sided") >= x.nbytes, op
    assert after.count("read") - before.count("read") == 1
    assert after.bytes("read", traffic="one-sided") - before.bytes("read", traffic="one-sided") == x.nbytes
    assert not [k for k in after.seconds if k[0] == "recv"], after.seconds
    sends, seconds = after.seconds[("send", "tcp")]
    assert sends - before.seconds[("send", "tcp")][0] == after.count("send", "tcp") - before.count("send", "tcp")
    assert seconds - before.seconds[("send", "tcp")][1] < 0.5, "a send's time holds no idle wait"


async def test_peers_opened_name_the_transports_passed_over_and_the_open_gauge_follows() -> None:
    """A fallback shows in the count: verbs is preferred and has no device here, so tcp is taken
    and ``passed_over`` says "verbs"; the open gauge goes up while the peers are open and back
    down once they close."""
    prefer = ("verbs", "tcp")
    start = metrics.snapshot()
    async with (
        tensorwire.start("127.0.0.1:0", transports=prefer) as na,
        tensorwire.start("127.0.0.1:0", transports=prefer) as nb,
    ):
        if "verbs" in na.offers:
            pytest.skip("this machine has an RDMA device: verbs is not passed over")
        a = await na.connect(nb.address)
        await nb.accept()
        assert [name for name, _ in a.path.passed_over] == ["verbs"], a.path
        during = metrics.snapshot()
        await a.aclose()
    end = metrics.snapshot()
    for side in ("connect", "accept"):
        key = ("tcp", side, "verbs")
        assert during.peers_opened.get(key, 0) - start.peers_opened.get(key, 0) == 1, during.peers_opened
    assert during.peers_open.get("tcp", 0) - start.peers_open.get("tcp", 0) == 2
    assert end.peers_open.get("tcp", 0) == start.peers_open.get("tcp", 0)
    # the gauge says 0 once the last peer closed (it vanished, so an alert on == 0 never fired)
    assert end.peers_open["tcp"] == 0
    assert 'tensorwire_peers_open{transport="tcp"} 0.0' in metrics.text()


async def test_transport_names_a_peer_makes_up_cannot_grow_the_label_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """A client's preference order reaches the server whole, and the names it passes over come
    back in the reply; each name a peer made up was a new ``passed_over`` value on both sides,
    kept for ever (one per connect from a client that changes it, each up to 32 names of 64
    characters). Names tensorwire does not know count as "other"."""
    # a client of another build, or a hostile one: it sends names this one does not know
    monkeypatch.setattr("tensorwire._node._check_transports", lambda names: tuple(names))
    before = metrics.snapshot().peers_opened
    async with (
        tensorwire.start("127.0.0.1:0", transports=("tcp",)) as client,
        tensorwire.start("127.0.0.1:0", transports=("tcp",)) as server,
    ):
        for i in range(5):
            peer = await client.connect(server.address, transports=(f'made-up "{i}"\\\n', "verbs", f"x{i}", "tcp"))
            assert [name for name, _ in peer.path.passed_over] == [f'made-up "{i}"\\\n', "verbs", f"x{i}"]
            await peer.aclose()
    after = metrics.snapshot().peers_opened
    grown = {key: n - before.get(key, 0) for key, n in after.items() if n != before.get(key, 0)}
    assert grown == {("tcp", "connect", "other,verbs"): 5, ("tcp", "accept", "other,verbs"): 5}, grown
    assert "made-up" not in metrics.text()


async def test_failed_connects_and_refused_handshakes_are_counted() -> None:
    with socket.socket() as s:  # a port with nothing behind it
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    before = metrics.snapshot()
    async with (
        tensorwire.start("127.0.0.1:0", auth_token="right", transports=("tcp",)) as guarded,
        tensorwire.start("127.0.0.1:0", auth_token="wrong", transports=("tcp",)) as intruder,
    ):
        with pytest.raises(tensorwire.AuthenticationError):
            await intruder.connect(guarded.address)
        with pytest.raises(tensorwire.TensorWireError, match="cannot reach") as failed:
            await intruder.connect(dead, connect_timeout=5)
    after = metrics.snapshot()
    for name in ("AuthenticationError", type(failed.value).__name__):
        assert after.connect_failures.get(name, 0) - before.connect_failures.get(name, 0) == 1, after
    assert after.refusals.get("control", 0) - before.refusals.get("control", 0) == 1, after.refusals


async def test_a_handshake_refused_for_require_is_counted_as_a_refusal() -> None:
    """A handshake the server refuses because it cannot meet the client's ``require=`` (or it
    and the client share no transport) is a refused request like a wrong token: it was only
    logged, at info, and ``tensorwire_refusals_total{kind="control"}`` did not move."""
    import grpc

    from tensorwire.control import PROTOCOL_VERSION
    from tensorwire.control._pb import control_pb2, control_pb2_grpc

    async with tensorwire.start("127.0.0.1:0", transports=("tcp",)) as node:
        if node.offers["tcp"].capabilities.rdma:
            pytest.skip("this node's tcp meets require='rdma'")
        before = metrics.snapshot().refusals.get("control", 0)
        async with grpc.aio.insecure_channel(node.address) as ch:
            stub = control_pb2_grpc.ControlStub(ch)
            for require, offered in (("rdma", "tcp"), ("any", "made-up")):
                req = control_pb2.HandshakeRequest(
                    protocol_version=PROTOCOL_VERSION, node_id="x", require=require, preference=[offered]
                )
                req.offers.add(name=offered, version=node.offers["tcp"].version, address=node.offers["tcp"].address)
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.Handshake(req, timeout=5)
                assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION, info.value
        assert metrics.snapshot().refusals.get("control", 0) - before == 2


async def test_one_set_of_transports_passed_over_is_one_label_value(monkeypatch: pytest.MonkeyPatch) -> None:
    """``passed_over`` joined the names in the order of the connect's preference, so the same
    fallback counted under two label values ("inproc,other" and "other,inproc") by the order a
    client happened to give: a query for one missed the other, and orders multiply the series a
    client can make. The names are sorted now."""
    monkeypatch.setattr("tensorwire._node._check_transports", lambda names: tuple(names))
    before = metrics.snapshot().peers_opened
    async with (
        tensorwire.start("127.0.0.1:0", transports=("inproc", "tcp")) as client,
        tensorwire.start("127.0.0.1:0", transports=("tcp",)) as server,
    ):
        for order in (("inproc", "made-up", "tcp"), ("made-up", "inproc", "tcp")):
            peer = await client.connect(server.address, transports=order)
            assert [name for name, _ in peer.path.passed_over] == list(order[:2])
            await peer.aclose()
    after = metrics.snapshot().peers_opened
    grown = {key: n - before.get(key, 0) for key, n in after.items() if n != before.get(key, 0)}
    assert grown == {("tcp", "connect", "inproc,other"): 2, ("tcp", "accept", "inproc,other"): 2}, grown


def test_a_connect_failure_is_counted_by_its_public_error_class() -> None:
    """A connect to a node cancelling its calls as it closes raises the control client's private
    NodeClosing, a ControlPlaneError: counted by that name, it made a label value that names
    no class a user can catch."""
    from tensorwire import _metrics
    from tensorwire.control._client import NodeClosing

    before = metrics.snapshot().connect_failures
    _metrics.connect_failed(NodeClosing("the tensorwire node at 127.0.0.1:5000 cancelled the call"))
    after = metrics.snapshot().connect_failures
    assert after.get("ControlPlaneError", 0) - before.get("ControlPlaneError", 0) == 1, after
    assert "NodeClosing" not in after


async def test_a_cancelled_connect_is_not_a_failure() -> None:
    async with tensorwire.start("127.0.0.1:0", transports=("tcp",)) as node:
        with socket.socket() as s:  # accepts TCP and never answers: the handshake hangs
            s.bind(("127.0.0.1", 0))
            s.listen()
            before = metrics.snapshot()
            task = asyncio.ensure_future(node.connect(f"127.0.0.1:{s.getsockname()[1]}", connect_timeout=30))
            await asyncio.sleep(0.3)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
    assert metrics.snapshot().connect_failures == before.connect_failures


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return str(response.read().decode())


def test_register_goes_by_the_registry_itself() -> None:
    """A second register does nothing; one after an unregister registers again (registrations
    were remembered by id(), so a new registry at a dead one's address got nothing, and one
    unregistered by hand stayed without); a registry with a metric of the same name refuses."""
    from prometheus_client import Counter, generate_latest

    registry = CollectorRegistry()
    metrics.register(registry)
    metrics.register(registry)
    assert b"# TYPE tensorwire_transfers_total counter" in generate_latest(registry)
    registry.unregister(metrics.collector())
    assert b"tensorwire_" not in generate_latest(registry)
    metrics.register(registry)
    assert b"# TYPE tensorwire_transfers_total counter" in generate_latest(registry)
    clash = CollectorRegistry()
    Counter("tensorwire_transfers", "someone else's", registry=clash)
    with pytest.raises(tensorwire.ConfigurationError, match="cannot register tensorwire's metrics"):
        metrics.register(clash)


async def test_metrics_served_over_http_and_closed_once() -> None:
    registry = CollectorRegistry()
    async with metrics.serve("127.0.0.1:0", registry=registry) as server:
        metrics.register(registry)
        metrics.register(registry)  # a second time does nothing (the registry would refuse it)
        host, port = server.address.rsplit(":", 1)
        body = await asyncio.to_thread(_get, f"http://{server.address}/metrics")
        assert "# TYPE tensorwire_transfers_total counter" in body
        assert "# TYPE tensorwire_peers_open gauge" in body
        # a filtered scrape finds tensorwire's families by name (describe() named none)
        only = await asyncio.to_thread(_get, f"http://{server.address}/metrics?name[]=tensorwire_peers_open")
        assert "# TYPE tensorwire_peers_open gauge" in only and "tensorwire_transfers_total" not in only, only
        # the port is taken while it serves
        with socket.socket() as s, pytest.raises(OSError, match="in use"):
            s.bind((host, int(port)))
        with pytest.raises(tensorwire.ConfigurationError, match="cannot serve metrics"):
            metrics.serve(server.address, registry=registry)
    await asyncio.gather(server.aclose(), server.aclose())  # idempotent; the second waits for the first
    assert "closed" in repr(server)
    with socket.socket() as s:  # and free once it closed
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, int(port)))


def _server_side(port: int) -> int:
    """This process's connections accepted at ``port`` (its local end there), any state but LISTEN."""
    from _procfs import _our_sockets, _port

    return sum(1 for cols in _our_sockets() if cols[3] != "0A" and _port(cols[1]) == port)


def test_connections_that_never_ask_are_dropped_and_none_outlives_the_server(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """The endpoint served each connection on a thread of its own for as long as the client
    kept it, whether it asked for anything or not: 5 idle connections held 5 threads, and all 5
    stayed open, with their threads, after ``close()`` (until their clients let go). An idle
    connection is dropped after ``IDLE_SECONDS`` now, quietly, and ``close()`` ends those left."""
    monkeypatch.setattr(metrics, "IDLE_SECONDS", 1.0)
    server = metrics.serve("127.0.0.1:0", registry=CollectorRegistry())
    port = int(server.address.rpartition(":")[2])
    try:
        idle = socket.create_connection(("127.0.0.1", port), timeout=10)
        with idle:
            assert idle.recv(1) == b"", "the idle connection was not dropped"
        monkeypatch.setattr(metrics, "IDLE_SECONDS", 60.0)
        held = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(5)]
        try:
            for _ in range(500):
                if _server_side(port) == 5:
                    break
                threading.Event().wait(0.01)
            assert _server_side(port) == 5
            assert "tensorwire_" not in _get(f"http://{server.address}/metrics")  # (it still serves)
            server.close()
            for _ in range(500):
                if _server_side(port) == 0:
                    break
                threading.Event().wait(0.01)
            assert _server_side(port) == 0, f"{_server_side(port)} of 5 connections outlived the server"
            for sock in held:
                assert sock.recv(1) == b""
        finally:
            for sock in held:
                sock.close()
    finally:
        server.close()
    assert "Traceback" not in capfd.readouterr().err


@pytest.mark.parametrize("address", ["nohost", "127.0.0.1:99999", "[::1]", 5])
def test_a_bad_metrics_address_is_a_configuration_error(address: object) -> None:
    with pytest.raises(tensorwire.ConfigurationError):
        metrics.serve(address)  # type: ignore[arg-type]


def test_without_prometheus_client_snapshot_works_and_the_rest_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import fails as if not installed
    assert isinstance(metrics.snapshot(), metrics.Snapshot)
    for call in (metrics.text, metrics.register, metrics.collector, lambda: metrics.serve("127.0.0.1:0")):
        with pytest.raises(tensorwire.ConfigurationError, match=r"tensorwire\[metrics\]"):
            call()


def test_counts_from_many_threads_are_not_lost() -> None:
    """Nodes may run on event loops in several threads: their counts add up exactly."""
    key = ("send", "messages", "thread-test", "eager", True, False, "host")
    before = metrics.snapshot().transfers.get(key, (0, 0))

    def count() -> None:
        for _ in range(20_000):
            _metrics.moved(*key, 3, 1e-4)

    threads = [threading.Thread(target=count) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after = metrics.snapshot().transfers[key]
    assert (after[0] - before[0], after[1] - before[1]) == (80_000, 240_000)


def test_threads_that_ended_leave_their_counts_and_nothing_else() -> None:
    """Each thread that counts has a tally of its own; one that ends leaves its counts to the
    others' sum, not its tally in the list a scrape reads (that list grew by one for every
    thread a program ever ran a loop in)."""

    async def job() -> None:
        async with connected_pair("inproc") as (a, b):
            await a.send(np.zeros(100, np.uint8), tag="job")
            await b.recv(tag="job")

    before, tallies = metrics.snapshot(), len(_metrics._tallies)
    for _ in range(6):  # one job after another, each on a new thread with its own loop
        thread = threading.Thread(target=asyncio.run, args=(job(),))
        thread.start()
        thread.join()
    after = metrics.snapshot()
    assert len(_metrics._tallies) == tallies  # (a thread's local storage goes before join() returns)
    for op in ("send", "recv"):
        assert after.count(op, "inproc", "messages") - before.count(op, "inproc", "messages") == 6
        assert after.bytes(op, "inproc", "messages") - before.bytes(op, "inproc", "messages") == 600


async def test_a_scrape_takes_no_lock_a_counting_loop_waits_on() -> None:
    """A loop that counts a peer, a failed connect or a refusal takes the metrics' lock; a
    scrape, in a thread of its own, copies what it reads without it. (One that held it while it
    built its copies could lose the interpreter lock meanwhile, and the loop then waited for every
    other thread's turn: 307 waits of 1-36 ms in 20 s of back-to-back scrapes.) Here the lock is
    held as a loop holds it, and scrapes of every kind still finish."""
    async with connected_pair("tcp"):
        with _metrics._lock:
            scrapes = [asyncio.create_task(asyncio.to_thread(scrape)) for scrape in (metrics.snapshot, metrics.text)]
            done, _ = await asyncio.wait(scrapes, timeout=20)
            assert len(done) == 2, "a scrape waited for the lock the counting threads take"
        await asyncio.gather(*scrapes)
        assert metrics.snapshot().peers_open["tcp"] >= 2


def test_a_scrape_copies_a_tally_whole_while_its_thread_adds_to_it() -> None:
    """On Python 3.11 a garbage collection starts at an allocation, and runs Python code (the
    finalizers and weak references' callbacks of what it collects), where another thread may
    take its turn: one inside ``list(tally.items())``, whose tuples are such allocations, let
    the counting thread add a key, and the scrape failed with RuntimeError (dictionary changed
    size during iteration). Here each collection inside a scrape adds a key to a large tally,
    as that thread would. (Python 3.12 collects only between instructions: it passes there.)"""
    import gc

    ready, finish = threading.Event(), threading.Event()
    tally: dict[Any, list[Any]] = {}

    def counting() -> None:  # a thread that counts, and then waits while the scrape runs
        _metrics.moved("send", "messages", "gc-test", "eager", True, False, "host", 1, 1e-4)
        # keys past the free list of tuples, so that a copy of their items allocates
        tally.update({("send", "messages", f"gc-{i}", "eager", True, False, "host"): [0] * 17 for i in range(3000)})
        _metrics._local.tally.update(tally)
        ready.set()
        finish.wait(30)

    thread = threading.Thread(target=counting)
    thread.start()
    assert ready.wait(30)
    mine = next(t for t in _metrics._tallies if next(iter(tally)) in t)
    added = []

    def during_scrape(phase: str, _: object) -> None:
        frame = sys._getframe(1)
        if phase == "start" and frame.f_code is _metrics.snapshot.__code__:
            key = ("send", "messages", f"gc-added-{len(added)}", "eager", True, False, "host")
            mine[key] = [0] * 17
            added.append(key)

    threshold = gc.get_threshold()
    gc.callbacks.append(during_scrape)
    gc.set_threshold(1)
    try:
        s = _metrics.snapshot()
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(during_scrape)
        for key in [*tally, *added]:  # (no label values of this test's left behind)
            mine.pop(key, None)
        finish.set()
        thread.join()
    assert s["transfers"][("send", "messages", "gc-test", "eager", True, False, "host")][0] >= 1


def test_a_scrape_sees_all_of_a_transfer_or_none_of_it() -> None:
    """A scrape may take its turn wherever the counting thread calls something. Where counting
    a send called for its bucket after adding its count, bytes and seconds, a scrape there saw a
    send counted, a histogram without it and a seconds sum with it (0 observations summing to
    more than 0 s). Here a scrape runs at every call the counting makes."""
    key = ("send", "messages", "torn-test", "eager", True, False, "host")
    seen: list[tuple[int, int, int, float]] = []

    def scrape(frame: Any, event: str, _: object) -> None:
        if event in ("call", "c_call") and frame.f_code is _metrics.moved.__code__:
            sys.setprofile(None)  # (the scrape's own calls are not the counting's)
            s = _metrics.snapshot()
            count, nbytes = s["transfers"].get(key, (0, 0))
            hist = s["seconds"].get(("send", "torn-test"), [0] * (len(_metrics.BUCKETS) + 1) + [0.0])
            seen.append((count, nbytes, int(sum(hist[:-1])), hist[-1]))
            sys.setprofile(scrape)

    for _ in range(2):
        sys.setprofile(scrape)
        try:
            _metrics.moved(*key, 5, 0.25)
        finally:
            sys.setprofile(None)
    assert seen, "no call inside the counting to scrape at"
    for count, nbytes, observed, total in seen:
        assert (nbytes, observed, total) == (5 * count, count, 0.25 * count), seen


_PART = """
from tensorwire.pipeline import FunctionPart


class Same:
    def forward(self, x):
        return x, None

    def backward(self, ctx, grad):
        return grad


def build(rank, num_stages):
    return FunctionPart(Same())
"""


@contextlib.contextmanager
def _started(argv: list[str]) -> Iterator[tuple[str, str]]:
    """A ``tensorwire`` command with ``--metrics 127.0.0.1:0``: (metrics URL, address it serves at)."""
    with subprocess.Popen(
        [sys.executable, "-m", "tensorwire.cli", *argv, "--metrics", "127.0.0.1:0", "--parent", str(os.getpid())],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    ) as proc:  # fmt: skip
        try:
            assert proc.stdout is not None
            first, second = proc.stdout.readline(), proc.stdout.readline()
            # where the metrics are comes first, then the serving line scripts look for
            assert first.startswith("tensorwire metrics at http://127.0.0.1:"), (first, second)
            assert " serving at " in second, (first, second)
            yield first.split()[-1], second.split()[-1]
        finally:
            proc.terminate()
            _, err = proc.communicate(timeout=30)
    assert proc.returncode in (0, 143, -15), err


def test_serve_metrics_flag_serves_them_beside_the_node() -> None:
    """``tensorwire serve --metrics 127.0.0.1:0``: the endpoint counts what an echo through the
    node moved."""
    with _started(["serve", "--echo", "0", "--transports", "tcp"]) as (url, node_address):

        async def echo() -> None:
            async with tensorwire.start("127.0.0.1:0", transports=("tcp",)) as node:
                peer = await node.connect(node_address)
                await peer.send(np.ones(1000, np.float64), tag=0)
                await peer.recv(tag=0)

        asyncio.run(echo())
        body = _get(url)
    assert _value(body, "tensorwire_transfer_bytes_total", op="recv", transport="tcp") == 8000, body
    assert _value(body, "tensorwire_transfer_bytes_total", op="send", transport="tcp") == 8000, body
    assert _value(body, "tensorwire_peers_opened_total", side="accept") == 1, body


def test_inproc_passed_over_for_a_peer_in_another_process_is_no_fallback() -> None:
    """inproc comes first in the default order and never carries a peer in another process:
    the path says it was passed over, but the count does not call that a fallback, whether the
    client offered inproc or not. Every peer between two processes was counted with
    ``passed_over="inproc"``, so the dashboard's ``passed_over!=""`` (peers that fell back)
    matched all of them. Between two nodes of one process it still counts."""
    with _started(["serve", "--transports", "inproc", "tcp"]) as (url, node_address):

        async def connect() -> tuple[list[tensorwire.Path], dict[tuple[str, str, str], int]]:
            before = metrics.snapshot().peers_opened
            paths = []
            for offered in (("inproc", "tcp"), ("tcp",)):
                async with tensorwire.start("127.0.0.1:0", transports=offered) as node:
                    peer = await node.connect(node_address)
                    paths.append(peer.path)
                    await peer.aclose()
            # two nodes of this process: inproc passed over there is a choice, and counts
            async with (
                tensorwire.start("127.0.0.1:0", transports=("tcp",)) as client,
                tensorwire.start("127.0.0.1:0", transports=("inproc", "tcp")) as server,
            ):
                await client.connect(server.address)
                paths.append((await server.accept()).path)
            after = metrics.snapshot().peers_opened
            return paths, {key: n - before.get(key, 0) for key, n in after.items() if n != before.get(key, 0)}

        paths, grown = asyncio.run(connect())
        body = _get(url)
    assert [p.transport for p in paths] == ["tcp"] * 3
    # the paths still say so; the first: "peer is in another process"
    assert [[name for name, _ in p.passed_over] for p in paths] == [["inproc"], [], ["inproc"]], paths
    assert grown == {("tcp", "connect", ""): 3, ("tcp", "accept", "inproc"): 1}, grown
    assert _value(body, "tensorwire_peers_opened_total", side="accept", passed_over="") == 2, body


def test_a_peer_in_another_process_named_like_a_node_of_this_one_is_no_fallback() -> None:
    """Whether inproc passed over counts is decided by the remote node's instance id: by its
    node id, a peer in another process whose node shares the name of a node of this one (both
    named after their host, in containers) was counted as an inproc fallback."""
    with _started(["serve", "--transports", "inproc", "tcp"]) as (_, node_address):

        async def connect() -> dict[tuple[str, str, str], int]:
            async with tensorwire.start("127.0.0.1:0", transports=("tcp",)) as probe:
                name = (await probe.connect(node_address)).remote_node
            before = metrics.snapshot().peers_opened
            async with (
                tensorwire.start("127.0.0.1:0", transports=("tcp",), node_id=name),  # (a namesake here)
                tensorwire.start("127.0.0.1:0", transports=("inproc", "tcp")) as client,
            ):
                peer = await client.connect(node_address)
                assert [n for n, _ in peer.path.passed_over] == ["inproc"], peer.path
                await peer.aclose()
            after = metrics.snapshot().peers_opened
            return {key: n - before.get(key, 0) for key, n in after.items() if n != before.get(key, 0)}

        grown = asyncio.run(connect())
    assert grown == {("tcp", "connect", ""): 1}, grown


def test_stage_metrics_flag_serves_them_beside_the_stage(tmp_path: Path) -> None:
    (tmp_path / "part.py").write_text(_PART)
    with _started(["stage", "--part", f"{tmp_path / 'part.py'}:build", "--transports", "tcp"]) as (url, _):
        body = _get(url)
    assert "# TYPE tensorwire_transfers_total counter" in body, body
    assert "# TYPE process_resident_memory_bytes gauge" in body, "the default registry's own metrics"


def test_the_cost_benchmark_runs_and_prints_its_table() -> None:
    """benchmarks/metrics_cost.py, briefly: it measures counted and uncounted round trips in one
    run and restores the counting it swapped out."""
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run(
        [sys.executable, "benchmarks/metrics_cost.py", "--transports", "inproc", "tcp",
         "--trips", "50", "--rounds", "2"],
        cwd=root, capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines() if line.split()[:1] in (["inproc"], ["tcp"])]
    assert [r[0] for r in rows] == ["inproc", "tcp"], out.stdout
    assert all(float(r[1]) > 0 and float(r[2]) > 0 and r[3].endswith("x") for r in rows), out.stdout


def test_each_layers_tags_are_its_traffic_and_lie_in_the_reserved_range() -> None:
    from tensorwire._bench import _wire
    from tensorwire._onesided import _OPS_TAG, _tags
    from tensorwire._peer import RESERVED_TAGS, tag_id
    from tensorwire.pipeline._stage import ABORT_TAG, HELLO_TAG, message_tag
    from tensorwire.rpc._protocol import CONTROL_TAG, REQUEST_TAG, args_tag, reply_tag

    reply, payload = _tags()
    cases = [
        (REQUEST_TAG, "rpc"), (CONTROL_TAG, "rpc"), (reply_tag(1), "rpc"), (args_tag(10**9), "rpc"),
        (_OPS_TAG, "one-sided"), (reply, "one-sided"), (payload, "one-sided"),
        (_wire.REQUEST_TAG, "bench"), (_wire.DATA_TAG, "bench"), (_wire.PONG_TAG, "bench"),
        (ABORT_TAG, "pipeline"), (HELLO_TAG, "pipeline"), (tag_id(message_tag(0, "f", 0)), "messages"),
        (0, "messages"), (tag_id("act"), "messages"),
        (RESERVED_TAGS.start - 1, "messages"), (2**63 - 1, "messages"), (-(2**63), "messages"),
    ]  # fmt: skip
    assert [(tag, _metrics.traffic_of(tag)) for tag, _ in cases] == cases
    for tags, name in _metrics._traffic:
        assert RESERVED_TAGS.start <= tags.start and tags.stop <= RESERVED_TAGS.stop, (name, tags)


async def test_counting_transfers_can_be_switched_off_and_on() -> None:
    async with (
        tensorwire.start("127.0.0.1:0", transports=("tcp",)) as na,
        tensorwire.start("127.0.0.1:0", transports=("tcp",)) as nb,
    ):
        a = await na.connect(nb.address)
        b = await nb.accept()
        try:
            metrics.count_transfers(False)
            before = metrics.snapshot()
            await a.send(np.ones(10), tag=1)
            await b.recv(tag=1)
            assert metrics.snapshot().transfers == before.transfers
        finally:
            metrics.count_transfers(True)
        await a.send(np.ones(10), tag=1)
        await b.recv(tag=1)
        after = metrics.snapshot()
    assert after.bytes("send", "tcp", "messages") - before.bytes("send", "tcp", "messages") == 80


BAD_QUERIES = [
    (("sned",), "op must be one of send, recv, read, write, not 'sned'"),  # was 0 however much moved
    ((None,), "op must be one of"),
    (("send", 5), "transport must be a transport's name"),
    (("send", "tcp", "message"), "traffic must be one of messages, rpc, one-sided, pipeline, bench"),
]


@pytest.mark.parametrize(("args", "said"), BAD_QUERIES, ids=[repr(a) for a, _ in BAD_QUERIES])
def test_a_snapshot_query_that_could_match_nothing_is_refused(args: tuple[Any, ...], said: str) -> None:
    snap = metrics.snapshot()
    for query in (snap.bytes, snap.count):
        with pytest.raises(tensorwire.ConfigurationError, match=re.escape(said)):
            query(*args)
    with pytest.raises(tensorwire.ArgumentError, match=r"Snapshot.bytes\(\): missing a required argument: 'op'"):
        snap.bytes()  # type: ignore[call-arg]


def test_a_layer_that_loads_while_messages_are_counted_leaves_the_others_traffic_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A layer says which tags are its traffic as it loads, which may be while a loop in another
    thread counts messages: that loop may take its turn at any call in it. Where the list was
    sorted in place, it was empty meanwhile, and an rpc request counted then was "messages"."""
    from tensorwire._peer import RESERVED_TAGS
    from tensorwire.rpc._protocol import REQUEST_TAG

    monkeypatch.setattr(_metrics, "_traffic", list(_metrics._traffic))
    monkeypatch.setattr(_metrics, "_reserved", _metrics._reserved)
    seen: list[str] = []

    def count(frame: Any, event: str, _: object) -> None:
        if event in ("call", "c_call"):
            sys.setprofile(None)
            seen.append(_metrics.traffic_of(REQUEST_TAG))
            sys.setprofile(count)

    sys.setprofile(count)
    try:
        _metrics.traffic_tags(range(RESERVED_TAGS.start, RESERVED_TAGS.start + 1), "late")
    finally:
        sys.setprofile(None)
    assert seen and set(seen) == {"rpc"}, seen
    assert _metrics.traffic_of(RESERVED_TAGS.start) == "late"


def test_every_kind_of_traffic_a_layer_counts_can_be_asked_for() -> None:
    # each layer names its traffic as it loads
    import tensorwire._bench
    import tensorwire.pipeline  # noqa: F401

    assert {name for _, name in _metrics._traffic} | {"messages"} == set(metrics._TRAFFIC)
    assert metrics.snapshot().bytes("read", "tcp", "one-sided") >= 0


@pytest.mark.parametrize("switch", ["no", None, 0, 1])
def test_count_transfers_takes_true_or_false_only(switch: object) -> None:
    """``count_transfers("no")`` switched counting on, ``count_transfers(None)`` off."""
    with pytest.raises(tensorwire.ConfigurationError, match=r"count_transfers\(on\) must be True or False"):
        metrics.count_transfers(switch)  # type: ignore[arg-type]
    assert _metrics.moved is not _metrics._not_counted  # still counting


@pytest.mark.parametrize("registry", [5, "default", object()])
def test_what_is_no_registry_is_refused_where_it_is_given(registry: object) -> None:
    """``register(5)`` was an AttributeError; ``serve(registry=5)`` served, and every scrape
    failed in the server's thread."""
    with pytest.raises(tensorwire.ConfigurationError, match=r"registry must be a prometheus_client\.CollectorRegistry"):
        metrics.register(registry)
    with pytest.raises(tensorwire.ConfigurationError, match=r"registry must be a prometheus_client\.CollectorRegistry"):
        metrics.serve("127.0.0.1:0", registry=registry)


async def test_a_gone_peer_dropped_unaccepted_counts_under_a_documented_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    """A node that never called accept() drops the oldest gone peer of its accept queue past
    ``Node.MAX_DEPARTED``, with its messages, and counts it in ``tensorwire_refusals_total``
    as kind "accept"; the metrics' docs said a kind is "control" or a data transport's name,
    so a dashboard written from them never looked for the messages dropped that way."""
    monkeypatch.setattr(tensorwire.Node, "MAX_DEPARTED", 0)
    before = metrics.snapshot().refusals
    async with (
        tensorwire.start("127.0.0.1:0", transports=("tcp",)) as server,
        tensorwire.start("127.0.0.1:0", transports=("tcp",)) as client,
    ):
        peer = await client.connect(server.address)
        await peer.send(np.ones(4), tag="left")
        await peer.aclose()
        await eventually(lambda: metrics.snapshot().refusals.get("accept", 0) > before.get("accept", 0))
    doc = metrics.__doc__ or ""
    refusals = doc[doc.index("tensorwire_refusals_total") :].split("\n- ", 1)[0]
    assert '"accept"' in refusals, refusals
