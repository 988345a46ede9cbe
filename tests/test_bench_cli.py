"""`tensorwire bench` as a user runs it: a local run (the node it measures is a `serve --bench`
child it starts), a run against a `serve --bench` started elsewhere, a `serve` without --bench
refusing, bad arguments, --json purity, Ctrl-C. The crc32c check is shown to catch a message
that did not land whole, on both contenders, in process. Speed is never asserted: the sizes are
tiny and --seconds short, so that the whole file runs in seconds on two busy cores."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _loopbacks import has_ipv6_loopback
from _polling import eventually

import tensorwire
from tensorwire import _bench
from tensorwire._bench import _client, _server, _wire
from tensorwire.cli import main as cli_main
from tensorwire.memory._cuda import cuda_device_count
from tensorwire.tensors._device import CPU

pytestmark = pytest.mark.timeout(60)

CLI = [sys.executable, "-m", "tensorwire.cli"]
QUICK = ["--sizes", "4K,64K", "--seconds", "0.1", "--transports", "tcp"]


def _bench_cli(*argv: str, timeout: float = 45) -> subprocess.CompletedProcess[str]:
    """`tensorwire bench ARGV` in a process of its own."""
    return subprocess.run([*CLI, "bench", *argv], capture_output=True, text=True, timeout=timeout)


def _bench_here(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """`tensorwire bench ARGV` in this process (no interpreter to start): exit code, stdout, stderr."""
    code = cli_main(["bench", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@contextlib.contextmanager
def _serve(*flags: str, command: tuple[str, ...] = ("serve",)) -> Iterator[str]:
    """`tensorwire serve FLAGS --address 127.0.0.1:0` (or another ``command``) in a process;
    the address it prints."""
    server = subprocess.Popen([*CLI, *command, "--address", "127.0.0.1:0", "--transports", "tcp", *flags],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert server.stdout is not None
        first = server.stdout.readline()
        assert "serving at" in first, first + server.communicate(timeout=10)[1]
        yield first.split()[-1]
        server.send_signal(signal.SIGTERM)
        _, err = server.communicate(timeout=20)
        assert server.returncode == 128 + signal.SIGTERM and "Traceback" not in err, err
    finally:
        if server.returncode is None:
            server.kill()
            server.communicate()


def _check_report(report: dict[str, Any], sizes: list[int], transport: str = "tcp") -> None:
    assert [row["size"] for row in report["rows"]] == sizes
    for row in report["rows"]:
        assert row["gbps"] > 0 and row["raw_tcp_gbps"] > 0, row
        assert row["ratio"] == pytest.approx(row["gbps"] / row["raw_tcp_gbps"])
        assert row["count"] >= 2 and row["raw_tcp_count"] >= 2, row
        assert row["protocol"] in ("eager", "rendezvous", "inline"), row
        assert re.fullmatch(r"0x[0-9a-f]{8}", row["crc32c"]), row
    assert report["verified"] is True
    assert report["path"]["transport"] == transport
    assert report["path"]["text"].startswith(f"{transport} [")
    assert report["latency_us"]["tensorwire"] > 0 and report["latency_us"]["raw_tcp"] > 0


@pytest.mark.timeout(90)
def test_local_bench_prints_the_path_and_a_row_per_size(capsys: pytest.CaptureFixture[str]) -> None:
    code, stdout, stderr = _bench_here(capsys, *QUICK)
    assert code == 0, stdout + stderr
    lines = stdout.splitlines()
    assert re.fullmatch(r"tensorwire bench to 127\.0\.0\.1:\d+ \(a node this run started, pid \d+\), .*", lines[0])
    assert re.fullmatch(r"path: tcp \[tcp x\d+ stream 127\.0\.0\.1:\d+\] \(kernel TCP\).*", lines[1]), lines[1]
    assert lines[2].startswith("baseline: one plain TCP socket between the same two processes")
    assert re.fullmatch(r"8-byte round trip, median of \d+: tensorwire [\d.]+ us, raw TCP [\d.]+ us", lines[3])
    head = lines.index(_client.Report.table_head())
    rows = [line.split() for line in lines[head + 1 : head + 3]]
    assert [r[:2] for r in rows] == [["4", "KiB"], ["64", "KiB"]], stdout
    for r in rows:
        assert float(r[2]) > 0 and float(r[3]) > 0 and r[4].endswith("x") and float(r[4][:-1]) > 0, r
        assert r[5] in ("eager;", "rendezvous;", "inline;") and r[6] == "node:", r  # and how its recvs landed
    assert "every batch verified: the node's crc32c of its last message matched the sender's" in stdout


@pytest.mark.timeout(90)
def test_local_bench_json_is_all_that_stdout_holds() -> None:
    out = _bench_cli(*QUICK, "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(out.stdout)  # nothing else on stdout
    _check_report(report, [4096, 65536])
    assert report["local_peer_pid"] > 0
    assert report["address"].startswith("127.0.0.1:")


@pytest.mark.timeout(90)
@pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="UCX's log comes from the ucx transport")
def test_a_local_bench_whose_node_prints_before_it_serves_still_runs() -> None:
    # UCX logs on file descriptor 1 (UCX_LOG_LEVEL=info here; a UCX_TLS it lacks warns too), so
    # the node it started printed that before its "serving at" line: the bench took the first
    # line for a failure and waited, for ever, for a node that served on to exit
    env = {**os.environ, "UCX_LOG_LEVEL": "info"}
    out = subprocess.run([*CLI, "bench", "--sizes", "4K", "--seconds", "0.1", "--json"],
                         capture_output=True, text=True, timeout=45, env=env)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(out.stdout)
    _check_report(report, [4096], transport=report["path"]["transport"])


@pytest.mark.timeout(90)
@pytest.mark.skipif(
    importlib.util.find_spec("ucxx") is None, reason="ucxx is not installed (pip install 'tensorwire[ucx]')"
)
def test_a_ucx_bench_says_the_route_ucx_named_for_large_messages_and_none_for_small() -> None:
    # ucx receipts name the protocol UCX selected for a payload of 4 MiB or more and the lanes it
    # used (Receipt.route), where the bench said only the path's lanes (all three over shared
    # memory) and tensorwire's protocol ("eager" for a send UCX moved by rendezvous zero-copy)
    sizes = ("--sizes", "4K,8M", "--seconds", "0.1", "--transports", "ucx")
    out = _bench_cli(*sizes, "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(out.stdout)
    _check_report(report, [4096, 8 << 20], transport="ucx")
    small, large = report["rows"]
    assert small["routes"] == [], small  # a 4 KiB send: UCX is not asked, nothing is made up
    assert large["routes"], large
    assert sum(r["sends"] for r in large["routes"]) <= large["count"], large
    endpoint = report["path"]["lanes"]
    for r in large["routes"]:
        assert r["transport"] == "ucx" and r["route"] and r["sends"] > 0, r
        assert r["lanes"] and set(r["lanes"]) <= set(endpoint), (r, endpoint)
        if "cma/memory" in endpoint:  # processes may read each other's memory here
            assert r["lanes"] == ["cma/memory"] and "zero-copy" in r["route"], r
    # the table: a line under the 8 MiB row, aligned with its protocol; none under 4 KiB's
    out = _bench_cli(*sizes)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    head = lines.index(_client.Report.table_head())
    assert lines[head + 1].split()[:2] == ["4", "KiB"] and lines[head + 2].split()[:2] == ["8", "MiB"], out.stdout
    column = lines[head].index("protocol")
    said = re.fullmatch(r"( *)ucx route(?: \(\S+ of sends\))?: (.+) over (\S.*)", lines[head + 3])
    assert said and len(said[1]) == column, out.stdout
    assert set(said[3].split(", ")) <= set(endpoint), out.stdout
    assert "route" not in "\n".join(lines[: head + 3]), out.stdout


@pytest.mark.timeout(90)
def test_bench_against_serve_bench_started_elsewhere(capsys: pytest.CaptureFixture[str]) -> None:
    with _serve("--bench", "--token", "s3cret") as address:
        code, stdout, stderr = _bench_here(capsys, address, "--sizes", "1K", "--seconds", "0.1", "--token", "s3cret",
                                           "--json", "--transports", "tcp")  # fmt: skip
        assert code == 0, stdout + stderr
        report = json.loads(stdout)
        _check_report(report, [1024])
        assert report["address"] == address and report["local_peer_pid"] is None


@pytest.mark.timeout(90)
def test_serve_without_bench_refuses_and_the_client_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    with _serve() as address:
        code, stdout, stderr = _bench_here(capsys, address, "--sizes", "1K", "--seconds", "0.1", "--transports", "tcp")
    assert code == 1, stdout + stderr
    assert stderr.strip() == (
        f"tensorwire: RemoteError: the node at {address} refused the bench: ConfigurationError: "
        "it was started without --bench (start one with `tensorwire serve --bench`)"
    ), stderr
    assert stdout == ""


@pytest.mark.timeout(90)
def test_a_stage_node_is_named_at_once(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A `tensorwire stage` node runs no bench service and left the requests unread: bench
    waited 10 s, then said DeadlineExceeded with a guess. It is now named as what it is, as a
    `serve` without --bench is, from the RPC method such a serve offers and a stage lacks."""
    (tmp_path / "part.py").write_text("def build(rank, num_stages):\n    return rank\n")
    with _serve(command=("stage", "--part", f"{tmp_path / 'part.py'}:build")) as address:
        code, stdout, stderr = _bench_here(capsys, address, "--sizes", "1K", "--seconds", "0.1", "--transports", "tcp")
    assert code == 1, stdout + stderr
    assert stderr.strip() == (
        f"tensorwire: MethodNotFound: the node at {address} runs no bench service: it is not a `tensorwire serve` "
        "(a `tensorwire stage`, or a program of its own?); start one with `tensorwire serve --bench`"
    ), stderr
    assert stdout == ""


@pytest.mark.parametrize(
    ("args", "complaint"),
    [
        (["--sizes", "0"], "argument --sizes: '0': a size is a whole number of bytes from 1 to 1T"),
        (["--sizes", "4Q"], "argument --sizes: '4Q' is not a size such as 4K, 1M, 64M or 4096"),
        (["--sizes", "4K,,1M"], "argument --sizes: '' is not a size"),
        (["--sizes", "2T"], "argument --sizes: '2T': a size is a whole number of bytes from 1 to 1T"),
        (["--sizes", "0.3K"], "a size is a whole number of bytes"),
        (["--seconds", "0"], "argument --seconds: must be above 0 and at most 3600, not 0"),
        (["--seconds", "nan"], "argument --seconds: must be above 0 and at most 3600, not nan"),
        (["--seconds", "soon"], "argument --seconds: not a number: 'soon'"),
        (["--device", "gpu"], "argument --device: unknown device 'gpu'"),
        (["--require", "fast"], "argument --require: invalid choice: 'fast'"),
        # a value that starts with '-' and a digit is a value, not an option (argparse took only a
        # plain negative number for one: these were "expected one argument")
        (["--sizes", "-1K"], "argument --sizes: '-1K' is not a size such as 4K, 1M, 64M or 4096"),
        (["--sizes", "-4K,1M"], "argument --sizes: '-4K' is not a size"),
        (["--seconds", "-1e3"], "argument --seconds: must be above 0 and at most 3600, not -1e3"),
        (["--seconds", "-.5"], "argument --seconds: must be above 0 and at most 3600, not -.5"),
    ],
)
def test_bench_rejects_bad_arguments_with_a_usage_error(
    args: list[str], complaint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as done:
        cli_main(["bench", *args])
    assert done.value.code == 2
    out, err = capsys.readouterr()
    assert complaint in err and out == "", err


def test_a_failed_bench_json_says_why_on_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    # it printed nothing on stdout (only the stderr line), where doctor --json prints its
    # failed connect as JSON: a script that always parses stdout broke
    with socket.socket() as unused:  # a port nothing listens on
        unused.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{unused.getsockname()[1]}"
    code, stdout, stderr = _bench_here(capsys, address, "--sizes", "1K", "--json", "--transports", "tcp")
    assert code == 1, stdout + stderr
    said = json.loads(stdout)
    assert said["address"] == address and said["error"].startswith(
        f"ControlPlaneError: cannot reach a tensorwire node at {address}"
    )
    assert stderr == f"tensorwire: {said['error']}\n"


def test_a_local_bench_gives_its_node_a_token_of_its_own(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # the node it starts serves that run alone: the user's TENSORWIRE_TOKEN (or --token, which
    # is for ADDRESS) was handed to it instead of a random token
    real = asyncio.create_subprocess_exec
    given: list[dict[str, str]] = []

    async def record(*argv: str, **options: Any) -> asyncio.subprocess.Process:
        given.append(options["env"])  # and a child that exits at once: nothing to measure
        return await real(sys.executable, "-c", "pass", stdout=options["stdout"])

    monkeypatch.setattr(asyncio, "create_subprocess_exec", record)
    monkeypatch.setenv("TENSORWIRE_TOKEN", "the-users-token")
    for flags in ([], ["--token", "another"]):
        code, _, stderr = _bench_here(capsys, "--sizes", "1K", *flags)
        assert code == 1 and "the node this bench started (pid" in stderr, stderr
    tokens = [env["TENSORWIRE_TOKEN"] for env in given]
    assert len(tokens) == 2 and all(re.fullmatch(r"[0-9a-f]{32}", t) for t in tokens), tokens
    assert tokens[0] != tokens[1]


def test_an_empty_token_from_the_environment_is_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TENSORWIRE_TOKEN", "")
    with pytest.raises(SystemExit) as done:  # (a bench without ADDRESS takes no token: test_cli)
        cli_main(["bench", "127.0.0.1:1"])
    assert done.value.code == 2 and "TENSORWIRE_TOKEN is empty" in capsys.readouterr().err


def test_sizes_parse_as_binary_units() -> None:
    assert _bench.parse_sizes("4K, 1M,64MiB,1g,512,0.5K,1kb") == [4096, 1 << 20, 64 << 20, 1 << 30, 512, 512, 1024]
    assert [_bench.fmt_size(n) for n in (4096, 1 << 20, 1000, 3 << 30)] == ["4 KiB", "1 MiB", "1000 B", "3 GiB"]


@pytest.mark.skipif(cuda_device_count() > 0, reason="a CUDA device is present here")
def test_bench_on_cuda_without_a_device_says_why_before_it_starts(capsys: pytest.CaptureFixture[str]) -> None:
    code, stdout, stderr = _bench_here(capsys, "--device", "cuda:1", "--sizes", "1K")
    assert code == 1 and stdout == "", stdout + stderr
    assert re.fullmatch(
        r"tensorwire: (UnsupportedTensorError: device 'cuda:1' asked for, but CuPy finds no CUDA device here"
        r"|CudaUnavailableError: moving CUDA tensors needs CuPy.*)\n",
        stderr,
    ), stderr


def _children(pid: int) -> list[int]:
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    kids.append(int(entry.name))
    return kids


def _alive(pid: int) -> bool:
    try:
        return (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]) != "Z"
    except OSError:
        return False


@pytest.mark.timeout(90)
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds processes through /proc")
def test_ctrl_c_ends_a_local_bench_with_130_and_stops_its_node() -> None:
    bench = subprocess.Popen([*CLI, "bench", "--sizes", "1M", "--seconds", "60", "--transports", "tcp"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    assert bench.stdout is not None
    kids: list[int] = []
    try:
        for line in bench.stdout:  # the table's head: the sizes are being measured
            if line.strip().startswith("size"):
                break
        kids = _children(bench.pid)
        assert kids, "no child node"
        time.sleep(0.3)
        bench.send_signal(signal.SIGINT)
        _, err = bench.communicate(timeout=20)
    finally:
        for pid in [bench.pid, *kids]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        bench.communicate()
    assert bench.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    end = time.monotonic() + 10
    while any(map(_alive, kids)) and time.monotonic() < end:
        time.sleep(0.05)
    assert not any(map(_alive, kids)), "the bench left its node running"


# -- in process: the crc check is real, the node's refusals, the baseline's secret ---------------------
@contextlib.asynccontextmanager
async def _pair(enabled: bool = True, **options: Any) -> Any:
    """A client peer connected to a node (``options``) whose peers are served by ``serve_bench``."""
    async with (
        tensorwire.start("127.0.0.1:0", transports=("tcp",), **options) as server,
        tensorwire.start("127.0.0.1:0", transports=("tcp",)) as client,
    ):
        peer = await client.connect(server.address)
        served = await server.accept()
        task = asyncio.ensure_future(_server.serve_bench(served, enabled=enabled))
        try:
            yield peer
        finally:
            await peer.aclose()
            async with asyncio.timeout(10):
                await task  # it ends when its peer goes


async def test_a_message_that_did_not_land_whole_is_caught_by_the_crc(monkeypatch: pytest.MonkeyPatch) -> None:
    receive = _server._receive

    async def last_byte_lost(peer: Any, out: Any, count: int) -> dict[str, int]:
        landed = await receive(peer, out, count)
        out[-1] ^= 0xFF  # as if the last message's tail never arrived
        return landed

    async with _pair() as peer:
        report = await _bench.run_bench(peer, [1000], seconds=0.05)
        assert report.rows[0].size == 1000  # honest: passes
        monkeypatch.setattr(_server, "_receive", last_byte_lost)
        with pytest.raises(tensorwire.IntegrityError, match=r"^tensorwire, 1000 B x1: the node's crc32c"):
            await _bench.run_bench(peer, [1000], seconds=0.05)


async def test_a_stale_buffer_is_caught_by_the_stamp(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every message of a batch carries the same bytes but the last, which is stamped: a node
    whose buffer still held the one before (its last recv lost) answers a crc that differs."""
    receive = _server._receive

    async def last_lost(peer: Any, out: Any, count: int) -> dict[str, int]:
        if count == 1:  # the first batch of a size lands whole: out holds a stamped message
            return await receive(peer, out, count)
        landed = await receive(peer, out, count - 1)
        await peer._recv_own(tag=_wire.DATA_TAG)  # taken, but not into out
        return {**landed, "copied": landed["copied"] + 1}

    async with _pair() as peer:
        monkeypatch.setattr(_server, "_receive", last_lost)
        with pytest.raises(tensorwire.IntegrityError, match=r"^tensorwire, 4 KiB x\d+: .* did not land whole"):
            await _bench.run_bench(peer, [4096], seconds=0.05)


async def test_each_row_says_how_the_nodes_receives_landed() -> None:
    """A row said "eager" (the sender's last receipt) and nothing of the node's side, where a
    message that came before its recv was copied out of a buffer of tensorwire's into the
    node's buffer (staged): `tensorwire bench` over ucx, 16 MiB, the node's own receipts said 97%
    staged while the row said "eager". The node now counts its receipts and the row says so."""
    async with _pair() as peer:
        report = await _bench.run_bench(peer, [4096, 1 << 20], seconds=0.05)
        for row in report.rows:
            assert row.landed is not None and sum(row.landed.values()) == row.count, row
            assert row.to_json()["node_recvs"] == row.landed
            assert "; node: " in _client.Report.row_text(row), row
    # the node's words are its receipts': deterministic cases over tcp
    async with (
        tensorwire.start("127.0.0.1:0", transports=("tcp",)) as a,
        tensorwire.start("127.0.0.1:0", transports=("tcp",)) as b,
    ):
        sender = await b.connect(a.address)
        node = await a.accept()
        small, large = np.zeros(4096, np.uint8), np.zeros(1 << 20, np.uint8)
        for _ in range(3):  # they come before the recv: through a buffer of tensorwire's
            await sender._send_own(small, tag=_wire.DATA_TAG)
        await eventually(lambda: _queued(node, 3))
        assert await _server._receive(node, np.empty_like(small), 3) == {"direct": 0, "staged": 3, "copied": 0}
        for x, how in ((large, "direct"), (small, "copied")):  # tcp reads 4 KiB through its read-ahead
            sink = asyncio.ensure_future(_server._receive(node, np.empty_like(x), 1))
            await eventually(lambda: node.channel.mailbox.has_posted(_wire.DATA_TAG))
            await sender._send_own(x, tag=_wire.DATA_TAG)
            assert await sink == {"direct": 0, "staged": 0, "copied": 0, how: 1}
    # a node from before says the crc alone: the row says nothing of it
    assert _client._landed(7, 2) == (7, None)
    with pytest.raises(tensorwire.ProtocolError):
        _client._landed({"crc32c": 7, "landed": {"direct": 1, "staged": 0, "copied": 0}}, 2)


def _queued(peer: tensorwire.Peer, n: int) -> bool:
    q = peer.channel.mailbox._arrived.get(_wire.DATA_TAG, ())
    return len(q) == n and all(arrival.done.done() for arrival in q)


async def test_the_baseline_is_checked_the_same_way(monkeypatch: pytest.MonkeyPatch) -> None:
    raw_receive = _server._raw_receive

    def first_byte_flipped(conn: socket.socket, out: memoryview, count: int) -> bool:
        ok = raw_receive(conn, out, count)
        out[0] ^= 0xFF
        return ok

    monkeypatch.setattr(_server, "_raw_receive", first_byte_flipped)
    async with _pair() as peer:
        with pytest.raises(tensorwire.IntegrityError, match=r"^raw TCP, 2 KiB x1: the node's crc32c"):
            await _bench.run_bench(peer, [2048], seconds=0.05)


async def test_a_node_that_does_not_serve_bench_requests_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    async with _pair(enabled=False) as peer:
        with pytest.raises(tensorwire.RemoteError, match=r"refused the bench: .*tensorwire serve --bench"):
            await _bench.run_bench(peer, [1024], seconds=0.05)
    # a node that runs no bench service at all (a program of its own, a stage) never reads the
    # requests: it is named at once (it waited for the first answer's timeout), and a node that
    # says it serves them but does not answer still runs into that timeout
    monkeypatch.setattr(_client, "_FIRST_ANSWER_S", 0.2)
    async with (
        tensorwire.start("127.0.0.1:0", transports=("tcp",)) as other,
        tensorwire.start("127.0.0.1:0", transports=("tcp",)) as client,
    ):
        peer = await client.connect(other.address)
        with pytest.raises(tensorwire.MethodNotFound, match=r"runs no bench service: it is not a `tensorwire serve`"):
            await _bench.run_bench(peer, [1024], seconds=0.05)
        _server.offer_bench(other)
        _server.offer_bench(other)  # (once is enough: a second says nothing new)
        with pytest.raises(tensorwire.DeadlineExceeded, match=r"within 0\.2 s: is it `tensorwire serve --bench`\?"):
            await _bench.run_bench(peer, [1024], seconds=0.05)


async def test_a_size_past_the_nodes_limit_is_refused_before_any_byte_moves() -> None:
    # said by the node, before the client sends a byte of that size
    async with _pair(limits=tensorwire.Limits(max_message_bytes=1 << 20)) as peer:
        with pytest.raises(tensorwire.RemoteError, match=r"a size is an int from 1 to 1048576 \(this node's limit\)"):
            async with asyncio.timeout(20):
                await _bench.run_bench(peer, [64 << 10, 4 << 20], seconds=0.05)


async def test_the_node_refuses_requests_out_of_bounds() -> None:
    async with _pair() as peer:
        for request, complaint in [
            ({"op": "sink", "size": 0, "count": 1}, "a size is an int from 1 to"),
            ({"op": "sink", "size": 8, "count": 0}, "a count is an int from 1 to"),
            ({"op": "sink", "size": 8, "count": 1, "device": "tpu"}, "unknown device 'tpu'"),
            ({"op": "launch"}, "unknown bench request"),
            ("open", "unknown bench request"),
        ]:
            await peer._send_own(request, tag=_wire.REQUEST_TAG)
            with pytest.raises(tensorwire.RemoteError, match=complaint):
                await _client._answer(peer)


def _dual_stack() -> bool:
    """Whether an IPv6 socket on '::' here can take IPv4 clients too."""
    if not socket.has_dualstack_ipv6():
        return False
    try:
        with socket.create_server(("::", 0), family=socket.AF_INET6, dualstack_ipv6=True):
            return True
    except OSError:
        return False


@pytest.mark.skipif(not _dual_stack(), reason="no dual-stack IPv6 socket on this machine")
async def test_a_node_on_every_ipv6_interface_benches_an_ipv4_client() -> None:
    """`serve --bench --address [::]:5555` takes IPv4 clients on its control and data planes, but
    its baseline listener was IPv6-only (socket.create_server's default): a bench from an IPv4
    address failed with 'the raw TCP baseline could not connect ... is that port blocked?'."""
    async with (
        tensorwire.start("[::]:0", transports=("tcp",)) as server,
        tensorwire.start("127.0.0.1:0", transports=("tcp",)) as client,
    ):
        peer = await client.connect(f"127.0.0.1:{server.address.rpartition(':')[2]}")
        task = asyncio.ensure_future(_server.serve_bench(await server.accept(), enabled=True))
        try:
            report = await _bench.run_bench(peer, [1024], seconds=0.05)
            assert report.baseline.startswith("one plain TCP socket between the same two processes, to 127.0.0.1:")
            assert report.rows[0].raw_count >= 2
        finally:
            await peer.aclose()
            async with asyncio.timeout(10):
                await task


@pytest.mark.skipif(not _dual_stack(), reason="no dual-stack IPv6 socket on this machine")
async def test_a_node_on_every_ipv4_interface_takes_an_ipv6_baseline_client() -> None:
    """gRPC serves a node at 0.0.0.0:P on both families ('*:P'), so `bench [::1]:P` reached
    it, but the baseline listened on 0.0.0.0 alone: 'could not connect to [::1]:Q ... is that
    port blocked between the machines?', exit 1."""
    raw = _server._RawServer("0.0.0.0", 1 << 20)
    try:
        client = await _client._RawClient.connect("::1", raw.port, raw.secret)
        try:
            assert len(await client.ping(2)) == 2
        finally:
            client.close()
    finally:
        raw.close()


async def test_the_baseline_listener_takes_only_the_client_with_the_secret() -> None:
    raw = _server._RawServer("127.0.0.1", 1 << 20)
    try:
        stranger = await asyncio.to_thread(socket.create_connection, ("127.0.0.1", raw.port), 5)
        with stranger:
            stranger.sendall(b"x" * _wire.SECRET_BYTES)
            stranger.settimeout(5)
            assert await asyncio.to_thread(stranger.recv, 1) == b""  # dropped
        client = await _client._RawClient.connect("127.0.0.1", raw.port, raw.secret)
        try:
            data = np.arange(300, dtype=np.uint8)
            seconds, crc = await client.sink(data, 3, b"\1" * 8)
            assert seconds > 0 and crc == await _wire.crc_of(data, CPU)
            assert len(await client.ping(5)) == 5
        finally:
            client.close()
    finally:
        raw.close()


async def test_the_baseline_listener_works_past_1024_open_files_and_a_silent_connection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The accept loop waited with select(), which refuses a descriptor numbered 1024 or more: a
    node with that many files open (a long-lived server, UCX's leaked sockets) refused every
    baseline ("is that port blocked?"). And a connection that never sends the secret held the
    one accept thread for STALL_S (60 s), and a real client behind it."""
    import resource

    monkeypatch.setattr(_server, "_SECRET_S", 0.5)  # (5 s in use) how long the silent one holds the thread
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"the hard limit on open files is {hard}: cannot open 1100 more")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200) if hard == resource.RLIM_INFINITY else hard, hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        raw = _server._RawServer("127.0.0.1", 1 << 20)
        try:
            assert all(s.fileno() >= 1024 for s in raw._listeners), "the listener should sit past 1024"
            silent = await asyncio.to_thread(socket.create_connection, ("127.0.0.1", raw.port), 5)
            with silent:
                client = await _client._RawClient.connect("127.0.0.1", raw.port, raw.secret)
                try:
                    assert len(await client.ping(2)) == 2
                finally:
                    client.close()
        finally:
            raw.close()
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.skipif(not has_ipv6_loopback(), reason="no IPv6 loopback here")
async def test_a_node_on_localhost_benches_a_client_over_either_loopback() -> None:
    """`serve --bench --address localhost:0` listens on 127.0.0.1 and ::1 (gRPC binds both),
    but its baseline listener bound what the name resolves to (127.0.0.1 here): a bench to
    [::1]:PORT failed with 'the raw TCP baseline could not connect ... is that port blocked?'."""
    async with (
        tensorwire.start("localhost:0", transports=("tcp",)) as server,
        tensorwire.start("127.0.0.1:0", transports=("tcp",)) as client,
    ):
        port = server.address.rpartition(":")[2]
        for host in ("[::1]", "127.0.0.1"):
            peer = await client.connect(f"{host}:{port}")
            task = asyncio.ensure_future(_server.serve_bench(await server.accept(), enabled=True))
            try:
                report = await _bench.run_bench(peer, [1024], seconds=0.05)
                assert report.baseline.startswith(f"one plain TCP socket between the same two processes, to {host}:")
                assert report.rows[0].raw_count >= 2
            finally:
                await peer.aclose()
                async with asyncio.timeout(10):
                    await task


@pytest.mark.skipif(not has_ipv6_loopback(), reason="no IPv6 loopback here")
async def test_a_bench_to_localhost_reaches_the_baseline_of_a_node_on_the_ipv6_loopback() -> None:
    """gRPC dials "localhost" on both loopbacks, whatever /etc/hosts says, so `bench
    localhost:P` reached a node serving at [::1]:P; but the baseline dialled the name through
    the system resolver, which may give 127.0.0.1 alone (this machine's /etc/hosts): 'the raw
    TCP baseline could not connect to localhost:Q ... is that port blocked between the
    machines?', exit 1, while tensorwire itself had connected."""
    async with (
        tensorwire.start("[::1]:0", transports=("tcp",)) as server,
        tensorwire.start("127.0.0.1:0", transports=("tcp",)) as client,
    ):
        peer = await client.connect(f"localhost:{server.address.rpartition(':')[2]}")
        task = asyncio.ensure_future(_server.serve_bench(await server.accept(), enabled=True))
        try:
            report = await _bench.run_bench(peer, [1024], seconds=0.05)
            assert report.baseline.startswith("one plain TCP socket between the same two processes, to localhost:")
            assert report.rows[0].raw_count >= 2
        finally:
            await peer.aclose()
            async with asyncio.timeout(10):
                await task


@pytest.mark.timeout(90)
def test_the_installed_command_runs_a_bench_and_exits_cleanly() -> None:
    """What the ``tensorwire`` script runs (``tensorwire._entry:main``, pyproject.toml), not
    ``python -m tensorwire.cli`` as the other tests, with UCX logging (which it does as its
    objects go): a ``gc.freeze()`` on the way out (to skip the last collection) left them to
    the interpreter's teardown, and the bench died of SIGSEGV at exit, after its report."""
    entry = [sys.executable, "-c", "import sys; from tensorwire._entry import main; sys.exit(main())"]
    env = {**os.environ, "UCX_LOG_LEVEL": "info"}
    out = subprocess.run([*entry, "bench", "--sizes", "4K", "--seconds", "0.1", "--json"],
                         capture_output=True, text=True, timeout=45, env=env)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    _check_report(json.loads(out.stdout), [4096], transport=json.loads(out.stdout)["path"]["transport"])
