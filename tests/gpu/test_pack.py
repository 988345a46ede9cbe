"""tensorwire.native pack/unpack on a CUDA GPU, checked byte for byte against CuPy and numpy.

Every test draws fresh random bytes; the seed is in the test's failure message.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
from _gpu_skip import cupy_with_a_device, most_of_the_device

cp = cupy_with_a_device("the GPU pack/unpack tests")

if os.environ.get("TENSORWIRE_TEST_NO_POOL"):  # exact allocations, for compute-sanitizer runs
    cp.cuda.set_allocator(None)

from tensorwire.errors import ShapeMismatchError, TensorError, UnsupportedTensorError  # noqa: E402
from tensorwire.native import pack, unpack  # noqa: E402
from tensorwire.native._pack import _plan  # noqa: E402
from tensorwire.testing import PACK_LAYOUTS  # noqa: E402

pytestmark = pytest.mark.gpu

POISON = 0xA5

DTYPES = {
    "bool": np.bool_,
    "int8": np.int8,
    "float16": np.float16,
    "bfloat16": np.uint16,  # bfloat16 travels as its 16-bit pattern
    "float32": np.float32,
    "float64": np.float64,
    "complex128": np.complex128,
}


def _seed() -> int:
    return int(np.random.SeedSequence().entropy % (1 << 63))


def _random_base(shape: tuple[int, ...], dtype: Any, seed: int) -> tuple[Any, np.ndarray]:
    """A fresh random C-contiguous CuPy array and the same bytes on the host as a void array."""
    rng = np.random.default_rng(seed)
    itemsize = np.dtype(dtype).itemsize
    n = int(np.prod(shape, dtype=np.int64))
    raw = rng.integers(0, 256, size=n * itemsize, dtype=np.uint8)
    if np.dtype(dtype) == np.bool_:
        raw &= 1  # only 0/1 are valid bools
    host = raw.view(f"V{itemsize}").reshape(shape)
    dev = cp.asarray(raw).view(dtype).reshape(shape)
    return dev, host


def _host_bytes(x: np.ndarray) -> bytes:
    return np.ascontiguousarray(x).tobytes()


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("layout", list(PACK_LAYOUTS))
def test_pack_unpack_roundtrip(layout: str, dtype: str) -> None:
    seed = _seed()
    why = f"layout={layout} dtype={dtype} seed={seed}"
    base_shape, view = PACK_LAYOUTS[layout]
    np_dtype = DTYPES[dtype]
    base, host_base = _random_base(base_shape, np_dtype, seed)
    x, host_x = view(base), view(host_base)
    assert x.shape == host_x.shape and x.strides == host_x.strides

    # pack into a poisoned buffer: equal to CuPy's own contiguous copy and to numpy's
    out = cp.full(x.nbytes, POISON, dtype=cp.uint8)
    got = pack(x, out=out)
    assert got is out
    reference = cp.ascontiguousarray(x).reshape(-1).view(cp.uint8)
    assert bool(cp.array_equal(out, reference)), why
    assert out.get().tobytes() == _host_bytes(host_x), why
    fresh = pack(x)
    assert fresh.dtype == cp.uint8 and fresh.ndim == 1 and fresh.flags.c_contiguous and fresh.nbytes == x.nbytes
    assert bool(cp.array_equal(fresh, reference)), why

    # unpack into the same layout over a poisoned base: the view gets x, the rest stays poisoned
    dst_base = cp.full(base.nbytes, POISON, dtype=cp.uint8).view(np_dtype).reshape(base_shape)
    dst = view(dst_base)
    assert unpack(out, dst) is dst
    expected_base = np.full(base.nbytes, POISON, dtype=np.uint8).view(host_base.dtype).reshape(base_shape)
    view(expected_base)[...] = host_x
    assert dst_base.get().tobytes() == expected_base.tobytes(), why
    assert bool(cp.array_equal(cp.ascontiguousarray(dst).reshape(-1).view(cp.uint8), reference)), why


@pytest.mark.parametrize("dtype", ["int8", "float32", "complex128"])
@pytest.mark.parametrize("layout", [k for k in PACK_LAYOUTS if k not in ("0d", "empty", "empty-slice")])
def test_64bit_index_kernels(layout: str, dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The 64-bit index variants (used past 2**31 words) on small tensors, with few blocks."""
    from tensorwire.native import _pack

    monkeypatch.setattr(_pack, "_NARROW_LIMIT", 0)
    monkeypatch.setattr(_pack, "_PACK_BLOCKS_PER_SM", 1)
    monkeypatch.setattr(_pack, "_UNPACK_BLOCKS_PER_SM", 1)
    test_pack_unpack_roundtrip(layout, dtype)


@pytest.mark.parametrize("layout", ["transpose", "row-slice", "8d-slices", "contiguous"])
def test_unpack_into_other_layout(layout: str) -> None:
    """pack(x) unpacked into a differently laid out array of the same shape gives the same values."""
    seed = _seed()
    base_shape, view = PACK_LAYOUTS[layout]
    x = view(_random_base(base_shape, np.float32, seed)[0])
    dst = cp.full(x.shape[::-1], np.nan, dtype=cp.float32).T  # F order
    unpack(pack(x), dst)
    assert bool(cp.array_equal(dst.view(cp.uint32), x.view(cp.uint32))), seed


def test_broadcast_source_packs() -> None:
    seed = _seed()
    a, host = _random_base((5, 1, 7), np.float64, seed)
    x = cp.broadcast_to(a, (5, 4, 7))
    assert pack(x).get().tobytes() == _host_bytes(np.broadcast_to(host, (5, 4, 7))), seed
    with pytest.raises(UnsupportedTensorError, match="zero stride"):
        unpack(cp.zeros(x.nbytes, cp.uint8), x)


def test_misaligned_views() -> None:
    """Byte offsets that rule out wide words still copy exactly."""
    seed = _seed()
    raw, host = _random_base((4099,), np.uint8, seed)
    for start in range(1, 9):
        x = raw[start : start + 64 * 48].reshape(64, 48)[:, 3:45].T
        hx = host[start : start + 64 * 48].reshape(64, 48)[:, 3:45].T
        out = cp.full(x.nbytes + 3, POISON, cp.uint8)[1 : 1 + x.nbytes]  # misaligned output too
        pack(x, out=out)
        assert out.get().tobytes() == _host_bytes(hx), (seed, start)
        dst = cp.zeros((42, 80), cp.uint8)[:, 5:69]
        unpack(out, dst)
        assert bool(cp.array_equal(dst, x)), (seed, start)


def test_streams() -> None:
    seed = _seed()
    x = _random_base((1024, 520), np.float32, seed)[0][:, 4:516].T
    reference = cp.ascontiguousarray(x).reshape(-1).view(cp.uint8)
    cp.cuda.Device().synchronize()  # the uploads ran on the legacy stream, which non-blocking ones ignore
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        out = pack(x)  # the current stream
    stream.synchronize()
    assert bool(cp.array_equal(out, reference)), seed
    other = cp.cuda.Stream(non_blocking=True)
    out2 = cp.zeros_like(out)
    cp.cuda.get_current_stream().synchronize()
    pack(x, out=out2, stream=other)
    dst = cp.zeros((1024, 520), cp.float32)[:, 4:516].T
    unpack(out2, dst, stream=other.ptr)  # a raw cudaStream_t
    other.synchronize()
    assert bool(cp.array_equal(out2, reference)), seed
    assert bool(cp.array_equal(dst.view(cp.uint32), x.view(cp.uint32))), seed


def test_errors() -> None:
    x = cp.zeros((8, 6), cp.float32).T
    with pytest.raises(ShapeMismatchError, match="bytes"):
        pack(x, out=cp.empty(x.nbytes - 1, cp.uint8))
    with pytest.raises(ShapeMismatchError, match="C-contiguous"):
        pack(x, out=cp.empty(2 * x.nbytes, cp.uint8)[::2])
    with pytest.raises(UnsupportedTensorError, match=r"cupy\.ndarray"):
        pack(np.zeros(3))
    with pytest.raises(TensorError):
        unpack(cp.empty(3, cp.uint8), x)


def test_plan_choices_on_device_arrays() -> None:
    a = cp.zeros((256, 512), cp.float32)
    p = _plan(a.T.shape, a.T.strides, 4, a.data.ptr, 0)
    assert p.kind == "tiled"
    p = _plan(a[:, 128:384].shape, a[:, 128:384].strides, 4, a[:, 128:384].data.ptr, 0)
    assert (p.kind, p.word) == ("elementwise", 16)


def test_more_than_2_to_32_words() -> None:
    """Past 2**32 words the kernels switch to 64-bit indices."""
    with most_of_the_device():  # (test_cuda_edges.py fills the device to 2 GiB)
        need = 40 << 30
        free, _ = cp.cuda.runtime.memGetInfo()
        if free < need:
            pytest.skip(f"needs {need >> 30} GiB of free GPU memory, {free >> 30} GiB free")
        rows, cols = 65600, 65600  # 4.3e9 one-byte words through a step slice
        base = cp.empty((rows, 2 * cols), cp.uint8)
        flat = base.reshape(-1).view(cp.uint64)
        pattern = cp.arange(flat.size, dtype=cp.uint64)
        pattern *= cp.uint64(0x9E3779B97F4A7C15)
        flat[...] = pattern
        del pattern
        x = base[:, 1::2]
        packed = pack(x)
        assert bool(cp.array_equal(packed.reshape(rows, cols), x))
        del flat
        base[...] = 0
        unpack(packed, x)
        assert bool(cp.array_equal(packed.reshape(rows, cols), x))
        assert not bool(base[:, ::2].any())
