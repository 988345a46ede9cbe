"""tensorwire.native's pack and unpack kernels run on the CPU, checked byte for byte against numpy.

The generated CUDA C is compiled by the host's C++ compiler with a shim that supplies what CUDA
would (threadIdx, blockIdx, gridDim, blockDim, __shared__, __syncthreads). Each copy is planned
exactly as on a GPU (``_plan``, then ``_launch``, with the real host pointers), and its launch runs
block by block: a block's threads as fibers that all reach each ``__syncthreads`` before any goes
on where the kernel syncs, one after the other where it never does. Every layout the GPU tests
use runs at every word size, both directions, with a one-SM pack grid so that the grid-stride
loops turn over; some also misaligned, and some through the 64-bit index kernels (which a GPU
uses past 2**31 words) as well. Every access through ``src`` and ``dst`` is bounds-checked against
the buffers the case allocated, so a stray index fails with its address instead of corrupting
this process.

This checks the kernels' index arithmetic and the arguments each launch passes. It says nothing
about the GPU's memory model, coalescing or speed; tests/gpu and the GPU benchmarks check those on
a device.
"""

from __future__ import annotations

import ctypes
import math
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
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
# layouts also run through the 64-bit index kernels (on a GPU those serve past 2**31 words)
WIDE = {"1d-step", "transpose", "nhwc-to-nchw", "negative-transpose", "step-slice", "8d-slices", "8d-tiled"}

SHIM = r"""
#include <ucontext.h>
#include <functional>
#include <type_traits>
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

// src and dst are bounds-checked: an access outside the buffers the case allocated is recorded
// (the first address) and goes to a scratch word instead, so a wrong index fails the test and
// never corrupts this process.
static unsigned long long tw_lo[2], tw_hi[2], tw_bad;
template <class T, int Side> struct tw_span {
    T* p;
    tw_span(T* q) : p(q) {}
    template <class I> T& operator[](I i) const {
        const unsigned long long a = (unsigned long long)p + (unsigned long long)((long long)i * (long long)sizeof(T));
        if (a < tw_lo[Side] || a + sizeof(T) > tw_hi[Side]) {
            if (!tw_bad) tw_bad = a;
            static typename std::remove_const<T>::type scratch;
            return scratch;
        }
        return p[i];
    }
};

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


def _checked(source: str) -> str:
    """The kernel source with its src and dst pointers bounds-checked (the shim's tw_span)."""
    out, n_src = re.subn(r"const (\w[\w ]*)\* __restrict__ src\b", r"tw_span<const \1, 0> src", source)
    out, n_dst = re.subn(r"(\w[\w ]*)\* __restrict__ dst\b", r"tw_span<\1, 1> dst", out)
    assert (n_src, n_dst) == (1, 1), "the kernel no longer takes 'const T* __restrict__ src, T* __restrict__ dst'"
    return out


def _wrapper(k: int, launch: _Launch) -> str:
    """The kernel in a namespace of its own, and a C entry point that runs its launch."""
    w = _WORD_TYPES[launch.word]
    w = f"tw_k{k}::{w}" if w.startswith("tw_") else w
    params = ", ".join(f"{_C_TYPES[a.dtype][0]} a{i}" for i, a in enumerate(launch.args))
    rest = "".join(f", a{i}" for i in range(2, len(launch.args)))
    source = launch.source()
    syncs = "true" if "__syncthreads" in source else "false"
    return f"""
namespace tw_k{k} {{
{_checked(source)}
}}
extern "C" unsigned long long run_{launch.name}(
    const unsigned* grid, const unsigned* block, const unsigned long long* bounds, {params}) {{
    const unsigned g[3] = {{grid[0], grid[1], grid[2]}}, b[3] = {{block[0], block[1], block[2]}};
    tw_lo[0] = bounds[0]; tw_hi[0] = bounds[1]; tw_lo[1] = bounds[2]; tw_hi[1] = bounds[3]; tw_bad = 0;
    tw_run(g, b, {syncs}, [=] {{ tw_k{k}::{launch.name}((const {w}*)a0, ({w}*)a1{rest}); }});
    return tw_bad;
}}
"""


@dataclass
class Case:
    """One planned copy with its buffers kept alive, and the check of its result."""

    launch: _Launch
    bounds: tuple[int, int, int, int]  # the src buffer's first and past-the-end address, then dst's
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


def _variants(layout: str) -> list[tuple[int, bool]]:
    """(offset of the packed buffer from 256-byte alignment, 64-bit indices) to run ``layout`` with."""
    out = [(0, False)]
    if layout in ("transpose", "row-slice", "8d-slices"):
        out.append((1, False))
    if layout in WIDE:
        out.append((0, True))
    return out


def _cases(layouts: dict[str, tuple[tuple[int, ...], View]]) -> Iterator[tuple[str, Case]]:
    seed = int(np.random.SeedSequence().entropy % (1 << 63))
    rng = np.random.default_rng(seed)
    for layout, (shape, view) in layouts.items():
        for itemsize in (1, 4) if layout in LARGE else ITEMSIZES:
            for packed_offset, wide in _variants(layout):
                n = math.prod(shape) * itemsize
                dt = np.dtype(f"V{itemsize}")
                for unpack in (False, True):
                    cid = f"{layout}-{itemsize}B-{'unpack' if unpack else 'pack'}"
                    cid += "-misaligned" * packed_offset + "-i64" * wide
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
                    launch = _launch(plan, unpack, src, dst, sm_count=1, narrow_limit=0 if wide else 2**31)
                    strided_buf = (_ptr(raw), _ptr(raw) + n)
                    packed_buf = (_ptr(packed), _ptr(packed) + x.nbytes)
                    bounds = (*packed_buf, *strided_buf) if unpack else (*strided_buf, *packed_buf)
                    check = partial(_check, unpack, x, base, packed, view, why)
                    yield cid, Case(launch, bounds, check)


CASES = dict(_cases(PACK_LAYOUTS))


def _build(launches: list[_Launch], where: str) -> ctypes.CDLL:
    """The kernels of ``launches`` (one per kernel class) in one shared library built for the host."""
    cpp, so = Path(where) / "kernels.cpp", Path(where) / "kernels.so"
    cpp.write_text(SHIM + "".join(_wrapper(k, launch) for k, launch in enumerate(launches)))
    assert CXX is not None
    # -Og: the launches run as fast as at -O1 (about 2 s for all of them), and the build takes 4 s of
    # CPU instead of 6.5 s
    cmd = [CXX, "-std=c++17", "-Og", "-shared", "-fPIC", "-w", "-o", str(so), str(cpp)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return ctypes.CDLL(str(so))


@pytest.fixture(scope="module")
def kernels() -> Iterator[ctypes.CDLL]:
    with tempfile.TemporaryDirectory(prefix="tw-kernels-") as tmp:
        yield _build(list({case.launch.name: case.launch for case in CASES.values()}.values()), tmp)


def _execute(lib: ctypes.CDLL, launch: _Launch, case: Case) -> None:
    """Run ``launch`` on ``case``'s buffers: it stays inside them, and the bytes are right."""
    fn = getattr(lib, f"run_{launch.name}")
    fn.argtypes = [
        ctypes.POINTER(ctypes.c_uint),
        ctypes.POINTER(ctypes.c_uint),
        ctypes.POINTER(ctypes.c_ulonglong),
        *(_C_TYPES[a.dtype][1] for a in launch.args),
    ]
    fn.restype = ctypes.c_ulonglong
    grid = (ctypes.c_uint * 3)(*launch.grid, *(1,) * (3 - len(launch.grid)))
    block = (ctypes.c_uint * 3)(*launch.block, *(1,) * (3 - len(launch.block)))
    bounds = (ctypes.c_ulonglong * 4)(*case.bounds)
    bad = fn(grid, block, bounds, *(a.item() for a in launch.args))
    lo, hi = min(case.bounds[0], case.bounds[2]), max(case.bounds[1], case.bounds[3])
    assert bad == 0, f"{launch.name} touched {bad:#x}, outside its buffers ({bad - lo:+d} bytes from {lo:#x}..{hi:#x})"
    case.check()


def test_the_cases_reach_every_kernel_class() -> None:
    keys = {case.launch.key for case in CASES.values()}
    assert {k[1] for k in keys if k[0] == "elementwise"} == {False, True}  # pack and unpack
    elementwise = {k[2:4] for k in keys if k[0] == "elementwise"}
    assert elementwise == {(w, index) for w in ITEMSIZES for index in ("unsigned int", "unsigned long long")}
    tiled = {(k[1], k[3]) for k in keys if k[0] == "tiled"}
    assert tiled == {(w, index) for w in ITEMSIZES for index in ("int", "long long")}
    assert any(c.launch.grid[0] * 4 * 256 < c.launch.args[2] for c in CASES.values()), (
        "no launch turns its grid-stride loop over four words in flight"
    )


@pytest.mark.parametrize("cid", list(CASES))
def test_kernel_on_the_cpu(cid: str, kernels: ctypes.CDLL) -> None:
    _execute(kernels, CASES[cid].launch, CASES[cid])


@pytest.mark.parametrize(
    ("cid", "arg", "wrong", "error"),
    [
        ("step-slice-4B-pack", -1, lambda s: s + 1, "seed="),  # the innermost stride one word off
        ("transpose-4B-unpack", 6, lambda s: s * 1000, "outside its buffers"),  # far outside the base
    ],
)
def test_a_wrong_argument_shows(cid: str, arg: int, wrong: Callable[[int], int], error: str) -> None:
    """The checks are not vacuous: a launch with one argument wrong fails them, and writes far
    outside the buffers are caught before they land (this process would not survive them)."""
    layout = cid.split("-4B-")[0]
    case = dict(_cases({layout: PACK_LAYOUTS[layout]}))[cid]  # fresh buffers, not the shared cases'
    args = list(case.launch.args)
    args[arg] = type(args[arg])(wrong(int(args[arg])))
    bad = replace(case.launch, args=tuple(args))
    with tempfile.TemporaryDirectory(prefix="tw-kernels-") as tmp:
        lib = _build([bad], tmp)
        with pytest.raises(AssertionError, match=error):
            _execute(lib, bad, case)
