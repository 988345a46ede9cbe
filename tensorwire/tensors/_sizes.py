"""How many bytes items of a list take in a message's header, to keep a header within a peer's
``Limits.max_header_bytes`` before it is built: a batch of many small parts (the regions of an
owner-served one-sided request) goes as several messages, each of which the peer accepts.

A list's items are repeated fields, each its key, its length and its node, so a header grows by
each item's own bytes, plus what the lengths of the nodes that hold the list grow by: a length
is a varint of at most 5 bytes (a header is below 4 GiB), from 1 byte for an empty node, so each
of them grows by 4 bytes at most (``HOLDER_GROWTH``).
"""

from __future__ import annotations

import functools
import math

from ..control._pb import wire_pb2
from ..errors import UnsupportedTensorError
from ._dtypes import DTYPES
from ._message import _flatten
from ._view import TensorView

__all__ = ["HOLDER_GROWTH", "WIDEST", "item_bytes", "tensor_item_bytes"]

HOLDER_GROWTH = 4  # bytes a length of a node around a list grows by as the list grows, at most
WIDEST = -(2**63)  # an int64 whose varint is the longest (10 bytes; sint64 zigzag too)
# the longest framework and device names a spec carries (``as_view``'s frameworks; "cpu" or "cuda")
_FRAMEWORK = max(("numpy", "torch", "cupy", "host-engine"), key=len)
_DEVICE = "cuda"


def _framed(n: int) -> int:
    """A node of ``n`` bytes as an item of a repeated field: its key (one byte: field numbers
    below 16), its length, itself."""
    return 1 + _varint_bytes(n) + n


def _varint_bytes(n: int) -> int:
    return max(1, (n.bit_length() + 6) // 7)


def item_bytes(obj: object) -> int:
    """The bytes ``obj`` (scalars and containers of them, no tensors) takes in a header as one
    item of a list; the nodes that hold the list grow by up to ``HOLDER_GROWTH`` bytes each."""
    views: list[TensorView] = []
    node = _flatten(obj, views)
    if views:
        raise UnsupportedTensorError("item_bytes sizes scalars and containers, not tensors")
    return _framed(len(node))


@functools.lru_cache(maxsize=4096)
def tensor_item_bytes(dtype: str, shape: tuple[int, ...]) -> int:
    """At most the bytes a C-contiguous tensor of ``dtype`` and ``shape`` takes in a header as
    one item of a list, ``[..., t]``, whichever framework and device it is of: its spec and its
    leaf in the tree. A C-contiguous tensor may have any stride along a dimension of 0 or 1
    elements (numpy's ``x[::1000]`` of one row keeps its stride), and along every dimension when
    it has none, so those count at their widest; the others are the C strides every such tensor
    has. The nodes that hold the list grow by up to ``HOLDER_GROWTH`` bytes each (two: the tree
    and the list's)."""
    count = math.prod(shape)
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc if n > 1 and count else WIDEST)
        acc *= n
    strides.reverse()
    nbytes = count * DTYPES[dtype].itemsize
    spec = wire_pb2.TensorSpec(
        dtype=dtype, shape=shape, strides=strides, device=_DEVICE, framework=_FRAMEWORK, nbytes=nbytes
    )
    leaf = wire_pb2.TreeNode(tensor=2**32 - 1)  # its place among the tensors, at its widest
    return _framed(spec.ByteSize()) + _framed(leaf.ByteSize())
