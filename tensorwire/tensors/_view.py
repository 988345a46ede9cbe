"""One adapter for every tensor type: numpy, torch, CuPy, DLPack, ``__cuda_array_interface__``
and the buffer protocol.

``as_view(obj)`` returns a TensorView: for host tensors a numpy array over the caller's own
memory, for CUDA tensors a :class:`~tensorwire.tensors._device.DeviceSource` (nothing copied or
enqueued yet), plus the framework it came from, so that a receiver can hand back the same kind
of tensor. torch is detected through ``sys.modules`` and CuPy through the object's type:
tensorwire never imports either just to check a type.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import TransferError, UnsupportedTensorError
from ._device import (
    _DLPACK_CUDA,
    _DLPACK_PINNED,
    DeviceSource,
    DeviceTensor,
    EngineArray,
    device_source,
    dlpack_device_kind,
    offers,
    overlapping,
    resolve_torch_bits,
)
from ._dtypes import DTYPES, big_endian, dtype_from_name, dtype_name

__all__ = [
    "MAX_NDIM",
    "TensorView",
    "as_view",
    "byte_view",
    "empty",
    "impossible_shape",
    "is_tensor",
    "mark_written",
    "overlaps_itself",
    "to_framework",
    "unsendable",
]

# numpy's own limit (NPY_MAXDIMS), and so the most dimensions a header may claim
MAX_NDIM = 64

# the largest payload a header may describe, counting empty dimensions as 1: a receiver refuses
# more (nothing it could allocate), so a sender must not send it
_MAX_SHAPE_BYTES = 1 << 62

# torch dtypes that numpy cannot hold natively; moved as same-width integers and re-viewed.
_TORCH_REVIEW = {"bfloat16": "int16", "float8_e4m3fn": "uint8", "float8_e5m2": "uint8"}


@dataclass(frozen=True, slots=True)
class TensorView:
    """A tensor as tensorwire sees it: a numpy array over the caller's host memory, or (``dev``)
    a description of the caller's device memory."""

    host: np.ndarray | None
    framework: str = "numpy"
    device: str = "cpu"
    dev: DeviceSource | None = None
    # why a recv may not write into it although its array is ours to write (a numpy scalar, a
    # torch view whose bytes had to be copied): empty when it may; ``host`` is then read-only too
    readonly: str = ""
    # what the view's memory is a copy of, when the caller's tensor has no memory holding its
    # values (a torch conj/neg view, resolved): empty otherwise; expose() refuses such a copy
    copied: str = ""
    # the torch tensor ``host`` is the memory of (detached, so sharing the caller's version
    # counter), for ``mark_written``; None for other frameworks and for device tensors
    tensor: Any = None

    @property
    def array(self) -> np.ndarray:
        """The host array; UnsupportedTensorError for a device tensor (a host-only path)."""
        if self.host is None:
            raise UnsupportedTensorError(
                f"this operation needs a host tensor, and a {self.framework} tensor on {self.device} was given"
            )
        return self.host

    @property
    def dtype(self) -> str:
        """The wire dtype name."""
        if self.dev is not None:
            return self.dev.dtype
        return dtype_name(self.array.dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        """The tensor's shape."""
        if self.dev is not None:
            return self.dev.shape
        return tuple(self.array.shape)

    @property
    def nbytes(self) -> int:
        """Its size in bytes."""
        if self.dev is not None:
            return self.dev.nbytes
        return int(self.array.nbytes)

    @property
    def contiguous(self) -> bool:
        """Whether its elements lie in C order with no gaps."""
        if self.dev is not None:
            return self.dev.contiguous
        return bool(self.array.flags.c_contiguous)

    def wire_array(self) -> tuple[np.ndarray | DeviceTensor, bool]:
        """The bytes to put on the wire in C order, and whether they are a copy of tensorwire's
        (a receipt's ``packed``): packed into C order, or the caller's tensor has no memory that
        holds its values and ``host`` is already one (``copied``: a torch conj or neg view)."""
        if self.dev is not None:
            return self.dev.wire()
        if self.array.flags.c_contiguous:
            return self.array, bool(self.copied)
        try:
            return np.ascontiguousarray(self.array), True
        except MemoryError as exc:  # a broadcast view (stride 0) packs to its full size
            raise TransferError(
                f"out of memory: could not pack a {self.dtype} tensor of shape {self.shape} ({self.nbytes} "
                "bytes) into C order to send it; nothing was sent (send a contiguous tensor, or a smaller one)"
            ) from exc


def _torch() -> Any:
    return sys.modules.get("torch")


def is_tensor(obj: object) -> bool:
    """True for objects ``as_view`` accepts as a tensor leaf (not for plain scalars)."""
    if isinstance(obj, (np.ndarray, np.generic)):
        return True
    torch = _torch()
    if torch is not None and isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, EngineArray):
        return True
    if isinstance(obj, (bytes, str)):
        return False
    if offers(obj, "__dlpack__") or offers(obj, "__cuda_array_interface__"):
        return True
    try:
        memoryview(obj)  # type: ignore[arg-type]
    except TypeError:
        return False
    except (ValueError, BufferError):  # a buffer, but not now (a closed mmap, a released view): as_view says so
        return True
    return True


def _from_torch(t: Any) -> TensorView:
    torch = _torch()
    if t.layout is not torch.strided or t.is_nested:
        raise UnsupportedTensorError(
            f"torch tensors of layout {'nested' if t.is_nested else t.layout} have no single buffer to send; "
            "send a dense one (t.to_dense(), or t.to_padded_tensor(0) for a nested one)"
        )
    if t.dim() > MAX_NDIM:
        raise UnsupportedTensorError(f"torch tensor of {t.dim()} dimensions: at most {MAX_NDIM} can be moved")
    if t.device.type != "cpu":
        dev = device_source(t)
        assert dev is not None
        return TensorView(None, "torch", dev.device, dev, copied=dev.copied)
    t, readonly, copied = resolve_torch_bits(t)  # a conj/neg view: a copy, never written into
    name = str(t.dtype).removeprefix("torch.")
    if name in DTYPES and not t.numel() and impossible_shape(tuple(t.shape), t.element_size()):
        raise unsendable(name, tuple(t.shape))  # (numpy views none past what it indexes: (0, 2**61) of float64)
    try:
        if name in _TORCH_REVIEW:
            carrier = getattr(torch, _TORCH_REVIEW[name])
            arr = t.view(carrier).numpy().view(DTYPES[name])
        else:
            arr = t.numpy()
    except TypeError as exc:
        raise UnsupportedTensorError(f"torch dtype {t.dtype} is not supported") from exc
    except (RuntimeError, ValueError) as exc:  # a tensor subclass (DTensor, ...) torch will not expose
        raise UnsupportedTensorError(f"this torch tensor ({type(t).__name__}) has no numpy view: {exc}") from exc
    dtype_name(arr.dtype)  # validates
    if readonly:
        arr.flags.writeable = False  # the copy's numpy view only; paths that check this refuse it too
    return TensorView(arr, "torch", readonly=readonly, copied=copied, tensor=t)


def plain_torch_array(t: Any) -> np.ndarray | None:
    """The numpy array over a plain CPU torch tensor's memory (a ``torch.Tensor`` or an
    ``nn.Parameter`` itself, dense, without torch's conj or neg bit, of a dtype a message
    carries): what ``as_view`` would find, for a send's cheap path, which checks only what
    decides that. None for any other tensor (``as_view`` looks at it closer)."""
    torch = _torch()
    if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
        return None
    if not t.is_cpu or t.layout is not torch.strided or t.is_nested or t.dim() > MAX_NDIM or t.is_neg():
        return None
    carrier = _torch_carriers[t.dtype]
    if carrier is None or t.is_conj():
        return None
    if t.requires_grad:
        t = t.detach()
    try:
        if carrier is t.dtype:
            return t.numpy()  # type: ignore[no-any-return]
        return t.view(carrier).numpy().view(DTYPES[str(t.dtype).removeprefix("torch.")])  # type: ignore[no-any-return]
    except (TypeError, RuntimeError, ValueError):
        return None  # (as_view says why)


class _TorchCarriers(dict[Any, Any]):
    """torch dtype -> the torch dtype whose numpy view carries it (itself, or the same-width
    integer of ``_TORCH_REVIEW``), None for one no message carries; filled on first use (torch's
    dtypes exist only once torch is imported)."""

    def __missing__(self, dtype: Any) -> Any:
        name = str(dtype).removeprefix("torch.")
        if name not in DTYPES:
            carrier = None
        else:
            carrier = getattr(_torch(), _TORCH_REVIEW[name]) if name in _TORCH_REVIEW else dtype
        self[dtype] = carrier
        return carrier


_torch_carriers = _TorchCarriers()


def impossible_shape(shape: tuple[int, ...], itemsize: int) -> bool:
    """Whether a shape (empty dimensions counted as 1) describes more bytes than a header may."""
    return math.prod(max(d, 1) for d in shape) * itemsize >= _MAX_SHAPE_BYTES


def unsendable(dtype: str, shape: tuple[int, ...]) -> UnsupportedTensorError:
    """The refusal of an empty tensor whose shape is ``impossible_shape``."""
    return UnsupportedTensorError(
        f"a {dtype} tensor of shape {list(shape)[:8]} cannot be sent: its dimensions (empty ones "
        "counted as 1) describe 2**62 bytes or more, which no receiver accepts"
    )


def as_view(obj: object) -> TensorView:
    """Adapt a tensor-like object; raises UnsupportedTensorError with the reason otherwise."""
    readonly = copied = ""
    if isinstance(obj, np.ndarray):
        ma = sys.modules.get("numpy.ma")  # none can exist before numpy.ma is imported
        if ma is not None and isinstance(obj, ma.MaskedArray):
            raise UnsupportedTensorError(
                "a masked array's mask cannot be sent: send arr.filled(value), or arr.data and arr.mask"
            )
        # a subclass (np.matrix, np.memmap, ...) as the plain ndarray over the same memory: its
        # own reshape and view may keep dimensions (a matrix stays 2-D), and byte views of it
        # then come out short
        arr = obj if type(obj) is np.ndarray else np.ndarray.view(obj, np.ndarray)
        framework = "numpy"
    elif isinstance(obj, np.generic):
        arr = np.asarray(obj)  # a copy: numpy scalars are immutable
        arr.flags.writeable = False
        readonly = f"a numpy scalar ({type(obj).__name__}) is immutable; receive into a 0-d array, np.empty((), dtype)"
        # what is sent is that copy, not the caller's memory: a send's receipt says so (direct=False)
        copied = f"a numpy scalar ({type(obj).__name__})"
        framework = "numpy"
    else:
        torch = _torch()
        if torch is not None and isinstance(obj, torch.Tensor):
            return _from_torch(obj)
        kind = dlpack_device_kind(obj)
        if isinstance(obj, EngineArray) or offers(obj, "__cuda_array_interface__") or kind in _DLPACK_CUDA:
            dev = device_source(obj)
            if dev is None:
                raise UnsupportedTensorError(f"{type(obj).__name__} could not be read as device memory")
            if len(dev.shape) > MAX_NDIM:
                raise UnsupportedTensorError(
                    f"{type(obj).__name__} of {len(dev.shape)} dimensions: at most {MAX_NDIM} can be moved"
                )
            return TensorView(None, dev.framework, dev.device, dev, copied=dev.copied)
        if kind == _DLPACK_PINNED:
            raise UnsupportedTensorError(
                f"{type(obj).__name__} is page-locked host memory offered only through DLPack, which "
                "says nothing of the CUDA stream that may still be writing it: pass a torch tensor, a "
                "CuPy or numpy array"
            )
        if offers(obj, "__dlpack__"):
            try:
                arr = np.from_dlpack(obj)  # type: ignore[arg-type]  # offers() found __dlpack__
            except Exception as exc:  # the producer's BufferError, TypeError, ... (its own code runs here)
                raise UnsupportedTensorError(
                    f"{type(obj).__name__} could not be imported through DLPack: {exc}"
                ) from exc
            framework = "numpy"
        else:
            try:
                arr = np.asarray(memoryview(obj))  # type: ignore[arg-type]
            except TypeError as exc:
                raise UnsupportedTensorError(
                    f"{type(obj).__name__} is not a tensor: expected numpy, torch, DLPack or a buffer"
                ) from exc
            except (ValueError, BufferError) as exc:  # a closed mmap, a released memoryview, ...
                raise UnsupportedTensorError(f"{type(obj).__name__}'s buffer cannot be read: {exc}") from exc
            framework = "numpy"
    if arr.dtype.byteorder == ">" or (arr.dtype.byteorder not in "=|" and not arr.dtype.isnative):
        raise big_endian(arr.dtype)
    dtype_name(arr.dtype)
    return TensorView(arr, framework, readonly=readonly, copied=copied)


def mark_written(views: Iterable[TensorView]) -> None:
    """Tell autograd that bytes are about to be received into these tensors' memory, as torch's
    own in-place writes do (the version counter): a tensor saved for a backward pass and then
    overwritten by a recv or read makes that backward raise, instead of computing its gradients
    from the new values in silence. Only torch tensors keep a counter."""
    for v in views:
        if v.framework != "torch":
            continue
        t = v.tensor if v.dev is None else v.dev.value
        if t is not None and not t.is_inference():  # (an inference tensor has no counter)
            _torch().autograd.graph.increment_version(t)


def overlaps_itself(arr: np.ndarray) -> bool:
    """Whether two elements of ``arr`` share a byte (``_device.overlapping``): bytes written
    into it would overwrite each other."""
    if arr.flags.c_contiguous or arr.flags.f_contiguous:
        return False
    return overlapping(arr.shape, arr.strides, arr.itemsize)


def to_framework(arr: np.ndarray | DeviceTensor, framework: str) -> Any:
    """Hand a received array back as the sender's framework when this process has it loaded;
    a device tensor is already the framework object it was allocated as."""
    if isinstance(arr, DeviceTensor):
        return arr.value
    if framework == "torch":
        torch = _torch()
        if torch is not None:
            name = dtype_name(arr.dtype)
            if name in _TORCH_REVIEW:
                carrier = np.dtype(_TORCH_REVIEW[name])
                return torch.from_numpy(arr.view(carrier)).view(getattr(torch, name))
            return torch.from_numpy(arr)
    return arr


def byte_view(arr: np.ndarray) -> memoryview:
    """A flat, writable-if-possible byte view of a C-contiguous array (no copy). Read through
    the plain ndarray: a subclass's reshape may keep dimensions (np.matrix stays 2-D), and a 2-D
    memoryview is one row long to a socket and cannot be assigned to. numpy's own dtypes go
    through the buffer protocol instead, a quarter of the cost (a message of many small tensors
    takes a view of each at either end); ml_dtypes' cannot be a buffer, nor an empty array cast."""
    if arr.dtype.isbuiltin == 1 and arr.nbytes and arr.flags.c_contiguous:
        return memoryview(arr).cast("B")  # type: ignore[arg-type, unused-ignore]  # (numpy < 2.5 stubs)
    return np.asarray(arr).reshape(-1).view(np.uint8).data


def empty(dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """A new host array for bytes that are to arrive. A process that cannot have the memory
    gets a TransferError (nothing moved yet), never numpy's MemoryError."""
    try:
        return np.empty(shape, dtype=dtype_from_name(dtype))
    except ValueError as exc:  # negative, or past what numpy can index (an empty one too: (0, 2**62))
        raise UnsupportedTensorError(
            f"no array can have the shape {list(shape)[:8]} of {dtype} (changed by hand?): {exc}; nothing moved"
        ) from exc
    except MemoryError as exc:
        nbytes = int(np.prod(shape, dtype=object)) * dtype_from_name(dtype).itemsize
        raise TransferError(
            f"out of memory: could not allocate {nbytes} bytes here for a {dtype} tensor of shape "
            f"{tuple(shape)}; receive into a buffer of your own (out=) or free memory"
        ) from exc
