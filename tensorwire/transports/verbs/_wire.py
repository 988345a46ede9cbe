"""The verbs transport's wire format: the offer blob, the bootstrap exchange, and the frames that
travel as SENDs into the peer's ring of receive buffers.

Offer (the Handshake's opaque address blob, one per node)::

    "TWV1" | port u8 | link layer u8 (1 = Ethernet/RoCE, 0 = InfiniBand) | gid index u16 |
    lid u16 | mtu u8 (ibv_mtu) | reserved u8 | gid (16) | bootstrap port u16 | host len u8 | host

Bootstrap (TCP to host:port, per connection; the socket then stays open as the liveness signal:
its end fails pending work at once)::

    server -> client  CHALLENGE "TWVC" | nonce (32)
    client -> server  HELLO     "TWVH" | sid len u16 | qp info | limits | session id | proof (32)
    server -> client  WELCOME   "TWVW" | qp info | limits | proof (32)
    client -> server  READY     "TWVR"  (the client's QP is ready to send)

    qp info = qpn u32 | psn u32 | gid index u16 | lid u16 | mtu u8 | port u8 | ring slots u16 |
              slot bytes u32 | gid (16)

The per-connection queue pair number and packet sequence number cannot live in the node-wide
offer (RC queue pairs are per peer), so they travel in the bootstrap, proven by the session
secret; the port, GID and MTU are in the offer so that ``accepts()`` can tell at negotiation
time whether the peer is reachable from this port at all.

Frames (one SEND each, at most one ring slot)::

    type u8 | flags u8 | nseg u16 | meta_len u32 | msg_id u64 | arg i64 | payload_len u64 |
    credit u64 | slots u32 | processed u32 | body

``credit``/``slots`` return the mailbox's buffer credit and message slots (``_credit.py``);
``processed`` is the count (mod 2**32) of frames the sender of this frame has taken out of its
receive ring, i.e. ring slots it has posted again, so the peer knows how many it may fill.
A MSG's body is the message header (``meta_len`` bytes) followed by the payload (INLINE) or by
``nseg`` segment descriptors (address u64, length u64, rkey u32, 0 u32) that the receiver reads
with RDMA READ, then acknowledges with FIN. A body too long for one slot goes ahead in FRAG
frames (same msg_id), the MSG frame carrying the last piece.
"""

from __future__ import annotations

import enum
import ipaddress
import struct
from dataclasses import dataclass

from ...errors import ConfigurationError, ProtocolError

__all__ = [
    "FRAME",
    "OFFER_MAGIC",
    "QP_INFO",
    "SEG",
    "Flag",
    "Kind",
    "Offer",
    "QpInfo",
]

OFFER_MAGIC = b"TWV1"
_OFFER = struct.Struct("<4sBBHHBx16sHB")
QP_INFO = struct.Struct("<IIHHBBHI16s")
FRAME = struct.Struct("<BBHIQqQQII")
SEG = struct.Struct("<QQII")
assert FRAME.size == 48


class Kind(enum.IntEnum):
    MSG = 1
    FRAG = 2
    FIN = 3
    ABORT = 4
    CREDIT = 5
    BYE = 6


class Flag(enum.IntFlag):
    RENDEZVOUS = 1  # beyond the credit: the payload waits for the recv
    INLINE = 2  # the payload follows the header in the body
    DROPPED = 4  # FIN: the receiver dropped the message (the sender aborted it)
    FAILED = 8  # FIN: the receiver could not read the payload


_KINDS = {int(k): k for k in Kind}
_FLAGS = int(Flag.RENDEZVOUS | Flag.INLINE | Flag.DROPPED | Flag.FAILED)


@dataclass(frozen=True, slots=True)
class Offer:
    port: int
    roce: bool
    gid_index: int
    lid: int
    mtu: int
    gid: bytes
    host: str
    bootstrap_port: int

    def pack(self) -> bytes:
        host = _host_bytes(self.host)
        return (
            _OFFER.pack(
                OFFER_MAGIC,
                self.port,
                int(self.roce),
                self.gid_index,
                self.lid,
                self.mtu,
                self.gid,
                self.bootstrap_port,
                len(host),
            )
            + host
        )

    @classmethod
    def unpack(cls, blob: bytes) -> Offer:
        if len(blob) < _OFFER.size or not blob.startswith(OFFER_MAGIC):
            raise ProtocolError(f"address blob is not a tensorwire verbs v1 address ({blob[:8]!r}...)")
        _, port, roce, gid_index, lid, mtu, gid, bport, hlen = _OFFER.unpack_from(blob, 0)
        raw = blob[_OFFER.size : _OFFER.size + hlen]
        if len(raw) != hlen or not bport:
            raise ProtocolError("verbs address blob is truncated")
        if not raw.isascii() or b"\0" in raw:  # (pack sends names as IDNA: no peer of ours sends these)
            raise ProtocolError(f"verbs address blob's host is not an ASCII host name ({raw[:32]!r})")
        host = raw.decode("ascii")
        try:
            ipaddress.ip_address(host)
        except ValueError:
            if not host or len(host) > 255:
                raise ProtocolError("verbs address blob has no usable host") from None
        return cls(port, bool(roce), gid_index, lid, mtu, gid, host, bport)


def _host_bytes(host: str) -> bytes:
    """The offer's host as it travels: ASCII, an internationalised name in its IDNA form."""
    try:
        raw = host.encode("ascii") if host.isascii() else host.encode("idna")
    except UnicodeError as exc:
        raise ConfigurationError(f"verbs: the host {host!r} cannot be written in an address: {exc}") from exc
    if not raw or len(raw) > 255 or b"\0" in raw:
        raise ConfigurationError(f"verbs: the host {host[:64]!r} cannot be written in an address (1-255 bytes)")
    return raw


@dataclass(frozen=True, slots=True)
class QpInfo:
    qpn: int
    psn: int
    gid_index: int
    lid: int
    mtu: int
    port: int
    slots: int
    slot_bytes: int
    gid: bytes

    def pack(self) -> bytes:
        return QP_INFO.pack(
            self.qpn, self.psn, self.gid_index, self.lid, self.mtu, self.port, self.slots, self.slot_bytes, self.gid
        )

    @classmethod
    def unpack(cls, data: bytes) -> QpInfo:
        info = cls(*QP_INFO.unpack(data))
        if not info.qpn or not 8 <= info.slots <= 4096 or not 4096 <= info.slot_bytes <= 1 << 20:
            raise ProtocolError("malformed verbs queue pair info")
        return info


def kind_of(value: int) -> Kind:
    k = _KINDS.get(value)
    if k is None:
        raise ProtocolError(f"unknown verbs frame type {value}")
    return k


def check_flags(flags: int) -> Flag:
    if flags & ~_FLAGS:
        raise ProtocolError("reserved verbs frame flags set")
    return Flag(flags)
