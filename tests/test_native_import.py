"""tensorwire.native without a GPU: importing it needs no CuPy, calling it says what is missing,
and the copy planner (pure Python) maps every layout onto the right bytes."""

import sys

import numpy as np
import pytest

from tensorwire.errors import TensorError, UnsupportedTensorError
from tensorwire.testing import PACK_LAYOUTS


def test_import_without_cupy_and_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)  # makes `import cupy` raise ImportError
    for name in [m for m in sys.modules if m.startswith("tensorwire.native")]:
        monkeypatch.delitem(sys.modules, name)
    import tensorwire.native as native

    assert "cupy" not in [m for m in sys.modules if sys.modules[m] is not None]
    with pytest.raises(native.NativeUnavailableError, match=r"CuPy") as info:
        native.pack(np.zeros(3))
    assert isinstance(info.value, TensorError)
    assert isinstance(info.value, UnsupportedTensorError)
    assert "pip install cupy" in str(info.value)
    with pytest.raises(TensorError, match=r"CuPy"):
        native.unpack(np.zeros(3, np.uint8), np.zeros(3, np.uint8))


# ------------------------------------------------------------------ the planner, simulated


def _layouts():
    # the GPU tests' layouts that hold elements, and a broadcast (a zero stride), which packs too
    layouts = {name: spec for name, spec in PACK_LAYOUTS.items() if "empty" not in name}
    layouts["broadcast"] = ((5, 1, 7), lambda a: np.broadcast_to(a, (5, 4, 7)))
    return layouts


@pytest.mark.parametrize("itemsize", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("layout", list(_layouts()))
@pytest.mark.parametrize("packed_offset", [0, 4])
def test_plan_maps_every_layout(layout: str, itemsize: int, packed_offset: int) -> None:
    from tensorwire.native._pack import _plan

    base_shape, view = _layouts()[layout]
    rng = np.random.default_rng()
    n = int(np.prod(base_shape)) * itemsize
    buf = rng.integers(0, 256, size=n + 64, dtype=np.uint8)
    base = buf[16 : 16 + n].view(f"V{itemsize}").reshape(base_shape)
    x = view(base)
    plan = _plan(x.shape, x.strides, itemsize, x.ctypes.data, 256 + packed_offset)
    assert plan.word in (1, 2, 4, 8, 16)
    assert plan.nwords * plan.word == x.nbytes
    assert x.ctypes.data % plan.word == 0 and (256 + packed_offset) % plan.word == 0
    # what the kernels do: word i of the packed side <-> word at offset(i) of the strided side
    origin = x.ctypes.data - buf.ctypes.data
    words = np.lib.stride_tricks.as_strided(
        buf[origin:], shape=(*plan.shape, plan.word), strides=(*(s * plan.word for s in plan.strides), 1)
    )
    assert words.tobytes() == np.ascontiguousarray(x).tobytes()
    assert plan.kind in ("memcpy", "tiled", "elementwise")
    if plan.kind == "tiled":
        assert plan.tile_axis is not None and abs(plan.strides[plan.tile_axis]) == 1


def test_plan_kinds() -> None:
    from tensorwire.native._pack import _plan

    def kind(x: np.ndarray) -> tuple[str, int]:
        p = _plan(x.shape, x.strides, x.itemsize, x.ctypes.data & ~255, 0)
        return p.kind, p.word

    a = np.zeros((256, 512), np.float32)
    assert kind(a) == ("memcpy", 16)
    assert kind(a[:, 128:384]) == ("elementwise", 16)
    assert kind(a.T) == ("tiled", 4)
    assert kind(np.zeros((8, 64, 64, 32), np.float16).transpose(0, 3, 1, 2)) == ("tiled", 2)
    assert kind(a[:, ::2]) == ("elementwise", 4)
    assert kind(np.zeros((), np.complex128)) == ("memcpy", 16)
    assert kind(np.zeros((4, 8), np.float64).T) == ("elementwise", 8)  # too small to tile


def test_kernel_sources_are_generated() -> None:
    from tensorwire.native._pack import _elementwise_source, _tiled_source

    src = _elementwise_source("tw_pack_w4_i32_d3", 4, "unsigned int", 3, unpack=False)
    assert "tw_pack_w4_i32_d3(" in src and "s2" in src and "__global__" in src
    src = _tiled_source("tw_tiled_w16_r2", 16, 2)
    assert "tw_word16 tile[32]" in src and "ds1" in src


def test_launch_reads_the_narrow_limit_when_called(monkeypatch: pytest.MonkeyPatch) -> None:
    """tests/gpu lowers _NARROW_LIMIT to run the 64-bit kernels on small tensors: the launch must see it."""
    from tensorwire.native import _pack

    plan = _pack._Plan(4, (64, 48), (64, 1))
    assert _pack._launch(plan, False, 0, 0, sm_count=1).key[3] == "unsigned int"
    monkeypatch.setattr(_pack, "_NARROW_LIMIT", 0)
    assert _pack._launch(plan, False, 0, 0, sm_count=1).key[3] == "unsigned long long"
    tiled = _pack._Plan(4, (40, 24), (1, 40))
    assert _pack._launch(tiled, True, 0, 0, sm_count=1).key[3] == "long long"
