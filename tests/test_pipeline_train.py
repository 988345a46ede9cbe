"""Pipeline training in one process: four stages as four nodes in one event loop, each a real
tensorwire node talking over tcp or ucx on loopback, trained for several steps and checked
against the same model trained in one piece."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import importlib.util
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
import pytest
from _pipeline_fixtures import NumpyLinear, stages
from _pipeline_reference import mse, one_process_step

import tensorwire
from tensorwire import pipeline

torch = pytest.importorskip("torch")
nn = torch.nn

_NO_UCX = importlib.util.find_spec("ucxx") is None
TRANSPORTS = ["tcp", pytest.param("ucx", marks=pytest.mark.skipif(_NO_UCX, reason="ucxx is not installed"))]
RTOL = 1e-5


@contextlib.asynccontextmanager
async def stages_and_driver(parts: list[Any], transport: str, offload: bool = True) -> AsyncIterator[pipeline.Pipeline]:
    async with stages(parts, transport, offload=offload) as (addresses, driver):
        async with await pipeline.Pipeline.connect(driver, addresses) as pipe:
            assert all(path.startswith(f"{transport} ") for path in pipe.paths), pipe.paths
            yield pipe


def mlp(seed: int = 0) -> list[Any]:
    torch.manual_seed(seed)
    d = 24
    return [nn.Sequential(nn.Linear(d, d), nn.Tanh()) for _ in range(3)] + [nn.Sequential(nn.Linear(d, 3))]


class Embed(nn.Module):  # type: ignore[misc]
    def __init__(self, d_in: int, d: int, max_len: int = 32) -> None:
        super().__init__()
        self.proj = nn.Linear(d_in, d)
        self.pos = nn.Parameter(torch.randn(max_len, d) * 0.1)

    def forward(self, x: Any) -> Any:
        return self.proj(x) + self.pos[: x.shape[1]]


def transformer(seed: int = 0) -> list[Any]:
    torch.manual_seed(seed)
    d = 16

    def block() -> Any:
        return nn.TransformerEncoderLayer(d, 2, dim_feedforward=32, dropout=0.0, batch_first=True)

    return [Embed(5, d), block(), block(), nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 2))]


def close(got: Any, want: Any, what: str) -> None:
    torch.testing.assert_close(got, want, rtol=RTOL, atol=1e-6, msg=lambda m: f"{what}: {m}")


async def train_and_compare(
    make: Callable[[], list[Any]],
    batches: list[tuple[Any, Any]],
    optimizer: Callable[[Any], Any],
    schedule: str,
    transport: str,
    microbatches: int = 8,
) -> None:
    parts = make()
    reference = nn.Sequential(*copy.deepcopy(parts))
    ref_opt = optimizer(reference.parameters())
    loss_fn = nn.functional.mse_loss
    stage_parts = [
        pipeline.TorchPart(p, optimizer=optimizer, loss=loss_fn if i == len(parts) - 1 else None)
        for i, p in enumerate(parts)
    ]
    async with stages_and_driver(stage_parts, transport) as pipe:
        for step, (x, y) in enumerate(batches):
            result = await pipe.step(x, y, microbatches=microbatches, schedule=schedule)
            ref_opt.zero_grad()
            want = loss_fn(reference(x), y)
            want.backward()
            ref_opt.step()
            assert result.loss == pytest.approx(want.item(), rel=RTOL), f"step {step}"
            assert len(result.losses) == microbatches and result.schedule.name == schedule
            assert all(s["compute_s"] > 0 for s in result.stages)
        states = await pipe.state()
    for s, (state, module) in enumerate(zip(states, reference, strict=True)):
        want_state = module.state_dict()
        assert state.keys() == want_state.keys()
        for name, value in state.items():
            close(value, want_state[name], f"stage {s} {name}")
            # the stage's own module object was updated in place too
        for name, value in parts[s].state_dict().items():
            close(value, want_state[name], f"stage {s} module {name}")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
async def test_mlp_matches_one_process(schedule: str, transport: str) -> None:
    g = torch.Generator().manual_seed(1)
    # the batch size changes from step to step (uneven microbatches at 44): shapes travel in headers
    batches = [(torch.randn(n, 24, generator=g), torch.randn(n, 3, generator=g)) for n in (64, 44, 80, 64)]
    await train_and_compare(mlp, batches, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), schedule, transport)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
async def test_transformer_block_matches_one_process(schedule: str, transport: str) -> None:
    g = torch.Generator().manual_seed(2)
    # the sequence length changes between steps
    batches = [(torch.randn(16, t, 5, generator=g), torch.randn(16, t, 2, generator=g)) for t in (6, 9, 4)]
    # SGD, not Adam: attention's key bias has a true gradient of zero, and Adam turns the rounding
    # noise of any summation order into a full-size step, so no two orders could agree there
    await train_and_compare(
        transformer, batches, lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9), schedule, transport
    )


# -- numpy stages: a layer with an explicit backward, no torch involved ---------------------------
def numpy_layers(seed: int = 3) -> list[NumpyLinear]:
    rng = np.random.default_rng(seed)
    return [NumpyLinear(rng, 12, 12, True) for _ in range(3)] + [NumpyLinear(rng, 12, 2, False)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
async def test_numpy_layers_with_explicit_backward(schedule: str) -> None:
    layers, reference = numpy_layers(), numpy_layers()
    parts = [pipeline.FunctionPart(layer, loss=mse if i == 3 else None) for i, layer in enumerate(layers)]
    rng = np.random.default_rng(4)
    async with stages_and_driver(parts, "tcp", offload=False) as pipe:
        for n in (32, 24, 40):
            x = rng.standard_normal((n, 12)).astype(np.float32)
            y = rng.standard_normal((n, 2)).astype(np.float32)
            result = await pipe.step(x, y, microbatches=8, schedule=schedule)
            want = one_process_step(reference, x, y)  # one process, whole batch
            assert result.loss == pytest.approx(want, rel=RTOL)
        states = await pipe.state()
    for s, (state, layer) in enumerate(zip(states, reference, strict=True)):
        assert isinstance(state["w"], np.ndarray)
        np.testing.assert_allclose(state["w"], layer.w, rtol=RTOL, atol=1e-6, err_msg=f"stage {s}")
        np.testing.assert_allclose(state["b"], layer.b, rtol=RTOL, atol=1e-6, err_msg=f"stage {s}")


@pytest.mark.timeout(60)
async def test_targets_given_as_lists_of_rows_train_as_arrays_do() -> None:
    """A batch may be a list of samples (label rows from a dataset, say): split slices it and
    each microbatch travels as a pytree, which the loss takes as it would take an array."""
    layers, reference = numpy_layers(), numpy_layers()
    parts = [pipeline.FunctionPart(layer, loss=mse if i == 3 else None) for i, layer in enumerate(layers)]
    rng = np.random.default_rng(5)
    async with stages_and_driver(parts, "tcp", offload=False) as pipe:
        x = rng.standard_normal((12, 12)).astype(np.float32)
        y = rng.standard_normal((12, 2)).astype(np.float32)
        result = await pipe.step(x, y.tolist(), microbatches=4)
        assert result.loss == pytest.approx(one_process_step(reference, x, y), rel=RTOL)


# -- failures inside one process ------------------------------------------------------------------
class Exploding(nn.Module):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.armed = False

    def forward(self, x: Any) -> Any:
        if self.armed:
            raise FloatingPointError("stage code blew up")
        return self.lin(x)


@pytest.mark.timeout(30)
async def test_an_error_in_one_stage_fails_the_step_on_every_stage() -> None:
    torch.manual_seed(0)
    bad = Exploding()
    parts = [nn.Linear(4, 4), bad, nn.Linear(4, 4), pipeline.TorchPart(nn.Linear(4, 4), loss=nn.functional.mse_loss)]
    async with stages_and_driver(parts, "tcp") as pipe:
        x, y = torch.randn(8, 4), torch.randn(8, 4)
        await pipe.step(x, y, microbatches=4)
        bad.armed = True
        with pytest.raises(tensorwire.RemoteError) as err:
            async with asyncio.timeout(10):
                await pipe.step(x, y, microbatches=4)
        assert err.value.remote_type == "FloatingPointError"
        notes = "\n".join(err.value.__notes__)
        assert "stage 1 (" in notes and "FloatingPointError: stage code blew up" in notes
        for s in (0, 2, 3):
            assert f"stage {s} (" in notes
        assert notes.count("aborted because stage 1 raised FloatingPointError") == 3, notes
        # the pipeline stays broken until it is configured again
        with pytest.raises(tensorwire.RemoteError, match="broken by an earlier failure"):
            await pipe.step(x, y, microbatches=4)
        # a new driver configures the same stages again, and they train; the old one is refused
        bad.armed = False
        addresses = [peer.remote_address for peer in pipe.peers]
        async with await pipeline.Pipeline.connect(pipe.node, addresses) as again:
            assert (await again.step(x, y, microbatches=4)).loss > 0
            with pytest.raises(tensorwire.RemoteError, match="configured by another driver"):
                await pipe.step(x, y, microbatches=4)
            await pipe.aclose()  # its release is refused too: the new driver's links stay up
            assert (await again.step(x, y, microbatches=2, schedule="gpipe")).loss > 0


@pytest.mark.timeout(30)
async def test_bad_configuration_is_reported() -> None:
    async with tensorwire.start("127.0.0.1:0") as a, tensorwire.start("127.0.0.1:0") as driver:
        async with pipeline.Stage(a, nn.Linear(2, 2)):
            # a last stage without a loss serves forward, and a training step says why it cannot
            async with await pipeline.Pipeline.connect(driver, [a.address]) as pipe:
                with pytest.raises(
                    tensorwire.ConfigurationError, match=r"stage 0 .* last stage and its part has no loss"
                ):
                    await pipe.step(torch.zeros(2, 2), torch.zeros(2, 2), microbatches=1)
                assert tuple((await pipe.forward(torch.zeros(2, 2), microbatches=1)).shape) == (2, 2)
            with pytest.raises(tensorwire.BusyResourceError):
                pipeline.Stage(a, nn.Linear(2, 2))
    with pytest.raises(tensorwire.ConfigurationError, match="is not a stage part"):
        pipeline.as_part(object())
    with pytest.raises(tensorwire.ShapeMismatchError):
        pipeline.split(np.zeros(3), 4)
    assert [len(c) for c in pipeline.split(np.zeros(10), 4)] == [3, 3, 2, 2]


@pytest.mark.gpu
@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
async def test_cuda_stages_match_one_process(schedule: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")

    def make() -> list[Any]:
        return [m.cuda() for m in mlp()]

    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(n, 24, generator=g).cuda(), torch.randn(n, 3, generator=g).cuda()) for n in (64, 40)]
    await train_and_compare(make, batches, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), schedule, "tcp")
