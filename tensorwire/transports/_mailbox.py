"""Tag matching, buffering and cancellation shared by every transport.

Messages match recvs per tag in FIFO order. A transport announces each message when its header
arrives (``Mailbox.arrive``), before the payload: if a recv is already posted, the payload lands
straight in that recv's ``out=`` buffer; if not, an eager payload is buffered (the sender spent
credit for it, so the buffer is bounded) and a rendezvous payload waits in the sender's memory
until a recv pulls it.

A cancelled recv never leaves its ``out=`` buffer to be written later: what already landed there
is copied into a buffer of tensorwire's own, the rest of the payload follows it there, and the
message goes back to the head of its tag's queue, so nothing is lost. (For a CUDA ``out=``, the
copies already queued into it are ordered before the consumer stream's later work.) A device with
no memory left for that buffer gets one in host memory instead: the cancel returns once what
landed in the device ``out=`` has been copied down. With no memory anywhere the message is
dropped alone, and the recv that takes it says so; the cancelled recv raises CancelledError
either way, as asked. A recv that
says its message's bytes are wanted nowhere else (``keep=False``: a cancelled operation's answer,
and the recv that drains it) lets them go instead: where the transport lands a payload in order
(tcp, inproc), the rest of it lands piece by piece in a small scratch buffer, never in one of
the message's size, and the message fails the recv that takes it. A recv whose message its
sender withdraws (a cancelled send) keeps its place in its tag's line from the moment the
withdrawal arrives (``Mailbox.abort``), so the next message is its own.

Device memory: a transport that can write device memory (``Channel.device_kinds``) lands a
matched message straight in the recv's CUDA ``out=`` or in tensors allocated on the requested
device; anything else lands in host memory of our own, and the recv moves it where it was asked
for (``device=``, or by default the sender's memory kind where this process has CUDA).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from bisect import bisect_right
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import _metrics
from .._loops import wait_out
from ..errors import TensorWireError, TransferError, UnsupportedTensorError
from ..memory import Event, download, stage_out, wait_event
from ..tensors import DTYPES, Spec, byte_view, match_out, rebuild, with_scalars
from ..tensors._device import (
    Device,
    DeviceTensor,
    Landing,
    Streams,
    allocate_device,
    capture_streams,
    check_cuda,
    cuda_usable,
    wanted_device,
)
from ..tensors._offload import copy_host, copy_host_soon, worth_a_thread
from ._base import Receipt, fresh, unsettled
from ._credit import own_tag

if TYPE_CHECKING:
    from ..control._pb import wire_pb2
    from ._base import Channel

__all__ = ["Arrival", "Mailbox", "SenderAborted"]

_SCRATCH_BYTES = 1 << 20  # where the bytes of a message that cannot be kept land, piece by piece


class SenderAborted(TransferError):
    """The sender cancelled this message part way; a recv waiting for it waits for the next."""


def _settle(fut: asyncio.Future[Any], exc: BaseException) -> None:
    """Fail ``fut`` without 'exception was never retrieved' noise if nobody awaits it."""
    if not fut.done():
        fut.set_exception(exc)
        fut.exception()


def _woken_by(wake: asyncio.Future[None]) -> Callable[[asyncio.Future[None]], None]:
    def woken(_: asyncio.Future[None]) -> None:
        if not wake.done():
            wake.set_result(None)

    return woken


def _caused(lost: TransferError, cause: BaseException) -> TransferError:
    """``lost`` (what a dropped message's next recv raises), with ``cause`` as its cause."""
    lost.__cause__ = cause
    return lost


class Arrival:
    """One incoming message, from its header on. ``dest`` is where its payload lands."""

    __slots__ = (
        "_flat",
        "_starts",
        "arrived",
        "channel",
        "consumed",
        "copied",
        "copied_bytes",
        "dest",
        "direct",
        "done",
        "go_ahead",
        "landed",
        "landing",
        "lost",
        "moving",
        "msg_id",
        "nbytes",
        "pinned",
        "protocol",
        "pulling",
        "rendezvous",
        "settled",
        "specs",
        "staged",
        "tag",
        "tree",
        "wake",
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
        nbytes: int | None = None,
    ) -> None:
        self.arrived = time.monotonic()  # when its header came (a wait in the queue counts: rpc deadlines)
        self.channel = channel
        self.tag = tag
        self.tree = tree
        self.specs = specs
        self.nbytes = sum(s.nbytes for s in specs) if nbytes is None else nbytes
        self.msg_id = msg_id
        self.rendezvous = rendezvous
        self.protocol = protocol
        self.pulling = False
        # a rendezvous message whose go-ahead went to its sender already though no recv pulls it
        # (ucx: taken back from a cancelled recv after its CTS, ``take_back``): its payload is
        # coming, and its sender can no longer withdraw it; the next recv pulls it as any other
        self.go_ahead = False
        # handed to a recv whole; not requeued, unless that recv is cancelled while it copies the
        # bytes out of our buffers, when the message goes back whole (and still holds its slot
        # and credit: they go back, ``settled``, once a recv has copied it out)
        self.consumed = False
        self.dest: list[np.ndarray | DeviceTensor] | None = None
        self.direct = False  # dest is the recv's out= buffer
        # the transport writes into dest and cannot redirect (a posted UCX receive): a recv
        # cancelled meanwhile waits for the write to finish before it gives the message back
        self.pinned = False
        self.settled = False  # its slot and credit went back to the sender already
        self.written = 0
        # how many payload bytes are in ``dest``, exact at every point the loop runs, kept by a
        # transport that writes them in order (tcp, inproc: ``mark``); None where unknown
        # (``written`` can lag by a frame, or a write under way elsewhere can still land)
        self.landed: int | None = None
        # the copy of what landed in a cancelled recv's out= into buffers of our own (``detach``),
        # under way in a copy thread: nothing reads ``dest`` before it ends
        self.moving: asyncio.Future[None] | None = None
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        # the future of the recv waiting for ``done`` (``Mailbox._complete``), woken as ``done``
        # is settled here: a loop turn sooner than through done's callbacks
        self.wake: asyncio.Future[None] | None = None
        self._flat: list[tuple[int, int, int, memoryview | None]] | None = None
        self._starts: list[int] = []  # the first byte of each _flat entry
        self.landing: Landing | None = None  # device copies queued for this message
        self.staged = False  # device bytes went through host staging chunks
        # the payload was copied on its way to ``dest``: bytes that rode with the header
        # ("inline"), or most of them came through another copy of ours (``count_copied``)
        self.copied = protocol == "inline"
        self.copied_bytes = 0  # payload bytes that came through a copy of ours so far (``count_copied``)
        # why the payload lands in scratch memory and is dropped (no memory for it here): the
        # message fails as it completes (``complete``), and its recv raises this
        self.lost: TransferError | None = None
        if self.nbytes == 0 and not rendezvous:
            self.done.set_result(None)

    def allocate(self, on_device: bool = False) -> None:
        """Give the payload a buffer of tensorwire's own: host memory, or, ``on_device`` (a
        transport that moves device memory by pointer), memory on the device a recv without
        ``device=`` would hand its CUDA tensors on (``_placement``), where it has the memory
        (else host memory for all)."""
        dest = None
        if on_device and any(s.device == "cuda" for s in self.specs):
            with contextlib.suppress(TransferError):
                dest = [
                    s.allocate()
                    if (w := _placement(s, None, None)) is None
                    else allocate_device(s.dtype, s.shape, s.framework, w)
                    for s in self.specs
                ]
        self.dest = dest if dest is not None else [s.allocate() for s in self.specs]
        self.direct = False
        self._flat = None

    def adopt(self, on_device: bool = False) -> bool:
        """Take an eager payload that no recv has pulled into memory of our own now (or into the
        device tensors a recv placed for it): allocate a buffer if it has none (its CUDA tensors
        on the device, ``on_device``: see ``allocate``), or only the caller's out= (a recv may be
        cancelled and give it back), and mark it as no longer waiting to be pulled. False, and
        nothing changed, if the memory cannot be had: it stays with its sender, as a rendezvous
        message does, for a recv to pull it (into out=, or into memory found then)."""
        if self.dest is None or self.direct:
            try:
                self.allocate(on_device)
            except TransferError:
                return False
        self.rendezvous = False
        return True

    def buffer(self) -> None:
        """``allocate`` for a payload that is on its way and must be taken now (eager): if the
        memory cannot be had, its bytes are read into scratch and dropped (``drop``), and the
        channel and every other message live on."""
        try:
            self.allocate()
        except TransferError as exc:
            self.drop(self._no_memory(exc))

    def _no_memory(self, exc: TransferError) -> TransferError:
        return _caused(
            TransferError(
                f"a {self.nbytes}-byte message on this tag came before its recv and could not be kept here (out "
                "of memory); it was dropped: post a recv with out= before such messages come, or lower "
                "Limits.recv_buffer_bytes"
            ),
            exc,
        )

    def droppable(self) -> bool:
        """Whether the rest of the payload can go to scratch now (``drop``): it is yet to land
        whole, and lands in host memory in order, exactly as far as ``landed`` says (tcp,
        inproc), so that no write under way elsewhere still lands in its current ``dest``."""
        return (
            not self.done.done()
            and self.lost is None
            and self.landed is not None
            and not self.pinned
            and (self.dest is None or all(type(d) is np.ndarray for d in self.dest))
        )

    def let_rest_go(self) -> None:
        """Nobody wants the payload's bytes (``Mailbox.recv``'s ``keep=False``): ``drop`` them,
        where the transport allows it (``droppable``), or where it lands them in device memory
        through staging chunks, in order (tcp), once the copies queued so far are handed to
        their targets' streams (``_let_landing_go``)."""
        if self.droppable() or (
            not self.done.done()
            and self.lost is None
            and self.landed is not None
            and not self.pinned
            and self._let_landing_go()
        ):
            self.drop(TransferError(f"a {self.nbytes}-byte message on this tag was dropped: nobody wanted its bytes"))

    def _let_landing_go(self) -> bool:
        """``let_rest_go`` for a payload landing in device tensors: each one's stream waits for
        the copies into it queued so far, which still run (out= may hold part of the bytes, as
        after a one-sided read that failed part way), and the landing's lanes go back; nothing
        waits for those copies here. A cancelled read of an owner's answer landing behind a busy
        consumer stream, with no device memory for buffers of ours, waited for that stream to
        copy what landed down to the host (``_to_host``), for good were it stuck, though nobody
        wanted the bytes. False where an engine has no streams to order: the message is kept,
        and a cancelled recv waits for those copies (``detach``)."""
        landing = self.landing
        if landing is not None:
            for d in self.dest or ():
                if isinstance(d, DeviceTensor):
                    after = landing.flush(d)
                    if after is not None and not d.engine.stream_wait(d.stream, after):
                        return False
            landing.finish_now([])
            self.landing = None
        return True

    def drop(self, lost: TransferError) -> None:
        """Land the rest of the payload in a small scratch buffer, reused for every piece, and
        fail the message with ``lost`` when it completes: the recv that takes it raises that."""
        self.lost = lost
        step = min(self.nbytes, _SCRATCH_BYTES) or 1
        scratch = np.empty(step, np.uint8)
        self.dest = [scratch[: min(step, self.nbytes - pos)] for pos in range(0, self.nbytes, step)]
        self.direct = False
        self._flat = None

    def mark(self, end: int) -> None:
        """The payload has landed up to byte ``end`` (a transport that writes it in order calls
        this after each write, so that ``landed`` is exact wherever the loop runs)."""
        self.landed = end

    def detach(self) -> asyncio.Future[None] | None:
        """Stop writing into the caller's buffer: keep what landed, continue into our own.

        Returns the future of the copy of what landed (``moving``: a copy thread's, or the task
        that copies it down from device memory, ``_to_host``): the cancelled recv waits it out
        before it returns, since it reads the caller's out=. Where the transport moved the
        message out of out= already (ucx's ``take_back`` of a message whose first tensors had
        landed), the copy it left running, if any."""
        if self.dest is None or not self.direct:
            return self.moving if self.moving is not None and not self.moving.done() else None
        if not self.done.done() and self.channel.unread(self):
            # nothing landed in the caller's buffer, nor will: the message goes back as it
            # came, and the next recv places it (copying out= whole took 3.7 s for 1 GiB)
            self.dest = None
            self.direct = False
            self._flat = None
            return None
        landed = self.nbytes if self.done.done() else self.landed
        # what landed there reaches the recv that takes the message through a copy of ours
        self.count_copied(self.written if landed is None else landed)
        if landed is not None and all(isinstance(d, np.ndarray) for d in self.dest):
            return self._move(landed)
        old = self.dest
        try:
            mine = [
                DeviceTensor(d.engine.empty(d.nbytes, d.stream), d.dtype, d.shape, spec.framework, d.stream)
                if isinstance(d, DeviceTensor)
                else None
                for spec, d in zip(self.specs, old, strict=True)
            ]
        except TransferError:
            # no device memory for buffers of ours (CopyEngine.allocating): host memory instead.
            # (Where ``landed`` is unknown the transport writes no more: ucx waits for its receives.)
            return self._to_host(self.nbytes if landed is None else landed)
        new: list[np.ndarray | DeviceTensor] = []
        for spec, d, m in zip(self.specs, old, mine, strict=True):
            if isinstance(d, DeviceTensor):
                # a device buffer of our own on the same device; the copy of what landed queues
                # after the landing copies (or after the transport's own writes by pointer,
                # finished by now), and the caller's stream waits for it
                assert m is not None
                if self.landing is not None or self.written:
                    landing = self.land()
                    landing.copy(m, d)
                    landing.hand_back(d)
                new.append(m)
            else:
                try:
                    own = spec.allocate()
                except TransferError as exc:
                    # no memory to keep what landed: the rest goes to scratch, never into
                    # the caller's buffer, and the message is dropped (its next recv says so)
                    self._lose(self._cannot_keep(exc))
                    return None
                # a transport may be part way through a chunk, so ``written`` can lag: copy it all
                np.copyto(own, d)
                new.append(own)
        self.dest = new
        self.direct = False
        self._flat = None
        return None

    def count_copied(self, n: int) -> None:
        """``n`` more payload bytes reach the recv that takes the message through a copy of
        tensorwire's (out of tcp's read-ahead buffer, out of a cancelled recv's out=, aside from
        the memory being sent): the message is ``copied``, not direct, once most of its payload
        went that way."""
        if n:
            self.copied_bytes += n
            self.copied = self.copied or 2 * self.copied_bytes > self.nbytes

    def _to_host(self, landed: int) -> asyncio.Future[None] | None:
        """``detach`` where the device has no memory for buffers of ours: the message is kept in
        host memory of ours. The first ``landed`` payload bytes are in the caller's tensors (in
        their device tensors once the landing's copies so far have run) and are copied down, in
        a task whose future this returns (``moving``); the rest lands on the host from now on
        (tcp hands a chunk under way there: ``TcpChannel._land``). No host memory either: the
        message is dropped (``_lose``), and the task only waits for the copies into out=."""
        old = self.dest
        assert old is not None
        landing, self.landing = self.landing, None
        new: list[np.ndarray] | None = None
        lost: TransferError | None = None
        try:
            new = [s.allocate() for s in self.specs]
        except TransferError as exc:
            lost = self._cannot_keep(exc)
        downs: list[tuple[DeviceTensor, memoryview, Event | None]] = []
        pos = 0
        for i, d in enumerate(old):
            start, pos = pos, pos + d.nbytes
            if isinstance(d, DeviceTensor):
                # the copies queued into the caller's tensor so far come before its stream's next
                # work, and the cancel waits for them (through the task: no block here)
                after = None if landing is None else landing.flush(d)
                if after is not None:
                    d.engine.stream_wait(d.stream, after)
                n = min(max(landed - start, 0), d.nbytes) if new is not None else 0
                if n or after is not None:
                    downs.append((d, byte_view(new[i])[:n] if new is not None else memoryview(b""), after))
            elif new is not None:
                np.copyto(new[i], d)  # as in detach: what landed in host tensors, all of it
        if landing is not None:
            landing.finish_now([])  # its lanes go back: nothing more is queued on them
        if new is None:
            assert lost is not None
            self._lose(lost)
        else:
            self.dest = new  # type: ignore[assignment]  # (list invariance)
            self.direct = False
            self._flat = None
        if downs:
            self.moving = asyncio.ensure_future(self._download(downs))
        return self.moving if downs else None

    async def _download(self, downs: list[tuple[DeviceTensor, memoryview, Event | None]]) -> None:
        """``_to_host``'s copies down, each after the copies into the caller's tensor that
        ``after`` marks (an empty ``dst``: only those); should one fail (a device error), the
        message is lost and its next recv says so. Never raises."""
        try:
            for d, dst, after in downs:
                if after is not None:
                    # on the host, for as long as it takes (the cancel must not return while they
                    # write out=): they wait for the consumer's stream, which may stay busy, and
                    # copies down queued behind them would hold the process's staging chunks
                    await wait_event(d.engine, after)
                if not len(dst):
                    continue
                async with contextlib.aclosing(stage_out(d.buf, 0, len(dst))) as chunks:
                    async for off, view in chunks:
                        dst[off : off + len(view)] = view
        except Exception as exc:
            self._lose(
                _caused(
                    TransferError(
                        f"a {self.nbytes}-byte message on this tag was dropped: its recv was cancelled as its "
                        f"bytes landed in device memory, and they could not be copied out ({exc!r})"
                    ),
                    exc,
                )
            )

    def _cannot_keep(self, exc: TransferError) -> TransferError:
        return _caused(
            TransferError(
                f"a {self.nbytes}-byte message on this tag was dropped: its recv was cancelled as its bytes "
                "landed, and there was no memory here to keep them (out of memory); free memory, or let "
                "recvs into out= run to their end"
            ),
            exc,
        )

    def _lose(self, lost: TransferError) -> None:
        """What landed cannot be kept: the message fails the next recv that takes it, with
        ``lost``. Bytes yet to come land in scratch (``drop``); a message whole already fails now,
        its slot and credit going back, as a dropped one's do once it completes."""
        if not self.done.done():
            self.drop(lost)
            return
        self.lost = lost
        self.dest = None
        self.direct = False
        self._flat = None
        self.settle()
        failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        _settle(failed, lost)
        self.done = failed

    def _move(self, landed: int) -> asyncio.Future[None] | None:
        """``detach`` where exactly the first ``landed`` bytes are in the caller's host buffers:
        the rest lands in ours from now on, and those bytes, which no longer change, are copied
        over (a large copy in a copy thread, so that a cancel of a large recv does not stall the
        loop for a whole copy; the bytes yet to come are not copied at all)."""
        old = self._layout()
        try:
            new = [s.allocate() for s in self.specs]
        except TransferError as exc:
            self._lose(self._cannot_keep(exc))  # as in detach: what landed is lost, and the message with it
            return None
        pairs = []
        for start, end, i, mv in old:
            if start >= landed:
                break
            n = min(end, landed) - start
            dst = np.frombuffer(byte_view(new[i]), np.uint8, n)
            pairs.append((dst, np.frombuffer(mv, np.uint8, n)))  # type: ignore[arg-type]  # host: mv is set
        self.dest = new  # type: ignore[assignment]  # (list invariance)
        self.direct = False
        self._flat = None
        self.moving = copy_host_soon(pairs)
        return self.moving

    async def moved(self) -> None:
        """Wait for the copy ``detach`` left running, if any, before reading ``dest``."""
        if self.moving is not None:
            await asyncio.shield(self.moving)

    def _layout(self) -> list[tuple[int, int, int, memoryview | None]]:
        """Each non-empty tensor of ``dest`` as (first byte, end, index, host byte view or None);
        ``_starts`` holds the first bytes, for the bisect that finds an offset's tensor (a scan
        of every tensor per offset made landing a message of many tensors quadratic)."""
        if self._flat is None:
            assert self.dest is not None
            flat = []
            starts = []
            pos = 0
            for i, a in enumerate(self.dest):
                if a.nbytes:
                    flat.append((pos, pos + a.nbytes, i, None if isinstance(a, DeviceTensor) else byte_view(a)))
                    starts.append(pos)
                    pos += a.nbytes
            self._flat = flat
            self._starts = starts
        return self._flat

    def locate(self, offset: int) -> tuple[int, int, int]:
        """Which tensor of ``dest`` holds payload byte ``offset``: (index, offset in it, bytes left in it)."""
        flat = self._layout()
        k = bisect_right(self._starts, offset) - 1
        if k >= 0:
            start, end, i, _ = flat[k]
            if offset < end:
                return i, offset - start, end - offset
        raise IndexError(f"offset {offset} outside a {self.nbytes}-byte payload")

    def view(self, offset: int, n: int) -> memoryview:
        """A writable byte view of the (host) payload at ``offset``, at most ``n`` bytes long."""
        flat = self._layout()
        k = bisect_right(self._starts, offset) - 1
        if k >= 0:
            start, end, _, mv = flat[k]
            if offset < end and mv is not None:
                return mv[offset - start : min(end, offset + n) - start]
        raise IndexError(f"offset {offset} outside the host part of a {self.nbytes}-byte payload")

    def fill(self, data: memoryview) -> None:
        """Copy the whole payload (``data``, ``nbytes`` long) into ``dest`` (host memory)."""
        dest = self.dest
        assert dest is not None
        if all(type(a) is np.ndarray for a in dest):
            _copy_into(dest, data)  # type: ignore[arg-type]
        else:
            pos = 0
            n = len(data)
            while pos < n:
                view = self.view(pos, n)
                view[:] = data[pos : pos + len(view)]
                pos += len(view)
        self.written = self.nbytes

    def land(self) -> Landing:
        """The device side of this message (created on first use)."""
        if self.landing is None:
            self.landing = Landing()
        return self.landing

    def complete(self) -> None:
        if self.done.done():
            return
        if self.lost is not None:  # its bytes went to scratch: its slot and credit go back now
            self.dest = None
            self.settle()
            self.fail(self.lost)
            return
        self.done.set_result(None)
        self._wake()

    def settle(self) -> None:
        """Give its slot and credit back to the sender, once (``settled``)."""
        if not self.settled:
            self.settled = True
            self.channel.release(self)

    def fail(self, exc: BaseException) -> None:
        _settle(self.done, exc)
        self._wake()

    def _wake(self) -> None:
        wake = self.wake
        if wake is not None and not wake.done():
            wake.set_result(None)

    async def completed(self) -> None:
        """Wait until ``done`` is settled, without taking its outcome; a cancelled wait leaves
        ``done`` alone. ``asyncio.shield(done)``, a loop turn sooner where ``complete`` or
        ``fail`` settles it: they wake the recv directly, where done's callbacks would run in
        the next turn and wake it only in the one after (a transport that settles ``done``
        itself still wakes it that way)."""
        wake = self.wake = asyncio.get_running_loop().create_future()
        woken = _woken_by(wake)
        self.done.add_done_callback(woken)
        try:
            await wake
        except BaseException:
            self.done.remove_done_callback(woken)
            raise
        finally:
            if self.wake is wake:
                self.wake = None

    def let_go(self) -> None:
        """The message failed part way (its sender withdrew it, or the channel broke): the device
        copies already queued into its destination (the caller's out=, or device buffers of ours
        now dropped) come before their streams' next work (engines without streams wait here, as
        in ``detach``), and the landing's lanes go back."""
        landing, self.landing = self.landing, None
        if landing is None:
            return
        for d in self.dest or ():
            if isinstance(d, DeviceTensor):
                landing.hand_back(d)
        landing.finish_now([])


def _match(out: object, arrival: Arrival, streams: Streams | None) -> list[np.ndarray | DeviceTensor]:
    """``match_out`` for ``arrival``, whatever the caller's out= object raises (a dict whose
    ``items`` fails, say) as an error of the tree: it fails that recv, never the channel."""
    try:
        return match_out(out, arrival.specs, streams, arrival.tree)
    except TensorWireError:
        raise
    except Exception as exc:
        raise UnsupportedTensorError(f"out= cannot be received into: {type(exc).__name__}: {exc}") from exc


class _Delivered:
    """What an express delivery (``Mailbox.deliver``) hands the waiting recv: the message's
    tensors, already filled (the recv's out= array, or new host arrays), and how to give its
    slot and credit back once the recv takes it."""

    __slots__ = ("dest", "nbytes", "protocol", "release", "specs", "tree")

    def __init__(
        self,
        tree: wire_pb2.TreeNode,
        specs: list[Spec],
        dest: list[np.ndarray],
        nbytes: int,
        protocol: str,
        release: Callable[[int], None],
    ) -> None:
        self.tree = tree
        self.specs = specs
        self.dest = dest
        self.nbytes = nbytes
        self.protocol = protocol  # as the transport's sender names it in its receipt
        self.release = release

    def finish(self, channel: Channel, out: object | None, t0: float) -> tuple[Any, Receipt]:
        """The recv's value and receipt. The recv has taken the message: its slot and credit go
        back now, not when it was delivered (its recv might have been cancelled in between,
        and given it back to the queue: ``give_back``)."""
        nbytes = self.nbytes
        self.release(nbytes)
        if out is not None:  # out= is one array: deliver() checked
            value = out
        else:
            value = _rebuild(self.tree, self.specs, self.dest)  # type: ignore[arg-type]
        seconds = time.perf_counter() - t0
        # the bytes came with the header and deliver() copied them out of the transport's frame
        # (ucx, verbs: "inline") or read buffer (tcp): never direct, unless there were none
        direct = not nbytes
        return value, Receipt(channel.transport, channel.lanes, nbytes, seconds, self.protocol, direct, False, False)

    def give_back(self, channel: Channel, tag: int, out: object | None) -> Arrival:
        """The message as a complete arrival in buffers of ours (its recv was cancelled after
        the bytes landed, before it took them). It still holds its slot and credit, until a
        later recv takes it."""
        arrival = _GivenBack(channel, tag, self.tree, self.specs, protocol=self.protocol, nbytes=self.nbytes)
        arrival.release = self.release
        arrival.copied = arrival.nbytes > 0  # deliver() copied them out of the transport's buffer
        # the caller's out= stays the caller's: copy it; arrays deliver() allocated are ours
        arrival.dest = [a.copy() for a in self.dest] if out is not None else list(self.dest)
        arrival.written = arrival.nbytes
        if not arrival.done.done():
            arrival.done.set_result(None)
        return arrival


class _GivenBack(Arrival):
    """An express delivery that its recv, cancelled before it took it, gave back to the queue.
    Its slot and credit go back the way the transport's express path said (``deliver``'s
    ``release``): the transport's own ``release(arrival)`` knows nothing of this message, and
    would tell wrongly whether it came eager (ucx asks its set of eager arrivals)."""

    __slots__ = ("release",)

    release: Callable[[int], None]

    def settle(self) -> None:
        if not self.settled:
            self.settled = True
            self.release(self.nbytes)


class _Posted:
    """A recv waiting in its tag's line for a message (``future``), or holding one it took."""

    __slots__ = ("again", "device", "future", "keep", "out", "seq", "streams")

    def __init__(
        self, out: object | None, device: Device | None, streams: Streams | None, keep: bool, seq: int
    ) -> None:
        self.out = out
        self.device = device
        self.streams = streams
        self.keep = keep
        self.seq = seq  # when its recv was called: the lines keep this order (``Mailbox._line_up``)
        self.future: asyncio.Future[Arrival | _Delivered] = asyncio.get_running_loop().create_future()
        # where its recv waits again once the message it holds is withdrawn (``Mailbox.abort``)
        self.again: _Posted | None = None


def _unlanded(arrival: Arrival) -> bool:
    """Nothing of ``arrival`` has landed, nor will before a recv asks for it (no buffer: a
    rendezvous message, or one given back unread): it is placed in the out= of the recv that
    takes it, as a new message is (``Mailbox._to_posted``'s ``place``), not in a buffer of ours."""
    return arrival.dest is None and not arrival.done.done()


class Mailbox:
    """Per-channel queues of arrived messages and posted recvs, matched per tag."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self._arrived: dict[int, deque[Arrival]] = {}
        self._posted: dict[int, deque[_Posted]] = {}
        # arrivals handed to a recv that waits for them to complete, and that recv: failed with
        # the channel too, so that no recv outlives its channel, whatever the transport still
        # tracks; and a recv whose message is withdrawn keeps its place (``abort``)
        self._held: dict[Arrival, _Posted] = {}
        self._seq = 0  # recvs called so far: each recv's place in its tag's line
        self.failure: BaseException | None = None
        self.in_flight = 0  # the user's recvs waiting or under way (not tensorwire's own tags)

    # -- transport side -------------------------------------------------------------------
    def deliver(
        self,
        tag: int,
        tree: wire_pb2.TreeNode,
        specs: list[Spec],
        data: memoryview,
        dest: list[np.ndarray] | None = None,
        *,
        protocol: str,
        release: Callable[[int], None],
    ) -> bool:
        """The express path for a small message whose bytes came with its header (``data``,
        the tensors' bytes in order): if the oldest recv posted on ``tag`` waits with an
        ``out=`` that is one contiguous, writable host array of the message's dtype and shape,
        or without ``out=`` and ``device=`` for a message of host tensors, copy ``data`` into
        out= (or into new host arrays) and wake that recv; True if so. Anything else (no recv,
        another out=, device memory) is False, and the transport goes the general way
        (``arrive``). ``dest``: what ``express_dest`` just returned for this message, if the
        caller asked first. ``protocol``: what the sender's receipt names (tcp sends a small
        payload in its first frame and calls that "eager"; ucx and verbs call it "inline").
        ``release(nbytes)``: gives the message's slot and credit back to the sender (as an eager
        message's), once its recv has taken it: a recv cancelled before its task resumed gives
        the message back to the queue, and it goes on counting against the sender's grants."""
        posted = self._posted.get(tag)
        if not posted:
            return False
        p = posted[0]
        if dest is None:
            dest = _express_dest(p, tree, specs)
            if dest is None:
                return False
        _copy_into(dest, data)
        posted.popleft()
        if not posted:
            del self._posted[tag]
        p.future.set_result(_Delivered(tree, specs, dest, data.nbytes, protocol, release))
        return True

    def express_dest(self, tag: int, tree: wire_pb2.TreeNode, specs: list[Spec]) -> list[np.ndarray] | None:
        """Where ``deliver`` would put a message of ``specs`` on ``tag`` now (the oldest posted
        recv's out=, or new host arrays), or None if it would not take it. No side effects but
        the allocation; valid until the loop runs again."""
        posted = self._posted.get(tag)
        return _express_dest(posted[0], tree, specs) if posted else None

    def holds_messages(self, ignore: range = range(0)) -> bool:
        """Does a message that arrived (whole, once the channel is gone) wait for a recv on a
        tag outside ``ignore``?"""
        return any(q for tag, q in self._arrived.items() if tag not in ignore)

    def oldest(self, tag: int) -> Arrival | None:
        """The oldest message queued on ``tag`` for a recv (whole, arriving, or waiting for its
        go-ahead), or None."""
        q = self._arrived.get(tag)
        return q[0] if q else None

    def waited(self, tag: int) -> float:
        """How long the oldest message queued on ``tag`` for a recv has waited (0.0: none waits)."""
        oldest = self.oldest(tag)
        return 0.0 if oldest is None else time.monotonic() - oldest.arrived

    def has_posted(self, tag: int) -> bool:
        """Is any recv (perhaps one cancelled a moment ago) posted on ``tag``?"""
        return tag in self._posted

    def arrive(self, arrival: Arrival) -> None:
        """A message header arrived. Match it to a posted recv or queue it."""
        if not self._to_posted(arrival, place=True):
            self._arrived.setdefault(arrival.tag, deque()).append(arrival)

    def _to_posted(self, arrival: Arrival, *, place: bool) -> bool:
        """Hand ``arrival`` to the oldest live recv posted on its tag; False if none takes it. A
        recv whose out= cannot take it fails (not the channel) and the next is tried. ``place``:
        a message yet to land lands where that recv wants it (its out=, or device tensors);
        one given back keeps the buffers of ours that hold what landed."""
        posted = self._posted.get(arrival.tag)
        while posted:
            p = posted.popleft()
            if not posted:
                del self._posted[arrival.tag]
            if p.future.done():  # cancelled recv
                continue
            try:
                if p.out is not None:
                    targets = _match(p.out, arrival, p.streams)
                    if place and self._lands(targets):
                        arrival.dest = targets
                        arrival.direct = True
                elif not p.keep:
                    arrival.let_rest_go()
                elif place and arrival.nbytes and self.channel.device_kinds:
                    self._place(arrival, p.device, p.streams)
            except TensorWireError as exc:  # that recv fails, not the channel
                p.future.set_exception(exc)
                continue
            self._held[arrival] = p
            p.future.set_result(arrival)
            return True
        return False

    def abort(self, arrival: Arrival) -> None:
        """The sender gave up on ``arrival``: drop it. A recv that took it keeps its place in
        its tag's line from now, not from when its task next runs: a message handed over before
        then (its header read in the same pass as the withdrawal, or sent by a task that ran
        first) goes to that recv, not to one posted after it (``_keep_place``)."""
        holder = self._held.get(arrival)
        keep_place = holder is not None and not arrival.done.done() and self.failure is None
        self.remove(arrival, SenderAborted("sender cancelled the message"))
        if holder is not None and keep_place:
            self._keep_place(arrival.tag, holder)

    def _keep_place(self, tag: int, holder: _Posted) -> None:
        """Post ``holder``'s recv again, where it was in its tag's line (``holder.again``, which
        its task awaits once it has seen the withdrawal). A message queued for no recv (the recv
        took the withdrawn one from the queue, and the next came behind it) is its now."""
        p = _Posted(holder.out, holder.device, holder.streams, holder.keep, holder.seq)
        holder.again = p
        self._line_up(tag, p)
        q = self._arrived.get(tag)
        if q:
            head = q.popleft()
            if not q:
                del self._arrived[tag]
            # (one yet to land, that waited for its go-ahead, is placed as a new message is)
            if not self._to_posted(head, place=_unlanded(head)):  # (its out= cannot take it: it stays first)
                self._arrived.setdefault(tag, deque()).appendleft(head)

    def _line_up(self, tag: int, p: _Posted) -> None:
        """Post ``p`` in its tag's line, behind the recvs called before its own and ahead of
        those called after (a new recv: at the end)."""
        line = self._posted.get(tag)
        if line is None:
            self._posted[tag] = deque((p,))
            return
        i = len(line)
        while i and line[i - 1].seq > p.seq:
            i -= 1
        line.insert(i, p)

    def remove(self, arrival: Arrival, exc: BaseException) -> None:
        """Take ``arrival`` out of its tag's queue, if it waits there, and fail it with ``exc``."""
        q = self._arrived.get(arrival.tag)
        if q is not None and arrival in q:
            q.remove(arrival)
            if not q:
                del self._arrived[arrival.tag]
        arrival.fail(exc)

    def fail(self, exc: BaseException) -> None:
        """The channel is gone: fail every posted recv and every incomplete message."""
        # each operation fails with a copy of its own, and the channel keeps one without the
        # traceback ``exc`` has so far (``fresh``): a raised failure keeps its raisers' frames
        self.failure = fresh(exc)
        for q in self._posted.values():
            for p in q:
                _settle(p.future, fresh(exc))
        self._posted.clear()
        for tag, aq in list(self._arrived.items()):
            keep = deque(a for a in aq if a.done.done() and a.done.exception() is None)
            for a in aq:
                if not a.done.done():
                    a.fail(fresh(exc))
            self._arrived[tag] = keep
        for a in self._held:
            a.fail(fresh(exc))  # a whole message delivered before the failure stays delivered

    def _lands(self, targets: list[np.ndarray | DeviceTensor]) -> bool:
        """Can this channel write every target where it is (host, or device memory it knows)?
        An empty device tensor takes no byte: it never keeps the rest from landing in place
        (it sent a message's host bytes through buffers of ours, and its receipt said staged)."""
        kinds = self.channel.device_kinds
        return all(not isinstance(t, DeviceTensor) or not t.nbytes or t.engine.kind in kinds for t in targets)

    def _place(self, arrival: Arrival, want: Device | None, streams: Streams | None) -> None:
        """A recv without out= is posted: allocate device tensors where they are to end up, so
        the transport lands the payload there directly."""
        where = [_placement(s, want, streams) for s in arrival.specs]
        if "cuda" not in self.channel.device_kinds or all(w is None for w in where):
            return
        arrival.dest = [
            s.allocate() if w is None else allocate_device(s.dtype, s.shape, s.framework, w, streams)
            for s, w in zip(arrival.specs, where, strict=True)
        ]
        arrival.direct = False

    # -- user side ------------------------------------------------------------------------
    async def _requeue(self, arrival: Arrival, keep: bool = True) -> None:
        """Give a cancelled recv's message back, out of the recv's out=: to the oldest recv
        posted on its tag meanwhile (it waited behind the one cancelled, and would otherwise
        take the next message first, this one left queued), else to the head of its queue;
        return once nothing reads or writes that out= any more. ``keep=False``: what is yet to
        land goes to scratch where it can (``Arrival.let_rest_go``), not to a buffer of ours of
        the message's size, and what landed in out= is not copied out: the message fails the
        recv that drains it."""
        if not keep:
            arrival.let_rest_go()
        moving = arrival.detach()
        # nothing of it landed, nor will before a recv asks (``detach`` left it no buffer): it is
        # placed as a new message is, in the out= of the recv that takes it, not in ours
        if not self._to_posted(arrival, place=_unlanded(arrival)):
            self._arrived.setdefault(arrival.tag, deque()).appendleft(arrival)
        if moving is not None:
            await wait_out(moving)  # the copy reads the caller's out=: it ends before the cancel does

    async def recv(
        self, tag: int, out: object | None, device: object = None, *, streams: Streams | None = None, keep: bool = True
    ) -> tuple[Any, Receipt]:
        """The next message on ``tag`` (``Channel.recv``), counted in the metrics. ``keep=False``:
        its bytes are wanted nowhere but in ``out=``: with out=, a recv cancelled part way lets
        the rest go rather than give the message back in buffers of ours; without, it takes the
        next message to drain it, lets go of what is yet to land and raises (TransferError), or
        returns it if it came whole. Where the transport cannot redirect a payload under way
        (``Arrival.droppable``), it is kept as by any recv."""
        t0 = time.perf_counter()
        want = None if device is None else wanted_device(device, out is not None)
        if streams is None:
            streams = capture_streams(want)
        # the user's recvs alone: tensorwire's standing ones (its RPC and one-sided services)
        # showed as 3 operations in flight in an idle peer's repr
        counted = not own_tag(tag)
        self.in_flight += counted
        seq = self._seq
        self._seq += 1
        # where this recv waits in its tag's line: posted now, or posted again in its old place
        # when the message it took was withdrawn (``abort``); None: it looks at the queue first
        p: _Posted | None = None
        try:
            while True:
                q = self._arrived.get(tag) if p is None else None
                if q:
                    arrival = q[0]
                    # a mismatched out= raises here and leaves the message queued
                    targets = _match(out, arrival, streams) if out is not None else None
                    q.popleft()
                    if not q:
                        del self._arrived[tag]  # tags may be unique per operation: keep no empties
                    if want is None and _whole_on_host(arrival, out, targets):
                        value, receipt = self._take_whole(arrival, out, targets, t0)
                        _metrics.transferred("recv", receipt, tag)
                        return value, receipt
                    holder = self._held[arrival] = _Posted(out, want, streams, keep, seq)
                    if out is None and not keep:
                        arrival.let_rest_go()
                else:
                    if p is None:
                        if self.failure is not None:
                            raise fresh(self.failure)
                        self.channel.check_open()
                        p = _Posted(out, want, streams, keep, seq)
                        self._line_up(tag, p)  # (behind every recv called before this one)
                    if not p.future.done():
                        self.channel.wait_briefly(p.future)
                    try:
                        got = await p.future
                        if isinstance(got, _Delivered):  # express: the bytes are in place already
                            value, receipt = got.finish(self.channel, out, t0)
                            _metrics.transferred("recv", receipt, tag)
                            return value, receipt
                        arrival = got
                    except asyncio.CancelledError:
                        await self._give_up(p, tag, out, keep)
                        raise
                    finally:
                        pq = self._posted.get(tag)
                        if pq is not None and not pq:
                            del self._posted[tag]
                    holder, p = p, None
                    targets = None
                try:
                    value, receipt = await self._complete(arrival, out, targets, t0, want, streams, keep)
                    _metrics.transferred("recv", receipt, tag)
                    return value, receipt
                except SenderAborted:
                    # withdrawn: wait in the place kept for this recv since the withdrawal,
                    # which may hold the next message already (none kept: post again in turn)
                    arrival.let_go()
                    p, holder.again = holder.again, None
                    continue
                except BaseException:
                    failed = arrival.done.done() and arrival.done.exception() is not None
                    if failed:
                        arrival.let_go()
                    elif not arrival.consumed:
                        await self._requeue(arrival, keep)
                    if holder.again is not None:  # (withdrawn as this recv was cancelled)
                        again, holder.again = holder.again, None
                        await self._give_up(again, tag, out, keep)
                    raise
                finally:
                    if self._held.get(arrival) is holder:
                        del self._held[arrival]
        finally:
            self.in_flight -= counted

    def _take_whole(
        self, arrival: Arrival, out: object | None, targets: list[np.ndarray | DeviceTensor] | None, t0: float
    ) -> tuple[Any, Receipt]:
        """``_complete`` for a message that came whole into host buffers of ours and goes to the
        host (``_whole_on_host``), done at once: nothing in that path waits for anything, and
        its three coroutines, the holder and its future, cost more than the copy of a small
        message (a stream of 4 KiB messages reaches its recvs this way). The message is taken,
        whatever happens: its slot and credit go back once its bytes have left our buffers."""
        arrival.consumed = True
        try:
            dest = arrival.dest
            assert dest is not None
            staged = arrival.staged
            if targets is None:
                value = _rebuild(arrival.tree, arrival.specs, dest)
            else:
                for src, dst in zip(dest, targets, strict=True):
                    np.copyto(dst, src)  # type: ignore[arg-type]  # (host arrays: _whole_on_host)
                    staged = staged or bool(src.nbytes)
                try:
                    value = with_scalars(out, arrival.tree)
                except TensorWireError:
                    raise
                except Exception as exc:  # (as in _hand_over)
                    raise TransferError(f"received message could not be rebuilt: {exc!r}") from exc
        finally:
            arrival.settle()
        return value, self._receipt(arrival, t0, staged)

    async def _give_up(self, p: _Posted, tag: int, out: object | None, keep: bool) -> None:
        """The recv posted as ``p`` is cancelled: out of its tag's line, or, if a message was
        handed to it, that message back (``_requeue``); if its sender has withdrawn it, the
        place kept for the recv is given up instead, and what that place took goes back."""
        f = p.future
        if not f.done() or f.cancelled() or f.exception() is not None:
            pq = self._posted.get(tag)
            if pq is not None and p in pq:
                pq.remove(p)
                if not pq:
                    del self._posted[tag]
            return
        got = f.result()
        if isinstance(got, _Delivered):
            # delivered into out= before the cancel: give the message back
            await self._requeue(got.give_back(self.channel, tag, out))
            return
        if self._held.get(got) is p:
            del self._held[got]  # given back (requeued) or failed
        if got.done.done() and isinstance(got.done.exception(), SenderAborted):
            got.let_go()
            if p.again is not None:
                again, p.again = p.again, None
                await self._give_up(again, tag, out, keep)
            return
        if got.pinned and self.channel.take_back(got):
            got.pinned = False  # nothing of it moved, nor will: it goes back unread
        elif got.pinned and not await _finished(got):
            # it failed: nothing to give back. Where its transport says the landing may go on
            # in out= (a UCX receive that outlived its grace: a sender stopped mid-payload), the
            # recv raises that, not the cancel, as a recv cancelled in its pull does: a bare
            # cancel would say out= is the caller's again
            late = unsettled([None if got.done.cancelled() else got.done.exception()])
            if late is not None:
                raise late
            return
        await self._requeue(got, keep)

    async def _complete(
        self,
        arrival: Arrival,
        out: object | None,
        targets: list[np.ndarray | DeviceTensor] | None,
        t0: float,
        want: Device | None = None,
        streams: Streams | None = None,
        keep: bool = True,
    ) -> tuple[Any, Receipt]:
        if arrival.done.done():
            # raises if it failed: its sender withdrew it, perhaps between the match and now
            # (SenderAborted: this recv waits for the next message), or the channel failed
            arrival.done.result()
        if arrival.rendezvous and not arrival.pulling:
            if targets is not None and self._lands(targets):
                arrival.dest, arrival.direct = targets, True
            elif targets is None and arrival.dest is None and self.channel.device_kinds:
                self._place(arrival, want, streams)
            if arrival.dest is None:
                arrival.allocate()
            arrival.pulling = True
            await self.channel.pull(arrival)
        elif not arrival.done.done():
            await arrival.completed()
            arrival.done.result()  # raises if it failed (SenderAborted: as above)
        await arrival.moved()  # given back by a cancelled recv: what landed in its out= is ours
        if arrival.done.done():
            arrival.done.result()  # raises if what landed could not be kept (``Arrival._lose``)
        arrival.consumed = True
        try:
            return await self._hand_over(arrival, out, targets, t0, want, streams, keep)
        finally:
            # its slot and credit go back once its bytes have left our buffers, not before: a
            # recv cancelled while it copies them gives the message back to the queue, still
            # buffered here, and it must go on counting against what the sender was granted
            if arrival.consumed:
                arrival.settle()

    async def _hand_over(
        self,
        arrival: Arrival,
        out: object | None,
        targets: list[np.ndarray | DeviceTensor] | None,
        t0: float,
        want: Device | None,
        streams: Streams | None,
        keep: bool = True,
    ) -> tuple[Any, Receipt]:
        """Move a whole message from where it landed to where its recv wants it, and rebuild it."""
        if arrival.dest is None:
            raise TransferError("message completed without a destination buffer")
        staged = arrival.staged
        memory = "host"
        try:
            dest = arrival.dest
            try:
                if out is None:
                    final = [_final(s, d, want, streams) for s, d in zip(arrival.specs, dest, strict=True)]
                elif arrival.direct:
                    final = dest
                else:
                    final = targets if targets is not None else _match(out, arrival, streams)
                bounce = _bounce(dest, final)
            except TensorWireError:
                # no memory for the result (a message left in device memory of ours by a
                # cancelled recv, wanted on the host or on another device): nothing is written
                # anywhere yet, and the message stays, whole, at the head of its tag's queue for
                # the next recv (one with out=), unless its bytes are wanted nowhere (keep=False)
                arrival.consumed = not keep
                raise
            if any(isinstance(d, DeviceTensor) for d in (*dest, *final)):
                try:
                    staged |= await _settle_device(arrival, dest, final, bounce)
                except asyncio.CancelledError:
                    # the bytes are whole in ``dest``: the copies queued into the caller's
                    # tensors finish first (or come before their streams' next work), and the
                    # message goes back to the queue for the next recv
                    arrival.land().finish_now(final)
                    arrival.consumed = False
                    raise
                memory = next((d.engine.kind for d in final if isinstance(d, DeviceTensor)), "host")
            else:
                copies = [(dst, src) for src, dst in zip(dest, final, strict=True) if src is not dst]
                try:
                    await copy_host(copies)  # type: ignore[arg-type]  # (host arrays, all of them)
                except asyncio.CancelledError:
                    # the copies ended before this propagates: the bytes are whole in ``dest``,
                    # and the message goes back to the queue for the next recv
                    arrival.consumed = False
                    raise
                staged = staged or any(src.nbytes for _, src in copies)  # an empty tensor passed through nothing
            value = _rebuild(arrival.tree, arrival.specs, final) if out is None else with_scalars(out, arrival.tree)
        except TensorWireError:
            raise
        except Exception as exc:  # validated headers make this unreachable; never jam the tag
            raise TransferError(f"received message could not be rebuilt: {exc!r}") from exc
        return value, self._receipt(arrival, t0, staged, memory)

    def _receipt(self, arrival: Arrival, t0: float, staged: bool, memory: str = "host") -> Receipt:
        """How ``arrival`` came to the recv that began at ``t0`` (``staged``: through buffers of
        ours; direct where it landed in the recv's own memory, not from a copy the sender made)."""
        ch = self.channel
        return Receipt(
            transport=ch.transport,
            lanes=ch.lanes,
            nbytes=arrival.nbytes,
            seconds=time.perf_counter() - t0,
            protocol=arrival.protocol,
            direct=not staged and not arrival.copied,
            staged=staged,
            packed=False,
            memory=memory,
        )


def _whole_on_host(arrival: Arrival, out: object | None, targets: list[np.ndarray | DeviceTensor] | None) -> bool:
    """Whether a recv that takes ``arrival`` from the queue can finish it at once
    (``Mailbox._take_whole``): its bytes all landed in host arrays of ours, no copy out of a
    cancelled recv's out= runs, the copies to make are small enough for the loop, and every
    tensor goes to the host (the caller's host arrays; no out=: ours, for host tensors only)."""
    done = arrival.done
    if not done.done() or done.cancelled() or done.exception() is not None:
        return False
    dest = arrival.dest
    if (
        dest is None
        or arrival.rendezvous
        or arrival.direct
        or arrival.moving is not None
        or arrival.landing is not None
        or worth_a_thread(arrival.nbytes)
    ):
        return False
    if not all(type(d) is np.ndarray for d in dest):
        return False
    if targets is None:
        return out is None and all(s.device != "cuda" for s in arrival.specs)
    return all(type(t) is np.ndarray for t in targets)


def _express_dest(p: _Posted, tree: wire_pb2.TreeNode, specs: list[Spec]) -> list[np.ndarray] | None:
    """``Mailbox.express_dest`` for the recv ``p``, the oldest posted on the message's tag."""
    if p.future.done():
        return None
    out = p.out
    if out is None:
        if p.device is not None or any(s.device == "cuda" for s in specs):
            return None
        try:
            return [s.allocate() for s in specs]
        except TransferError:
            return None  # no memory for it: the general way drops it and tells that recv
    if type(out) is not np.ndarray or len(specs) != 1:
        return None
    s = specs[0]
    if out.shape != s.shape:
        return None
    dtype = DTYPES.get(s.dtype)
    if out.dtype is not dtype and out.dtype != dtype:  # (the same object, mostly: a cheaper test first)
        return None
    flags = out.flags
    if not (flags.c_contiguous and flags.writeable) or not tree.HasField("tensor"):
        return None  # (a one-tensor list or dict does not fit an array: the general way says so)
    return [out]


def _copy_into(arrays: list[np.ndarray], data: memoryview) -> None:
    """Copy ``data`` (the tensors' bytes in order, empty tensors taking none) into host arrays."""
    if len(arrays) == 1:  # (most messages: the bytes are all the one tensor's)
        a = arrays[0]
        if not a.nbytes:
            return
        if a.dtype.isbuiltin == 1:
            memoryview(a).cast("B")[:] = data  # type: ignore[arg-type, unused-ignore]  # numpy < 2.5 stubs
        else:
            byte_view(a)[:] = data
        return
    pos = 0
    for a in arrays:
        n = a.nbytes
        if not n:
            continue
        if a.dtype.isbuiltin == 1:  # numpy's own dtypes: the cheapest copy
            memoryview(a).cast("B")[:] = data[pos : pos + n]  # type: ignore[arg-type, unused-ignore]  # numpy < 2.5 stubs
        else:  # bfloat16 and kin (ml_dtypes) cannot be a memoryview's format
            byte_view(a)[:] = data[pos : pos + n]
        pos += n


def _rebuild(tree: wire_pb2.TreeNode, specs: list[Spec], arrays: list[np.ndarray | DeviceTensor]) -> Any:
    """``rebuild``, with anything but our own errors reported as a TransferError."""
    try:
        return rebuild(tree, specs, arrays)
    except TensorWireError:
        raise
    except Exception as exc:  # validated headers make this unreachable; never jam the tag
        raise TransferError(f"received message could not be rebuilt: {exc!r}") from exc


async def _finished(arrival: Arrival) -> bool:
    """Wait for a pinned arrival's transfer to end, whatever cancellations come; True if its
    bytes all landed."""
    while not arrival.done.done():
        with contextlib.suppress(BaseException):
            await arrival.completed()
    return arrival.done.exception() is None


def _placement(spec: Spec, want: Device | None, streams: Streams | None) -> int | None:
    """The CUDA device a received tensor goes to, or None for host memory."""
    if want is None:
        if spec.device == "cuda" and cuda_usable():
            return streams.device if streams is not None else check_cuda(None)
        return None
    return want.index if want.kind == "cuda" else None


def _final(
    spec: Spec, d: np.ndarray | DeviceTensor, want: Device | None, streams: Streams | None
) -> np.ndarray | DeviceTensor:
    """What a recv without out= hands back for one tensor: ``d`` itself where it already sits
    where it is wanted, else a new tensor there."""
    where = _placement(spec, want, streams)
    if isinstance(d, DeviceTensor) and d.value is not None and d.engine.kind == "cuda" and where == d.buf.device:
        return d
    if where is None:
        return d if isinstance(d, np.ndarray) else spec.allocate()
    return allocate_device(spec.dtype, spec.shape, spec.framework, where, streams)


def _bounce(dest: list[np.ndarray | DeviceTensor], final: list[np.ndarray | DeviceTensor]) -> list[np.ndarray | None]:
    """Host memory (uint8) for each tensor whose bytes go from one device's memory to another's,
    which no copy engine reaches both of (``_settle_device``), else None. Allocated before
    anything is written anywhere: a recv that finds no memory for it leaves the message whole."""
    return [
        Spec("uint8", (src.nbytes,), src.nbytes).allocate()
        if isinstance(src, DeviceTensor)
        and isinstance(dst, DeviceTensor)
        and src is not dst
        and src.nbytes
        and src.engine is not dst.engine
        else None
        for src, dst in zip(dest, final, strict=True)
    ]


async def _settle_device(
    arrival: Arrival,
    dest: list[np.ndarray | DeviceTensor],
    final: list[np.ndarray | DeviceTensor],
    bounce: list[np.ndarray | None],
) -> bool:
    """Move what landed in ``dest`` to ``final`` where they differ (through ``bounce``, host
    memory, between two devices' memory), then hand device tensors to their consumers' streams.
    Returns True if a copy was needed."""
    landing = arrival.land()
    copied = False
    on_host: list[tuple[np.ndarray, np.ndarray]] = []  # host to host: made together, below
    for src, dst, host in zip(dest, final, bounce, strict=True):
        if src is dst or not src.nbytes:
            continue
        copied = True
        if isinstance(dst, DeviceTensor):
            if isinstance(src, DeviceTensor) and src.engine is dst.engine:
                landing.copy(dst, src)
            elif isinstance(src, DeviceTensor):
                # another device's memory: a buffer of ours that a recv into that device left the
                # message in (cancelled while its bytes landed). No copy engine reaches both, so
                # the bytes go down to the host and up again (it failed, and the message was lost)
                assert host is not None  # (``_bounce`` gave it)
                await landing.upload(dst, await _to_host(src, landing, host))
            else:
                await landing.upload(dst, src)
        elif isinstance(src, DeviceTensor):
            await _to_host(src, landing, dst)
        else:
            on_host.append((dst, src))
    await copy_host(on_host)
    await landing.finish(final)
    for src, dst in zip(dest, final, strict=True):
        if src is not dst and isinstance(src, DeviceTensor) and src.nbytes and src.stream is not None:
            landing.hand_back(src)  # a buffer of ours, read by the copies above and dropped now
    return copied


async def _to_host(src: DeviceTensor, landing: Landing, host: np.ndarray) -> np.ndarray:
    """``host`` (any dtype, ``src.nbytes`` long) holding device tensor ``src``'s bytes, after
    every copy ``landing`` has queued into it. Those copies are waited for on the host first:
    they may wait for a consumer's stream that stays busy (the cancelled recv's that left the
    message in ``src``), and copies down queued behind them would hold the process's staging
    chunks (every device send's) as long."""
    after = landing.flush(src)
    if after is not None:
        await wait_event(src.engine, after)
    await download(src.buf, byte_view(host))
    return host
