"""A recv cancelled while it copies a buffered message into its out=, or after a small message
was delivered straight into its out= but before its task resumed, gives the message back to its
tag's queue; until a later recv takes it, the message still sits in this side's buffer and must
still count against what the sender was granted (``Limits.recv_buffer_bytes``)."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import itertools
import time
from typing import Any

import numpy as np
import pytest
from _polling import eventually

import tensorwire
from tensorwire._peer import tag_id
from tensorwire.tensors import prepare
from tensorwire.tensors._offload import OFF_LOOP_BYTES
from tensorwire.testing import connected_pair
from tensorwire.transports._mailbox import Arrival, _Delivered

MiB = 1 << 20

pytestmark = pytest.mark.timeout(90)

_N = 2 * OFF_LOOP_BYTES  # its copy into out= runs in a copy thread, and it fills the whole credit


def _filled_by(n: int) -> int:
    """The credit that an n-byte message fills (goes eager into, leaving less than n): tcp and ucx keep
    the last eighth of the credit for small messages (``SendWindow.keep``)."""
    return -(-8 * n // 7)


_TRANSPORTS = [
    "tcp",
    "inproc",
    pytest.param(
        "ucx",
        marks=pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="ucxx is not installed"),
    ),
]


@pytest.mark.parametrize("transport", _TRANSPORTS)
async def test_a_message_given_back_by_a_recv_cancelled_mid_copy_still_holds_its_buffer_credit(
    transport: str,
) -> None:
    """An eager message that fills the receiver's whole buffer credit arrives before its recv; the
    recv (into out=) is cancelled after 0..11 loop turns, some of them while its copy into out=
    runs in a copy thread. Whenever the recv was cancelled, the message is still buffered here,
    so a second such message must not come eager on top of it: its send waits for a recv and goes
    rendezvous. Before, the message's slot and credit went back to the sender as the copy began,
    and stayed given when the cancelled recv requeued it: the second send went eager and both
    messages sat in the receiver's memory, twice the recv_buffer_bytes it grants."""
    limits = tensorwire.Limits(recv_buffer_bytes=_filled_by(_N))
    mid_copy = 0
    async with connected_pair(transport, limits=limits) as (a, b):
        mailbox = b.channel.mailbox
        tag = tag_id("t")
        for turns in range(12):
            x = np.full(_N, turns + 1, np.uint8)
            sent = await asyncio.wait_for(a.send(x, tag="t"), 10)
            assert sent.protocol == "eager", sent
            # the whole message waits here, buffered, before any recv is posted
            await eventually(lambda: (m := mailbox.oldest(tag)) is not None and m.done.done(), 10, 0)
            out = np.zeros(_N, np.uint8)
            recv = asyncio.ensure_future(b.recv(tag="t", out=out))
            for _ in range(turns):
                await asyncio.sleep(0)
            recv.cancel()
            try:
                await recv
            except asyncio.CancelledError:
                # the copy into out= ends before the cancel returns: all of it or none of it
                assert np.array_equal(out, x) or not out.any()
                mid_copy += bool(out.any())
                follow = asyncio.ensure_future(a.send(np.full(_N, 200, np.uint8), tag="t"))
                await asyncio.sleep(0.1)  # time for credit the receiver gave back to reach the sender
                assert not follow.done(), (
                    f"after {turns} turns: a second {_N}-byte message went eager while the first, given back "
                    "by its cancelled recv, still filled the receiver's buffer credit"
                )
                got = await asyncio.wait_for(b.recv(tag="t"), 10)
                assert np.array_equal(got, x)
                assert (await asyncio.wait_for(b.recv(tag="t"), 10) == 200).all()
                assert (await asyncio.wait_for(follow, 10)).protocol == "rendezvous"
            else:
                assert np.array_equal(out, x)
            # a frame from the receiver brings back the credit its recvs returned: the next
            # message goes eager again
            ping = asyncio.ensure_future(b.send(np.zeros(1, np.uint8), tag="ping"))
            await asyncio.wait_for(a.recv(tag="ping"), 10)
            await asyncio.wait_for(ping, 10)
    assert mid_copy, "no recv was cancelled during its copy into out=: the test proved nothing"


_SMALL = 256  # its bytes ride with its header: the express path (tcp's read-ahead, ucx's inline)


@pytest.mark.parametrize("transport", _TRANSPORTS)
async def test_a_message_delivered_to_a_recv_cancelled_before_it_resumed_still_holds_its_buffer_credit(
    transport: str,
) -> None:
    """A recv (into out=) is posted, a small message comes, and the recv is cancelled once the
    message landed in its out= and woke it (its posted entry gone) but before its task resumed:
    it gives the message back to the queue. That message is still buffered here, and fills the
    receiver's whole buffer credit, so the next message must come rendezvous, not eager; both
    are then received once each, in order, and the credit all goes back. Before, tcp and ucx
    gave an express delivery's slot and credit back as it landed (``Mailbox.deliver``), and
    the given-back message held none: the next one came eager on top of it. (inproc delivers
    no message express; there the same window is the general path's.)"""
    limits = tensorwire.Limits(recv_buffer_bytes=_filled_by(_SMALL))
    hits = express = 0
    async with connected_pair(transport, limits=limits) as (a, b):
        mailbox = b.channel.mailbox
        tag = tag_id("t")

        async def flush_credit() -> None:
            # a frame from the receiver brings back all the credit its recvs have returned
            ping = asyncio.ensure_future(b.send(np.zeros(1, np.uint8), tag="ping"))
            await asyncio.wait_for(a.recv(tag="ping"), 10)
            await asyncio.wait_for(ping, 10)

        for i in range(24):
            x = np.full(_SMALL, i + 1, np.uint8)
            out = np.zeros(_SMALL, np.uint8)
            recv = asyncio.ensure_future(b.recv(tag="t", out=out))
            await eventually(lambda: mailbox.has_posted(tag), 10, 0)
            posted = mailbox._posted[tag][0]
            send = asyncio.ensure_future(a.send(x, tag="t"))
            # polled every loop turn: the recv's entry goes as the message is handed to it, and its task
            # resumes a turn later at the earliest (what woke it runs after this task's turn)
            await eventually(lambda: not mailbox.has_posted(tag), 10, 0)
            recv.cancel()
            sent = await asyncio.wait_for(send, 10)
            assert sent.protocol != "rendezvous", f"turn {i}: the receiver kept credit it had been given back"
            try:
                await recv
            except asyncio.CancelledError:
                hits += 1
                express += isinstance(posted.future.result(), _Delivered)
                given = mailbox.oldest(tag)
                assert given is not None and given.done.done(), "the cancelled recv lost its message"
                await flush_credit()
                follow = asyncio.ensure_future(a.send(np.full(_SMALL, 200, np.uint8), tag="t"))
                await eventually(lambda: len(mailbox._arrived.get(tag, ())) == 2, 10)  # its header came
                assert (await asyncio.wait_for(b.recv(tag="t"), 10) == x).all()
                assert (await asyncio.wait_for(b.recv(tag="t"), 10) == 200).all()
                assert (await asyncio.wait_for(follow, 10)).protocol == "rendezvous", (
                    f"turn {i}: a second {_SMALL}-byte message went eager while the first, given back by its "
                    "cancelled recv, still filled the receiver's buffer credit"
                )
            else:
                assert np.array_equal(out, x)
            await flush_credit()
        assert mailbox.oldest(tag) is None
        budget = getattr(b.channel, "_budget", None)  # (tcp, ucx; inproc counts at its sender)
        if budget is not None:
            assert (budget._used_slots, budget._used_credit) == (0, 0), "a message's slot or credit never went back"
    assert hits, "no recv was cancelled between its message's delivery and its task's resumption"
    if transport != "inproc":
        assert express, "no cancelled recv had its message delivered express: the test proved nothing"


@pytest.mark.parametrize(
    ("transport", "options"),
    [("tcp", {}), ("tcp", {"checksum": True}), ("inproc", {})],
    ids=["tcp", "tcp-checksum", "inproc"],
)
async def test_a_recv_cancelled_part_way_through_a_large_payload_lets_the_loop_run_while_it_gives_it_back(
    transport: str, options: dict[str, object]
) -> None:
    """A large recv into out= is cancelled with half its payload landed there. Giving the message
    back copies what landed out of out= into a buffer of ours: that copy runs in a copy thread
    while the loop goes on (before, the whole tensor was copied on the loop: 4.3 s for 1 GiB over
    tcp, long enough for a peer's lease on this node to run out), the rest of the payload lands
    in our buffer meanwhile, a recv that takes the message during the cancel waits for the copy,
    and nothing touches out= once the cancel has returned. (With tcp's checksums, the frame's
    crc32c is taken over the bytes once they are copied into ours.)"""
    n = 64 << 20
    x = (np.arange(n, dtype=np.uint32) % 251).astype(np.uint8) + 1
    out = np.zeros(n, np.uint8)
    async with connected_pair(transport, **options) as (a, b):
        mailbox = b.channel.mailbox
        tag = tag_id("t")
        send = asyncio.ensure_future(a.send(x, tag="t"))
        recv = asyncio.ensure_future(b.recv(tag="t", out=out))
        await eventually(lambda: bool(out[n // 2]) or recv.done(), 30, 0)
        assert not recv.done()
        turns = 0
        later: list[asyncio.Future[object]] = []

        async def spin() -> None:
            nonlocal turns
            while True:
                if recv.done():
                    return
                turns += 1
                if not later and mailbox.oldest(tag) is not None:  # given back: a recv may take it now
                    later.append(asyncio.ensure_future(b.recv(tag="t")))
                await asyncio.sleep(0)

        spinner = asyncio.ensure_future(spin())
        recv.cancel()
        with pytest.raises(asyncio.CancelledError):
            await recv
        out[:] = 0xEE  # the caller's again: nothing may write into it from here on
        await spinner
        assert turns >= 3, "the loop stood still while the cancelled recv gave its message back"
        assert later, "the message was not given back to the queue"
        got = await asyncio.wait_for(later[0], 30)
        await asyncio.wait_for(send, 30)
        assert np.array_equal(got, x)
        assert (out == 0xEE).all()


@pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="ucxx is not installed")
async def test_a_recv_cancelled_after_its_message_matched_but_before_it_pulled_gives_it_back_without_a_copy() -> None:
    """Over ucx, a 128 MiB rendezvous message's header matches a recv into out=, and the recv is
    cancelled before its task resumes to post the payload receive: nothing landed in out=, and
    nothing will. The message goes back with no buffer, so the cancel holds the loop for no
    copy; before, the mailbox (which cannot tell over ucx how far a payload has landed) copied
    all of out= into a new buffer of ours on the loop: 3.7 s for 1 GiB between two processes,
    long enough for a peer's lease on this node to run out. The longest the loop stood still
    during the cancel is compared with that very copy, made here in the same run."""
    n = 128 * MiB
    x = np.resize(np.arange(1, 200, dtype=np.uint8), n)  # never 0xEE
    out = np.full(n, 0xEE, np.uint8)
    copy = float("inf")  # what the cancel did before: a new buffer, and out= copied into it
    for _ in range(3):  # the quickest of three, on a machine that others share
        began = time.perf_counter()
        np.copyto(np.empty_like(out), out)
        copy = min(copy, time.perf_counter() - began)
    async with connected_pair("ucx", limits=tensorwire.Limits(recv_buffer_bytes=0)) as (a, b):
        mailbox = b.channel.mailbox
        tag = tag_id("t")
        recv = asyncio.ensure_future(b.recv(tag="t", out=out))
        await eventually(lambda: mailbox.has_posted(tag), 10, 0)
        send = asyncio.ensure_future(a.send(x, tag="t"))
        # polled every turn: the header matched the recv (it is posted no more) a turn at most
        # ago, and the recv's task, woken by it, has yet to run
        await eventually(lambda: not mailbox.has_posted(tag) or recv.done(), 30, 0)
        assert not recv.done()
        recv.cancel()
        stall, last = 0.0, time.perf_counter()
        while not recv.done():
            await asyncio.sleep(0)
            now = time.perf_counter()
            stall, last = max(stall, now - last), now
        with pytest.raises(asyncio.CancelledError):
            await recv
        assert (out == 0xEE).all(), "the payload began to land before the cancel: the test missed its moment"
        got = await asyncio.wait_for(b.recv(tag="t"), 30)
        await asyncio.wait_for(send, 30)
        assert np.array_equal(got, x)
        assert (out == 0xEE).all()
    assert stall < copy / 10, (
        f"the cancel held the loop {stall * 1e3:.1f} ms; out= copied into a new buffer takes {copy * 1e3:.1f} ms here"
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", _TRANSPORTS)
async def test_a_message_given_back_goes_to_the_recv_that_waited_behind_the_cancelled_one(transport: str) -> None:
    """Recv A takes a 64 MiB message and is cancelled part way; recv B, posted on the same tag
    while A held it, must get that message, and the next message comes after. Before, the
    message went back to the queue while B stayed posted, so B took the next message (3 bytes)
    first and the 64 MiB one waited for a later recv: the tag's order was broken."""
    n = 64 * MiB
    x = np.full(n, 1, np.uint8)
    for _ in range(5):  # a message that landed whole before the cancel misses the point: again
        out = np.zeros(n, np.uint8)
        async with connected_pair(transport) as (a, b):
            sending = asyncio.ensure_future(a.send(x, tag=1))
            first = asyncio.ensure_future(b.recv(tag=1, out=out))
            await eventually(lambda out=out: bool(out[n // 4]), 30, pause=0)
            behind = asyncio.ensure_future(b.recv(tag=1))
            await eventually(lambda: b.channel.mailbox.has_posted(tag_id(1)), 10, pause=0)
            first.cancel()
            try:
                await first
            except asyncio.CancelledError:
                pass
            else:  # it had landed whole
                behind.cancel()
                continue
            async with asyncio.timeout(30):
                await sending
            second = asyncio.ensure_future(a.send(np.full(3, 2, np.uint8), tag=1))
            async with asyncio.timeout(30):
                got = await behind
            assert got.shape == (n,) and bool((got == 1).all()), f"the recv behind got {got.shape} first"
            async with asyncio.timeout(30):
                nxt = await b.recv(tag=1)
                await second
            assert nxt.tolist() == [2, 2, 2]
            return
    pytest.fail("the 64 MiB message landed whole before its recv could be cancelled, 5 times")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", _TRANSPORTS)
async def test_a_recv_whose_queued_message_is_withdrawn_takes_the_one_queued_behind_it(transport: str) -> None:
    """A rendezvous message x and a small one y1 wait queued on a tag; recv A takes x, and x's
    send is cancelled 0..5 loop turns later; recv B is posted 0..5 turns after the cancel.
    Where the withdrawal reached the receiver while y1 still waited in the queue, A keeps its
    place and takes y1, and B the next message (y2). Before, A took its place back only when its
    task next ran, and B, posted meanwhile, took y1 from the queue first (tcp, inproc, ucx)."""
    x = np.full(16 * MiB, 7, np.uint8)  # rendezvous, and its landing lasts several loop turns
    owed = 0
    async with connected_pair(transport, limits=tensorwire.Limits(recv_buffer_bytes=64 * 1024)) as (a, b):
        mailbox = b.channel.mailbox
        tag = tag_id("q")
        seen: list[bool] = []  # per withdrawal as it reached b: whether y1 still waited unclaimed
        abort = mailbox.abort

        def watched(arrival: Any) -> None:
            if arrival.tag == tag:
                seen.append(mailbox.oldest(tag) is not None)
            abort(arrival)

        mailbox.abort = watched  # type: ignore[method-assign]
        for gap in range(6):
            for spins in range(6):
                seen.clear()
                y1, y2 = np.full(1000, 100 + spins, np.uint8), np.full(1000, 200 + spins, np.uint8)
                send = asyncio.ensure_future(a.send(x, tag="q"))
                await eventually(lambda: mailbox.oldest(tag) is not None, 10, 0)  # x waits for a recv
                sent = await asyncio.wait_for(a.send(y1, tag="q"), 10)
                assert sent.protocol != "rendezvous", sent
                await eventually(lambda: len(mailbox._arrived.get(tag, ())) == 2, 10, 0)  # y1 behind x
                first = asyncio.ensure_future(b.recv(tag="q"))
                await eventually(lambda: len(mailbox._arrived.get(tag, ())) == 1, 10, 0)  # A took x
                for _ in range(spins):
                    await asyncio.sleep(0)
                send.cancel()
                for _ in range(gap):
                    await asyncio.sleep(0)
                second = asyncio.ensure_future(b.recv(tag="q"))
                with contextlib.suppress(asyncio.CancelledError):
                    await send
                await asyncio.wait_for(a.send(y2, tag="q"), 10)
                got = [await asyncio.wait_for(first, 10), await asyncio.wait_for(second, 10)]
                order = [x, y1, y2]
                places = [next((i for i, m in enumerate(order) if np.array_equal(g, m)), -1) for g in got]
                if places[0] == 0:
                    expected = [0, 1]  # the cancel came too late: x arrived whole
                elif seen == [False]:
                    expected = [2, 1]  # B took y1 before the withdrawal came
                else:
                    expected = [1, 2]
                    owed += seen == [True]
                assert places == expected, (
                    f"recvs took messages {places} of [x, y1, y2], not {expected} (x withdrawn {spins} turns "
                    f"after A took it, B posted {gap} turns after the cancel; y1 still queued then: {seen})"
                )
                for i in sorted({1, 2} - set(places)):
                    assert np.array_equal(await asyncio.wait_for(b.recv(tag="q"), 10), order[i])
        del mailbox.abort
    assert owed, "no withdrawal reached the receiver while y1 waited: the test tested nothing"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", _TRANSPORTS)
async def test_a_recv_cancelled_after_its_message_was_withdrawn_loses_nothing(transport: str) -> None:
    """Recvs A and B are posted on a tag; a rendezvous message matches A, and its send is
    cancelled 0..3 loop turns later; y1 and y2 are sent 0..2 turns after that, and A is cancelled
    0..2 turns after them: A is cancelled while the place kept for it waits, or after that place
    took y1. Whatever A took goes back: B and one more recv get y1 and y2 whole, A is cancelled
    or has one of them, and no recv stays posted."""
    x = np.full(256 * 1024, 7, np.uint8)  # past recv_buffer_bytes: rendezvous
    async with connected_pair(transport, limits=tensorwire.Limits(recv_buffer_bytes=64 * 1024)) as (a, b):
        mailbox = b.channel.mailbox
        tag = tag_id("c")
        for spins, gap, late in itertools.product(range(4), range(3), range(3)):
            ys = [np.full(1000, 100 + k, np.uint8) for k in range(2)]
            first = asyncio.ensure_future(b.recv(tag="c"))
            await eventually(lambda: len(mailbox._posted.get(tag, ())) == 1, 10, 0)
            second = asyncio.ensure_future(b.recv(tag="c"))
            await eventually(lambda: len(mailbox._posted.get(tag, ())) == 2, 10, 0)
            send = asyncio.ensure_future(a.send(x, tag="c"))
            await eventually(lambda: len(mailbox._posted.get(tag, ())) == 1, 10, 0)  # x matched A
            for _ in range(spins):
                await asyncio.sleep(0)
            send.cancel()
            for _ in range(gap):
                await asyncio.sleep(0)
            after = [asyncio.ensure_future(a.send(y, tag="c")) for y in ys]
            for _ in range(late):
                await asyncio.sleep(0)
            first.cancel()
            try:
                await send
                sent = True
            except asyncio.CancelledError:
                sent = False  # withdrawn, or it came whole all the same (the cancel came too late)
            for s in after:
                await asyncio.wait_for(s, 10)
            got = []
            try:
                got.append(await asyncio.wait_for(first, 10))
            except asyncio.CancelledError:
                pass
            got.append(await asyncio.wait_for(second, 10))
            while (
                sum(g.shape != x.shape for g in got) < 2
                or (sent and all(g.shape != x.shape for g in got))
                or mailbox.oldest(tag) is not None
            ):
                got.append(await asyncio.wait_for(b.recv(tag="c"), 10))
            where = f"({spins}, {gap}, {late} turns: {[int(g[0]) for g in got]})"
            assert sorted(int(g[0]) for g in got if g.shape != x.shape) == [100, 101], f"y1, y2 not received {where}"
            assert all(bool((g == g[0]).all()) for g in got), f"a message came corrupt {where}"
            assert sum(g.shape == x.shape for g in got) <= 1, f"x came twice {where}"
            assert not mailbox.has_posted(tag), "a recv (or a place kept for one) stayed posted"
            assert mailbox.oldest(tag) is None, "a message stayed queued"
            assert not mailbox._held, "a message stayed held"


_W = 64 * 1024


def _header(channel: Any, tag: int, x: np.ndarray, *, rendezvous: bool) -> Arrival:
    """A message's header as a transport hands it to the mailbox (``Mailbox.arrive``); its payload
    is then landed by hand (``_land``), so that this test decides what runs between which step."""
    msg = prepare(x)
    arrival = Arrival(channel, tag, msg.tree, msg.specs, rendezvous=rendezvous, protocol="eager")
    arrival.landed = 0
    return arrival


def _land(arrival: Arrival, x: np.ndarray, end: int) -> None:
    """Land ``x``'s bytes up to ``end`` where the mailbox now wants them, as inproc and tcp do:
    in order, marked as they go, and the message complete once whole."""
    if arrival.dest is None:
        arrival.allocate()
    start = arrival.landed or 0
    data = memoryview(x).cast("B")
    while start < end:
        view = arrival.view(start, end - start)
        view[:] = data[start : start + len(view)]
        start += len(view)
        arrival.mark(start)
    if end == arrival.nbytes:
        arrival.written = end
        arrival.complete()


def _come(mailbox: Any, tag: int, x: np.ndarray, end: int) -> Arrival:
    """Message ``x`` comes on ``tag``: its header, then its payload up to ``end``."""
    arrival = _header(mailbox.channel, tag, x, rendezvous=False)
    mailbox.arrive(arrival)
    _land(arrival, x, end)
    return arrival


@pytest.mark.timeout(60)
async def test_a_recv_cancelled_before_its_task_ran_after_its_message_was_withdrawn_in_the_same_pass() -> None:
    """Recv A (and, in some cases, recv B behind it) waits on a tag. In one pass of the loop, as a
    transport reads frames, message x matches A and its sender withdraws it (x, then a second
    withdrawn one, x2, in some cases), so A's kept place waits for the next message; message y
    comes before A is cancelled, after, or after A's task has run and given up, whole or half
    landed, and z with y or only later. A's task never runs between the withdrawal and its cancel.
    Whatever A's kept place took goes on: y and z each reach exactly one later recv, whole, in the
    order they came (the recv after A gets y, the next z), except where B took z while A's place
    held y (README: a recv cancelled after its message matched hands it to the next recv posted);
    A's out= is not written once its cancel has returned, and nothing stays posted, held or
    queued. The interleavings are made here by hand, on an inproc channel's real mailbox."""
    y = (np.arange(_W) % 251 + 1).astype(np.uint8)
    z = y[::-1].copy()
    cases = itertools.product(
        ("before the cancel", "after the cancel", "after A gave up"),  # when y comes
        (False, True),  # B waits behind A
        (False, True),  # A receives into out=
        (False, True),  # y is half landed as A's cancel returns
        (False, True),  # z comes with y (else once the rest has settled)
        (1, 2),  # messages withdrawn from A's place in that pass
    )
    async with connected_pair("inproc") as (_, b):
        channel, mailbox, tag = b.channel, b.channel.mailbox, tag_id("w")
        for when, behind, into, half, with_y, withdrawn in cases:
            case = (
                f"(y {when}, B behind: {behind}, out=: {into}, y half landed: {half}, z with y: {with_y}, "
                f"{withdrawn} withdrawn)"
            )
            out = np.zeros(_W, np.uint8) if into else None
            first = asyncio.ensure_future(b.recv(tag="w", out=out))
            await eventually(lambda: len(mailbox._posted.get(tag, ())) == 1, 10, 0)
            place = mailbox._posted[tag][0].seq  # A's place in the tag's line
            recvs = []  # the recvs after A, in the order they were called
            if behind:
                recvs.append(asyncio.ensure_future(b.recv(tag="w")))
                await eventually(lambda: len(mailbox._posted.get(tag, ())) == 2, 10, 0)
            arrived: list[Arrival] = []  # y, z
            y_end = _W // 2 if half else _W
            # one pass: nothing below awaits until A's cancel, so A's task does not run in between
            for _ in range(withdrawn):
                x = _header(channel, tag, np.full(_W, 0xAA, np.uint8), rendezvous=True)
                mailbox.arrive(x)
                assert not x.done.done()
                mailbox.abort(x)
            if when == "before the cancel":
                arrived.append(_come(mailbox, tag, y, y_end))
                if with_y:
                    arrived.append(_come(mailbox, tag, z, _W))
            first.cancel()
            if when == "after the cancel":
                arrived.append(_come(mailbox, tag, y, y_end))
                if with_y:
                    arrived.append(_come(mailbox, tag, z, _W))
            if when != "after A gave up":  # the case in point: A's kept place holds y as A's task first runs
                holder = mailbox._held.get(arrived[0])
                assert holder is not None and holder.seq == place, f"y did not go to A's kept place {case}"
            with pytest.raises(asyncio.CancelledError):
                await first
            if out is not None:
                out[:] = 0xEE  # the caller's again: nothing may land in it from here on
            if when == "after A gave up":
                arrived.append(_come(mailbox, tag, y, y_end))
                if with_y:
                    arrived.append(_come(mailbox, tag, z, _W))
            _land(arrived[0], y, _W)  # the rest of y, wherever the mailbox now wants it
            if not with_y:
                arrived.append(_come(mailbox, tag, z, _W))
            got: list[np.ndarray] = []
            try:
                async with asyncio.timeout(5):
                    got.extend([await r for r in recvs])
                    while len(got) < 2:
                        got.append(await b.recv(tag="w"))
            except TimeoutError:
                pytest.fail(f"a message was lost: the recvs after A got {len(got)} of y and z {case}")
            names = ["y" if np.array_equal(g, y) else "z" if np.array_equal(g, z) else f"?{g[:4]}" for g in got]
            expected = ["z", "y"] if behind and with_y and when != "after A gave up" else ["y", "z"]
            assert names == expected, f"the recvs after A got {names}, not {expected} {case}"
            assert out is None or (out == 0xEE).all(), f"a message landed in A's out= after its cancel {case}"
            assert not mailbox.has_posted(tag), f"a recv, or a place kept for one, stayed posted {case}"
            assert mailbox.oldest(tag) is None, f"a message stayed queued {case}"
            assert not mailbox._held, f"a message stayed held {case}"
