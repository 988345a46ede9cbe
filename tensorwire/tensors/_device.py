"""CUDA tensors (torch, CuPy) as tensorwire sees them, the ``device=`` argument, and landing
received bytes in device memory with the consumer's stream in mind.

Streams, as torch and CuPy users expect them:

* Sending: the tensor's bytes are read only after an event recorded on the producer's current
  stream (``torch.cuda.current_stream()`` / CuPy's current stream) at the moment of the send;
  the copy lane waits for that event, never the whole device. A non-contiguous tensor is packed
  by ``tensorwire.native`` on the producer's stream first.
* Receiving: the copies into the destination run on a lane of tensorwire's own that first waits
  for the consumer's current stream; the consumer's stream then waits for the lane's last event.
  So the tensor a recv returns may be used on the consumer's stream at once; another stream
  must be ordered after it as usual (``wait_stream``). The host never waits for the device.

Without CuPy or a device, nothing here imports CuPy until a CUDA tensor is met, and then a
clear :class:`~tensorwire.errors.UnsupportedTensorError` says what to install.
"""

from __future__ import annotations

import asyncio
import functools
import math
import re
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import ConfigurationError, UnsupportedTensorError
from ..memory import CopyEngine, DeviceBuffer, Event, HostEngine, StageIn, download, wait_event
from ._dtypes import DTYPES, dtype_name

__all__ = [
    "Device",
    "DeviceSource",
    "DeviceTensor",
    "EngineArray",
    "Landing",
    "allocate_device",
    "cuda_usable",
    "device_source",
    "offers",
    "parse_device",
    "wanted_device",
]

# dtypes CuPy lacks travel as same-width unsigned integers
_CARRIER = {"bfloat16": "uint16", "float8_e4m3fn": "uint8", "float8_e5m2": "uint8"}
_DEVICE_RE = re.compile(r"(cpu|cuda)(?::([0-9]{1,6}))?")


@dataclass(frozen=True, slots=True)
class Device:
    """Where a received tensor is to live: ``cpu``, ``cuda`` (the current device) or ``cuda:N``."""

    kind: str
    index: int | None = None

    def __str__(self) -> str:
        return self.kind if self.index is None else f"{self.kind}:{self.index}"


CPU = Device("cpu")


def parse_device(device: object) -> Device | None:
    """``device=`` as torch names it: "cpu", "cuda", "cuda:1", 1 (cuda:1), a torch.device or a
    CuPy Device. None stays None (the sender's memory kind, where this process can hold it)."""
    if device is None:
        return None
    if isinstance(device, Device):
        return device
    if isinstance(device, bool):
        raise ConfigurationError(f"device must be a string such as 'cuda:0', an int or a torch.device, not {device!r}")
    if isinstance(device, (int, np.integer)):
        if device < 0:
            raise ConfigurationError(f"device index {device} is negative")
        return Device("cuda", int(device))
    kind = getattr(device, "type", None)
    if isinstance(kind, str):  # torch.device
        index = getattr(device, "index", None)
        return parse_device(kind if index is None else f"{kind}:{index}")
    ident = getattr(device, "id", None)
    if isinstance(ident, int) and type(device).__module__.startswith("cupy"):
        return Device("cuda", ident)
    if not isinstance(device, str):
        raise ConfigurationError(
            f"device must be a string such as 'cuda:0', an int or a torch.device, not {type(device).__name__}"
        )
    m = _DEVICE_RE.fullmatch(device.strip())
    if m is None:
        raise ConfigurationError(f"unknown device {device!r}: tensorwire receives into 'cpu', 'cuda' or 'cuda:N'")
    if m.group(1) == "cpu":
        if m.group(2) is not None and int(m.group(2)) != 0:
            # torch ignores a cpu index; taken here it would name a device that does not exist
            raise ConfigurationError(
                f"unknown device {device!r}: host memory is one device, 'cpu' (or 'cpu:0'); "
                "tensorwire receives into 'cpu', 'cuda' or 'cuda:N'"
            )
        return CPU
    return Device("cuda", None if m.group(2) is None else int(m.group(2)))


@functools.cache
def _device_count() -> int:
    from ..memory._cuda import cuda_device_count

    return cuda_device_count()


def cuda_usable() -> bool:
    """True where CuPy is installed and sees a CUDA device (checked once per process)."""
    return _device_count() > 0


def _no_cuda(what: str) -> UnsupportedTensorError:
    """The error for CUDA memory asked for where there is none: what to install if CuPy is
    missing (raised from here), else that CuPy finds no device."""
    _cp()
    return UnsupportedTensorError(f"{what}, but CuPy finds no CUDA device here")


def wanted_device(device: object, has_out: bool) -> Device | None:
    """A recv's or read's ``device=``, parsed and checked: not with ``out=`` (it already says
    where the bytes go), and a CUDA device that exists here, its index made explicit."""
    want = parse_device(device)
    if want is None:
        return None
    if has_out:
        raise ConfigurationError("pass out= or device=, not both: out= already says where the bytes go")
    return Device("cuda", check_cuda(want.index)) if want.kind == "cuda" else want


def check_cuda(index: int | None) -> int:
    """The device index to allocate on for ``cuda``/``cuda:N``; raises if there is no such device."""
    n = _device_count()
    if n == 0:
        raise _no_cuda(f"device 'cuda{'' if index is None else f':{index}'}' asked for")
    if index is None:
        return _current_device()
    if index >= n:
        raise ConfigurationError(f"device 'cuda:{index}' asked for, but this process sees {n} CUDA device(s)")
    return index


def _torch() -> Any:
    return sys.modules.get("torch")


def _cp() -> Any:
    from ..memory._cuda import cupy_module

    return cupy_module()


def _torch_cuda(torch: Any) -> bool:
    """torch is imported here and built with CUDA (a CPU-only build has no streams to take)."""
    try:
        return torch is not None and bool(torch.cuda.is_available())
    except Exception:
        return False


def _current_device() -> int:
    torch = _torch()
    if _torch_cuda(torch):
        return int(torch.cuda.current_device())
    return int(_cp().cuda.runtime.getDevice())


def _engine(device: int) -> CopyEngine:
    from ..memory._cuda import CudaEngine

    return CudaEngine.get(device)


def _stream(framework: str, device: int) -> int:
    """The framework's current stream on ``device``, as a raw handle."""
    if framework == "torch":
        return int(_torch().cuda.current_stream(device).cuda_stream)
    cp = _cp()
    with cp.cuda.Device(device):
        return int(cp.cuda.get_current_stream().ptr)


def _carrier(name: str) -> np.dtype:
    return np.dtype(_CARRIER.get(name, name)) if name in _CARRIER else DTYPES[name]


def _c_strides(shape: tuple[int, ...], dt: np.dtype) -> tuple[int, ...]:
    """The byte strides of a C-contiguous array of ``shape`` and ``dt`` (a dimension of 0
    counts as 1, as numpy's own C-contiguous arrays have it). Computed, not read off an empty
    numpy array: numpy 2 gives a zero-size array zero strides."""
    strides = []
    step = int(dt.itemsize)
    for n in reversed(shape):
        strides.append(step)
        step *= max(int(n), 1)
    return tuple(reversed(strides))


def _layout(shape: tuple[int, ...], dt: np.dtype, given: Any) -> tuple[tuple[int, ...], bool]:
    """(byte strides, C-contiguous?) of a ``__cuda_array_interface__``'s ``shape`` and its
    ``strides`` entry (None: C-contiguous). The strides of a dimension of size 1 say nothing
    (producers report anything there), and a tensor with no elements is contiguous."""
    c_strides = _c_strides(shape, dt)
    if given is None:
        return c_strides, True
    strides = tuple(int(s) for s in given)
    if len(strides) != len(shape):
        raise UnsupportedTensorError(f"__cuda_array_interface__ has {len(strides)} strides for {len(shape)} dimensions")
    contiguous = any(n == 0 for n in shape) or all(
        s == c for n, s, c in zip(shape, strides, c_strides, strict=True) if n != 1
    )
    return strides, contiguous


# an interleaved layout's elements are listed one by one to tell whether two share a byte; one of
# more elements than this is taken to overlap (no real tensor is laid out so)
_OVERLAP_ELEMENTS = 1 << 20


def overlapping(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> bool:
    """Whether two elements of a layout (byte ``strides``) share a byte: a zero stride
    (``broadcast_to``, torch's ``expand``) or windows cut by ``as_strided``. Bytes written into
    it would overwrite each other. Dimensions sorted by stride clear any ordinary layout at once
    (each steps past all that the smaller ones span); only an interleaved one has its offsets
    listed."""
    if any(n == 0 for n in shape):
        return False
    dims = sorted((abs(st), n) for n, st in zip(shape, strides, strict=True) if n > 1)
    span = itemsize
    for st, n in dims:
        if st < span:
            break
        span += (n - 1) * st
    else:
        return False
    if math.prod(shape) > _OVERLAP_ELEMENTS:
        return True
    offsets = np.zeros(1, np.int64)
    for st, n in dims:
        offsets = (offsets[:, None] + np.arange(n, dtype=np.int64) * st).reshape(-1)
    offsets.sort()
    return bool((np.diff(offsets) < itemsize).any())


def _cupy_view(ptr: int, shape: tuple[int, ...], strides: tuple[int, ...], name: str, device: int, owner: Any) -> Any:
    """A CuPy array over someone else's device memory (no copy, no synchronization)."""
    cp = _cp()
    carrier = _carrier(name)
    if any(n == 0 for n in shape):
        span = 0
    else:
        span = sum((n - 1) * abs(s) for n, s in zip(shape, strides, strict=True)) + carrier.itemsize
    base = ptr - sum((n - 1) * -s for n, s in zip(shape, strides, strict=True) if s < 0)
    mem = cp.cuda.UnownedMemory(base, span, owner, device)
    return cp.ndarray(shape, dtype=carrier, memptr=cp.cuda.MemoryPointer(mem, ptr - base), strides=strides)


# --------------------------------------------------------------------------- device tensors


@dataclass(eq=False, slots=True)
class DeviceTensor:
    """A tensor's wire bytes in device memory: what a send reads, or where a recv writes.

    ``stream``: the framework stream the tensor belongs to (producer's or consumer's).
    ``ready``: sending: the bytes are complete once this event has completed.
    ``value``: receiving: the object handed to the caller (torch / CuPy / EngineArray).
    ``unpack_to``: receiving into a non-contiguous ``out=``: the strided CuPy view that ``buf``
    is unpacked into once every byte has landed.
    """

    buf: DeviceBuffer
    dtype: str
    shape: tuple[int, ...]
    framework: str
    stream: int | None = None
    ready: Event | None = None
    value: Any = field(default=None, repr=False)
    unpack_to: Any = field(default=None, repr=False)

    @property
    def nbytes(self) -> int:
        """Its size in bytes."""
        return self.buf.nbytes

    @property
    def engine(self) -> CopyEngine:
        """The copy engine of the device its memory is on."""
        return self.buf.engine

    @property
    def device(self) -> str:
        """Where its memory is: ``"cuda:N"``."""
        return f"{self.buf.engine.kind}:{self.buf.device}"

    async def to_host(self, until: asyncio.Future[Any] | None = None) -> np.ndarray:
        """Its bytes in a new host array (uint8), read once ``ready`` has completed, through the
        staging chunks (for a transport that cannot read device memory). ``until`` (a channel's
        ``ended``) cuts short the wait for ``ready``: the producer's stream may stay busy."""
        host = np.empty(self.nbytes, np.uint8)
        if self.nbytes:
            await download(self.buf, host.data, self.ready, until)
        return host


@dataclass(eq=False, slots=True)
class DeviceSource:
    """A framework's device tensor as handed to tensorwire (nothing enqueued yet)."""

    value: Any
    framework: str
    engine: CopyEngine
    dtype: str
    shape: tuple[int, ...]
    ptr: int
    strides: tuple[int, ...]  # bytes
    contiguous: bool
    stream: int | None
    readonly: str = ""  # why it may not be written (never a recv's out=): empty when it may
    # the stream came with the object itself (a __cuda_array_interface__ v3 ``stream``), not from
    # its framework's current one: the streams a recv took at its call never replace it
    own_stream: bool = False
    # what ``value`` is a copy of, when it is not the caller's memory (a torch conj/neg view)
    copied: str = ""

    @property
    def nbytes(self) -> int:
        n = DTYPES[self.dtype].itemsize
        for d in self.shape:
            n *= d
        return n

    @property
    def device(self) -> str:
        return f"{self.engine.kind}:{self.engine.device}"

    def wire(self) -> tuple[DeviceTensor, bool]:
        """The bytes to send in C order (packed on the producer's stream if need be), and whether
        they are a copy of tensorwire's: packed, or ``value`` is already one (``copied``). The
        bytes are complete once the returned tensor's ``ready`` event is."""
        engine = self.engine
        if self.contiguous:
            buf = DeviceBuffer(engine, self.ptr, self.nbytes, engine.device, self.value)
            return DeviceTensor(
                buf, self.dtype, self.shape, self.framework, self.stream, engine.record_on(self.stream)
            ), bool(self.copied)
        from ..native import pack

        packed = engine.empty(self.nbytes, self.stream)  # written on the producer's stream
        src = _cupy_view(self.ptr, self.shape, self.strides, self.dtype, engine.device, self.value)
        pack(src, out=packed.owner, stream=self.stream)
        ready = engine.record_on(self.stream)
        return DeviceTensor(packed, self.dtype, self.shape, self.framework, self.stream, ready), True

    def region(self, offset: int, shape: tuple[int, ...]) -> Any:
        """The C-contiguous run of elements starting ``offset`` bytes into this C-contiguous
        tensor, as ``shape``, as an object of the tensor's own framework (no copy): what an
        exposed tensor's owner sends from, or receives into, for rows a peer names."""
        count = math.prod(shape)
        start = offset // DTYPES[self.dtype].itemsize
        value = self.value
        if isinstance(value, EngineArray):
            return EngineArray(
                value.engine, value.array.reshape(-1)[start : start + count].reshape(shape), value.stream
            )
        if self.framework == "torch":
            return value.reshape(-1)[start : start + count].view(shape)
        cp = _cp()
        if isinstance(value, cp.ndarray):
            return value.reshape(-1)[start : start + count].reshape(shape)
        strides = _c_strides(shape, _carrier(self.dtype))
        return _cupy_view(self.ptr + offset, shape, strides, self.dtype, self.engine.device, value)

    def target(self, streams: Streams | None = None) -> DeviceTensor:
        """Where a recv into this tensor writes: its own memory, or a buffer to unpack from.
        Ordered on the consumer's stream: the one of ``streams`` (taken when the recv was
        called) for this framework and device, else the tensor's own; a stream the object names
        itself (``own_stream``) always wins, since its owner uses the memory there."""
        if self.readonly:
            raise UnsupportedTensorError(f"out= {type(self.value).__name__} is read-only ({self.readonly})")
        engine = self.engine
        stream = self.stream
        if streams is not None and engine.kind == "cuda" and not self.own_stream:
            taken = streams.of(self.framework, engine.device)
            if taken is not None:
                stream = taken
        if self.contiguous:
            buf = DeviceBuffer(engine, self.ptr, self.nbytes, engine.device, self.value)
            return DeviceTensor(buf, self.dtype, self.shape, self.framework, stream, value=self.value)
        if overlapping(self.shape, self.strides, _carrier(self.dtype).itemsize):
            raise UnsupportedTensorError(
                "out= tensor has elements that share memory (a zero or overlapping stride, as expand(), "
                "broadcast_to() or as_strided() make), so the values received would overwrite each other; "
                "receive into a tensor of distinct elements"
            )
        view = _cupy_view(self.ptr, self.shape, self.strides, self.dtype, engine.device, self.value)
        # the copies land here and the unpack reads it on a lane of ours; the consumer stream
        # waits for those before its next work, so its pool may hand the block on after that
        return DeviceTensor(
            engine.empty(self.nbytes, stream),
            self.dtype,
            self.shape,
            self.framework,
            stream,
            value=self.value,
            unpack_to=view,
        )


class EngineArray:
    """A C-contiguous numpy array posing as device memory of a :class:`~tensorwire.memory.HostEngine`.

    Moves through exactly the staging code a CUDA tensor does (pinned pools, lanes, events), with
    the host engine in place of a GPU: what tests without a GPU send and receive (``out=``).
    """

    def __init__(self, engine: HostEngine, array: np.ndarray, stream: int | None = None) -> None:
        if not array.flags.c_contiguous:
            raise UnsupportedTensorError("EngineArray needs a C-contiguous array")
        self.engine = engine
        # a subclass (np.matrix, ...) as the plain ndarray over its memory: its own reshape may
        # keep dimensions, and the engine's byte views of it would come out short
        self.array = array if type(array) is np.ndarray else np.ndarray.view(array, np.ndarray)
        self.stream = stream  # from engine.stream(): the framework stream it belongs to, or None

    def __repr__(self) -> str:
        return f"EngineArray({self.engine.name}, {self.array.dtype}{list(self.array.shape)})"


def device_source(obj: object) -> DeviceSource | None:
    """A DeviceSource for a CUDA torch tensor, a CuPy array, a ``__cuda_array_interface__``
    object or an EngineArray; None if ``obj`` is none of those (host tensors)."""
    if isinstance(obj, EngineArray):
        a = obj.array
        name = dtype_name(a.dtype)
        return DeviceSource(
            obj,
            "host-engine",
            obj.engine,
            name,
            tuple(a.shape),
            int(a.ctypes.data),
            tuple(a.strides),
            True,
            obj.stream,
            "" if a.flags.writeable else "its array is read-only",
        )
    torch = _torch()
    if torch is not None and isinstance(obj, torch.Tensor):
        if obj.device.type != "cuda":
            if obj.device.type == "cpu":
                return None
            raise UnsupportedTensorError(f"torch tensor on {obj.device} cannot be moved: only cpu and cuda tensors")
        return _torch_source(obj)
    if getattr(type(obj), "__cuda_array_interface__", None) is not None:
        return _cupy_source(obj)
    if dlpack_device_kind(obj) in _DLPACK_CUDA:
        return _dlpack_source(obj)
    return None


_DLPACK_CUDA = (2, 13)  # kDLCUDA, kDLCUDAManaged: device memory a CUDA stream orders
_DLPACK_PINNED = 3  # kDLCUDAHost: page-locked host memory, written by CUDA streams


def offers(obj: object, name: str) -> bool:
    """``hasattr(obj, name)``, for a protocol attribute (``__dlpack__``, ...) of an object of
    any library: one whose property fails does offer it, and using it then says what failed."""
    try:
        return hasattr(obj, name)
    except Exception:
        return True


def dlpack_device_kind(obj: object) -> int | None:
    """The DLPack device type ``obj`` says it lives on, None if it offers no DLPack."""
    if not offers(obj, "__dlpack__"):
        return None
    try:
        kind, _ = obj.__dlpack_device__()  # type: ignore[attr-defined]
        return int(kind)
    except Exception:
        return None


def _dlpack_source(obj: Any) -> DeviceSource:
    """A CUDA object that offers only DLPack (JAX, ...), imported as a CuPy array over the same
    memory. CuPy hands the producer its current stream (DLPack's ``stream=``), and the producer
    orders its pending writes before that stream (an event, not a host wait), so the send's event
    on that stream follows them. It is never written into (a recv's out=, a writable exposure):
    which stream its owner reads it on is not known, and several such libraries (JAX) treat
    their arrays as immutable."""
    if not cuda_usable():
        raise _no_cuda(f"{type(obj).__name__} is CUDA memory (DLPack)")
    try:
        arr = _cp().from_dlpack(obj)
    except Exception as exc:  # the producer's BufferError, TypeError, ...
        raise UnsupportedTensorError(f"{type(obj).__name__} could not be imported through DLPack: {exc}") from exc
    src = _cupy_source(arr)
    src.readonly = (
        "a DLPack-only CUDA object, whose consumer stream tensorwire cannot know: receive into a torch "
        "tensor or a CuPy array"
    )
    return src


def resolve_torch_bits(t: Any) -> tuple[Any, str, str]:
    """``t`` detached, with torch's lazy conj/neg bits resolved into a copy (on the current
    stream for a CUDA tensor), and the reasons ``(readonly, copied)`` that go with it: a copy
    can be sent but never received into or exposed (the caller's tensor would not see the
    bytes). Both are empty for a plain tensor, which is returned as it is."""
    t = t.detach()
    readonly = copied = ""
    if t.is_conj():
        t = t.resolve_conj()
        copied = "a conjugate view (torch's conj bit)"
        readonly = f"{copied}; receive into a tensor without it, then .conj() that"
    if t.is_neg():
        t = t.resolve_neg()
        copied = copied or "a negative view (torch's neg bit, as x.conj().imag has)"
        readonly = readonly or f"{copied}; receive into a plain tensor"
    return t, readonly, copied


def _torch_source(t: Any) -> DeviceSource:
    t, readonly, copied = resolve_torch_bits(t)
    name = str(t.dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise UnsupportedTensorError(f"torch dtype {t.dtype} is not supported; supported: {', '.join(DTYPES)}")
    device = int(t.device.index if t.device.index is not None else t.get_device())
    item = t.element_size()
    return DeviceSource(
        t,
        "torch",
        _engine(device),
        name,
        tuple(t.shape),
        int(t.data_ptr()),
        tuple(s * item for s in t.stride()),
        bool(t.is_contiguous()),
        _stream("torch", device),
        readonly,
        copied=copied,
    )


def _interface_source(obj: Any) -> DeviceSource:
    """Another library's CUDA array (numba, ...), read from its ``__cuda_array_interface__`` here:
    ``cupy.asarray`` would synchronize the producer's stream on the host (blocking the loop) where
    a send only needs an event on it. Version 3's ``stream`` is the producer's stream (1: the
    legacy default stream, 2: the per-thread default one); without one the data is ready now, and
    CuPy's current stream (where a strided array is packed) stands in."""
    try:
        cai = obj.__cuda_array_interface__
        ptr = int(cai["data"][0])
        shape = tuple(int(n) for n in cai["shape"])
        dt = np.dtype(cai["typestr"])
        given = cai.get("strides")
        stream = cai.get("stream")
        masked = cai.get("mask") is not None
        readonly = "a read-only __cuda_array_interface__" if cai["data"][1] else ""
    except Exception as exc:
        raise UnsupportedTensorError(f"{type(obj).__name__} has no usable __cuda_array_interface__: {exc!r}") from exc
    if masked:
        raise UnsupportedTensorError(f"{type(obj).__name__}: masked CUDA arrays cannot be sent")
    name = dtype_name(dt)
    strides, contiguous = _layout(shape, dt, given)
    if stream is not None and (not isinstance(stream, int) or isinstance(stream, bool) or stream == 0):
        # version 3 forbids 0 (ambiguous between the legacy and the per-thread default stream)
        raise UnsupportedTensorError(
            f"{type(obj).__name__}: __cuda_array_interface__ stream must be None or a nonzero int, not {stream!r}"
        )
    if not cuda_usable():
        raise _no_cuda(f"{type(obj).__name__} is CUDA memory (__cuda_array_interface__)")
    # stream 2 (cudaStreamPerThread) means the calling thread's: the send records on it right
    # here, in the caller's thread, before its first await
    try:
        if ptr == 0:
            device = _current_device()
        else:
            rt = _cp().cuda.runtime
            attrs = rt.pointerGetAttributes(ptr)
            if attrs.type not in (rt.memoryTypeDevice, rt.memoryTypeManaged):
                raise UnsupportedTensorError(f"{type(obj).__name__}: {ptr:#x} is not device memory")
            device = int(attrs.device)
    except UnsupportedTensorError:
        raise
    except Exception as exc:  # cupy's CUDARuntimeError: not a pointer CUDA knows in this process
        raise UnsupportedTensorError(f"{type(obj).__name__}: {ptr:#x} is not CUDA memory here: {exc}") from exc
    raw = _stream("cupy", device) if stream is None else 0 if stream == 1 else int(stream)
    return DeviceSource(
        obj,
        "cupy",
        _engine(device),
        name,
        shape,
        ptr,
        strides,
        contiguous,
        raw,
        readonly,
        own_stream=stream is not None,
    )


def _cupy_source(a: Any) -> DeviceSource:
    cp = _cp()
    if not isinstance(a, cp.ndarray):
        return _interface_source(a)
    name = dtype_name(a.dtype)  # not a.dtype.str: bfloat16's is "<V2", a plain void type
    device = int(a.device.id)
    return DeviceSource(
        a,
        "cupy",
        _engine(device),
        name,
        tuple(a.shape),
        int(a.data.ptr),
        tuple(a.strides),
        bool(a.flags.c_contiguous),
        _stream("cupy", device),
    )


@dataclass(frozen=True, slots=True)
class Streams:
    """The caller's current streams when a recv was called: the device it would allocate on, and
    torch's and CuPy's current stream there (None where that framework is not in use)."""

    device: int
    torch: int | None
    cupy: int | None

    def of(self, framework: str, device: int) -> int | None:
        if device != self.device:
            return None
        return self.torch if framework == "torch" else self.cupy if framework == "cupy" else None


def capture_streams(want: Device | None) -> Streams | None:
    """Take the caller's streams at the moment of the recv (later, another task may have made
    another stream current). Cheap without CUDA: nothing is imported for host-only receivers."""
    if want is not None and want.kind != "cuda":
        return None
    torch = _torch()
    torch_live = torch is not None and bool(torch.cuda.is_initialized())
    # CuPy imported on a machine without a usable GPU (a CPU box with CuPy installed) has no
    # current device or stream to take: such a receiver is host-only unless it asks for cuda
    cupy_live = "cupy" in sys.modules and cuda_usable()
    if want is None and not (torch_live or cupy_live):
        return None
    device = want.index if want is not None and want.index is not None else _current_device()
    return Streams(
        device,
        _stream("torch", device) if torch_live or (want is not None and _torch_cuda(torch)) else None,
        _stream("cupy", device) if cupy_live or want is not None else None,
    )


def _torch_stream(torch: Any, ptr: int, device: int) -> Any:
    """A torch stream object for the raw handle ``ptr`` (its own objects where they match)."""
    for s in (torch.cuda.current_stream(device), torch.cuda.default_stream(device)):
        if int(s.cuda_stream) == ptr:
            return s
    return torch.cuda.ExternalStream(ptr, device=device)


def allocate_device(
    dtype: str, shape: tuple[int, ...], framework: str, device: int, streams: Streams | None = None
) -> DeviceTensor:
    """A new tensor on CUDA device ``device`` for a received one: torch if the sender's was torch
    (and torch is loaded here), else CuPy. Allocated on the consumer's stream (the one current
    when the recv was called, ``streams``, else the current one). No memory for it on the device
    (torch's or CuPy's out-of-memory error): TransferError, and the recv leaves its message queued."""
    torch = _torch()
    engine = _engine(device)
    nbytes = math.prod(shape) * DTYPES[dtype].itemsize
    what = f"a received {dtype} tensor of shape {shape}"
    advice = "receive into a tensor of your own (out=) or free device memory"
    if framework == "torch" and _torch_cuda(torch):  # else CuPy: a CPU-only torch cannot hold it
        stream = streams.of("torch", device) if streams is not None else None
        if stream is None:
            stream = _stream("torch", device)
        with engine.allocating(nbytes, what, advice), torch.cuda.stream(_torch_stream(torch, stream, device)):
            t = torch.empty(shape, dtype=getattr(torch, dtype), device=f"cuda:{device}")
        buf = DeviceBuffer(engine, int(t.data_ptr()), int(t.numel() * t.element_size()), device, t)
        return DeviceTensor(buf, dtype, shape, "torch", stream, value=t)
    from ..memory._cuda import allocating_on

    cp = _cp()
    stream = streams.of("cupy", device) if streams is not None else None
    if stream is None:
        stream = _stream("cupy", device)
    with engine.allocating(nbytes, what, advice), allocating_on(cp, device, stream):
        a = cp.empty(shape, dtype=_carrier(dtype))
    buf = DeviceBuffer(engine, int(a.data.ptr), int(a.nbytes), device, a)
    return DeviceTensor(buf, dtype, shape, "cupy", stream, value=a)


def host_value(arr: np.ndarray, framework: str) -> Any:
    """A received host array as the sender's framework would want it on the host."""
    if framework == "cupy":
        return arr  # CuPy's host counterpart is numpy
    return arr


# --------------------------------------------------------------------------- landing


class Landing:
    """The device side of one received message: a StageIn per device written to, each waiting
    first for the consumer streams of the tensors it writes; ``finish`` hands them over."""

    __slots__ = ("_stages", "_streams")

    def __init__(self) -> None:
        self._stages: dict[CopyEngine, StageIn] = {}
        self._streams: set[tuple[CopyEngine, int | None]] = set()

    def stage(self, target: DeviceTensor, fresh: bool = False) -> StageIn:
        """The lane that writes ``target``, ordered after its stream's work so far (the first
        time that stream is met, or again with ``fresh``: ``target`` was allocated since)."""
        engine = target.engine
        st = self._stages.get(engine)
        if st is None:
            st = self._stages[engine] = StageIn(engine)
        key = (engine, target.stream)
        if fresh or key not in self._streams:
            self._streams.add(key)
            st.lane.wait(engine.record_on(target.stream))  # the consumer's work on it so far
        return st

    def flush(self, target: DeviceTensor) -> Event | None:
        """An event after which every copy queued so far into ``target``'s device has run."""
        st = self._stages.get(target.engine)
        return None if st is None else st.mark()

    def hand_back(self, target: DeviceTensor) -> None:
        """Order ``target``'s stream after every copy of this landing queued so far: the caller's
        buffer is given up (a cancelled recv), or a buffer of ours that the copies read is dropped
        (its stream's pool must not hand the block on before: torch's ``record_stream``).
        Engines without streams wait here."""
        event = self.flush(target)
        if event is not None and not target.engine.stream_wait(target.stream, event):
            event.synchronize()

    async def upload(self, target: DeviceTensor, src: np.ndarray) -> None:
        """Copy host array ``src`` into ``target`` through staging chunks."""
        data = np.asarray(src).reshape(-1).view(np.uint8).data if src.nbytes else memoryview(b"")  # as byte_view

        def fill(view: memoryview, pos: int) -> None:
            view[:] = data[pos : pos + len(view)]

        await self.stage(target, fresh=True).write(lambda: target.buf, 0, target.nbytes, fill)

    def copy(self, target: DeviceTensor, src: DeviceTensor) -> None:
        """Queue a device copy of ``src``'s bytes (landed through this landing) into ``target``."""
        if src.engine is not target.engine:
            raise UnsupportedTensorError(f"cannot copy between {src.device} and {target.device} directly")
        # ``target`` may be a block just taken from its stream's pool (allocated after the
        # landing began): the copy waits for that stream's work queued since
        st = self.stage(target, fresh=True)
        st.device_copy(target.buf, 0, src.buf, 0, target.nbytes)

    async def finish(self, targets: list[Any]) -> None:
        """Every byte has been queued: unpack into strided ``out=`` tensors, then make each
        target's stream wait for the copies (or wait here, for engines without streams)."""
        for t in targets:
            if isinstance(t, DeviceTensor) and t.unpack_to is not None and t.nbytes:
                from ..memory._cuda import lane_stream
                from ..native import unpack

                def run(lane: Any, t: DeviceTensor = t) -> None:
                    unpack(t.buf.owner, t.unpack_to, stream=lane_stream(lane))

                self.stage(t).launch(run)
        done: dict[CopyEngine, Event | None] = {e: st.finish() for e, st in self._stages.items()}
        for t in targets:
            if not isinstance(t, DeviceTensor):
                continue
            event = done.get(t.engine)
            if event is None:
                continue
            if not t.engine.stream_wait(t.stream, event):
                await wait_event(t.engine, event)

    def finish_now(self, targets: list[Any]) -> None:
        """``finish`` without awaiting (for cancellation paths): engines without streams block."""
        done: dict[CopyEngine, Event | None] = {e: st.finish() for e, st in self._stages.items()}
        for t in targets:
            if isinstance(t, DeviceTensor):
                event = done.get(t.engine)
                if event is not None and not t.engine.stream_wait(t.stream, event):
                    event.synchronize()
