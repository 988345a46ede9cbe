"""Pytrees of tensors and scalars, and the header that describes them on the wire.

A message is a pytree (dict / list / tuple of tensors and plain scalars). ``prepare`` flattens it
into a header (the tree structure with scalars inline, and one TensorSpec per tensor leaf) and
the tensors' bytes in C order. ``decode_header`` is the receiver's side and trusts nothing: every
length and shape is checked against the limits before anything is allocated.
"""

from __future__ import annotations

import asyncio
import math
import re
import struct
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from ..control._pb import wire_pb2
from ..errors import ProtocolError, ShapeMismatchError, UnsupportedTensorError
from ._device import DeviceSource, DeviceTensor, Streams
from ._dtypes import DTYPES, dtype_name
from ._offload import off_loop, packs_in_a_thread
from ._view import MAX_NDIM, TensorView, as_view, byte_view, empty, is_tensor, mark_written, to_framework

__all__ = [
    "Outgoing",
    "Preparing",
    "Spec",
    "check_out",
    "decode_header",
    "decode_header_sized",
    "match_out",
    "prepare",
    "prepare_off_loop",
    "rebuild",
    "with_scalars",
]

# Each pytree level is two protobuf levels (TreeNode, then Sequence/Mapping), and protobuf's
# decoder stops at 100: 32 levels keeps every message we send decodable on the other side.
MAX_DEPTH = 32
MAX_BIG_INT_DIGITS = 1000
_BIG_INT = re.compile(rf"-?[0-9]{{1,{MAX_BIG_INT_DIGITS}}}")
_BIG_INT_BITS = math.ceil(MAX_BIG_INT_DIGITS * math.log2(10))  # every int of that many digits has no more bits
# the largest payload a header may describe, counting empty dimensions as 1: a receiver refuses
# more (nothing it could allocate), so a sender must not send it
_MAX_SHAPE_BYTES = 1 << 62
_SCALAR_KINDS = frozenset({"none", "bool_value", "int_value", "float_value", "str_value", "bytes_value", "big_int"})
_INT64 = 2**63
_CUDA_DEVICE = re.compile(r"cuda(:[0-9]{1,6})?")


@dataclass(frozen=True, slots=True)
class Spec:
    """One tensor of a message, as its header describes it."""

    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    framework: str = "numpy"
    device: str = "cpu"

    def allocate(self) -> np.ndarray:
        """A new host array for the tensor this spec describes."""
        return empty(self.dtype, self.shape)


@dataclass(slots=True)
class Outgoing:
    """A message ready to send: its header, and the tensors' bytes in wire order.

    ``arrays`` holds host arrays and, for CUDA tensors, DeviceTensors (wire bytes in device
    memory, complete once their ``ready`` event is). ``memory`` is "cuda" if any tensor was in
    device memory; ``staged`` says the device bytes were already copied to host (``to_host``).
    """

    tree: wire_pb2.TreeNode
    specs: list[Spec]
    arrays: Sequence[np.ndarray | DeviceTensor]  # C-contiguous, over the caller's memory unless packed
    packed: bool
    nbytes: int
    _header: bytes | None = field(default=None, repr=False)
    on_device: bool = False
    staged: bool = False
    memory: str = "host"  # the device memory kind of the tensors ("cuda"), else "host"

    @property
    def device_bytes(self) -> bool:
        """Whether any device tensor of the message holds bytes: those pass through buffers of
        ours on a staged path (empty ones pass through nothing: not staged, as their receiver says)."""
        return any(isinstance(a, DeviceTensor) and a.nbytes for a in self.arrays)

    @property
    def header(self) -> bytes:
        """The message's wire header (its tree and tensor specs), encoded once."""
        if self._header is None:
            msg = wire_pb2.MessageHeader(tree=self.tree)
            for s, a in zip(self.specs, self.arrays, strict=True):
                if isinstance(a, DeviceTensor):
                    strides = _c_strides(a.shape)
                else:
                    strides = [st // a.itemsize for st in a.strides] if a.itemsize else []
                msg.tensors.add(
                    dtype=s.dtype,
                    shape=s.shape,
                    strides=strides,
                    device=s.device,
                    framework=s.framework,
                    nbytes=s.nbytes,
                )
            try:
                self._header = msg.SerializeToString()
            except Exception as exc:  # protobuf's own limits (nesting, sizes)
                raise UnsupportedTensorError(f"message header cannot be encoded: {exc}") from exc
        return self._header

    def segments(self) -> list[memoryview]:
        """The payload as flat byte views of the wire arrays (empty tensors omitted); host only."""
        if self.on_device:
            raise UnsupportedTensorError("message holds device tensors: use parts(), or to_host() first")
        return [byte_view(a) for a in self.arrays if isinstance(a, np.ndarray) and a.nbytes]

    def parts(self) -> list[memoryview | DeviceTensor]:
        """The payload in order: host byte views and device tensors (empty tensors omitted)."""
        return [a if isinstance(a, DeviceTensor) else byte_view(a) for a in self.arrays if a.nbytes]

    def items_from(self, start: int) -> Outgoing:
        """A message of a tuple message's items from ``start`` on, as flattening that shorter
        tuple would make it, without flattening (or packing) anything again: the same arrays,
        the tensors numbered from the first of those items."""
        items = self.tree.tuple.items
        skipped = sum(_tensor_count(node) for node in items[:start])
        tree = wire_pb2.TreeNode()
        for node in items[start:]:
            _renumber(tree.tuple.items.add(), node, skipped)
        arrays = self.arrays[skipped:]
        return Outgoing(
            tree,
            self.specs[skipped:],
            arrays,
            self.packed,
            sum(a.nbytes for a in arrays),
            on_device=self.on_device,
            memory=self.memory,
        )

    async def to_host(self, until: asyncio.Future[Any] | None = None) -> None:
        """Copy every device tensor's bytes into host memory of our own (for transports that
        cannot read device memory); waits for each producer's event on a copy lane, a wait that
        ``until`` (the channel's ``ended``) cuts short."""
        if not self.on_device:
            return
        arrays: list[np.ndarray | DeviceTensor] = []
        for a in self.arrays:
            arrays.append(await a.to_host(until) if isinstance(a, DeviceTensor) else a)
        self.header  # noqa: B018 - encode while the device shapes are still at hand
        self.staged = self.device_bytes
        self.arrays = arrays
        self.on_device = False


def _tensor_nodes(root: wire_pb2.TreeNode) -> list[wire_pb2.TreeNode]:
    """Every tensor leaf of a tree (dict keys are scalars, never tensors)."""
    found, stack = [], [root]
    while stack:
        node = stack.pop()
        kind = node.WhichOneof("kind")
        if kind == "tensor":
            found.append(node)
        elif kind == "tuple":
            stack.extend(node.tuple.items)
        elif kind == "list":
            stack.extend(node.list.items)
        elif kind == "dict":
            stack.extend(node.dict.values)
    return found


def _tensor_count(node: wire_pb2.TreeNode) -> int:
    return len(_tensor_nodes(node))


def _renumber(dst: wire_pb2.TreeNode, src: wire_pb2.TreeNode, lower: int) -> None:
    """``dst`` made a copy of ``src`` whose tensor leaves point ``lower`` tensors lower."""
    dst.CopyFrom(src)
    for node in _tensor_nodes(dst):
        node.tensor -= lower


def _c_strides(shape: tuple[int, ...]) -> list[int]:
    out = []
    acc = 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return list(reversed(out))


def _flatten(obj: object, views: list[TensorView], depth: int) -> wire_pb2.TreeNode:
    if depth > MAX_DEPTH:
        raise UnsupportedTensorError(f"pytree is nested deeper than {MAX_DEPTH} levels")
    node = wire_pb2.TreeNode()
    if obj is None:
        node.none = True
    elif isinstance(obj, bool):
        node.bool_value = obj
    elif isinstance(obj, int) and not isinstance(obj, np.generic):
        if -_INT64 <= obj < _INT64:
            node.int_value = obj
        else:
            # int's own digits: a subclass's str() may be anything ("E.BIG" for an (int, Enum)
            # member), which the receiver refuses as a malformed header
            text = int.__repr__(obj) if obj.bit_length() <= _BIG_INT_BITS else ""
            if not text or len(text.lstrip("-")) > MAX_BIG_INT_DIGITS:
                raise UnsupportedTensorError(f"integers beyond {MAX_BIG_INT_DIGITS} digits are not supported")
            node.big_int = text
    elif isinstance(obj, float) and not isinstance(obj, np.generic):
        node.float_value = obj
    elif isinstance(obj, str):
        try:
            node.str_value = obj
        except UnicodeEncodeError as exc:  # lone surrogates ("\udcff", from os.fsdecode and the like)
            shown = obj[max(0, exc.start - 20) : exc.end + 20].encode("utf-8", "backslashreplace").decode()
            raise UnsupportedTensorError(
                f"a string that cannot be encoded as UTF-8 ({exc.reason}) cannot be sent: ...{shown!r}..."
            ) from None
    elif isinstance(obj, bytes):
        node.bytes_value = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            # a numpy number is a tensor, never a key (np.float64 is a float too: it left a tensor key
            # that the receiver refused, breaking the channel)
            if k is not None and (
                not isinstance(k, _SCALARS) or (isinstance(k, np.generic) and not isinstance(k, (str, bytes)))
            ):
                raise UnsupportedTensorError(f"dict key of type {type(k).__name__} is not supported")
            node.dict.keys.append(_flatten(k, views, depth + 1))
            node.dict.values.append(_flatten(v, views, depth + 1))
        if not obj:
            node.dict.SetInParent()
    elif isinstance(obj, (list, tuple)):
        seq = node.tuple if isinstance(obj, tuple) else node.list
        seq.SetInParent()
        for item in obj:
            seq.items.append(_flatten(item, views, depth + 1))
    elif is_tensor(obj):
        node.tensor = len(views)
        views.append(as_view(obj))
    else:
        raise UnsupportedTensorError(
            f"cannot send {type(obj).__name__}: a message is a tensor, or a dict/list/tuple of tensors "
            "and plain scalars (None, bool, int, float, str, bytes)"
        )
    return node


_SINGLE_TREE = wire_pb2.TreeNode(tensor=0)
_CACHE_LIMIT = 1024
_single_cache: dict[tuple[np.dtype, tuple[int, ...]], tuple[list[Spec], bytes]] = {}
_decode_cache: dict[bytes, tuple[wire_pb2.TreeNode, list[Spec], int]] = {}


def _prepare_array(arr: np.ndarray) -> Outgoing:
    """The common case, one contiguous numpy array: header built once per (dtype, shape)."""
    key = (arr.dtype, arr.shape)
    hit = _single_cache.get(key)
    if hit is None:
        msg = _prepare_tree(arr)
        if len(_single_cache) >= _CACHE_LIMIT:
            _single_cache.clear()
        _single_cache[key] = (msg.specs, msg.header)
        return msg
    specs, header = hit
    return Outgoing(_SINGLE_TREE, specs, [arr], False, specs[0].nbytes, header)


def prepare(obj: object) -> Outgoing:
    """Flatten a message for sending; the tensors' bytes are not copied unless packing is needed."""
    if type(obj) is np.ndarray and obj.flags.c_contiguous and obj.dtype.isnative:
        return _prepare_array(obj)
    return _prepare_tree(obj)


class Preparing(Protocol):
    """What ``prepare_off_loop`` gives: awaitable for the message. ``ready`` is the message
    itself where no copy is left to make in a thread (awaiting it then yields nothing to the
    loop), else None."""

    @property
    def ready(self) -> Outgoing | None: ...

    def __await__(self) -> Generator[Any, None, Outgoing]: ...


def prepare_off_loop(obj: object) -> Preparing:
    """``prepare``, with the packing copies of large strided host tensors (``OFF_LOOP_BYTES`` or
    more, ``_offload.worth_a_thread``) made in a copy thread while the event loop goes on.

    The message is flattened, and its device tensors wired (their producers' events recorded),
    now, at the call; awaiting the result makes the large copies and gives the message."""
    if type(obj) is np.ndarray and obj.flags.c_contiguous and obj.dtype.isnative:
        return _Ready(_prepare_array(obj))
    views: list[TensorView] = []
    tree = _flatten(obj, views, 0)
    heavy = {i for i, v in enumerate(views) if _packs_on_host(v)}
    wired = [None if i in heavy else v.wire_array() for i, v in enumerate(views)]
    if not heavy:
        return _Ready(_assemble(tree, views, wired))  # type: ignore[arg-type]  # (no None in it)
    return _Packing(tree, views, wired, sorted(heavy))


class _Ready:
    """A message prepared at once, awaitable as one still packing is."""

    __slots__ = ("msg",)

    def __init__(self, msg: Outgoing) -> None:
        self.msg = msg

    @property
    def ready(self) -> Outgoing:
        return self.msg

    def __await__(self) -> Generator[Any, None, Outgoing]:
        return self.msg
        yield  # (a generator that returns at once)


class _Packing:
    """A message whose large strided host tensors are packed in a copy thread when awaited."""

    __slots__ = ("heavy", "tree", "views", "wired")
    ready = None  # (packed when awaited)

    def __init__(
        self,
        tree: wire_pb2.TreeNode,
        views: list[TensorView],
        wired: list[tuple[np.ndarray | DeviceTensor, bool] | None],
        heavy: list[int],
    ) -> None:
        self.tree, self.views, self.wired, self.heavy = tree, views, wired, heavy

    def __await__(self) -> Generator[Any, None, Outgoing]:
        return self._finish().__await__()

    async def _finish(self) -> Outgoing:
        views = self.views
        done = await off_loop(lambda: [views[i].wire_array() for i in self.heavy])
        wired = list(self.wired)
        for i, w in zip(self.heavy, done, strict=True):
            wired[i] = w
        return _assemble(self.tree, views, wired)  # type: ignore[arg-type]  # (no None left)


def _packs_on_host(v: TensorView) -> bool:
    """Whether ``v`` is a host tensor that needs a packing copy large enough for a thread."""
    return v.dev is None and packs_in_a_thread(v.array)


def _prepare_tree(obj: object) -> Outgoing:
    views: list[TensorView] = []
    tree = _flatten(obj, views, 0)
    return _assemble(tree, views, [v.wire_array() for v in views])


def _assemble(
    tree: wire_pb2.TreeNode, views: list[TensorView], wired: list[tuple[np.ndarray | DeviceTensor, bool]]
) -> Outgoing:
    """The message of ``views`` whose wire arrays (and whether each was packed) are ``wired``."""
    arrays: list[np.ndarray | DeviceTensor] = []
    specs: list[Spec] = []
    packed = False
    on_device = False
    total = 0
    for v, (arr, was_packed) in zip(views, wired, strict=True):
        packed |= was_packed
        arrays.append(arr)
        if isinstance(arr, DeviceTensor):
            on_device = True
            device = "cuda" if arr.engine.kind == "cuda" else "cpu"
        else:
            device = "cpu"
        nbytes = int(arr.nbytes)
        if not nbytes and _impossible(v.shape, DTYPES[v.dtype].itemsize):  # (empty: no bytes bound its shape)
            raise UnsupportedTensorError(
                f"a {v.dtype} tensor of shape {list(v.shape)[:8]} cannot be sent: its dimensions (empty ones "
                "counted as 1) describe 2**62 bytes or more, which no receiver accepts"
            )
        specs.append(Spec(v.dtype, v.shape, nbytes, v.framework, device))
        total += nbytes
    memory = next((a.engine.kind for a in arrays if isinstance(a, DeviceTensor)), "host")
    return Outgoing(tree, specs, arrays, packed, total, on_device=on_device, memory=memory)


def decode_header(
    data: bytes | bytearray | memoryview, *, max_message_bytes: int
) -> tuple[wire_pb2.TreeNode, list[Spec]]:
    """Parse and validate a received header. Raises ProtocolError for anything inconsistent.

    Validated results are cached by the header's bytes (small headers only), so a stream of
    same-shaped messages is parsed once.
    """
    tree, specs, _ = decode_header_sized(data, max_message_bytes=max_message_bytes)
    return tree, specs


def decode_header_sized(
    data: bytes | bytearray | memoryview, *, max_message_bytes: int
) -> tuple[wire_pb2.TreeNode, list[Spec], int]:
    """``decode_header``, and the payload's total size (the sum of the specs' ``nbytes``)."""
    small = len(data) <= 512
    if small:
        key = data if type(data) is bytes else bytes(data)
        hit = _decode_cache.get(key)
        if hit is not None and hit[2] <= max_message_bytes:
            return hit
    tree, specs = _decode_header(data, max_message_bytes)
    result = (tree, specs, sum(s.nbytes for s in specs))
    if small:
        if len(_decode_cache) >= _CACHE_LIMIT:
            _decode_cache.clear()
        _decode_cache[key] = result
    return result


def _decode_header(
    data: bytes | bytearray | memoryview, max_message_bytes: int
) -> tuple[wire_pb2.TreeNode, list[Spec]]:
    try:
        msg = wire_pb2.MessageHeader.FromString(bytes(data))
    except Exception as exc:  # protobuf raises DecodeError and friends
        raise ProtocolError(f"undecodable message header ({len(data)} bytes)") from exc
    specs: list[Spec] = []
    total = 0
    for t in msg.tensors:
        dt = DTYPES.get(t.dtype)
        if dt is None:
            raise ProtocolError(f"header names unknown dtype {t.dtype[:32]!r}")
        if len(t.shape) > MAX_NDIM:
            raise ProtocolError(f"header claims {len(t.shape)} dimensions (limit {MAX_NDIM})")
        shape = tuple(int(d) for d in t.shape)
        if any(d < 0 for d in shape):
            raise ProtocolError(f"header claims a negative dimension in shape {shape}")
        if _impossible(shape, dt.itemsize):
            raise ProtocolError(f"header claims an impossible shape {list(shape)[:8]}")
        n = math.prod(shape) * dt.itemsize
        if n != t.nbytes:
            raise ProtocolError(f"header claims {t.nbytes} bytes for {t.dtype}{list(shape)} ({n} bytes)")
        total += n
        if total > max_message_bytes:
            raise ProtocolError(f"message claims more than the {max_message_bytes}-byte limit")
        if t.device in ("", "cpu"):
            device = "cpu"
        elif _CUDA_DEVICE.fullmatch(t.device):
            device = "cuda"
        else:
            raise ProtocolError(f"header claims device {t.device[:32]!r}, which this build cannot receive")
        specs.append(Spec(t.dtype, shape, n, t.framework or "numpy", device))
    _check_tree(msg.tree, len(specs), 0)
    return msg.tree, specs


def _impossible(shape: tuple[int, ...], itemsize: int) -> bool:
    """Whether a shape (empty dimensions counted as 1) describes more bytes than a header may."""
    return math.prod(max(d, 1) for d in shape) * itemsize >= _MAX_SHAPE_BYTES


def _check_tree(node: wire_pb2.TreeNode, ntensors: int, depth: int) -> None:
    """Everything ``rebuild`` will do must succeed for a tree that passes here."""
    if depth > MAX_DEPTH:
        raise ProtocolError(f"pytree deeper than {MAX_DEPTH} levels")
    kind = node.WhichOneof("kind")
    if kind == "tensor":
        if node.tensor >= ntensors:
            raise ProtocolError(f"tree refers to tensor {node.tensor} of {ntensors}")
    elif kind in ("list", "tuple"):
        for item in getattr(node, kind).items:
            _check_tree(item, ntensors, depth + 1)
    elif kind == "dict":
        if len(node.dict.keys) != len(node.dict.values):
            raise ProtocolError("dict node with unequal keys and values")
        for k in node.dict.keys:
            if k.WhichOneof("kind") not in _SCALAR_KINDS:
                raise ProtocolError("dict key must be a scalar")
            _check_tree(k, ntensors, depth + 1)
        for v in node.dict.values:
            _check_tree(v, ntensors, depth + 1)
    elif kind == "big_int":
        if not _BIG_INT.fullmatch(node.big_int):
            raise ProtocolError("big_int is not a decimal integer of at most 1000 digits")
    elif kind is None:
        raise ProtocolError("empty tree node")


def rebuild(tree: wire_pb2.TreeNode, specs: list[Spec], arrays: list[Any]) -> Any:
    """The received pytree, tensors in the sender's framework where this process has it loaded."""
    leaves = [to_framework(a, s.framework) for a, s in zip(arrays, specs, strict=True)]
    return _unflatten(tree, leaves)


def _unflatten(node: wire_pb2.TreeNode, leaves: list[Any]) -> Any:
    kind = node.WhichOneof("kind")
    if kind == "tensor":
        return leaves[node.tensor]
    if kind == "list":
        return [_unflatten(i, leaves) for i in node.list.items]
    if kind == "tuple":
        return tuple(_unflatten(i, leaves) for i in node.tuple.items)
    if kind == "dict":
        return {
            _unflatten(k, leaves): _unflatten(v, leaves) for k, v in zip(node.dict.keys, node.dict.values, strict=True)
        }
    if kind == "none":
        return None
    if kind == "big_int":
        return int(node.big_int)
    return getattr(node, kind)


def match_out(
    out: object, specs: list[Spec], streams: Streams | None = None, tree: wire_pb2.TreeNode | None = None
) -> list[np.ndarray | DeviceTensor]:
    """The caller's out= pytree as writable arrays (host) or DeviceTensors (device), one per
    tensor leaf, checked against specs (and against the message's ``tree``: the same
    containers, keys and tensor places); device ones ordered on the recv's ``streams``."""
    if type(out) is np.ndarray and len(specs) == 1 and (tree is None or tree.HasField("tensor")):
        s = specs[0]
        if out.dtype == DTYPES.get(s.dtype) and out.shape == s.shape and out.flags.c_contiguous and out.flags.writeable:
            return [out]
    views: list[TensorView] = []
    if tree is None:
        _flatten(out, views, 0)
    else:
        try:
            _views_along(out, tree, views)
        except _Misfit as misfit:
            raise ShapeMismatchError(f"out={''.join(reversed(misfit.path))} {misfit.text}") from None
    if len(views) != len(specs):
        raise ShapeMismatchError(f"out= holds {len(views)} tensors but the message has {len(specs)}")
    for i, (v, s) in enumerate(zip(views, specs, strict=True)):
        if v.dtype != s.dtype or v.shape != s.shape:
            raise ShapeMismatchError(
                f"out= tensor {i} is {v.dtype}{list(v.shape)} but the message carries {s.dtype}{list(s.shape)}"
            )
    _check_leaves(views)
    targets = [v.dev.target(streams) if v.dev is not None else v.array for v in views]
    mark_written(views)
    return targets


def check_out(out: object, views: list[TensorView] | None = None) -> None:
    """Refuse an out= whose host tensors no message could land in (read-only, not C-contiguous,
    two sharing memory, or no tensor tensorwire can receive into), as ``match_out`` would, for
    a caller that must know before it sends anything (an RPC's ``_out=``: the method would run
    and its result be dropped). ``views``: its leaves, ``as_view`` of each, where the caller
    walked it already."""
    if type(out) is np.ndarray and out.flags.c_contiguous and out.flags.writeable and out.dtype.isnative:
        dtype_name(out.dtype)  # (an object array, ...: UnsupportedTensorError)
        return
    if views is None:
        views = []
        _flatten(out, views, 0)  # (as_view refuses a dtype no message carries: big-endian, object)
    _check_leaves(views)


def _check_leaves(views: list[TensorView]) -> None:
    """out= leaves bytes can land in: host ones writable and C-contiguous, none sharing memory."""
    for v in views:
        if v.dev is None:
            _writable(v)
    if len(views) > 1:
        _refuse_overlap(views)


_SCALARS = (bool, int, float, str, bytes)
_NOT_TENSORS = (dict, list, tuple, bool, int, float, str, bytes, type(None))


class _Misfit(Exception):
    """Where out= departs from the message's tree (turned into a ShapeMismatchError by
    ``match_out``; the path is put together only then, on the way up)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.path: list[str] = []


def _views_along(obj: object, node: wire_pb2.TreeNode, views: list[TensorView]) -> None:
    """out= walked along the message's tree: its tensors (as views, in wire order) where the
    message has tensors, else _Misfit. Tensors matched by their place alone would let
    ``{"k": K, "v": V}`` land in ``out={"v": ..., "k": ...}`` crosswise, so dicts must have the
    message's keys in its order; a list may stand for a tuple and the other way round; a
    scalar of the message may face any scalar (the recv returns the message's)."""
    kind = node.WhichOneof("kind")
    if kind == "tensor":
        if isinstance(obj, _NOT_TENSORS) and not isinstance(obj, np.generic):
            raise _Misfit(f"is {_what(obj)} where the message has a tensor")
        views.append(as_view(obj))  # (anything else that is no tensor: UnsupportedTensorError)
        return
    if kind == "list" or kind == "tuple":
        items = node.list.items if kind == "list" else node.tuple.items
        if not isinstance(obj, (list, tuple)):
            raise _Misfit(f"is {_what(obj)} where the message has a {kind}")
        if len(obj) != len(items):
            raise _Misfit(f"holds {len(obj)} items where the message's {kind} has {len(items)}")
        pairs: Any = zip(obj, items, strict=True)
    elif kind == "dict":
        if not isinstance(obj, dict):
            raise _Misfit(f"is {_what(obj)} where the message has a dict")
        keys = [_unflatten(k, []) for k in node.dict.keys]
        mine = list(obj)
        if len(mine) != len(keys) or not all(_same_key(a, b) for a, b in zip(mine, keys, strict=True)):
            raise _Misfit(f"has the keys {mine!r} where the message has {keys!r} (in that order, of the same types)")
        pairs = zip(obj.values(), node.dict.values, strict=True)
    else:
        if isinstance(obj, (dict, list, tuple)) or (
            obj is not None and not isinstance(obj, _SCALARS) and is_tensor(obj)
        ):
            raise _Misfit(f"is {_what(obj)} where the message has a scalar")
        return
    for i, (o, n) in enumerate(pairs):
        try:
            _views_along(o, n, views)
        except _Misfit as misfit:
            misfit.path.append(f"[{list(obj)[i]!r}]" if kind == "dict" else f"[{i}]")
            raise


def _same_key(mine: object, theirs: object) -> bool:
    """Is the out= key ``mine`` the message's key ``theirs`` (a scalar as the wire carries it)? Of
    the same wire kind (an int is no float, nor a bool an int: the recv returns out='s keys) and
    value; a NaN is the NaN key it was sent as. Never runs ``mine``'s own ``__eq__`` for
    anything but a scalar (it may raise, or answer with an array)."""
    kind = _key_kind(mine)
    if kind is None or kind is not _key_kind(theirs):
        return False
    if kind is float and math.isnan(mine) and math.isnan(theirs):  # type: ignore[arg-type]
        return True
    return bool(mine == theirs)


def _key_kind(key: object) -> type | None:
    """The scalar a dict key travels as (``_flatten``'s rule), or None for a key no message has."""
    if key is None:
        return type(None)
    if isinstance(key, np.generic) and not isinstance(key, (str, bytes)):
        return None
    for kind in (bool, int, float, str, bytes):  # (bool before int: True is an int too)
        if isinstance(key, kind):
            return kind
    return None


def _what(obj: object) -> str:
    if isinstance(obj, dict):
        return "a dict"
    if isinstance(obj, (list, tuple)):
        return f"a {type(obj).__name__}"
    if obj is None or isinstance(obj, _SCALARS):
        return "a scalar"
    return "a tensor" if is_tensor(obj) else f"a {type(obj).__name__}"


def with_scalars(out: object, tree: wire_pb2.TreeNode) -> object:
    """What a recv into ``out`` returns: ``out`` itself, or where the message's scalars differ
    from those ``out`` holds, the message's structure with ``out``'s tensors in it (``out`` was
    checked by ``match_out`` to have that structure)."""
    if tree.HasField("tensor") or _scalars_equal(out, tree):
        return out
    return _with_scalars(out, tree)


def _scalars_equal(obj: Any, node: wire_pb2.TreeNode) -> bool:
    kind = node.WhichOneof("kind")
    if kind == "tensor":
        return True
    if kind == "list" or kind == "tuple" or kind == "dict":
        items = node.list.items if kind == "list" else node.tuple.items if kind == "tuple" else node.dict.values
        for o, n in zip(obj.values() if kind == "dict" else obj, items, strict=True):
            if not n.HasField("tensor") and not _scalars_equal(o, n):  # (tensors: no call)
                return False
        return True
    value = _unflatten(node, [])
    if type(value) is float:  # by bits: -0.0 == 0.0, and every NaN has one hex() whatever its payload
        return type(obj) is float and struct.pack("<d", obj) == struct.pack("<d", value)
    return type(obj) is type(value) and bool(obj == value)


def _with_scalars(obj: Any, node: wire_pb2.TreeNode) -> Any:
    kind = node.WhichOneof("kind")
    if kind == "tensor":
        return obj
    if kind == "list":
        return [_with_scalars(o, n) for o, n in zip(obj, node.list.items, strict=True)]
    if kind == "tuple":
        return tuple(_with_scalars(o, n) for o, n in zip(obj, node.tuple.items, strict=True))
    if kind == "dict":
        return {k: _with_scalars(v, n) for (k, v), n in zip(obj.items(), node.dict.values, strict=True)}
    return _unflatten(node, [])


def _writable(v: TensorView) -> np.ndarray:
    if v.readonly:
        raise UnsupportedTensorError(f"out= {v.framework} tensor cannot be received into: {v.readonly}")
    if not v.array.flags.c_contiguous:
        raise ShapeMismatchError("out= buffer must be C-contiguous so bytes can land in it directly")
    if not v.array.flags.writeable:
        raise ShapeMismatchError("out= buffer is read-only")
    return v.array


def bounds(ptr: int, shape: Sequence[int], strides: Sequence[int], itemsize: int) -> tuple[int, int]:
    """The addresses ``[low, high)`` an array's bytes lie within (any strides, negative ones
    reaching below ``ptr``); empty for no bytes."""
    if any(n == 0 for n in shape):
        return ptr, ptr
    low = ptr + sum((n - 1) * st for n, st in zip(shape, strides, strict=True) if st < 0)
    high = ptr + sum((n - 1) * st for n, st in zip(shape, strides, strict=True) if st > 0)
    return low, high + itemsize


def refuse_shared(leaves: Sequence[np.ndarray | DeviceSource | None], text: str) -> None:
    """ShapeMismatchError (``text``, formatted with the places ``first`` and ``second``) if two
    destinations may share memory: the later one's bytes would land over the earlier one's
    (``recv(out=[buf, buf])``). Swept by start address (host and device pointers share one
    address space under CUDA's unified addressing): host arrays whose bounds overlap are
    compared exactly (interleaved strided views share nothing), device ones by their bounds.
    A None (a destination yet to be allocated) shares nothing but keeps its place."""
    if all(isinstance(a, np.ndarray) and a.flags.owndata for a in leaves) and len({id(a) for a in leaves}) == len(
        leaves
    ):
        return  # arrays that own their memory, each another: none shares it (the common case)
    spans: list[_Span] = []
    for i, a in enumerate(leaves):
        if a is None:
            continue
        if isinstance(a, np.ndarray):
            ptr: int = a.__array_interface__["data"][0]  # (ndarray.ctypes costs several times more)
            if a.flags.c_contiguous:
                low, high = ptr, ptr + a.nbytes
            else:
                low, high = bounds(ptr, a.shape, a.strides, a.itemsize)
            host: np.ndarray | None = a
        else:
            low, high = bounds(a.ptr, a.shape, a.strides, DTYPES[a.dtype].itemsize)
            host = None
        if low != high:
            spans.append((low, high, i, host))
    spans.sort()  # (by start, end, place: places differ, so arrays are never compared)
    cluster: list[_Span] = []  # spans whose bounds chain into each other's
    reach = -1
    for span in spans:
        if span[0] >= reach:  # none before reaches here (disjoint leaves: always)
            _refuse_in(cluster, text)
            cluster = []
        cluster.append(span)
        reach = max(reach, span[1])
    _refuse_in(cluster, text)


_Span = tuple[int, int, int, "np.ndarray | None"]  # [low, high), place, host array (None: device)
_OCCUPANCY_BYTES = 64 << 20  # host leaves spread over at most this: checked by marking their bytes


def _refuse_in(cluster: list[_Span], text: str) -> None:
    """``refuse_shared`` within spans whose bounds overlap, sorted by start. Pair by pair, each
    with those still reaching it; many strided host leaves over one range (the columns of a
    matrix) instead by marking the bytes each covers, once: comparing every pair of a thousand
    took a second."""
    if len(cluster) < 2:
        return
    low, high = cluster[0][0], max(span[1] for span in cluster)
    if len(cluster) > 8 and high - low <= _OCCUPANCY_BYTES and all(span[3] is not None for span in cluster):
        marks = np.zeros(high - low, np.uint8)
        for k, (_, _, i, a) in enumerate(cluster):
            assert a is not None
            ptr = a.__array_interface__["data"][0]
            bytes_of = np.lib.stride_tricks.as_strided(
                marks[ptr - low :], shape=(*a.shape, a.itemsize), strides=(*a.strides, 1), writeable=True
            )
            if bytes_of.any():  # a byte an earlier leaf covers: which one, pair by pair (an error)
                j = next(j for _, _, j, b in cluster[:k] if np.shares_memory(a, b))
                first, second = sorted((i, j))
                raise ShapeMismatchError(text.format(first=first, second=second))
            bytes_of[...] = 1
        return
    active: list[_Span] = []  # the spans reaching past this start
    for span in cluster:
        start, _, i, mine = span
        active = [other for other in active if other[1] > start]
        for _, _, j, other in active:
            shared = True
            if mine is not None and other is not None and not (mine.flags.c_contiguous and other.flags.c_contiguous):
                try:  # (numpy's stubs allow only the two special max_work values; any bound works)
                    shared = bool(np.shares_memory(mine, other, max_work=1 << 16))  # type: ignore[arg-type]
                except np.exceptions.TooHardError:
                    pass  # (pathological strides: their bounds overlap, which is all we can tell)
            if shared:
                first, second = sorted((i, j))
                raise ShapeMismatchError(text.format(first=first, second=second))
        active.append(span)


def _refuse_overlap(views: list[TensorView]) -> None:
    """``refuse_shared`` for a recv's out= leaves."""
    refuse_shared(
        [v.array if v.dev is None else v.dev for v in views],
        "out= tensors {first} and {second} share memory: each tensor of the message needs its own buffer",
    )
