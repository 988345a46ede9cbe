"""One-sided access as a transport offers it: the remote-key blob, the registration cache, and
the two small protocols a transport with ``Capabilities.one_sided`` implements.

The control plane carries a peer's key in ``LookupResponse.remote_key`` without parsing it. Its
layout is tensorwire's (so that every one-sided transport, ucx and verbs, can put its own key
there) and versioned::

    "TWRK" | version u8 (=1) | name_len u8 | transport name (ascii) | address u64 | length u64 | key

little-endian; ``key`` (the rest) is the transport's own: a packed UCX rkey, or a verbs rkey.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from ..errors import ProtocolError

__all__ = [
    "OneSidedChannel",
    "OneSidedTransport",
    "Registration",
    "RegistrationCache",
    "RemoteKeyBlob",
    "pack_remote_key",
    "unpack_remote_key",
]

_MAGIC = b"TWRK"
_VERSION = 1
_HEAD = struct.Struct("<4sBB")
_SPAN = struct.Struct("<QQ")


@dataclass(frozen=True, slots=True)
class RemoteKeyBlob:
    """A peer's registered region as a one-sided transport reaches it."""

    transport: str
    address: int
    length: int
    key: bytes


def pack_remote_key(transport: str, address: int, length: int, key: bytes) -> bytes:
    name = transport.encode("ascii")
    if not 0 < len(name) < 256:
        raise ValueError(f"transport name {transport!r} does not fit a remote-key blob")
    return _HEAD.pack(_MAGIC, _VERSION, len(name)) + name + _SPAN.pack(address, length) + key


def unpack_remote_key(blob: bytes) -> RemoteKeyBlob:
    """Parse a blob from ``pack_remote_key``; ProtocolError if it is not one (or a newer one)."""
    if len(blob) < _HEAD.size:
        raise ProtocolError("remote key blob is too short")
    magic, version, n = _HEAD.unpack_from(blob, 0)
    if magic != _MAGIC:
        raise ProtocolError("not a tensorwire remote key blob")
    if version != _VERSION:
        raise ProtocolError(f"remote key blob version {version}; this tensorwire reads version {_VERSION}")
    end = _HEAD.size + n
    if len(blob) < end + _SPAN.size:
        raise ProtocolError("remote key blob is truncated")
    address, length = _SPAN.unpack_from(blob, end)
    return RemoteKeyBlob(blob[_HEAD.size : end].decode("ascii", "replace"), address, length, blob[end + _SPAN.size :])


@dataclass(eq=False)
class Registration:
    """One registered region, shared by every holder of the same one (see the cache).

    ``key`` is the transport's own key (a packed UCX rkey); ``remote_key`` the blob a peer
    gets through Lookup (``pack_remote_key``). Each ``RegistrationCache.acquire`` returns a
    ``Hold``; releasing the last one unregisters the memory.
    """

    transport: str
    address: int
    length: int
    writable: bool
    key: bytes
    remote_key: bytes
    _unregister: Callable[[], None]
    refs: int = 0
    seconds: float = 0.0  # how long registering took
    owner: Any = None  # keeps the memory alive while registered


@dataclass(eq=False)
class Hold:
    """One holder's reference to a Registration."""

    registration: Registration
    _cache: RegistrationCache
    _released: bool = False

    @property
    def remote_key(self) -> bytes:
        """The blob a peer's Lookup gets; empty where the transport found it could not register
        the memory after all (verbs registers fresh memory after ``expose`` returned): Lookup
        then hands out no key, and peers read and write the tensor through its owner."""
        return self.registration.remote_key

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._cache._release(self.registration)


@dataclass
class RegistrationCache:
    """Registered regions keyed by (address, length, writable), reference counted.

    Exposing the same memory twice (under two names, or again after a revocation that has not
    finished) registers it once. ``register(address, length, writable)`` is the transport's own
    call; it returns the transport's key bytes and the function that unregisters.
    """

    transport: str
    register: Callable[[int, int, bool], tuple[bytes, Callable[[], None]]]
    regions: dict[tuple[int, int, bool], Registration] = field(default_factory=dict)
    registrations: int = 0  # calls into the transport's register
    hits: int = 0  # acquisitions served from the cache

    def acquire(self, address: int, length: int, writable: bool, owner: Any = None) -> Hold:
        key = (address, length, writable)
        reg = self.regions.get(key)
        if reg is None:
            t0 = time.perf_counter()
            packed, unregister = self.register(address, length, writable)
            reg = Registration(
                self.transport,
                address,
                length,
                writable,
                packed,
                pack_remote_key(self.transport, address, length, packed),
                unregister,
                seconds=time.perf_counter() - t0,
                owner=owner,
            )
            self.regions[key] = reg
            self.registrations += 1
        else:
            self.hits += 1
        reg.refs += 1
        return Hold(reg, self)

    def _release(self, reg: Registration) -> None:
        reg.refs -= 1
        if reg.refs <= 0 and self.regions.get((reg.address, reg.length, reg.writable)) is reg:
            del self.regions[(reg.address, reg.length, reg.writable)]
            reg.owner = None
            reg._unregister()

    def clear(self) -> None:
        """Unregister everything (the transport is closing)."""
        regions, self.regions = self.regions, {}
        first: Exception | None = None
        for reg in regions.values():
            reg.owner = None
            try:
                reg._unregister()
            except Exception as exc:  # unregister the rest; report the first failure
                first = first or exc
        if first is not None:
            raise first


@runtime_checkable
class OneSidedTransport(Protocol):
    """A transport whose Capabilities say ``one_sided``: it registers memory for peers."""

    name: str
    region_kinds: frozenset[str]  # the memory kinds register_region takes ("host", "cuda")

    def register_region(self, address: int, length: int, *, writable: bool, owner: Any = None) -> Hold:
        """Register ``[address, address + length)`` (through the cache) for peers to reach."""
        ...


@runtime_checkable
class OneSidedChannel(Protocol):
    """A channel that reads and writes a peer's registered memory without the peer's CPU."""

    def remote_key(self, packed: bytes) -> Any:
        """Unpack the transport's own key (``RemoteKeyBlob.key``) for this channel; the result
        has an idempotent ``close()``."""
        ...

    async def get(self, remote_addr: int, rkey: Any, dest: Any) -> None:
        """Read ``len(dest)`` bytes at ``remote_addr`` into ``dest``."""
        ...

    async def put(self, src: Any, remote_addr: int, rkey: Any) -> None:
        """Write ``src`` at ``remote_addr``; returns once the bytes are in the peer's memory."""
        ...

    async def rma_many(
        self, op: str, items: list[tuple[int, int, int, Any, object]]
    ) -> tuple[str, tuple[str, ...]] | None:
        """Gets (``op="get"``) or puts of ``(local pointer, n, remote_addr, rkey, keep)``, all
        posted at once; returns once every one has completed, and so does a failure or a
        cancellation (what was posted cannot be taken back) unless the channel is closing.
        Returns how the transport below says it moved them (``Receipt.route``, and the lanes
        that took them) where it said so for all of them, else None.
        ``keep``: the object that holds the local bytes (for a host-memory transport, a numpy
        array containing them, which it registers); device memory where ``rma_device``."""
        ...
