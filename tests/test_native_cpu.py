"""tensorwire.native's pack and unpack kernels run on the CPU, checked byte for byte against numpy.

The generated CUDA C is compiled by the host's C++ compiler with a shim that supplies what CUDA
would (threadIdx, blockIdx, gridDim, blockDim, __shared__, __syncthreads). Each copy is planned
exactly as on a GPU (``_plan``, then ``_launch``, with the real host pointers), and its launch runs
block by block: a block's threads as fibers that all reach each ``__syncthreads`` before any goes
on where the kernel syncs, one after the other where it never does. Every layout the GPU tests
use runs at every word size, both directions, with a one-SM pack grid so that the grid-stride
loops turn over.

This checks the kernels' index arithmetic and the arguments each launch passes. It says nothing
about the GPU's memory model, coalescing or speed; tests/gpu and the GPU benchmarks check those on
a device.
"""

from __future__ import annotations

import ctypes
import math
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import pytest

from tensorwire.native._pack import _WORD_TYPES, _Launch, _launch, _plan
from tensorwire.testing import PACK_LAYOUTS
from tensorwire.testing._layouts import View

CXX = shutil.which("g++") or shutil.which("clang++")
pytestmark = pytest.mark.skipif(CXX is None, reason="no C++ compiler (g++ or clang++) to build the kernels for the CPU")

POISON = 0xA5
ITEMSIZES = (1, 2, 4, 8, 16)
LARGE = {"transpose-large", "step-large"}  # millions of elements: two word sizes are enough

SHIM = r"""
#include <ucontext.h>
#include <functional>
#include <vector>

struct tw_dim3 { unsigned int x, y, z; };
static tw_dim3 threadIdx, blockIdx, gridDim, blockDim;

// A block whose kernel syncs runs its threads as fibers on this one OS thread: each runs until
// it reaches __syncthreads (or its end) and hands control back; once every fiber has, the next
// round starts, so no thread passes a barrier before all have reached it.
static ucontext_t tw_scheduler, *tw_fiber;
static const std::function<void()>* tw_body;
static bool tw_finished;
static inline void __syncthreads() { swapcontext(tw_fiber, &tw_scheduler); }
static void tw_fiber_main() { (*tw_body)(); tw_finished = true; }

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
#define __shared__ static  /* one block runs at a time, so a block's shared memory is one static */

static void tw_run(const unsigned (&grid)[3], const unsigned (&block)[3], bool syncs,
                   const std::function<void()>& kernel) {
    gridDim = {grid[0], grid[1], grid[2]};
    blockDim = {block[0], block[1], block[2]};
    const unsigned n = block[0] * block[1] * block[2];
    const size_t stack = 64 * 1024;
    std::vector<char> stacks(syncs ? n * stack : 0);
    std::vector<ucontext_t> fibers(syncs ? n : 0);
    std::vector<char> done(n);
    tw_body = &kernel;
    for (unsigned z = 0; z < grid[2]; ++z)
    for (unsigned y = 0; y < grid[1]; ++y)
    for (unsigned x = 0; x < grid[0]; ++x) {
        blockIdx = {x, y, z};
        for (unsigned t = 0; t < n; ++t) {
            threadIdx = {t % block[0], t / block[0] % block[1], t / (block[0] * block[1])};
            if (!syncs) { kernel(); continue; }
            getcontext(&fibers[t]);
            fibers[t].uc_stack.ss_sp = &stacks[t * stack];
            fibers[t].uc_stack.ss_size = stack;
            fibers[t].uc_link = &tw_scheduler;
            makecontext(&fibers[t], tw_fiber_main, 0);
            done[t] = 0;
        }
        for (unsigned left = syncs ? n : 0; left;) {
            for (unsigned t = 0; t < n; ++t) {
                if (done[t]) continue;
                threadIdx = {t % block[0], t / block[0] % block[1], t / (block[0] * block[1])};
                tw_fiber = &fibers[t];
                tw_finished = false;
                swapcontext(&tw_scheduler, &fibers[t]);
                if (tw_finished) { done[t] = 1; --left; }
            }
        }
    }
}
"""

_C_TYPES = {
    np.dtype(np.uint64): ("unsigned long long", ctypes.c_uint64),
    np.dtype(np.int64): ("long long", ctypes.c_int64),
    np.dtype(np.uint32): ("unsigned int", ctypes.c_uint32),
    np.dtype(np.int32): ("int", ctypes.c_int32),
}


def _wrapper(k: int, launch: _Launch) -> str:
    """The kernel in a namespace of its own, and a C entry point that runs its launch."""
    word = launch.key[1] if launch.key[0] == "tiled" else launch.key[2]
    w = _WORD_TYPES[word]
    w = f"tw_k{k}::{w}" if w.startswith("tw_") else w
    params = ", ".join(f"{_C_TYPES[a.dtype][0]} a{i}" for i, a in enumerate(launch.args))
    rest = "".join(f", a{i}" for i in range(2, len(launch.args)))
    syncs = "true" if "__syncthreads" in launch.source() else "false"
    return f"""
namespace tw_k{k} {{
{launch.source()}
}}
extern "C" void run_{launch.name}(const unsigned* grid, const unsigned* block, {params}) {{
    const unsigned g[3] = {{grid[0], grid[1], grid[2]}}, b[3] = {{block[0], block[1], block[2]}};
    tw_run(g, b, {syncs}, [=] {{ tw_k{k}::{launch.name}((const {w}*)a0, ({w}*)a1{rest}); }});
}}
"""


@dataclass
class Case:
    """One planned copy with its buffers kept alive, and the check of its result."""

    launch: _Launch | None  # None: the plan is a plain memcpy, no kernel
    check: Callable[[], None]


def _aligned(nbytes: int, offset: int = 0) -> np.ndarray:
    raw = np.empty(nbytes + 512, np.uint8)
    start = (-raw.ctypes.data) % 256 + offset
    return raw[start : start + nbytes]


def _ptr(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


def _check(unpack: bool, x: np.ndarray, base: np.ndarray, packed: np.ndarray, view: View, why: str) -> None:
    if unpack:  # the view holds the packed bytes, the rest of its base is still poison
        expected = np.full(base.nbytes, POISON, np.uint8).view(base.dtype).reshape(base.shape)
        view(expected)[...] = packed.view(x.dtype).reshape(x.shape)
        assert base.tobytes() == expected.tobytes(), why
    else:  # the packed bytes are the view's elements in C order
        assert packed.tobytes() == np.ascontiguousarray(x).tobytes(), why


def _cases() -> Iterator[tuple[str, Case]]:
    seed = int(np.random.SeedSequence().entropy % (1 << 63))
    rng = np.random.default_rng(seed)
    for layout, (shape, view) in PACK_LAYOUTS.items():
        for itemsize in (1, 4) if layout in LARGE else ITEMSIZES:
            for packed_offset in (0, 1) if layout in ("transpose", "row-slice", "8d-slices") else (0,):
                n = math.prod(shape) * itemsize
                dt = np.dtype(f"V{itemsize}")
                for unpack in (False, True):
                    cid = f"{layout}-{itemsize}B-{'unpack' if unpack else 'pack'}{'-misaligned' * packed_offset}"
                    why = f"{cid} seed={seed}"
                    raw = _aligned(n)
                    raw[...] = POISON if unpack else rng.integers(0, 256, n, dtype=np.uint8)
                    base = raw.view(dt).reshape(shape)
                    x = view(base)
                    if x.size == 0:
                        continue
                    packed = _aligned(x.nbytes, packed_offset)
                    packed[...] = rng.integers(0, 256, x.nbytes, dtype=np.uint8) if unpack else POISON
                    plan = _plan(x.shape, x.strides, itemsize, _ptr(x), _ptr(packed))
                    if plan.kind == "memcpy":
                        assert x.flags.c_contiguous or x.size == 1, why
                        continue
                    src, dst = (_ptr(packed), _ptr(x)) if unpack else (_ptr(x), _ptr(packed))
                    launch = _launch(plan, unpack, src, dst, sm_count=1)

                    yield cid, Case(launch, partial(_check, unpack, x, base, packed, view, why))


CASES = dict(_cases())
KERNEL_CASES = {cid: case for cid, case in CASES.items() if case.launch is not None}


@pytest.fixture(scope="module")
def kernels() -> Iterator[ctypes.CDLL]:
    """Every kernel class the cases launch, in one shared library built for the host."""
    launches: dict[str, _Launch] = {}
    for case in KERNEL_CASES.values():
        assert case.launch is not None
        launches.setdefault(case.launch.name, case.launch)
    with tempfile.TemporaryDirectory(prefix="tw-kernels-") as tmp:
        cpp = Path(tmp) / "kernels.cpp"
        so = Path(tmp) / "kernels.so"
        cpp.write_text(SHIM + "".join(_wrapper(k, launch) for k, launch in enumerate(launches.values())))
        assert CXX is not None
        cmd = [CXX, "-std=c++17", "-O1", "-shared", "-fPIC", "-w", "-o", str(so), str(cpp)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stderr[-4000:]
        yield ctypes.CDLL(str(so))


def _run(lib: ctypes.CDLL, launch: _Launch) -> None:
    fn = getattr(lib, f"run_{launch.name}")
    fn.argtypes = [ctypes.POINTER(ctypes.c_uint), ctypes.POINTER(ctypes.c_uint)] + [
        _C_TYPES[a.dtype][1] for a in launch.args
    ]
    fn.restype = None
    grid = (ctypes.c_uint * 3)(*launch.grid, *(1,) * (3 - len(launch.grid)))
    block = (ctypes.c_uint * 3)(*launch.block, *(1,) * (3 - len(launch.block)))
    fn(grid, block, *(a.item() for a in launch.args))


def test_the_cases_reach_every_kernel_kind() -> None:
    kinds = {
        (c.launch.key[0], c.launch.key[1] if c.launch.key[0] == "elementwise" else None)
        for c in KERNEL_CASES.values()
        if c.launch
    }
    assert kinds == {("elementwise", False), ("elementwise", True), ("tiled", None)}
    words = {c.launch.key[2] for c in KERNEL_CASES.values() if c.launch and c.launch.key[0] == "elementwise"}
    assert words == set(ITEMSIZES)
    assert any(c.launch and c.launch.grid[0] * 4 * 256 < c.launch.args[2] for c in KERNEL_CASES.values()), (
        "no pack launch turns its grid-stride loop over four words in flight"
    )


@pytest.mark.parametrize("cid", list(KERNEL_CASES))
def test_kernel_on_the_cpu(cid: str, kernels: ctypes.CDLL) -> None:
    case = KERNEL_CASES[cid]
    assert case.launch is not None
    _run(kernels, case.launch)
    case.check()


def test_a_wrong_argument_shows() -> None:
    """The check is not vacuous: a launch with one stride off writes different bytes."""
    (_, case), *_ = ((c, k) for c, k in KERNEL_CASES.items() if c.startswith("step-slice-4B-pack"))
    assert case.launch is not None
    launch = case.launch
    args = list(launch.args)
    args[-1] = type(args[-1])(int(args[-1]) + 1)  # the innermost stride
    bad = _Launch(launch.key, launch.name, launch.grid, launch.block, tuple(args))
    with tempfile.TemporaryDirectory(prefix="tw-kernels-") as tmp:
        cpp, so = Path(tmp) / "k.cpp", Path(tmp) / "k.so"
        cpp.write_text(SHIM + _wrapper(0, bad))
        assert CXX is not None
        subprocess.run(
            [CXX, "-std=c++17", "-O1", "-shared", "-fPIC", "-w", "-o", str(so), str(cpp)],
            check=True,
            timeout=120,
        )
        _run(ctypes.CDLL(str(so)), bad)
    with pytest.raises(AssertionError):
        case.check()
