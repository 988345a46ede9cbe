"""Pipeline stages in processes on loopback (four by default), training an MLP.

    python examples/pipeline_mlp.py [--transport tcp|ucx] [--schedule 1f1b|gpipe] [--steps 8] [--stages 4]

Each stage is a ``tensorwire stage`` process serving ``build_part`` from this file; this process
is the driver: it links the stages, feeds them batches split into microbatches and prints the
loss of each step, the negotiated path of each link and the bubble fraction. The same
``build_part`` can serve stages on other machines:

    tensorwire stage --part examples/pipeline_mlp.py:build_part --address 0.0.0.0:5000
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from typing import Any

# imported here, when `tensorwire stage --part` loads this file before its node serves: importing
# torch inside build_part would hold the GIL for seconds while the stage must answer lease renewals
import torch
from torch import nn

import tensorwire
from tensorwire.pipeline import Pipeline, TorchPart, get_schedule

# torch's first optimizer imports torch._dynamo (1-2 s holding the GIL): a stage makes one now, not
# in build_part; the driver (this file run as a script) steps no optimizer
if __name__ != "__main__":
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)

WIDTH = 256
IN, OUT = 64, 10
LR = 0.3
PART = f"{os.path.abspath(__file__)}:build_part"  # what the stage processes serve


def build_model(rank: int, num_stages: int) -> Any:
    """Stage ``rank``'s slice of the MLP, the same weights in every process (seeded by rank)."""
    torch.manual_seed(1000 + rank)
    d_in = IN if rank == 0 else WIDTH
    if rank == num_stages - 1:
        return nn.Sequential(nn.Linear(d_in, WIDTH), nn.GELU(), nn.Linear(WIDTH, OUT))
    return nn.Sequential(nn.Linear(d_in, WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH), nn.GELU())


def make_optimizer(params: Any) -> Any:
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def build_part(rank: int, num_stages: int) -> Any:
    """What ``tensorwire stage --part examples/pipeline_mlp.py:build_part`` serves."""
    torch.set_num_threads(int(os.environ.get("TENSORWIRE_STAGE_THREADS", "1")))  # one core per stage
    last = rank == num_stages - 1
    return TorchPart(
        build_model(rank, num_stages), optimizer=make_optimizer, loss=nn.functional.cross_entropy if last else None
    )


async def spawn_stages(
    n: int, part: str, transports: list[str], env: dict[str, str] | None = None
) -> tuple[list[Any], list[str]]:
    """Start ``n`` stage processes on loopback (port 0) and read the address each one bound."""
    procs, addresses = [], []
    for _ in range(n):
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tensorwire.cli", "stage", "--part", part,
            "--address", "127.0.0.1:0", "--transports", *transports,
            "--parent", str(os.getpid()),  # they go even if this driver is SIGKILLed
            stdout=asyncio.subprocess.PIPE, env=env,
        )  # fmt: skip
        procs.append(proc)
    try:
        for proc in procs:
            assert proc.stdout is not None
            async with asyncio.timeout(60):
                # native libraries may print first (UCX's log on its stdout): skip to our line
                while "tensorwire stage serving at " not in (line := (await proc.stdout.readline()).decode()):
                    if not line:  # it closed its stdout: it is exiting
                        raise RuntimeError(f"a stage process did not start (exit {await proc.wait()})")
                    sys.stderr.write(line)
            addresses.append(line.rsplit(" ", 1)[1].strip())
    except BaseException:
        await stop(procs)
        raise
    return procs, addresses


async def stop(procs: list[Any]) -> None:
    for proc in procs:
        if proc.returncode is None:
            proc.terminate()
    for proc in procs:
        try:
            async with asyncio.timeout(10):
                await proc.wait()
        except TimeoutError:
            proc.kill()
            await proc.wait()


def cancel_on_sigterm() -> None:
    """Take SIGTERM like Ctrl-C: cancel this task, so that its ``finally`` stops the stage processes."""
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    # a second SIGTERM while the stages are being stopped is ignored rather than cutting that short
    loop.add_signal_handler(signal.SIGTERM, lambda: task.cancelling() or task.cancel())


async def main(transport: str, schedule: str, steps: int, microbatches: int, batch: int, p: int = 4) -> None:
    cancel_on_sigterm()
    procs, addresses = await spawn_stages(p, PART, [transport])
    try:
        async with tensorwire.start("127.0.0.1:0", transports=(transport,)) as node:
            pipe = await Pipeline.connect(node, addresses, transports=[transport])
            async with pipe:
                print(f"{p} stage processes: {', '.join(addresses)}")
                for s, path in enumerate(pipe.paths):
                    print(f"  link stage {s} -> {s + 1}: {path}")
                g = torch.Generator().manual_seed(0)
                teacher = torch.randn(IN, OUT, generator=g)
                theory = get_schedule(schedule)(p, microbatches).bubble
                for step in range(steps):
                    x = torch.randn(batch, IN, generator=g)
                    y = (x @ teacher).argmax(dim=1)
                    r = await pipe.step(x, y, microbatches=microbatches, schedule=schedule)
                    print(
                        f"step {step}: loss {r.loss:.4f}  {r.seconds * 1e3:6.1f} ms  "
                        f"bubble {r.bubble:.2f} (theory {theory:.2f} for p={p}, m={microbatches})"
                    )
    finally:
        await stop(procs)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--transport", default="tcp", choices=["tcp", "ucx"])
    ap.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe"])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--stages", type=int, default=4, help="stage processes, one slice of the MLP each (2 or more)")
    a = ap.parse_args()
    if a.stages < 2:
        ap.error(f"--stages must be 2 or more, not {a.stages}")
    try:
        asyncio.run(main(a.transport, a.schedule, a.steps, a.microbatches, a.batch, a.stages))
    except KeyboardInterrupt:
        sys.exit(128 + signal.SIGINT)
    except asyncio.CancelledError:  # SIGTERM; the stage processes are stopped by now
        sys.exit(128 + signal.SIGTERM)
