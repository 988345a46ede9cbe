"""Non-blocking socket I/O driven by the asyncio loop, without copying tensor payloads.

asyncio's StreamReader copies every chunk; ``loop.sock_recv_into`` keeps a pending read into a
buffer the caller may no longer own after a cancellation. This module reads only synchronously,
right after the selector says the socket is readable, into a view it asks for at that moment:
so when a recv is cancelled and its buffer swapped out, no later write can land in the old one.

While the reader waits between frames (``read_header``), a frame handler of the channel's
(``on_frames``) may take the small frames that are whole in the buffer straight from the
readable callback: a small message then reaches its recv without a trip through the reader task
(one loop turn and one future fewer per message). The reader task is woken for anything else.
"""

from __future__ import annotations

import asyncio
import select
import socket
import time
from collections.abc import Callable, Sequence

from ..._loops import wait_out
from ...errors import PeerDisconnected
from .._frames import HEADER, FrameHeader, unpack

__all__ = ["SMALL_READ", "Sent", "SockIO", "advance", "finish_uncancelled"]

IOV_MAX = 512
_BUFSIZE = 256 * 1024
_SMALL = 64 * 1024
SMALL_READ = _SMALL  # a read of fewer bytes goes through the read-ahead buffer (a copy), not recv_into
_HEADER_FILL = 16 * 1024
# A receiver that never finds its socket empty would otherwise never give the loop back (and
# miss its lease renewals): yield after this many payload bytes read without waiting, counted
# across reads (a large message comes as DATA frames each smaller than this), or after this
# long, whichever comes first (a recv into memory not yet touched pays a page fault per 4 KiB:
# 8 MiB took 100-150 ms in a VM, where 1 GiB held the loop 1-4 s when counted per frame)
_YIELD_EVERY = 8 << 20
_YIELD_SECONDS = 0.005
# epoll's "the peer closed its end" event (Linux): seen while unread bytes are still queued
_RDHUP: int | None = getattr(select, "EPOLLRDHUP", None)
# ... and after this many bytes of frames taken on the header path: each costs Python work (a
# peer sending empty CREDIT frames, or ABORTs of unknown messages, would hold the loop for good)
_YIELD_FRAMES = 64 << 10

Buffer = bytes | bytearray | memoryview
# what a write took of the buffers it was given -> what is left to write (``SockIO.send_now``)
Sent = Callable[[list[Buffer], int], list[Buffer]]


class PeerEOF(PeerDisconnected):
    """The peer closed its end of the connection."""


def advance(bufs: list[Buffer], n: int) -> list[Buffer]:
    """``bufs`` without their first ``n`` bytes."""
    i = 0
    while i < len(bufs) and n >= len(bufs[i]):
        n -= len(bufs[i])
        i += 1
    rest = bufs[i:]
    if n and rest:
        rest[0] = memoryview(rest[0])[n:]
    return rest


async def finish_uncancelled(task: asyncio.Task[None]) -> None:
    """Await ``task`` to the end even if we are cancelled meanwhile; then re-raise the cancel."""
    await wait_out(task)
    if task.cancelled():  # not us: the connection was closed under the write
        raise PeerEOF("connection closed while a frame was being written")
    task.result()


class SockIO:
    """One connected non-blocking socket: buffered small reads, zero-copy large ones."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.fd = sock.fileno()
        self.loop = asyncio.get_running_loop()
        self._buf = bytearray(_BUFSIZE)
        self._start = 0
        self._end = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._waiter: asyncio.Future[None] | None = None
        self._watching = False
        self._parked = False  # the reader waits in read_header, between frames
        self._failure: PeerDisconnected | None = None  # what the readable callback's recv saw
        self._closed = False
        self._unyielded = 0  # bytes of frames the reader took since the loop last ran others
        self._unyielded_payload = 0  # payload bytes read_into landed since the loop last ran others
        self._ran_others = time.perf_counter()  # when the loop last ran others (as far as we know)
        self.last_header = b""  # raw bytes of the last frame header read (for checksums)
        self.checked = False  # frame headers carry a check (a channel with checksums)
        # called from the readable callback while the reader is parked between frames, with
        # (buffer, start, end): handles the whole frames it can at ``start`` and returns
        # (new start, whether the reader task must handle what follows)
        self.on_frames: Callable[[bytearray, int, int], tuple[int, bool]] | None = None
        self._hangups: select.epoll | None = None  # the socket's hang-up alone (``watch_hangup``)
        self._on_hangup: Callable[[], None] | None = None

    # -- the peer's close, while nobody reads ------------------------------------------------
    def watch_hangup(self, on_hangup: Callable[[], None]) -> None:
        """Call ``on_hangup`` once, from the loop, when the peer closes or drops the connection
        (until ``unwatch_hangup`` or ``close``): for a reader that may stop reading for long (it
        waits for room to land what it read) and would learn of the close only once it reads up
        to it. The bytes queued before the close stay readable. A socket read sees the close
        only after every byte queued before it, so this asks epoll, on a descriptor of its own,
        for the hang-up alone (EPOLLRDHUP; EPOLLHUP and EPOLLERR for a reset): a new byte does
        not wake it. Not watched where epoll is missing (then the control plane's lease tells)."""
        if self._closed or self._on_hangup is not None or _RDHUP is None:
            return
        ep = self._hangups
        if ep is None:
            ep = self._hangups = select.epoll(1)
            ep.register(self.fd, _RDHUP)
        self._on_hangup = on_hangup
        self.loop.add_reader(ep.fileno(), self._hung_up)

    def unwatch_hangup(self) -> None:
        if self._on_hangup is not None:
            self._on_hangup = None
            if self._hangups is not None:
                self.loop.remove_reader(self._hangups.fileno())

    def _hung_up(self) -> None:
        on_hangup = self._on_hangup
        if self._hangups is None or on_hangup is None or not self._hangups.poll(0):
            return
        self.unwatch_hangup()  # (level-triggered: it would fire at every loop turn)
        on_hangup()

    # -- waiting ----------------------------------------------------------------------------
    async def _wait(self, add: Callable[..., None], remove: Callable[[int], bool]) -> None:
        fut = self.loop.create_future()
        add(self.fd, _wake, fut)
        try:
            await fut
        finally:
            remove(self.fd)

    async def _readable(self) -> None:
        # the reader stays registered across reads (two epoll_ctl calls a message fewer); it is
        # removed when it fires with nobody waiting, since level-triggered it would fire again
        fut = self._waiter = self.loop.create_future()
        if not self._watching:
            self.loop.add_reader(self.fd, self._on_readable)
            self._watching = True
        try:
            await fut
        finally:
            if self._waiter is fut:
                self._waiter = None
            self._unyielded = 0
            self._unyielded_payload = 0
            self._ran_others = time.perf_counter()

    def _on_readable(self) -> None:
        fut = self._waiter
        if fut is None or fut.done():
            self.loop.remove_reader(self.fd)
            self._watching = False
            return
        if self._parked and self.on_frames is not None and not self._serve(fut):
            return
        self._waiter = None
        fut.set_result(None)

    def _serve(self, fut: asyncio.Future[None]) -> bool:
        """The reader is parked between frames and the socket is readable: read, and let
        ``on_frames`` take whole small frames. True if the reader task must be woken."""
        on_frames = self.on_frames
        assert on_frames is not None
        try:
            if not self._recv_some(_HEADER_FILL):
                return False  # nothing there after all
            taken = 0
            while True:
                start = self._start
                self._start, wake = on_frames(self._buf, start, self._end)
                if wake or self._closed or fut.done():
                    break
                taken += self._start - start
                if self._start == self._end or taken >= _YIELD_FRAMES or not self._recv_some(_HEADER_FILL):
                    # parked still: the rest of a frame comes later, or frames keep coming and
                    # the rest of the loop runs first (we are called again while more waits)
                    return False
        except PeerDisconnected as exc:
            self._failure = exc  # the reader raises it
        return not (self._closed or fut.done())

    def _writable(self) -> object:
        return self._wait(self.loop.add_writer, self.loop.remove_writer)

    # -- reading ----------------------------------------------------------------------------
    @property
    def buffered(self) -> int:
        return self._end - self._start

    def _recv_some(self, limit: int) -> bool:
        """Read what the socket has now, at most ``limit`` bytes, into the internal buffer;
        False if it had nothing. Callers need fewer than ``_SMALL`` more bytes than are buffered
        or less than ``len(self._buf) - _SMALL`` buffered in all, so there is always room."""
        if self._start == self._end:
            self._start = self._end = 0
        elif len(self._buf) - self._end < _SMALL:
            n = self._end - self._start
            self._buf[:n] = self._buf[self._start : self._end]
            self._start, self._end = 0, n
        try:
            n = self.sock.recv_into(memoryview(self._buf)[self._end : self._end + limit])
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as exc:
            raise PeerEOF(f"connection failed: {exc}") from exc
        if n == 0:
            raise PeerEOF("peer closed the connection")
        self._end += n
        return True

    async def _fill(self, limit: int = _BUFSIZE) -> None:
        """Read what the socket has, at most ``limit`` bytes, into the internal buffer (at least one)."""
        while not self._recv_some(limit):
            await self._readable()

    async def read_header(self) -> FrameHeader:
        """The next frame's header. With ``on_frames`` set, the whole small frames it takes go
        to it first (from here, or from the readable callback while this waits)."""
        on_frames = self.on_frames
        while True:
            if self._unyielded >= _YIELD_FRAMES:  # frames keep coming: let the rest of the loop run too
                self._unyielded = 0
                await asyncio.sleep(0)
            if on_frames is not None and self._end - self._start >= HEADER.size:
                start = self._start
                self._start, _ = on_frames(self._buf, start, self._end)
                self._unyielded += self._start - start
                if self._closed:  # the frames broke the channel
                    raise PeerEOF("connection closed")
            if self._end - self._start >= HEADER.size:
                break
            if self._failure is not None:
                raise self._failure
            # a header, its metadata and a small payload; a large payload that follows should go
            # straight to its destination, not through this buffer (one copy fewer)
            if not self._recv_some(_HEADER_FILL):
                self._parked = True  # the readable callback may take small frames itself
                try:
                    await self._readable()
                finally:
                    self._parked = False
        raw = bytes(self._buf[self._start : self._start + HEADER.size])
        hdr = unpack(raw, checked=self.checked)
        self.last_header = raw
        self._start += HEADER.size
        self._unyielded += HEADER.size
        return hdr

    async def read_exact(self, n: int) -> bytes:
        """Read ``n`` bytes; callers check ``n`` against their limits first."""
        if n <= len(self._buf) - _SMALL:
            while self._end - self._start < n:
                await self._fill()
            data = bytes(self._buf[self._start : self._start + n])
            self._start += n
            return data
        out = bytearray(n)
        await self.read_into(lambda off, k: memoryview(out)[off : off + k], 0, n)
        return bytes(out)

    async def read_into(
        self,
        view: Callable[[int, int], memoryview],
        offset: int,
        n: int,
        landed: Callable[[int], None] | None = None,
    ) -> int:
        """Read ``n`` bytes into ``view(offset, k)``, asking for the view anew before each write,
        and telling ``landed`` the offset reached after each (before anything else runs). Returns
        how many of them were copied out of the read-ahead buffer (the rest went straight in by
        ``recv_into``): what came in with an earlier read, and any tail under ``_SMALL``."""
        end = offset + n
        copied = 0
        while offset < end:
            if self._unyielded_payload and (  # data keeps coming: let the rest of the loop run too
                self._unyielded_payload >= _YIELD_EVERY or time.perf_counter() - self._ran_others >= _YIELD_SECONDS
            ):
                self._unyielded_payload = 0
                await asyncio.sleep(0)
                self._ran_others = time.perf_counter()
            remaining = end - offset
            if self._end > self._start:
                k = min(remaining, self._end - self._start)
                dst = view(offset, k)
                k = len(dst)
                dst[:] = memoryview(self._buf)[self._start : self._start + k]
                self._start += k
                offset += k
                copied += k
                self._unyielded_payload += k
                if landed is not None:
                    landed(offset)
                continue
            if remaining < _SMALL:
                await self._fill()
                continue
            dst = view(offset, remaining)
            try:
                k = self.sock.recv_into(dst)
            except (BlockingIOError, InterruptedError):
                await self._readable()
                continue
            except OSError as exc:
                raise PeerEOF(f"connection failed: {exc}") from exc
            if k == 0:
                raise PeerEOF("peer closed the connection mid-message")
            offset += k
            self._unyielded_payload += k
            if landed is not None:
                landed(offset)
        return copied

    # -- writing ----------------------------------------------------------------------------
    def send_now(self, bufs: list[Buffer], sent: Sent | None = None) -> list[Buffer]:
        """Write what the socket takes now of ``bufs`` (non-empty buffers); return the rest,
        which the caller must finish (``send_rest``) before anything else is written. ``sent``:
        told what each write took, right after it, and gives what is left to write (the rest,
        or more: ``TcpChannel``'s crc32c over the bytes as they go, then its trailer)."""
        while bufs:
            try:
                n = self.sock.sendmsg(bufs if len(bufs) <= IOV_MAX else bufs[:IOV_MAX])
            except (BlockingIOError, InterruptedError):
                return bufs
            except OSError as exc:
                raise PeerEOF(f"connection failed: {exc}") from exc
            bufs = advance(bufs, n) if sent is None else sent(bufs, n)
        return bufs

    async def _send_rest(self, bufs: list[Buffer], sent: Sent | None = None) -> None:
        while bufs:
            await self._writable()  # type: ignore[misc]
            bufs = self.send_now(bufs, sent)

    async def send_all(self, bufs: Sequence[Buffer]) -> None:
        """Write a whole frame. Once started it is finished even if the caller is cancelled,
        so the stream never holds half a frame; the cancellation is re-raised afterwards."""
        rest = self.send_now([b for b in bufs if len(b)])
        if rest:
            await self.send_rest(rest)

    async def send_rest(self, rest: list[Buffer], sent: Sent | None = None) -> None:
        """Finish a frame that ``send_now`` started, even if the caller is cancelled meanwhile
        (the cancellation is re-raised afterwards)."""
        task = self.loop.create_task(self._send_rest(rest, sent))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        await finish_uncancelled(task)

    async def send_last(self, bufs: Sequence[Buffer]) -> None:
        """Write the frame after which the connection closes (BYE). Unlike ``send_all``, a
        cancellation stops it part way: a peer that stopped reading must not hold the close up,
        and nothing but the close follows the half frame."""
        rest = self.send_now([b for b in bufs if len(b)])
        if rest:
            await self._send_rest(rest)

    async def linger(self, seconds: float) -> None:
        """Close after the last frame (BYE) without resetting the connection: say that nothing
        more comes (FIN, behind every byte queued), then read and drop what the peer still sends
        until it closes too, ``seconds`` at most, and close. A socket closed with bytes from the
        peer unread, or that bytes reach after its close (a peer's credit frame, say), is reset
        by the kernel, which then drops what it still held for the peer: frames of messages
        whose sends had returned, and the BYE."""
        try:
            if self._closed:
                return
            self.on_frames = None
            if self._watching:  # (the reader's: it is gone)
                self._watching = False
                self.loop.remove_reader(self.fd)
            self.sock.shutdown(socket.SHUT_WR)
            async with asyncio.timeout(max(seconds, 0)):
                while True:
                    try:
                        if not self.sock.recv_into(self._buf):
                            return  # the peer closed too
                    except (BlockingIOError, InterruptedError):
                        await self._wait(self.loop.add_reader, self.loop.remove_reader)
                        continue
                    await asyncio.sleep(0)  # a peer that keeps sending must not hold the loop
        except (OSError, TimeoutError):
            pass  # reset, or the peer kept its end open: closed all the same
        finally:
            self.close()

    def close(self) -> None:
        if self._closed:  # (its descriptor's number may be another socket's by now)
            return
        self._closed = True
        self.unwatch_hangup()
        if self._hangups is not None:
            self._hangups.close()
        for t in list(self._tasks):
            t.cancel()
        self._watching = False
        try:
            self.loop.remove_reader(self.fd)
            self.loop.remove_writer(self.fd)
        except (ValueError, OSError):
            pass
        self.sock.close()


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
