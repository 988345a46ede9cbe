"""A message header's specs and framing, as protobuf writes a MessageHeader (``wire.proto``):
each tensor's spec an item of field 1, the tree (``_tree``) field 2.

At the sender a spec is written once per description (dtype, shape, strides, framework,
device) and kept; at the receiver each spec's bytes are checked once and kept as a Spec, so a
message of thousands of tensors of a few shapes costs a lookup a tensor at either end. A header
written as we write them is cut into its specs and tree here; any other encoding protobuf reads
(fields reordered, repeated, unknown) is read by protobuf whole.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..control._pb import wire_pb2
from ..errors import ProtocolError, UnsupportedTensorError
from ._device import DeviceTensor
from ._dtypes import DTYPES, dtype_name
from ._tree import Plan, plan, varint
from ._view import _MAX_SHAPE_BYTES, MAX_NDIM, TensorView, empty, impossible_shape, unsendable

__all__ = [
    "Spec",
    "SpecEntry",
    "c_strides",
    "decode_header",
    "decode_header_sized",
    "device_spec",
    "header_bytes",
    "host_spec",
    "host_specs",
    "impossible_shape",
    "plan_of",
    "spec_item",
]

_CACHE_LIMIT = 1024

_CUDA_DEVICE = re.compile(r"cuda(:[0-9]{1,6})?")
MAX_HEADER_BYTES = 2**31 - 1  # protobuf's limit on an encoded message: no receiver could parse more


@dataclass(frozen=True, slots=True)
class Spec:
    """One tensor of a message, as its header describes it (one object for every tensor of the
    same description: immutable)."""

    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    framework: str = "numpy"
    device: str = "cpu"

    def allocate(self) -> np.ndarray:
        """A new host array for the tensor this spec describes."""
        try:
            return np.empty(self.shape, DTYPES[self.dtype])
        except MemoryError:
            return empty(self.dtype, self.shape)  # (which says so as a TransferError)


def c_strides(shape: tuple[int, ...]) -> list[int]:
    out = []
    acc = 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return list(reversed(out))


# A tensor's spec, once per description: the Spec and its item in a header (framed as
# MessageHeader.tensors). Host wire arrays are found by (numpy dtype, shape, byte strides,
# framework), which decide every field; numpy dtypes are equal only where native and alike.
SpecEntry = tuple[Spec, bytes]
_SPEC_LIMIT = 1 << 13
host_specs: dict[tuple[np.dtype, tuple[int, ...], tuple[int, ...], str], SpecEntry] = {}


def host_spec(wire: np.ndarray, framework: str) -> SpecEntry:
    """The spec of a C-contiguous host wire array (of a dtype ``as_view`` accepted)."""
    key = (wire.dtype, wire.shape, wire.strides, framework)
    hit = host_specs.get(key)
    if hit is None:
        name = dtype_name(wire.dtype)
        shape = tuple(wire.shape)
        nbytes = int(wire.nbytes)
        if not nbytes and impossible_shape(shape, wire.itemsize):  # (empty: no bytes bound its shape)
            raise unsendable(name, shape)
        spec = Spec(name, shape, nbytes, framework, "cpu")
        strides = [st // wire.itemsize for st in wire.strides]
        hit = (spec, _framed_spec(spec, strides))
        if len(host_specs) >= _SPEC_LIMIT:
            host_specs.clear()
        host_specs[key] = hit
    return hit


def device_spec(view: TensorView, wire: DeviceTensor) -> SpecEntry:
    device = "cuda" if wire.engine.kind == "cuda" else "cpu"
    nbytes = int(wire.nbytes)
    if not nbytes and impossible_shape(view.shape, DTYPES[view.dtype].itemsize):
        raise unsendable(view.dtype, view.shape)
    spec = Spec(view.dtype, view.shape, nbytes, view.framework, device)
    return spec, _framed_spec(spec, c_strides(wire.shape))


def _framed_spec(s: Spec, strides: list[int]) -> bytes:
    """``s`` as an item of MessageHeader.tensors, written as protobuf writes a TensorSpec: its
    fields in number order, the repeated ones packed, empty ones left out (proto3), an int64
    as the varint of its 64-bit two's complement."""
    body = b"".join(
        (
            _texts(s.dtype, s.device, s.framework)[0],
            _packed(b"\x12", s.shape) if s.shape else b"",
            _packed(b"\x1a", strides) if strides else b"",
            _texts(s.dtype, s.device, s.framework)[1],
            b"\x30" + varint(s.nbytes) if s.nbytes else b"",
        )
    )
    return b"\x0a" + varint(len(body)) + body


@functools.lru_cache(maxsize=256)
def _texts(dtype: str, device: str, framework: str) -> tuple[bytes, bytes]:
    """A spec's string fields, written: its dtype (field 1), and its device and framework (4, 5)."""
    return _text(b"\x0a", dtype), _text(b"\x22", device) + _text(b"\x2a", framework)


def _text(tag: bytes, text: str) -> bytes:
    data = text.encode()
    return tag + varint(len(data)) + data if data else b""


def _packed(tag: bytes, values: Sequence[int]) -> bytes:
    if max(values) < 0x80 and min(values) >= 0:  # (each its own one-byte varint)
        data = bytes(values)
    elif min(values) >= 0:
        data = b"".join([varint(v) for v in values])
    else:
        data = b"".join([varint(v & _UINT64) for v in values])
    return tag + varint(len(data)) + data


_UINT64 = 2**64 - 1


def spec_item(s: Spec, a: np.ndarray | DeviceTensor) -> bytes:
    """A spec's item in a header, for a message made without them (rpc's cached trees)."""
    if isinstance(a, DeviceTensor):
        strides = c_strides(a.shape)
    else:
        strides = [st // a.itemsize for st in a.strides] if a.itemsize else []
    return _framed_spec(s, strides)


def decode_header(
    data: bytes | bytearray | memoryview, *, max_message_bytes: int
) -> tuple[wire_pb2.TreeNode, list[Spec]]:
    """Parse and validate a received header. Raises ProtocolError for anything inconsistent.

    Validated results are cached by the header's bytes, so a stream of same-shaped messages is
    parsed once.
    """
    tree, specs, _ = decode_header_sized(data, max_message_bytes=max_message_bytes)
    return tree, specs


# Headers decoded, by their bytes, up to _DECODED_BYTES of them in all; the plans of their trees
# (by the tree's id: a recv rebuilds from the tree the header gave), dropped with them.
_DECODED_BYTES = 4 << 20
_decode_cache: dict[bytes, tuple[wire_pb2.TreeNode, list[Spec], int]] = {}
_decoded_held = 0
_plans: dict[int, tuple[wire_pb2.TreeNode, Plan]] = {}
# A received spec's bytes -> its Spec, checked (a spec is its own bytes wherever it is). Only
# specs of at most _KEPT_SPEC_BYTES are kept: every spec we write is shorter (64 dimensions of
# 10-byte shapes and strides, and short names), while a peer may name any framework, a new long
# one in each message, which kept 8,192 of them would hold gigabytes.
_KEPT_SPEC_BYTES = 2048
_received_specs: dict[bytes, Spec] = {}


def decode_header_sized(
    data: bytes | bytearray | memoryview, *, max_message_bytes: int
) -> tuple[wire_pb2.TreeNode, list[Spec], int]:
    """``decode_header``, and the payload's total size (the sum of the specs' ``nbytes``)."""
    global _decoded_held
    key = data if type(data) is bytes else bytes(data)
    hit = _decode_cache.get(key)
    if hit is not None and hit[2] <= max_message_bytes:
        return hit
    tree, specs, total, p = _decode_header(key, max_message_bytes)
    result = (tree, specs, total)
    if len(key) <= _DECODED_BYTES // 4:
        if len(_decode_cache) >= _CACHE_LIMIT or _decoded_held + len(key) > _DECODED_BYTES:
            _decode_cache.clear()
            _plans.clear()
            _decoded_held = 0
        _decode_cache[key] = result
        _plans[id(tree)] = (tree, p)
        _decoded_held += len(key)
    return result


def _decode_header(data: bytes, max_message_bytes: int) -> tuple[wire_pb2.TreeNode, list[Spec], int, Plan]:
    parts = _split(data)
    known = _received_specs
    try:
        if parts is None:  # (not as we write headers: protobuf reads it whole)
            msg = wire_pb2.MessageHeader.FromString(data)
            tree = msg.tree
            found: list[Spec | wire_pb2.TensorSpec] = list(msg.tensors)
        else:
            raw, tree_bytes = parts
            tree = wire_pb2.TreeNode.FromString(tree_bytes)
            parsed: dict[bytes, wire_pb2.TensorSpec] = {}  # (the specs new here, each parsed once)
            found = [known.get(t) or parsed.get(t) or parsed.setdefault(t, _parse_spec(t)) for t in raw]
    except Exception as exc:  # protobuf raises DecodeError and friends
        raise ProtocolError(f"undecodable message header ({len(data)} bytes)") from exc
    specs: list[Spec] = []
    total = 0
    for i, t in enumerate(found):
        if type(t) is Spec:
            spec = t
        elif parts is None:
            spec = _received_spec(t)  # type: ignore[arg-type]  # (a TensorSpec)
        else:  # checked once per description, like a header's specs are kept once
            item = parts[0][i]
            spec = known.get(item) or _received_spec(t)  # type: ignore[arg-type]
            if len(item) <= _KEPT_SPEC_BYTES:  # (a longer one, a peer's long name, is never kept)
                if len(known) >= _SPEC_LIMIT:
                    known.clear()
                known[item] = spec
        total += spec.nbytes
        if total > max_message_bytes:
            raise ProtocolError(f"message claims more than the {max_message_bytes}-byte limit")
        specs.append(spec)
    return tree, specs, total, plan(tree, len(specs))


def _parse_spec(data: bytes) -> wire_pb2.TensorSpec:
    spec: wire_pb2.TensorSpec = wire_pb2.TensorSpec.FromString(data)
    return spec


def _split(data: bytes) -> tuple[list[bytes], bytes] | None:
    """A header as we write it, cut into its specs' bytes and its tree's bytes: each spec's
    item (field 1), then the tree's (field 2), ending the header. None for anything else that
    protobuf may read (fields in another order, repeated, unknown; or malformed)."""
    specs = []
    pos, end = 0, len(data)
    while pos < end and data[pos] == 0x0A:
        if pos + 1 < end and data[pos + 1] < 0x80:  # (a spec below 128 bytes: most)
            pos, stop = pos + 2, pos + 2 + data[pos + 1]
        else:
            pos, stop = _length(data, pos + 1)
        if stop > end:
            return None
        specs.append(data[pos:stop])
        pos = stop
    if pos >= end or data[pos] != 0x12:
        return None
    pos, stop = _length(data, pos + 1)
    if stop != end:
        return None
    return specs, data[pos:stop]


def _length(data: bytes, pos: int) -> tuple[int, int]:
    """The start and end of a length-delimited field whose length (a varint) is at ``pos``;
    an end past the data for a length that is not there."""
    n = shift = 0
    for i in range(pos, min(pos + 5, len(data))):
        b = data[i]
        n |= (b & 0x7F) << shift
        if b < 0x80:
            return i + 1, i + 1 + n
        shift += 7
    return pos, len(data) + 1


def _received_spec(t: wire_pb2.TensorSpec) -> Spec:
    """A received TensorSpec checked: a dtype we know, a shape we could allocate, its byte
    count that shape's, a device this build receives on."""
    dt = DTYPES.get(t.dtype)
    if dt is None:
        raise ProtocolError(f"header names unknown dtype {t.dtype[:32]!r}")
    if len(t.shape) > MAX_NDIM:
        raise ProtocolError(f"header claims {len(t.shape)} dimensions (limit {MAX_NDIM})")
    shape = tuple(t.shape)
    if shape and min(shape) < 0:
        raise ProtocolError(f"header claims a negative dimension in shape {shape}")
    n = math.prod(shape) * dt.itemsize
    if n >= _MAX_SHAPE_BYTES or (not n and impossible_shape(shape, dt.itemsize)):  # (no empty dimension: n says)
        raise ProtocolError(f"header claims an impossible shape {list(shape)[:8]}")
    if n != t.nbytes:
        raise ProtocolError(f"header claims {t.nbytes} bytes for {t.dtype}{list(shape)} ({n} bytes)")
    if t.device in ("", "cpu"):
        device = "cpu"
    elif _CUDA_DEVICE.fullmatch(t.device):
        device = "cuda"
    else:
        raise ProtocolError(f"header claims device {t.device[:32]!r}, which this build cannot receive")
    return Spec(t.dtype, shape, n, t.framework or "numpy", device)


def header_bytes(items: list[bytes], tree: bytes) -> bytes:
    """A MessageHeader of the specs' ``items`` (each framed, ``host_spec``) and an encoded tree."""
    header = b"".join(items) + b"\x12" + varint(len(tree)) + tree
    if len(header) > MAX_HEADER_BYTES:
        raise UnsupportedTensorError(
            f"message header cannot be encoded: {len(header)} bytes, more than protobuf's {MAX_HEADER_BYTES}"
        )
    return header


def plan_of(tree: wire_pb2.TreeNode) -> Plan | None:
    """The plan of a tree that a decoded header gave (while that header is kept), else None."""
    known = _plans.get(id(tree))
    return known[1] if known is not None and known[0] is tree else None
