"""One-sided access to exposed tensors: ``node.expose`` / ``peer.lookup`` / ``peer.read`` / ``peer.write``.

An owner exposes a C-contiguous tensor under a name; a session peer resolves the name over the
control plane into a RemoteHandle (dtype, shape, generation, and for one-sided transports the
registered address and key) and then reads or writes the whole tensor.

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
from dataclasses import dataclass, replace
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
from .transports import Receipt

if TYPE_CHECKING:
    from ._peer import Peer

log = logging.getLogger(__name__)

__all__ = ["ExposureTable", "Handle", "RemoteHandle", "read", "serve_ops", "write"]

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
    remote_key: bytes = b""


@dataclass(slots=True)
class _Exposed:
    handle: Handle
    array: np.ndarray
    source: Any  # the caller's object, kept alive while exposed


class ExposureTable:
    """The tensors one node exposes, by name."""

    def __init__(self) -> None:
        self._by_name: dict[str, _Exposed] = {}
        self._generation = itertools.count(1)

    def expose(self, tensor: Any, name: str) -> Handle:
        if not isinstance(name, str) or not name or len(name) > 256:
            raise ConfigurationError("a handle name is a non-empty string of at most 256 characters")
        if name in self._by_name:
            raise ConfigurationError(f"{name!r} is already exposed; unexpose it first")
        view = as_view(tensor)
        arr = view.array
        if not arr.flags.c_contiguous:
            raise ShapeMismatchError(f"exposed tensors must be C-contiguous ({name!r} is not)")
        h = Handle(name, view.dtype, view.shape, view.nbytes, next(self._generation), bool(arr.flags.writeable))
        self._by_name[name] = _Exposed(h, arr, tensor)
        return h

    def unexpose(self, name: str) -> None:
        if self._by_name.pop(name, None) is None:
            raise HandleNotFound(f"{name!r} is not exposed")

    def get(self, name: str) -> _Exposed | None:
        return self._by_name.get(name)

    def clear(self) -> None:
        self._by_name.clear()


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
            task = asyncio.get_running_loop().create_task(_serve_one(peer, table, req))
            running.add(task)
            task.add_done_callback(running.discard)
    finally:
        for t in running:
            t.cancel()


async def _serve_one(peer: Peer, table: ExposureTable, req: dict[str, Any]) -> None:
    reply: int = req["reply"]
    op, name, gen = req.get("op"), req.get("name"), req.get("generation")
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


async def read(peer: Peer, handle: RemoteHandle, out: Any = None) -> tuple[Any, Receipt]:
    t0 = time.perf_counter()
    if out is None:
        out = np.empty(handle.shape, dtype_from_name(handle.dtype))
    target = as_view(out).array
    _check_against(handle, target, "out=")
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
    arr = as_view(src).array
    _check_against(handle, arr, "the source")
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
