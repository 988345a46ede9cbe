"""One-sided access to exposed tensors: ``node.expose`` / ``peer.lookup`` / ``peer.read`` / ``peer.write``.

An owner exposes a C-contiguous tensor under a name; a session peer resolves the name over the
control plane into a RemoteHandle (dtype, shape, generation, and for one-sided transports the
registered address and key) and then reads or writes the whole tensor, or rows of it
(``handle[3]``, ``handle[4:8]``: a contiguous byte range of a C-contiguous tensor, so the same
single get/put or owner-assisted request at an offset).

Direct (transports whose Capabilities say ``one_sided``: ucx): ``expose`` registers the memory
with each such transport (through its registration cache); Lookup hands the session peer a
remote-key blob (``transports/_remote.py``) for the transport its channel uses (none where the
transport could not register it after all, ``Hold.remote_key``: the owner serves that peer, as
below); the reader unpacks the key once per (peer, handle generation) and moves the bytes with
get/put + flush.
No code of the owner's runs per operation. Receipts say ``protocol="one-sided"`` where the
channel reaches the owner's memory without the owner's CPU (a cma or RDMA lane), and
``"one-sided-emulated"`` where UCX emulates get/put over its other lanes (tcp, sysv/posix
shared memory): no tensorwire code of the owner's runs then either, but its UCX worker, driven
by its event loop, serves each operation (``UcxChannel.one_sided_direct``).

Revocation of direct handles: ``unexpose`` removes the name at once (lookups and
owner-assisted operations fail from then on), then sends every peer that received the key a
*revoke* notice on the reserved ops tag. A peer marks the handle revoked (its later reads and
writes fail with HandleNotFound, and so does one under way at its next gets or puts: each batch
of them checks the mark right before it is posted, ``_move``), waits for its operations on it
that are still moving, and acknowledges. Only when every such peer acknowledged (or its channel
closed) does the owner unregister the memory and drop its reference to the tensor. So a tensorwire peer never
touches memory the owner has let go of; gets and puts posted before the notice arrived
complete against the exposed memory as it was.

On transports without one-sided support (tcp, inproc) the same calls go through the owner's
node: a small request on a reserved tag, answered by the owner's per-peer service, with the
payload moving straight between the exposed memory and the requester's buffer (rendezvous
for large tensors). Receipts say ``protocol="owner-assisted"`` so nobody mistakes it for RDMA;
a batch of handles of both kinds says ``"mixed"``, with a receipt per way (``Receipt.parts``).
``unexpose`` lets the requests being served from or into the tensor end before it lets the
tensor go (``_Exposed.busy``): a write still being received lands until then, never after.
A node keeps at most ``_MAX_ASKED`` such requests (and revocation notices) unanswered on one
channel, and later ones wait their turn; an owner serves at most ``_MAX_SERVED`` of one peer's
at once and reads no more of them until one ends, so a peer that never takes its answers
costs the owner bounded memory (``serve_ops`` says why honest peers never wait on that).

Device memory (CUDA; the host engine's in tests): an exposed device tensor is registered only
with transports whose ``region_kinds`` name its kind (ucx with cuda lanes), else served by its
owner with send/recv's staging. A read into, or a write from, a device tensor keeps to the
framework's streams as send/recv do: one-sided by pointer where the channel takes that memory
(``rma_device``; posted after the consumer's or producer's event), else through host memory
and a landing. The owner's own streams are not waited for: as with RDMA, the owner exposes and
writes its tensor when its work on it is done.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import math
import operator
import time
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from . import _metrics
from ._loops import call_off
from .errors import (
    ClosedResourceError,
    ConfigurationError,
    HandleNotFound,
    MessageRefused,
    ShapeMismatchError,
    TensorWireError,
    TransferError,
    UnsupportedTensorError,
)
from .memory import CopyEngine, DeviceBuffer, Event, HostChunk, Move, Piece, scatter, wait_event
from .rpc._registry import FifoAdmission, PerChannel
from .tensors import Outgoing, as_view, dtype_from_name, prepare, prepare_off_loop
from .tensors._device import (
    Device,
    DeviceSource,
    DeviceTensor,
    Landing,
    Streams,
    allocate_device,
    capture_streams,
    check_cuda,
    cuda_usable,
    wanted_device,
)
from .tensors._dtypes import big_endian
from .tensors._header import impossible_shape
from .tensors._message import refuse_shared
from .tensors._offload import copy_host, off_loop, packs_in_a_thread
from .tensors._sizes import HOLDER_GROWTH, WIDEST, item_bytes, tensor_item_bytes
from .tensors._view import empty, mark_written, overlaps_itself
from .transports import ChannelState, Receipt, Transport
from .transports._remote import Hold, OneSidedChannel, OneSidedTransport, RemoteKeyBlob, unpack_remote_key

if TYPE_CHECKING:
    from ._peer import Peer

log = logging.getLogger(__name__)

__all__ = [
    "ExposureTable",
    "Handle",
    "RemoteHandle",
    "Revocation",
    "read",
    "read_many",
    "remember",
    "retire",
    "serve_ops",
    "write",
    "write_many",
]

_OPS_TAG = -0x7477_6F70_7300_0001  # reserved: owner-assisted one-sided requests
_REPLY_BASE = -0x7477_7270_0000_0000  # reserved range for per-operation replies and payloads
_metrics.traffic_tags(range(_REPLY_BASE, _OPS_TAG + 1), "one-sided")
_DRAIN_SECONDS = 60.0
# owner-assisted requests and revocation notices one node has unanswered on one channel, and
# the tasks an owner runs for one peer's at once: more than that, for ``serve_ops``'s argument
_MAX_ASKED = 64
_MAX_SERVED = 2 * _MAX_ASKED
_MAX_REGIONS = 256  # regions in one owner-assisted request (its header also within the limits: ``_parts``)


@dataclass(frozen=True, slots=True)
class Handle:
    """A tensor this node exposes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    generation: int
    writable: bool
    memory: str = "host"  # or the device kind: "cuda" (a torch CUDA tensor, a CuPy array), ...


@dataclass(frozen=True, slots=True)
class RemoteHandle:
    """A peer's exposed tensor, as ``peer.lookup`` resolved it."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    generation: int
    owner: str
    transport: str = ""  # one-sided transport holding a registration, "" = owner-assisted
    remote_key: bytes = b""  # transports._remote blob: address, length and the transport's key
    writable: bool = True
    offset: int = 0  # where this handle's bytes start in the exposed tensor (rows: ``handle[a:b]``)
    memory: str = "host"  # where the owner's tensor lives: "host", "cuda"
    # the session of the peer that looked it up: a handle works on that peer only. A node
    # restarted at the same address (even with the same node_id) exposes new memory under
    # names and generations that may equal the old ones; this tells them apart.
    session: str = ""

    @property
    def direct(self) -> bool:
        """Reads and writes move the bytes one-sided, without the owner's code."""
        return bool(self.remote_key)

    def __iter__(self) -> Iterator[RemoteHandle]:
        """Not iterable: ``__getitem__`` would otherwise make ``for row in h`` and ``list(h)``
        run past the last row into a ShapeMismatchError that names a row nobody asked for."""
        raise ConfigurationError(
            f"a handle ({self.name!r}) is not iterable: index its rows (h[3], h[4:8]), "
            "or list them for read_many: [h[i] for i in range(h.shape[0])]"
        )

    def __getitem__(self, index: int | slice) -> RemoteHandle:
        """Rows along the first axis as a handle of their own, as numpy indexes: ``h[3]`` (one
        row, that axis dropped), ``h[4:8]``, ``h[-2:]``, ``h[4:8][1]``. An exposed tensor is
        C-contiguous, so rows are one range of its bytes: reading or writing them moves just
        those bytes. Only steps of 1; anything else is a ShapeMismatchError."""
        if not self.shape:
            raise ShapeMismatchError(f"{self.name!r} is 0-d: it has no rows to index")
        rows, rest = self.shape[0], self.shape[1:]
        row_bytes = dtype_from_name(self.dtype).itemsize * math.prod(rest)
        if isinstance(index, slice):
            if not (index.step is None or _index_of(index.step) == 1):
                raise ShapeMismatchError(
                    f"{self.name!r}: a slice of rows has step 1 (got {index.step!r}), else it is not contiguous"
                )
            if rows < 0:  # (a shape no tensor has: changed by hand, or a broken owner's lookup answer)
                raise ShapeMismatchError(f"{self.name!r} has the shape {list(self.shape)[:8]}, which no tensor has")
            try:
                start, stop, _ = index.indices(rows)
            except TypeError:
                raise ShapeMismatchError(f"{self.name!r}: slice bounds are ints, not {index!r}") from None
            stop = max(start, stop)
            shape: tuple[int, ...] = (stop - start, *rest)
            nbytes = (stop - start) * row_bytes
        else:
            start_or_none = None if isinstance(index, bool) else _index_of(index)
            if start_or_none is None:
                raise ShapeMismatchError(
                    f"a handle is indexed by an int or a slice of rows, not {type(index).__name__}"
                    + (" (an array of indices: read_many([h[i] for i in ids]))" if getattr(index, "ndim", 0) else "")
                )
            start = start_or_none
            if not -rows <= start < rows:
                raise ShapeMismatchError(f"row {start} is out of range for {self.name!r} with {rows} rows")
            start %= rows
            shape, nbytes = rest, row_bytes
        # (not dataclasses.replace: a handle per block read, and replace costs four times this)
        return RemoteHandle(
            self.name, self.dtype, shape, nbytes, self.generation, self.owner, self.transport, self.remote_key,
            self.writable, self.offset + start * row_bytes, self.memory, self.session,
        )  # fmt: skip


def _index_of(value: Any) -> int | None:
    """``value`` as an int, as an index takes it, or None where it is none: the types that
    define ``__index__`` (numpy arrays, torch tensors) raise TypeError for any but a single
    integer, and the test ``step not in (None, 1)`` raised numpy's ValueError for an array."""
    try:
        return operator.index(value)
    except TypeError:
        return None


@dataclass(slots=True)
class _Exposed:
    handle: Handle
    array: np.ndarray | None  # host memory
    dev: DeviceSource | None  # device memory (CUDA), C-contiguous
    source: Any  # the caller's object, kept alive while exposed
    holds: dict[str, Hold] = field(default_factory=dict)  # one-sided transport -> registration
    given: set[str] = field(default_factory=set)  # sessions that received a remote key
    busy: int = 0  # owner-assisted reads and writes moving its bytes now (``_serve_one``)
    idle: asyncio.Event | None = None  # set when ``busy`` drops to 0, for a retire waiting on it

    def region(self, offset: int, shape: tuple[int, ...]) -> Any:
        """The tensor's elements from byte ``offset`` on, as ``shape`` (checked by the caller):
        what an owner-assisted read sends from or a write receives into."""
        if self.array is None:
            assert self.dev is not None
            return self.source if offset == 0 and shape == self.handle.shape else self.dev.region(offset, shape)
        arr = self.array
        if offset == 0 and shape == arr.shape:
            return arr
        start = offset // arr.itemsize
        return arr.reshape(-1)[start : start + math.prod(shape)].reshape(shape)

    def enter(self) -> None:
        """An owner-assisted operation starts moving this tensor's bytes."""
        self.busy += 1

    def leave(self) -> None:
        self.busy -= 1
        if not self.busy and self.idle is not None:
            self.idle.set()

    async def quiet(self) -> None:
        """Until no owner-assisted operation moves its bytes any more. Once unexposed none
        starts: each ends when its bytes have moved, or its channel closed (a dead peer's lease)."""
        while self.busy:
            self.idle = asyncio.Event()
            await self.idle.wait()

    def release(self) -> None:
        """Unregister the memory (one reference of the registration cache) and let it go."""
        holds, self.holds = self.holds, {}
        for hold in holds.values():
            try:
                hold.release()
            except TensorWireError as exc:
                log.warning("unregistering %r failed: %s", self.handle.name, exc)


MAX_HANDLE_NAME_CHARS = 256


def check_handle_name(name: str) -> None:
    """A name ``expose`` takes, and so the only kind ``lookup`` can find: non-empty, at most
    MAX_HANDLE_NAME_CHARS characters, and with a UTF-8 form (a lone surrogate has none, so no
    peer could ever look it up). ``lookup`` checks it before its round trip: a name longer than
    any exposed one went to the owner all the same, and one of 5 MB came back as gRPC's
    RESOURCE_EXHAUSTED in a ControlPlaneError."""
    if not name or len(name) > MAX_HANDLE_NAME_CHARS:
        raise ConfigurationError(
            f"a handle name is a non-empty string of at most {MAX_HANDLE_NAME_CHARS} characters"
            + (f", not one of {len(name)}" if name else "")
        )
    try:
        name.encode()
    except UnicodeEncodeError as exc:
        raise ConfigurationError(f"a handle name must encode as UTF-8, not {name!r} ({exc.reason})") from None


class ExposureTable:
    """The tensors one node exposes, by name."""

    def __init__(self) -> None:
        self._by_name: dict[str, _Exposed] = {}
        self._generation = itertools.count(1)
        self.served = 0  # owner-assisted reads and writes this node answered

    def expose(self, tensor: Any, name: str, transports: Mapping[str, Transport] | None = None) -> Handle:
        """Publish ``tensor``; register it with every one-sided transport in ``transports`` that
        registers its kind of memory (``region_kinds``: host, and CUDA where UCX has cuda lanes)."""
        if not isinstance(name, str):
            raise ConfigurationError(
                f"a handle name is a non-empty string of at most {MAX_HANDLE_NAME_CHARS} characters, "
                f"not {type(name).__name__}"
            )
        check_handle_name(name)
        if name in self._by_name:
            raise ConfigurationError(f"{name!r} is already exposed; unexpose it first")
        view = as_view(tensor)
        # peers would read and write a copy, never the caller's tensor (a numpy scalar, immutable,
        # is all its copy: exposed read-only)
        if view.copied and not isinstance(tensor, np.generic):
            raise UnsupportedTensorError(
                f"{name!r} cannot be exposed: it is {view.copied}, whose values no memory holds, so "
                "peers would reach a copy and never the tensor; expose x.resolve_conj() (or "
                "x.resolve_neg()) and keep that tensor"
            )
        dev = view.dev
        if dev is None:
            arr: np.ndarray | None = view.array
            assert arr is not None
            contiguous, writable, address, kind = arr.flags.c_contiguous, arr.flags.writeable, arr.ctypes.data, "host"
        else:
            arr = None
            contiguous, writable, address, kind = dev.contiguous, not dev.readonly, dev.ptr, dev.engine.kind
        if not contiguous:
            raise ShapeMismatchError(f"exposed tensors must be C-contiguous ({name!r} is not)")
        h = Handle(name, view.dtype, view.shape, view.nbytes, next(self._generation), bool(writable), kind)
        entry = _Exposed(h, arr, dev, tensor)
        try:
            for tname, transport in (transports or {}).items():
                if (
                    h.nbytes
                    and transport.capabilities.one_sided
                    and isinstance(transport, OneSidedTransport)
                    and kind in transport.region_kinds
                ):
                    entry.holds[tname] = transport.register_region(
                        address, h.nbytes, writable=h.writable, owner=arr if dev is None else tensor
                    )
        except BaseException:
            entry.release()
            raise
        self._by_name[name] = entry
        return h

    def unexpose(self, name: str) -> _Exposed:
        """Remove ``name``; the caller retires the entry (``retire``)."""
        entry = self._by_name.pop(name, None)
        if entry is None:
            raise HandleNotFound(f"{name!r} is not exposed")
        return entry

    def get(self, name: str) -> _Exposed | None:
        return self._by_name.get(name)

    def forget(self, session_id: str) -> None:
        """A session ended: no exposure waits for its acknowledgement any more (each one-sided
        lookup added it to ``given``, and peers that reconnect for days would have grown it)."""
        for entry in self._by_name.values():
            entry.given.discard(session_id)

    def clear(self) -> None:
        entries = list(self._by_name.values())
        self._by_name.clear()
        for entry in entries:
            entry.release()


class Revocation:
    """What ``node.unexpose`` returns. Awaiting it is optional: it completes once every peer
    that held a one-sided key acknowledged the revocation (or went away), the owner-assisted
    reads and writes already moving its bytes ended, and the memory was unregistered; from then
    on no read or write of any peer reaches the tensor."""

    __slots__ = ("_task",)

    def __init__(self, task: asyncio.Task[None] | None) -> None:
        self._task = task

    def done(self) -> bool:
        return self._task is None or self._task.done()

    def __await__(self) -> Generator[Any, None, None]:
        if self._task is not None:
            yield from asyncio.shield(self._task).__await__()


async def retire(entry: _Exposed, session_peers: Callable[[str], list[Peer]]) -> None:
    """Revoke an unexposed tensor's direct handles and let the owner-assisted operations under
    way end (a write still being received lands in the tensor), then unregister it (module
    docstring)."""
    try:
        # (each session's peers: both ends of a node's connection to itself, whose notice must
        # reach the end that looked the name up, and only the session id says who that was)
        # (closed ones too: their channel may still be shutting, see ``_revoke``)
        peers = [p for sid in sorted(entry.given) for p in session_peers(sid)]
        await asyncio.gather(*[_revoke(p, entry.handle) for p in peers], entry.quiet(), return_exceptions=True)
    finally:
        entry.release()


async def _revoke(peer: Peer, h: Handle) -> None:
    """Until the peer acknowledged the revocation, or its channel has gone so far that nothing
    of the peer's can reach the memory through it any more (``_gone_for_good``)."""
    reply, _ = _tags()
    if peer.closed:
        await _gone_for_good(peer)
        return
    try:
        room = await _room(peer)  # the peer serves a notice as it does a request (``serve_ops``)
    except TensorWireError:
        await _gone_for_good(peer)
        return
    try:
        await peer._send_own({"op": "revoke", "name": h.name, "generation": h.generation, "reply": reply}, tag=_OPS_TAG)
        await peer._recv_own(tag=reply)  # until the peer acknowledges or its channel closes
        return
    except TensorWireError:
        pass
    finally:
        room.release()
    await _gone_for_good(peer)


async def _gone_for_good(peer: Peer) -> None:
    """A key holder that went (closed, said goodbye, declared dead) without acknowledging: wait
    until its channel has shut and the transport serves it nothing more (``Channel.settled``:
    over ucx lanes that emulate gets and puts this node's worker serves them from and into the
    memory, and answered a get under way after the goodbye)."""
    settling = peer.channel.settled()
    if settling is not None:
        await settling


# -- the owner's side ---------------------------------------------------------------------------
async def serve_ops(peer: Peer, table: ExposureTable) -> None:
    """Answer a peer's owner-assisted reads and writes, and its revocation notices, until the
    channel closes: each in a task of its own, at most ``_MAX_SERVED`` at once.

    At the cap it reads no more of them: they wait in the mailbox, holding the peer's message
    slots, and a peer that sends more waits for slots. (Uncapped, a peer that never took its
    answers left a task per request here: 20 000 reads, 19 974 tasks, +182 MiB.) No honest peer
    is stuck on it. A peer takes room (``_room``) for each request and notice before sending it
    and gives it back only once it has the final answer (one that may never come: after
    _DRAIN_SECONDS), so at most ``_MAX_ASKED`` of the tasks here can still need anything of the
    peer's (a write's payload, a slot or go-ahead for an answer). At the cap the others, at least
    ``_MAX_SERVED - _MAX_ASKED``, have sent their final answer and end by themselves (a note
    left over drained within _DRAIN_SECONDS), and the reading goes on: no write's payload waits
    for good for a slot that requests left unread hold. (A cap with no bound at the sender hung
    honest concurrent writes that way.)
    """
    loop = asyncio.get_running_loop()
    running: set[asyncio.Task[None]] = set()
    room = asyncio.Event()
    room.set()

    def ended(task: asyncio.Task[None]) -> None:
        running.discard(task)
        room.set()

    def start(coro: Coroutine[Any, Any, None]) -> None:
        task = loop.create_task(coro)
        running.add(task)
        task.add_done_callback(ended)
        if len(running) >= _MAX_SERVED:
            room.clear()

    try:
        while True:
            await room.wait()
            try:
                req = await peer._recv_own(tag=_OPS_TAG)
            except TensorWireError:
                return
            if not isinstance(req, dict) or not isinstance(req.get("reply"), int):
                log.warning("malformed one-sided request from %s dropped", peer.remote_address)
                continue
            op = req.get("op")
            if not isinstance(op, str):  # (compared below: an array's == answers with an array)
                req["op"] = op = ""  # (``_serve_one`` answers that it is no operation)
            if op == "drop":  # a cancelled write's note, sent after the payload arrived
                if isinstance(req.get("data"), int):
                    start(_drain_within(peer, req["data"], _DRAIN_SECONDS))
                continue
            if op == "revoke":
                # mark it now, before any task sees a later message from the owner
                name, gen = req.get("name"), req.get("generation")
                if not isinstance(name, str) or not isinstance(gen, int):
                    continue
                _mark_revoked(peer, name, gen)
                start(_acknowledge(peer, name, gen, req["reply"]))
                continue
            start(_serve_one(peer, table, req))
    finally:
        for t in running:
            t.cancel()


async def _serve_one(peer: Peer, table: ExposureTable, req: dict[str, Any]) -> None:
    """One read or write of a list of regions: the reply (a read's tensors) is a list of as many.
    A request the owner refuses is answered with why; so is one whose bytes the owner could not
    move while the channel stayed up (``failed``: a TransferError for the requester), so that no
    requester waits for an answer that never comes."""
    reply: int = req["reply"]
    op = req.get("op")
    table.served += 1
    regions, entries, error = _regions(table, req.get("regions"), writing=op == "write")
    for entry in entries:  # an unexpose now waits for this operation (``retire``)
        entry.enter()
    failed = mismatch = False
    try:
        if op not in ("read", "write"):
            await peer._send_own({"error": f"no such operation: {op!r}", "failed": False}, tag=reply)
        elif op == "read":
            if error is None:
                try:
                    await peer._send_own(regions, tag=reply)
                    return
                except TensorWireError as exc:
                    if _gone(peer):
                        return  # the channel went away: the requester sees that itself
                    error, failed = f"the owner could not send the regions: {exc}", True
                    log.warning("one-sided read from %s failed at the owner: %s", peer.remote_address, exc)
            await peer._send_own({"error": error, "failed": failed}, tag=reply)
        elif op == "write":
            data_tag = req.get("data")
            if not isinstance(data_tag, int):
                return
            landed: Receipt | None = None
            stray = False  # the writer's note that no payload comes may yet arrive (after its abort)
            took = False  # the drain below took the payload: a cancelled writer's note may follow it
            if error is None:
                try:
                    _, landed = await peer._recv_own_with_receipt(tag=data_tag, out=regions)
                    await _landed(regions)
                except ShapeMismatchError as exc:  # refused before the message was taken
                    # the writer checked its sources against its handle: that handle is not this
                    # tensor's dtype (changed by hand), which its writer raises as such (``_owner_error``)
                    error, mismatch = f"the tensor there is not what the handle says (changed by hand?): {exc}", True
                    took = await _drain(peer, data_tag)  # what the writer sent, so nothing lingers
                except TensorWireError as exc:
                    if _gone(peer):
                        return
                    error, failed = f"the owner could not take the bytes: {exc}", True
                    log.warning("one-sided write from %s failed at the owner: %s", peer.remote_address, exc)
                    stray = True
            else:
                took = await _drain(peer, data_tag)  # what the writer sent, so nothing lingers
            answer = (
                {"error": error, "failed": failed, "mismatch": mismatch, "took": took} if error else _written(landed)
            )
            await peer._send_own(answer, tag=reply)
            if stray:  # in this task, so that ``serve_ops`` counts it
                await _drain_within(peer, data_tag, _DRAIN_SECONDS)
    except TensorWireError:
        return  # the channel went away: the requester sees that itself
    finally:
        for entry in entries:
            entry.leave()


def _gone(peer: Peer) -> bool:
    """The requester went away: its channel is no longer open, or its node said goodbye (the
    channel then stays open a while, and a send to it raises PeerDisconnected). Nothing failed
    at the owner then, and no answer can reach the requester."""
    return peer.channel.state is not ChannelState.OPEN or peer.remote_closing


def _written(landed: Receipt | None) -> dict[str, Any]:
    """A write's answer: done, and how its bytes came into the exposed memory here (its writer's
    receipt says so: read through a buffer of ours, or staged, is this side's to tell)."""
    if landed is None:
        return {"ok": True}
    return {"ok": True, "direct": landed.direct, "staged": landed.staged}


async def _landed(regions: list[Any]) -> None:
    """A recv into device memory returns once its copies are ordered before the owner's stream;
    a write is acknowledged once they have run (its writer is told the bytes are in place)."""
    for region in regions:
        if type(region) is not np.ndarray:
            dev = as_view(region).dev
            if dev is not None and dev.stream is not None:
                await wait_event(dev.engine, dev.engine.record_on(dev.stream))


def _regions(table: ExposureTable, items: Any, *, writing: bool) -> tuple[list[Any], list[_Exposed], str | None]:
    """The parts of exposed tensors a request names and the exposures they are of (one per
    part), or why it cannot have them (a peer may send anything: every name, generation and
    range is checked)."""
    if not isinstance(items, list) or not 0 < len(items) <= _MAX_REGIONS:
        return [], [], f"a request names 1..{_MAX_REGIONS} regions"
    out, entries = [], []
    for item in items:
        name = item.get("name") if isinstance(item, dict) else None
        entry = table.get(name) if isinstance(name, str) else None
        if entry is None:
            return [], [], f"{name!r} is not exposed (revoked or never exposed)"
        generation = item.get("generation")
        if type(generation) is not int or generation != entry.handle.generation:
            return [], [], f"{name!r} was exposed again since it was looked up; look it up anew"
        if writing and not entry.handle.writable:
            return [], [], f"{name!r} is exposed read-only"
        offset, shape, h = item.get("offset"), item.get("shape"), entry.handle
        if (
            type(offset) is not int
            or not isinstance(shape, list)
            or not all(type(n) is int and n >= 0 for n in shape)
            or len(shape) > 64
        ):
            return [], [], f"malformed region of {name!r}: offset {offset!r}, shape {shape!r}"
        itemsize = dtype_from_name(h.dtype).itemsize
        end = offset + math.prod(shape) * itemsize
        if offset < 0 or offset % itemsize or end > h.nbytes:
            why = f"bytes {offset}..{end} of shape {shape} are not within {name!r} ({h.nbytes} bytes of {h.dtype})"
            return [], [], why
        if impossible_shape(tuple(shape), itemsize):  # (no bytes, but no array has it: [0, 2**62])
            return [], [], f"malformed region of {name!r}: no tensor has the shape {shape[:8]}"
        out.append(entry.region(offset, tuple(shape)))
        entries.append(entry)
    return out, entries, None


# -- the requester's side -----------------------------------------------------------------------
_op_ids = itertools.count(1)


class _Asking(FifoAdmission):
    """This node's owner-assisted requests and revocation notices on one channel whose final
    answer has not come: at most ``_MAX_ASKED``, in turn (FIFO), so that the peer's service of
    them never stops for good at its cap (``serve_ops``)."""

    def __init__(self) -> None:
        super().__init__()
        self.asked = 0
        self.failure: BaseException | None = None  # the channel closed: nothing gets room

    def _fits(self, n: int) -> bool:
        return self.asked + n <= _MAX_ASKED

    def _take(self, n: int) -> None:
        self.asked += n

    def _give(self, n: int) -> None:
        self.asked -= n

    def fail(self, exc: BaseException | None) -> None:
        failure = self.failure = exc if exc is not None else ClosedResourceError("the channel closed")
        self._fail_waiters(lambda _n: failure)

    async def enter(self) -> None:
        if self.failure is not None:
            raise self.failure
        await self._admit(1)

    def leave(self) -> None:
        self._release(1)


class _Room:
    """One request's place in its channel's ``_Asking``, given back once: by the operation, or
    by what it hands the place to (``pass_on``: a drain of an answer still owed)."""

    __slots__ = ("_asking",)

    def __init__(self, asking: _Asking | None) -> None:
        self._asking = asking

    def pass_on(self) -> _Room:
        asking, self._asking = self._asking, None
        return _Room(asking)

    def release(self) -> None:
        asking, self._asking = self._asking, None
        if asking is not None:
            asking.leave()


_askings: PerChannel[_Asking] = PerChannel(lambda _peer: _Asking())


async def _room(peer: Peer) -> _Room:
    """Wait for room to send ``peer`` one more request or notice (``_Asking``)."""
    asking = _askings(peer)
    await asking.enter()
    return _Room(asking)


class _Direct:
    """A peer's registered tensor as this side reaches it: the key, unpacked once."""

    __slots__ = ("blob", "dtype", "idle", "inflight", "name", "revoked", "rkey", "writable")

    def __init__(self, blob: RemoteKeyBlob | None, name: str = "", writable: bool = False, dtype: str = "") -> None:
        self.blob = blob
        self.name = name
        self.dtype = dtype  # as the lookup said: indexing keeps it, only a change by hand does not
        # what the lookup said: a handle's own ``writable`` is the caller's to change
        # (dataclasses.replace), and no owner code looks at a put to refuse it
        self.writable = writable
        self.rkey: Any = None
        self.inflight = 0
        self.revoked = blob is None
        self.idle: asyncio.Event | None = None

    def close(self) -> None:
        if self.rkey is not None:
            rkey, self.rkey = self.rkey, None
            rkey.close()


# (peer -> (name, generation) -> state), live handles only; dies with the peer
_directs: weakref.WeakKeyDictionary[Peer, dict[tuple[str, int], _Direct]] = weakref.WeakKeyDictionary()
# (peer -> name -> the newest generation it revoked): generations only grow and a name has one
# live generation at a time, so every generation up to that one is dead. One int per name
# instead of a state per revoked generation (a name exposed again and again).
_revoked: weakref.WeakKeyDictionary[Peer, dict[str, int]] = weakref.WeakKeyDictionary()


def _revoked_upto(peer: Peer) -> dict[str, int]:
    upto = _revoked.get(peer)
    if upto is None:
        upto = _revoked[peer] = {}
    return upto


def _states(peer: Peer) -> dict[tuple[str, int], _Direct]:
    states = _directs.get(peer)
    if states is None:
        states = _directs[peer] = {}
    return states


def remember(peer: Peer, handle: RemoteHandle) -> None:
    """A lookup on ``peer`` returned a direct handle: keep its key for reads and writes."""
    key = (handle.name, handle.generation)
    states = _states(peer)
    if key in states or handle.generation <= _revoked_upto(peer).get(handle.name, 0):
        return  # the same generation again (the key is the same), or revoked already
    if not isinstance(peer.channel, OneSidedChannel) or peer.channel.transport != handle.transport:
        raise TransferError(f"lookup of {handle.name!r} returned a {handle.transport} key this peer cannot use")
    blob = unpack_remote_key(handle.remote_key)
    if blob.transport != handle.transport or blob.length < handle.nbytes:
        raise TransferError(f"lookup of {handle.name!r} returned a key that does not cover the tensor")
    states[key] = _Direct(blob, handle.name, handle.writable, handle.dtype)


def _mark_revoked(peer: Peer, name: str, generation: int) -> None:
    upto = _revoked_upto(peer)
    upto[name] = max(upto.get(name, 0), generation)  # also when the lookup has not returned yet
    state = _states(peer).get((name, generation))
    if state is not None:
        state.revoked = True


async def _acknowledge(peer: Peer, name: str, generation: int, reply: int) -> None:
    """Once the revoked handle's running operations finished, forget it and tell the owner."""
    state = _states(peer).get((name, generation))
    if state is not None:
        if state.inflight:
            state.idle = asyncio.Event()
            await state.idle.wait()
        state.close()
        _states(peer).pop((name, generation), None)
    try:
        await peer._send_own({"ok": True}, tag=reply)
    except TensorWireError:
        return


def _direct_state(peer: Peer, handle: RemoteHandle) -> _Direct | None:
    """The direct route for ``handle`` on ``peer``, or None for the owner-assisted one."""
    if handle.owner != peer.remote_node:
        raise ConfigurationError(
            f"{handle.name!r} belongs to node {handle.owner[:12]}, not to this peer ({peer.remote_node[:12]})"
        )
    if peer.session is None or handle.session != peer.session.id:
        # the owner's name and generation match, but they belong to another session: an earlier
        # incarnation of the node (restarted at the same address with the same node_id, its
        # tensors exposed anew) or another Peer object. Never let it reach this session's memory.
        raise HandleNotFound(
            f"{handle.name!r} was looked up on another session with node {handle.owner[:12]} (a peer "
            "since closed, a node since restarted, or another Peer object); look it up on this peer"
        )
    # what moves is a buffer of the handle's dtype and shape, not ``nbytes``: a handle whose
    # fields disagree (one changed with dataclasses.replace) would get or put past its range,
    # into the owner's memory around the exposed tensor, where no check below looks
    itemsize = dtype_from_name(handle.dtype).itemsize
    span = itemsize * math.prod(handle.shape)
    if span != handle.nbytes:
        raise ShapeMismatchError(
            f"{handle.name!r}: the handle's {handle.dtype}{list(handle.shape)} is {span} bytes but it names "
            f"{handle.nbytes} (changed by hand?); index the handle for rows: handle[a:b]"
        )
    # and it starts on an element: bytes that straddle two were read and written over ucx (the
    # range check below let them through), and through the owner refused as "not within" it
    if handle.offset % itemsize:
        raise ShapeMismatchError(
            f"{handle.name!r}: the handle's offset {handle.offset} is not on an element of its "
            f"{itemsize}-byte {handle.dtype} (changed by hand?); nothing moved. Index the handle for rows: handle[a:b]"
        )
    if not handle.direct:
        return None
    state = _states(peer).get((handle.name, handle.generation))
    if state is None and handle.generation > _revoked_upto(peer).get(handle.name, 0):
        raise ConfigurationError(f"{handle.name!r} was not looked up on this peer; call peer.lookup first")
    if state is None or state.revoked:
        raise HandleNotFound(
            f"{handle.name!r} (generation {handle.generation}) was revoked by its owner "
            "(unexposed or exposed again); look it up anew"
        )
    if state.dtype and handle.dtype != state.dtype:
        raise _retyped(handle, state.dtype)
    if handle.transport != peer.channel.transport:
        raise ConfigurationError(
            f"{handle.name!r} has a {handle.transport} key, but this peer uses {peer.path.transport}"
        )
    assert state.blob is not None
    if handle.offset < 0 or handle.offset + handle.nbytes > state.blob.length:
        raise ShapeMismatchError(
            f"{handle.name!r}: bytes {handle.offset}..{handle.offset + handle.nbytes} are not within "
            f"the exposed {state.blob.length} (index the handle for rows: handle[a:b])"
        )
    return state


async def _move(
    peer: Peer,
    op: str,
    moves: Sequence[tuple[_Direct, np.ndarray | DeviceBuffer, int]],
    within: np.ndarray | None = None,
) -> _Route | None:
    """Get into (``op="get"``) or put from each buffer (a host array, or device memory the
    channel takes by pointer), at its handle's registered address plus the offset, one-sided;
    returns once all of them are in place, with how the transport below says it moved them
    (``Receipt.route``; None where it does not say). The transport posts a batch at once and
    waits for it as a whole (``OneSidedChannel.rma_many``). ``within``: one host array that
    holds every buffer (a staging chunk), registered as a whole."""
    await peer._lease_fence()  # then nothing awaits before the operations are posted
    # The handles were checked before the caller's first await, but the revocation may have come
    # since (while this fence, a stream's event or an earlier chunk of the same transfer was
    # awaited) and been acknowledged: between two chunks nothing is in flight. The owner may
    # then have let the memory go. Checked here, with no await before ``inflight`` counts the
    # operations: a notice that comes later waits for them (``_acknowledge``).
    for state, _, _ in moves:
        if state.revoked:
            raise HandleNotFound(_revoked_midway(state, op))
    channel: Any = peer.channel  # a OneSidedChannel: _direct_state checked
    items = []
    for state, buf, offset in moves:
        assert state.blob is not None
        if state.rkey is None:  # its first use (a revoked state never gets here: its key is closed)
            state.rkey = channel.remote_key(state.blob.key)
        ptr = buf.__array_interface__["data"][0] if isinstance(buf, np.ndarray) else buf.ptr
        keep = buf if within is None else within
        items.append((ptr, buf.nbytes, state.blob.address + offset, state.rkey, keep))
    for state, _, _ in moves:
        state.inflight += 1
    try:
        route: _Route | None = await channel.rma_many(op, items)
    finally:
        for state, _, _ in moves:
            state.inflight -= 1
            if not state.inflight and state.idle is not None:
                state.idle.set()
    return route


def _retyped(handle: RemoteHandle, dtype: str) -> ShapeMismatchError:
    """A handle whose dtype was changed by hand to one of the same size: its bytes are the
    owner's, but read or written as another type (over ucx they were; through the owner the
    answer did not fit and was called "unexpected", or the owner's refusal HandleNotFound)."""
    return ShapeMismatchError(
        f"{handle.name!r} is {dtype} at its owner, but the handle says {handle.dtype} (changed by hand?): "
        "nothing moved; look it up anew, and view what you read as another dtype yourself"
    )


def _revoked_midway(state: _Direct, op: str) -> str:
    """Why an operation stopped at a handle revoked while it was under way, and what moved."""
    where = (
        "the bytes put before it are in the owner's tensor (the write landed in part, or not at all)"
        if op == "put"
        else "the destination may hold the bytes got before it (the read landed in part, or not at all)"
    )
    return (
        f"{state.name!r} was revoked by its owner (unexposed or exposed again) while this operation was "
        f"under way: nothing more of it was started; {where}. Look it up anew"
    )


def _receipt(
    op: str,
    peer: Peer,
    protocol: str,
    nbytes: int,
    t0: float,
    packed: bool,
    moved: Receipt | None,
    memory: str = "host",
    staged: bool = False,
    *,
    counted: bool = True,
    ways: tuple[Receipt, ...] = (),
    route: _Route | None = None,
) -> Receipt:
    """A one-sided operation's receipt, and its count in the metrics unless it moved nothing
    (``counted=False``: a batch of no handles); ``moved``: the channel's own, for an
    owner-assisted one. ``ways``: a batch that moved both ways (``_ways``), counted as them.
    ``route``: what the transport below said of every get or put of it (``_move``)."""
    receipt = _described(peer, protocol, nbytes, time.perf_counter() - t0, packed, moved, memory, staged, ways, route)
    if counted:
        for r in ways or (receipt,):
            _metrics.transferred(op, r)
    return receipt


def _described(
    peer: Peer,
    protocol: str,
    nbytes: int,
    seconds: float,
    packed: bool,
    moved: Receipt | None,
    memory: str,
    staged: bool,
    ways: tuple[Receipt, ...] = (),
    route: _Route | None = None,
) -> Receipt:
    ch = peer.channel
    if moved is not None:
        packed, staged = packed or moved.packed, staged or moved.staged
        return replace(
            moved,
            protocol=protocol,
            nbytes=nbytes,
            # the reply may have landed in place, but in a buffer of ours that was then copied
            # into a strided out= (packed): not direct
            direct=moved.direct and not packed and not staged,
            packed=packed,
            staged=staged,
            memory=memory if memory != "host" else moved.memory,
            seconds=seconds,
            parts=ways,
        )
    return Receipt(
        transport=ch.transport,
        lanes=ch.lanes if route is None else route[1],
        nbytes=nbytes,
        seconds=seconds,
        protocol=protocol,
        direct=not packed and not staged,
        staged=staged,
        packed=packed,
        memory=memory,
        parts=ways,
        route="" if route is None else route[0],
    )


def _and_then(earlier: Receipt | None, later: Receipt) -> Receipt:
    """The channel's receipts of two owner-served parts of one batch as one: direct only if
    both were, staged or packed if either was (the last part's alone described the batch)."""
    if earlier is None:
        return later
    return replace(
        later,
        direct=earlier.direct and later.direct,
        staged=earlier.staged or later.staged,
        packed=earlier.packed or later.packed,
        memory=later.memory if later.memory != "host" else earlier.memory,
    )


def _one_sided(peer: Peer) -> str:
    """What a get/put over this peer's channel is: "one-sided" where it reaches the owner's
    memory without the owner's CPU, "one-sided-emulated" where the transport emulates it and
    the owner's worker serves it (UCX without a cma or RDMA lane)."""
    return "one-sided" if peer.channel.one_sided_direct else "one-sided-emulated"


def _protocol(peer: Peer, direct: list[Any], assisted: list[int]) -> str:
    """What a receipt says: the owner took part in all of it, in none, or in some of it (a
    batch of handles some of which move one-sided: "mixed", its ``parts`` saying how much went
    each way, ``_ways``)."""
    if assisted:
        return "mixed" if direct else "owner-assisted"
    if direct:
        return _one_sided(peer)
    return _one_sided(peer) if isinstance(peer.channel, OneSidedChannel) else "owner-assisted"  # an empty batch


# what ``_described`` takes of one way of a batch: nbytes, seconds, packed, moved, memory, staged
_Way = tuple[int, float, bool, Receipt | None, str, bool]
# how the transport below says it moved a one-sided operation's bytes, and over which lanes
# (``Receipt.route``, ``OneSidedChannel.rma_many``)
_Route = tuple[str, tuple[str, ...]]


def _ways(peer: Peer, one_sided: _Way, assisted: _Way, route: _Route | None = None) -> tuple[Receipt, Receipt]:
    """A mixed batch's receipts, one for each way its handles moved: one-sided (the handles
    whose lookup gave a key, ``h.direct``; with their ``route``) and through the owner (the
    others), each with its handles' bytes and its own time. (The batch's one receipt said
    "owner-assisted" alone, as if the owner's CPU had served the one-sided part too.)"""
    return (
        _described(peer, _one_sided(peer), *one_sided, route=route),
        _described(peer, "owner-assisted", *assisted),
    )


def _naming(handle: RemoteHandle) -> dict[str, Any]:
    """What an owner-assisted request says of the bytes it is about."""
    return _named(handle.name, handle.generation, handle.offset, handle.shape)


def _named(name: str, generation: int, offset: int, shape: tuple[int, ...]) -> dict[str, Any]:
    return {"name": name, "generation": generation, "offset": offset, "shape": list(shape)}


def _asking(op: str, handles: list[RemoteHandle], reply: int, data: int) -> dict[str, Any]:
    """An owner-assisted request: a read's, or a write's (whose payload follows on ``data``)."""
    req: dict[str, Any] = {"op": op, "regions": [_naming(h) for h in handles], "reply": reply}
    if op == "write":
        req["data"] = data
    return req


# the header of a request without its regions (a write's: the longer; its tags at their widest),
# and what the four nodes that hold its list of regions grow by as it fills (tensors._sizes)
_ASKING_BYTES = len(prepare(_asking("write", [], WIDEST, WIDEST)).header) + 4 * HOLDER_GROWTH
# the header of a read's answer or a write's payload (a list of tensors) without its tensors
_CARRYING_BYTES = len(prepare([]).header) + 2 * HOLDER_GROWTH


@functools.lru_cache(maxsize=4096)
def _region_bytes(name: str, generation: int, shape: tuple[int, ...]) -> int:
    """At most the bytes one region of ``name`` takes in a request's header: its offset counted
    at its widest, so that the rows of a tensor share one entry."""
    return item_bytes(_named(name, generation, WIDEST, shape))


def _parts(peer: Peer, handles: list[RemoteHandle], assisted: list[int], op: str) -> list[list[int]]:
    """The owner-served handles of a batch (their places in it) as the requests they go in: each
    request of at most ``_MAX_REGIONS`` regions, and each message of it within the header bytes
    and the payload bytes its receiver takes. Every region repeats its tensor's name in the
    request (256 rows of a 200-character name made a 69 KB header) and its spec in the tensors
    that follow a write or answer a read. The request and a write's tensors go to the owner,
    within the max_header_bytes and max_message_bytes it announced as the channel opened; a
    read's answer comes here, within ours. Sized before anything moves: a region that fits in no
    request, or whose bytes alone are past the payload limit, is a MessageRefused then, and a
    later part is never refused for its size after earlier ones moved."""
    if not assisted:
        return []
    theirs = peer.channel.remote_limits
    assert peer.session is not None  # (``_direct_state`` checked every handle)
    carrier = theirs if op == "write" else peer.session.limits  # who takes the tensors
    header_limit, carried_limit, payload_limit = (
        theirs.max_header_bytes,
        carrier.max_header_bytes,
        carrier.max_message_bytes,
    )
    who = "the owner" if op == "write" else "this node"
    parts: list[list[int]] = []
    part: list[int] = []
    asked = carried = payload = 0
    for i in assisted:
        h = handles[i]
        ask, carry = _region_bytes(h.name, h.generation, h.shape), tensor_item_bytes(h.dtype, h.shape)
        if _ASKING_BYTES + ask > header_limit:
            # the bound counts its ints at their widest: whether it fits alone is the exact size's to say
            alone = len(prepare(_asking(op, [h], WIDEST, WIDEST)).header)
            if alone > header_limit:
                raise MessageRefused(
                    f"{op} of {h.name!r}: a request for a region of it has a {alone}-byte header (each region "
                    f"names its tensor), past the owner's {header_limit}-byte limit (its Limits.max_header_bytes); "
                    f"nothing was {_done(op)}. Expose the tensor under a shorter name, or give the owner a "
                    "larger Limits.max_header_bytes"
                )
            ask = header_limit - _ASKING_BYTES  # in a request of its own
        if _CARRYING_BYTES + carry > carried_limit:
            raise MessageRefused(
                f"{op} of {h.name!r}: the tensor of a region of it ({h.dtype}{list(h.shape)}) takes up to "
                f"{_CARRYING_BYTES + carry} bytes of message header, past {who}'s {carried_limit}-byte limit (its "
                f"Limits.max_header_bytes), so nothing was {_done(op)}. Give {who} a larger Limits.max_header_bytes"
            )
        if h.nbytes > payload_limit:
            raise MessageRefused(
                f"{op} of {h.name!r}: a region of it ({h.dtype}{list(h.shape)}) is {h.nbytes} bytes, past {who}'s "
                f"{payload_limit}-byte message limit (its Limits.max_message_bytes), so nothing was {_done(op)}. "
                f"{'Read' if op == 'read' else 'Write'} fewer rows at a time (handle[a:b]), or give {who} a larger "
                "Limits.max_message_bytes"
            )
        if part and (
            len(part) == _MAX_REGIONS
            or _ASKING_BYTES + asked + ask > header_limit
            or _CARRYING_BYTES + carried + carry > carried_limit
            or payload + h.nbytes > payload_limit
        ):
            parts.append(part)
            part, asked, carried, payload = [], 0, 0, 0
        part.append(i)
        asked += ask
        carried += carry
        payload += h.nbytes
    parts.append(part)
    return parts


def _done(op: str) -> str:
    return "read" if op == "read" else "written"


async def _part(moving: Awaitable[Receipt], before: str) -> Receipt:
    """One owner-served part of a batch. Refused at this side all the same (MessageRefused: none
    of it went out; ``_parts`` sized it to the limits both ends announced, but a transport may
    hold headers to a tighter bound of its own), it says what the parts before it moved, as the
    owner's own refusals do (``_before``)."""
    try:
        return await moving
    except MessageRefused as exc:
        if not before:
            raise
        raise MessageRefused(f"{exc}{before}") from exc


def _tags() -> tuple[int, int]:
    n = next(_op_ids) * 2
    return _REPLY_BASE + n, _REPLY_BASE + n + 1


def _check_against(handle: RemoteHandle, x: np.ndarray | DeviceSource, what: str) -> None:
    """``x`` (a host array, or device memory) has the handle's dtype and shape. A byte-swapped
    host array is refused as send refuses it (UnsupportedTensorError), not as a mismatch."""
    if isinstance(x, np.ndarray) and not x.dtype.isnative:
        raise big_endian(x.dtype)
    same = x.dtype == dtype_from_name(handle.dtype) if isinstance(x, np.ndarray) else x.dtype == handle.dtype
    if not same or tuple(x.shape) != handle.shape:
        raise ShapeMismatchError(
            f"{what} is {x.dtype}{list(x.shape)} but {handle.name!r} is {handle.dtype}{list(handle.shape)}"
        )


async def _drain(peer: Peer, tag: int) -> bool:
    """Take the next message on ``tag`` and let its bytes go: where the transport lands a
    payload in order (tcp, inproc), what is yet to land goes to a small scratch buffer, never to
    a buffer of the message's size (the answer of a cancelled 256 MiB read took 256 MiB to drain).
    Whether it was a message of tensors, not a note of none (a cancelled writer's ``None``)."""
    try:
        value, _ = await peer.channel.recv(tag, None, keep=False)
    except TransferError:
        if peer.channel.state is not ChannelState.OPEN:
            raise
        return True  # dropped as asked part way (or failed on its way: gone all the same)
    return value is not None


def _drain_later(peer: Peer, tag: int, *, owed: bool = False, room: _Room | None = None) -> None:
    """A cancelled operation's answer still arrives: receive and drop it so nothing lingers.
    ``owed``: the owner read the request and answers it, however late (its loop busy, or its
    answer waiting for one of our message slots): taken whenever it comes, or until the channel
    closes. A read's answer left unread waited for our go-ahead (rendezvous) for good, and the
    owner's ``unexpose`` with it; an eager one held a message slot of ours for good. Else (a
    message that may never come) given up after _DRAIN_SECONDS. ``room``: the operation's,
    given back once the answer is in."""
    peer._spawn(_drain_within(peer, tag, None if owed else _DRAIN_SECONDS, room))


async def _drain_within(peer: Peer, tag: int, seconds: float | None, room: _Room | None = None) -> None:
    try:
        async with asyncio.timeout(seconds):
            await _drain(peer, tag)
    except (TensorWireError, TimeoutError):
        pass
    finally:
        if room is not None:
            room.release()


# Per peer: the cancelled owner-assisted writes whose payload may still land in the owner's memory
# (``_settle_later``); a value holds no reference to its peer.
_unsettled: weakref.WeakKeyDictionary[Peer, set[asyncio.Future[None]]] = weakref.WeakKeyDictionary()


def _settle_later(peer: Peer, work: Coroutine[Any, Any, None]) -> None:
    """Run ``work``, a cancelled owner-assisted write's end (the drain of its answer, or the note
    that its payload will not come), in the background, and until it ends hold back this side's
    next owner-assisted operations on ``peer`` (``_settled``). Such a write's payload may have
    reached the owner whole before the owner's service posted its receive: the owner keeps it and
    copies it into the tensor later, after the cancel has returned. A read after it then saw the
    tensor as before the write (or parts of both), and the tensor changed under the read that had
    returned; a write after it could be overwritten by it. The owner answers once the bytes are
    in place (or dropped), and that answer ends ``work``."""
    settled: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    _unsettled.setdefault(peer, set()).add(settled)

    async def settle() -> None:
        try:
            await work
        finally:
            pending = _unsettled.get(peer)
            if pending is not None:
                pending.discard(settled)
                if not pending:
                    del _unsettled[peer]
            if not settled.done():
                settled.set_result(None)

    peer._spawn(settle())


async def _settled(peer: Peer) -> None:
    """Wait until this side's cancelled owner-assisted writes to ``peer`` (those so far) have
    landed at the owner or were dropped there (``_settle_later``), or the channel has ended (the
    operation then fails as it would have). Nothing to wait for (the usual case) costs a lookup.
    Bounded as those drains are: the owner answers every write it read, and a closed channel
    ends them all. Direct (one-sided) writes need none of it: a cancelled one has ended its
    transfer before its cancel returns (docs/ucx.md)."""
    pending = _unsettled.get(peer)
    if not pending:
        return
    ended = peer.channel.ended
    waiting = set(pending)
    while waiting and not ended.done():
        await asyncio.wait({*waiting, ended}, return_when=asyncio.FIRST_COMPLETED)
        waiting = {f for f in waiting if not f.done()}


def _split(peer: Peer, handles: list[RemoteHandle]) -> tuple[list[tuple[int, _Direct]], list[int]]:
    """Which handles go one-sided (index, state) and which through the owner (index); all are
    checked before anything moves."""
    direct, assisted = [], []
    for i, h in enumerate(handles):
        state = _direct_state(peer, h)
        if state is None:
            assisted.append(i)
        else:
            direct.append((i, state))
    return direct, assisted


def _check_handles(handles: Sequence[Any]) -> None:
    for h in handles:
        if not isinstance(h, RemoteHandle):
            raise ConfigurationError(f"expected a RemoteHandle (from peer.lookup), got {type(h).__name__}")


async def read(
    peer: Peer, handle: RemoteHandle, out: Any = None, *, device: Any = None, want_receipt: bool = True
) -> tuple[Any, Receipt | None]:
    """One handle. A one-sided read into a plain buffer skips the batch's bookkeeping (a
    quarter of what a small read costs); everything else is a batch of one."""
    _check_handles((handle,))
    if (
        handle.direct
        and device is None
        and (
            (out is None and handle.memory == "host")
            or (type(out) is np.ndarray and out.flags.c_contiguous and out.flags.writeable)
        )
    ):
        t0 = time.perf_counter()
        if out is None:
            out = empty(handle.dtype, handle.shape)  # a TransferError if memory is short: nothing moved
        _check_against(handle, out, "out=")
        state = _direct_state(peer, handle)
        if state is not None:
            route = await _move(peer, "get", [(state, out, handle.offset)])
            if not want_receipt:  # counted all the same, without building a receipt
                ch = peer.channel
                _metrics.moved(
                    "read",
                    "one-sided",
                    ch.transport,
                    _one_sided(peer),
                    True,
                    False,
                    "host",
                    out.nbytes,
                    time.perf_counter() - t0,
                )
                return out, None
            return out, _receipt("read", peer, _one_sided(peer), out.nbytes, t0, False, None, route=route)
    results, receipt = await read_many(peer, [handle], [out], device=device, want_receipt=want_receipt)
    return results[0], receipt


async def write(peer: Peer, handle: RemoteHandle, src: Any) -> Receipt:
    """One handle; as ``read``, a one-sided write from a plain array takes the short way."""
    _check_handles((handle,))
    if handle.direct and handle.writable and type(src) is np.ndarray and src.flags.c_contiguous:
        t0 = time.perf_counter()
        _check_against(handle, src, "the source")
        state = _direct_state(peer, handle)
        if state is not None and state.writable:  # (else write_many says it is read-only)
            route = await _move(peer, "put", [(state, src, handle.offset)])
            return _receipt("write", peer, _one_sided(peer), src.nbytes, t0, False, None, route=route)
    return await write_many(peer, [handle], [src])


class _Dest:
    """Where one handle of a read lands: a host array (``target``, with ``dest`` the C-contiguous
    one the bytes land in), or device memory (``dev``, the caller's; or ``tensor``, allocated)."""

    __slots__ = ("dest", "dev", "target", "tensor", "value")

    def __init__(self, value: Any, target: np.ndarray | None, dev: DeviceSource | None = None) -> None:
        self.value = value  # what the read returns
        self.target = target
        self.dest = target if target is None or target.flags.c_contiguous else np.empty(target.shape, target.dtype)
        self.dev = dev
        self.tensor: DeviceTensor | None = None

    def staged(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The copy (to, from) that moves the bytes landed in a buffer of ours into the caller's
        strided host out=, or None where they landed in place."""
        if self.target is None or self.dest is self.target:
            return None
        assert self.dest is not None
        return self.target, self.dest

    def host(self) -> np.ndarray:
        """The host array the bytes land in (a host destination)."""
        assert self.dest is not None
        return self.dest

    @property
    def nbytes(self) -> int:
        if self.target is not None:
            return int(self.target.nbytes)
        return self.tensor.nbytes if self.tensor is not None else self.dev.nbytes  # type: ignore[union-attr]


def _where(handle: RemoteHandle, want: Device | None, streams: Streams | None) -> int | None:
    """The CUDA device a read without out= allocates on, or None for host memory: ``device=``
    where given, else where the owner's tensor is, if this process has CUDA."""
    if want is None:
        if handle.memory == "cuda" and cuda_usable():
            return streams.device if streams is not None else check_cuda(None)
        return None
    return want.index if want.kind == "cuda" else None


def _destinations(
    handles: list[RemoteHandle], outs: list[Any], device: Any
) -> tuple[list[_Dest], Streams | None, bool]:
    """Each handle's destination, checked (dtype, shape, writable); allocated where ``outs``
    has None. Also the caller's streams, taken now, and whether any destination is on a device."""
    want = wanted_device(device, any(out is not None for out in outs))
    on_device = want is not None and want.kind == "cuda"
    views: list[Any] = []
    for out in outs:
        view = None if out is None or type(out) is np.ndarray else as_view(out)
        views.append(view)
        on_device = on_device or (view is not None and view.dev is not None)
    if not on_device and want is None:
        on_device = any(h.memory == "cuda" for h in handles) and cuda_usable()
    streams = capture_streams(want) if on_device else None
    dests = []
    for h, out, view in zip(handles, outs, views, strict=True):
        if out is None:
            where = _where(h, want, streams)
            if where is None:
                arr = empty(h.dtype, h.shape)  # before anything moves (TransferError if memory is short)
                dests.append(_Dest(arr, arr))
                continue
            t = allocate_device(h.dtype, h.shape, "torch", where, streams)
            d = _Dest(t.value, None)
            d.tensor = t
            dests.append(d)
            continue
        if view is not None and view.dev is not None:
            _check_against(h, view.dev, "out=")
            if view.dev.readonly:
                raise ShapeMismatchError(f"out= {type(out).__name__} is read-only ({view.dev.readonly})")
            dests.append(_Dest(out, None, view.dev))
            continue
        target = out if view is None else view.array
        _check_against(h, target, "out=")
        if view is not None and view.readonly:  # (its array is a copy: a torch conj or neg view)
            raise ShapeMismatchError(f"out= {type(out).__name__} is read-only ({view.readonly})")
        if not target.flags.writeable:
            raise ShapeMismatchError("out= buffer is read-only")
        if overlaps_itself(target):  # (the copy into it would keep the last of each shared element)
            raise ShapeMismatchError(
                f"out= {type(out).__name__} has elements that share memory (a zero or overlapping stride, "
                "as expand(), broadcast_to() or as_strided() make), so the values read would overwrite "
                "each other; read into a tensor of distinct elements"
            )
        dests.append(_Dest(out, target))
    mark_written(v for v in views if v is not None)
    return dests, streams, on_device


def _refuse_overlapping_writes(handles: list[RemoteHandle]) -> None:
    """ShapeMismatchError if two handles of a write batch name the same bytes of a tensor: which
    of them lands last is not defined (the owner refused such a request, and the error said the
    tensor was not found). Checked before anything moves."""
    ranges: dict[tuple[str, str, int], list[tuple[int, int, int]]] = {}
    for i, h in enumerate(handles):
        if h.nbytes:
            ranges.setdefault((h.owner, h.name, h.generation), []).append((h.offset, h.offset + h.nbytes, i))
    for (_, name, _), spans in ranges.items():
        spans.sort()
        reach, last = -1, -1
        for start, end, i in spans:
            if start < reach:
                first, second = sorted((last, i))
                raise ShapeMismatchError(
                    f"handles {first} and {second} of the write batch name the same bytes of {name!r}: "
                    "each byte is written once per batch"
                )
            if end > reach:
                reach, last = end, i


async def read_many(
    peer: Peer, handles: list[RemoteHandle], outs: list[Any] | None, *, device: Any = None, want_receipt: bool = True
) -> tuple[list[Any], Receipt | None]:
    """Read each handle's tensor (or rows) into its ``out`` (allocated where None: on
    ``device``, else where the owner's tensor lives if this process can hold it there), as one
    batch; the receipt (None unless ``want_receipt``) says how, with the bytes of all."""
    t0 = time.perf_counter()
    if outs is None:
        outs = [None] * len(handles)
    elif len(outs) != len(handles):
        raise ConfigurationError(f"{len(handles)} handles but {len(outs)} out= buffers")
    _check_handles(handles)
    dests, streams, on_device = _destinations(handles, outs, device)
    refuse_shared(
        [d.target if d.target is not None else d.dev for d in dests],  # (None: allocated, shares nothing)
        "out= buffers {first} and {second} share memory: each handle of a batch needs its own buffer",
    )
    direct, assisted = _split(peer, handles)
    parts = _parts(peer, handles, assisted, "read")
    moved = None
    memory, staged = "host", False
    route = None
    if direct:
        if on_device:
            memory, staged, route = await _get_device(peer, handles, dests, direct, streams)
        else:
            route = await _move(peer, "get", [(state, dests[i].host(), handles[i].offset) for i, state in direct])
    t1 = time.perf_counter()  # the one-sided part's end (a mixed batch's receipt times each part)
    done = [i for i, _ in direct]  # the handles whose bytes are in place: an error names them
    try:
        for part in parts:
            before = _before("read", done, len(handles))
            # device memory: the recv lands it (staged or by pointer) and orders the consumer's stream
            reading = _assisted_read(
                peer,
                [handles[i] for i in part],
                [dests[i].value if dests[i].dest is None else dests[i].dest for i in part],
                streams,
                before,
            )
            got = await _part(reading, before)
            moved = _and_then(moved, got)
            done += part
    except TensorWireError:
        # the error says these are in their outs: strided ones too
        await copy_host([c for c in (dests[i].staged() for i in done) if c is not None])
        raise
    copies = [c for c in (d.staged() for d in dests) if c is not None]
    await copy_host(copies)  # (large ones in a copy thread)
    t2 = time.perf_counter()
    # strided outs are packed: on the host by the copies above, on a device on a lane by _get_device
    packed = bool(copies) or any(_unpacked(d) for d in dests)
    nbytes = sum(d.nbytes for d in dests)
    if memory == "host" and on_device:
        memory = next((_kind(d) for d in dests if d.target is None), "host")
    # device memory its owner serves left it through host staging buffers of the owner's (a
    # transport that moves such memory by pointer registers it, and the handle is direct): the
    # reply's receipt here tells only this side
    served_staged = any(handles[i].memory != "host" and handles[i].nbytes for i in assisted)
    ways: tuple[Receipt, ...] = ()
    if direct and assisted:

        def way(places: list[int], seconds: float, moved: Receipt | None, staged: bool) -> _Way:
            ds = [dests[i] for i in places]
            memory = next((_kind(d) for d in ds if d.target is None), "host")
            packed = any(d.staged() is not None or _unpacked(d) for d in ds)
            return sum(d.nbytes for d in ds), seconds, packed, moved, memory, staged

        gotten = [i for i, _ in direct]
        ways = _ways(peer, way(gotten, t1 - t0, None, staged), way(assisted, t2 - t1, moved, served_staged), route)
    protocol = _protocol(peer, direct, assisted)
    staged = staged or served_staged
    receipt = _receipt(
        "read", peer, protocol, nbytes, t0, packed, moved, memory, staged, counted=bool(handles), ways=ways, route=route
    )
    return [d.value for d in dests], receipt if want_receipt else None


def _unpacked(d: _Dest) -> bool:
    """A device destination whose bytes landed in a buffer of ours and were unpacked into a
    strided out= on a lane."""
    return d.tensor is not None and d.tensor.unpack_to is not None


def _by_pointer(peer: Peer, t: DeviceTensor) -> bool:
    """The channel's one-sided operations take ``t``'s memory as it is (ucx with cuda lanes),
    else it goes through host memory around them."""
    return peer.channel.rma_device and t.engine.kind in peer.channel.device_kinds


def _kind(d: _Dest) -> str:
    if d.tensor is not None:
        return d.tensor.engine.kind
    assert d.dev is not None
    return d.dev.engine.kind


async def _get_device(
    peer: Peer, handles: list[RemoteHandle], dests: list[_Dest], direct: list[tuple[int, _Direct]], streams: Any
) -> tuple[str, bool, _Route | None]:
    """The one-sided gets of a batch with device destinations. Memory of a kind the channel
    takes by pointer (ucx with cuda lanes) is posted once the consumer stream's earlier work on
    it is done; other device memory gets its bytes in staging chunks, each chunk copied up while
    the next ones are got (``StageIn.gather``). Strided destinations are unpacked on a lane.
    Returns the memory kind, whether it was staged, and the gets' route (``_move``; None where
    some went through staging chunks, whose gets are not asked)."""
    landing = Landing()
    waits: list[tuple[CopyEngine, Event]] = []
    moves: list[tuple[_Direct, np.ndarray | DeviceBuffer, int]] = []
    staged: dict[CopyEngine, list[tuple[_Direct, DeviceTensor, int]]] = {}
    memory = "host"
    for i, state in direct:
        d = dests[i]
        if d.target is not None:
            moves.append((state, d.host(), handles[i].offset))
            continue
        t = d.tensor if d.tensor is not None else d.dev.target(streams)  # type: ignore[union-attr]
        d.tensor = t
        memory = t.engine.kind
        if _by_pointer(peer, t):
            if t.stream is not None:
                waits.append((t.engine, t.engine.record_on(t.stream)))  # taken now, at the call
            moves.append((state, t.buf, handles[i].offset))
        else:
            staged.setdefault(t.engine, []).append((state, t, handles[i].offset))
    # UCX writes outside every stream: the consumer's work first, a wait that the channel's end
    # cuts short (nothing is posted yet; the stream may stay busy for as long as its work runs)
    for engine, event in waits:
        await wait_event(engine, event, peer.channel.ended)
    route = await _move(peer, "get", moves) if moves else None
    targets = [t for i, _ in direct if (t := dests[i].tensor) is not None]
    try:
        for jobs in staged.values():
            await _gather(peer, landing, jobs)
        await landing.finish([t for t in targets if t.unpack_to is not None or t.engine in staged])
    except BaseException:  # cancelled or failed: the copies queued so far come before the consumer's work
        landing.finish_now(targets)
        raise
    return memory, bool(staged), None if staged else route


async def _gather(peer: Peer, landing: Landing, jobs: list[tuple[_Direct, DeviceTensor, int]]) -> None:
    """Get each ``(state, tensor, offset)`` of one engine through its staging chunks: the gets
    land in the chunks themselves, each chunk copied up on the landing's lane (after each
    tensor's consumer stream) while the next chunks are being got."""
    stage = None
    for _, t, _ in jobs:
        stage = landing.stage(t, fresh=True)
    assert stage is not None
    bufs = [t.buf for _, t, _ in jobs]
    # a chunk is reused only once its copies up, queued after the consumer's stream, have run:
    # the channel's end cuts that wait short (the stream may stay busy for as long as its work runs)
    await stage.gather(bufs, _chunk_moves(peer, "get", jobs), spoiled=_closing(peer), until=peer.channel.ended)


def _chunk_moves(peer: Peer, op: str, jobs: list[tuple[_Direct, DeviceTensor, int]]) -> Move:
    """Gets into (or puts from) a staging chunk of its pieces of ``jobs``' tensors, each at its
    handle's offset plus the piece's place in the tensor: one batch per chunk."""

    async def move(chunk: HostChunk, pieces: list[Piece]) -> None:
        items = [(jobs[i][0], chunk.array[off : off + k], jobs[i][2] + pos) for i, pos, off, k in pieces]
        await _move(peer, op, items, within=chunk.array)

    return move


def _closing(peer: Peer) -> Callable[[], bool]:
    """Whether ``peer``'s channel has stopped waiting for what it posted (it is closing): a
    staging chunk such an operation used may still be touched."""
    return lambda: peer.channel.state is not ChannelState.OPEN


async def _assisted_read(
    peer: Peer, handles: list[RemoteHandle], dests: list[Any], streams: Streams | None, before: str = ""
) -> Receipt:
    """Ask the owner for the rows and receive them into ``dests``; device ones ordered on the
    consumer's ``streams`` taken at the read's call (another task may have made other streams
    current while the request was on its way). ``before``: what the batch moved before this
    part, for the owner's refusal to say (``_before``)."""
    reply, _ = _tags()
    await _settled(peer)  # a cancelled write that may still land is in place first
    room = await _room(peer)
    try:
        sending = _sending(peer, _asking("read", handles, reply, 0))
        # the receive is posted as the request goes (its task's first step right after the send's
        # first), before the owner can answer: the reply lands straight in ``dests`` however soon
        # it comes. Posted once the send had returned, a reply that came first (inproc's, under
        # 64 KiB) waited in a buffer of ours and was copied in. Cancelled, the read wants none of
        # it: the rest of a reply under way is let go, not moved to a buffer of ours for the
        # drain (keep)
        receiving = asyncio.ensure_future(peer.channel.recv(reply, dests, streams=streams, keep=False))
        try:
            await _request(sending, lambda held: _drain_later(peer, reply, owed=True, room=held), room)
        except BaseException:
            await call_off(receiving)  # a reply it had taken goes back to its tag, for the drain
            raise
        try:
            try:
                _, receipt = await _reply(peer, receiving)
            except ShapeMismatchError:
                answer = await peer._recv_own(tag=reply)  # not the tensors: the owner's error
                if isinstance(answer, dict) and (error := _error_of(answer)):
                    raise _owner_error(answer)(f"read of {_names(handles)}: {error}{before}") from None
                if isinstance(answer, list):  # the owner's tensors, of another dtype than the handles say
                    raise ShapeMismatchError(
                        f"read of {_names(handles)}: the owner's tensors are not the handles' dtypes (one changed "
                        f"by hand?): nothing was read into their outs; look them up anew{before}"
                    ) from None
                raise TransferError(f"read of {_names(handles)}: unexpected answer from the owner") from None
            except TensorWireError:
                if peer.channel.state is ChannelState.OPEN:
                    # The receive failed here with the channel up: the reply came whole and
                    # could not be handed over (a device copy into dests that failed), or was
                    # lost here. The owner answers with an error only when its send raised, and
                    # a send that fails part way on an open channel is withdrawn, which this
                    # receive waits through (taking that error answer itself, above): the owner
                    # sent this reply whole, its service of the request is over, and nothing
                    # more comes. So the place goes back now (the finally below); handed to the
                    # drain it was lost for _DRAIN_SECONDS after every such failure, and 64 of
                    # them in a minute stalled every owner-assisted operation on the channel.
                    # The drain stays, without the place, for the one transport that tells an
                    # owner its send failed after the receive took it (inproc: a copy into our
                    # memory that failed part way): its error answer is taken, not left unread.
                    _drain_later(peer, reply)
                raise
        except asyncio.CancelledError:
            if not (receiving.done() and not receiving.cancelled() and receiving.exception() is None):
                # (else the reply came whole before the cancel)
                _drain_later(peer, reply, owed=True, room=room.pass_on())
            raise
    finally:
        room.release()
    return receipt


async def _reply(peer: Peer, receiving: asyncio.Future[tuple[Any, Receipt]]) -> tuple[Any, Receipt]:
    """The receive of an owner-assisted read's reply, awaited until it ends or the channel does
    (``Channel.ended``): then it is cancelled, waited for (it writes into the read's buffers
    until it has ended), and the read raises what ended the channel, PeerDisconnected for the
    owner's close, ClosedResourceError for our own, as a one-sided read does over ucx. A reply
    that was whole before the close is still the read's (the cancel finds it done).

    Without this, a reply landing in device memory whose consumer stream stayed busy outlived
    its channel: inproc (and ucx, for device memory its owner serves) had it whole in host
    memory of ours and handed it over once the stream freed, however long after the close (for
    good, were the stream stuck), where a one-sided read over ucx raised at once. A recv keeps
    such a message (messages that had fully arrived are still delivered), but a read is an
    operation on the owner's memory, and ends with its channel on every transport. Copies
    already queued behind the stream still run: out= may hold part of the bytes, as after any
    read that failed part way. (Over tcp the reader, landing the reply, waits for the stream
    before it can read the owner's close behind it: ``ended`` fails once the socket hangs up,
    ``TcpChannel._peer_hung_up``, before the channel shuts.)"""
    ended = peer.channel.ended

    def cut(_: asyncio.Future[None]) -> None:
        receiving.cancel()

    ended.add_done_callback(cut)
    try:
        return await receiving
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and not task.cancelling() and ended.done() and not ended.cancelled():
            failure = ended.exception()
            if failure is not None:  # (our own cancel, not the caller's)
                raise failure from None
        raise
    finally:
        ended.remove_done_callback(cut)


def _sending(peer: Peer, req: dict[str, Any]) -> asyncio.Task[Receipt]:
    """The send of an owner-assisted request, started (``_request`` waits for it)."""
    return asyncio.get_running_loop().create_task(peer._send_own(req, tag=_OPS_TAG))


async def _request(sending: asyncio.Task[Receipt], undo: Callable[[_Room], None], room: _Room) -> None:
    """Wait for an owner-assisted request to be sent (``_sending``). The send is left to finish
    by itself: a caller cancelled meanwhile returns at once, and if the request then goes out
    whole (the owner answers it) ``undo()`` runs: it takes the answer (and for a write says the
    payload will not come). One that never went out has nothing to undo; a note for it would
    wait at the owner for good. (Cancelled part way, a send may still deliver the request: tcp
    finishes a frame it started, and the abort after it is ignored for a message already whole.
    Each answer nobody took held one of the owner's message slots, until the owner could send
    this peer nothing at all; the owner's service of a write waited for its payload for good.)
    The operation's ``room`` goes to ``undo`` then (given back once the answer is in), or is
    given back as the send ends undelivered."""
    try:
        await asyncio.shield(sending)
    except asyncio.CancelledError:
        held = room.pass_on()

        def sent(task: asyncio.Task[Receipt]) -> None:
            if not task.cancelled() and task.exception() is None:
                undo(held)
            else:
                held.release()

        sending.add_done_callback(sent)
        raise


def _owner_error(answer: Any) -> type[TensorWireError]:
    """What an owner's error answer is raised as: it refused the request (a name, generation or
    range it does not have: HandleNotFound), the bytes did not fit its tensor (a handle whose
    dtype was changed by hand: ShapeMismatchError), or it failed to move bytes it has
    (TransferError)."""
    if isinstance(answer, dict) and answer.get("mismatch") is True:
        return ShapeMismatchError
    return TransferError if isinstance(answer, dict) and answer.get("failed") is True else HandleNotFound


def _error_of(answer: Any) -> str | None:
    """The error an owner's answer says (None: it says none). Its fields are read by type, not
    by truth: a broken or hostile owner may send anything, tensors too, whose truth numpy
    refuses; an answer that is not a dict, or whose error is not a string, is "unexpected"."""
    if not isinstance(answer, dict):
        return "unexpected answer"
    error = answer.get("error")
    if error is None or error is False or (isinstance(error, str) and not error):
        return None
    return error if isinstance(error, str) else f"unexpected answer (an error of type {type(error).__name__})"


def _before(op: str, done: list[int], total: int) -> str:
    """What a batch moved before the part that is refused (a batch too large for one request
    goes as several, ``_parts``, each checked by the owner as it comes, after the one-sided
    part): the caller learns which handles are in place, by their places in the batch. Empty
    when nothing moved."""
    if not done:
        return ""
    spans: list[str] = []
    first = last = -2
    for i in [*sorted(done), -2]:
        if i != last + 1:
            if last >= 0:
                spans.append(str(first) if first == last else f"{first}-{last}")
            first = i
        last = i
    verb = "read into their outs" if op == "read" else "written"
    return (
        f" (of this batch of {total} handles, {', '.join(spans)} were {verb} before this part was refused;"
        " the rest were not)"
    )


def _names(handles: list[RemoteHandle]) -> str:
    names = sorted({h.name for h in handles})
    return repr(names[0]) if len(names) == 1 else f"{len(names)} tensors ({names[0]!r}, ...)"


async def write_many(peer: Peer, handles: list[RemoteHandle], srcs: list[Any]) -> Receipt:
    """Write each source into its handle's tensor (or rows), as one batch; returns once all
    the bytes are in the owner's memory. Device sources are read after their producer
    stream's work queued before this call (an event recorded now)."""
    t0 = time.perf_counter()
    if len(srcs) != len(handles):
        raise ConfigurationError(f"{len(handles)} handles but {len(srcs)} sources")
    _check_handles(handles)
    arrays: list[np.ndarray | DeviceSource] = []
    # each source's bytes go from a copy: packed into C order, or a copy of tensorwire's already
    # (a torch conj or neg view, resolved)
    packs: list[bool] = []
    for h, src in zip(handles, srcs, strict=True):
        copied = False
        if type(src) is np.ndarray:
            arr: np.ndarray | DeviceSource = src
        else:
            view = as_view(src)
            arr = view.array if view.dev is None else view.dev
            copied = bool(view.copied)
        _check_against(h, arr, "the source")
        arrays.append(arr)
        packs.append(copied or not (arr.flags.c_contiguous if isinstance(arr, np.ndarray) else arr.contiguous))
    _refuse_overlapping_writes(handles)
    direct, assisted = _split(peer, handles)
    # every handle before anything moves: the owner refused a read-only one only when the
    # request naming it came, after the parts of a batch of more than _MAX_REGIONS before it had
    # landed; and a direct handle is read-only as its lookup said, whatever its field says now
    said = {i: state.writable for i, state in direct}
    for i, h in enumerate(handles):
        if not (h.writable and said.get(i, True)):
            raise HandleNotFound(f"write of {h.name!r}: {h.name!r} is exposed read-only; nothing was written")
    # the owner-served parts' messages now, at the call: device sources record their producer
    # stream's event here, not after the awaits below (by then another stream may be current)
    parts = _parts(peer, handles, assisted, "write")
    # each sends what was checked: the host array ``as_view`` made of its source (a ``bytes``
    # is a tensor of uint8 to it but a scalar to a message, which the owner then refused with
    # "a tensor where the message has a scalar", as a HandleNotFound; over ucx it was put), or
    # a device source as given (its message records its producer stream's event)
    preparing = [
        prepare_off_loop([a if isinstance(a := arrays[i], np.ndarray) else srcs[i] for i in part]) for part in parts
    ]
    packed = any(packs)
    # device sources: their bytes in C order, after an event on the producer's stream, now, at
    # the call (before the awaits below: the work the caller queues on that stream meanwhile is
    # not this write's to wait for)
    wired = {i: a.wire()[0] for i, _ in direct if isinstance(a := arrays[i], DeviceSource)}
    outgoing = [await p for p in preparing]  # (large strided host sources packed in a copy thread)
    moved = None
    memory, staged = "host", False
    route = None
    if direct:
        moves: list[tuple[_Direct, np.ndarray | DeviceBuffer, int]] = []
        down: dict[CopyEngine, list[tuple[_Direct, DeviceTensor, int]]] = {}
        hosts = {i: a for i, _ in direct if isinstance(a := arrays[i], np.ndarray)}
        # the large packing copies all in one copy thread, as a send's are (one hop each, in
        # turn, took a thread's round trip per source); the small ones here, where they cost less
        heavy = [i for i, a in hosts.items() if packs_in_a_thread(a)]
        wires: dict[int, np.ndarray] = {}
        if heavy:
            packing = await off_loop(lambda: [_packed(hosts[i], handles[i]) for i in heavy])
            wires = dict(zip(heavy, packing, strict=True))
        for i, state in direct:
            t = wired.get(i)
            if t is None:
                h = handles[i]
                wire = wires[i] if i in wires else _packed(hosts[i], h)
                moves.append((state, wire, h.offset))
                continue
            memory = t.engine.kind
            if _by_pointer(peer, t):
                if t.ready is not None:  # the producer's work first; the channel's end cuts it short
                    await wait_event(t.engine, t.ready, peer.channel.ended)
                moves.append((state, t.buf, handles[i].offset))
            else:
                down.setdefault(t.engine, []).append((state, t, handles[i].offset))
        if moves:
            route = await _move(peer, "put", moves)
        for jobs in down.values():
            await _scatter(peer, jobs)
        staged = bool(down)
        if staged:  # (the puts from staging chunks are not asked)
            route = None
    t1 = time.perf_counter()  # the one-sided part's end (a mixed batch's receipt times each part)
    done = [i for i, _ in direct]  # the handles whose bytes are in place: an error names them
    for part, msg in zip(parts, outgoing, strict=True):
        before = _before("write", done, len(handles))
        sent = await _part(_assisted_write(peer, [handles[i] for i in part], msg, before), before)
        moved = _and_then(moved, sent)
        done += part
    nbytes = sum(a.nbytes for a in arrays)
    ways: tuple[Receipt, ...] = ()
    if direct and assisted:

        def way(places: list[int], seconds: float, moved: Receipt | None, memory: str, staged: bool) -> _Way:
            return sum(arrays[i].nbytes for i in places), seconds, any(packs[i] for i in places), moved, memory, staged

        put = [i for i, _ in direct]
        ways = _ways(
            peer,
            way(put, t1 - t0, None, memory, staged),
            way(assisted, time.perf_counter() - t1, moved, "host", False),
            route,
        )
    protocol = _protocol(peer, direct, assisted)
    return _receipt(
        "write",
        peer,
        protocol,
        nbytes,
        t0,
        packed,
        moved,
        memory,
        staged,
        counted=bool(handles),
        ways=ways,
        route=route,
    )


def _packed(src: np.ndarray, handle: RemoteHandle) -> np.ndarray:
    """A host source in C order, to put from: as it is, or packed into a copy (a broadcast view
    packs to its full size); TransferError, as a send's packing, when that copy cannot be had."""
    try:
        return np.ascontiguousarray(src)
    except MemoryError as exc:
        raise TransferError(
            f"out of memory: could not pack a {src.dtype} source of shape {src.shape} ({src.nbytes} bytes) into C "
            f"order to write it to {handle.name!r}; nothing was written (write from a contiguous tensor, or fewer "
            "rows at a time)"
        ) from exc


async def _scatter(peer: Peer, jobs: list[tuple[_Direct, DeviceTensor, int]]) -> None:
    """Put each ``(state, tensor, offset)`` of one engine through its staging chunks: each
    chunk is copied down and put from the chunk itself while the next chunks are being copied
    down. The tensors' producer events are waited for first, on the host, in a wait that the
    channel's end cuts short (``ended``), as a send's is: a producer stream may stay busy for as
    long as its owner's work runs, and copies queued behind it cannot be taken back (the chunks
    they copy into could not be reused, nor freed, until that work is done)."""
    events = list({id(e): e for _, t, _ in jobs if (e := t.ready) is not None}.values())
    for event in events:
        await wait_event(jobs[0][1].engine, event, peer.channel.ended)
    await scatter([t.buf for _, t, _ in jobs], _chunk_moves(peer, "put", jobs), spoiled=_closing(peer))


async def _assisted_write(peer: Peer, handles: list[RemoteHandle], msg: Outgoing, before: str = "") -> Receipt:
    """Send the owner a write request and then the sources, ``msg`` (prepared at the write's
    call); returns once the owner has the bytes in place. ``before``: as ``_assisted_read``."""
    reply, data = _tags()
    await _settled(peer)  # a cancelled write that may still land cannot overwrite this one
    room = await _room(peer)
    try:
        await _request(
            _sending(peer, _asking("write", handles, reply, data)),
            lambda held: peer._spawn(_cancel_write(peer, data, reply, held)),
            room,
        )
        try:
            receipt = await peer.channel.send(data, msg)
        except BaseException:
            # cancelled, or failed before the payload went out (refused: ``_parts`` sized it to
            # the owner's limits, but a transport may hold headers to a tighter bound of its
            # own): the owner read the request and waits for the payload, holding the tensor busy
            # (its unexpose waited for good); tell it none comes
            # (the payload may have reached it whole all the same, to land later: ``_settle_later``)
            _settle_later(peer, _cancel_write(peer, data, reply, room.pass_on()))
            raise
        try:
            answer = await peer._recv_own(tag=reply)
        except asyncio.CancelledError:
            # its answer is owed, as ``_drain_later``'s; the payload may land before it (``_settle_later``)
            _settle_later(peer, _drain_within(peer, reply, None, room.pass_on()))
            raise
    finally:
        room.release()
    if error := _error_of(answer):
        raise _owner_error(answer)(f"write of {_names(handles)}: {error}{before}")
    # the owner's side of the payload, as it says (an owner of an earlier release says nothing):
    # read through its channel's read-ahead (a small tcp payload), copied in from a buffer of its
    # own (come before its recv was posted), staged into device memory
    return replace(
        receipt,
        direct=receipt.direct and answer.get("direct") is not False,
        staged=receipt.staged or answer.get("staged") is True,
    )


async def _cancel_write(peer: Peer, data: int, reply: int, room: _Room) -> None:
    """Tell the owner the payload will not come (a tensorless message it cannot take as one).
    A send cancelled late may have delivered the payload whole all the same: the owner then
    answers ``ok``, or refuses the write having drained that payload (``took``), and our note is
    left over on its data tag, so we ask it to drop the note (left there, each held one of our
    message slots at the owner for good).
    The owner answers every write request, however late (``_drain_later``'s ``owed``). The
    write's ``room`` is given back at the end: the owner's drain of the note needs nothing more."""
    try:
        await peer._send_own(None, tag=data)
        answer = await peer._recv_own(tag=reply)
        if isinstance(answer, dict) and (answer.get("ok") is True or answer.get("took") is True):
            await peer._send_own({"op": "drop", "data": data, "reply": reply}, tag=_OPS_TAG)
    except (TensorWireError, TimeoutError, ClosedResourceError):
        pass
    finally:
        room.release()
