"""The pending-session table every transport's server side admits HELLOs through: the one place
that says which session ids are waiting, checks a HELLO's proof, and refuses a used id."""

from __future__ import annotations

import asyncio
import hmac
from typing import cast

import pytest

from tensorwire.errors import ConnectError, ProtocolError
from tensorwire.transports import Channel, Limits, Session, TransportContext
from tensorwire.transports._base import PendingSessions
from tensorwire.transports.inproc import InprocTransport

pytestmark = pytest.mark.timeout(30)


def _session(sid: str = "s1", secret: bytes = b"k" * 32) -> Session:
    return Session(sid, secret, "server", "client", Limits())


def _holds(secret: bytes):  # type: ignore[no-untyped-def]
    return lambda s: hmac.compare_digest(s.secret, secret)


async def test_admit_returns_the_waiting_entry_and_its_future_resolves() -> None:
    table = PendingSessions()
    s = _session()
    fut = table.expect(s)
    session, got = table.admit(b"s1", _holds(s.secret))
    assert session is s and got is fut and not fut.done()
    channel = cast(Channel, object())
    got.set_result(channel)
    assert await fut is channel
    await asyncio.sleep(0)  # the done-callback forgets the entry
    with pytest.raises(ProtocolError, match="unknown or already used session id"):
        table.admit("s1", _holds(s.secret))  # once resolved, the id opens nothing more


@pytest.mark.parametrize("sid", [b"nope", "nope", b"\xff\xfe"])
async def test_unknown_id_is_refused_before_any_proof_is_checked(sid: bytes | str) -> None:
    table = PendingSessions()
    table.expect(_session())
    asked: list[Session] = []
    with pytest.raises(ProtocolError, match="unknown or already used session id"):
        table.admit(sid, lambda s: asked.append(s) or True)  # type: ignore[func-returns-value]
    assert asked == []


async def test_wrong_proof_is_refused_and_the_session_still_waits_for_its_owner() -> None:
    table = PendingSessions()
    s = _session()
    fut = table.expect(s)
    with pytest.raises(ProtocolError, match="wrong session secret"):
        table.admit("s1", _holds(b"x" * 32))
    assert not fut.done()
    assert table.admit("s1", _holds(s.secret))[1] is fut


async def test_a_done_entry_not_yet_forgotten_is_refused() -> None:
    """Between a future's completion and its done-callback (one loop turn) the entry is still in
    the table: a HELLO arriving then is refused as no longer pending, not admitted twice."""
    table = PendingSessions()
    s = _session()
    fut = table.expect(s)
    fut.cancel()
    with pytest.raises(ProtocolError, match="session no longer pending"):
        table.admit("s1", _holds(s.secret))
    await asyncio.sleep(0)
    with pytest.raises(ProtocolError, match="unknown or already used session id"):
        table.admit("s1", _holds(s.secret))


async def test_an_old_future_ending_does_not_forget_a_newer_expect_of_the_same_id() -> None:
    table = PendingSessions()
    s = _session()
    old = table.expect(s)
    new = table.expect(s)
    old.cancel()
    await asyncio.sleep(0)
    assert table.admit("s1", _holds(s.secret))[1] is new


async def test_cancel_all_cancels_every_waiting_future() -> None:
    table = PendingSessions()
    futs = [table.expect(_session(f"s{i}")) for i in range(3)]
    channel = cast(Channel, object())
    futs[0].set_result(channel)
    table.cancel_all()
    assert futs[0].result() is channel and all(f.cancelled() for f in futs[1:])
    assert len(table) == 3
    await asyncio.sleep(0)
    assert len(table) == 0


async def test_inproc_connect_says_why_the_server_refused() -> None:
    caps = InprocTransport.probe()
    assert caps is not None
    ctx = TransportContext(node_id="n", host="127.0.0.1", limits=Limits())
    server, client = InprocTransport(ctx, caps), InprocTransport(ctx, caps)
    try:
        address = await server.listen()
        s = _session()
        waiting = asyncio.ensure_future(server.expect(s))
        with pytest.raises(ConnectError, match="rejected the session: wrong session secret"):
            await client.connect(address, _session(secret=b"z" * 32))
        with pytest.raises(ConnectError, match="rejected the session: unknown or already used session id"):
            await client.connect(address, _session("other"))
        assert not waiting.done()
        ch = await client.connect(address, s)
        assert (await waiting) is not ch and ch.state.value == "open"
        late = asyncio.ensure_future(server.expect(_session("late")))
        await server.aclose()  # cancels what still waits
        assert late.cancelled()
    finally:
        await server.aclose()
        await client.aclose()
