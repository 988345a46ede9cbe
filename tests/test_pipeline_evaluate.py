"""Evaluation with a loss: ``Pipeline.evaluate`` runs the schedule's forwards alone through real
stages over real transports and has the last stage compute each microbatch's loss, in eval mode
and without a gradient. Checked against the same model evaluated in one process; an evaluation
between training steps changes nothing of the training; its errors are a step's."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import importlib.util
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
from _pipeline_fixtures import CountingLinear, NumpyLinear, nodes, stages
from _pipeline_reference import mse

import tensorwire
from tensorwire import pipeline
from tensorwire.rpc import CallLimits

_NO_UCX = importlib.util.find_spec("ucxx") is None
TRANSPORTS = ["tcp", pytest.param("ucx", marks=pytest.mark.skipif(_NO_UCX, reason="ucxx is not installed"))]
RTOL = 1e-5
BATCHES = ((10, 4), (7, 7), (33, 3))  # (batch, microbatches): unequal microbatches weigh differently


def torch_model(torch: Any, seed: int = 0) -> list[Any]:
    """Three stages, with dropout and batch norm (the last stage's too, whose module runs with
    the loss): both act differently in eval mode."""
    torch.manual_seed(seed)
    nn, d = torch.nn, 12
    modules = [
        nn.Sequential(nn.Linear(d, d), nn.BatchNorm1d(d), nn.Tanh()),
        nn.Sequential(nn.Linear(d, d), nn.Dropout(0.5), nn.Tanh()),
        nn.Sequential(nn.BatchNorm1d(d), nn.Dropout(0.5), nn.Linear(d, 3)),
    ]
    with torch.no_grad():  # running statistics of their own, so that eval mode shows in the loss
        for norm in (modules[0][1], modules[2][0]):
            norm.running_mean.uniform_(-0.5, 0.5)
            norm.running_var.uniform_(0.5, 2.0)
    return modules


def numpy_model(rng: np.random.Generator) -> list[NumpyLinear]:
    return [NumpyLinear(rng, 6, 6, tanh=True), NumpyLinear(rng, 6, 6, tanh=True), NumpyLinear(rng, 6, 2, tanh=False)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
async def test_torch_evaluate_equals_the_one_process_eval_mode_loss(schedule: str, transport: str) -> None:
    torch = pytest.importorskip("torch")
    modules = torch_model(torch)
    reference = torch.nn.Sequential(*copy.deepcopy(modules)).eval()
    loss_fn = torch.nn.functional.mse_loss
    parts = [pipeline.TorchPart(m, loss=loss_fn if i == 2 else None) for i, m in enumerate(modules)]
    before = [{k: v.clone() for k, v in m.state_dict().items()} for m in modules]
    g = torch.Generator().manual_seed(1)
    async with stages(parts, transport, offload=True) as (addresses, driver):
        async with await pipeline.Pipeline.connect(driver, addresses) as pipe:
            for n, m in BATCHES:
                x, y = torch.randn(n, 12, generator=g), torch.randn(n, 3, generator=g)
                with torch.no_grad():
                    want = loss_fn(reference(x), y).item()
                    # each microbatch's own loss, and the batch's as a step weights them
                    want_each = [
                        loss_fn(reference(a), b).item()
                        for a, b in zip(x.tensor_split(m), y.tensor_split(m), strict=True)
                    ]
                result = await pipe.evaluate(x, y, microbatches=m, schedule=schedule)
                assert isinstance(result, pipeline.EvalResult)
                assert result.loss == pytest.approx(want, rel=RTOL)
                assert result.losses == pytest.approx(want_each, rel=RTOL)
                assert result.schedule.forward_only and result.schedule.name == schedule
                assert result.seconds > 0 and len(result.stages) == 3 and 0 <= result.bubble <= 1
                # numpy in: the same loss
                again = await pipe.evaluate(x.numpy(), y.numpy(), microbatches=m, schedule=schedule)
                assert again.loss == pytest.approx(want, rel=RTOL)
    # every module back in training mode; batch norm's statistics, the parameters and their
    # (absent) gradients as they were
    assert all(sub.training for module in modules for sub in module.modules())
    for module, state in zip(modules, before, strict=True):
        assert all(torch.equal(v, state[k]) for k, v in module.state_dict().items())
        assert all(p.grad is None for p in module.parameters())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
async def test_numpy_evaluate_equals_the_one_process_loss(schedule: str, transport: str) -> None:
    rng = np.random.default_rng(0)
    layers = numpy_model(rng)
    reference = copy.deepcopy(layers)
    parts = [pipeline.FunctionPart(layer, loss=mse if i == 2 else None) for i, layer in enumerate(layers)]
    async with stages(parts, transport) as (addresses, driver):
        async with await pipeline.Pipeline.connect(driver, addresses) as pipe:
            for n, m in BATCHES:
                x = rng.standard_normal((n, 6)).astype(np.float32)
                y = rng.standard_normal((n, 2)).astype(np.float32)
                h = x
                for layer in reference:
                    h, _ = layer.forward(h)
                result = await pipe.evaluate(x, y, microbatches=m, schedule=schedule)
                assert result.loss == pytest.approx(mse(h, y)[0], rel=RTOL)
                hs = np.array_split(h, m)
                assert result.losses == pytest.approx(
                    [mse(a, b)[0] for a, b in zip(hs, np.array_split(y, m), strict=True)], rel=RTOL
                )
    for layer, ref in zip(layers, reference, strict=True):  # no backward reached a layer
        assert not layer.gw.any() and not layer.gb.any()
        np.testing.assert_array_equal(layer.w, ref.w)


# -- between training steps ---------------------------------------------------------------------
@pytest.mark.timeout(120)
async def test_evaluate_between_training_steps_changes_nothing_of_the_training() -> None:
    """Two pipelines train the same model on the same batches, one with an evaluation after
    every step: their losses and parameters are identical, bit for bit, and both match the model
    trained in one process; each evaluation equals the one-process eval-mode loss then."""
    torch = pytest.importorskip("torch")
    nn = torch.nn

    def model() -> list[Any]:
        torch.manual_seed(0)  # dropout 0 while training (the one-process RNG draws differ)
        return [
            nn.Sequential(nn.Linear(12, 12), nn.Tanh()),
            nn.Sequential(nn.Linear(12, 12), nn.Dropout(0.0), nn.Tanh()),
            nn.Linear(12, 3),
        ]

    def optimizer(ps: Any) -> Any:
        return torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01)

    loss_fn = torch.nn.functional.mse_loss
    reference = nn.Sequential(*model())
    ref_opt = optimizer(reference.parameters())
    twins = [model(), model()]
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(16, 12, generator=g), torch.randn(16, 3, generator=g)) for _ in range(4)]
    probe = (torch.randn(9, 12, generator=g), torch.randn(9, 3, generator=g))
    losses: list[list[float]] = [[], []]
    async with two_pipelines(twins, loss_fn, optimizer) as (plain, evaluating):
        for step, (x, y) in enumerate(batches):
            schedule = "1f1b" if step % 2 else "gpipe"
            for k, pipe in enumerate((plain, evaluating)):
                losses[k].append((await pipe.step(x, y, microbatches=4, schedule=schedule)).loss)
            ref_opt.zero_grad()
            want = loss_fn(reference(x), y)
            want.backward()
            ref_opt.step()
            assert losses[1][-1] == pytest.approx(want.item(), rel=RTOL), f"step {step}"
            grads = [[p.grad.clone() for p in m.parameters()] for m in twins[1]]
            states = await evaluating.state()
            result = await evaluating.evaluate(*probe, microbatches=3, schedule=schedule)
            with torch.no_grad():
                assert result.loss == pytest.approx(loss_fn(reference.eval()(probe[0]), probe[1]).item(), rel=RTOL)
            reference.train()
            # the evaluation left every gradient and parameter as the step left them
            for s, module in enumerate(twins[1]):
                for p, before in zip(module.parameters(), grads[s], strict=True):
                    assert torch.equal(p.grad, before), f"stage {s}: the evaluation touched a gradient"
            for before, after in zip(states, await evaluating.state(), strict=True):
                assert all(torch.equal(before[k], after[k]) for k in before)
    assert losses[0] == losses[1]  # exactly: the evaluations changed nothing
    for a, b in zip(twins[0], twins[1], strict=True):
        for (name, v), w in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
            assert torch.equal(v, w), name
    for (name, v), w in zip(
        nn.Sequential(*twins[1]).state_dict().items(), reference.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(v, w, rtol=RTOL, atol=1e-6, msg=name)


@contextlib.asynccontextmanager
async def two_pipelines(
    twins: list[list[Any]], loss_fn: Any, optimizer: Any
) -> AsyncIterator[tuple[pipeline.Pipeline, pipeline.Pipeline]]:
    """Two 3-stage torch pipelines, one per model of ``twins``, each with its driver."""
    async with contextlib.AsyncExitStack() as stack:
        pipes = []
        for twin in twins:
            parts = [
                pipeline.TorchPart(m, optimizer=optimizer, loss=loss_fn if i == 2 else None) for i, m in enumerate(twin)
            ]
            addresses, driver = await stack.enter_async_context(stages(parts, offload=True))
            pipes.append(await stack.enter_async_context(await pipeline.Pipeline.connect(driver, addresses)))
        yield pipes[0], pipes[1]


# -- a Part of one's own ------------------------------------------------------------------------
class Counting(pipeline.Part):
    """A last stage that does not override ``infer_loss``: y = 2x, loss = mean((y - t)^2)."""

    has_loss = True

    def __init__(self) -> None:
        self.calls: list[str] = []

    def forward(self, x: Any, needs_input_grad: bool) -> tuple[Any, Any]:
        self.calls.append("forward")
        return 2 * x, x

    def forward_loss(self, x: Any, target: Any, weight: float, needs_input_grad: bool) -> tuple[float, Any]:
        self.calls.append(f"forward_loss {weight} {needs_input_grad}")
        return float(np.mean((2 * x - target) ** 2)), x

    def backward(self, ctx: Any, grad: Any) -> Any:
        self.calls.append("backward")
        return None

    def zero_grad(self) -> None:
        self.calls.append("zero_grad")

    def step(self) -> None:
        self.calls.append("step")

    def state(self) -> dict[str, Any]:
        return {}


@pytest.mark.timeout(60)
async def test_a_part_without_infer_loss_evaluates_through_forward_loss_unweighted() -> None:
    rng = np.random.default_rng(3)
    first = NumpyLinear(rng, 4, 4, tanh=True)
    last = Counting()
    x, y = rng.standard_normal((6, 4)).astype(np.float32), rng.standard_normal((6, 4)).astype(np.float32)
    h, _ = copy.deepcopy(first).forward(x)
    async with stages([pipeline.FunctionPart(first), last]) as (addresses, driver):
        async with await pipeline.Pipeline.connect(driver, addresses) as pipe:
            result = await pipe.evaluate(x, y, microbatches=3)
    assert result.loss == pytest.approx(float(np.mean((2 * h - y) ** 2)), rel=RTOL)
    # the loss unscaled (weight 1), no input gradient asked for, and nothing else
    assert last.calls == ["forward_loss 1.0 False"] * 3
    assert not first.gw.any()


# -- errors ---------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
async def test_a_pipeline_without_a_loss_refuses_evaluate_before_any_stage_runs() -> None:
    rng = np.random.default_rng(0)
    layers = [CountingLinear(rng, 6, 6, tanh=True), CountingLinear(rng, 6, 2, tanh=False)]
    x, y = rng.standard_normal((8, 6)).astype(np.float32), np.zeros((8, 2), np.float32)
    async with stages([pipeline.FunctionPart(layer) for layer in layers]) as (addresses, driver):
        async with await pipeline.Pipeline.connect(driver, addresses) as pipe:
            CountingLinear.forwards = 0
            with pytest.raises(
                tensorwire.ConfigurationError,
                match=r"stage 1 \(.*\) is the last stage and its part has no loss: this pipeline serves "
                r"Pipeline.forward, not Pipeline.evaluate",
            ):
                await pipe.evaluate(x, y, microbatches=2)
            assert CountingLinear.forwards == 0  # refused at the driver: no stage ran, none is broken
            assert (await pipe.forward(x, microbatches=2)).shape == (8, 2)


@pytest.mark.timeout(60)
async def test_a_batch_evaluate_cannot_send_is_refused_before_any_stage_runs() -> None:
    rng = np.random.default_rng(0)
    layers = [CountingLinear(rng, 64, 64, tanh=True), CountingLinear(rng, 64, 64, tanh=False)]
    parts = [pipeline.FunctionPart(layers[0]), pipeline.FunctionPart(layers[1], loss=mse)]
    x = rng.standard_normal((32, 64)).astype(np.float32)  # 8192 bytes
    y = np.zeros((32, 64), np.float32)  # 8192 bytes, for the last stage
    async with nodes(3) as ns, pipeline.Stage(ns[0], parts[0]), pipeline.Stage(ns[1], parts[1]):
        ns[1].methods.limits = CallLimits(max_inflight_bytes=4096)  # the last stage's node: targets count
        async with await pipeline.Pipeline.connect(ns[2], [ns[0].address, ns[1].address]) as pipe:
            CountingLinear.forwards = 0
            with pytest.raises(
                tensorwire.MessageRefused, match=r"to stage 1 .* 8192 bytes of microbatches, past the 4096"
            ):
                await pipe.evaluate(x, y, microbatches=2)
            with pytest.raises(tensorwire.ShapeMismatchError, match="inputs have 32 samples but targets 31"):
                await pipe.evaluate(x, y[:31], microbatches=2)
            with pytest.raises(tensorwire.UnsupportedTensorError, match="the target of microbatch 0 cannot be sent"):
                await pipe.evaluate(x, [object()] * 32, microbatches=2)
            assert CountingLinear.forwards == 0
            # nothing broke: a batch within the limits evaluates
            assert (await pipe.evaluate(x[:8], y[:8], microbatches=2)).loss > 0


class _RaisesOn:
    """A loss that raises on the microbatch whose first target is ``7``."""

    def __call__(self, y: np.ndarray, target: np.ndarray) -> tuple[float, np.ndarray]:
        if target[0, 0] == 7.0:
            raise FloatingPointError("overflow in this microbatch's loss")
        return mse(y, target)


@pytest.mark.timeout(60)
async def test_a_stage_failing_an_evaluation_names_the_action_and_microbatch_and_breaks_until_reconnect() -> None:
    rng = np.random.default_rng(0)
    layers = numpy_model(rng)
    parts = [pipeline.FunctionPart(layer, loss=_RaisesOn() if i == 2 else None) for i, layer in enumerate(layers)]
    x = rng.standard_normal((8, 6)).astype(np.float32)
    y = np.zeros((8, 2), np.float32)
    y[4, 0] = 7.0  # the first row of microbatch 2 (of 4)
    async with stages(parts) as (addresses, driver):
        async with await pipeline.Pipeline.connect(driver, addresses) as pipe:
            with pytest.raises(tensorwire.RemoteError) as err:
                async with asyncio.timeout(10):
                    await pipe.evaluate(x, y, microbatches=4, schedule="1f1b")
            where = "step 0, at F2: the forward of microbatch 2"
            assert err.value.remote_type == "FloatingPointError"
            assert f"pipeline stage 2 raised this in {where}" in err.value.remote_traceback
            notes = "\n".join(err.value.__notes__)
            aborted = f"aborted because stage 2 raised FloatingPointError in {where}: overflow"
            assert "FloatingPointError: overflow in this microbatch's loss" in notes, notes
            # the stages before it wait for nothing from it: each may have sent its last
            # activation and answered before the abort reached it (which breaks it all the same)
            for s in (0, 1):
                line = next(line for line in notes.splitlines() if line.strip().startswith(f"stage {s} ("))
                assert line.endswith(("): finished", f"stage {s}: {aborted}")), notes
            with pytest.raises(tensorwire.RemoteError, match="broken by an earlier failure"):
                await pipe.evaluate(x, y, microbatches=4)
        y[4, 0] = 0.0
        async with await pipeline.Pipeline.connect(driver, addresses) as pipe:
            h = x
            for layer in layers:
                h, _ = layer.forward(h)
            assert (await pipe.evaluate(x, y, microbatches=4)).loss == pytest.approx(mse(h, y)[0], rel=RTOL)


@pytest.mark.timeout(60)
async def test_a_torch_loss_that_is_no_scalar_fails_the_evaluation_naming_the_stage() -> None:
    torch = pytest.importorskip("torch")
    parts = [pipeline.TorchPart(torch.nn.Linear(4, 2), loss=lambda out, t: (out - t) ** 2)]
    async with stages(parts) as (addresses, driver):
        async with await pipeline.Pipeline.connect(driver, addresses) as pipe:
            with pytest.raises(tensorwire.RemoteError, match="not a scalar tensor") as err:
                await pipe.evaluate(torch.randn(4, 4), torch.randn(4, 2), microbatches=2)
    assert err.value.remote_type == "ConfigurationError"
    assert "at F0: the forward of microbatch 0" in err.value.remote_traceback


@pytest.mark.timeout(60)
async def test_evaluate_runs_one_at_a_time_with_step_and_forward() -> None:
    """evaluate, forward and step run one at a time (BusyResourceError), and none runs on a
    closed pipeline."""
    rng = np.random.default_rng(0)
    parts = [
        pipeline.FunctionPart(NumpyLinear(rng, 4, 4, tanh=True)),
        pipeline.FunctionPart(NumpyLinear(rng, 4, 2, tanh=False), loss=mse),
    ]
    x, y = rng.standard_normal((64, 4)).astype(np.float32), np.zeros((64, 2), np.float32)
    async with stages(parts) as (addresses, driver):
        async with await pipeline.Pipeline.connect(driver, addresses) as pipe:
            running = asyncio.ensure_future(pipe.step(x, y, microbatches=32))
            await asyncio.sleep(0)
            with pytest.raises(tensorwire.BusyResourceError):
                await pipe.evaluate(x, y, microbatches=2)
            with pytest.raises(tensorwire.BusyResourceError):
                await pipe.forward(x, microbatches=2)
            await running
            assert (await pipe.forward(x, microbatches=2)).shape == (64, 2)  # free again
            evaluating = asyncio.ensure_future(pipe.evaluate(x, y, microbatches=32))
            await asyncio.sleep(0)
            with pytest.raises(tensorwire.BusyResourceError):
                await pipe.step(x, y, microbatches=2)
            with pytest.raises(tensorwire.BusyResourceError):
                await pipe.forward(x, microbatches=2)
            assert len((await evaluating).losses) == 32
            # a hand-written schedule: its forwards run, in its order
            result = await pipe.evaluate(x, y, microbatches=2, schedule=[["F1", "F0"], ["F1", "F0"]])
            assert result.schedule.forward_only and len(result.losses) == 2
            with pytest.raises(tensorwire.ScheduleError, match="p=2, m=2; this step has p=2, m=3"):
                await pipe.evaluate(x, y, microbatches=3, schedule=result.schedule)
        with pytest.raises(tensorwire.ClosedResourceError):
            await pipe.evaluate(x, y, microbatches=2)
        with pytest.raises(tensorwire.ClosedResourceError):
            await pipe.forward(x, microbatches=2)
