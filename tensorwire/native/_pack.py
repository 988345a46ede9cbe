"""Pack strided CuPy arrays into wire order (C order bytes) and unpack them back.

How a copy is planned (``_plan``, pure Python, so it is tested on machines without a GPU):

1. The array is seen as bytes: its shape gains a trailing axis of ``itemsize`` bytes with a
   stride of one byte. Axes of length 1 are dropped, and neighbouring axes that step through
   memory as one axis would are merged (coalesced), so a sliced or contiguous tensor shrinks to
   one or two axes and a transposed one keeps only the axes that really are permuted.
2. The widest word of 16, 8, 4, 2 or 1 bytes that divides the innermost run, every other
   stride and both base addresses is chosen; one thread moves one such word at a time.
3. The copy then runs as one of three kinds:

   * ``memcpy``: the strided side is in fact contiguous, a plain device-to-device copy.
   * ``tiled``: the axis on which the strided side is contiguous is not its last axis (a
     transpose or permutation); 32x32-word tiles go through shared memory so that both the
     reads and the writes are coalesced, batched over the remaining axes.
   * ``elementwise``: every other layout; each thread turns the linear C-order index into the
     strided offset (divisions over the axes, innermost first), four words in flight per thread.

Kernels are CUDA C strings compiled through CuPy's NVRTC bindings (``cupy.RawModule``) the
first time a (kind, word size, number of axes, index width) class is needed, then cached per
device. Which class, grid and arguments a copy launches is planned in pure Python too
(``_launch``), so that every class is compiled by NVRTC and its parameters checked against the
launch's arguments on machines without a GPU (tests/test_native_nvrtc.py). CuPy is imported only
inside the functions.
"""

from __future__ import annotations

import importlib
import math
import threading
import warnings
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from ..errors import ShapeMismatchError, UnsupportedTensorError

__all__ = ["NativeUnavailableError", "pack", "unpack"]

_WORD_TYPES = {1: "unsigned char", 2: "unsigned short", 4: "unsigned int", 8: "unsigned long long", 16: "tw_word16"}
_PRELUDE = """
// a 16-byte word moved as one vector load/store (same layout as ulonglong2)
struct __align__(16) tw_word16 { unsigned long long x, y; };
"""
_BLOCK = 256
_TILE = 32
_TILE_ROWS = 8
_TILED_MIN_EXTENT = 16
_MAX_GRID_YZ = 65535
# elementwise grid, in blocks of _BLOCK threads per SM (grid-stride beyond; 0: one thread per word).
# Measured on an H100: gathers (pack) like 32 per SM, scatters (unpack) like a full grid.
_PACK_BLOCKS_PER_SM = 32
_UNPACK_BLOCKS_PER_SM = 0
_NARROW_LIMIT = 2**31  # 32-bit index arithmetic where every index and offset stays below this


class NativeUnavailableError(UnsupportedTensorError):
    """The CUDA pack/unpack kernels cannot run here: CuPy or a CUDA device is missing."""


# --------------------------------------------------------------------------- planning


@dataclass(frozen=True)
class _Plan:
    """A copy between one strided side and one C-contiguous side, in words of ``word`` bytes.

    ``shape`` and ``strides`` (in words, of the strided side) are coalesced; the packed side's
    strides are the C-contiguous strides of ``shape``.
    """

    word: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]

    @property
    def nwords(self) -> int:
        return math.prod(self.shape)

    @property
    def packed_strides(self) -> tuple[int, ...]:
        out = []
        acc = 1
        for n in reversed(self.shape):
            out.append(acc)
            acc *= n
        return tuple(reversed(out))

    @property
    def kind(self) -> str:
        if len(self.shape) == 1 and self.strides[0] == 1:
            return "memcpy"
        if self.tile_axis is not None:
            return "tiled"
        return "elementwise"

    @property
    def tile_axis(self) -> int | None:
        """The axis (not the last) on which the strided side is contiguous, if a tiled copy pays."""
        if len(self.shape) < 2 or abs(self.strides[-1]) == 1 or self.shape[-1] < _TILED_MIN_EXTENT:
            return None
        for axis in range(len(self.shape) - 1):
            if abs(self.strides[axis]) == 1 and self.shape[axis] >= _TILED_MIN_EXTENT:
                return axis
        return None


def _plan(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int, strided_ptr: int, packed_ptr: int) -> _Plan:
    """Plan the copy of a non-empty array of ``shape``/``strides`` (bytes) into C order."""
    dims = [(n, s) for n, s in zip(shape, strides, strict=True) if n != 1]
    dims.append((itemsize, 1))
    merged = [dims[-1]]
    for n, s in reversed(dims[:-1]):
        n_in, s_in = merged[-1]
        if s == n_in * s_in:
            merged[-1] = (n * n_in, s_in)
        else:
            merged.append((n, s))
    merged.reverse()
    inner = merged[-1][0]  # bytes in the innermost run; its stride is one byte
    word = 16
    while word > 1:
        if (
            inner % word == 0
            and strided_ptr % word == 0
            and packed_ptr % word == 0
            and all(s % word == 0 for _, s in merged[:-1])
        ):
            break
        word //= 2
    words = [(n, s // word) for n, s in merged[:-1]]
    if inner // word != 1:
        words.append((inner // word, 1))
    if not words:
        words = [(1, 1)]
    return _Plan(word, tuple(n for n, _ in words), tuple(s for _, s in words))


# --------------------------------------------------------------------------- kernel sources


def _elementwise_source(name: str, word: int, index: str, ndim: int, unpack: bool) -> str:
    w = _WORD_TYPES[word]
    params = ", ".join(f"{index} n{d}, long long s{d}" for d in range(ndim))
    args = ", ".join(f"n{d}, s{d}" for d in range(ndim))
    body = [f"    {index} q; long long off = 0;" if ndim > 1 else "    long long off = 0;"]
    for d in range(ndim - 1, 0, -1):
        body.append(f"    q = r / n{d}; off += (long long)(r - q * n{d}) * s{d}; r = q;")
    body.append("    off += (long long)r * s0;")
    body.append("    return off;")
    offset_fn = f"__device__ __forceinline__ long long tw_offset({index} r, {params}) {{\n" + "\n".join(body) + "\n}\n"
    if unpack:
        load, store = "src[{i}]", f"dst[tw_offset({{i}}, {args})]"
    else:
        load, store = f"src[tw_offset({{i}}, {args})]", "dst[{i}]"
    four = ["i", "i + step", "i + 2 * step", "i + 3 * step"]
    loads = "\n".join(f"        const {w} v{k} = {load.format(i=ix)};" for k, ix in enumerate(four))
    stores = "\n".join(f"        {store.format(i=ix)} = v{k};" for k, ix in enumerate(four))
    return f"""{_PRELUDE}
{offset_fn}
extern "C" __global__ void __launch_bounds__({_BLOCK})
{name}(const {w}* __restrict__ src, {w}* __restrict__ dst, {index} n, {params})
{{
    const {index} step = ({index})gridDim.x * blockDim.x;
    {index} i = ({index})blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * step < n; i += 4 * step) {{
{loads}
{stores}
    }}
    for (; i < n; i += step) {{
        {store.format(i="i")} = {load.format(i="i")};
    }}
}}
"""


def _tiled_source(name: str, word: int, nrest: int, index: str = "long long") -> str:
    """Copy where src is contiguous along axis a and dst along axis b, batched over the rest.

    ``index`` is the signed type of every extent, stride and offset: ``int`` where they all fit.
    """
    w = _WORD_TYPES[word]
    t = index
    rest_params = "".join(f", {t} m{k}, {t} ss{k}, {t} ds{k}" for k in range(nrest))
    decompose = [f"        {t} soff = 0, doff = 0;"]
    if nrest:
        decompose.append(f"        {t} r = z, q;")
    for k in range(nrest - 1, -1, -1):
        decompose.append(
            f"        q = r / m{k}; soff += (r - q * m{k}) * ss{k}; doff += (r - q * m{k}) * ds{k}; r = q;"
        )
    decomp = "\n".join(decompose)
    return f"""{_PRELUDE}
extern "C" __global__ void __launch_bounds__({_TILE * _TILE_ROWS})
{name}(const {w}* __restrict__ src, {w}* __restrict__ dst, {t} na, {t} nb,
       {t} sa, {t} sb, {t} da, {t} db, {t} nbatch{rest_params})
{{
    __shared__ {w} tile[{_TILE}][{_TILE} + 1];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const {t} b0 = ({t})blockIdx.x * {_TILE};
    for ({t} z = blockIdx.z; z < nbatch; z += gridDim.z) {{
{decomp}
        for ({t} a0 = ({t})blockIdx.y * {_TILE}; a0 < na; a0 += ({t})gridDim.y * {_TILE}) {{
            const {t} a = a0 + tx;
#pragma unroll
            for (int j = 0; j < {_TILE}; j += {_TILE_ROWS}) {{
                const {t} b = b0 + ty + j;
                if (a < na && b < nb) tile[ty + j][tx] = src[soff + a * sa + b * sb];
            }}
            __syncthreads();
            const {t} b2 = b0 + tx;
#pragma unroll
            for (int j = 0; j < {_TILE}; j += {_TILE_ROWS}) {{
                const {t} a2 = a0 + ty + j;
                if (a2 < na && b2 < nb) dst[doff + a2 * da + b2 * db] = tile[tx][ty + j];
            }}
            __syncthreads();
        }}
    }}
}}
"""


# --------------------------------------------------------------------------- runtime

_kernels: dict[tuple[Any, ...], Any] = {}
_kernels_lock = threading.Lock()
_sm_counts: dict[int, int] = {}


def _cupy() -> ModuleType:
    try:
        return importlib.import_module("cupy")
    except ImportError as exc:
        raise NativeUnavailableError(
            "tensorwire.native needs CuPy and a CUDA GPU to pack/unpack device tensors, and CuPy "
            f"could not be imported ({exc}); install the build matching your CUDA, e.g. "
            "'pip install cupy-cuda12x' or 'cupy-cuda13x' (tensorwire[cuda] or tensorwire[cuda13]), "
            "or move host tensors with numpy"
        ) from exc


def _check_array(cp: ModuleType, obj: object, what: str) -> None:
    if isinstance(obj, cp.ndarray):
        return
    try:
        available = bool(cp.cuda.is_available())
    except Exception:  # pragma: no cover - a broken driver reads as "no device"
        available = False
    if not available:
        raise NativeUnavailableError(
            f"tensorwire.native needs a CUDA device, and CuPy finds none ({what} is {type(obj).__name__})"
        )
    raise UnsupportedTensorError(f"{what} must be a cupy.ndarray on a CUDA device, not {type(obj).__name__}")


def _get_kernel(cp: ModuleType, device_id: int, launch: _Launch) -> Any:
    full_key = (device_id, *launch.key)
    fn = _kernels.get(full_key)
    if fn is None:
        with _kernels_lock:
            fn = _kernels.get(full_key)
            if fn is None:
                module = cp.RawModule(code=launch.source())
                fn = module.get_function(launch.name)
                _kernels[full_key] = fn
    return fn


def _sm_count(cp: ModuleType, device_id: int) -> int:
    n = _sm_counts.get(device_id)
    if n is None:
        try:
            n = int(cp.cuda.runtime.getDeviceProperties(device_id)["multiProcessorCount"])
        except Exception:  # pragma: no cover - any sane guess only sizes the grid
            n = 128
        _sm_counts[device_id] = n
    return n


class _StreamHandle:
    """A raw ``cudaStream_t`` dressed in the CUDA stream protocol, for ``Stream.from_external``."""

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.ptr)


def _external_stream(cp: ModuleType, ptr: int) -> Any:
    from_external = getattr(cp.cuda.Stream, "from_external", None)  # CuPy >= 14
    if from_external is not None:
        try:
            return from_external(_StreamHandle(ptr))
        except Exception:  # pragma: no cover - an older protocol; fall back below
            pass
    with warnings.catch_warnings():  # deprecated in CuPy 14, the only way before it
        warnings.simplefilter("ignore", DeprecationWarning)
        return cp.cuda.ExternalStream(ptr)


def _resolve_stream(cp: ModuleType, stream: Any) -> Any:
    if stream is None:
        return cp.cuda.get_current_stream()
    base = getattr(cp.cuda.stream, "BaseStream", None) or getattr(cp.cuda.stream, "_BaseStream", None)
    if isinstance(stream, base or cp.cuda.Stream):
        return stream
    if isinstance(stream, int):
        if stream == 0:  # the legacy default stream (torch's and CuPy's default)
            return cp.cuda.Stream.null
        return _external_stream(cp, stream)
    ptr = getattr(stream, "cuda_stream", None)  # torch.cuda.Stream and friends
    if isinstance(ptr, int):
        return _external_stream(cp, ptr)
    raise UnsupportedTensorError(
        f"stream must be a cupy stream, a raw cudaStream_t or None, not {type(stream).__name__}"
    )


@dataclass(frozen=True)
class _Launch:
    """One kernel launch, planned in pure Python: which kernel class, its grid and its arguments.

    ``key`` names the kernel class (what is compiled and cached per device) and ``args`` are numpy
    scalars whose widths must match the kernel's parameters one for one.
    """

    key: tuple[Any, ...]
    name: str
    grid: tuple[int, ...]
    block: tuple[int, ...]
    args: tuple[Any, ...]

    @property
    def word(self) -> int:
        """Bytes each thread moves at a time (the kernel's word type)."""
        return int(self.key[1] if self.key[0] == "tiled" else self.key[2])

    def source(self) -> str:
        if self.key[0] == "tiled":
            _, word, nrest, index = self.key
            return _tiled_source(self.name, word, nrest, index)
        _, unpack, word, index, ndim = self.key
        return _elementwise_source(self.name, word, index, ndim, unpack)


def _launch(
    plan: _Plan, unpack: bool, src_ptr: int, dst_ptr: int, sm_count: int, narrow_limit: int | None = None
) -> _Launch:
    """The kernel launch for a ``tiled`` or ``elementwise`` plan (a ``memcpy`` plan needs none).

    Indices are 32-bit where every index and offset stays below ``narrow_limit`` (default
    ``_NARROW_LIMIT``; tests lower it to run the 64-bit kernels on small tensors).
    """
    if narrow_limit is None:
        narrow_limit = _NARROW_LIMIT
    word = plan.word
    ndim = len(plan.shape)
    if plan.kind == "tiled":
        axis = plan.tile_axis
        assert axis is not None
        last = ndim - 1
        pstrides = plan.packed_strides
        # src is contiguous along axis a, dst along axis b
        a, b = (last, axis) if unpack else (axis, last)
        s_strides, d_strides = (pstrides, plan.strides) if unpack else (plan.strides, pstrides)
        rest = [d for d in range(ndim) if d not in (a, b)]
        nbatch = math.prod(plan.shape[d] for d in rest)
        span = max(
            sum(abs(s) * (n - 1) for n, s in zip(plan.shape, strides, strict=True))
            for strides in (s_strides, d_strides)
        )
        narrow = (
            max(span, nbatch + _MAX_GRID_YZ, plan.shape[a] + _TILE * _MAX_GRID_YZ, plan.shape[b] + _TILE) < narrow_limit
        )
        index = "int" if narrow else "long long"
        itype: Any = np.int32 if narrow else np.int64
        args: list[Any] = [
            np.uint64(src_ptr),
            np.uint64(dst_ptr),
            itype(plan.shape[a]),
            itype(plan.shape[b]),
            itype(s_strides[a]),
            itype(s_strides[b]),
            itype(d_strides[a]),
            itype(d_strides[b]),
            itype(nbatch),
        ]
        for d in rest:
            args += [itype(plan.shape[d]), itype(s_strides[d]), itype(d_strides[d])]
        grid = (-(-plan.shape[b] // _TILE), min(-(-plan.shape[a] // _TILE), _MAX_GRID_YZ), min(nbatch, _MAX_GRID_YZ))
        return _Launch(
            key=("tiled", word, len(rest), index),
            name=f"tw_tiled_w{word}_{'i32' if narrow else 'i64'}_r{len(rest)}",
            grid=grid,
            block=(_TILE, _TILE_ROWS, 1),
            args=tuple(args),
        )
    n = plan.nwords
    blocks = -(-n // _BLOCK)
    per_sm = _UNPACK_BLOCKS_PER_SM if unpack else _PACK_BLOCKS_PER_SM
    if per_sm:
        blocks = min(blocks, sm_count * per_sm)
    blocks = min(blocks, 2**31 - 1)
    step = blocks * _BLOCK
    wide = n + 4 * step >= narrow_limit
    index = "unsigned long long" if wide else "unsigned int"
    itype = np.uint64 if wide else np.uint32
    args = [np.uint64(src_ptr), np.uint64(dst_ptr), itype(n)]
    for extent, stride in zip(plan.shape, plan.strides, strict=True):
        args += [itype(extent), np.int64(stride)]
    return _Launch(
        key=("elementwise", unpack, word, index, ndim),
        name=f"tw_{'unpack' if unpack else 'pack'}_w{word}_{'i64' if wide else 'i32'}_d{ndim}",
        grid=(blocks,),
        block=(_BLOCK,),
        args=tuple(args),
    )


def _copy(cp: ModuleType, strided: Any, packed: Any, unpack: bool, stream: Any) -> None:
    """Copy between ``strided`` (any layout) and ``packed`` (C-contiguous bytes) on ``stream``."""
    strided_ptr = int(strided.data.ptr)
    packed_ptr = int(packed.data.ptr)
    plan = _plan(tuple(strided.shape), tuple(strided.strides), int(strided.dtype.itemsize), strided_ptr, packed_ptr)
    device_id = int(strided.device.id)
    src_ptr, dst_ptr = (packed_ptr, strided_ptr) if unpack else (strided_ptr, packed_ptr)
    if plan.kind == "memcpy":
        nbytes = plan.nwords * plan.word
        cp.cuda.runtime.memcpyAsync(dst_ptr, src_ptr, nbytes, cp.cuda.runtime.memcpyDeviceToDevice, stream.ptr)
        return
    launch = _launch(plan, unpack, src_ptr, dst_ptr, _sm_count(cp, device_id))
    fn = _get_kernel(cp, device_id, launch)
    fn(launch.grid, launch.block, launch.args)


def pack(src: Any, out: Any = None, stream: Any = None) -> Any:
    """Copy ``src`` (a CuPy array of any layout) into C-order bytes.

    Returns a new C-contiguous 1-D ``uint8`` CuPy array of ``src.nbytes`` bytes holding the
    elements in row-major order (the bytes of ``cupy.ascontiguousarray(src)``), or fills and
    returns ``out``, a C-contiguous CuPy array of exactly ``src.nbytes`` bytes on the same device.
    The copy is enqueued on ``stream`` (a CuPy stream, a raw ``cudaStream_t`` or an object with
    ``cuda_stream``; default: the current CuPy stream) and is not synchronized.
    """
    cp = _cupy()
    _check_array(cp, src, "src")
    nbytes = int(src.nbytes)
    with src.device:
        st = _resolve_stream(cp, stream)
        if out is None:
            with st:
                out = cp.empty(nbytes, dtype=cp.uint8)
        else:
            _check_packed(cp, out, nbytes, src, "out")
        if nbytes:
            with st:
                _copy(cp, src, out, unpack=False, stream=st)
    return out


def unpack(packed: Any, dst: Any, stream: Any = None) -> Any:
    """Write C-order bytes from ``packed`` into ``dst`` (a CuPy array of any layout); returns ``dst``.

    ``packed`` is a C-contiguous CuPy array of exactly ``dst.nbytes`` bytes on ``dst``'s device,
    as :func:`pack` makes. Elements of ``dst``'s base array outside the view are not touched.
    """
    cp = _cupy()
    _check_array(cp, dst, "dst")
    nbytes = int(dst.nbytes)
    _check_packed(cp, packed, nbytes, dst, "packed")
    if dst.size > 1 and any(s == 0 and n > 1 for n, s in zip(dst.shape, dst.strides, strict=True)):
        raise UnsupportedTensorError(
            "dst has overlapping elements (a zero stride, as from broadcasting); "
            "unpack needs every element of dst to own its memory"
        )
    with dst.device:
        st = _resolve_stream(cp, stream)
        if nbytes:
            with st:
                _copy(cp, dst, packed, unpack=True, stream=st)
    return dst


def _check_packed(cp: ModuleType, buf: Any, nbytes: int, like: Any, what: str) -> None:
    _check_array(cp, buf, what)
    if not buf.flags.c_contiguous:
        raise ShapeMismatchError(f"{what} must be C-contiguous (a packed byte buffer), got strides {buf.strides}")
    if int(buf.nbytes) != nbytes:
        raise ShapeMismatchError(f"{what} holds {buf.nbytes} bytes, the tensor needs exactly {nbytes}")
    if int(buf.device.id) != int(like.device.id):
        raise UnsupportedTensorError(f"{what} is on device {buf.device.id}, the tensor on device {like.device.id}")
