"""tensorwire.native's kernels compiled by NVRTC without a GPU.

The pack/unpack kernels are CUDA C generated at run time and compiled through CuPy's NVRTC
bindings, the library ``cupy.RawModule`` uses on a GPU. NVRTC needs no device, so here every
kernel class the launch planner asks for is compiled to PTX, and the PTX is held against the
launch: one parameter per argument with the argument's width, a block no larger than the
kernel's launch bounds, and 16-byte words moved as one vector load and store. A kernel that does
not compile, or a launch whose arguments are laid out differently from the kernel's parameters,
fails here instead of on the first GPU that runs it.
"""

from __future__ import annotations

import math
import re
import warnings
from functools import cache
from typing import Any

import pytest

with warnings.catch_warnings():  # CuPy's own import-time notices are not ours to fail on
    warnings.simplefilter("ignore")
    cp = pytest.importorskip("cupy", reason="CuPy is not installed: NVRTC comes through it", exc_type=ImportError)
    from cupy.cuda import nvrtc


def _nvrtc_version() -> tuple[int, int] | None:
    try:
        return tuple(nvrtc.getVersion())  # type: ignore[return-value]
    except Exception:
        return None


if _nvrtc_version() is None:
    pytest.skip(
        "CuPy finds no NVRTC library (pip install nvidia-cuda-nvrtc-cu12, part of the dev extra)",
        allow_module_level=True,
    )

from tensorwire.native._pack import _MAX_GRID_YZ, _Launch, _launch, _Plan  # noqa: E402

WORDS = (1, 2, 4, 8, 16)
SM_COUNT = 132  # an H100's; only sizes the pack grid
# compute_75 is the oldest architecture CUDA 13 still compiles for, compute_90 the H100/H200
ARCHS = ("compute_75", "compute_90")


def _plans(word: int) -> dict[str, _Plan]:
    """Plans (shape and strides in words) that reach every kernel class, narrow and wide indices."""
    return {
        # elementwise: a slice of rows, a strided 3-d view, 9 and 33 axes, and one past 2**31 words
        "rows": _Plan(word, (64, 48), (64, 1)),
        "step3": _Plan(word, (5, 7, 9), (300, 30, 3)),
        "axes9": _Plan(word, (2,) * 9, tuple(2 ** (k + 1) for k in range(9, 0, -1))),
        "axes33": _Plan(word, (2,) * 33, tuple(2 ** (k + 1) for k in range(33, 0, -1))),
        "rows-wide": _Plan(word, (2**20, 2**12), (2**13, 1)),
        # tiled: a transpose, one with a batch axis, one with six, and a transpose past 2**31 words
        "transpose": _Plan(word, (40, 24), (1, 40)),
        "transpose-batch": _Plan(word, (3, 40, 24), (960, 1, 40)),
        "transpose-rest6": _Plan(word, (2, 2, 2, 2, 2, 2, 17, 19), (*(646 * 2**k for k in range(5, -1, -1)), 1, 17)),
        "transpose-wide": _Plan(word, (2**16, 2**16), (1, 2**16)),
    }


def _launches() -> dict[tuple[Any, ...], _Launch]:
    """One launch per kernel class the planner chose for the plans above, both directions."""
    out: dict[tuple[Any, ...], _Launch] = {}
    for word in WORDS:
        for name, plan in _plans(word).items():
            expected = "tiled" if name.startswith("transpose") else "elementwise"
            assert plan.kind == expected, (name, plan)
            for unpack in (False, True):
                launch = _launch(plan, unpack, src_ptr=0x7F00_0000_0000, dst_ptr=0x7F10_0000_0000, sm_count=SM_COUNT)
                out.setdefault(launch.key, launch)
    return out


LAUNCHES = _launches()


@cache
def _ptx(name: str, source: str, arch: str) -> str:
    prog = nvrtc.createProgram(source, f"{name}.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(prog, [f"-arch={arch}"])
        except nvrtc.NVRTCError as exc:
            log = nvrtc.getProgramLog(prog)
            log = log.decode() if isinstance(log, bytes) else log
            raise AssertionError(f"{name} does not compile for {arch}: {exc}\n{log}\n{source}") from exc
        ptx = nvrtc.getPTX(prog)
        return ptx.decode() if isinstance(ptx, bytes) else str(ptx)
    finally:
        nvrtc.destroyProgram(prog)


def _entry(ptx: str, name: str) -> str:
    m = re.search(rf"\.entry {re.escape(name)}\((.*?)\)(.*?)\{{", ptx, re.S)
    assert m, f"no .entry {name} in the PTX"
    return m.group(0)


def test_the_plans_reach_every_kernel_class() -> None:
    keys = set(LAUNCHES)
    for word in WORDS:
        for unpack in (False, True):
            for index in ("unsigned int", "unsigned long long"):
                assert any(k[:4] == ("elementwise", unpack, word, index) for k in keys), (word, unpack, index)
        for index in ("int", "long long"):
            assert any(k[0] == "tiled" and k[1] == word and k[3] == index for k in keys), (word, index)
    assert {k[2] for k in keys if k[0] == "tiled"} == {0, 1, 6}
    assert len({launch.name for launch in LAUNCHES.values()}) == len(LAUNCHES), "two kernel classes share a name"


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("key", list(LAUNCHES), ids=[launch.name for launch in LAUNCHES.values()])
def test_kernel_compiles_and_matches_its_launch(key: tuple[Any, ...], arch: str) -> None:
    launch = LAUNCHES[key]
    entry = _entry(_ptx(launch.name, launch.source(), arch), launch.name)

    params = re.findall(rf"\.param \.[bsuf](\d+) {re.escape(launch.name)}_param_(\d+)", entry)
    assert [int(i) for _, i in params] == list(range(len(params)))
    widths = [int(bits) // 8 for bits, _ in params]
    assert widths == [int(a.dtype.itemsize) for a in launch.args], (
        f"{launch.name}: the kernel takes parameters of {widths} bytes, the launch passes "
        f"{[int(a.dtype.itemsize) for a in launch.args]}"
    )
    for a in launch.args:  # every argument fits its type (numpy would have refused, but say it)
        assert int(a) == a.item()

    maxntid = re.search(r"\.maxntid (\d+), (\d+), (\d+)", entry)
    assert maxntid, f"{launch.name} has no launch bounds"
    assert math.prod(launch.block) <= math.prod(int(x) for x in maxntid.groups())
    assert 1 <= launch.grid[0] <= 2**31 - 1
    assert all(1 <= g <= _MAX_GRID_YZ for g in launch.grid[1:])


@pytest.mark.parametrize(
    "key", [k for k, launch in LAUNCHES.items() if launch.word == 16], ids=lambda k: LAUNCHES[k].name
)
def test_sixteen_byte_words_move_as_one_vector(key: tuple[Any, ...]) -> None:
    launch = LAUNCHES[key]
    ptx = _ptx(launch.name, launch.source(), ARCHS[-1])
    vector = r"\.v(?:2\.[bu]64|4\.[bu]32)"
    assert re.search(rf"ld(?:\.global)?(?:\.nc)?{vector}", ptx), f"{launch.name} loads 16-byte words piecemeal"
    assert re.search(rf"st(?:\.global|\.shared)?{vector}", ptx), f"{launch.name} stores 16-byte words piecemeal"


def test_a_broken_kernel_is_reported_with_nvrtcs_log() -> None:
    with pytest.raises(AssertionError, match=r"(?s)does not compile.*identifier \"y\" is undefined"):
        _ptx("tw_broken", 'extern "C" __global__ void tw_broken(int* x) { x[0] = y; }', ARCHS[-1])
