"""The conformance suite over every transport available here.

ucx runs twice: over UCX's tcp transport only, and over shared memory (UCX's default choice on
one machine). The UCX options go to the node's UCX context through ``ucx_config``, never through
the environment.
"""

import asyncio
import contextlib
import importlib.util
from typing import Any

import pytest
from _lines import lines_of_a_message

from tensorwire.memory import HostEngine
from tensorwire.testing import CHECKS, connected_pair

_NO_UCXX = importlib.util.find_spec("ucxx") is None
_ucx = pytest.mark.skipif(_NO_UCXX, reason="ucxx is not installed (pip install 'tensorwire[ucx]')")

# (transport, UCX options) by test id
VARIANTS = {
    "tcp": ("tcp", None),
    "inproc": ("inproc", None),
    "ucx-tls=tcp": ("ucx", {"TLS": "tcp"}),
    "ucx-tls=sm": ("ucx", {"TLS": "sm,self"}),
}
TRANSPORTS = [pytest.param(v, id=v, marks=_ucx if v.startswith("ucx") else ()) for v in VARIANTS]


def _options(variant: str) -> contextlib.AbstractContextManager[None]:
    options = VARIANTS[variant][1]
    if options is None:
        return contextlib.nullcontext()
    from tensorwire.transports.ucx import ucx_config

    return ucx_config(**options)


@pytest.mark.parametrize("variant", TRANSPORTS)
@pytest.mark.parametrize("name", list(CHECKS))
async def test_conformance(variant: str, name: str) -> None:
    with _options(variant):
        async with connected_pair(VARIANTS[variant][0], check=name) as (a, b):
            await CHECKS[name](a, b)


async def test_exchange_refuses_an_unknown_order() -> None:
    import numpy as np

    import tensorwire
    from tensorwire.testing import exchange

    async with connected_pair("inproc") as (a, b):
        with pytest.raises(tensorwire.ConfigurationError, match="recv-first"):
            await exchange(a, b, np.zeros(4), np.zeros(4), "sideways")


async def test_the_cancel_checks_size_their_message_by_how_long_its_landing_lasts() -> None:
    """The recv-cancel checks take the smallest message whose landing lasts more than twice their
    last cancel's loop turns (Soft-RoCE lands 4 MiB in hundreds of turns, tcp 16 MiB in tens).
    inproc lands up to 4 MiB in 5 turns, 8 MiB in 6 and 16 MiB in 8 (into out= or not)."""
    from tensorwire.testing._conformance import MiB, _landing_size

    async with connected_pair("inproc") as (a, b):
        assert await _landing_size(a, b, 32 * MiB, turns=2) == MiB
        assert await _landing_size(a, b, 32 * MiB, turns=2, above=4 * MiB) == 8 * MiB, "not past `above`"
        assert await _landing_size(a, b, 32 * MiB, turns=3, out=True) == 16 * MiB
        assert await _landing_size(a, b, 24 * MiB, turns=100) == 24 * MiB, "none lasts: the cap"
        assert await _landing_size(a, b, 32 * MiB, turns=0, seconds=30.0) == 32 * MiB, "none lasts 30 s"


@pytest.mark.parametrize("variant", TRANSPORTS)
async def test_the_cancelled_recv_check_holds_where_its_messages_go_rendezvous(variant: str) -> None:
    """The check that a cancelled recv loses nothing waits for its message's send before the recv
    that takes the message; a message that goes rendezvous (past the receiver's credit, or with
    the credit of the check's earlier messages not back yet: seen over tcp with checksums, one
    run of test_integrity.py in 6-12) is sent only once a recv takes it. Before, it waited for
    that send first, for good."""
    import tensorwire

    name = "cancelled_recv_loses_nothing"
    with _options(variant):
        async with connected_pair(VARIANTS[variant][0], limits=tensorwire.Limits(recv_buffer_bytes=1 << 20)) as (a, b):
            await asyncio.wait_for(CHECKS[name](a, b), 30)


@pytest.mark.parametrize("variant", TRANSPORTS)
async def test_the_withdrawal_check_withdraws_messages_while_a_recv_waits_behind(variant: str) -> None:
    """The check that a recv whose message was withdrawn keeps its place tests something only
    where some of its withdrawals reach the receiver while the recv posted after it still waits
    (it then sends the next message 0-2 loop turns after the cancel, so that its header and the
    withdrawal come in the same pass): on every transport here, some do."""
    from tensorwire.testing._conformance import _withdraw_in_front

    name = "recvs_posted_in_order_take_messages_in_order_when_a_send_is_withdrawn"
    with _options(variant):
        async with connected_pair(VARIANTS[variant][0], check=name) as (a, b):
            assert await _withdraw_in_front(a, b) > 0


@pytest.mark.parametrize("variant", TRANSPORTS)
async def test_closed_channels_are_let_go(variant: str) -> None:
    """A transport holds a channel only until it closes: closed peers, their channels and the
    messages they never delivered are freed while the nodes live on (inproc kept every
    channel, and 4 MiB unreceived in each, until its transport closed)."""
    import gc
    import weakref

    import numpy as np

    import tensorwire

    transport = VARIANTS[variant][0]
    with _options(variant):
        async with (
            tensorwire.start("127.0.0.1:0", transports=(transport,)) as na,
            tensorwire.start("127.0.0.1:0", transports=(transport,)) as nb,
        ):
            channels = []
            for _ in range(3):
                p = await na.connect(nb.address)
                q = await nb.accept()
                await p.send(np.ones(4 << 20, np.uint8), tag=1)  # buffered at q, never received
                await asyncio.sleep(0.01)
                channels += [weakref.ref(p.channel), weakref.ref(q.channel)]
                await p.aclose()
                await q.aclose()
                del p, q
            async with asyncio.timeout(5):
                while any(ref() is not None for ref in channels):
                    gc.collect()
                    await asyncio.sleep(0.01)  # a transport's closing tasks may hold one a moment


@pytest.mark.parametrize("variant", TRANSPORTS)
async def test_failed_channel_fails_the_peers_work_promptly(variant: str) -> None:
    """``Channel.fail`` (a lost lease or session) fails the peer's pending recvs and sends at
    once with PeerDisconnected, well before its own lease of the failed node would run out:
    inproc tells the peer, tcp shuts the connection, ucx posts a BYE on its way out (it sent
    nothing, and its peer learned it only from the lease)."""
    import numpy as np

    import tensorwire

    with _options(variant):
        async with connected_pair(VARIANTS[variant][0], limits=tensorwire.Limits(recv_buffer_bytes=0)) as (a, b):
            recv = asyncio.ensure_future(b.recv(tag="r"))
            send = asyncio.ensure_future(b.send(np.ones(1 << 20, np.uint8), tag="s"))  # rendezvous, never received
            await asyncio.sleep(0.05)
            assert not recv.done() and not send.done()
            a.channel.fail(tensorwire.PeerDisconnected("lease ran out"))
            for fut in (recv, send):
                with pytest.raises(tensorwire.PeerDisconnected):
                    async with asyncio.timeout(1):  # a lease is 3 s
                        await fut


@pytest.mark.parametrize("closer", ["peer", "node"])
@pytest.mark.parametrize("variant", TRANSPORTS)
async def test_work_pending_at_a_peer_that_closes_and_lives_on_ends_at_once(variant: str, closer: str) -> None:
    """A peer closes gracefully (its ``Peer``, or its node) and its process lives on, with a
    message it never received (eager: buffered there), one that waits for its recv (rendezvous)
    and a recv of ours pending. The eager send has its receipt (its message was handed over,
    then dropped unread with the channel); the rendezvous send and the recv fail with
    PeerDisconnected saying that the peer closed, at once, not when our lease of it (30 s) runs
    out. (Over ucx a rendezvous message whose CTS went before its recv was cancelled ends as the
    eager one does: test_ucx_edges.py.)"""
    import numpy as np

    import tensorwire

    limits = tensorwire.Limits(recv_buffer_bytes=1 << 20)
    with _options(variant):
        async with connected_pair(VARIANTS[variant][0], limits=limits, lease_seconds=30.0) as (a, b):
            eager = await a.send(np.ones(256 << 10, np.uint8), tag="eager")  # (within the credit)
            rendezvous = asyncio.ensure_future(a.send(np.ones(8 << 20, np.uint8), tag="rendezvous"))
            recv = asyncio.ensure_future(a.recv(tag="back"))
            await asyncio.sleep(0.05)
            assert not rendezvous.done() and not recv.done()
            await (b.aclose() if closer == "peer" else b.node.aclose())
            for fut in (rendezvous, recv):
                with pytest.raises(tensorwire.PeerDisconnected, match="closed"):
                    async with asyncio.timeout(10):  # (the lease is 30 s)
                        await fut
            assert eager.nbytes == 256 << 10


@pytest.mark.timeout(60)
@pytest.mark.parametrize("variant", TRANSPORTS)
async def test_a_message_of_many_tensors_takes_work_linear_in_them(variant: str) -> None:
    """Sending and receiving a message of n tensors runs tensorwire code in proportion to n,
    counted in lines executed rather than seconds: four times the tensors take about four times
    the lines. Finding the tensor that holds a payload offset scanned every tensor
    (``Arrival.view``), so 8,000 one-element arrays took 26 s on inproc and 10,000 took 4.6 s on
    tcp, with the event loop blocked long enough for leases to lapse."""
    with _options(variant):
        async with connected_pair(VARIANTS[variant][0]) as (a, b):
            small, large = await lines_of_a_message(a, b, 250), await lines_of_a_message(a, b, 1000)
    assert large < 6 * small, f"250 tensors ran {small} lines of tensorwire, 1000 ran {large}"


class _RefusingCopiesOut(HostEngine):
    """A host engine (standing in for a GPU) whose copies out of device memory fail as they are
    queued, as a GPU's do after a CUDA error."""

    def _new_lane(self) -> Any:
        lane = super()._new_lane()

        def to_host(*args: object) -> None:
            raise RuntimeError("device error: a copy to host failed")

        lane.to_host = to_host
        return lane


@pytest.mark.parametrize("variant", TRANSPORTS)
async def test_a_send_whose_copy_out_of_device_memory_fails_raises_a_transfer_error(variant: str) -> None:
    """A send of device memory whose copies out of it fail raises TransferError with the device's
    error as its cause, delivers nothing (the recv posted for it takes the next message on its
    tag) and leaves the channel open; an owner-assisted read of such a tensor is answered with
    the error. Over inproc and ucx, which copy device memory through host memory of theirs before
    anything goes, the send raised the device's RuntimeError bare, and a read of it waited for
    good (the owner answers TensorWireErrors only)."""
    import numpy as np

    import tensorwire
    from tensorwire.tensors import EngineArray
    from tensorwire.transports import ChannelState

    engine = _RefusingCopiesOut()
    data = np.arange(200_000, dtype=np.uint8)
    try:
        with _options(variant):
            async with connected_pair(VARIANTS[variant][0]) as (a, b):
                recv = asyncio.ensure_future(b.recv(tag="x"))
                async with asyncio.timeout(10):
                    with pytest.raises(tensorwire.TransferError) as failed:
                        await a.send(EngineArray(engine, data), tag="x")
                    assert isinstance(failed.value.__cause__, RuntimeError), repr(failed.value)
                    await a.send(np.arange(7), tag="x")
                    assert np.array_equal(await recv, np.arange(7)), "the failed send delivered something"
                    a.node.expose(EngineArray(engine, data), name="t")
                    with pytest.raises(tensorwire.TransferError):
                        await b.read(await b.lookup("t"), out=np.zeros_like(data))
                assert a.channel.state is ChannelState.OPEN and b.channel.state is ChannelState.OPEN
    finally:
        engine.close()


@pytest.mark.parametrize("variant", TRANSPORTS)
async def test_a_peers_repr_counts_the_users_recvs_and_sends_apart(variant: str) -> None:
    """``repr(peer)`` says how many of the user's recvs and sends are under way, apart: none for
    an idle peer whose node has served calls and one-sided reads, a recv waiting on the side
    that waits, a send waiting for its recv (every message waits for its recv here) on the side
    that sends. It said 3 for an idle peer (tensorwire's own standing recvs were counted), and
    then one ``in_flight`` that summed the user's recvs with every send the channel moved,
    tensorwire's own among them (an owner's answers to reads, RPC requests and replies)."""
    import numpy as np
    from _polling import eventually

    from tensorwire.transports import Limits

    def counts(peer: Any) -> str:
        return " ".join(repr(peer).split()[-2:])

    with _options(variant):
        async with connected_pair(VARIANTS[variant][0], limits=Limits(recv_buffer_bytes=0)) as (a, b):

            @b.node.method()
            async def one() -> int:
                return 1

            assert await a.call("one") == 1
            b.node.expose(np.arange(4), name="x")
            assert np.array_equal(await a.read(await a.lookup("x")), np.arange(4))
            await eventually(lambda: counts(a) == counts(b) == "recvs=0 sends=0>")
            waiting = asyncio.ensure_future(b.recv(tag="t"))
            await eventually(lambda: counts(b) == "recvs=1 sends=0>")
            assert counts(a) == "recvs=0 sends=0>", repr(a)
            await a.send(np.arange(3), tag="t")
            assert np.array_equal(await waiting, np.arange(3))
            await eventually(lambda: counts(b) == "recvs=0 sends=0>")
            sending = asyncio.ensure_future(a.send(np.arange(5), tag="u"))  # (waits for its recv)
            await eventually(lambda: counts(a) == "recvs=0 sends=1>")
            assert not sending.done() and counts(b) == "recvs=0 sends=0>", repr(b)
            assert np.array_equal(await b.recv(tag="u"), np.arange(5))
            await sending
            assert counts(a) == "recvs=0 sends=0>", repr(a)


def test_time_scale_lengthens_the_checks_bounds_and_nothing_else() -> None:
    """``time_scale`` multiplies each bound of the checks' waits (nested scales multiply, and the
    bound is back once it ends); it cannot shorten them."""
    from tensorwire.testing import _conformance, time_scale

    assert _conformance._s(10) == 10
    with time_scale(3):
        assert _conformance._s(10) == 30
        with time_scale(2):
            assert _conformance._s(10) == 60
        assert _conformance._s(10) == 30
    assert _conformance._s(10) == 10
    for bad in (0.5, 0, float("nan")):
        with pytest.raises(ValueError, match="factor of 1 or more"), time_scale(bad):
            pass
    assert _conformance._s(10) == 10
