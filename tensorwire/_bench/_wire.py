"""What both ends of a bench share: the reserved tags, the plain socket's framing, sizes,
and the buffers (host or CUDA) that are sent, received, stamped and summed."""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import struct
from typing import Any

import crc32c
import numpy as np

from .. import _metrics
from ..tensors._device import Device, check_cuda, parse_device

_BASE = -0x7477_424E_0000_0000  # "twBN": far from the RPC and one-sided ranges and hashed string tags
REQUEST_TAG = _BASE - 1
ANSWER_TAG = _BASE - 2
DATA_TAG = _BASE - 3
PING_TAG = _BASE - 4
PONG_TAG = _BASE - 5
# an RPC method offered by a node that runs the bench service (``offer_bench``): the client calls
# it first, and a node without one, which would never answer a request, says so (MethodNotFound)
SERVICE_METHOD = "tw.bench"
_metrics.traffic_tags(range(PONG_TAG, _BASE), "bench")

RAW_HEAD = struct.Struct("<IQQ")  # op, size, count
RAW_CRC = struct.Struct("<I")
RAW_SINK, RAW_PING = 1, 2
SECRET_BYTES = 16
PING_BYTES = 8
STALL_S = 60.0  # the baseline socket moving no byte for this long is a failure
MAX_COUNT = 1_000_000
_CRC_INLINE = 1 << 20  # larger buffers are summed in a thread

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE_RE = re.compile(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([KMGT]?)(?:I?B)?", re.IGNORECASE)
MAX_SIZE = 1 << 40


def parse_sizes(text: str) -> list[int]:
    """``"4K,1M,64M"`` (binary units K, M, G, T; ``KiB``, ``MB`` and plain bytes too) as bytes.
    ValueError says which entry is wrong."""
    sizes = []
    for part in text.split(","):
        m = _SIZE_RE.fullmatch(part.strip())
        if m is None:
            raise ValueError(f"{part.strip()!r} is not a size such as 4K, 1M, 64M or 4096")
        value = float(m[1]) * _UNITS[m[2].upper()]
        if value != int(value) or not 1 <= value <= MAX_SIZE:
            raise ValueError(f"{part.strip()!r}: a size is a whole number of bytes from 1 to 1T")
        sizes.append(int(value))
    return sizes


def fmt_size(n: int) -> str:
    for unit, v in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= v and n % v == 0:
            return f"{n // v} {unit}"
    return f"{n} B"


def bench_device(text: str) -> Device:
    """``--device``: ``cpu``, or a CUDA device that exists here (its index made explicit);
    ConfigurationError or UnsupportedTensorError (no CuPy, no device) otherwise."""
    device = parse_device(text)
    assert device is not None
    return device if device.kind == "cpu" else Device("cuda", check_cuda(device.index))


def cupy() -> Any:
    from ..memory._cuda import cupy_module

    return cupy_module()


def allocate(size: int, device: Device) -> Any:
    if device.kind == "cpu":
        return np.empty(size, np.uint8)
    cp = cupy()
    with cp.cuda.Device(device.index):
        return cp.empty(size, cp.uint8)


def host_bytes(arr: Any, device: Device) -> np.ndarray:
    """``arr``'s bytes on the host, once every queued write to it has run (blocking: a thread's)."""
    if device.kind == "cpu":
        return np.asarray(arr)
    cp = cupy()
    dev = cp.cuda.Device(device.index)
    with dev:
        dev.synchronize()  # every stream: tensorwire's copy lanes and the caller's
        return np.asarray(cp.asnumpy(arr))


async def crc_of(arr: Any, device: Device) -> int:
    if device.kind == "cpu" and arr.nbytes <= _CRC_INLINE:
        return int(crc32c.crc32c(arr.data))
    return await asyncio.to_thread(lambda: int(crc32c.crc32c(host_bytes(arr, device).data)))


def stamp(arr: Any, nonce: bytes) -> None:
    """Write ``nonce`` over the first and the last (up to) 8 bytes of ``arr`` (host or CUDA)."""
    k = min(len(nonce), arr.shape[0])
    value: Any = np.frombuffer(nonce[:k], np.uint8)
    with contextlib.nullcontext() if isinstance(arr, np.ndarray) else arr.device:  # CuPy: the array's device
        if not isinstance(arr, np.ndarray):
            value = cupy().asarray(value)  # on the current stream, which tensorwire's send orders after
        arr[:k] = value
        arr[arr.shape[0] - k :] = value


def recv_exact(conn: socket.socket, view: memoryview) -> bool:
    """Fill ``view`` from ``conn``; False if the other end closed first."""
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if n == 0:
            return False
        got += n
    return True
