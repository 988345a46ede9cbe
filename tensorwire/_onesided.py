"""One-sided access to exposed tensors: ``node.expose`` / ``peer.lookup`` / ``peer.read`` / ``peer.write``.

An owner exposes a C-contiguous tensor under a name; a session peer resolves the name over the
control plane into a RemoteHandle (dtype, shape, generation, and for one-sided transports the
registered address and key) and then reads or writes the whole tensor.

Direct (transports whose Capabilities say ``one_sided``: ucx): ``expose`` registers the memory
with each such transport (through its registration cache); Lookup hands the session peer a
remote-key blob (``transports/_remote.py``) for the transport its channel uses; the reader
unpacks the key once per (peer, handle generation) and moves the bytes with get/put + flush.
No code of the owner's runs per operation. Receipts say ``protocol="one-sided"``.

Revocation of direct handles: ``unexpose`` removes the name at once (lookups and
owner-assisted operations fail from then on), then sends every peer that received the key a
*revoke* notice on the reserved ops tag. A peer marks the handle revoked (its later reads and
writes fail with HandleNotFound), waits for its operations on it that are still moving, and
acknowledges. Only when every such peer acknowledged (or its channel closed) does the owner
unregister the memory and drop its reference to the tensor. So a tensorwire peer never
touches memory the owner has let go of; an operation that started before the notice arrived
completes against the exposed memory as it was.

On transports without one-sided support (tcp, inproc) the same calls go through the owner's
node: a small request on a reserved tag, answered by the owner's per-peer service, with the
payload moving straight between the exposed memory and the requester's buffer (rendezvous
for large tensors). Receipts say ``protocol="owner-assisted"`` so nobody mistakes it for RDMA.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import weakref
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import (
    ClosedResourceError,
    ConfigurationError,
    HandleNotFound,
    ShapeMismatchError,
    TensorWireError,
    TransferError,
)
from .tensors import as_view, dtype_from_name
from .transports import Receipt, Transport
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
    "remember",
    "retire",
    "serve_ops",
    "write",
]

_OPS_TAG = -0x7477_6F70_7300_0001  # reserved: owner-assisted one-sided requests
_REPLY_BASE = -0x7477_7270_0000_0000  # reserved range for per-operation replies and payloads
_DRAIN_SECONDS = 60.0


@dataclass(frozen=True, slots=True)
class Handle:
    """A tensor this node exposes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    generation: int
    writable: bool


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

    @property
    def direct(self) -> bool:
        """Reads and writes move the bytes one-sided, without the owner's code."""
        return bool(self.remote_key)


@dataclass(slots=True)
class _Exposed:
    handle: Handle
    array: np.ndarray
    source: Any  # the caller's object, kept alive while exposed
    holds: dict[str, Hold] = field(default_factory=dict)  # one-sided transport -> registration
    given: set[str] = field(default_factory=set)  # sessions that received a remote key

    def release(self) -> None:
        """Unregister the memory (one reference of the registration cache) and let it go."""
        holds, self.holds = self.holds, {}
        for hold in holds.values():
            try:
                hold.release()
            except TensorWireError as exc:
                log.warning("unregistering %r failed: %s", self.handle.name, exc)


class ExposureTable:
    """The tensors one node exposes, by name."""

    def __init__(self) -> None:
        self._by_name: dict[str, _Exposed] = {}
        self._generation = itertools.count(1)
        self.served = 0  # owner-assisted reads and writes this node answered

    def expose(self, tensor: Any, name: str, transports: Mapping[str, Transport] | None = None) -> Handle:
        """Publish ``tensor``; register it with every one-sided transport in ``transports``."""
        if not isinstance(name, str) or not name or len(name) > 256:
            raise ConfigurationError("a handle name is a non-empty string of at most 256 characters")
        if name in self._by_name:
            raise ConfigurationError(f"{name!r} is already exposed; unexpose it first")
        view = as_view(tensor)
        arr = view.array
        if not arr.flags.c_contiguous:
            raise ShapeMismatchError(f"exposed tensors must be C-contiguous ({name!r} is not)")
        h = Handle(name, view.dtype, view.shape, view.nbytes, next(self._generation), bool(arr.flags.writeable))
        entry = _Exposed(h, arr, tensor)
        try:
            for tname, transport in (transports or {}).items():
                if h.nbytes and transport.capabilities.one_sided and isinstance(transport, OneSidedTransport):
                    entry.holds[tname] = transport.register_region(
                        arr.ctypes.data, h.nbytes, writable=h.writable, owner=arr
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

    def clear(self) -> None:
        entries = list(self._by_name.values())
        self._by_name.clear()
        for entry in entries:
            entry.release()


class Revocation:
    """What ``node.unexpose`` returns. Awaiting it is optional: it completes once every peer
    that held a one-sided key acknowledged the revocation (or went away) and the memory was
    unregistered; from then on no direct read or write of any peer reaches the tensor."""

    __slots__ = ("_task",)

    def __init__(self, task: asyncio.Task[None] | None) -> None:
        self._task = task

    def done(self) -> bool:
        return self._task is None or self._task.done()

    def __await__(self) -> Generator[Any, None, None]:
        if self._task is not None:
            yield from asyncio.shield(self._task).__await__()


async def retire(entry: _Exposed, session_peer: Callable[[str], Peer | None]) -> None:
    """Revoke an unexposed tensor's direct handles, then unregister it (module docstring)."""
    try:
        peers = [p for p in map(session_peer, sorted(entry.given)) if p is not None and not p.closed]
        await asyncio.gather(*[_revoke(p, entry.handle) for p in peers], return_exceptions=True)
    finally:
        entry.release()


async def _revoke(peer: Peer, h: Handle) -> None:
    reply, _ = _tags()
    try:
        await peer.send({"op": "revoke", "name": h.name, "generation": h.generation, "reply": reply}, tag=_OPS_TAG)
        await peer.recv(tag=reply)  # until the peer acknowledges or its channel closes
    except TensorWireError:
        return


# -- the owner's side ---------------------------------------------------------------------------
async def serve_ops(peer: Peer, table: ExposureTable) -> None:
    """Answer a peer's owner-assisted reads and writes until the channel closes."""
    running: set[asyncio.Task[None]] = set()
    try:
        while True:
            try:
                req = await peer.recv(tag=_OPS_TAG)
            except TensorWireError:
                return
            if not isinstance(req, dict) or not isinstance(req.get("reply"), int):
                log.warning("malformed one-sided request from %s dropped", peer.remote_address)
                continue
            if req.get("op") == "revoke":
                # mark it now, before any task sees a later message from the owner
                name, gen = req.get("name"), req.get("generation")
                if not isinstance(name, str) or not isinstance(gen, int):
                    continue
                _mark_revoked(peer, name, gen)
                task = asyncio.get_running_loop().create_task(_acknowledge(peer, name, gen, req["reply"]))
                running.add(task)
                task.add_done_callback(running.discard)
                continue
            task = asyncio.get_running_loop().create_task(_serve_one(peer, table, req))
            running.add(task)
            task.add_done_callback(running.discard)
    finally:
        for t in running:
            t.cancel()


async def _serve_one(peer: Peer, table: ExposureTable, req: dict[str, Any]) -> None:
    reply: int = req["reply"]
    op, name, gen = req.get("op"), req.get("name"), req.get("generation")
    table.served += 1
    entry = table.get(name) if isinstance(name, str) else None
    error = None
    if entry is None:
        error = f"{name!r} is not exposed (revoked or never exposed)"
    elif gen != entry.handle.generation:
        error = f"{name!r} was exposed again since it was looked up; look it up anew"
    try:
        if op == "read":
            if error is not None or entry is None:
                await peer.send({"error": error}, tag=reply)
            else:
                await peer.send(entry.array, tag=reply)
        elif op == "write":
            data_tag = req.get("data")
            if not isinstance(data_tag, int):
                return
            if error is None and entry is not None and not entry.handle.writable:
                error = f"{name!r} is exposed read-only"
            if error is None and entry is not None:
                try:
                    await peer.recv(tag=data_tag, out=entry.array)
                except ShapeMismatchError as exc:
                    error = str(exc)
            if error is not None:
                await peer.recv(tag=data_tag)  # drain what the writer sent, so nothing lingers
            await peer.send({"error": error} if error else {"ok": True}, tag=reply)
    except TensorWireError:
        return  # the channel went away: the requester sees that itself


# -- the requester's side -----------------------------------------------------------------------
_op_ids = itertools.count(1)


class _Direct:
    """A peer's registered tensor as this side reaches it: the key, unpacked once."""

    __slots__ = ("blob", "idle", "inflight", "revoked", "rkey")

    def __init__(self, blob: RemoteKeyBlob | None) -> None:
        self.blob = blob
        self.rkey: Any = None
        self.inflight = 0
        self.revoked = blob is None
        self.idle: asyncio.Event | None = None

    def close(self) -> None:
        if self.rkey is not None:
            rkey, self.rkey = self.rkey, None
            rkey.close()


# (peer -> (name, generation) -> state); dies with the peer
_directs: weakref.WeakKeyDictionary[Peer, dict[tuple[str, int], _Direct]] = weakref.WeakKeyDictionary()


def _states(peer: Peer) -> dict[tuple[str, int], _Direct]:
    states = _directs.get(peer)
    if states is None:
        states = _directs[peer] = {}
    return states


def remember(peer: Peer, handle: RemoteHandle) -> None:
    """A lookup on ``peer`` returned a direct handle: keep its key for reads and writes."""
    key = (handle.name, handle.generation)
    states = _states(peer)
    if key in states:
        return  # the same generation again (or revoked already): the key is the same
    if not isinstance(peer.channel, OneSidedChannel) or peer.channel.transport != handle.transport:
        raise TransferError(f"lookup of {handle.name!r} returned a {handle.transport} key this peer cannot use")
    blob = unpack_remote_key(handle.remote_key)
    if blob.transport != handle.transport or blob.length < handle.nbytes:
        raise TransferError(f"lookup of {handle.name!r} returned a key that does not cover the tensor")
    states[key] = _Direct(blob)


def _mark_revoked(peer: Peer, name: str, generation: int) -> None:
    states = _states(peer)
    state = states.get((name, generation))
    if state is None:
        states[(name, generation)] = _Direct(None)  # revoked before the lookup returned
    else:
        state.revoked = True


async def _acknowledge(peer: Peer, name: str, generation: int, reply: int) -> None:
    """Once the revoked handle's running operations finished, tell the owner."""
    state = _states(peer)[(name, generation)]
    if state.inflight:
        state.idle = asyncio.Event()
        await state.idle.wait()
    state.close()
    try:
        await peer.send({"ok": True}, tag=reply)
    except TensorWireError:
        return


def _direct_state(peer: Peer, handle: RemoteHandle) -> _Direct | None:
    """The direct route for ``handle`` on ``peer``, or None for the owner-assisted one."""
    if handle.owner != peer.remote_node:
        raise ConfigurationError(
            f"{handle.name!r} belongs to node {handle.owner[:12]}, not to this peer ({peer.remote_node[:12]})"
        )
    if not handle.direct:
        return None
    state = _states(peer).get((handle.name, handle.generation))
    if state is None:
        raise ConfigurationError(f"{handle.name!r} was not looked up on this peer; call peer.lookup first")
    if state.revoked:
        raise HandleNotFound(
            f"{handle.name!r} (generation {handle.generation}) was revoked by its owner "
            "(unexposed or exposed again); look it up anew"
        )
    if handle.transport != peer.channel.transport:
        raise ConfigurationError(
            f"{handle.name!r} has a {handle.transport} key, but this peer uses {peer.path.transport}"
        )
    return state


async def _move(peer: Peer, state: _Direct, op: str, arr: np.ndarray) -> None:
    channel: Any = peer.channel  # a OneSidedChannel: _direct_state checked
    assert state.blob is not None
    if state.rkey is None:
        state.rkey = channel.remote_key(state.blob.key)
    state.inflight += 1
    try:
        rma = getattr(channel, "rma", None)
        if rma is not None:  # the transport's fast path: raw pointer, no buffer re-wrapping
            await rma(op, arr.__array_interface__["data"][0], arr.nbytes, state.blob.address, state.rkey, arr)
        elif op == "get":
            await channel.get(state.blob.address, state.rkey, arr)
        else:
            await channel.put(arr, state.blob.address, state.rkey)
    finally:
        state.inflight -= 1
        if not state.inflight and state.idle is not None:
            state.idle.set()


def _direct_receipt(peer: Peer, nbytes: int, t0: float, packed: bool) -> Receipt:
    ch = peer.channel
    return Receipt(
        transport=ch.transport,
        lanes=ch.lanes,
        nbytes=nbytes,
        seconds=time.perf_counter() - t0,
        protocol="one-sided",
        direct=not packed,
        staged=False,
        packed=packed,
    )


def _tags() -> tuple[int, int]:
    n = next(_op_ids) * 2
    return _REPLY_BASE + n, _REPLY_BASE + n + 1


def _check_against(handle: RemoteHandle, arr: np.ndarray, what: str) -> None:
    if arr.dtype != dtype_from_name(handle.dtype) or tuple(arr.shape) != handle.shape:
        raise ShapeMismatchError(
            f"{what} is {arr.dtype}{list(arr.shape)} but {handle.name!r} is {handle.dtype}{list(handle.shape)}"
        )


def _drain_later(peer: Peer, tag: int) -> None:
    """A cancelled operation's answer still arrives: receive and drop it so nothing lingers."""

    async def drain() -> None:
        try:
            async with asyncio.timeout(_DRAIN_SECONDS):
                await peer.recv(tag=tag)
        except (TensorWireError, TimeoutError):
            pass

    peer._spawn(drain())


async def read(
    peer: Peer, handle: RemoteHandle, out: Any = None, *, want_receipt: bool = True
) -> tuple[Any, Receipt | None]:
    """Read the whole tensor into ``out``; the receipt (None unless ``want_receipt``) says how."""
    t0 = time.perf_counter()
    if out is None:
        out = np.empty(handle.shape, dtype_from_name(handle.dtype))
    target = out if type(out) is np.ndarray else as_view(out).array
    _check_against(handle, target, "out=")
    state = _direct_state(peer, handle)
    if state is not None:
        if not target.flags.writeable:
            raise ShapeMismatchError("out= buffer is read-only")
        packed = not target.flags.c_contiguous
        dest = np.empty(target.shape, target.dtype) if packed else target
        await _move(peer, state, "get", dest)
        if packed:
            target[...] = dest
        return out, _direct_receipt(peer, dest.nbytes, t0, packed) if want_receipt else None
    reply, _ = _tags()
    await peer.send({"op": "read", "name": handle.name, "generation": handle.generation, "reply": reply}, tag=_OPS_TAG)
    try:
        try:
            _, receipt = await peer.recv_with_receipt(tag=reply, out=out)
        except ShapeMismatchError:
            answer = await peer.recv(tag=reply)  # not the tensor: the owner's error
            if isinstance(answer, dict) and answer.get("error"):
                raise HandleNotFound(f"read of {handle.name!r}: {answer['error']}") from None
            raise TransferError(f"read of {handle.name!r}: unexpected answer from the owner") from None
    except asyncio.CancelledError:
        _drain_later(peer, reply)
        raise
    return out, replace(receipt, protocol="owner-assisted", seconds=time.perf_counter() - t0)


async def write(peer: Peer, handle: RemoteHandle, src: Any) -> Receipt:
    t0 = time.perf_counter()
    arr = src if type(src) is np.ndarray else as_view(src).array
    _check_against(handle, arr, "the source")
    state = _direct_state(peer, handle)
    if state is not None:
        if not handle.writable:
            raise HandleNotFound(f"write of {handle.name!r}: {handle.name!r} is exposed read-only")
        packed = not arr.flags.c_contiguous
        data_arr = np.ascontiguousarray(arr)
        await _move(peer, state, "put", data_arr)
        return _direct_receipt(peer, data_arr.nbytes, t0, packed)
    reply, data = _tags()
    req = {"op": "write", "name": handle.name, "generation": handle.generation, "reply": reply, "data": data}
    await peer.send(req, tag=_OPS_TAG)
    try:
        receipt = await peer.send(src, tag=data)
    except asyncio.CancelledError:
        peer._spawn(_cancel_write(peer, data, reply))
        raise
    try:
        answer = await peer.recv(tag=reply)
    except asyncio.CancelledError:
        _drain_later(peer, reply)
        raise
    if not isinstance(answer, dict) or answer.get("error"):
        error = answer.get("error") if isinstance(answer, dict) else "unexpected answer"
        raise HandleNotFound(f"write of {handle.name!r}: {error}")
    return replace(receipt, protocol="owner-assisted", seconds=time.perf_counter() - t0)


async def _cancel_write(peer: Peer, data: int, reply: int) -> None:
    """Tell the owner the payload will not come (a tensorless message it cannot take as one)."""
    try:
        await peer.send(None, tag=data)
        async with asyncio.timeout(_DRAIN_SECONDS):
            await peer.recv(tag=reply)
    except (TensorWireError, TimeoutError, ClosedResourceError):
        pass
