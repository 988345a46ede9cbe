"""Pipeline stages as separate processes (``tensorwire stage``) on loopback, port 0: training
matches one process over tcp and ucx while shapes change between steps; a stage killed mid-step
fails the step on every other stage promptly, with an error that names it."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tensorwire
from tensorwire import pipeline

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "pipeline_mlp.py"
SLOW_PART = f"{Path(__file__).resolve()}:slow_numpy_part"
_NO_UCX = importlib.util.find_spec("ucxx") is None


def spawn(n: int, part: str, transports: list[str]) -> tuple[list[subprocess.Popen[str]], list[str]]:
    env = dict(os.environ, TENSORWIRE_STAGE_THREADS="1")
    cmd = [sys.executable, "-m", "tensorwire.cli", "stage", "--part", part, "--address", "127.0.0.1:0"]
    procs = [
        subprocess.Popen([*cmd, "--transports", *transports], stdout=subprocess.PIPE, text=True, env=env)
        for _ in range(n)
    ]
    addresses = []
    try:
        deadline = time.monotonic() + 60
        for proc in procs:
            assert proc.stdout is not None
            ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            line = proc.stdout.readline() if ready else ""
            assert line.startswith("tensorwire stage serving at "), f"stage did not start: {line!r}"
            addresses.append(line.rsplit(" ", 1)[1].strip())
    except BaseException:
        stop(procs)
        raise
    return procs, addresses


def stop(procs: list[subprocess.Popen[str]], *, kill: bool = False) -> None:
    """SIGTERM the stages and wait for them; ``kill``: SIGKILL them instead, for stages whose
    clean exit nobody checks here (a torch process's interpreter finalization alone costs about
    a second of CPU; test_readme and test_cli check that stages exit on SIGTERM)."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


@pytest.fixture(scope="module")
def torch_stages() -> Iterator[list[str]]:
    """Four stage processes serving the example's MLP, offering ucx (where installed) and tcp;
    each driver picks the transport of its links, and each configure builds the model afresh."""
    pytest.importorskip("torch")
    transports = ["tcp"] if _NO_UCX else ["ucx", "tcp"]
    procs, addresses = spawn(4, f"{EXAMPLE}:build_part", transports)
    yield addresses
    stop(procs, kill=True)


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("pipeline_mlp_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "transport", ["tcp", pytest.param("ucx", marks=pytest.mark.skipif(_NO_UCX, reason="ucxx is not installed"))]
)
async def test_stage_processes_match_one_process(torch_stages: list[str], transport: str) -> None:
    torch = pytest.importorskip("torch")
    ex = _example()
    reference = torch.nn.Sequential(*[ex.build_model(r, 4) for r in range(4)])
    ref_opt = ex.make_optimizer(reference.parameters())
    g = torch.Generator().manual_seed(5)
    teacher = torch.randn(ex.IN, ex.OUT, generator=g)
    async with tensorwire.start("127.0.0.1:0", transports=(transport,)) as node:
        async with await pipeline.Pipeline.connect(node, torch_stages, transports=[transport]) as pipe:
            assert all(path.startswith(f"{transport} ") for path in pipe.paths), pipe.paths
            # the batch size (so every activation's shape) and the schedule change from step to step
            for step, (n, schedule) in enumerate([(64, "1f1b"), (40, "gpipe"), (96, "1f1b"), (64, "gpipe")]):
                x = torch.randn(n, ex.IN, generator=g)
                y = (x @ teacher).argmax(dim=1)
                async with asyncio.timeout(60):
                    result = await pipe.step(x, y, microbatches=8, schedule=schedule)
                ref_opt.zero_grad()
                want = torch.nn.functional.cross_entropy(reference(x), y)
                want.backward()
                ref_opt.step()
                assert result.loss == pytest.approx(want.item(), rel=1e-5), f"step {step}"
            states = await pipe.state()
    for s, state in enumerate(states):
        for name, value in state.items():
            torch.testing.assert_close(value, reference[s].state_dict()[name], rtol=1e-5, atol=1e-6)


# -- a stage that dies ------------------------------------------------------------------------------
class SlowLayer:
    """A numpy layer whose forward takes a while, so that a step is long enough to kill a stage
    in the middle of it."""

    def __init__(self, rank: int) -> None:
        self.w = np.eye(4, dtype=np.float32) * (1 + rank)

    def forward(self, x: np.ndarray) -> tuple[np.ndarray, Any]:
        time.sleep(0.1)
        return x @ self.w, x

    def backward(self, ctx: Any, grad: np.ndarray) -> np.ndarray:
        return grad @ self.w.T  # type: ignore[no-any-return]


def slow_numpy_part(rank: int, num_stages: int) -> pipeline.Part:
    """Served by the stage processes below; they never import torch (the numpy path needs none)."""
    if "torch" in sys.modules:
        raise RuntimeError("a numpy stage imported torch")

    def mse(y: np.ndarray, target: np.ndarray) -> tuple[float, np.ndarray]:
        d = y - target
        return float(np.mean(d * d)), 2 * d / d.size

    return pipeline.FunctionPart(SlowLayer(rank), loss=mse if rank == num_stages - 1 else None)


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "transport", ["tcp", pytest.param("ucx", marks=pytest.mark.skipif(_NO_UCX, reason="ucxx is not installed"))]
)
async def test_killed_stage_fails_every_other_stage_promptly(transport: str) -> None:
    procs, addresses = spawn(4, SLOW_PART, [transport])
    try:
        async with tensorwire.start("127.0.0.1:0", transports=(transport,)) as node:
            pipe = await pipeline.Pipeline.connect(node, addresses, transports=[transport])
            assert all(path.startswith(f"{transport} ") for path in pipe.paths), pipe.paths
            x = np.ones((16, 4), np.float32)
            result = await pipe.step(x, x, microbatches=8)  # a whole step works, without torch
            assert result.loss > 0
            step = asyncio.ensure_future(pipe.step(x, x, microbatches=8))
            await asyncio.sleep(0.5)  # every stage is busy or waiting on a neighbour now
            assert not step.done()
            procs[2].send_signal(signal.SIGKILL)
            killed = time.monotonic()
            with pytest.raises(tensorwire.PeerDisconnected) as err:
                async with asyncio.timeout(10):  # never a hang: the others fail on their own
                    await step
            took = time.monotonic() - killed
            message = str(err.value)
            notes = "\n".join(err.value.__notes__)
            assert f"stage 2 ({addresses[2]}) is gone" in message, message
            assert "stage 1: its link to stage 2" in notes and "stage 3: its link to stage 2" in notes, notes
            assert f"stage 0 ({addresses[0]}): BrokenResourceError: stage 0: aborted because stage 1: its link" in (
                notes
            ), notes
            print(f"every stage failed {took:.2f} s after the kill:\n{message}\n{notes}")
            # the survivors are alive and refuse further steps until configured again
            assert all(procs[s].poll() is None for s in (0, 1, 3))
            with pytest.raises(tensorwire.TensorWireError):
                async with asyncio.timeout(10):
                    await pipe.step(x, x, microbatches=8)
            await pipe.aclose()
    finally:
        stop(procs)


@pytest.mark.timeout(30)
def test_stage_command_reports_a_bad_part(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "tensorwire.cli", "stage", "--part"]
    empty = tmp_path / "parts.py"  # a file of no parts (the example would import torch for seconds)
    empty.write_text("WIDTH = 4\n")
    for part, needle in [
        ("no_such_module_xyz:build", "cannot import no_such_module_xyz"),
        (f"{empty}:no_such_function", "has no function 'no_such_function'"),
        ("nocolon", "is not MODULE:FUNCTION"),
    ]:
        out = subprocess.run([*cmd, part], capture_output=True, text=True, timeout=30)
        assert out.returncode == 1, out
        assert "ConfigurationError" in out.stderr and needle in out.stderr, out.stderr
