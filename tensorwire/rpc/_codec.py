"""A cached ``prepare`` for RPC messages, whose structure repeats call after call.

Flattening a pytree into its wire header costs tens of microseconds in Python, as much as a
loopback round trip, and the receiver parses what the sender built. RPC messages keep their
structure from call to call (same method, same argument shapes; the call id and deadline ride
in a small int64 tensor, not in the tree), so this module keys each message by its structure
and scalar values and reuses the tree, specs and encoded header. The receiver's header cache
then hits too. Anything but plain C-contiguous numpy arrays, containers and scalars goes
through ``prepare`` unchanged.
"""

from __future__ import annotations

import struct
from collections.abc import Hashable
from typing import Any

import numpy as np

from ..control._pb import wire_pb2
from ..tensors import Outgoing, Spec, prepare, prepare_off_loop
from ..tensors._message import Preparing, Ready

__all__ = ["encode"]

_MAX_DEPTH = 16
_MAX_ENTRIES = 512
# a key holds the message's scalars and an entry its header, whose size they make: a header past
# _MAX_HEADER (long text, a distinct prompt per call) is not cached, and the cache is cleared
# before its headers pass _MAX_BYTES, so that what calls sent long ago is let go
_MAX_HEADER = 64 * 1024
_MAX_BYTES = 8 * 1024 * 1024
_NO = object()  # the walk found something only ``prepare`` knows how to handle
_F64 = struct.Struct("<d")

_cache: dict[Hashable, tuple[wire_pb2.TreeNode, list[Spec], bytes, int]] = {}
_held = 0  # header bytes in _cache


def _walk(obj: Any, arrays: list[np.ndarray], depth: int) -> Any:
    t = type(obj)
    if t is np.ndarray:
        if not (obj.flags.c_contiguous and obj.dtype.isnative) or depth > _MAX_DEPTH:
            return _NO
        arrays.append(obj)
        return (obj.dtype, obj.shape)
    if t is tuple or t is list:
        if depth > _MAX_DEPTH:
            return _NO
        keys = []
        for item in obj:
            k = _walk(item, arrays, depth + 1)
            if k is _NO:
                return _NO
            keys.append(k)
        return (t, tuple(keys))
    if t is dict:
        if depth > _MAX_DEPTH:
            return _NO
        items = []
        for key, value in obj.items():
            kk = _scalar(key)
            vk = _walk(value, arrays, depth + 1)
            if kk is _NO or vk is _NO:
                return _NO
            items.append((kk, vk))
        return (dict, tuple(items))
    return _scalar(obj)


def _scalar(obj: Any) -> Any:
    t = type(obj)
    if obj is None:
        return None
    if t is float:
        return (float, _F64.pack(obj))  # by its bits: -0.0, and a nan's sign and payload, travel as they are
    if t is bool or t is str or t is bytes:
        return (t, obj)
    if isinstance(obj, int) and not isinstance(obj, np.integer):  # int and IntEnum encode alike
        return (int, int(obj))
    return _NO


def encode(obj: Any) -> Outgoing:
    """``prepare(obj)``, from the cache when a message of the same structure was sent before."""
    arrays: list[np.ndarray] = []
    key = _walk(obj, arrays, 0)
    if key is _NO:
        return prepare(obj)
    return _cached(obj, key, arrays)


def encode_off_loop(obj: Any) -> Preparing:
    """``encode``, with large strided tensors packed in a copy thread (``prepare_off_loop``);
    what the cache takes (contiguous tensors only) needs no packing. Flattened now; awaiting
    the result gives the message, and its ``ready`` is the message at once where nothing is
    left to pack (no coroutine per call: RPC requests and replies take this path)."""
    arrays: list[np.ndarray] = []
    key = _walk(obj, arrays, 0)
    if key is _NO:
        return prepare_off_loop(obj)
    return Ready(_cached(obj, key, arrays))


def _cached(obj: Any, key: Any, arrays: list[np.ndarray]) -> Outgoing:
    hit = _cache.get(key)
    if hit is not None:
        tree, specs, header, nbytes = hit
        return Outgoing(tree, specs, arrays, False, nbytes, header)
    global _held
    msg = prepare(obj)
    size = len(msg.header)
    if not msg.packed and len(msg.arrays) == len(arrays) and size <= _MAX_HEADER:
        if len(_cache) >= _MAX_ENTRIES or _held + size > _MAX_BYTES:
            _cache.clear()
            _held = 0
        _cache[key] = (msg.tree, msg.specs, msg.header, msg.nbytes)
        _held += size
    return msg
