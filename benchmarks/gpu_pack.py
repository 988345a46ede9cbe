"""Time tensorwire.native pack/unpack against CuPy's own copy kernel and a plain device copy.

    python benchmarks/gpu_pack.py [--gib 1] [--repeats 20] [--json out.json]

For each layout (a transposed tensor, a row slice, a step slice, an NHWC->NCHW permutation)
of about ``--gib`` GiB of packed float32 data, all in one run on one GPU:

* pack:   tensorwire.native.pack(x, out=buf)   vs  cupy.ascontiguousarray(x)
* unpack: tensorwire.native.unpack(buf, x)     vs  x[...] = buf.view(float32).reshape(x.shape)
* memcpy: a contiguous device-to-device copy of the same number of bytes (the ceiling)

Times are CUDA-event medians over ``--repeats`` runs after warm-up; GB/s counts the bytes read
plus the bytes written (2 x the tensor's bytes), 1 GB = 1e9 bytes. Every result is checked
against CuPy's before it is timed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's tensorwire


def _time(cp: Any, fn: Callable[[], Any], repeats: int, warmup: int = 3) -> float:
    """Median milliseconds of ``fn`` on the current stream, by CUDA events."""
    for _ in range(warmup):
        fn()
    cp.cuda.get_current_stream().synchronize()
    times = []
    for _ in range(repeats):
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop))
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=float, default=1.0, help="packed size of each tensor in GiB")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)

    try:
        import cupy as cp
    except ImportError as exc:
        print(f"gpu_pack: needs CuPy and a CUDA GPU ({exc})", file=sys.stderr)
        return 2
    from tensorwire.memory._cuda import cuda_device_count

    if cuda_device_count() == 0:
        print("gpu_pack: needs a CUDA GPU, and CuPy sees none here", file=sys.stderr)
        return 2

    from tensorwire.native import pack, unpack
    from tensorwire.native._pack import _plan

    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    print(f"device: {name}, CuPy {cp.__version__}, CUDA runtime {cp.cuda.runtime.runtimeGetVersion()}")

    n = round((args.gib * (1 << 30) / 4) ** 0.5)
    n -= n % 64  # n x n float32 elements packed
    h = round((args.gib * (1 << 30) / 4 / 64 / 64) ** 0.5)  # NHWC 64 x h x h x 64
    cases: list[tuple[str, tuple[int, ...], Callable[[Any], Any]]] = [
        (f"transpose {n}x{n}", (n, n), lambda a: a.T),
        (
            f"row slice [:, {n // 4}:{n // 4 + n}] of {n}x{3 * n // 2}",
            (n, 3 * n // 2),
            lambda a: a[:, n // 4 : n // 4 + n],
        ),
        (f"step slice [:, ::2] of {n}x{2 * n}", (n, 2 * n), lambda a: a[:, ::2]),
        (f"NHWC->NCHW 64x{h}x{h}x64", (64, h, h, 64), lambda a: a.transpose(0, 3, 1, 2)),
    ]
    rows: list[dict[str, Any]] = []
    for label, base_shape, view in cases:
        base = cp.random.random(base_shape, dtype=cp.float32)
        x = view(base)
        nbytes = x.nbytes
        plan = _plan(x.shape, x.strides, 4, x.data.ptr, 0)
        buf = cp.empty(nbytes, cp.uint8)
        ref = cp.ascontiguousarray(x)
        pack(x, out=buf)
        assert bool(cp.array_equal(buf, ref.reshape(-1).view(cp.uint8))), f"pack is wrong for {label}"
        dst_base = cp.zeros(base_shape, cp.float32)
        dst = view(dst_base)
        unpack(buf, dst)
        assert bool(cp.array_equal(dst, x)), f"unpack is wrong for {label}"
        copy_dst = cp.empty_like(buf)
        del ref

        def _cupy_pack(x: Any = x) -> Any:
            return cp.ascontiguousarray(x)

        def _cupy_unpack(buf: Any = buf, dst: Any = dst) -> None:
            dst[...] = buf.view(cp.float32).reshape(dst.shape)

        def _memcpy(buf: Any = buf, copy_dst: Any = copy_dst) -> None:
            copy_dst.data.copy_from_device_async(buf.data, buf.nbytes)

        timings = {
            ("pack", "tensorwire"): _time(cp, lambda x=x, buf=buf: pack(x, out=buf), args.repeats),
            ("pack", "cupy"): _time(cp, _cupy_pack, args.repeats),
            ("unpack", "tensorwire"): _time(cp, lambda buf=buf, dst=dst: unpack(buf, dst), args.repeats),
            ("unpack", "cupy"): _time(cp, _cupy_unpack, args.repeats),
            ("memcpy", "d2d copy"): _time(cp, _memcpy, args.repeats),
        }
        memcpy_ms = timings[("memcpy", "d2d copy")]
        for (op, impl), ms in timings.items():
            cupy_ms = timings.get((op, "cupy"), ms)
            rows.append(
                {
                    "case": label,
                    "plan": f"{plan.kind}/{plan.word}B",
                    "op": op,
                    "impl": impl,
                    "ms": ms,
                    "gbps": 2 * nbytes / (ms * 1e-3) / 1e9,
                    "x_cupy": cupy_ms / ms,
                    "of_memcpy": memcpy_ms / ms,
                    "bytes": nbytes,
                }
            )
        del base, x, buf, dst_base, dst, copy_dst
        cp.get_default_memory_pool().free_all_blocks()

    width = max(len(r["case"]) for r in rows)
    header = (
        f"| {'case':<{width}} | {'plan':<16} | {'op':<6} | {'impl':<10} | {'ms':>7} | {'GB/s':>6} "
        f"| {'vs cupy':>7} | {'of memcpy':>9} |"
    )
    print()
    print(header)
    print("|" + "|".join("-" * len(c) for c in header.split("|")[1:-1]) + "|")
    for r in rows:
        plan_s = r["plan"] if r["impl"] == "tensorwire" else ""
        vs = f"{r['x_cupy']:.2f}x" if r["op"] != "memcpy" else "-"
        print(
            f"| {r['case']:<{width}} | {plan_s:<16} | {r['op']:<6} | {r['impl']:<10} | {r['ms']:7.3f} "
            f"| {r['gbps']:6.0f} | {vs:>7} | {r['of_memcpy']:9.0%} |"
        )
    print()
    print(
        "GB/s counts bytes read + written; 'vs cupy' = CuPy time / this time (>1: faster than CuPy); "
        "'of memcpy' = share of the contiguous d2d copy's speed."
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
