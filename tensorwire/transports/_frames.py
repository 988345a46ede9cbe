"""The staged-TCP wire format: fixed 48-byte frame headers, checked before anything is trusted.

::

    offset size field
    0      4    magic  b"TWR1"
    4      1    type   (FrameType)
    5      1    flags  (RENDEZVOUS = 1, CHECKSUM = 2: a crc32c trailer follows the payload)
    6      2    check: zero, or with checksums the low 16 bits of the header's crc32c
    8      4    meta_len     bytes of metadata after the header (message header, hello, ...)
    12     8    payload_len  bytes of payload after the metadata
    20     8    msg_id       sender-chosen message id
    28     8    arg          MSG: tag (signed); DATA: payload offset; ABORT/CTS: unused
    36     8    credit       receive-buffer bytes returned to the peer (piggybacked)
    44     4    slots        message slots returned to the peer (piggybacked)

With checksums negotiated (either side asks), every MSG and DATA frame ends with a 4-byte
crc32c (little endian) of its header, metadata and payload; a mismatch breaks the channel with
IntegrityError and the message is never delivered. Every frame after the handshake also carries
a check of its own header (the low 16 bits of the crc32c of the 48 bytes with the check field
zero), verified before its lengths are trusted: a flipped length would otherwise be found only
at the trailer, once as many bytes as it claims had come.

A connection opens with CHALLENGE (server -> client, 32-byte nonce), HELLO (client: session id,
HMAC proof of the session secret over the nonce, its limits) and WELCOME (server: its own proof
and limits). Nothing else is accepted before HELLO is verified.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from ..errors import IntegrityError, MessageRefused, ProtocolError
from ._base import Limits

if TYPE_CHECKING:
    from collections.abc import Callable

    from ._base import TransportContext

__all__ = ["HEADER", "MAGIC", "FrameHeader", "FrameType", "PeerLimits", "proof"]

MAGIC = b"TWR1"
HEADER = struct.Struct("<4sBBHIQQqQI")
assert HEADER.size == 48
RENDEZVOUS = 1
CHECKSUM = 2
TRAILER = struct.Struct("<I")
FLAG_CHECKSUM = 1  # PeerLimits.flags: this side wants crc32c on every payload frame
NONCE_BYTES = 32
MAX_SESSION_ID = 128
LIMITS = struct.Struct("<QIQII")  # recv_buffer_bytes, max_unexpected, max_message_bytes, max_header_bytes, flags


def _first_crc32c(data: Any, value: int = 0, /) -> int:
    """``crc32c.crc32c``, imported on its first call, which then puts it in its own place: the
    package's import reads its installed metadata (importlib.metadata, email, argparse: ~30 ms
    and ~50 modules at a node's first start) that a node without checksums never needs."""
    global crc32c
    from crc32c import crc32c as impl

    crc32c = impl
    return impl(data, value)


crc32c: Callable[..., int] = _first_crc32c  # (data, value=0) -> int: call through the module


class FrameType(enum.IntEnum):
    CHALLENGE = 1
    HELLO = 2
    WELCOME = 3
    MSG = 4
    CTS = 5
    DATA = 6
    ABORT = 7
    CREDIT = 8
    BYE = 9


class FrameHeader(NamedTuple):
    type: FrameType
    flags: int
    meta_len: int
    payload_len: int
    msg_id: int
    arg: int
    credit: int
    slots: int

    def pack(self) -> bytes:
        return pack(*self)


_TYPES = {int(t): t for t in FrameType}


def pack(
    ftype: FrameType,
    flags: int = 0,
    meta_len: int = 0,
    payload_len: int = 0,
    msg_id: int = 0,
    arg: int = 0,
    credit: int = 0,
    slots: int = 0,
    *,
    checked: bool = False,
) -> bytes:
    """A frame header; ``checked`` (a channel with checksums) fills in its header check."""
    raw = HEADER.pack(MAGIC, ftype, flags, 0, meta_len, payload_len, msg_id, arg, credit, slots)
    if not checked:
        return raw
    return raw[:6] + _CHECK.pack(crc32c(raw) & 0xFFFF) + raw[8:]


_CHECK = struct.Struct("<H")
_ZERO_CHECK = bytes(2)


def _header_check(data: bytes | bytearray | memoryview, offset: int) -> int:
    view = memoryview(data)[offset : offset + HEADER.size]
    return crc32c(view[8:], crc32c(_ZERO_CHECK, crc32c(view[:6]))) & 0xFFFF


def unpack(data: bytes | bytearray | memoryview, *, checked: bool = False) -> FrameHeader:
    """Decode the frame header at the start of ``data`` (a receive buffer may hold more);
    ProtocolError on too few bytes, bad magic, unknown type or reserved bits, IntegrityError
    when ``checked`` and its header check does not match."""
    return FrameHeader(*unpack_fields(data, checked=checked))


def unpack_fields(
    data: bytes | bytearray | memoryview, offset: int = 0, *, checked: bool = False
) -> tuple[FrameType, int, int, int, int, int, int, int]:
    """``unpack`` as a plain tuple in FrameHeader's order, of the header at ``offset`` (no
    NamedTuple built: the per-message paths of the transports call this)."""
    try:
        magic, ftype, flags, check, meta_len, payload_len, msg_id, arg, credit, slots = HEADER.unpack_from(data, offset)
    except struct.error as exc:  # (no transport passes fewer bytes)
        raise ProtocolError(f"a frame header is {HEADER.size} bytes: {exc}") from exc
    if checked and check != _header_check(data, offset):
        raise IntegrityError("a frame header does not match its check: the stream was corrupted")
    if magic != MAGIC:
        raise ProtocolError(f"bad frame magic {bytes(magic)!r} (expected {MAGIC!r})")
    t = _TYPES.get(ftype)
    if t is None:
        raise ProtocolError(f"unknown frame type {ftype}")
    if (check and not checked) or flags & ~(RENDEZVOUS | CHECKSUM):
        raise ProtocolError("reserved frame bits set")
    return t, flags, meta_len, payload_len, msg_id, arg, credit, slots


@dataclass(frozen=True, slots=True)
class PeerLimits:
    """What one side of a connection promises to accept, exchanged in HELLO/WELCOME."""

    recv_buffer_bytes: int
    max_unexpected: int
    max_message_bytes: int
    max_header_bytes: int
    flags: int = 0

    def pack(self) -> bytes:
        return LIMITS.pack(
            self.recv_buffer_bytes, self.max_unexpected, self.max_message_bytes, self.max_header_bytes, self.flags
        )

    @classmethod
    def unpack(cls, data: bytes) -> PeerLimits:
        """The limits a peer sent in its handshake; ProtocolError for bytes of another size, or
        limits no channel can keep: no message slot (every send would wait for one forever), a
        header bound below ``Limits.MIN_HEADER_BYTES`` (not even a short error reply would fit),
        or flags this version does not know."""
        try:
            limits = cls(*LIMITS.unpack(data))
        except struct.error as exc:  # (no transport passes another size)
            raise ProtocolError(f"peer limits are {LIMITS.size} bytes, not {len(data)}") from exc
        if limits.max_unexpected < 1:
            raise ProtocolError("peer limits allow no message in flight (max_unexpected 0)")
        if limits.max_header_bytes < Limits.MIN_HEADER_BYTES:
            raise ProtocolError(
                f"peer limits allow message headers of {limits.max_header_bytes} bytes, "
                f"below the {Limits.MIN_HEADER_BYTES}-byte minimum"
            )
        if limits.flags & ~FLAG_CHECKSUM:
            raise ProtocolError(f"peer limits carry unknown flags {limits.flags:#x}")
        return limits

    @classmethod
    def of(cls, ctx: TransportContext) -> PeerLimits:
        """What a node's transport promises its peers: its limits, and whether it checksums."""
        lim = ctx.limits
        flags = FLAG_CHECKSUM if ctx.checksum else 0
        return cls(lim.recv_buffer_bytes, lim.max_unexpected, lim.max_message_bytes, lim.max_header_bytes, flags)

    def check_send(self, nbytes: int, header_len: int, header_max: int | None = None) -> None:
        """Refuse, before any of it is sent, a message this peer would drop the connection for:
        MessageRefused naming the limit; ``header_max`` is a transport's own tighter header bound."""
        if nbytes > self.max_message_bytes:
            raise MessageRefused(
                f"a {nbytes}-byte message exceeds the peer's {self.max_message_bytes}-byte limit "
                "(its Limits.max_message_bytes)"
            )
        if header_max is not None and header_max < self.max_header_bytes:
            limit, name = header_max, "this transport's own header limit"
        else:
            limit, name = self.max_header_bytes, "its Limits.max_header_bytes"
        if header_len > limit:
            raise MessageRefused(
                f"a message header of {header_len} bytes exceeds the peer's {limit}-byte limit ({name})"
            )


def proof(secret: bytes, nonce: bytes, session_id: bytes, role: bytes) -> bytes:
    """HMAC-SHA256 over the connection's nonce: proves the secret without sending it."""
    return hmac.new(secret, b"tensorwire-data-v1|" + role + b"|" + nonce + b"|" + session_id, hashlib.sha256).digest()
