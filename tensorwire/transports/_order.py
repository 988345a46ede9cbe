"""FIFO per (peer, tag) for sends that may wait before their message goes out.

A send that stages device memory waits for its producer stream, and any send may wait for a
message slot; one entered later on the same tag that does not wait (a small host message) would
overtake it. So each send takes a turn when it is entered, before any await, and posts its MSG
frame only after the send entered before it on its tag has posted its own. Different tags never
wait for each other.
"""

from __future__ import annotations

import asyncio
from typing import Any

from ._base import fresh

__all__ = ["SendOrder", "Turn"]


class Turn:
    """One send's place on its tag: ``wait()`` before posting the MSG frame, ``passed()`` once
    it is posted (or the send failed or was cancelled: then the next one goes once the send
    ahead of this one has gone, so a cancel never lets a later message overtake)."""

    __slots__ = ("_ahead", "_mine", "_order", "_tag")

    def __init__(self, order: SendOrder, tag: int, ahead: asyncio.Future[None] | None) -> None:
        self._order, self._tag, self._ahead = order, tag, ahead
        self._mine: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def wait(self) -> None:
        """Until the send ahead has posted its MSG frame, or the channel's shutdown fails the
        order (``SendOrder.fail``): the send ahead may be held by a producer stream that no
        shutdown stops. Our cancel never touches the send ahead."""
        order = self._order
        if order.failure is not None:
            raise fresh(order.failure)
        ahead = self._ahead
        if ahead is None or ahead.done():
            return
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

        def wake(_: object) -> None:
            if not fut.done():
                fut.set_result(None)

        ahead.add_done_callback(wake)
        order.waiting.add(fut)
        try:
            await fut
        finally:
            order.waiting.discard(fut)
            ahead.remove_done_callback(wake)

    def passed(self) -> None:
        """This send is done with its turn (idempotent)."""
        if self._mine.done():
            return
        ahead = self._ahead
        if ahead is not None and not ahead.done():
            self._ahead = None
            ahead.add_done_callback(lambda _: self.passed())
            return
        self._mine.set_result(None)
        if self._order.turns.get(self._tag) is self._mine:
            del self._order.turns[self._tag]


class SendOrder:
    """The turns of a channel's sends, per tag (an entry only while a send on it has not posted).
    A transport that hands over every message in one line (inproc) uses one key for all tags."""

    __slots__ = ("failure", "turns", "waiting")

    def __init__(self) -> None:
        self.turns: dict[int, asyncio.Future[None]] = {}
        self.waiting: set[asyncio.Future[Any]] = set()  # sends waiting for the one ahead of them
        self.failure: BaseException | None = None

    def fail(self, exc: BaseException) -> None:
        """The channel is gone: every send waiting for its turn, and any that comes to wait
        later, raises ``exc`` (idempotent: the first failure stays)."""
        if self.failure is None:
            self.failure = fresh(exc)  # (each raise a copy of its own: see ``fresh``)
        for fut in self.waiting:
            if not fut.done():
                fut.set_exception(fresh(self.failure))
                fut.exception()
        self.waiting.clear()

    def busy(self, tag: int) -> bool:
        """Has a send on ``tag`` yet to post its MSG frame? (A send that would go at once must not.)"""
        return tag in self.turns

    def enter(self, tag: int) -> Turn:
        """A send on ``tag`` begins: its turn, after the send entered last on that tag."""
        turn = Turn(self, tag, self.turns.get(tag))
        self.turns[tag] = turn._mine
        return turn
