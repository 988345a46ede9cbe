"""Pytrees of tensors and scalars, and the header that describes them on the wire.

A message is a pytree (dict / list / tuple of tensors and plain scalars). ``prepare`` flattens it
into a header (the tree structure with scalars inline, and one TensorSpec per tensor leaf) and
the tensors' bytes in C order. ``decode_header`` is the receiver's side and trusts nothing: every
length and shape is checked against the limits before anything is allocated.

Both ends do their work per leaf on the event loop, so a pytree of thousands of tensors must
cost little per leaf: the tree is written and planned directly (``_tree``), and a tensor's spec
is made once per description and kept, at either end (``_header``). A message of more than
``ON_LOOP_LEAVES`` host tensors is flattened in a copy thread, its containers copied at the call.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import struct
import sys
from collections.abc import Generator, Sequence
from typing import Any, Protocol

import numpy as np

from ..control._pb import wire_pb2
from ..errors import ShapeMismatchError, UnsupportedTensorError
from ._device import DeviceSource, DeviceTensor, Streams
from ._dtypes import DTYPES, dtype_name, is_wire_dtype
from ._header import (
    Spec,
    decode_header,
    decode_header_sized,
    device_spec,
    header_bytes,
    host_spec,
    host_specs,
    plan_of,
    spec_item,
)
from ._offload import off_loop, packs_in_a_thread, worth_a_thread
from ._tree import MAX_BIG_INT_DIGITS, MAX_DEPTH, build, encode
from ._view import (
    MAX_NDIM,
    TensorView,
    _torch_carriers,
    as_view,
    byte_view,
    is_tensor,
    mark_written,
    plain_torch_array,
    to_framework,
)

__all__ = [
    "MAX_BIG_INT_DIGITS",
    "MAX_DEPTH",
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
    "wire_nbytes",
    "with_scalars",
]


class Outgoing:
    """A message ready to send: its header, and the tensors' bytes in wire order.

    ``arrays`` holds host arrays and, for CUDA tensors, DeviceTensors (wire bytes in device
    memory, complete once their ``ready`` event is). ``memory`` is "cuda" if any tensor was in
    device memory; ``staged`` says the device bytes were already copied to host (``to_host``).
    ``tree`` is the pytree as a TreeNode: a flattened message carries it encoded
    (``tree_bytes``) and parses it only if asked.
    """

    __slots__ = (
        "_header",
        "_host_parts",
        "_items",
        "_tree",
        "_tree_bytes",
        "arrays",
        "memory",
        "nbytes",
        "on_device",
        "packed",
        "specs",
        "staged",
    )

    def __init__(
        self,
        tree: wire_pb2.TreeNode | None,
        specs: list[Spec],
        arrays: Sequence[np.ndarray | DeviceTensor],  # C-contiguous, over the caller's memory unless packed
        packed: bool,
        nbytes: int,
        header: bytes | None = None,
        *,
        on_device: bool = False,
        staged: bool = False,
        memory: str = "host",  # the device memory kind of the tensors ("cuda"), else "host"
        tree_bytes: bytes | None = None,
        items: list[bytes] | None = None,  # each spec as the header frames it
    ) -> None:
        self._tree = tree
        self._tree_bytes = tree_bytes
        self._items = items
        self._header = header
        self._host_parts: list[memoryview] | None = None  # segments(), made ahead (off the loop)
        self.specs = specs
        self.arrays = arrays
        self.packed = packed
        self.nbytes = nbytes
        self.on_device = on_device
        self.staged = staged
        self.memory = memory

    def __repr__(self) -> str:
        return (
            f"Outgoing(tensors={len(self.specs)}, nbytes={self.nbytes}, packed={self.packed}, "
            f"memory={self.memory!r}, staged={self.staged})"
        )

    @property
    def tree(self) -> wire_pb2.TreeNode:
        """The message's pytree as a TreeNode."""
        if self._tree is None:
            assert self._tree_bytes is not None
            self._tree = wire_pb2.TreeNode.FromString(self._tree_bytes)
        return self._tree

    @property
    def device_bytes(self) -> bool:
        """Whether any device tensor of the message holds bytes: those pass through buffers of
        ours on a staged path (empty ones pass through nothing: not staged, as their receiver says)."""
        return any(isinstance(a, DeviceTensor) and a.nbytes for a in self.arrays)

    @property
    def header(self) -> bytes:
        """The message's wire header (its tree and tensor specs), encoded once: a MessageHeader,
        its specs (field 1) then its tree (field 2), as protobuf writes it."""
        if self._header is None:
            if self._items is None:
                self._items = [spec_item(s, a) for s, a in zip(self.specs, self.arrays, strict=True)]
            tree = self._tree_bytes if self._tree_bytes is not None else self.tree.SerializeToString()
            self._header = header_bytes(self._items, tree)
        return self._header

    def segments(self) -> list[memoryview]:
        """The payload as flat byte views of the wire arrays (empty tensors omitted); host only."""
        if self.on_device:
            raise UnsupportedTensorError("message holds device tensors: use parts(), or to_host() first")
        if self._host_parts is not None:
            return list(self._host_parts)
        return [byte_view(a) for a in self.arrays if isinstance(a, np.ndarray) and a.nbytes]

    def parts(self) -> list[memoryview | DeviceTensor]:
        """The payload in order: host byte views and device tensors (empty tensors omitted)."""
        if self._host_parts is not None and not self.on_device:
            return list(self._host_parts)
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
            items=None if self._items is None else self._items[skipped:],
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


def _flatten(obj: object, views: list[TensorView], depth: int = 0) -> bytes:
    """``obj``'s tree, encoded (as ``depth`` levels deep in a message), and its tensor leaves as
    views (appended to ``views``)."""

    def leaf(tensor: object) -> int:
        views.append(as_view(tensor))
        return len(views) - 1

    return encode(obj, leaf, depth)


def wire_nbytes(obj: object, depth: int = 0) -> int:
    """The tensor bytes ``obj`` puts on the wire as a part of a message, ``depth`` levels deep
    in it (an item of a call's arguments), checked as flattening that message checks it (its
    dict keys, scalars and depth: UnsupportedTensorError), with nothing packed or copied."""
    views: list[TensorView] = []
    _flatten(obj, views, depth)
    return sum(v.nbytes for v in views)


class _Leaves:
    """A message's tensor leaves as flattening meets them, each as a record ``[wire array,
    packed, view, spec entry]``. A plain numpy array or CPU torch tensor in C order, of a dtype
    a message carries, is taken as it is: ``as_view`` would find the same array over the same
    memory. With ``defer``, a host tensor whose packing copy is worth a thread is left unpacked
    (wire and spec None) for ``_Packing``. With a ``budget``, meeting a tensor past that many
    host ones raises _TooMany (a message for ``_Flattening``), unless a tensor of another kind
    came first (device memory, a buffer: those are flattened at the call, whatever the size)."""

    __slots__ = ("budget", "defer", "records")

    def __init__(self, defer: bool, budget: int | None = None) -> None:
        self.records: list[list[Any]] = []
        self.defer = defer
        self.budget = budget

    def __call__(self, obj: object) -> int:
        records = self.records
        place = len(records)
        arr: np.ndarray | None
        if type(obj) is np.ndarray:
            arr, framework = obj, "numpy"
        else:
            torch = sys.modules.get("torch")
            arr = plain_torch_array(obj) if torch is not None and isinstance(obj, torch.Tensor) else None
            framework = "torch"
        if arr is None and not isinstance(obj, np.generic):
            self.budget = None
        elif place == self.budget:
            raise _TooMany
        if arr is not None and arr.flags.c_contiguous:
            hit = host_specs.get((arr.dtype, arr.shape, arr.strides, framework))
            if hit is None and is_wire_dtype(arr.dtype):  # (else as_view says what is wrong)
                hit = host_spec(arr, framework)
            if hit is not None:
                records.append([arr, False, None, hit])
                return place
        if self.defer:
            unresolved = _resolves_on_host(obj)
            if unresolved is not None:
                records.append([None, True, _Resolving(unresolved), None])
                return place
        view = as_view(obj)
        if self.defer and _packs_on_host(view):
            if type(obj) is np.ndarray and view.host is obj:  # (the caller's own array, packed
                # later: a view of it, so that ``obj.shape = ...`` meanwhile is not what travels)
                view = dataclasses.replace(view, host=obj.view())
            records.append([None, True, view, None])
        else:
            records.append(_wired(view))
        return place


class _TooMany(Exception):
    """(``_Leaves``'s budget ran out: the message is one to flatten in a thread.)"""


def _wired(view: TensorView) -> list[Any]:
    """A leaf's record: its wire array (packed if need be), whether packed, its view, its spec."""
    wire, packed = view.wire_array()
    if isinstance(wire, DeviceTensor):
        return [wire, packed, view, device_spec(view, wire)]
    return [wire, packed, view, host_spec(wire, view.framework)]


_SINGLE_TREE = wire_pb2.TreeNode(tensor=0)
_CACHE_LIMIT = 1024
_single_cache: dict[tuple[np.dtype, tuple[int, ...]], tuple[list[Spec], bytes]] = {}


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
        return Ready(_prepare_array(obj))
    leaves = _Leaves(defer=True, budget=ON_LOOP_LEAVES)
    try:
        tree = encode(obj, leaves)
    except _TooMany:
        try:
            return _Flattening(_copied(obj, 0))
        except _Unplain:
            leaves = _Leaves(defer=True)
            tree = encode(obj, leaves)
    heavy = [i for i, r in enumerate(leaves.records) if r[0] is None]
    if not heavy:
        return Ready(_assemble(tree, leaves.records))
    return _Packing(tree, leaves.records, heavy)


class Ready:
    """A message prepared at once, awaitable as one still packing is."""

    __slots__ = ("ready",)

    def __init__(self, msg: Outgoing) -> None:
        self.ready = msg  # (an attribute, not a property: a sender reads it once per message)

    def __await__(self) -> Generator[Any, None, Outgoing]:
        return self.ready
        yield  # (a generator that returns at once)


class _Packing:
    """A message whose large strided host tensors are packed in a copy thread when awaited."""

    __slots__ = ("heavy", "records", "tree")
    ready = None  # (packed when awaited)

    def __init__(self, tree: bytes, records: list[list[Any]], heavy: list[int]) -> None:
        self.tree, self.records, self.heavy = tree, records, heavy

    def __await__(self) -> Generator[Any, None, Outgoing]:
        return self._finish().__await__()

    async def _finish(self) -> Outgoing:
        views = [self.records[i][2] for i in self.heavy]
        done = await off_loop(lambda: [v.wire_array() for v in views])
        records = list(self.records)
        for i, v, (wire, packed) in zip(self.heavy, views, done, strict=True):
            records[i] = [wire, packed, v, host_spec(wire, v.framework)]
        return _assemble(self.tree, records)


# A message of more tensors than this, all host ones, is flattened in a copy thread: at a few
# microseconds a tensor, flattening 10,000 of them on the loop held it for tens of ms.
ON_LOOP_LEAVES = 512


class _Flattening:
    """A large message of host tensors whose containers were copied at the call, flattened in a
    copy thread when awaited. The copy keeps ``prepare_off_loop``'s promise (what the caller
    does to its dicts and lists afterwards is not sent) at a small part of flattening's cost,
    the containers copied by C loops; the rest (each tensor's view, spec and packing, and the
    header) runs in the thread, where the GIL lets the loop turn every few milliseconds."""

    __slots__ = ("copy",)
    ready = None  # (flattened when awaited)

    def __init__(self, copy: object) -> None:
        self.copy = copy

    def __await__(self) -> Generator[Any, None, Outgoing]:
        return off_loop(self._flatten).__await__()

    def _flatten(self) -> Outgoing:
        msg = _prepare_tree(self.copy)
        msg.header  # noqa: B018 - encoded here too, off the loop, and the payload's byte views made
        if not msg.on_device:  # (never: device tensors are flattened at the call)
            msg._host_parts = msg.segments()
        return msg


class _Unplain(Exception):
    """(``_copied`` met what only a flattening at the call may take.)"""


_IMMUTABLE = frozenset({type(None), bool, int, float, str, bytes})


def _copied(obj: object, depth: int, tensors: tuple[type, ...] = ()) -> object:
    """A copy of a pytree's containers around leaves the caller cannot change: scalars, numpy
    scalars, new views of numpy arrays (``a.shape = ...`` on the caller's array leaves them as
    they were), new detached views of CPU torch tensors (``resize_``, ``set_`` or ``.data =`` on
    the caller's tensor leave its shape, dtype and memory as they were: taken as they are, a
    tensor changed so before the thread met it travelled changed, unlike in a smaller message;
    half a microsecond a tensor more at the call). Their bytes stay the caller's to leave alone
    until the send returns, as always. _Unplain for any other leaf
    (device tensors are wired at the call; a bytearray may be resized) or anything flattening
    refuses (it says why), and for a mapping whose items are not a dict's. ``tensors``: the
    torch tensor types taken (found at the top, once)."""
    if depth > MAX_DEPTH:
        raise _Unplain
    if not depth:
        torch = sys.modules.get("torch")
        tensors = () if torch is None else (torch.Tensor, torch.nn.Parameter)
    cls = type(obj)
    if cls in _IMMUTABLE:
        return obj
    if cls is np.ndarray:
        return obj.view()  # type: ignore[attr-defined]
    if cls in tensors:
        if obj.is_cpu:  # type: ignore[attr-defined]
            return obj.detach()  # type: ignore[attr-defined]
        raise _Unplain
    if isinstance(obj, dict):
        copy = {}
        count = 0
        for k, v in obj.items():
            kind = type(v)
            if kind is np.ndarray:
                copy[k] = v.view()
            elif kind in tensors and v.is_cpu:
                copy[k] = v.detach()
            else:
                copy[k] = _copied(v, depth + 1, tensors)
            count += 1
        if count != len(copy):  # (a subclass whose items repeat a key)
            raise _Unplain
        return copy
    if isinstance(obj, (list, tuple)):
        items = [v.view() if type(v) is np.ndarray else _copied(v, depth + 1, tensors) for v in obj]
        return tuple(items) if isinstance(obj, tuple) else items
    if isinstance(obj, (np.generic, str, bytes, int, float)):
        return obj  # (numpy scalars, and subclasses of scalars: np.str_, an IntEnum member, ...)
    raise _Unplain


def _packs_on_host(v: TensorView) -> bool:
    """Whether ``v`` is a host tensor that needs a packing copy large enough for a thread."""
    return v.dev is None and packs_in_a_thread(v.array)


def _resolves_on_host(obj: object) -> Any:
    """``obj`` detached (its shape and memory as at the call), if it is a CPU torch view with
    the conj or neg bit that ``as_view`` takes, whose resolving copy (such a view has no memory
    holding its values) is large enough for a thread; else None (``as_view`` at the call)."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(obj, torch.Tensor) or not obj.is_cpu or obj.layout is not torch.strided:
        return None
    if obj.is_nested or not (obj.is_conj() or obj.is_neg()) or obj.dim() > MAX_NDIM:
        return None
    if _torch_carriers[obj.dtype] is None or not worth_a_thread(obj.nbytes):
        return None
    return obj.detach()


class _Resolving:
    """A heavy leaf of ``_Packing`` that is a torch view with the conj or neg bit: looked at
    (``as_view``, which resolves the bits into a copy) in the copy thread, and packed there."""

    __slots__ = ("tensor",)
    framework = "torch"

    def __init__(self, tensor: Any) -> None:
        self.tensor = tensor

    def wire_array(self) -> tuple[np.ndarray | DeviceTensor, bool]:
        return as_view(self.tensor).wire_array()  # (a copy: packed)


def _prepare_tree(obj: object) -> Outgoing:
    leaves = _Leaves(defer=False)
    tree = encode(obj, leaves)
    return _assemble(tree, leaves.records)


def _assemble(tree: bytes, records: list[list[Any]]) -> Outgoing:
    """The message of the encoded ``tree`` and its leaves' records (every one wired)."""
    arrays: list[np.ndarray | DeviceTensor] = []
    specs: list[Spec] = []
    items: list[bytes] = []
    packed = False
    memory = "host"
    total = 0
    for arr, was_packed, _, (spec, item) in records:
        arrays.append(arr)
        specs.append(spec)
        items.append(item)
        packed |= was_packed
        total += spec.nbytes
        if memory == "host" and type(arr) is not np.ndarray and isinstance(arr, DeviceTensor):
            memory = arr.engine.kind
    return Outgoing(
        None,
        specs,
        arrays,
        packed,
        total,
        on_device=memory != "host",
        memory=memory,
        tree_bytes=tree,
        items=items,
    )


def rebuild(tree: wire_pb2.TreeNode, specs: list[Spec], arrays: list[Any]) -> Any:
    """The received pytree, tensors in the sender's framework where this process has it loaded."""
    leaves = [
        a if type(a) is np.ndarray and s.framework == "numpy" else to_framework(a, s.framework)
        for a, s in zip(arrays, specs, strict=True)
    ]
    p = plan_of(tree)
    return _unflatten(tree, leaves) if p is None else build(p, leaves)


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
        _flatten(out, views)
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
        _flatten(out, views)  # (as_view refuses a dtype no message carries: big-endian, object)
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
