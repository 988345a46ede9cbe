"""Pipeline step time against the compute-only ideal, and the measured bubble against theory.

    python benchmarks/pipeline.py [--width 1024] [--batch 256] [--steps 5] [--transports tcp ucx]

Four ``tensorwire stage`` processes on loopback, each a slice of an MLP (two width x width
layers, one torch thread), run 1F1B steps with m = 4, 8 and 16 microbatches over each transport.
For each row:

  step      median wall time of a step at the driver
  alone     the slowest stage's compute for one step (forward+backward of the batch in m
            microbatches, and its optimizer step) through the same Part, measured in this process
            before the stages start (one thread, no other stage running)
  ideal     alone x (m+p-1)/m: a perfect pipeline of that compute, nothing else
  in-run    the slowest stage's own compute wall time during the step (the stage reports it),
            and ideal(in-run) = in-run x (m+p-1)/m: the same ideal with the compute the stages
            actually got (on a machine with fewer cores than stages, compute slows down when
            several stages compute at once, and that is not the pipeline's doing)
  floor     the fastest this machine could run the step: the larger of the CPU-time ideal
            (slowest stage's compute CPU seconds x (m+p-1)/m) and all stages' compute CPU
            seconds spread over its cores
  bubble    1 - (compute summed over stages) / (p x step), against theory (p-1)/(m+p-1)

Rows with ``offload=off`` run compute on the stage's event loop instead of a worker thread.
The goal (issue #6) is step <= 1.25 x ideal at m=8; the table says PASS or MISS and why. Speed
is never asserted; the script exits 0 unless something failed.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import statistics
import sys
import time
from typing import Any

# imported here, when `tensorwire stage --part` loads this file before its node serves: importing
# torch inside build_part would hold the GIL for seconds while the stage must answer lease renewals
import torch
from torch import nn

import tensorwire
from tensorwire.pipeline import Pipeline, TorchPart

# torch's first optimizer imports torch._dynamo (1-2 s holding the GIL): make one now, not in build_part
torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)

P = 4
HERE = os.path.abspath(__file__)


def build_model(rank: int, num_stages: int) -> Any:
    width = int(os.environ.get("PIPELINE_BENCH_WIDTH", "1024"))
    torch.manual_seed(rank)
    layers = [nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width)]
    if rank < num_stages - 1:
        layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def build_part(rank: int, num_stages: int) -> Any:
    torch.set_num_threads(1)
    return TorchPart(
        build_model(rank, num_stages),
        optimizer=lambda ps: torch.optim.SGD(ps, lr=1e-3),
        loss=nn.functional.mse_loss if rank == num_stages - 1 else None,
    )


def compute_alone(width: int, batch: int, m: int, repeat: int = 5) -> float:
    """Seconds the slowest stage needs for one step's compute alone: forward+backward of a batch in
    m microbatches and its optimizer step (median of ``repeat``)."""
    torch.set_num_threads(1)
    worst = 0.0
    for rank in range(P):
        part = build_part(rank, P)
        x = torch.randn(batch // m, width)
        times = []
        for _ in range(repeat + 1):
            t0 = time.perf_counter()
            part.zero_grad()
            for _ in range(m):
                if rank == P - 1:
                    _, ctx = part.forward_loss(x, x, 1 / m, rank > 0)
                    part.backward(ctx, None)
                else:
                    y, ctx = part.forward(x, rank > 0)
                    part.backward(ctx, torch.ones_like(y))
            part.step()
            times.append(time.perf_counter() - t0)
        worst = max(worst, statistics.median(times[1:]))
    return worst


async def spawn(transport: str, offload: bool, width: int) -> tuple[list[Any], list[str]]:
    env = dict(os.environ, PIPELINE_BENCH_WIDTH=str(width))
    procs, addresses = [], []
    extra = [] if offload else ["--no-offload"]
    for _ in range(P):
        procs.append(
            await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "tensorwire.cli",
                "stage",
                "--part",
                f"{HERE}:build_part",
                "--address",
                "127.0.0.1:0",
                "--transports",
                transport,
                *extra,
                stdout=asyncio.subprocess.PIPE,
                env=env,
            )
        )
    for proc in procs:
        assert proc.stdout is not None
        async with asyncio.timeout(120):
            line = (await proc.stdout.readline()).decode()
        addresses.append(line.rsplit(" ", 1)[1].strip())
    return procs, addresses


async def stop(procs: list[Any]) -> None:
    for proc in procs:
        if proc.returncode is None:
            proc.terminate()
    for proc in procs:
        await proc.wait()


async def run(transport: str, offload: bool, ms: list[int], args: argparse.Namespace) -> list[dict[str, Any]]:
    procs, addresses = await spawn(transport, offload, args.width)
    rows = []
    try:
        async with tensorwire.start("127.0.0.1:0", transports=(transport,)) as node:
            async with await Pipeline.connect(node, addresses, transports=[transport]) as pipe:
                path = pipe.paths[0]
                x = torch.randn(args.batch, args.width)
                for m in ms:
                    results = []
                    for i in range(args.warmup + args.steps):
                        r = await pipe.step(x, x, microbatches=m, schedule="1f1b")
                        if i >= args.warmup:
                            results.append(r)
                    step = statistics.median(r.seconds for r in results)
                    in_run = statistics.median(max(s["compute_s"] for s in r.stages) for r in results)
                    cpu_max = statistics.median(max(s["cpu_s"] for s in r.stages) for r in results)
                    cpu_sum = statistics.median(sum(s["cpu_s"] for s in r.stages) for r in results)
                    bubble = statistics.median(r.bubble for r in results)
                    rows.append(
                        {
                            "transport": transport,
                            "offload": offload,
                            "m": m,
                            "step": step,
                            "in_run": in_run,
                            "cpu_max": cpu_max,
                            "cpu_sum": cpu_sum,
                            "bubble": bubble,
                            "path": path,
                        }
                    )
    finally:
        await stop(procs)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16])
    have_ucx = importlib.util.find_spec("ucxx") is not None
    ap.add_argument("--transports", nargs="+", default=["tcp", "ucx"] if have_ucx else ["tcp"])
    args = ap.parse_args()
    os.environ["PIPELINE_BENCH_WIDTH"] = str(args.width)  # build_model reads it, here and in the stages
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(
        f"p={P} stage processes, 1F1B, MLP width {args.width} (2 layers per stage), batch {args.batch}, "
        f"{cores} CPU cores for {P} stages + driver, 1 torch thread per stage"
    )
    alone = {m: compute_alone(args.width, args.batch, m) for m in args.microbatches}
    rows = []
    for transport in args.transports:
        rows += asyncio.run(run(transport, True, args.microbatches, args))
        if 8 in args.microbatches:
            rows += asyncio.run(run(transport, False, [8], args))
    head = (
        f"{'transport':<9} {'offload':<7} {'m':>3} {'step ms':>8} {'alone ms':>8} {'ideal ms':>8} {'ratio':>6} "
        f"{'in-run ms':>9} {'ideal(in-run)':>13} {'ratio':>6} {'floor ms':>8} {'ratio':>6} {'bubble':>6} "
        f"{'theory':>6}"
    )
    print(head)
    print("-" * len(head))
    verdicts = []
    for r in rows:
        m = r["m"]
        scale = (m + P - 1) / m
        ideal, ideal_run = alone[m] * scale, r["in_run"] * scale
        ratio, ratio_run = r["step"] / ideal, r["step"] / ideal_run
        floor = max(r["cpu_max"] * scale, r["cpu_sum"] / (cores or 1))
        print(
            f"{r['transport']:<9} {'on' if r['offload'] else 'off':<7} {m:>3} {r['step'] * 1e3:>8.1f} "
            f"{alone[m] * 1e3:>8.1f} {ideal * 1e3:>8.1f} {ratio:>5.2f}x {r['in_run'] * 1e3:>9.1f} "
            f"{ideal_run * 1e3:>13.1f} {ratio_run:>5.2f}x {floor * 1e3:>8.1f} {r['step'] / floor:>5.2f}x "
            f"{r['bubble']:>6.2f} {(P - 1) / (m + P - 1):>6.2f}"
        )
        if m == 8 and r["offload"]:
            verdicts.append((r["transport"], ratio, ratio_run, r["step"] / floor))
    print()
    for r in rows:
        if r["m"] == args.microbatches[0] and r["offload"]:
            print(f"path {r['transport']}: {r['path']}")
    for transport, ratio, ratio_run, ratio_floor in verdicts:
        ok = "PASS" if ratio <= 1.25 else "MISS"
        print(
            f"goal step <= 1.25 x ideal at m=8 over {transport}: {ok} ({ratio:.2f}x against compute alone; "
            f"{ratio_run:.2f}x against the compute the stages got in the run; {ratio_floor:.2f}x against "
            f"this machine's floor)"
        )
    if cores is not None and cores < P + 1:
        print(
            f"note: {cores} cores for {P} stages and the driver: stages that compute at once share cores, so "
            "'alone' cannot be reached here; 'floor' is what this machine allows"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
