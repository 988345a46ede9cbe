"""Credit-based flow control shared by the stream transports (tcp, ucx).

A receiver grants each peer ``recv_buffer_bytes`` of buffer credit and ``max_unexpected``
message slots, and ``own_slots(max_unexpected)`` more slots that only tensorwire's own messages
(``OWN_TAGS``: RPC, one-sided requests and answers, revocations, bench, pipeline aborts) may
take. A message holds its slot until it is received, and the user may leave messages unreceived
for good; without slots of their own, tensorwire's requests, replies and cancellations would
wait behind them.
``SendWindow`` is the sender's view of those grants: a message that fits the credit may go
eager, every message needs a slot, and a sender without slots waits.
``ReceiveBudget`` is the receiver's view: it checks that the peer stays within what it was
granted, the user's messages within their share as well as all messages within the total (a
violation is a ProtocolError), and collects what consumed messages give back, to be piggybacked
on the next frame or flushed in a CREDIT frame shortly after.
"""

from __future__ import annotations

import asyncio
import sys
from collections import deque
from collections.abc import Callable, Mapping

from ..errors import ProtocolError
from ._base import Limits, fresh
from ._frames import PeerLimits

__all__ = ["FLUSH_DELAY", "OWN_TAGS", "ReceiveBudget", "SendWindow", "own_slots", "own_tag"]

FLUSH_DELAY = 0.001  # seconds a credit return waits for a frame to ride on

# tensorwire's own tags (rpc, one-sided requests and replies, bench, pipeline stages' hellos and
# aborts); tensorwire._peer.RESERVED_TAGS is this range
OWN_TAGS = range(-0x7478_0000_0000_0000 + 1, -0x7477_0000_0000_0000 + 1)
_OWN_FIRST, _OWN_LAST = OWN_TAGS[0], OWN_TAGS[-1]


def own_slots(max_unexpected: int) -> int:
    """The slots a receiver grants a peer's tensorwire messages on top of ``max_unexpected``.

    As many again, and at least 4: RPC keeps what it may leave unread within a quarter of the
    receiver's ``max_unexpected`` (requests) and a half (replies to the receiver's own calls),
    at least 1 and 2, so even when the user's messages fill their share a quarter of these stays
    free for cancellations, credit, one-sided requests and answers, and revocations, which are
    received promptly.
    """
    return max(4, max_unexpected)


def own_tag(tag: int) -> bool:
    """Whether ``tag`` is one of tensorwire's own, whose messages may take the kept slots."""
    return _OWN_FIRST <= tag <= _OWN_LAST


class SendWindow:
    """What this side may still send to a peer.

    With ``keep_for_small`` (tcp, ucx, verbs), a message over ``small`` bytes goes eager only if it leaves
    ``keep`` of the credit (an eighth of the grant) free: those last bytes are for messages of
    ``small`` bytes (a sixteenth of ``keep``) or less, so that a ping sent beside large eager
    sends the receiver has not taken yet still goes eager, and does not wait for its CTS behind
    them (credit head-of-line blocking). A policy of the sender's alone: the receiver checks
    only the grant.
    """

    def __init__(self, remote: PeerLimits, *, keep_for_small: bool = False) -> None:
        self._max_credit = remote.recv_buffer_bytes
        self.keep = remote.recv_buffer_bytes // 8 if keep_for_small else 0
        self.small = self.keep // 16
        self.kept = own_slots(remote.max_unexpected)  # the last free slots: tensorwire's own messages only
        self._max_slots = remote.max_unexpected + self.kept
        self.credit = remote.recv_buffer_bytes
        self.slots = self._max_slots  # free at the receiver
        self._waiters: deque[tuple[asyncio.Future[None], int]] = deque()  # (future, tag), in the order they came

    def has_slot(self, tag: int) -> bool:
        """Whether a message on ``tag`` may take a slot now: the user's leave the kept ones."""
        return self.slots > self.kept or (self.slots > 0 and _OWN_FIRST <= tag <= _OWN_LAST)

    async def take_slot(self, tag: int, check_open: Callable[[], None]) -> None:
        """Wait for a message slot (backpressure); ``check_open`` raises once the channel is gone.

        Waiters are handed the slots that come back in the order they began to wait, whatever
        their tags (``_hand``): a send begun while a woken one had not run yet took its slot
        before, so a later message on another tag (a pipeline's F3) overtook an earlier one
        (F2), against the order the sender sent them in (and that ``pipeline``'s schedule
        check counts on: with one slot, the receiver waited for F2 behind F3 for good)."""
        check_open()
        if self.has_slot(tag):  # (a waiter left is one no slot now fits: it goes on waiting)
            self.slots -= 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (fut, tag)
        self._waiters.append(entry)
        try:
            await fut  # done: the slot is ours (``_hand``)
        except BaseException:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self.slots += 1  # handed to us as we were cancelled: the next waiter's
                self._hand()
            elif entry in self._waiters:
                self._waiters.remove(entry)
            raise
        try:
            check_open()
        except BaseException:
            self.slots += 1  # (the next waiter's, should one still wait)
            self._hand()
            raise

    def fits(self, nbytes: int) -> bool:
        """Whether an ``nbytes`` message may go eager now: within the credit, and leaving the kept
        part of it free unless the message is small."""
        return nbytes <= self.credit - (self.keep if nbytes > self.small else 0)

    def end(self) -> None:
        """No message goes eager from now on: ``fits`` is False whatever the size (the peer said
        goodbye or hung up). The fast paths, which test ``fits`` already, fall through to the
        slow path, which raises (``Channel._check_going``): they pay nothing for this."""
        self.small = -1  # every message is "large" ...
        self.keep = sys.maxsize  # ... and must leave more than any credit free

    def reserve(self, nbytes: int) -> bool:
        """Spend credit for an eager message if it fits; False means it must go rendezvous."""
        if self.fits(nbytes):
            self.credit -= nbytes
            return True
        return False

    def unspend(self, nbytes: int, eager: bool) -> None:
        """A message that never reached the wire gives its slot (and credit) back locally; a
        sender waiting for a slot may take it (the peer has nothing to return for it)."""
        self.slots += 1
        if eager:
            self.credit += nbytes
        self._hand()

    def grant(self, credit: int, slots: int) -> None:
        """The peer returned credit and slots; wake senders waiting for a slot."""
        if not (credit or slots):
            return
        self.credit += credit
        self.slots += slots
        if self.credit > self._max_credit or self.slots > self._max_slots:
            raise ProtocolError("peer returned more credit than it granted")
        if self._waiters:
            self._hand()

    def _hand(self) -> None:
        """Give free slots to the senders waiting for one, oldest first, now: a send begun
        before their tasks run finds them taken. A user's message that no slot fits waits on,
        and so do the user's behind it (none fits them either); tensorwire's own may still
        take the kept slots."""
        if not self._waiters:
            return
        left: deque[tuple[asyncio.Future[None], int]] = deque()
        for fut, tag in self._waiters:
            if fut.done():
                continue
            if self.has_slot(tag):
                self.slots -= 1
                fut.set_result(None)
            else:
                left.append((fut, tag))
        self._waiters = left

    def fail(self, exc: BaseException) -> None:
        for f, _ in self._waiters:
            if not f.done():
                f.set_exception(fresh(exc))  # (each waiter a copy of its own: see ``fresh``)
                f.exception()
        self._waiters.clear()


class ReceiveBudget:
    """What a peer holds of this side's grants, and what this side owes back."""

    def __init__(self, limits: Limits, flush: Callable[[], None]) -> None:
        self._limits = limits
        # owing this much back makes the flush urgent (no delay)
        self._urgent_credit = limits.recv_buffer_bytes // 4
        self._urgent_slots = limits.max_unexpected // 4
        self._max_slots = limits.max_unexpected + own_slots(limits.max_unexpected)
        self._flush = flush  # sends a CREDIT frame when something is still owed
        self._used_credit = 0
        self._used_slots = 0
        self._used_user_slots = 0  # of _used_slots, those held by messages on the user's tags
        self._ret_credit = 0
        self._ret_slots = 0
        self._timer: asyncio.TimerHandle | None = None
        self._urgent = False  # the pending timer is the no-delay one
        self._flushing = False  # a flush was asked for and has not taken the returns yet

    def admit(self, nbytes: int, eager: bool, tag: int) -> None:
        """A message header arrived on ``tag``: it takes a slot, and credit if it came eager.

        The user's messages may hold ``max_unexpected`` slots, tensorwire's all of them. This is
        ``SendWindow.has_slot`` seen from here: an honest sender lets a user's message go only
        while fewer than ``max_unexpected`` of its slots are taken, by messages of either kind,
        and a slot comes back to it only after this side released it; so the user's messages
        held here never exceed their share, whatever order the frames arrive in. A peer that
        broke this would leave no slot for tensorwire's messages (RPC replies, one-sided
        requests, revocations) behind the user's it parks here.
        """
        self._used_slots += 1
        if self._used_slots > self._max_slots:
            raise ProtocolError(f"peer sent more than {self._max_slots} messages without credit")
        if not _OWN_FIRST <= tag <= _OWN_LAST:  # (own_tag, written out: this runs per message)
            self._used_user_slots += 1
            if self._used_user_slots > self._limits.max_unexpected:
                raise ProtocolError(
                    f"peer sent more than {self._limits.max_unexpected} user messages without credit "
                    f"(the other {self._max_slots - self._limits.max_unexpected} slots are kept for tensorwire's own)"
                )
        if eager:
            self._used_credit += nbytes
            if self._used_credit > self._limits.recv_buffer_bytes:
                raise ProtocolError("peer sent an eager message beyond its buffer credit")

    def release(self, nbytes: int, eager: bool, tag: int, *, schedule: bool = True) -> None:
        """A message on ``tag`` was consumed (or aborted): owe its slot and credit back to the peer."""
        user = not _OWN_FIRST <= tag <= _OWN_LAST  # (own_tag, written out)
        if self._used_slots <= 0 or (user and self._used_user_slots <= 0) or (eager and nbytes > self._used_credit):
            # a message released twice would hand the sender credit this side never had
            raise RuntimeError(f"tensorwire bug: release of a {nbytes}-byte message that holds no slot or credit")
        self._used_slots -= 1
        if user:
            self._used_user_slots -= 1
        self._ret_slots += 1
        if eager:
            self._used_credit -= nbytes
            self._ret_credit += nbytes
        if not schedule or self._flushing:  # the flush under way takes these returns too
            return
        urgent = self._ret_credit >= self._urgent_credit or self._ret_slots >= self._urgent_slots
        if self._timer is not None:
            if self._urgent or not urgent:
                return  # the pending timer comes soon enough
            self._timer.cancel()
        self._urgent = urgent
        self._timer = asyncio.get_running_loop().call_later(0 if urgent else FLUSH_DELAY, self._due)

    def _due(self) -> None:
        self._timer = None
        if self.owed:
            self._flushing = True
            self._flush()

    @property
    def owed(self) -> bool:
        return bool(self._ret_credit or self._ret_slots)

    def take_returns(self) -> tuple[int, int]:
        """What to piggyback on the frame being written now."""
        credit, slots = self._ret_credit, self._ret_slots
        self._ret_credit = self._ret_slots = 0
        self._flushing = False
        return credit, slots

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def fail_waiting_sends(window: SendWindow, cts: Mapping[int, asyncio.Future[None]], exc: BaseException) -> None:
    """Fail the sends waiting on the peer with (a copy of) ``exc``: for a message slot or credit
    (``window``), or for the CTS of a rendezvous message (``cts``): the peer said goodbye, or hung
    up behind bytes not read yet, so that CTS will not come, or its payload would go nowhere. No
    message goes eager after it either (``SendWindow.end``): the peer would drop it."""
    window.fail(exc)
    window.end()  # and a send begun later, the fast path's too, raises it (``SendWindow.end``)
    for fut in cts.values():  # (each a copy of its own: see ``fresh``)
        if not fut.done():
            fut.set_exception(fresh(exc))
            fut.exception()
