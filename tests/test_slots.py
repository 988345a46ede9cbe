"""Message slots kept for tensorwire's own messages (transports/_credit): the user's sends leave
them free, tensorwire's may take them. The conformance check
``tensorwire_messages_pass_the_users_unreceived_ones`` shows it on real nodes of every transport."""

from __future__ import annotations

import asyncio

import pytest

from tensorwire import _onesided
from tensorwire._bench import _wire as bench_wire
from tensorwire._peer import RESERVED_TAGS
from tensorwire.errors import ProtocolError
from tensorwire.rpc import _protocol
from tensorwire.transports import Limits
from tensorwire.transports._credit import OWN_TAGS, ReceiveBudget, SendWindow, own_slots, own_tag
from tensorwire.transports._frames import PeerLimits

pytestmark = pytest.mark.timeout(30)


def test_the_kept_slots_go_to_every_tag_tensorwire_sends_on() -> None:
    mine = [
        _protocol.REQUEST_TAG,
        _protocol.CONTROL_TAG,
        _protocol.reply_tag(1),
        _protocol.args_tag(2**40),
        _onesided._OPS_TAG,
        _onesided._REPLY_BASE,
        bench_wire.REQUEST_TAG,
        bench_wire.PONG_TAG,
    ]
    assert all(own_tag(t) and t in OWN_TAGS for t in mine)
    assert not any(own_tag(t) for t in (0, -1, 7, OWN_TAGS[0] - 1, OWN_TAGS[-1] + 1))


@pytest.mark.parametrize(("users", "kept"), [(1, 4), (2, 4), (4, 4), (5, 5), (1024, 1024)])
async def test_the_users_messages_take_max_unexpected_slots_and_leave_the_rest(users: int, kept: int) -> None:
    assert own_slots(users) == kept
    window = SendWindow(PeerLimits(1 << 20, users, 1 << 20, Limits.MIN_HEADER_BYTES, 0))
    budget = ReceiveBudget(Limits(max_unexpected=users), flush=lambda: None)

    def is_open() -> None:
        pass

    for _ in range(users):
        await asyncio.wait_for(window.take_slot(7, is_open), 1)
        budget.admit(0, False, 7)
    user = asyncio.ensure_future(window.take_slot(7, is_open))
    await asyncio.sleep(0)
    assert not user.done(), "a user's message took a slot kept for tensorwire's"
    for _ in range(kept):
        await asyncio.wait_for(window.take_slot(_onesided._OPS_TAG, is_open), 1)
        budget.admit(0, False, _onesided._OPS_TAG)  # the receiver accepts them all
    own = asyncio.ensure_future(window.take_slot(_protocol.REQUEST_TAG, is_open))
    await asyncio.sleep(0)
    assert not own.done() and not user.done()
    window.grant(0, 1)  # one slot back: tensorwire's message takes it, the user's still waits
    await asyncio.wait_for(own, 1)
    assert not user.done()
    window.grant(0, kept + 1)  # the kept slots are all free again, and one more: the user's goes
    await asyncio.wait_for(user, 1)
    user.result()


@pytest.mark.parametrize("users", [1, 4, 64])
def test_the_receiver_refuses_a_users_message_past_its_share(users: int) -> None:
    """A peer whose sender ignored the rule above (a hostile or broken one) parked twice the
    user's share of messages: the receiver checked only the total, and the user's messages
    could fill the slots kept for tensorwire's. Now the first past the share is a protocol
    violation, while tensorwire's may still take every slot there is."""
    kept = own_slots(users)
    budget = ReceiveBudget(Limits(max_unexpected=users), flush=lambda: None)
    for _ in range(users):
        budget.admit(16, True, 7)
    with pytest.raises(ProtocolError, match=f"more than {users} user messages without credit"):
        budget.admit(16, True, 8)

    budget = ReceiveBudget(Limits(max_unexpected=users), flush=lambda: None)
    for _ in range(users):
        budget.admit(16, True, 7)
    for _ in range(kept):  # the user's share is full: tensorwire's take the rest
        budget.admit(16, True, _protocol.REQUEST_TAG)
    with pytest.raises(ProtocolError, match=f"more than {users + kept} messages without credit"):
        budget.admit(16, True, _protocol.REQUEST_TAG)


def test_a_released_users_message_frees_a_user_slot_and_tensorwire_s_do_not() -> None:
    budget = ReceiveBudget(Limits(max_unexpected=2), flush=lambda: None)
    budget.admit(0, False, 7)
    budget.admit(0, False, _onesided._OPS_TAG)
    budget.release(0, False, _onesided._OPS_TAG, schedule=False)  # tensorwire's gave back no user slot
    budget.admit(0, False, 7)
    with pytest.raises(ProtocolError, match="more than 2 user messages"):
        budget.admit(0, False, 7)
    budget = ReceiveBudget(Limits(max_unexpected=2), flush=lambda: None)
    budget.admit(0, False, 7)
    budget.admit(0, False, 7)
    budget.release(0, False, 7, schedule=False)
    budget.admit(0, False, 7)  # the user's slot came back
    assert budget.take_returns() == (0, 1)


async def test_the_receiver_takes_all_an_honest_sender_sends_even_out_of_slot_order() -> None:
    """The receiver is never stricter than ``SendWindow``: with the user's share one short, a
    user's message takes the last user slot and one of tensorwire's a kept one after it, and
    their frames may reach the receiver the other way round (another lane, another writer);
    the receiver counts the user's messages, not the slots taken before each."""
    users = 4
    window = SendWindow(PeerLimits(1 << 20, users, 1 << 20, Limits.MIN_HEADER_BYTES, 0))
    budget = ReceiveBudget(Limits(max_unexpected=users), flush=lambda: None)

    def is_open() -> None:
        pass

    sent: list[int] = []
    for _ in range(users - 1):
        await window.take_slot(7, is_open)
        sent.append(7)
    await window.take_slot(7, is_open)  # the last user slot
    await window.take_slot(_protocol.REQUEST_TAG, is_open)  # a kept one
    sent += [_protocol.REQUEST_TAG, 7]  # ... arriving first
    while window.has_slot(_protocol.REQUEST_TAG):
        await window.take_slot(_protocol.REQUEST_TAG, is_open)
        sent.append(_protocol.REQUEST_TAG)
    assert not window.has_slot(7)
    for tag in sent:
        budget.admit(0, False, tag)
    assert len(sent) == users + own_slots(users)


def test_no_string_tag_lands_in_tensorwire_s_own_range() -> None:
    """A string tag hashes to 64 bits, and about 1 name in 65,536 hashed into tensorwire's own
    range: its messages would have taken the slots kept for tensorwire's (and been counted as
    rpc or one-sided traffic). Such a name is moved out of the range, the same in every process."""
    import hashlib

    from tensorwire._peer import tag_id

    def raw(name: str) -> int:
        return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little", signed=True)

    landed = [name for name in (f"layer{i}" for i in range(400_000)) if raw(name) in RESERVED_TAGS][:3]
    assert landed, "no name of 400,000 hashed into the range (about 6 expected)"
    for name in landed:
        tag = tag_id(name)
        assert tag not in RESERVED_TAGS and -(2**63) <= tag < 2**63, (name, tag)
        assert tag == tag_id(name)
    assert tag_id("layer1") == raw("layer1")  # every other name hashes as it always did


@pytest.mark.parametrize("transport", ["tcp", "inproc"])
async def test_the_public_verbs_refuse_tensorwire_s_own_int_tags(
    transport: str, caplog: pytest.LogCaptureFixture
) -> None:
    """send, recv and recv_with_receipt took an int tag in tensorwire's own range: on real nodes
    a user's recv on the next RPC reply's tag took the reply (the call hung), one on the
    one-sided requests' tag took a peer's read request (the read hung), and user messages left
    unread on such a tag took the slots kept for tensorwire's (a call to that node hung). Each
    verb now refuses the tag before anything is sent or posted (the range's ends included); the
    ints just outside it are the user's, and tensorwire's own messages still go."""
    import argparse
    import functools
    import re

    import numpy as np

    from tensorwire._peer import tag_id
    from tensorwire.cli import _echo_tag
    from tensorwire.errors import ConfigurationError
    from tensorwire.pipeline._stage import HELLO_TAG
    from tensorwire.testing import connected_pair

    first, last = RESERVED_TAGS[0], RESERVED_TAGS[-1]
    served = {_protocol.REQUEST_TAG, _protocol.CONTROL_TAG, _onesided._OPS_TAG}  # recvs always posted
    reserved = [first, last, *served, _protocol.reply_tag(1), bench_wire.DATA_TAG, HELLO_TAG]
    said = re.escape(f"(the ints {first:#_x} to {last:#_x}") + ".*or a string tag$"
    async with connected_pair(transport) as (a, b):

        @b.node.method()
        async def add(x: int, y: int) -> int:
            return x + y

        b.node.expose(np.arange(8), name="x")
        h = await a.lookup("x")
        for tag in reserved:
            for verb in (
                functools.partial(a.send, np.zeros(1), tag=tag),
                functools.partial(a.recv, tag=tag),
                functools.partial(a.recv_with_receipt, tag=tag),
            ):
                with pytest.raises(ConfigurationError, match=rf"^tag {tag} is one of tensorwire's own {said}"):
                    await verb()
            with pytest.raises(argparse.ArgumentTypeError, match="is one of tensorwire's own"):
                _echo_tag(str(tag))  # `tensorwire serve --echo TAG`
        for tag in (first - 1, last + 1):  # the user's
            assert tag_id(tag) == tag and _echo_tag(str(tag)) == str(tag)
            await a.send(np.arange(3), tag=tag)
            assert list(await b.recv(tag=tag)) == [0, 1, 2]
            await b.send(np.arange(2), tag=tag)
            got, receipt = await a.recv_with_receipt(tag=tag)
            assert list(got) == [0, 1] and receipt.nbytes == 16
        # nothing refused was sent or posted, and tensorwire's own messages still go
        assert not a.channel.mailbox.holds_messages() and not b.channel.mailbox.holds_messages()
        assert not any(a.channel.mailbox.has_posted(t) for t in reserved if t not in served)
        assert await a.call("add", 2, 3) == 5
        assert list(await a.read(h)) == list(range(8))
    assert "malformed" not in caplog.text
