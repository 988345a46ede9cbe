"""Tag matching, buffering and cancellation shared by every transport.

Messages match recvs per tag in FIFO order. A transport announces each message when its header
arrives (``Mailbox.arrive``), before the payload: if a recv is already posted, the payload lands
straight in that recv's ``out=`` buffer; if not, an eager payload is buffered (the sender spent
credit for it, so the buffer is bounded) and a rendezvous payload waits in the sender's memory
until a recv pulls it.

A cancelled recv never leaves its ``out=`` buffer to be written later: what already landed there
is copied into a buffer of tensorwire's own, the rest of the payload follows it there, and the
message goes back to the head of its tag's queue, so nothing is lost.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import ShapeMismatchError, TensorWireError, TransferError
from ..tensors import Spec, byte_view, match_out, rebuild
from ._base import Receipt

if TYPE_CHECKING:
    from ..control._pb import wire_pb2
    from ._base import Channel

__all__ = ["Arrival", "Mailbox", "SenderAborted"]


class SenderAborted(TransferError):
    """The sender cancelled this message part way; a recv waiting for it waits for the next."""


def _settle(fut: asyncio.Future[Any], exc: BaseException) -> None:
    """Fail ``fut`` without 'exception was never retrieved' noise if nobody awaits it."""
    if not fut.done():
        fut.set_exception(exc)
        fut.exception()


class Arrival:
    """One incoming message, from its header on. ``dest`` is where its payload lands."""

    __slots__ = (
        "_flat",
        "channel",
        "consumed",
        "dest",
        "direct",
        "done",
        "msg_id",
        "nbytes",
        "protocol",
        "pulling",
        "rendezvous",
        "specs",
        "tag",
        "tree",
        "written",
    )

    def __init__(
        self,
        channel: Channel,
        tag: int,
        tree: wire_pb2.TreeNode,
        specs: list[Spec],
        *,
        msg_id: int = 0,
        rendezvous: bool = False,
        protocol: str = "eager",
    ) -> None:
        self.channel = channel
        self.tag = tag
        self.tree = tree
        self.specs = specs
        self.nbytes = sum(s.nbytes for s in specs)
        self.msg_id = msg_id
        self.rendezvous = rendezvous
        self.protocol = protocol
        self.pulling = False
        self.consumed = False  # handed to a recv: its credit went back, it is never requeued
        self.dest: list[np.ndarray] | None = None
        self.direct = False  # dest is the recv's out= buffer
        self.written = 0
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._flat: list[tuple[int, memoryview]] | None = None
        if self.nbytes == 0 and not rendezvous:
            self.done.set_result(None)

    def allocate(self) -> None:
        """Give the payload a buffer of tensorwire's own."""
        self.dest = [s.allocate() for s in self.specs]
        self.direct = False
        self._flat = None

    def detach(self) -> None:
        """Stop writing into the caller's buffer: keep what landed, continue into our own."""
        if self.dest is None or not self.direct:
            return
        old = self.dest
        self.allocate()
        assert self.dest is not None
        # a transport may be part way through a chunk, so ``written`` can lag: copy it all
        for src, dst in zip(old, self.dest, strict=True):
            np.copyto(dst, src)

    def view(self, offset: int, n: int) -> memoryview:
        """A writable byte view of the payload at ``offset``, at most ``n`` bytes long."""
        if self._flat is None:
            assert self.dest is not None
            flat = []
            pos = 0
            for a in self.dest:
                if a.nbytes:
                    flat.append((pos, byte_view(a)))
                    pos += a.nbytes
            self._flat = flat
        for start, mv in self._flat:
            end = start + len(mv)
            if start <= offset < end:
                return mv[offset - start : min(end, offset + n) - start]
        raise IndexError(f"offset {offset} outside a {self.nbytes}-byte payload")

    def complete(self) -> None:
        if not self.done.done():
            self.done.set_result(None)

    def fail(self, exc: BaseException) -> None:
        _settle(self.done, exc)


class _Posted:
    __slots__ = ("future", "out")

    def __init__(self, out: object | None) -> None:
        self.out = out
        self.future: asyncio.Future[Arrival] = asyncio.get_running_loop().create_future()


class Mailbox:
    """Per-channel queues of arrived messages and posted recvs, matched per tag."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self._arrived: dict[int, deque[Arrival]] = {}
        self._posted: dict[int, deque[_Posted]] = {}
        self.failure: BaseException | None = None
        self.in_flight = 0

    # -- transport side -------------------------------------------------------------------
    def arrive(self, arrival: Arrival) -> None:
        """A message header arrived. Match it to a posted recv or queue it."""
        posted = self._posted.get(arrival.tag)
        while posted:
            p = posted.popleft()
            if not posted:
                del self._posted[arrival.tag]
            if p.future.done():  # cancelled recv
                continue
            if p.out is not None:
                try:
                    arrival.dest = match_out(p.out, arrival.specs)
                    arrival.direct = True
                except ShapeMismatchError as exc:
                    p.future.set_exception(exc)
                    continue
            p.future.set_result(arrival)
            return
        self._arrived.setdefault(arrival.tag, deque()).append(arrival)

    def abort(self, arrival: Arrival) -> None:
        """The sender gave up on ``arrival``: drop it, and let a recv waiting on it re-post."""
        q = self._arrived.get(arrival.tag)
        if q is not None and arrival in q:
            q.remove(arrival)
            if not q:
                del self._arrived[arrival.tag]
        arrival.fail(SenderAborted("sender cancelled the message"))

    def fail(self, exc: BaseException) -> None:
        """The channel is gone: fail every posted recv and every incomplete message."""
        self.failure = exc
        for q in self._posted.values():
            for p in q:
                _settle(p.future, exc)
        self._posted.clear()
        for tag, aq in list(self._arrived.items()):
            keep = deque(a for a in aq if a.done.done() and a.done.exception() is None)
            for a in aq:
                if not a.done.done():
                    a.fail(exc)
            self._arrived[tag] = keep

    # -- user side ------------------------------------------------------------------------
    def _requeue(self, arrival: Arrival) -> None:
        arrival.detach()
        self._arrived.setdefault(arrival.tag, deque()).appendleft(arrival)

    async def recv(self, tag: int, out: object | None) -> tuple[Any, Receipt]:
        t0 = time.perf_counter()
        self.in_flight += 1
        try:
            while True:
                q = self._arrived.get(tag)
                if q:
                    arrival = q[0]
                    # a mismatched out= raises here and leaves the message queued
                    targets = match_out(out, arrival.specs) if out is not None else None
                    q.popleft()
                    if not q:
                        del self._arrived[tag]  # tags may be unique per operation: keep no empties
                else:
                    if self.failure is not None:
                        raise self.failure
                    self.channel.check_open()
                    p = _Posted(out)
                    self._posted.setdefault(tag, deque()).append(p)
                    try:
                        arrival = await p.future
                    except asyncio.CancelledError:
                        f = p.future
                        if f.done() and not f.cancelled() and f.exception() is None:
                            self._requeue(f.result())
                        else:
                            pq = self._posted.get(tag)
                            if pq is not None and p in pq:
                                pq.remove(p)
                        raise
                    finally:
                        pq = self._posted.get(tag)
                        if pq is not None and not pq:
                            del self._posted[tag]
                    targets = None
                try:
                    return await self._complete(arrival, out, targets, t0)
                except SenderAborted:
                    continue
                except BaseException:
                    failed = arrival.done.done() and arrival.done.exception() is not None
                    if not failed and not arrival.consumed:
                        self._requeue(arrival)
                    raise
        finally:
            self.in_flight -= 1

    async def _complete(
        self, arrival: Arrival, out: object | None, targets: list[np.ndarray] | None, t0: float
    ) -> tuple[Any, Receipt]:
        if arrival.rendezvous and not arrival.pulling:
            if targets is not None:
                arrival.dest, arrival.direct = targets, True
            elif arrival.dest is None:
                arrival.allocate()
            arrival.pulling = True
            await self.channel.pull(arrival)
        elif not arrival.done.done():
            await asyncio.shield(arrival.done)
        else:
            arrival.done.result()  # raises if the message failed
        arrival.consumed = True
        self.channel.release(arrival)
        if arrival.dest is None:
            raise TransferError("message completed without a destination buffer")
        staged = False
        try:
            if out is None:
                value = rebuild(arrival.tree, arrival.specs, arrival.dest)
            else:
                if not arrival.direct:
                    if targets is None:
                        targets = match_out(out, arrival.specs)
                    for src, dst in zip(arrival.dest, targets, strict=True):
                        np.copyto(dst, src)
                    staged = True
                value = out
        except TensorWireError:
            raise
        except Exception as exc:  # validated headers make this unreachable; never jam the tag
            raise TransferError(f"received message could not be rebuilt: {exc!r}") from exc
        ch = self.channel
        receipt = Receipt(
            transport=ch.transport,
            lanes=ch.lanes,
            nbytes=arrival.nbytes,
            seconds=time.perf_counter() - t0,
            protocol=arrival.protocol,
            direct=not staged,
            staged=staged,
            packed=False,
        )
        return value, receipt
