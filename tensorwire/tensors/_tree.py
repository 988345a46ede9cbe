"""A message's pytree in its header: encoded by hand on the way out, turned into a plan on the
way in.

A dict of a few thousand tensors is one step on the event loop at each end. Built as protobuf
objects (a TreeNode per key and per value, each copied into its parent) it cost several
microseconds a leaf; ``encode`` writes the same bytes protobuf would (``wire.proto``'s
TreeNode, fields in number order, as ``SerializeToString`` writes them) straight from the
pytree. ``plan`` is the receiver's single walk over a parsed tree: it checks everything
``build`` relies on and gives a plain-Python plan of the pytree, which ``build`` fills with
the received tensors (a dict of tensors in one ``dict(zip(...))``).
"""

from __future__ import annotations

import math
import re
import struct
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from ..control._pb import wire_pb2
from ..errors import ProtocolError, UnsupportedTensorError
from ._view import is_tensor

__all__ = ["MAX_BIG_INT_DIGITS", "MAX_DEPTH", "Plan", "build", "encode", "plan", "varint"]

# Each pytree level is two protobuf levels (TreeNode, then Sequence/Mapping), and protobuf's
# decoder stops at 100: 32 levels keeps every message we send decodable on the other side.
MAX_DEPTH = 32
MAX_BIG_INT_DIGITS = 1000
_BIG_INT = re.compile(rf"-?[0-9]{{1,{MAX_BIG_INT_DIGITS}}}")
_BIG_INT_BITS = math.ceil(MAX_BIG_INT_DIGITS * math.log2(10))  # every int of that many digits has no more bits
_SCALAR_KINDS = frozenset({"none", "bool_value", "int_value", "float_value", "str_value", "bytes_value", "big_int"})
_INT64 = 2**63
_SCALARS = (bool, int, float, str, bytes)

# TreeNode's fields as keys (field number << 3 | wire type): varints are type 0, lengths 2,
# doubles 1; a Sequence's items and a Mapping's keys are field 1, a Mapping's values field 2
_TENSOR = b"\x08"
_LIST = b"\x12"
_TUPLE = b"\x1a"
_DICT = b"\x22"
_NONE = b"\x28\x01"
_FALSE = b"\x30\x00"
_TRUE = b"\x30\x01"
_INT = b"\x38"
_FLOAT = b"\x41"
_STR = b"\x4a"
_BYTES = b"\x52"
_BIG = b"\x5a"
_ITEM = b"\x0a"  # Sequence.items, Mapping.keys (and MessageHeader.tensors)
_VALUE = b"\x12"  # Mapping.values (and MessageHeader.tree)
_DOUBLE = struct.Struct("<d").pack

_ONE_BYTE = [bytes((i,)) for i in range(128)]
# a list's and a dict's tensor items, framed, by the tensor's place: made once, as the varints are
_TENSOR_ITEMS = [_ITEM + _ONE_BYTE[2] + _TENSOR + _ONE_BYTE[i] for i in range(128)]
_TENSOR_VALUES = [_VALUE + _ONE_BYTE[2] + _TENSOR + _ONE_BYTE[i] for i in range(128)]

_KEY_CACHE_LIMIT = 1 << 16
# a key longer than this is framed anew each time: a distinct text per send (a prompt as a key)
# would keep every one, and its encoding, until the cache filled; names are far shorter
_KEY_CACHE_CHARS = 256
_key_items: dict[str, bytes] = {}  # a str key's framed node (state-dict keys repeat send after send)


def varint(n: int) -> bytes:
    """Protobuf's base-128 varint of a non-negative integer."""
    if n < 0x80:
        return _ONE_BYTE[n]
    if n < 0x4000:
        return bytes((n & 0x7F | 0x80, n >> 7))
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _framed(tag: bytes, body: bytes) -> bytes:
    n = len(body)
    return tag + (_ONE_BYTE[n] if n < 0x80 else varint(n)) + body


def _tensor_item(i: int) -> bytes:
    return _TENSOR_ITEMS[i] if i < 0x80 else _framed(_ITEM, _TENSOR + varint(i))


Leaf = Callable[[object], int]  # takes a tensor leaf, gives its place among the message's tensors


def encode(obj: object, leaf: Leaf, depth: int = 0) -> bytes:
    """``obj`` as an encoded TreeNode; each tensor leaf is handed to ``leaf`` (in wire order)
    where it is met. Raises UnsupportedTensorError for what no message carries."""
    if depth > MAX_DEPTH:
        raise UnsupportedTensorError(f"pytree is nested deeper than {MAX_DEPTH} levels")
    cls = type(obj)
    if cls is dict:
        return _dict(obj, leaf, depth)  # type: ignore[arg-type]
    if cls is list:
        return _framed(_LIST, _items(obj, leaf, depth))  # type: ignore[arg-type]
    if cls is tuple:
        return _framed(_TUPLE, _items(obj, leaf, depth))  # type: ignore[arg-type]
    if cls is np.ndarray:
        return _TENSOR + varint(leaf(obj))
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):  # (never also a container or scalar)
        return _TENSOR + varint(leaf(obj))
    return _other(obj, leaf, depth)


def _other(obj: object, leaf: Leaf, depth: int) -> bytes:
    """A scalar, a container subclass, or a tensor of another kind, in the order of checks
    every message has always been flattened in (np.float64 is a float, but a tensor)."""
    if obj is None:
        return _NONE
    if isinstance(obj, bool):
        return _TRUE if obj else _FALSE
    if isinstance(obj, int) and not isinstance(obj, np.generic):
        if -_INT64 <= obj < _INT64:
            return _INT + varint(2 * obj if obj >= 0 else -2 * obj - 1)  # (sint64: zigzag)
        # int's own digits: a subclass's str() may be anything ("E.BIG" for an (int, Enum)
        # member), which the receiver refuses as a malformed header
        text = int.__repr__(obj) if obj.bit_length() <= _BIG_INT_BITS else ""
        if not text or len(text.lstrip("-")) > MAX_BIG_INT_DIGITS:
            raise UnsupportedTensorError(f"integers beyond {MAX_BIG_INT_DIGITS} digits are not supported")
        return _framed(_BIG, text.encode())
    if isinstance(obj, float) and not isinstance(obj, np.generic):
        return _FLOAT + _DOUBLE(obj)
    if isinstance(obj, str):
        return _framed(_STR, _utf8(obj))
    if isinstance(obj, bytes):
        # a subclass's own bytes (np.bytes_, ...), never what it says its length is
        return _framed(_BYTES, obj if type(obj) is bytes else bytes.__getitem__(obj, slice(None)))
    if isinstance(obj, dict):
        return _dict(obj, leaf, depth)
    if isinstance(obj, (list, tuple)):
        return _framed(_TUPLE if isinstance(obj, tuple) else _LIST, _items(obj, leaf, depth))
    if is_tensor(obj):
        return _TENSOR + varint(leaf(obj))
    raise UnsupportedTensorError(
        f"cannot send {type(obj).__name__}: a message is a tensor, or a dict/list/tuple of tensors "
        "and plain scalars (None, bool, int, float, str, bytes)"
    )


def _utf8(text: str) -> bytes:
    try:
        return str.encode(text, "utf-8")
    except UnicodeEncodeError as exc:  # lone surrogates ("\udcff", from os.fsdecode and the like)
        shown = text[max(0, exc.start - 20) : exc.end + 20].encode("utf-8", "backslashreplace").decode()
        raise UnsupportedTensorError(
            f"a string that cannot be encoded as UTF-8 ({exc.reason}) cannot be sent: ...{shown!r}..."
        ) from None


def _items(seq: list[Any] | tuple[Any, ...], leaf: Leaf, depth: int) -> bytes:
    """A Sequence's body: each item framed."""
    if seq and depth >= MAX_DEPTH:
        raise UnsupportedTensorError(f"pytree is nested deeper than {MAX_DEPTH} levels")
    out = []
    for item in seq:
        if type(item) is np.ndarray:
            out.append(_tensor_item(leaf(item)))
        else:
            out.append(_framed(_ITEM, encode(item, leaf, depth + 1)))
    return b"".join(out)


def _dict(obj: dict[Any, Any], leaf: Leaf, depth: int) -> bytes:
    """A dict node: its keys framed, then its values (the order protobuf writes a Mapping in)."""
    deep = depth >= MAX_DEPTH  # (its keys and values would be deeper than that)
    keys = []
    values = []
    cached = _key_items
    for k, v in obj.items():
        if type(k) is str:
            if deep:
                raise UnsupportedTensorError(f"pytree is nested deeper than {MAX_DEPTH} levels")
            item = cached.get(k)
            if item is None:
                item = _framed(_ITEM, _framed(_STR, _utf8(k)))
                if len(k) <= _KEY_CACHE_CHARS:
                    if len(cached) >= _KEY_CACHE_LIMIT:
                        cached.clear()
                    cached[k] = item
            keys.append(item)
        else:
            keys.append(_framed(_ITEM, _key(k, depth)))
        if type(v) is np.ndarray:
            i = leaf(v)
            values.append(_TENSOR_VALUES[i] if i < 0x80 else _framed(_VALUE, _TENSOR + varint(i)))
        else:
            values.append(_framed(_VALUE, encode(v, leaf, depth + 1)))
    return _framed(_DICT, b"".join(keys) + b"".join(values))


def _key(k: object, depth: int) -> bytes:
    # a numpy number is a tensor, never a key (np.float64 is a float too: it left a tensor key
    # that the receiver refused, breaking the channel)
    if k is not None and (
        not isinstance(k, _SCALARS) or (isinstance(k, np.generic) and not isinstance(k, (str, bytes)))
    ):
        numpy = isinstance(k, np.generic)  # (np.True_'s type is named "bool": "numpy.bool" says whose)
        raise UnsupportedTensorError(
            f"dict key of type {'numpy.' * numpy}{type(k).__name__} is not supported: a key is None, bool, int, "
            "float, str or bytes"
            + (" (a numpy scalar travels as a 0-d tensor: key by int(k), float(k) or bool(k))" if numpy else "")
        )
    return encode(k, _no_tensor, depth + 1)


def _no_tensor(obj: object) -> int:
    raise AssertionError("a dict key is a scalar")  # (_key let only scalars through)


# A plan: what ``build`` makes of the received tensors. Tuples headed by one of these.
_P_TENSOR = 0  # (_, place)
_P_SCALAR = 1  # (_, value)
_P_LIST = 2  # (_, plans)
_P_TUPLE = 3  # (_, plans)
_P_DICT = 4  # (_, keys, plans)
_P_LIST_OF_TENSORS = 5  # (_, places)
_P_TUPLE_OF_TENSORS = 6  # (_, places)
_P_DICT_OF_TENSORS = 7  # (_, keys, places)
Plan = tuple[Any, ...]


def plan(node: wire_pb2.TreeNode, ntensors: int) -> Plan:
    """The plan of a received tree, which must hold ``ntensors`` tensors; ProtocolError for
    anything ``build`` could not make (every node checked, in the order of its fields), and
    for a tree that does not place each tensor once, in wire order, as every sender writes it
    (``encode``): one placed twice would come back as one array twice, the other's bytes
    unseen, and one out of order would land in ``out=`` by wire order but in a plain recv by
    place."""
    placed = [0]  # the tensors placed so far: the next one's place
    p = _plan(node, ntensors, 0, placed)
    if placed[0] != ntensors:
        raise ProtocolError(f"tree places {placed[0]} of its {ntensors} tensors")
    return p


def _plan(node: wire_pb2.TreeNode, ntensors: int, depth: int, placed: list[int]) -> Plan:
    if depth > MAX_DEPTH:
        raise ProtocolError(f"pytree deeper than {MAX_DEPTH} levels")
    kind = node.WhichOneof("kind")
    if kind == "tensor":
        return (_P_TENSOR, _place(node.tensor, ntensors, placed))
    if kind == "dict":
        mapping = node.dict
        if len(mapping.keys) != len(mapping.values):
            raise ProtocolError("dict node with unequal keys and values")
        deep = depth + 1 > MAX_DEPTH
        keys = []
        for k in mapping.keys:
            key_kind = k.WhichOneof("kind")
            if key_kind not in _SCALAR_KINDS:
                raise ProtocolError("dict key must be a scalar")
            if deep:
                raise ProtocolError(f"pytree deeper than {MAX_DEPTH} levels")
            keys.append(k.str_value if key_kind == "str_value" else _scalar(k, key_kind))
        if len(set(keys)) != len(keys):  # (``build`` would keep the last value of each: the others lost)
            raise ProtocolError("dict node repeats a key (1, 1.0 and True are one key)")
        places, plans = _children(mapping.values, ntensors, depth, placed)
        if places is not None:
            return (_P_DICT_OF_TENSORS, tuple(keys), places)
        return (_P_DICT, tuple(keys), plans)
    if kind == "list" or kind == "tuple":
        places, plans = _children(getattr(node, kind).items, ntensors, depth, placed)
        if places is not None:
            return (_P_LIST_OF_TENSORS if kind == "list" else _P_TUPLE_OF_TENSORS, places)
        return (_P_LIST if kind == "list" else _P_TUPLE, plans)
    if kind is None:
        raise ProtocolError("empty tree node")
    return (_P_SCALAR, _scalar(node, kind))


def _children(
    nodes: Any, ntensors: int, depth: int, placed: list[int]
) -> tuple[tuple[int, ...] | None, tuple[Plan, ...]]:
    """The places of a container's items if every one is a tensor (the common case, checked
    without a call per item), else None and their plans."""
    deep = depth + 1 > MAX_DEPTH
    places: list[int] = []
    for i, child in enumerate(nodes):
        if child.WhichOneof("kind") != "tensor":
            done = [(_P_TENSOR, p) for p in places]
            return None, (*done, *(_plan(c, ntensors, depth + 1, placed) for c in nodes[i:]))
        if deep:
            raise ProtocolError(f"pytree deeper than {MAX_DEPTH} levels")
        places.append(_place(child.tensor, ntensors, placed))
    return tuple(places), ()


def _place(place: int, ntensors: int, placed: list[int]) -> int:
    """A tensor leaf's place, checked: a tensor of the message, the next one in wire order."""
    if place >= ntensors:
        raise ProtocolError(f"tree refers to tensor {place} of {ntensors}")
    if place != placed[0]:
        again = " twice" if place < placed[0] else ""
        raise ProtocolError(f"tree refers to tensor {place}{again} where tensor {placed[0]} comes next")
    placed[0] += 1
    return place


def _scalar(node: wire_pb2.TreeNode, kind: str) -> Any:
    if kind == "none":
        return None
    if kind == "big_int":
        if not _BIG_INT.fullmatch(node.big_int):
            raise ProtocolError("big_int is not a decimal integer of at most 1000 digits")
        return int(node.big_int)
    return getattr(node, kind)


def build(p: Plan, leaves: list[Any]) -> Any:
    """The pytree ``p`` describes, around ``leaves`` (one per tensor, in wire order)."""
    head = p[0]
    if head == _P_DICT_OF_TENSORS:
        return dict(zip(p[1], map(leaves.__getitem__, p[2]), strict=True))
    if head == _P_TENSOR:
        return leaves[p[1]]
    if head == _P_SCALAR:
        return p[1]  # (immutable: one object for every message is as good as a new one)
    if head == _P_LIST_OF_TENSORS:
        return list(map(leaves.__getitem__, p[1]))
    if head == _P_TUPLE_OF_TENSORS:
        return tuple(map(leaves.__getitem__, p[1]))
    if head == _P_DICT:
        return {k: build(c, leaves) for k, c in zip(p[1], p[2], strict=True)}
    if head == _P_LIST:
        return [build(c, leaves) for c in p[1]]
    return tuple(build(c, leaves) for c in p[1])
