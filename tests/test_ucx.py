"""The ucx transport beyond the conformance suite: one-sided put/get, negotiation, the hello's
authentication, the environment, idle CPU, and a peer killed mid-transfer. Real UCX on loopback."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from typing import Any

import numpy as np
import pytest
from _lines import lines_of_a_message

import tensorwire
from tensorwire.testing import connected_pair, idle_cpu_percent
from tensorwire.transports.ucx import _ucp

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("ucxx") is None, reason="ucxx is not installed (pip install 'tensorwire[ucx]')"
    ),
    pytest.mark.timeout(15),
]

MiB = 1 << 20


def _ucx_config(**options: str):  # type: ignore[no-untyped-def]
    from tensorwire.transports.ucx import ucx_config

    return ucx_config(**options)


@pytest.mark.parametrize("tls", ["sm,self", "tcp"])
@pytest.mark.parametrize("size", [1 * MiB, 64 * MiB])
async def test_put_and_get_between_two_nodes(tls: str, size: int) -> None:
    """The one-sided bindings: b registers memory, a puts into it and gets it back."""
    with _ucx_config(TLS=tls):
        async with connected_pair("ucx") as (a, b):
            transport = b.node.transports["ucx"]
            region = np.zeros(size, np.uint8)
            with transport.register(region) as mr:  # type: ignore[attr-defined]
                assert mr.address == region.ctypes.data and mr.length == size and mr.rkey
                await b.send({"addr": mr.address, "rkey": mr.rkey}, tag="mr")
                info = await a.recv(tag="mr")
                rkey = a.channel.remote_key(info["rkey"])  # type: ignore[attr-defined]
                src = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
                await a.channel.put(src, info["addr"], rkey)  # type: ignore[attr-defined]
                assert np.array_equal(region, src), "put did not land in the peer's memory"
                region[: size // 2] = 7  # the owner changes its memory; a get sees the change
                back = np.empty(size, np.uint8)
                await a.channel.get(info["addr"], rkey, back)  # type: ignore[attr-defined]
                assert np.array_equal(back[: size // 2], np.full(size // 2, 7, np.uint8))
                assert np.array_equal(back[size // 2 :], src[size // 2 :])
                # a part of the region, at an offset
                await a.channel.get(info["addr"] + 4096, rkey, back[:4096])  # type: ignore[attr-defined]
                assert np.array_equal(back[:4096], region[4096:8192])
                rkey.close()
                rkey.close()  # idempotent
                with pytest.raises(tensorwire.ClosedResourceError):
                    await a.channel.get(info["addr"], rkey, back)  # type: ignore[attr-defined]


async def test_path_names_ucx_lanes() -> None:
    with _ucx_config(TLS="sm,self"):
        async with connected_pair("ucx") as (a, _b):
            assert a.path.transport == "ucx"
            assert any(lane.split("/")[0] in ("posix", "sysv", "cma") for lane in a.path.lanes), a.path
            assert "tcp" not in " ".join(a.path.lanes)
            assert not a.path.rdma
    with _ucx_config(TLS="tcp"):
        async with connected_pair("ucx") as (a, _):
            assert all(lane.startswith("tcp/") for lane in a.path.lanes), a.path
            caps = a.node.offers["ucx"].capabilities
            assert caps.tcp_only and not caps.rdma and caps.one_sided


@pytest.mark.parametrize("tls", ["sm,self", "tcp"])
async def test_host_payloads_up_to_inline_bytes_ride_in_the_msg_frame(tls: str) -> None:
    """A host message of up to ``Limits.inline_bytes`` (64 KiB by default) goes as one control
    frame carrying its bytes (both receipts say "inline"), one byte more as a frame and a
    payload of its own ("eager"); a node with a smaller ``inline_bytes`` sends by its own bound.
    Until 2026-12-01 ucx took at most 8 KiB so, and a 16-64 KiB message cost ~100 us more."""
    from tensorwire.transports.ucx._channel import _INLINE_MAX

    assert _INLINE_MAX == tensorwire.Limits().inline_bytes == 64 << 10
    cases = [(None, 64 << 10, "inline"), (None, (64 << 10) + 1, "eager"), (9000, 9000, "inline"), (9000, 9001, "eager")]
    with _ucx_config(TLS=tls):
        for inline_bytes, n, protocol in cases:
            limits = None if inline_bytes is None else tensorwire.Limits(inline_bytes=inline_bytes)
            async with connected_pair("ucx", limits=limits) as (a, b):
                x = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
                out = np.zeros_like(x)
                recv = asyncio.ensure_future(b.recv_with_receipt(tag="x", out=out))
                sent = await a.send(x, tag="x")
                got, received = await asyncio.wait_for(recv, 10)
                assert got is out and np.array_equal(out, x), n
                assert (sent.protocol, received.protocol) == (protocol, protocol), (inline_bytes, n, sent, received)


async def test_ucx_without_the_shared_memory_fifo_keeps_cma_and_moves_data() -> None:
    """The setting docs/ucx.md recommends where processes may be SIGKILLed: no posix/sysv FIFO
    (which a sender killed mid-send blocks for good), cma for bulk, tcp for the rest."""
    options = {"TLS": "^posix,sysv"}
    async with (
        tensorwire.start("127.0.0.1:0", transports=("ucx",), ucx_options=options) as a,
        tensorwire.start("127.0.0.1:0", transports=("ucx",), ucx_options=options) as b,
    ):
        p = await a.connect(b.address)
        q = await asyncio.wait_for(b.accept(), 10)
        kinds = {lane.split("/")[0] for lane in p.path.lanes}
        assert p.path.transport == "ucx" and "cma" in kinds and not kinds & {"posix", "sysv"}, p.path
        x = np.random.default_rng(1).random(4 << 20)  # 32 MiB: a rendezvous transfer
        await p.send(x, tag=1)
        assert np.array_equal(await q.recv(tag=1), x)


async def test_tcp_only_ucx_gives_way_to_tcp_and_says_so() -> None:
    with _ucx_config(TLS="tcp"):
        async with tensorwire.start(transports=("ucx", "tcp")) as na, tensorwire.start(transports=("ucx", "tcp")) as nb:
            peer = await na.connect(nb.address)
            assert peer.path.transport == "tcp"
            reasons = dict(peer.path.passed_over)
            assert "only tcp lanes" in reasons["ucx"], reasons
            assert "not ucx: only tcp lanes" in str(peer.path)
    # with shared memory, ucx is preferred over tcp
    with _ucx_config(TLS="sm,self,tcp"):
        async with tensorwire.start(transports=("ucx", "tcp")) as na, tensorwire.start(transports=("ucx", "tcp")) as nb:
            peer = await na.connect(nb.address)
            assert peer.path.transport == "ucx", peer.path


async def test_unreachable_ucx_falls_back_to_tcp_with_a_reason() -> None:
    """One node offers UCX over shared memory only, the other over tcp only: no endpoint."""
    with _ucx_config(TLS="sm,self"):
        na = await tensorwire.start(transports=("ucx", "tcp"))
    try:
        with _ucx_config(TLS="tcp"):
            nb = await tensorwire.start(transports=("ucx", "tcp"))
        try:
            peer = await na.connect(nb.address)
            assert peer.path.transport == "tcp"
            assert "ucx" in dict(peer.path.passed_over)
        finally:
            await nb.aclose()
    finally:
        await na.aclose()


async def test_hello_without_the_secret_is_dropped(caplog: pytest.LogCaptureFixture) -> None:
    """A UCX peer that knows the worker address but not the session secret gets no channel."""
    from ucxx._lib.arr import Array

    from tensorwire.transports.ucx import ADDRESS_MAGIC
    from tensorwire.transports.ucx._channel import HELLO, make_tag

    caplog.set_level(logging.WARNING, logger="tensorwire")
    async with tensorwire.start(transports=("ucx",)) as server, tensorwire.start(transports=("ucx",)) as attacker:
        blob = server.offers["ucx"].address
        assert blob.startswith(ADDRESS_MAGIC)
        w = attacker.transports["ucx"].worker  # type: ignore[attr-defined]
        ep = w.worker.create_endpoint_from_worker_address(w.lib.UCXAddress.create_from_buffer(blob[4:]), False)
        for junk in (b"x" * 100, b"TWUH" + bytes(200)):
            req = ep.tag_send(Array(junk), w.lib.UCXXTag(make_tag(0, HELLO)))
            await w.future(req)
        for _ in range(100):
            if sum("dropped ucx hello" in r.getMessage() for r in caplog.records) >= 2:
                break
            await asyncio.sleep(0.01)
        assert sum("dropped ucx hello" in r.getMessage() for r in caplog.records) >= 2
        await w.close_endpoint(ep)
        # and an honest client still gets in
        peer = await attacker.connect(server.address)
        other = await server.accept()
        await peer.send(np.arange(3), tag=1)
        assert np.array_equal(await other.recv(tag=1), np.arange(3))


async def test_a_hello_the_server_cannot_answer_fails_the_connect_saying_why(caplog: pytest.LogCaptureFixture) -> None:
    """A server that cannot create the endpoint back to the worker address a HELLO gives (a buggy
    client's, here; or UCX failing there) drops the HELLO, and nothing reaches the client without
    that endpoint: the client learns of it only by waiting handshake_seconds. Its error then says
    what most likely happened and where to look: the server's 'dropped ucx hello' warning, which
    names the same client node. It used to say only 'ucx data connection failed: TimeoutError'."""
    caplog.set_level(logging.WARNING, logger="tensorwire")
    limits = tensorwire.Limits(handshake_seconds=1)
    async with (
        tensorwire.start(transports=("ucx",), limits=limits) as server,
        tensorwire.start(transports=("ucx",), limits=limits) as client,
    ):
        # its offer (made at start) is right; the address its HELLO gives is not one UCX can read
        client.transports["ucx"].worker.address = b"\x0f" + bytes(63)  # type: ignore[attr-defined]
        with pytest.raises(tensorwire.ConnectError) as info:
            await client.connect(server.address)
    message = str(info.value)
    assert "did not answer this node's HELLO within 1 s" in message, message
    assert "endpoint back" in message and "'dropped ucx hello'" in message, message
    assert f"client node {client.node_id[:8]}" in message, message
    dropped = [r.getMessage() for r in caplog.records if "dropped ucx hello" in r.getMessage()]
    assert any(f"client node {client.node_id[:8]}" in m and "format version 15" in m for m in dropped), dropped


async def test_a_connect_timeout_during_the_data_connection_says_the_handshake_was_done() -> None:
    """With connect_timeout shorter than handshake_seconds (by default they are equal, and the
    connect's own timeout starts first), the connect's timeout fires while the data connection
    is under way. It said only 'took longer than N s'; it now says the control-plane handshake
    was done and which transport's data connection did not open."""
    limits = tensorwire.Limits(handshake_seconds=5)
    async with (
        tensorwire.start(transports=("ucx",), limits=limits) as server,
        tensorwire.start(transports=("ucx",), limits=limits, connect_timeout=1) as client,
    ):
        client.transports["ucx"].worker.address = b"\x0f" + bytes(63)  # type: ignore[attr-defined]
        with pytest.raises(tensorwire.ConnectTimeout) as info:
            await client.connect(server.address)
    message = str(info.value)
    assert "took longer than 1.0 s" in message, message
    assert "the control-plane handshake was done, the ucx data connection did not open" in message, message


async def test_inline_answer_wait_backs_off_when_answers_come_late() -> None:
    """A recv right after a send waits inline (holding the loop) for at most 50 us; when the
    answer keeps coming later (here it can only come from this very loop: both nodes share it),
    the wait backs off exponentially, so it skips almost every recv, and nothing is lost."""
    async with connected_pair("ucx") as (a, b):
        channel = a.channel

        async def echo() -> None:
            for _ in range(200):
                x = await b.recv(tag=1)
                await b.send(x, tag=2)

        server = asyncio.ensure_future(echo())
        for i in range(200):
            await a.send(np.array([i]), tag=1)
            assert int((await a.recv(tag=2))[0]) == i
        await server
        # every inline wait failed: the back-off doubled up to skipping >= 64 recvs in a row
        assert channel._wait_penalty >= 64, channel._wait_penalty  # type: ignore[attr-defined]


@pytest.mark.multiprocess
@pytest.mark.timeout(60)  # the child imports ucxx and joins a node
async def test_answers_taken_inline_schedule_nothing_and_the_loop_still_turns() -> None:
    """A ping-pong with a peer in another process: a recv right after a send waits inline for
    the answer, and the frame it takes there is handled without a loop callback (the control
    receive was re-posted with ``call_soon``, a handle per frame on the round trip's path). Yet
    the loop turns at least every 16 such recvs (it never did while every answer came in time:
    lease renewals and other tasks waited). Counted in callbacks and loop turns, not time."""
    from tensorwire.transports.ucx._channel import UcxChannel
    from tensorwire.transports.ucx._worker import Worker

    n = 600
    async with tensorwire.start(transports=("ucx",)) as node:
        child = await _ucx_client(
            node.address,
            "pass",
            f"for _ in range({n}): await p.send(await p.recv(tag=1), tag=2)",
        )
        try:
            async with asyncio.timeout(30):
                peer = await node.accept()
            loop = asyncio.get_running_loop()
            state = {"inline": False, "frame": False, "frames": 0, "scheduled": 0, "turns": 0}
            real_until, real_on_ctrl, real_call_soon = Worker.progress_until, UcxChannel._on_ctrl, loop.call_soon

            def until(self: Worker, fut: Any, seconds: float) -> bool:
                state["inline"] = True
                try:
                    return real_until(self, fut, seconds)
                finally:
                    state["inline"] = False

            def on_ctrl(self: UcxChannel, *args: Any) -> None:
                state["frame"] = state["inline"]
                state["frames"] += state["inline"]
                try:
                    real_on_ctrl(self, *args)
                finally:
                    state["frame"] = False

            def call_soon(*args: Any, **kwargs: Any) -> Any:
                state["scheduled"] += state["frame"]
                return real_call_soon(*args, **kwargs)

            async def turns() -> None:
                while True:
                    state["turns"] += 1
                    await asyncio.sleep(0)

            counter = asyncio.ensure_future(turns())
            await asyncio.sleep(0)
            streak = longest = 0
            seen = state["turns"]
            x = np.zeros(1, np.float64)
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(Worker, "progress_until", until)
                mp.setattr(UcxChannel, "_on_ctrl", on_ctrl)
                mp.setattr(loop, "call_soon", call_soon)
                for i in range(n):
                    x[0] = i
                    await peer.send(x, tag=1)
                    assert (await peer.recv(tag=2, out=x))[0] == i
                    streak = streak + 1 if state["turns"] == seen else 0
                    seen = state["turns"]
                    longest = max(longest, streak)
            counter.cancel()
            if not state["frames"]:
                pytest.skip("no answer came within an inline wait here (a loaded machine)")
            assert state["scheduled"] == 0, f"{state['scheduled']} loop callbacks for {state['frames']} inline frames"
            # (a recv that waited through the loop, then up to 16 answered inline)
            assert longest <= 16, f"{longest} recvs in a row returned without a turn of the loop"
        finally:
            async with asyncio.timeout(30):
                await child.wait()


async def test_busy_ucx_that_moves_nothing_is_polled_not_spun_and_said(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A UCX worker that refuses to arm (work pending) yet moves nothing for seconds is polled
    every millisecond instead of spun, with a warning; progress again ends that. A peer SIGKILLed
    mid-send over shared memory can leave a worker so for good (docs/ucx.md), but not on demand:
    here a real worker's arm and progress_once are overridden to look like it."""
    from tensorwire.transports.ucx import _worker as ucx_worker

    monkeypatch.setattr(ucx_worker, "_STALL", 0.2)
    async with connected_pair("ucx") as (a, b):
        w = a.node.transports["ucx"].worker
        real = w.worker

        class Wedged:
            # (the real worker is the instance's, not a closure of the class's: a class is freed
            # only by the cycle collector, and the node's UCX worker with it, some tests later)
            def __init__(self, real: Any) -> None:
                self.real = real
                self.calls = 0
                self.moves = 0  # progress_once reports this many moves, one per call

            def progress_once(self) -> int:
                self.calls += 1
                if self.moves:
                    self.moves -= 1
                    return 1
                return 0

            def progress(self) -> None:
                pass

            def arm(self) -> bool:
                return False

            def __getattr__(self, name: str) -> object:
                return getattr(self.real, name)

        wedged = Wedged(real)
        w.worker = wedged
        try:
            with caplog.at_level(logging.WARNING, logger="tensorwire.transports.ucx._worker"):
                w.kick()
                await asyncio.sleep(0.5)
                assert w.stalled
                assert "without moving anything" in caplog.text and "docs/ucx.md" in caplog.text
                before = wedged.calls
                await asyncio.sleep(0.3)
                # polled every 1 ms: a few hundred progress calls; spinning makes tens of thousands
                assert wedged.calls - before < 1500, wedged.calls - before
                wedged.moves = 1
                await asyncio.sleep(0.05)
                assert not w.stalled
                assert "makes progress again" in caplog.text
        finally:
            w.worker = real
        w.kick()
        await a.send(np.arange(3), tag=1)
        assert np.array_equal(await asyncio.wait_for(b.recv(tag=1), 5), np.arange(3))


def test_ucx_config_rejects_bad_options() -> None:
    with pytest.raises(tensorwire.ConfigurationError), _ucx_config(UCX_TLS="tcp"):
        pass


async def test_context_defaults_yield_to_the_callers_options(monkeypatch: pytest.MonkeyPatch) -> None:
    """tensorwire's own UCX defaults (MEMTYPE_CACHE=n, as ucxx sets on import) reach a real
    context, which accepts them; a node's ucx_options and a UCX_* variable of the same name win."""

    async def options(**node_options: str) -> dict[str, str]:
        async with tensorwire.start(transports=("ucx",), ucx_options=node_options) as node:
            assert "ucx" in node.offers, node.unusable
            return dict(node.transports["ucx"].worker.options)  # type: ignore[attr-defined]

    monkeypatch.delenv("UCX_MEMTYPE_CACHE", raising=False)
    got = await options()
    assert got["MEMTYPE_CACHE"] == "n" and got["WARN_UNUSED_ENV_VARS"] == "n", got
    assert (await options(MEMTYPE_CACHE="try"))["MEMTYPE_CACHE"] == "try"
    monkeypatch.setenv("UCX_MEMTYPE_CACHE", "y")
    assert "MEMTYPE_CACHE" not in await options()  # the environment's value applies
    assert (await options(MEMTYPE_CACHE="n"))["MEMTYPE_CACHE"] == "n"


def _run(code: str, timeout: float = 12, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=env,
    )


def test_using_ucx_leaves_the_environment_alone() -> None:
    proc = _run(
        """
        import asyncio, os
        before = dict(os.environ)
        import tensorwire
        assert dict(os.environ) == before, "import edited os.environ"
        async def main():
            async with tensorwire.start(transports=("ucx",)) as n:
                assert "ucx" in n.offers, n.unusable
        asyncio.run(main())
        changed = {k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k)}
        assert not changed, changed
        print("ok")
        """
    )
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.timeout(30)
def test_a_node_loads_ucx_with_the_loop_turning() -> None:
    """ucxx's import loads libucx's libraries through ctypes.CDLL, whose dlopen holds the GIL for
    ~0.4 s while UCX's constructors run; a node's first start with ucx did that on the loop. It
    now loads them in a thread first: when the probe imports ucxx, libucs is loaded and the loop
    has turned since the start began (a task counts its turns). The second node finds it done."""
    proc = _run(
        """
        import asyncio, json
        import tensorwire
        from tensorwire.transports.ucx import _transport, _ucp
        turns = 0
        seen = {}
        real = _transport.import_ucxx
        def import_ucxx():
            if not seen:
                seen.update(turns=turns, ucs=_ucp.loaded_library("libucs.so") is not None)
            return real()
        _transport.import_ucxx = import_ucxx
        async def count():
            global turns
            while True:
                await asyncio.sleep(0)
                turns += 1
        async def main():
            assert _ucp.loaded_library("libucs.so") is None, "UCX was loaded before the node started"
            counter = asyncio.create_task(count())
            await asyncio.sleep(0)
            before = turns
            async with tensorwire.start(transports=("ucx", "tcp")) as a, tensorwire.start(transports=("ucx",)) as b:
                offers = [list(a.offers), list(b.offers)]
            counter.cancel()
            print(json.dumps({"turns": seen["turns"] - before, "ucs": seen["ucs"], "offers": offers}))
        asyncio.run(main())
        """,
        timeout=25,
        env={k: v for k, v in os.environ.items() if k != "RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = json.loads(proc.stdout.splitlines()[-1])
    assert got["offers"] == [["ucx", "tcp"], ["ucx"]], got
    assert got["ucs"], got  # loaded before ucxx's import, off the loop
    assert got["turns"] > 0, got  # the loop ran while it loaded


def _ucx_settings(*, ucxx_first: bool, check: bool) -> str:
    """A script that prints (JSON) the UCX settings of a node's real context, the UCX_* variables
    after an ``import ucxx`` done before tensorwire's (``ucxx_first``, as dask or RAPIDS would),
    and those left at the end; with ``check``, it also runs back_to_back_messages_land_in_place
    over TLS=tcp."""
    return f"""
import asyncio, json, os
if {ucxx_first}:
    import ucxx
ucxx_env = {{k: v for k, v in os.environ.items() if k.startswith("UCX_")}}
import tensorwire
from tensorwire.testing import CHECKS, connected_pair
from tensorwire.transports.ucx import ucx_config
async def main():
    async with tensorwire.start(transports=("ucx",)) as n:
        cfg = n.transports["ucx"].worker.context.config
    if {check}:
        with ucx_config(TLS="tcp"):
            async with connected_pair("ucx") as (a, b):
                await CHECKS["back_to_back_messages_land_in_place"](a, b)
    return {{k: cfg[k] for k in ("RNDV_THRESH", "RNDV_FRAG_MEM_TYPES", "MAX_RNDV_RAILS")}}
cfg = asyncio.run(main())
left = {{k: v for k, v in os.environ.items() if k.startswith("UCX_")}}
print(json.dumps({{"config": cfg, "ucxx_env": ucxx_env, "left": left}}))
"""


def _settings(code: str, env: dict[str, str]) -> dict[str, Any]:
    proc = _run(code, timeout=50, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return dict(json.loads(proc.stdout.splitlines()[-1]))


def _ucx_env(**variables: str) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if not k.startswith("UCX_")}, **variables}


@pytest.mark.timeout(60)
def test_ucxx_imported_first_does_not_choose_tensorwires_ucx_settings() -> None:
    """ucxx's import sets UCX_RNDV_THRESH=8192, UCX_MAX_RNDV_RAILS=1 and others where they are
    unset. Imported before tensorwire, those values pass for the user's unless told apart: with
    them, back-to-back messages over TLS=tcp were staged instead of landing in the posted out=.
    A context must look as it does without the earlier import, and the environment stays as
    ucxx left it (dask still reads it)."""
    alone = _settings(_ucx_settings(ucxx_first=False, check=False), _ucx_env())
    got = _settings(_ucx_settings(ucxx_first=True, check=True), _ucx_env())
    assert got["ucxx_env"].get("UCX_RNDV_THRESH") == "8192", got  # what ucxx does on import
    assert got["config"] == alone["config"], got
    assert got["left"] == got["ucxx_env"], got


@pytest.mark.timeout(60)
def test_the_users_own_ucx_variables_still_count_after_ucxx_was_imported_first() -> None:
    """The same values set by the user before the process started are the user's: they apply
    (and with them back-to-back messages over TLS=tcp are staged, which is why they are not the
    default)."""
    env = _ucx_env(UCX_RNDV_THRESH="8192", UCX_MAX_RNDV_RAILS="1")
    got = _settings(_ucx_settings(ucxx_first=True, check=False), env)["config"]
    assert got["RNDV_THRESH"] == "intra:8K,inter:8K" and got["MAX_RNDV_RAILS"] == "1", got


def test_ucxx_leftovers_are_told_from_the_users_values() -> None:
    from tensorwire.transports.ucx._worker import _ucxx_leftovers

    env = {"UCX_RNDV_THRESH": "8192", "UCX_MAX_RNDV_RAILS": "2", "UCX_TLS": "tcp", "UCX_MEMTYPE_CACHE": "n"}
    assert _ucxx_leftovers(env, {"UCX_TLS": "tcp"}) == {"UCX_RNDV_THRESH", "UCX_MEMTYPE_CACHE"}
    assert _ucxx_leftovers(env, {"UCX_RNDV_THRESH": "8192"}) == {"UCX_MEMTYPE_CACHE"}
    assert _ucxx_leftovers(env, None) == {"UCX_RNDV_THRESH", "UCX_MEMTYPE_CACHE"}  # /proc unreadable


def test_ucx_options_take_ucxx_leftovers_for_unset_until_the_user_changes_them(monkeypatch: pytest.MonkeyPatch) -> None:
    from tensorwire.transports.ucx import _worker

    monkeypatch.setattr(_worker, "_leftovers", frozenset({"UCX_MEMTYPE_CACHE"}))
    monkeypatch.setenv("UCX_MEMTYPE_CACHE", "n")  # ucxx's value: tensorwire passes its own option
    assert _worker.ucx_options()["MEMTYPE_CACHE"] == "n"
    with _worker._without_leftovers():
        assert "UCX_MEMTYPE_CACHE" not in os.environ
    assert os.environ["UCX_MEMTYPE_CACHE"] == "n"  # put back for everyone else
    monkeypatch.setenv("UCX_MEMTYPE_CACHE", "try")  # changed since: the user's, and it applies
    assert "MEMTYPE_CACHE" not in _worker.ucx_options()
    with _worker._without_leftovers():
        assert os.environ["UCX_MEMTYPE_CACHE"] == "try"


@pytest.mark.timeout(60)  # the child imports ucxx and joins two nodes; idle_cpu_percent says where it stuck
def test_idle_node_burns_no_cpu() -> None:
    """A node with a ucx listener and a connected peer sleeps in epoll while nothing moves."""
    pct = idle_cpu_percent("ucx")
    # two nodes, each with a lease watchdog and heartbeats: a few tenths of a percent at most
    assert pct < 5.0, f"idle cpu {pct:.2f}%"


async def _ucx_client(address: str, before: str, then: str) -> asyncio.subprocess.Process:
    """A child process that runs ``before`` (allocations, made before any session begins),
    connects a ucx node to ``address`` as ``p``, and runs ``then`` (one line) in that session."""
    code = (
        "import asyncio, numpy as np, tensorwire\n"
        "async def main():\n"
        f"    {before}\n"
        '    async with tensorwire.start(transports=("ucx",)) as n:\n'
        f"        p = await n.connect({address!r})\n"
        f"        {then}\n"
        "asyncio.run(main())\n"
    )
    return await asyncio.create_subprocess_exec(sys.executable, "-c", code)


@pytest.mark.multiprocess
@pytest.mark.parametrize("posted", [True, False], ids=["recv-first", "message-first"])
async def test_the_loop_turns_while_a_large_payload_lands_over_cma(posted: bool) -> None:
    """Over cma the receiving process copies the payload in UCX progress calls, 512 KiB a round
    (UCX's CMA_SEG_SIZE). ucxx's ``progress()`` progresses until nothing moves, so a 256 MiB
    payload landed inside one call, the loop blocked for it (0.05 s into warm pages, 1.2 s into
    pages never touched: lease renewals went unanswered and a 2 GiB tensor lost its session).
    Now the loop's other tasks run many times while it lands: counted in loop turns, not in
    time."""
    async with tensorwire.start(transports=("ucx",)) as node:
        child = await _ucx_client(
            node.address,
            "x = np.full(256 << 20, 7, np.uint8)",
            'await p.recv(tag="go"); await p.send(x, tag=1); await p.recv(tag="bye")',
        )
        try:
            async with asyncio.timeout(30):
                peer = await node.accept()
            if "cma" not in str(peer.path):
                pytest.skip(f"UCX chose no cma lane here: {peer.path}")
            out = np.empty(256 * MiB, np.uint8)  # pages never touched: the copy takes longest
            gaps: list[float] = []

            async def turn() -> None:
                last = time.perf_counter()
                while True:
                    await asyncio.sleep(0)
                    now = time.perf_counter()
                    gaps.append(now - last)
                    last = now

            if not posted:  # the message waits, its payload not pulled, until the recv
                await peer.send(np.zeros(1), tag="go")
                await asyncio.sleep(0.5)
            turning = asyncio.ensure_future(turn())
            await asyncio.sleep(0)
            t0 = time.perf_counter()
            try:
                recv = asyncio.ensure_future(peer.recv(tag=1, out=out))
                if posted:
                    await peer.send(np.zeros(1), tag="go")
                async with asyncio.timeout(60):
                    await recv
                took = time.perf_counter() - t0
            finally:
                turning.cancel()
            assert out[0] == 7 and out[-1] == 7 and int(out.sum(dtype=np.uint64)) == 7 * 256 * MiB
            # a ratio within this run, not a time: the old code held the loop for nearly all of it
            longest = max(gaps)
            assert longest < took / 2, f"the loop stood still {longest:.3f} s of the recv's {took:.3f} s"
            await peer.send(np.zeros(1), tag="bye")
            async with asyncio.timeout(30):
                await child.wait()
        finally:
            if child.returncode is None:
                child.kill()
                await child.wait()


@pytest.mark.multiprocess
async def test_peer_killed_mid_transfer_fails_pending_ops() -> None:
    """SIGKILL the sender while 256 MiB moves over shared memory: the recv fails promptly
    (the control-plane lease; UCX peer error handling is off), nothing hangs, the node serves on.

    Over cma this process copies each 256 MiB payload inside one UCX progress call, its loop
    blocked meanwhile (0.1-0.4 s here; over 1 s into pages never touched), and the child
    declares this node dead when its renewals go unanswered for a lease. That lease is this
    node's, in both directions (a node's lease_seconds applies to the peers that connect to
    it), so it is made long enough for those stalls and stays well under the 5 s bound, and
    both buffers are touched before the session begins. (With a 1 s lease and untouched
    buffers the first recv failed in 3 runs of 5, one node having given up on the other.)"""
    async with tensorwire.start(transports=("ucx",), lease_seconds=2.0) as node:
        out = np.ones(256 * MiB, np.uint8)
        child = await _ucx_client(
            node.address, "x = np.ones(256 << 20, np.uint8)", "while True: await p.send(x, tag=1)"
        )
        try:
            async with asyncio.timeout(10):
                peer = await node.accept()
            await peer.recv(tag=1, out=out)
            failures = _ucp.peer_failures_survived
            recv = asyncio.ensure_future(peer.recv(tag=1, out=out))
            # killed from another thread, so that the kill lands while this process is inside
            # UCX copying from the peer (cma): UCX would abort the process there
            killer = threading.Timer(0.02, os.kill, (child.pid, signal.SIGKILL))
            killer.start()
            await asyncio.to_thread(killer.join)
            t0 = time.monotonic()

            async def drain() -> None:  # messages that had fully arrived may still come
                async with asyncio.timeout(8):
                    await recv
                    while True:
                        await peer.recv(tag=1, out=out)

            with pytest.raises(tensorwire.PeerDisconnected):
                await drain()
            assert time.monotonic() - t0 < 5
            print("cma transfers to the dead peer survived:", _ucp.peer_failures_survived - failures)
        finally:
            if child.returncode is None:
                child.kill()
            await child.wait()
        # the node still serves a new peer
        async with tensorwire.start(transports=("ucx",)) as other:
            p = await other.connect(node.address)
            q = await node.accept()
            await p.send(np.arange(4), tag=2)
            assert np.array_equal(await q.recv(tag=2), np.arange(4))


def test_doctor_reports_ucx() -> None:
    from tensorwire.cli import _doctor_report

    ucx = _doctor_report()["ucx"]
    assert ucx["version"].count(".") == 2
    assert ucx["libucp"].endswith(tuple(f"libucp.so{s}" for s in ("", ".0", ".0.0.0")))
    assert "tcp" in ucx["transports"]
    assert ucx["rdma"] is False  # the PyPI libucx is built without verbs


@pytest.mark.parametrize(
    ("tls", "cuda_support", "kernel_ready", "want"),
    [
        (["rc_mlx5", "dc_mlx5", "cuda_copy", "cuda_ipc", "gdr_copy"], True, True, True),
        (["rc_mlx5", "cuda_copy"], True, False, False),  # no nvidia-peermem, no dma-buf
        (["tcp", "sysv", "cuda_copy", "cuda_ipc"], True, True, False),  # no RDMA lane
        (["rc_verbs", "ud_verbs"], True, True, False),  # a UCX without cuda transports
        # ucxx refuses device buffers (UCX_TLS leaves cuda_copy out): they go through host memory,
        # so the path must not claim GPUDirect
        (["rc_mlx5", "cuda_ipc", "gdr_copy"], False, True, False),
    ],
)
def test_gpudirect_needs_rdma_lanes_cuda_memory_and_the_kernels_consent(
    tls: list[str], cuda_support: bool, kernel_ready: bool, want: bool
) -> None:
    from tensorwire.transports.ucx._transport import _gpudirect

    assert _gpudirect(tls, cuda_support, lambda: kernel_ready) is want


@pytest.mark.parametrize(
    ("tls", "cuda_support", "want"),
    [
        (["tcp", "sysv", "cuda_copy", "cuda_ipc"], True, ("host", "cuda")),
        (["tcp", "sysv", "cuda_copy", "cuda_ipc"], False, ("host",)),  # ucxx would refuse device buffers
        (["tcp", "sysv"], True, ("host",)),
    ],
)
def test_cuda_memory_needs_a_cuda_lane_and_ucxx_consent(
    tls: list[str], cuda_support: bool, want: tuple[str, ...]
) -> None:
    from tensorwire.transports.ucx._transport import _memory_kinds

    assert _memory_kinds(tls, cuda_support) == want


def test_this_ucx_says_no_gpudirect() -> None:
    """The PyPI libucx has no verbs lanes: never GPUDirect, whatever the kernel allows."""
    from tensorwire.transports.ucx import UcxTransport

    caps = UcxTransport.probe()
    assert caps is not None, UcxTransport.unavailable_reason()
    assert not caps.rdma and not caps.gpudirect


def test_ucx_says_which_protocols_it_used() -> None:
    """UCX_PROTO_INFO=used makes UCX report, as a worker goes, every protocol it selected; the GPU
    test holds cuda_ipc to it. Here, on host memory, the same report must come out at shutdown and
    parse: an 8 MiB message goes rendezvous, on a lane of this machine."""
    from tensorwire.transports.ucx import used_protocols

    proc = _run(
        """
        import asyncio, numpy as np, tensorwire

        async def main():
            async with tensorwire.start("127.0.0.1:0", transports=("ucx",)) as a, \\
                       tensorwire.start("127.0.0.1:0", transports=("ucx",)) as b:
                accepted = asyncio.ensure_future(b.accept())
                pa = await a.connect(b.address)
                pb = await accepted
                x = np.arange(8 << 20, dtype=np.uint8)
                _, got = await asyncio.gather(pa.send(x, tag="x"), pb.recv(tag="x"))
                assert np.array_equal(got, x)

        asyncio.run(main())
        """,
        env={**os.environ, "UCX_PROTO_INFO": "used"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    used = used_protocols(proc.stdout)
    big = [u for u in used if "tag_send" in u.operation and "host" in u.operation and "rendezvous" in u.protocol]
    assert big, f"no rendezvous tag send in UCX's report: {used}\n{proc.stdout[-3000:]}"
    assert all(u.times >= 1 and u.lanes.split("/")[0] in ("cma", "sysv", "posix", "tcp") for u in big), big
    assert not used_protocols("| a | b |\n| 0  0..92 | eager short | sysv/memory |\n| 93..5028 | x | y |"), (
        "rows selected zero times, or without a count, are not 'used'"
    )


def test_ucxx_refusing_device_buffers_is_seen() -> None:
    """Where UCX_TLS leaves cuda_copy out, ucxx refuses device buffers: the probe must see it."""
    code = """
        from tensorwire.transports.ucx._worker import context_cuda_support, ucx_options
        print(context_cuda_support(tuple(sorted(ucx_options().items()))))
    """
    assert _run(code, env={**os.environ, "UCX_TLS": "^cuda_copy"}).stdout.split() == ["False"]
    assert _run(code, env={k: v for k, v in os.environ.items() if k != "UCX_TLS"}).stdout.split() == ["True"]


@pytest.mark.parametrize("options", [{"BOGUS_OPT": "1"}, {"TLS": "nonsense"}, {"RNDV_THRESH": "notanumber"}])
async def test_ucx_options_ucx_refuses_are_a_configuration_error(options: dict[str, str]) -> None:
    """They used to leave ucx unusable without a word, the node quietly on tcp."""
    with pytest.raises(tensorwire.ConfigurationError, match="were refused"):
        await tensorwire.start("127.0.0.1:0", ucx_options=options)
    async with tensorwire.start("127.0.0.1:0", ucx_options={"TLS": "tcp"}) as node:
        assert "ucx" in node.offers


@pytest.mark.parametrize("options", [{"BOGUS_OPT": "1"}, {"RNDV_THRESH": "notanumber"}])
async def test_ucx_config_options_ucx_refuses_are_a_configuration_error_too(options: dict[str, str]) -> None:
    """README and docs/ucx.md give ucx_config(...) as the other way to pass UCX options: ones
    UCX refused there left ucx unusable without a word, every node of the block quietly on tcp."""
    from tensorwire.transports.ucx import ucx_config

    with ucx_config(**options), pytest.raises(tensorwire.ConfigurationError, match="were refused"):
        await tensorwire.start("127.0.0.1:0")
    with ucx_config(TLS="tcp"):
        async with tensorwire.start("127.0.0.1:0") as node:
            assert "ucx" in node.offers
    with ucx_config(**options):  # a node that does not ask for ucx is none of its business
        async with tensorwire.start("127.0.0.1:0", transports=("tcp",)) as node:
            assert list(node.offers) == ["tcp"]


async def test_ucx_options_that_leave_only_cma_say_so_in_the_path() -> None:
    """With TLS="cma" ucx was offered, and every connect, either way, fell back to tcp with UCX's
    bare 'Destination is unreachable': cma only copies, and carries no messages to connect over.
    Such a node now offers no ucx, and both paths say why, naming the option."""
    async with (
        tensorwire.start("127.0.0.1:0", transports=("ucx", "tcp"), ucx_options={"TLS": "cma"}) as cma,
        tensorwire.start("127.0.0.1:0", transports=("ucx", "tcp")) as other,
    ):
        assert "ucx" not in cma.offers
        to_cma = await other.connect(cma.address)
        from_cma = await cma.connect(other.address)
        for peer in (to_cma, from_cma):
            assert peer.path.transport == "tcp"
            reason = dict(peer.path.passed_over)["ucx"]
            assert "ucx_options TLS='cma'" in reason and "carries no messages" in reason, reason
            assert "Destination is unreachable" not in reason, reason


@pytest.mark.parametrize(
    "body",
    [b"\x44", b"\x2f" + bytes(30), b"\x0f" + bytes(200), b""],
    ids=["version-4", "version-15", "version-15-long", "empty"],
)
async def test_a_handshake_with_a_bad_ucx_address_is_refused_and_the_node_lives_on(body: bytes) -> None:
    """A UCX worker address reaches UCX from a handshake, before any proof of a session; UCX
    aborts the process on an address format version it does not know. The node refuses it
    and goes on serving."""
    import grpc

    from tensorwire.control import PROTOCOL_VERSION
    from tensorwire.control._pb import control_pb2, control_pb2_grpc

    async with tensorwire.start(transports=("ucx", "tcp")) as server, tensorwire.start(transports=("ucx",)) as honest:
        request = control_pb2.HandshakeRequest(protocol_version=PROTOCOL_VERSION, node_id="x", preference=["ucx"])
        request.offers.add(name="ucx", version=server.offers["ucx"].version, address=b"TWU1" + body)
        async with grpc.aio.insecure_channel(server.address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await control_pb2_grpc.ControlStub(channel).Handshake(request, timeout=10)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "ucx" in (refused.value.details() or "")
        peer = await honest.connect(server.address)
        x = np.arange(1000, dtype=np.float32)
        await peer.send(x, tag=1)
        assert np.array_equal(await (await server.accept()).recv(tag=1), x)


async def test_a_server_answering_with_a_bad_ucx_address_gets_a_clean_error() -> None:
    """The connecting side hands the server's chosen address to UCX too."""
    import grpc

    from tensorwire.control import PROTOCOL_VERSION
    from tensorwire.control._pb import control_pb2, control_pb2_grpc

    class Hostile(control_pb2_grpc.ControlServicer):
        async def Handshake(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC method name
            resp = control_pb2.HandshakeResponse(
                session_id="s" * 32,
                session_secret=bytes(32),
                server_node_id="h",
                server_instance_id="i" * 32,
                protocol_version=PROTOCOL_VERSION,
            )
            resp.chosen.name, resp.chosen.version, resp.chosen.address = "ucx", version, b"TWU1\x44"
            return resp

    async with tensorwire.start(transports=("ucx",)) as client:
        version = client.offers["ucx"].version
        server = grpc.aio.server()
        control_pb2_grpc.add_ControlServicer_to_server(Hostile(), server)  # type: ignore[no-untyped-call]
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            with pytest.raises(tensorwire.ConnectError, match="not a UCX worker address"):
                await client.connect(f"127.0.0.1:{port}", connect_timeout=5)
        finally:
            await server.stop(0)


@pytest.mark.parametrize("how", ["close", "abort", "fail"])
async def test_a_recv_shut_while_ucx_lands_its_payload_returns_only_after_the_writes(how: str) -> None:
    """The receiver's channel shut (closed, aborted, failed) while UCX lands a large rendezvous
    payload straight into a recv's out= (UCX over tcp moves it fragment by fragment): the recv
    fails, and nothing is written into out= after it returned. UCX cannot take back a receive
    that has matched, so the recv waits for it to end (it used to return at once, and UCX went
    on writing for tens of milliseconds)."""
    src = np.full(128 * MiB, 7, np.uint8)
    with _ucx_config(TLS="tcp"):
        async with connected_pair("ucx", limits=tensorwire.Limits(recv_buffer_bytes=0)) as (a, b):
            out = np.zeros_like(src)
            recv = asyncio.ensure_future(b.recv(tag="big", out=out))
            await asyncio.sleep(0.01)
            send = asyncio.ensure_future(a.send(src, tag="big"))
            async with asyncio.timeout(10):
                while not out[-1] and not out[0] and not recv.done():  # noqa: ASYNC110 - the landing is the point
                    await asyncio.sleep(0)
            assert not recv.done(), "the message landed before the shut"
            if how == "close":
                await b.aclose()
            elif how == "abort":
                b.abort()
            else:
                b.channel.fail(tensorwire.PeerDisconnected("lease ran out"))
            async with asyncio.timeout(5):
                (received,) = await asyncio.gather(recv, return_exceptions=True)
            landed = out.copy()
            await asyncio.sleep(0.3)
            want = tensorwire.PeerDisconnected if how == "fail" else tensorwire.ClosedResourceError
            assert isinstance(received, want), received
            assert "may still be written" not in str(received), "UCX's receive did not end when cancelled"
            assert np.array_equal(out, landed), "out= was written after its recv had failed"
            send.cancel()
            await asyncio.gather(send, return_exceptions=True)


async def test_a_sender_closing_mid_send_over_tcp_says_disconnected_not_garbage(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The sender closes while its payload still fills UCX's tcp lane: its BYE waits in UCX's
    queue, and UCX copies the frame's bytes only when the lane frees up. The receiver gets a
    BYE (its recv fails with PeerDisconnected, or had the whole message), never garbage: the
    frame was a temporary freed before UCX sent it, and the receiver closed the channel on
    "bad frame magic" (ProtocolError), in most runs."""
    src = np.full(32 * MiB, 7, np.uint8)
    with _ucx_config(TLS="tcp"):
        for _ in range(5):
            async with connected_pair("ucx") as (a, b):
                out = np.zeros_like(src)
                recv = asyncio.ensure_future(b.recv(tag="cs", out=out))
                await asyncio.sleep(0.01)
                send = asyncio.ensure_future(a.send(src, tag="cs"))
                async with asyncio.timeout(10):
                    while not send.done() and not recv.done() and not out[0]:  # noqa: ASYNC110 - the landing is the point
                        await asyncio.sleep(0)
                await a.aclose()
                async with asyncio.timeout(5):
                    received, _ = await asyncio.gather(recv, send, return_exceptions=True)
                assert received is out or isinstance(received, tensorwire.PeerDisconnected), repr(received)
                assert "frame magic" not in caplog.text, "the BYE reached the receiver as garbage"


async def test_a_cancelled_ucx_connect_leaves_the_node_open_to_ucx_peers() -> None:
    """A connect cancelled in its ucx handshake (a caller's deadline) gives up its own UCX
    requests only. It used to give up every request the transport owned, the node's hello
    receive among them: from then on no peer could open a ucx channel to that node (each
    connect ran into ConnectError after handshake_seconds)."""
    limits = tensorwire.Limits(handshake_seconds=2.0)
    async with (
        tensorwire.start("127.0.0.1:0", transports=("ucx",), limits=limits) as na,
        tensorwire.start("127.0.0.1:0", transports=("ucx",), limits=limits) as nb,
        tensorwire.start("127.0.0.1:0", transports=("ucx",), limits=limits) as nc,
    ):
        transport: Any = na.transports["ucx"]
        started = asyncio.Event()
        connect = transport.connect

        async def connect_and_say(*args: Any) -> Any:
            started.set()
            return await connect(*args)

        transport.connect = connect_and_say
        task = asyncio.ensure_future(na.connect(nb.address))
        await started.wait()  # A's HELLO is out and it waits for B's WELCOME
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        transport.connect = connect
        async with asyncio.timeout(10):
            peer = await nc.connect(na.address)  # a peer connecting to A
            other = await na.accept()
            await peer.send(np.arange(3), tag=1)
            assert np.array_equal(await other.recv(tag=1), np.arange(3))
            assert peer.path.transport == "ucx", peer.path


def without_libucp(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nodes started from here on find no libucp bindings: their channels post every request
    through ucxx (the path where the bindings fail to load)."""
    from tensorwire.errors import TransportUnavailable
    from tensorwire.transports.ucx import _transport

    def unavailable() -> Any:
        raise TransportUnavailable("the test's: no libucp bindings")

    monkeypatch.setattr(_transport, "load_ucp", unavailable)


async def recv_after_raw_frame(sender: Any, receiver: Any, frame: bytes, then: Any = None) -> object:
    """What a recv waiting at ``receiver`` (tag "x") ends with once ``sender`` posted ``frame``
    raw on its control tag, as its channel posts its own frames (and then sent ``then`` on that
    tag, if given): a result or an error."""
    waiting = asyncio.ensure_future(receiver.recv(tag="x"))
    await asyncio.sleep(0.01)
    sender.channel._send_frame(frame)
    if then is not None:
        await sender.send(then, tag="x")
    async with asyncio.timeout(5):
        (got,) = await asyncio.gather(waiting, return_exceptions=True)
    return got


@pytest.mark.parametrize(
    ("fields", "said"),
    [
        ({"magic": b"EVIL"}, "bad frame magic"),
        ({"ftype": 200}, "unknown frame type 200"),
        ({"flags": 0x80}, "reserved frame bits"),
        ({"check": 1}, "reserved frame bits"),
    ],
    ids=["magic", "type", "flags", "check"],
)
async def test_a_control_frame_that_is_not_one_breaks_the_channel_saying_why(
    fields: dict[str, Any], said: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A control frame with a bad magic, an unknown type or reserved bits set breaks the
    receiving channel with the ProtocolError that says which (the handler decodes a good
    frame's header itself, and leaves a bad one to ``unpack_fields``); a recv waiting there
    fails with it, and the next frame, a good one, is not taken."""
    from tensorwire.transports._frames import HEADER, MAGIC, FrameType

    values = {"magic": MAGIC, "ftype": int(FrameType.CREDIT), "flags": 0, "check": 0, **fields}
    frame = HEADER.pack(values["magic"], values["ftype"], values["flags"], values["check"], 0, 0, 0, 0, 0, 0)
    async with connected_pair("ucx") as (a, b):
        await a.send(np.arange(3), tag="before")
        assert np.array_equal(await b.recv(tag="before"), np.arange(3))
        got = await recv_after_raw_frame(a, b, frame, then=np.arange(4))
        assert isinstance(got, tensorwire.ProtocolError), repr(got)
        assert said in str(got), got
        assert b.channel.state is tensorwire.transports.ChannelState.BROKEN
        assert f"closing ucx channel {b.channel.name}: {said}" in caplog.text


async def test_a_control_frame_larger_than_the_receive_buffer_breaks_the_channel() -> None:
    """A control frame larger than the receiver's control buffer (what its limits let a frame
    carry) is truncated by UCX: the receive fails, and so does the channel, saying so; a recv
    waiting there fails with that error."""
    from tensorwire.transports._frames import FrameType, pack
    from tensorwire.transports.ucx._channel import ctrl_bytes

    async with connected_pair("ucx") as (a, b):
        frame = pack(FrameType.CREDIT) + bytes(ctrl_bytes(b.channel._limits))  # one frame's bytes too many
        got = await recv_after_raw_frame(a, b, frame)
        assert isinstance(got, tensorwire.TransferError), repr(got)
        assert "ucx control receive failed" in str(got) and "truncated" in str(got).lower(), got
        assert b.channel.state is tensorwire.transports.ChannelState.BROKEN


async def test_control_frames_waiting_in_ucx_are_taken_in_one_go() -> None:
    """Frames already waiting in UCX as a control frame is taken (a burst of small sends while
    the receiver's loop was busy) are taken with it, up to ``_CTRL_BURST``, before the task the
    first one woke runs: a burst's payload receives are all posted before UCX moves any payload.
    Counted in messages taken, not time: without the burst, the recv that took the first found
    none of the others taken yet. Over tcp lanes, where one progress round reads many frames
    off the socket: the first matches the posted receive and UCX keeps the others (over shared
    memory a round takes one FIFO entry, and frames wait so behind frames a recv's inline wait
    took)."""
    from tensorwire._peer import tag_id
    from tensorwire.transports.ucx._channel import _CTRL_BURST

    n = 48
    assert n < _CTRL_BURST
    with _ucx_config(TLS="tcp"):
        async with connected_pair("ucx") as (a, b):
            await a.send(np.zeros(1), tag="warm")
            await b.recv(tag="warm")
            x = np.arange(16, dtype=np.int64)
            for i in range(n):  # inline sends: none yields to the loop, so b takes none meanwhile
                x[0] = i
                await a.send(x, tag="burst")
            async with asyncio.timeout(5):
                first = int((await b.recv(tag="burst"))[0])
                taken = len(b.channel.mailbox._arrived.get(tag_id("burst"), ()))
                rest = [int((await b.recv(tag="burst"))[0]) for _ in range(n - 1)]
            assert [first, *rest] == list(range(n))
            assert taken >= 8, f"{taken} of the {n - 1} frames behind the first were taken with it"


@pytest.mark.timeout(120)
async def test_receiving_a_message_of_many_tensors_takes_work_linear_in_them() -> None:
    """The n payload receives of a message of n tensors are watched as one group: a dispatch
    looks at the first one not yet landed, not at all n, so four times the tensors take about
    four times the lines of tensorwire. Watched one by one, each was looked at in every
    dispatch: 1,000 -> 4,000 tensors of 512 bytes over shared memory ran 211,115 -> 1,558,422
    lines (7.4 times). Both sizes are flattened off the loop (``ON_LOOP_LEAVES``), so only the
    number of tensors differs. Counted in lines, never seconds."""

    with _ucx_config(TLS="sm,self"):
        async with connected_pair("ucx") as (a, b):
            await lines_of_a_message(a, b, 1000, 60)  # (the specs and buffers of these shapes made)
            mid, large = await lines_of_a_message(a, b, 1000, 60), await lines_of_a_message(a, b, 4000, 60)
            assert large < 5 * mid, f"1,000 tensors ran {mid} lines of tensorwire, 4,000 ran {large}"
            worker: Any = b.channel._w  # type: ignore[attr-defined]
            assert not worker._groups and not worker._awaited, "the worker still watches a landed message"


async def test_requests_held_for_ucx_cost_a_dispatch_the_same_however_many() -> None:
    """Requests given up while UCX may still write into their memory (a channel cut in the
    middle of a message: its matched receives, ``Worker.hold``) wait in the worker's graveyard
    until UCX completes them. A dispatch asks UCX about one of them still in flight, and about
    each completed one once; asking about each in every dispatch ran 120 -> 4,020 lines of
    tensorwire per dispatch with 100 -> 4,000 held. Their memory still goes only once UCX is
    done with it, and then all of it. Counted in lines, never seconds."""
    from _lines import counting_lines
    from _polling import eventually
    from ucxx._lib.arr import Array

    from tensorwire.transports.ucx._channel import make_tag

    async def per_dispatch(worker: Any, n: int) -> int:
        bufs = [np.empty(64, np.uint8) for _ in range(n)]
        refs = [weakref.ref(buf) for buf in bufs]
        # receives nobody sends to: UCX may write into their memory until they are cancelled
        tag = worker.lib.UCXXTag
        reqs = [worker.worker.tag_recv(Array(buf), tag(make_tag(0x7777, 3, i))) for i, buf in enumerate(bufs)]
        for req, buf in zip(reqs, bufs, strict=True):
            worker.hold(req, buf)
        del bufs, buf
        with counting_lines() as ran:
            for _ in range(50):
                worker._dispatch()
        assert all(ref() is not None for ref in refs), "memory UCX may still write into was let go"
        for req in reqs:
            worker.cancel(req)
        worker.kick()  # (as abandon() does after its cancels)
        await eventually(lambda: not worker._graveyard)
        assert all(ref() is None for ref in refs), "memory of requests UCX completed is still held"
        return ran.count

    with _ucx_config(TLS="sm,self"):
        async with connected_pair("ucx") as (_, b):
            worker: Any = b.channel._w  # type: ignore[attr-defined]
            small, large = await per_dispatch(worker, 100), await per_dispatch(worker, 4000)
    assert large < 2 * small, f"50 dispatches ran {small} lines with 100 requests held, {large} with 4,000"


async def test_ucxx_requests_held_for_ucx_count_as_stranded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the libucp bindings did not load, a channel sends its payloads through ucxx, and a
    send its channel gave up waits in the worker's graveyard of ucxx requests with its payload
    until UCX completes it: a rendezvous whose receiver never took it, never. ``stranded()`` (the
    metrics' ``tensorwire_stranded_*``) counted only the graveyard of raw requests: such a send
    and its memory went unreported. A held request that UCX completes stops counting."""
    from _polling import eventually
    from ucxx._lib.arr import Array

    from tensorwire.transports.ucx._channel import make_tag

    without_libucp(monkeypatch)
    payload, scratch = np.full(4 * MiB, 7, np.uint8), np.empty(MiB, np.uint8)
    with _ucx_config(TLS="sm,self"):
        async with connected_pair("ucx") as (a, _):
            channel: Any = a.channel
            transport = a.node.transports["ucx"]
            assert channel._ucp is None, "the channel went through the libucp bindings"
            # a payload send as _send_payload_ucxx posts it, to a tag nobody receives
            req = channel._ep.tag_send(Array(payload), channel._lib.UCXXTag(make_tag(0x7777, 3, 1)))
            wait = asyncio.ensure_future(channel._wait(req, payload, "payload send"))
            await eventually(lambda: bool(channel._futs))
            assert transport.stranded() == (0, 0)  # (its channel is open: in flight, not stranded)
            await a.aclose()
            (closed,) = await asyncio.gather(wait, return_exceptions=True)
            assert isinstance(closed, tensorwire.ClosedResourceError), closed
            assert not req.completed
            assert transport.stranded() == (1, 4 * MiB)
            assert tensorwire.metrics.snapshot().stranded["ucx"] == (1, 4 * MiB)
            # a receive given up (Worker.hold) counts while UCX may write into its memory
            worker: Any = transport.worker  # type: ignore[attr-defined]
            recv = worker.worker.tag_recv(Array(scratch), worker.lib.UCXXTag(make_tag(0x7777, 3, 2)))
            worker.hold(recv, scratch)
            assert transport.stranded() == (2, 5 * MiB)
            worker.cancel(recv)
            worker.kick()
            await eventually(lambda: transport.stranded() == (1, 4 * MiB))
            del req, recv, wait


async def test_ucxx_payload_sends_held_for_ucx_count_once_and_are_warned_of(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A payload send through ucxx (no libucp bindings) that its channel's close cut off: the
    close's ``abandon`` put it in the graveyard, then ``_send_payload_ucxx`` held it again with
    the others, and ``stranded()`` counted it twice (2, 8 MiB for one 4 MiB send). And the worker
    swept only raw requests: such a send, never completed by UCX, was never warned of."""
    from _polling import eventually

    from tensorwire.transports.ucx import _worker

    caplog.set_level(logging.WARNING, logger="tensorwire.transports.ucx._worker")
    without_libucp(monkeypatch)
    monkeypatch.setattr(_worker, "_SWEEP", 0.05)
    payload = np.full(4 * MiB, 7, np.uint8)
    with _ucx_config(TLS="sm,self"):
        async with connected_pair("ucx") as (a, _):
            channel: Any = a.channel
            transport = a.node.transports["ucx"]
            assert channel._ucp is None, "the channel went through the libucp bindings"
            # a payload whose header never went: its receiver never takes it
            send = asyncio.ensure_future(channel._send_payload_ucxx(0x7777, [memoryview(payload)]))
            await eventually(lambda: bool(channel._futs))
            await a.aclose()
            (closed,) = await asyncio.gather(send, return_exceptions=True)
            assert isinstance(closed, tensorwire.ClosedResourceError), closed
            del send, closed
            assert transport.stranded() == (1, 4 * MiB)
            await eventually(lambda: "never completed by UCX" in caplog.text, seconds=10, pause=0.05)
            assert "1 sends" in caplog.text and "4.0 MiB" in caplog.text, caplog.text


async def test_raw_receives_cut_off_while_landing_count_as_stranded() -> None:
    """A raw receive cancelled while its message was landing (its channel shut: ``abandon``)
    keeps its buffer until UCX has written the rest (``Worker._raw_recv_gone``): memory the node
    keeps for UCX, which ``stranded()`` did not count. Here the sender's worker stops
    progressing in the middle of a 32 MiB eager message over tcp (a cancel ends a receive that
    has not matched yet, or a rendezvous one that has; not this one, which needs the sender to
    send the rest); once it runs again the receive lands and stops counting."""
    from _polling import eventually

    from tensorwire.transports.ucx._channel import make_tag

    with _ucx_config(TLS="tcp", RNDV_THRESH="inf"):
        async with connected_pair("ucx") as (a, b):
            sender: Any = a.node.transports["ucx"].worker  # type: ignore[attr-defined]
            receiver: Any = b.node.transports["ucx"].worker  # type: ignore[attr-defined]
            transport = b.node.transports["ucx"]
            assert receiver._ucp is not None, "no libucp bindings"
            tag = make_tag(0x7777, 3, 9)
            buf, data = np.zeros(32 * MiB, np.uint8), np.full(32 * MiB, 5, np.uint8)
            owner, landed = object(), []
            ptr = receiver._ucp.tag_recv(receiver.handle, buf.ctypes.data, buf.nbytes, tag)
            assert ptr is not None
            receiver.listen_raw(receiver._ucp, ptr, landed.append, keep=buf, owner=owner)
            ucp, progress = sender._ucp, sender._progress

            def paused() -> None:  # (the sender's worker stops progressing)
                sender._scheduled = False

            sender._progress = paused
            try:
                sent = ucp.tag_send_at(a.channel.endpoint_handle, data.ctypes.data, data.nbytes, tag)  # type: ignore[attr-defined]
                assert sent is not None
                sender.keep_raw(ucp, sent, data, owner=a.channel)
                for _ in range(100):  # its first fragments out (a socket's worth), and no more
                    sender.worker.progress_once()
                await asyncio.sleep(0.2)  # (the receiver matched it, and waits for the rest)
                assert not landed and not ucp.request_done(sent)
                receiver.abandon(owner)
                assert ptr in receiver._raw_recv_gone, "the receive ended as it was cancelled"
                assert transport.stranded() == (1, 32 * MiB)
            finally:
                sender._progress = progress
                sender.kick()
            waited = sender.wait_raw(sent, "the test's send")
            if waited is not None:
                await asyncio.wait_for(waited, 30)
            await eventually(lambda: transport.stranded() == (0, 0), seconds=10)
            assert np.array_equal(buf, data)
