"""Forward-only steps (inference, evaluation): ``Pipeline.forward`` runs the schedule's forwards
alone through real stages over real transports, and returns the last stage's outputs for the
whole batch. Checked against the same modules run in one process; a forward between training
steps changes nothing of the training; a stage that fails fails it as a training step does."""

from __future__ import annotations

import asyncio
import copy
import importlib.util
from typing import Any

import numpy as np
import pytest
from _pipeline_fixtures import CountingLinear, NumpyLinear, stages
from _pipeline_reference import mse

import tensorwire
from tensorwire import pipeline
from tensorwire.pipeline import Schedule, get_schedule, make_schedule

_NO_UCX = importlib.util.find_spec("ucxx") is None
TRANSPORTS = ["tcp", pytest.param("ucx", marks=pytest.mark.skipif(_NO_UCX, reason="ucxx is not installed"))]
RTOL = 1e-5


def mlp(torch: Any, seed: int = 0, dropout: float = 0.0) -> list[Any]:
    torch.manual_seed(seed)
    nn, d = torch.nn, 12
    return [
        nn.Sequential(nn.Linear(d, d), nn.Tanh()),
        nn.Sequential(nn.Linear(d, d), nn.Dropout(dropout), nn.Tanh()),
        nn.Sequential(nn.Linear(d, 3)),
    ]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
async def test_forward_equals_the_one_process_model(schedule: str, transport: str) -> None:
    torch = pytest.importorskip("torch")
    # dropout: the stages run their modules in eval mode for a forward (the driver cannot call
    # .eval() on a module in another process), and back in training mode afterwards
    modules = mlp(torch, dropout=0.5)
    reference = torch.nn.Sequential(*copy.deepcopy(modules)).eval()
    parts = [
        pipeline.TorchPart(m, loss=torch.nn.functional.mse_loss if i == 2 else None) for i, m in enumerate(modules)
    ]
    g = torch.Generator().manual_seed(1)
    async with stages(parts, transport, offload=True) as (addresses, driver):
        async with await pipeline.Pipeline.connect(driver, addresses) as pipe:
            for n, m in ((10, 4), (7, 7), (32, 3)):
                x = torch.randn(n, 12, generator=g)
                with torch.no_grad():
                    want = reference(x)
                got = await pipe.forward(x, microbatches=m, schedule=schedule)
                assert isinstance(got, torch.Tensor) and not got.requires_grad
                torch.testing.assert_close(got, want, rtol=RTOL, atol=1e-6)
                # numpy in: the stages give torch tensors back, which the driver joins as torch
                got = await pipe.forward(x.numpy(), microbatches=m, schedule=schedule)
                torch.testing.assert_close(got, want, rtol=RTOL, atol=1e-6)
    assert all(m.training for module in modules for m in module.modules())


@pytest.mark.timeout(90)
async def test_forward_between_training_steps_changes_nothing_of_the_training() -> None:
    torch = pytest.importorskip("torch")
    modules = mlp(torch)
    reference = torch.nn.Sequential(*copy.deepcopy(modules))

    def optimizer(ps: Any) -> Any:
        return torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01)

    ref_opt = optimizer(reference.parameters())
    loss_fn = torch.nn.functional.mse_loss
    parts = [
        pipeline.TorchPart(m, optimizer=optimizer, loss=loss_fn if i == 2 else None) for i, m in enumerate(modules)
    ]
    g = torch.Generator().manual_seed(2)
    async with stages(parts, offload=True) as (addresses, driver):
        async with await pipeline.Pipeline.connect(driver, addresses) as pipe:
            for step in range(3):
                x, y = torch.randn(16, 12, generator=g), torch.randn(16, 3, generator=g)
                result = await pipe.step(x, y, microbatches=4)
                ref_opt.zero_grad()
                want = loss_fn(reference(x), y)
                want.backward()
                ref_opt.step()
                assert result.loss == pytest.approx(want.item(), rel=RTOL), f"step {step}"
                grads = [[p.grad.clone() for p in m.parameters()] for m in modules]
                states = await pipe.state()
                probe = torch.randn(9, 12, generator=g)
                got = await pipe.forward(probe, microbatches=3)
                with torch.no_grad():
                    torch.testing.assert_close(got, reference(probe), rtol=RTOL, atol=1e-6)
                # the forward left every stage's gradients and parameters as the step left them
                for s, module in enumerate(modules):
                    for p, before in zip(module.parameters(), grads[s], strict=True):
                        assert torch.equal(p.grad, before), f"stage {s}: the forward touched a gradient"
                for before, after in zip(states, await pipe.state(), strict=True):
                    assert all(torch.equal(before[k], after[k]) for k in before)


# -- numpy stages: any structure out of the last stage, joined back into one batch ---------------
class Heads(NumpyLinear):
    """The last stage of a numpy model: (logits, {"mask": int rows}, a plain float)."""

    def forward(self, x: np.ndarray) -> tuple[Any, Any]:
        y, ctx = super().forward(x)
        return (y, {"mask": (y[:, :1] > 0).astype(np.int64)}, 1.5), ctx


@pytest.mark.timeout(60)
async def test_tuple_and_dict_outputs_are_joined_along_the_first_dimension() -> None:
    rng = np.random.default_rng(0)
    layers = [NumpyLinear(rng, 6, 6, tanh=True), NumpyLinear(rng, 6, 6, tanh=True), Heads(rng, 6, 2, tanh=False)]
    reference = copy.deepcopy(layers)
    parts = [pipeline.FunctionPart(layer, loss=mse if i == 2 else None) for i, layer in enumerate(layers)]
    x = rng.standard_normal((11, 6)).astype(np.float32)
    h = x
    for layer in reference:
        h, _ = layer.forward(h)
    want_y, want_mask = h[0], h[1]["mask"]
    async with stages(parts) as (addresses, driver):
        async with await pipeline.Pipeline.connect(driver, addresses) as pipe:
            # a hand-written order: the outputs still come back in microbatch order
            y, extra, scalars = await pipe.forward(x, microbatches=3, schedule=[["F2", "F0", "F1"]] * 3)
    np.testing.assert_allclose(y, want_y, rtol=RTOL, atol=1e-6)
    assert isinstance(extra, dict) and extra["mask"].dtype == np.int64
    np.testing.assert_array_equal(extra["mask"], want_mask)
    assert scalars == [1.5, 1.5, 1.5]  # no first dimension: one value per microbatch


# -- failure -------------------------------------------------------------------------------------
class RaisesOn(NumpyLinear):
    """Raises in the forward of the microbatch whose first value is ``marker`` while armed."""

    armed = True

    def forward(self, x: np.ndarray) -> tuple[np.ndarray, Any]:
        if self.armed and x[0, 0] == 7.0:
            raise FloatingPointError("overflow in this microbatch")
        return super().forward(x)


@pytest.mark.timeout(60)
async def test_a_stage_failing_a_forward_names_the_action_and_microbatch_and_breaks_until_reconnect() -> None:
    rng = np.random.default_rng(0)
    first = NumpyLinear(rng, 4, 4, tanh=False, bias=False)
    first.w = np.eye(4, dtype=np.float32)  # stage 1 sees x itself
    bad = RaisesOn(rng, 4, 4, tanh=True)
    parts = [
        pipeline.FunctionPart(first),
        pipeline.FunctionPart(bad),
        pipeline.FunctionPart(NumpyLinear(rng, 4, 2, tanh=False), loss=mse),
    ]
    x = rng.standard_normal((8, 4)).astype(np.float32)
    x[4, 0] = 7.0  # the first row of microbatch 2 (of 4)
    async with stages(parts) as (addresses, driver):
        async with await pipeline.Pipeline.connect(driver, addresses) as pipe:
            with pytest.raises(tensorwire.RemoteError) as err:
                async with asyncio.timeout(10):
                    await pipe.forward(x, microbatches=4)
            where = "step 0, at F2: the forward of microbatch 2"
            assert err.value.remote_type == "FloatingPointError"
            assert f"pipeline stage 1 raised this in {where}" in err.value.remote_traceback
            notes = "\n".join(err.value.__notes__)
            aborted = f"aborted because stage 1 raised FloatingPointError in {where}: overflow"
            assert f"stage 2: {aborted}" in notes, notes
            # stage 0 has no backward to wait for: it may have sent its last activation and
            # answered before the abort reached it (the abort then breaks it all the same)
            assert f"stage 0: {aborted}" in notes or "): finished" in notes, notes
            # broken, as after a failed training step, until a driver configures the stages again
            with pytest.raises(tensorwire.RemoteError, match="broken by an earlier failure"):
                await pipe.forward(x, microbatches=4)
        bad.armed = False
        async with await pipeline.Pipeline.connect(driver, addresses) as pipe:
            got = await pipe.forward(x, microbatches=4)
            h = x
            for part in parts:
                h, _ = part.layer.forward(h)
            np.testing.assert_allclose(got, h, rtol=RTOL, atol=1e-6)
            assert (await pipe.step(x, np.zeros((8, 2), np.float32), microbatches=2)).loss > 0


# -- forward-only schedules are schedules ---------------------------------------------------------
def test_forward_only_schedules_are_data() -> None:
    sched = get_schedule("1f1b")(3, 4).forwards()
    assert sched.forward_only and sched.forwards() is sched
    assert str(sched) == "stage 0: F0 F1 F2 F3\nstage 1: F0 F1 F2 F3\nstage 2: F0 F1 F2 F3"
    assert sched == Schedule("1f1b", 4, (sched.stages[0],) * 3, forward_only=True)
    assert sched.validate() is sched and sched.bubble == pytest.approx(2 / 6)
    assert sched.peak_activations(0) == 0  # a forward-only step keeps nothing for a backward
    assert sched.grid().splitlines()[1:3] == ["   0  F0      .       .", "   1  F1      F0      ."]
    assert Schedule.parse(str(sched), name="1f1b", forward_only=True) == sched
    # a training step refuses it, and a forward-only schedule that misses or adds actions is invalid
    with pytest.raises(tensorwire.ScheduleError, match="'1f1b' is forward-only: a training step runs"):
        make_schedule(sched, 3, 4)
    with pytest.raises(tensorwire.ScheduleError, match="stage 1 never runs F1"):
        Schedule.parse("F0 F1\nF0", forward_only=True).validate()
    with pytest.raises(tensorwire.ScheduleError, match="B0 is a backward, and this schedule is forward-only"):
        Schedule.parse("F0 B0", forward_only=True).validate()
    # given a training schedule, a forward step runs its forwards
    assert make_schedule([["F0", "B0", "F1", "B1"]], 1, 2, forward_only=True).stages == (
        (pipeline.Action.parse("F0"), pipeline.Action.parse("F1")),
    )


# -- an inference-only pipeline: no loss on the last stage ----------------------------------------
@pytest.mark.timeout(60)
async def test_a_pipeline_without_a_loss_serves_forward_and_refuses_a_step_before_any_stage_runs() -> None:
    """Configure refused a last stage without a loss ('stage 1 is the last stage but its part
    has no loss'), so a model served for inference alone could not be connected at all."""
    rng = np.random.default_rng(0)
    layers = [CountingLinear(rng, 6, 6, tanh=True), CountingLinear(rng, 6, 2, tanh=False)]
    reference = copy.deepcopy(layers)
    x = rng.standard_normal((8, 6)).astype(np.float32)
    want = reference[1].forward(reference[0].forward(x)[0])[0]
    async with stages([pipeline.FunctionPart(layer) for layer in layers]) as (addresses, driver):
        async with await pipeline.Pipeline.connect(driver, addresses) as pipe:
            np.testing.assert_allclose(await pipe.forward(x, microbatches=2), want, rtol=RTOL, atol=1e-6)
            CountingLinear.forwards = 0
            with pytest.raises(
                tensorwire.ConfigurationError, match=r"stage 1 \(.*\) is the last stage and its part has no loss"
            ):
                await pipe.step(x, np.zeros((8, 2), np.float32), microbatches=2)
            assert CountingLinear.forwards == 0  # refused at the driver: no stage ran, none is broken
            np.testing.assert_allclose(await pipe.forward(x, microbatches=4), want, rtol=RTOL, atol=1e-6)


@pytest.mark.timeout(60)
async def test_forward_puts_a_torch_module_in_eval_mode_through_its_own_train_method() -> None:
    """infer set ``.training`` by hand, so a module that overrides ``train()`` (to freeze a part
    of itself, say) was never told; its submodules are still each back in their own mode."""
    torch = pytest.importorskip("torch")
    calls: list[bool] = []

    class Told(torch.nn.Module):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.frozen = torch.nn.Linear(4, 4), torch.nn.Dropout(0.5)

        def train(self, mode: bool = True) -> Any:
            calls.append(mode)
            return super().train(mode)

        def forward(self, x: Any) -> Any:
            return self.frozen(self.lin(x))

    module = Told()
    module.frozen.eval()  # a submodule kept in eval mode while the module trains
    calls.clear()
    async with stages([pipeline.TorchPart(module)]) as (addresses, driver):
        async with await pipeline.Pipeline.connect(driver, addresses) as pipe:
            x = torch.randn(4, 4)
            torch.testing.assert_close(await pipe.forward(x, microbatches=2), module.lin(x).detach())
    assert calls == [False, True] * 2  # once per microbatch
    assert module.training and module.lin.training and not module.frozen.training


def test_join_refuses_what_it_cannot_join_the_same_way_whatever_the_order() -> None:
    """join(tensor) raised a raw RuntimeError; [0-d, 1-d] gave a list while [1-d, 0-d] raised;
    dicts with the same keys in another order were refused; float and int64 were promoted."""
    torch = pytest.importorskip("torch")
    join = pipeline.join
    with pytest.raises(tensorwire.ConfigurationError, match="list of microbatch outputs"):
        join(torch.zeros(3))
    with pytest.raises(tensorwire.ConfigurationError, match="list of microbatch outputs"):
        join(None)  # type: ignore[arg-type]
    for parts in ([torch.tensor(1.0), torch.zeros(2)], [torch.zeros(2), torch.tensor(1.0)]):
        with pytest.raises(tensorwire.ShapeMismatchError, match="dimensions in microbatch 0"):
            join(parts)
    got = join([{"a": torch.zeros(1), "b": torch.ones(2)}, {"b": torch.ones(1), "a": torch.zeros(3)}])
    assert list(got) == ["a", "b"] and got["a"].shape == (4,) and got["b"].shape == (3,)
    with pytest.raises(tensorwire.ShapeMismatchError, match="different keys"):
        join([{"a": torch.zeros(1)}, {"b": torch.zeros(1)}])
    with pytest.raises(tensorwire.ShapeMismatchError, match=r"torch\.float32 in microbatch 0 and torch\.int64"):
        join([torch.zeros(2), torch.zeros(2, dtype=torch.int64)])
    with pytest.raises(tensorwire.ShapeMismatchError, match=r"\[1\] is float32 in microbatch 0 and int64"):
        join([(np.zeros(1), np.zeros(1, np.float32)), (np.zeros(1), np.zeros(1, np.int64))])
    assert join([torch.tensor(1.0), torch.tensor(2.0)]) == [torch.tensor(1.0), torch.tensor(2.0)]


# -- an invalid training schedule is invalid for every call ---------------------------------------
@pytest.mark.timeout(60)
async def test_forward_and_evaluate_refuse_the_training_schedules_step_refuses() -> None:
    """``pipe.forward`` and ``pipe.evaluate`` took a training schedule's forwards and dropped the
    rest unchecked, so a schedule ``pipe.step`` refuses (a B before its F, a B that never comes,
    a B listed twice) ran its forwards there. Each call now refuses it with the same
    ScheduleError, before any stage runs; per-stage lists of forwards alone still run."""
    rng = np.random.default_rng(4)
    layers = [CountingLinear(rng, 6, 6, tanh=True), CountingLinear(rng, 6, 2, tanh=False)]
    parts = [pipeline.FunctionPart(layers[0]), pipeline.FunctionPart(layers[1], loss=mse)]
    x = rng.standard_normal((8, 6)).astype(np.float32)
    y = rng.standard_normal((8, 2)).astype(np.float32)
    fine = ["F0", "F1", "B0", "B1"]
    bad = [
        ([["B0", "F0", "F1", "B1"], fine], "stage 0: B0 comes before F0 on stage 0"),
        ([fine, ["F0", "F1", "B0"]], "B1 from stage 1, which it never runs"),
        ([fine, ["F0", "F1", "B0", "B1", "B1"]], "B1 runs a second time on stage 1"),
    ]
    for schedule, why in bad:
        with pytest.raises(tensorwire.ScheduleError, match=why):
            make_schedule(schedule, 2, 2, forward_only=True)
    async with stages(parts) as (addresses, driver):
        async with await pipeline.Pipeline.connect(driver, addresses) as pipe, asyncio.timeout(30):
            for schedule, why in bad:
                CountingLinear.forwards = 0
                with pytest.raises(tensorwire.ScheduleError, match=why) as refused:
                    await pipe.step(x, y, microbatches=2, schedule=schedule)
                with pytest.raises(tensorwire.ScheduleError) as forward:
                    await pipe.forward(x, microbatches=2, schedule=schedule)
                with pytest.raises(tensorwire.ScheduleError) as evaluate:
                    await pipe.evaluate(x, y, microbatches=2, schedule=schedule)
                assert str(forward.value) == str(evaluate.value) == str(refused.value)
                assert CountingLinear.forwards == 0  # refused at the driver: no stage ran
            assert (await pipe.forward(x, microbatches=2, schedule=[["F1", "F0"]] * 2)).shape == (8, 2)
            assert (await pipe.evaluate(x, y, microbatches=2, schedule=[fine, fine])).loss > 0
