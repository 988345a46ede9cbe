"""What tensorwire says about the path it took, checked against what happened: real nodes on
loopback, real UCX lanes, a real owner process frozen with SIGSTOP, the doctor against a real
connect between two processes."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import tensorwire
from tensorwire import _doctor
from tensorwire._path import Path

pytestmark = pytest.mark.timeout(60)
needs_ucx = pytest.mark.skipif(
    importlib.util.find_spec("ucxx") is None, reason="ucxx is not installed (pip install 'tensorwire[ucx]')"
)


async def _connect(a_tls: str, b_tls: str, transports: tuple[str, ...]) -> tuple[str, str, str]:
    """Two nodes with these UCX transports; the client's path, its str, the server's str."""
    async with (
        tensorwire.start(transports=transports, ucx_options={"TLS": a_tls}) as a,
        tensorwire.start(transports=transports, ucx_options={"TLS": b_tls}) as b,
    ):
        peer = await a.connect(b.address)
        other = await b.accept()
        return peer.path.transport, str(peer.path), str(other.path)


@needs_ucx
async def test_ucx_over_tcp_lanes_is_not_called_direct() -> None:
    """ucx with only tcp lanes (and no tensorwire tcp to give way to) said '(direct)'."""
    transport, mine, theirs = await _connect("tcp", "tcp", ("ucx",))
    assert transport == "ucx"
    for text in (mine, theirs):
        assert "(direct)" not in text and "kernel TCP" in text, text
        assert "emulated" in text, text  # no cma/RDMA lane: the owner's worker serves get/put


@needs_ucx
async def test_ucx_over_shared_memory_says_so() -> None:
    transport, mine, _ = await _connect("sm,self", "sm,self", ("ucx", "tcp"))
    assert transport == "ucx" and "shared memory (cma single copy)" in mine, mine
    assert "TCP" not in mine.split(";")[0] and "emulated" not in mine, mine


@needs_ucx
async def test_an_endpoint_with_only_tcp_lanes_gives_way_to_tcp() -> None:
    """Both nodes list shared memory, but not the same kind: the endpoint between them has tcp
    lanes only (as between two machines). ucx was kept, its bytes over UCX's tcp lanes, though
    the README promises tensorwire's tcp in that case; now the server judges the endpoint."""
    transport, mine, theirs = await _connect("sysv,tcp", "posix,tcp", ("ucx", "tcp"))
    assert transport == "tcp", mine
    for text in (mine, theirs):
        assert "not ucx: only tcp lanes between" in text and "tcp/lo" in text, text
    # the same kinds of shared memory on both sides: ucx stays
    transport, mine, _ = await _connect("sysv,tcp", "sysv,tcp", ("ucx", "tcp"))
    assert transport == "ucx" and "sysv/memory" in mine, mine


@needs_ucx
@pytest.mark.parametrize(("tls", "protocol"), [("sm,self", "one-sided"), ("^cma", "one-sided-emulated")])
async def test_one_sided_receipts_say_whether_ucx_emulates_get_and_put(tls: str, protocol: str) -> None:
    """Without a cma (or RDMA) lane UCX emulates get/put (UCX_PROTO_INFO=used: 'software
    emulation' over sysv, put over tcp/lo), yet receipts said "one-sided"."""
    async with (
        tensorwire.start(transports=("ucx",), ucx_options={"TLS": tls}) as a,
        tensorwire.start(transports=("ucx",), ucx_options={"TLS": tls}) as b,
    ):
        x = np.arange(1 << 16, dtype=np.uint8)
        a.expose(x, name="x")
        peer = await b.connect(a.address)
        h = await peer.lookup("x")
        assert h.direct
        got, r = await peer.read_with_receipt(h)
        assert np.array_equal(got, x)
        w = await peer.write(h, np.ones_like(x))
        rows = await peer.read_many_with_receipt([h[0:4], h[8:9]])
        assert (r.protocol, w.protocol, rows[1].protocol) == (protocol, protocol, protocol)
        assert (x == 1).all() and a.exposures.served == 0  # no tensorwire code of the owner's either way


_OWNER = """
import asyncio, numpy as np, tensorwire
async def main():
    async with tensorwire.start(transports=("ucx",), ucx_options={"TLS": "^cma"}, lease_seconds=1.0) as n:
        n.expose(np.arange(1 << 20, dtype=np.uint8), name="x")
        print(n.address, flush=True)
        p = await n.accept()
        await p.recv(tag="bye")
asyncio.run(main())
"""


@needs_ucx
@pytest.mark.multiprocess
async def test_an_emulated_read_needs_the_owner_process() -> None:
    """What "one-sided-emulated" means: with the owner frozen (SIGSTOP) the read does not
    complete (over cma it does: test_ucx_onesided's stopped-owner test); it ends when the
    owner's lease runs out, not with the bytes."""
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", textwrap.dedent(_OWNER), stdout=asyncio.subprocess.PIPE
    )
    assert child.stdout is not None
    try:
        async with asyncio.timeout(20):
            address = (await child.stdout.readline()).decode().strip()
        async with tensorwire.start(transports=("ucx",), ucx_options={"TLS": "^cma"}, lease_seconds=1.0) as node:
            peer = await node.connect(address)
            h = await peer.lookup("x")
            _, r = await peer.read_with_receipt(h)
            assert r.protocol == "one-sided-emulated"
            os.kill(child.pid, signal.SIGSTOP)
            try:
                with pytest.raises((TimeoutError, tensorwire.PeerDisconnected)):
                    async with asyncio.timeout(0.5):
                        await peer.read(h)
            finally:
                os.kill(child.pid, signal.SIGCONT)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, signal.SIGCONT)
            child.kill()
        await child.wait()


def test_ucx_path_is_rdma_only_over_an_rdma_lane() -> None:
    """A node whose UCX lists an RDMA transport, connected to a peer over shared memory (same
    machine) or tcp (a peer without RDMA): Path said rdma=True, and '(RDMA)'."""
    kinds = ("host", "cuda")
    shm = Path("ucx", ("sysv/memory", "cma/memory"), True, True, kinds, ())
    assert not shm.rdma and not shm.gpudirect and "RDMA" not in str(shm)
    rc = Path("ucx", ("rc_mlx5/mlx5_0:1", "cma/memory"), True, True, kinds, ())
    assert rc.rdma and rc.gpudirect and "RDMA" in str(rc)


def _doctor_json(*args: str, env: dict[str, str]) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-m", "tensorwire.cli", "doctor", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)  # type: ignore[no-any-return]


@needs_ucx
@pytest.mark.multiprocess
def test_doctor_predicts_the_transport_a_real_connect_uses_with_ucx_tls_tcp() -> None:
    """With UCX_TLS=tcp exported the doctor said 'a connect to another process would use: ucx',
    while a real connect between two processes so configured took tcp."""
    env = {**os.environ, "UCX_TLS": "tcp"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tensorwire.cli", "serve", "--address", "127.0.0.1:0"],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        address = proc.stdout.readline().split("serving at")[1].strip()
        rep = _doctor_json(address, env=env)
        pick = rep["connect_to_another_process"]
        conn = rep["connect"]
        assert isinstance(pick, dict) and isinstance(conn, dict)
        assert conn["transport"] == "tcp", conn
        assert pick["transport"] == conn["transport"], (pick, conn)
        assert any(line.startswith("ucx: only tcp lanes") for line in pick["passed_over"]), pick
    finally:
        proc.terminate()
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


def test_doctor_says_verbs_has_no_device_here_rather_than_blaming_the_setup() -> None:
    rep = _doctor.report()
    verbs = rep["transports"]["verbs"]
    if verbs["usable"] or rep["rdma_devices"]:
        pytest.skip("this machine has RDMA devices or pyverbs")
    assert "no RDMA device" in verbs["note"]
    assert "no RDMA device" in _doctor.render(rep)


@pytest.mark.parametrize("transport", ["tcp", pytest.param("ucx", marks=needs_ucx)])
async def test_both_sides_log_the_path_they_took(transport: str, caplog: pytest.LogCaptureFixture) -> None:
    """The connecting side logged its path; the accepting side logged nothing about its own."""
    caplog.set_level("INFO", logger="tensorwire")
    async with tensorwire.start(transports=(transport,)) as a, tensorwire.start(transports=(transport,)) as b:
        await a.connect(b.address)
        other = await asyncio.wait_for(b.accept(), 10)
        accepted = [r.getMessage() for r in caplog.records if r.getMessage().startswith("accepted ")]
        assert accepted == [f"accepted {other.remote_address} (node {a.node_id[:12]}): {other.path}"], accepted
        assert transport in accepted[0]


@needs_ucx
@pytest.mark.parametrize("how", ["client node", "connect", "connect ranking ucx second"])
async def test_the_accepting_side_says_why_a_transport_it_prefers_was_not_used(how: str) -> None:
    """A client that asks for tcp alone (a node of tcp only, or ``connect(transports=("tcp",))``)
    reaching a server that prefers ucx, has it and could use it: the server's path read plain tcp,
    its peers_opened metric passed_over="", with no word on ucx, since it listed only what the
    client's order passed over. Now the server's path names ucx and why; the negotiation is
    unchanged (tcp), as is the client's path (its own order passed nothing over)."""
    from tensorwire import metrics

    client_transports, ask, expected = {
        "client node": (("tcp",), None, "not enabled"),
        "connect": (("ucx", "tcp"), ("tcp",), "not in client"),
        "connect ranking ucx second": (("ucx", "tcp"), ("tcp", "ucx"), "preference order puts tcp before it"),
    }[how]
    async with (
        tensorwire.start("127.0.0.1:0", transports=("ucx", "tcp")) as server,
        tensorwire.start("127.0.0.1:0", transports=client_transports) as client,
    ):
        before = metrics.snapshot().peers_opened
        peer = await client.connect(server.address, transports=ask)
        other = await asyncio.wait_for(server.accept(), 10)
        after = metrics.snapshot().peers_opened
    assert peer.path.transport == other.path.transport == "tcp", (peer.path, other.path)
    assert peer.path.passed_over == (), peer.path
    reasons = dict(other.path.passed_over)
    assert list(reasons) == ["ucx"], other.path
    assert expected in reasons["ucx"] and f"client {client.node_id[:8]}" in reasons["ucx"], reasons
    assert "not ucx: " in str(other.path), other.path
    key = ("tcp", "accept", "ucx")
    assert after.get(key, 0) == before.get(key, 0) + 1, (before, after)


@needs_ucx
def test_a_ucx_that_cannot_reach_the_peer_says_what_each_side_offered() -> None:
    """Nodes whose UCX shared-memory transports do not match (as two machines with shared
    memory alone): the path said only UCX's "Destination is unreachable". Each side's lanes
    now say why, on both sides."""
    transport, mine, theirs = asyncio.run(_connect("posix", "sysv", ("ucx", "tcp")))
    assert transport == "tcp", mine
    for text in (mine, theirs):
        assert "not ucx: UCX cannot create an endpoint" in text, text
        assert "lists sysv/memory; client " in text and " lists posix/memory)" in text, text


@needs_ucx
@pytest.mark.parametrize(("tls", "protocol"), [("posix,self", "one-sided-emulated"), ("sm,self", "one-sided")])
def test_the_doctor_says_one_sided_is_emulated_where_the_receipts_do(tls: str, protocol: str) -> None:
    """UCX without a lane that reaches a peer's memory by itself (TLS=posix; a container that
    does not allow cma): every read's receipt says one-sided-emulated (the owner's event loop
    serves it), while the doctor said one_sided=True. It says emulated now, and why."""
    from tensorwire.transports.ucx import ucx_config

    async def read() -> str:
        async with (
            tensorwire.start(transports=("ucx",), ucx_options={"TLS": tls}) as a,
            tensorwire.start(transports=("ucx",), ucx_options={"TLS": tls}) as b,
        ):
            a.expose(np.arange(4096, dtype=np.uint8), name="x")
            peer = await b.connect(a.address)
            _, receipt = await peer.read_with_receipt(await peer.lookup("x"))
            return receipt.protocol

    assert asyncio.run(read()) == protocol
    with ucx_config(TLS=tls):
        rep = _doctor.report()
    emulated = protocol == "one-sided-emulated"
    ucx = rep["transports"]["ucx"]
    assert ucx["one_sided"] and ucx.get("one_sided_emulated", False) is emulated, ucx
    row = next(line for line in _doctor.render(rep).splitlines() if line.startswith("  ucx "))
    assert ("one_sided=emulated" in row) is emulated and ("one_sided=True" in row) is not emulated, row
    assert ("owner's event loop serves" in ucx.get("note", "")) is emulated, ucx
