"""Pipeline steps at the edges a torch.distributed.pipelining user runs into: a stage through
which no gradient flows back (checked against the same modules trained in one process), a stage
whose code raises on one microbatch (the error names it), and a batch past a stage's CallLimits."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import time
import warnings
from typing import Any

import numpy as np
import pytest
from _elsewhere import on_another_loop
from _pipeline_fixtures import NumpyLinear, nodes, stages
from _pipeline_reference import mse

import tensorwire
from tensorwire import pipeline
from tensorwire.rpc import CallLimits
from tensorwire.testing import peak_allocation


class RaisesOnce(NumpyLinear):
    """A layer whose forward or backward of one microbatch (by its input's first value) raises."""

    def __init__(self, rng: np.random.Generator, kind: str, marker: float) -> None:
        super().__init__(rng, 4, 4, tanh=True)
        self.kind, self.marker = kind, marker

    def forward(self, x: np.ndarray) -> tuple[np.ndarray, Any]:
        if self.kind == "F" and x[0, 0] == self.marker:
            raise FloatingPointError("overflow in this microbatch")
        y, ctx = super().forward(x)
        return y, (ctx, x[0, 0] == self.marker)

    def backward(self, ctx: Any, grad: np.ndarray) -> np.ndarray:
        inner, marked = ctx
        if self.kind == "B" and marked:
            raise FloatingPointError("overflow in this microbatch")
        return super().backward(inner, grad)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("kind", "schedule", "what"), [("F", "gpipe", "forward"), ("B", "1f1b", "backward")])
async def test_an_error_in_one_microbatch_names_the_stage_and_the_microbatch(
    kind: str, schedule: str, what: str
) -> None:
    # the old stage said "stage 1 raised FloatingPointError in step 0" and no more: with 4
    # microbatches, which one (and forward or backward) was left to guess
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 4)).astype(np.float32)
    x[4, 0] = 7.0  # the first row of microbatch 2 (of 4)
    parts = [
        pipeline.FunctionPart(NumpyLinear(rng, 4, 4, tanh=False, bias=False)),
        pipeline.FunctionPart(RaisesOnce(rng, kind, 7.0)),
        pipeline.FunctionPart(NumpyLinear(rng, 4, 2, tanh=False), loss=mse),
    ]
    parts[0].layer.w = np.eye(4, dtype=np.float32)  # type: ignore[attr-defined]  # stage 1 sees x
    async with stages(parts) as (addresses, driver):
        async with await pipeline.Pipeline.connect(driver, addresses) as pipe:
            with pytest.raises(tensorwire.RemoteError) as err:
                async with asyncio.timeout(10):
                    await pipe.step(x, np.zeros((8, 2), np.float32), microbatches=4, schedule=schedule)
    where = f"step 0, at {kind}2: the {what} of microbatch 2"
    assert err.value.remote_type == "FloatingPointError"
    assert f"pipeline stage 1 raised this in {where}" in err.value.remote_traceback
    notes = "\n".join(err.value.__notes__)
    assert notes.count(f"aborted because stage 1 raised FloatingPointError in {where}: overflow") == 2, notes


class _BadStr(FloatingPointError):
    def __str__(self) -> str:
        raise RuntimeError("no str for you")


@dataclasses.dataclass(frozen=True)
class _FrozenError(FloatingPointError):
    """An exception that is a frozen dataclass: add_note() cannot set its __notes__."""

    code: int


class _TupleNotes(FloatingPointError):
    __notes__ = ("a library's own note, in a tuple",)  # type: ignore[assignment]


class _RaisesAwkward(NumpyLinear):
    error: BaseException

    def forward(self, x: np.ndarray) -> tuple[np.ndarray, Any]:
        raise self.error


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "error", [_BadStr(), _FrozenError(7), _TupleNotes("overflow")], ids=["str-raises", "frozen", "tuple-notes"]
)
async def test_a_part_error_that_takes_no_str_or_no_note_still_aborts_every_stage(error: BaseException) -> None:
    # str-raises: the old stage put the part's error into its abort reason with an f-string,
    # and the str() that raised there replaced the part's error. frozen, tuple-notes: the stage
    # names the microbatch in a note on the part's error; an error that refuses add_note (a
    # frozen dataclass raises FrozenInstanceError, __notes__ that is not a list a TypeError)
    # raised that instead, from the stage's except clause. Either way no abort was sent, the
    # other stages waited for the driver to cancel them abort_grace (6 s) later, their accounts
    # said DeadlineExceeded, and the step reported the str() or add_note failure, not the part's error
    rng = np.random.default_rng(0)
    raising = _RaisesAwkward(rng, 4, 4, tanh=True)
    raising.error = error
    parts = [
        pipeline.FunctionPart(NumpyLinear(rng, 4, 4, tanh=True)),
        pipeline.FunctionPart(raising),
        pipeline.FunctionPart(NumpyLinear(rng, 4, 2, tanh=False), loss=mse),
    ]
    x = rng.standard_normal((8, 4)).astype(np.float32)
    async with stages(parts) as (addresses, driver):
        async with await pipeline.Pipeline.connect(driver, addresses) as pipe:
            with pytest.raises(tensorwire.RemoteError) as err:
                async with asyncio.timeout(20):
                    await pipe.step(x, np.zeros((8, 2), np.float32), microbatches=2)
    assert err.value.remote_type == type(error).__name__, err.value
    notes = "\n".join(err.value.__notes__)
    assert notes.count(f"aborted because stage 1 raised {type(error).__name__} in step 0, at F0") == 2, notes
    assert "DeadlineExceeded" not in notes, notes


class _Halt(BaseException):
    """What a part's code may raise that is no Exception (pytest.fail's, a BaseExceptionGroup)."""


class _RaisesHalt(NumpyLinear):
    def forward(self, x: np.ndarray) -> tuple[np.ndarray, Any]:
        raise _Halt("stop right there")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("call", ["step", "forward"])
async def test_a_part_error_that_is_no_exception_aborts_every_stage_and_breaks_its_own(call: str) -> None:
    # A part that raised a BaseException that is no Exception (not a CancelledError) passed the
    # stage's except clauses: no abort was sent and the stage was not broken. The other stages
    # waited for the driver to cancel them abort_grace (6 s) later (their accounts said
    # DeadlineExceeded), and the next call ran on that stage alone, which waited for an
    # activation from a stage that had refused the call: another 6 s, then DeadlineExceeded again
    rng = np.random.default_rng(0)
    parts = [
        pipeline.FunctionPart(NumpyLinear(rng, 4, 4, tanh=True)),
        pipeline.FunctionPart(_RaisesHalt(rng, 4, 4, tanh=True)),
        pipeline.FunctionPart(NumpyLinear(rng, 4, 2, tanh=False), loss=mse),
    ]
    x, y = rng.standard_normal((8, 4)).astype(np.float32), np.zeros((8, 2), np.float32)
    async with stages(parts) as (addresses, driver):
        async with await pipeline.Pipeline.connect(driver, addresses) as pipe:
            run = (
                (lambda: pipe.step(x, y, microbatches=2))
                if call == "step"
                else (lambda: pipe.forward(x, microbatches=2))
            )
            with pytest.raises(tensorwire.RemoteError) as err:
                async with asyncio.timeout(20):
                    await run()
            assert err.value.remote_type == "_Halt", err.value
            notes = "\n".join(err.value.__notes__)
            # (in a forward stage 0 may have finished before the abort reached it)
            for s in (0, 2) if call == "step" else (2,):
                assert f"stage {s}: aborted because stage 1 raised _Halt in step 0, at F0" in notes, notes
            assert "DeadlineExceeded" not in notes, notes
            with pytest.raises(tensorwire.RemoteError) as again:
                async with asyncio.timeout(20):
                    await run()
            notes = "\n".join(again.value.__notes__)
            for s in (1, 2):  # stage 1 too
                assert f"stage {s} is broken by an earlier failure" in notes, notes
            assert "DeadlineExceeded" not in notes, notes


class _RaisesLong(NumpyLinear):
    def forward(self, x: np.ndarray) -> tuple[np.ndarray, Any]:
        raise ValueError("no good: " + "é" * 6000 + " (the end)")


@pytest.mark.timeout(60)
async def test_a_part_error_longer_than_a_neighbours_header_limit_still_aborts_every_stage() -> None:
    # The abort a stage sends its neighbours carried the part's error message whole. One longer
    # than a neighbour's Limits.max_header_bytes (here 6000 two-byte characters against 4 KiB; by
    # default any message past 1 MiB) made that send fail with MessageRefused, which the abort
    # send swallows: no neighbour heard, each waited for the driver to cancel it abort_grace
    # (6 s) later, and its account said DeadlineExceeded
    rng = np.random.default_rng(0)
    parts = [
        pipeline.FunctionPart(NumpyLinear(rng, 4, 4, tanh=True)),
        pipeline.FunctionPart(_RaisesLong(rng, 4, 4, tanh=True)),
        pipeline.FunctionPart(NumpyLinear(rng, 4, 2, tanh=False), loss=mse),
    ]
    x, y = rng.standard_normal((8, 4)).astype(np.float32), np.zeros((8, 2), np.float32)
    async with stages(parts, limits=tensorwire.Limits(max_header_bytes=4096)) as (addresses, driver):
        async with await pipeline.Pipeline.connect(driver, addresses) as pipe:
            with pytest.raises(tensorwire.RemoteError) as err:
                async with asyncio.timeout(20):
                    await pipe.step(x, y, microbatches=2)
    assert err.value.remote_type == "ValueError", err.value
    notes = "\n".join(err.value.__notes__)
    for s in (0, 2):
        assert f"stage {s}: aborted because stage 1 raised ValueError in step 0, at F0: the forward of" in notes, notes
    assert "DeadlineExceeded" not in notes, notes


@pytest.mark.timeout(60)
@pytest.mark.parametrize("call", ["forward", "evaluate"])
async def test_a_torch_modules_frozen_dataclass_error_in_eval_mode_comes_back_as_itself(call: str) -> None:
    # TorchPart ran forward-only microbatches inside a generator context manager (eval mode,
    # no_grad), whose __exit__ sets the leaving exception's __traceback__: the module's frozen
    # dataclass error became FrozenInstanceError ("cannot assign to field '__traceback__'")
    torch = pytest.importorskip("torch")

    class Refuses(torch.nn.Module):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.inner = torch.nn.Linear(4, 2)

        def forward(self, x: Any) -> Any:
            if not self.training:
                raise _FrozenError(3)
            return self.inner(x)

    last = Refuses()
    parts = [
        pipeline.TorchPart(torch.nn.Linear(4, 4)),
        pipeline.TorchPart(last, loss=torch.nn.functional.mse_loss),
    ]
    x, y = torch.ones(4, 4), torch.zeros(4, 2)
    async with stages(parts) as (addresses, driver):
        async with await pipeline.Pipeline.connect(driver, addresses) as pipe:
            run = pipe.forward(x, microbatches=2) if call == "forward" else pipe.evaluate(x, y, microbatches=2)
            with pytest.raises(tensorwire.RemoteError) as err:
                async with asyncio.timeout(20):
                    await run
    assert err.value.remote_type == "_FrozenError", err.value
    assert last.training and last.inner.training  # back in the mode it was in


@pytest.mark.timeout(120)
@pytest.mark.parametrize("call", ["step", "evaluate", "forward"])
async def test_a_microbatch_count_no_batch_fits_is_refused_before_a_schedule_is_made(call: str) -> None:
    # the old driver made and validated the schedule before it split the batch: 10**4
    # microbatches of a batch of 8 took 11 MiB and seconds of the event loop (10**6: 2.8 GiB and
    # about 100 s) before "a batch of 8 cannot be split into 10000 microbatches"
    rng = np.random.default_rng(0)
    parts = [
        pipeline.FunctionPart(NumpyLinear(rng, 4, 4, tanh=True)),
        pipeline.FunctionPart(NumpyLinear(rng, 4, 2, tanh=False), loss=mse),
    ]
    x, y = rng.standard_normal((8, 4)).astype(np.float32), np.zeros((8, 2), np.float32)
    batch = (x,) if call == "forward" else (x, y)
    async with stages(parts) as (addresses, driver):
        async with await pipeline.Pipeline.connect(driver, addresses) as pipe:
            run = getattr(pipe, call)
            with peak_allocation() as mem, pytest.raises(tensorwire.ShapeMismatchError, match="a batch of 8 cannot"):
                await run(*batch, microbatches=10**4)
            assert mem["peak"] < 1 << 20, mem
            # a count that is no count is still the schedule's error, as it was
            with pytest.raises(tensorwire.ScheduleError, match="num_microbatches must be a positive int, not 0"):
                await run(*batch, microbatches=0)
            await pipe.step(x, y, microbatches=2)  # refused before any stage ran: nothing broke


@pytest.mark.timeout(60)
@pytest.mark.parametrize("call", ["step", "evaluate"])
async def test_targets_of_another_sample_count_are_named_whatever_the_microbatch_count(call: str) -> None:
    # the old driver split the targets before it compared the counts: 6 inputs and 2 targets in
    # 3 microbatches said "a batch of 2 cannot be split into 3 microbatches" (the batch is 6),
    # and in 2 microbatches "inputs have 6 samples but targets 2"
    rng = np.random.default_rng(0)
    parts = [
        pipeline.FunctionPart(NumpyLinear(rng, 4, 4, tanh=True)),
        pipeline.FunctionPart(NumpyLinear(rng, 4, 2, tanh=False), loss=mse),
    ]
    x, y = rng.standard_normal((6, 4)).astype(np.float32), np.zeros((6, 2), np.float32)
    async with stages(parts) as (addresses, driver):
        async with await pipeline.Pipeline.connect(driver, addresses) as pipe:
            run = getattr(pipe, call)
            cases = [(x, y[:2], 6, 2), (x[:2], y, 2, 6), (x, (y[:2], y[:2]), 6, 2), ((x[:2],), {"y": y}, 2, 6)]
            for inputs, targets, n_in, n_targets in cases:
                for m in (2, 3):
                    with pytest.raises(tensorwire.ShapeMismatchError) as err:
                        await run(inputs, targets, microbatches=m)
                    assert f"inputs have {n_in} samples but targets {n_targets}" in str(err.value), (m, err.value)
            await pipe.step(x, y, microbatches=3)  # refused before any stage ran: nothing broke


@pytest.mark.timeout(60)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
async def test_no_gradient_through_a_stage_leaves_the_earlier_ones_untouched(schedule: str) -> None:
    # In one process stage 0's parameters get no gradient (None), so SGD with weight decay and
    # momentum leaves them alone; the old TorchPart sent zeros back instead, and weight decay
    # moved stage 0 (and through it every later loss) away from the one-process model.
    torch = pytest.importorskip("torch")
    nn = torch.nn

    class Detach(nn.Module):  # type: ignore[misc]
        def forward(self, x: Any) -> Any:
            return x.detach() * 2

    torch.manual_seed(0)
    d = 6
    parts = [nn.Linear(d, d), Detach(), nn.Linear(d, 2)]
    reference = nn.Sequential(*copy.deepcopy(parts))
    first = {k: v.clone() for k, v in parts[0].state_dict().items()}

    def optimizer(ps: Any) -> Any:
        return torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.1)

    ref_opt = optimizer(reference.parameters())
    loss_fn = nn.functional.mse_loss
    stage_parts = [
        pipeline.TorchPart(parts[0], optimizer=optimizer),
        pipeline.TorchPart(parts[1]),
        pipeline.TorchPart(parts[2], optimizer=optimizer, loss=loss_fn),
    ]
    x, y = torch.randn(7, d), torch.randn(7, 2)
    async with stages(stage_parts) as (addresses, driver):
        async with await pipeline.Pipeline.connect(driver, addresses) as pipe:
            for _ in range(2):
                result = await pipe.step(x, y, microbatches=3, schedule=schedule)
                ref_opt.zero_grad()
                want = loss_fn(reference(x), y)
                want.backward()
                ref_opt.step()
                assert result.loss == pytest.approx(want.item(), rel=1e-5)
    assert reference[0].weight.grad is None  # what the pipeline must reproduce
    for name, value in parts[0].state_dict().items():
        assert torch.equal(value, first[name]), f"stage 0 {name} moved without a gradient"
    for name, value in parts[2].state_dict().items():
        torch.testing.assert_close(value, reference[2].state_dict()[name], rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(60)
async def test_a_batch_past_a_stages_call_limits_fails_at_once_and_breaks_nothing() -> None:
    # stage 0's node serves calls of at most 4096 argument bytes (CallLimits). The old driver
    # checked only Limits.max_message_bytes and sent the step; the node refused stage 0's call
    # before the stage ran it, so no stage aborted the others, which waited abort_grace (6 s
    # here) for it, and the driver's cancel then broke every stage until the next connect
    rng = np.random.default_rng(0)
    parts = [
        pipeline.FunctionPart(NumpyLinear(rng, 64, 64, tanh=True)),
        pipeline.FunctionPart(NumpyLinear(rng, 64, 2, tanh=False), loss=mse),
    ]
    x = rng.standard_normal((32, 64)).astype(np.float32)  # 8192 bytes
    y = np.zeros((32, 2), np.float32)
    async with nodes(3) as ns, pipeline.Stage(ns[0], parts[0]), pipeline.Stage(ns[1], parts[1]):
        ns[0].methods.limits = CallLimits(max_inflight_bytes=4096)
        async with await pipeline.Pipeline.connect(ns[2], [ns[0].address, ns[1].address]) as pipe:
            with pytest.raises(tensorwire.MessageRefused, match="8192 bytes of microbatches, past the 4096-byte"):
                await pipe.step(x, y, microbatches=2)
            await pipe.step(x[:8], y[:8], microbatches=2)  # refused before it began: nothing broke
            # limits lowered after connect: the node refuses the call, and the driver cuts the
            # other stages short at once instead of waiting abort_grace for them
            ns[0].methods.limits = CallLimits(max_inflight_bytes=1024)
            with pytest.raises(tensorwire.InvalidArguments, match="carry 2048 tensor bytes; the limit here is 1024"):
                async with asyncio.timeout(3):
                    await pipe.step(x[:8], y[:8], microbatches=2)


@pytest.mark.timeout(60)
async def test_a_torch_batch_of_another_layout_is_refused_before_any_stage_runs() -> None:
    # a sparse batch raised torch's NotImplementedError ("Could not run 'aten::as_strided' ...",
    # then a hundred dispatch keys), a CSR one "RuntimeError: Sparse CSR tensors do not have
    # strides", a nested one in a tuple "RuntimeError: Internal error: NestedTensorImpl doesn't
    # support sizes": none from tensorwire's error tree, none saying what a batch may be
    torch = pytest.importorskip("torch")
    nn = torch.nn
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    with warnings.catch_warnings():  # torch calls CSR and nested tensors beta, prototype
        warnings.simplefilter("ignore")
        nested = torch.nested.nested_tensor([torch.randn(3, 4), torch.randn(5, 4)])
        cases = [
            (x.to_sparse(), "a Tensor of layout torch.sparse_coo cannot be cut along its first dimension"),
            (x.to_sparse_csr(), "a Tensor of layout torch.sparse_csr cannot be cut along its first dimension"),
            ((nested, x), "element 0 of the batch: a nested Tensor cannot be cut along its first dimension"),
        ]
    parts = [pipeline.TorchPart(nn.Linear(4, 4)), pipeline.TorchPart(nn.Linear(4, 2), loss=nn.functional.mse_loss)]
    async with stages(parts) as (addresses, driver):
        async with await pipeline.Pipeline.connect(driver, addresses) as pipe:
            for batch, text in cases:
                for run in (
                    lambda b=batch: pipe.step(b, y, microbatches=2),
                    lambda b=batch: pipe.forward(b, microbatches=2),
                    lambda b=batch: pipe.evaluate(x, b, microbatches=2),
                ):
                    with pytest.raises(tensorwire.UnsupportedTensorError, match="give a dense tensor") as err:
                        await run()
                    assert text in str(err.value), err.value
            assert (await pipe.step(x, y, microbatches=2)).loss > 0  # refused before any stage ran


@pytest.mark.timeout(60)
async def test_a_torch_module_output_the_wire_cannot_carry_or_a_loss_that_is_no_scalar_is_named() -> None:
    # a module returning a tuple failed with "AttributeError: 'tuple' object has no attribute
    # 'detach'", a loss without reduction with torch's "a Tensor with 14 elements cannot be
    # converted to Scalar": neither said what a TorchPart stage takes and returns. Tuples of
    # tensors now pass between stages (tests/test_pipeline_pytrees.py); an output holding
    # something the wire cannot carry is named
    torch = pytest.importorskip("torch")
    nn = torch.nn

    class Pair(nn.Module):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: Any) -> Any:
            y = self.lin(x)
            return y, object()

    x, y = torch.randn(4, 4), torch.randn(4, 2)
    cases = [
        (
            [Pair(), nn.Linear(4, 2)],
            nn.functional.mse_loss,
            "UnsupportedTensorError",
            "returned a tuple with a leaf of type object",
        ),
        ([nn.Linear(4, 4), nn.Linear(4, 2)], nn.MSELoss(reduction="none"), "ConfigurationError", "not a scalar tensor"),
    ]
    for modules, loss, kind, text in cases:
        parts = [pipeline.TorchPart(modules[0]), pipeline.TorchPart(modules[1], loss=loss)]
        async with stages(parts) as (addresses, driver):
            async with await pipeline.Pipeline.connect(driver, addresses) as pipe:
                with pytest.raises(tensorwire.RemoteError) as err:
                    async with asyncio.timeout(10):
                        await pipe.step(x, y, microbatches=2)
        assert err.value.remote_type == kind, err.value
        assert text in str(err.value) + err.value.remote_traceback, err.value


@pytest.mark.timeout(60)
async def test_a_numpy_stage_before_a_stage_that_passes_no_gradient_back_is_left_alone() -> None:
    # once TorchPart passed None (not zeros) for "no gradient", FunctionPart handed that None to
    # its layer's backward: a numpy stage before a detaching torch stage failed every step with
    # "unsupported operand type(s) for *: 'NoneType' and 'float'" (or took nan from np.asarray)
    torch = pytest.importorskip("torch")
    nn = torch.nn

    class Detach(nn.Module):  # type: ignore[misc]
        def forward(self, x: Any) -> Any:
            return x.detach() * 2

    class Counted(NumpyLinear):
        backwards = 0

        def backward(self, ctx: Any, grad: np.ndarray) -> np.ndarray:
            Counted.backwards += 1
            return super().backward(ctx, grad)

    rng = np.random.default_rng(0)
    first = Counted(rng, 4, 4, tanh=True)
    w0 = first.w.copy()
    parts = [
        pipeline.FunctionPart(first),
        pipeline.TorchPart(Detach()),
        pipeline.TorchPart(
            nn.Linear(4, 2), optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), loss=nn.functional.mse_loss
        ),
    ]
    x, y = rng.standard_normal((6, 4)).astype(np.float32), rng.standard_normal((6, 2)).astype(np.float32)
    async with stages(parts) as (addresses, driver):
        async with await pipeline.Pipeline.connect(driver, addresses) as pipe:
            losses = [(await pipe.step(x, y, microbatches=3)).loss for _ in range(2)]
    assert losses[1] < losses[0], losses  # the last stage trains
    assert Counted.backwards == 0 and np.array_equal(first.w, w0), "no gradient reached stage 0"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["tcp", "inproc"])
@pytest.mark.parametrize(("rank", "sender"), [(1, 0), (0, 1)])
async def test_a_stage_receives_on_its_parts_device(transport: str, rank: int, sender: int) -> None:
    # a stage received every activation and gradient where its event loop thread's current
    # device was (cuda:0), whatever device its part computed on: a stage on cuda:1 held memory
    # and a CUDA context on GPU 0, and copied each message across (tests/gpu/test_pipeline_gpu.py
    # checks the placement on two GPUs). Here, without a GPU, a part that names cuda:0 shows that
    # the stage asks for its part's device: its receive (the activation at rank 1, the gradient
    # at rank 0) is refused, as this process has no CUDA device. The old stage took host memory
    # and the step went through
    from tensorwire.tensors._device import cuda_usable

    if cuda_usable():
        pytest.skip("a CUDA device is here: tests/gpu/test_pipeline_gpu.py checks the placement on one")
    rng = np.random.default_rng(0)
    parts = [
        pipeline.FunctionPart(NumpyLinear(rng, 4, 4, tanh=True)),
        pipeline.FunctionPart(NumpyLinear(rng, 4, 2, tanh=False), loss=mse),
    ]
    parts[rank].device = "cuda:0"
    x, y = rng.standard_normal((4, 4)).astype(np.float32), rng.standard_normal((4, 2)).astype(np.float32)
    async with stages(parts, transport) as (addresses, driver):
        async with await pipeline.Pipeline.connect(driver, addresses) as pipe:
            with pytest.raises(tensorwire.RemoteError) as err:
                async with asyncio.timeout(20):
                    await pipe.step(x, y, microbatches=2, schedule="gpipe")
    # CudaUnavailableError (an UnsupportedTensorError) where CuPy is not installed
    assert err.value.remote_type in ("UnsupportedTensorError", "CudaUnavailableError"), err.value
    text = str(err.value)
    assert f"stage {rank} cannot receive from stage {sender}" in text, text
    assert "cuda:0" in text, text


_ROW = 196_608  # float32 values: 0.75 MiB a row, so a microbatch of two rows is past OFF_LOOP_BYTES


class _FortranScale:
    """y = w * x, returned in Fortran order: a microbatch of two rows is a strided array of
    1.5 MiB (packed in a copy thread when sent), one of a single row is contiguous (sent at once)."""

    def __init__(self) -> None:
        self.w = np.float32(1.5)
        self.zero_grad()

    def zero_grad(self) -> None:
        self.gw = np.float32(0.0)

    def forward(self, x: np.ndarray) -> tuple[np.ndarray, Any]:
        return np.asfortranarray(x * self.w), x

    def backward(self, ctx: Any, grad: np.ndarray) -> np.ndarray:
        self.gw += np.float32((ctx * grad).sum())
        return np.ascontiguousarray(grad * self.w)

    def step(self) -> None:
        self.w -= np.float32(0.1) * self.gw

    def state(self) -> dict[str, Any]:
        return {"w": np.array(self.w)}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["tcp", "inproc"])
async def test_a_schedule_validated_under_max_unexpected_runs_when_an_activation_is_packed_in_a_thread(
    transport: str,
) -> None:
    # GPipe receives in the order it sends, so Schedule.validate accepts it under any
    # Limits.max_unexpected. Microbatch 0's activation (strided, 1.5 MiB) is packed in a copy
    # thread; microbatch 1's (contiguous) went straight into the channel and took stage 1's one
    # message slot: stage 1 waited for F0 behind F1 for good (the step hung)
    limits = tensorwire.Limits(max_unexpected=1)
    parts = [pipeline.FunctionPart(_FortranScale()), pipeline.FunctionPart(_FortranScale(), loss=mse)]
    x = np.ones((3, _ROW), np.float32)
    y = np.zeros((3, _ROW), np.float32)
    async with stages(parts, transport, only={0: {"limits": limits}, 1: {"limits": limits}}) as (addresses, driver):
        async with await pipeline.Pipeline.connect(driver, addresses) as pipe:
            assert pipe.max_unexpected == [1, 1]
            async with asyncio.timeout(20):
                r = await pipe.step(x, y, microbatches=2, schedule="gpipe")
    assert np.isfinite(r.loss)


@pytest.mark.timeout(60)
async def test_an_evaluate_refused_by_the_last_stages_node_after_stage_0_finished_leaves_no_call_to_hang() -> None:
    # The last stage's node refuses its call (InvalidArguments: its CallLimits lowered since
    # connect) only once stage 0 has finished its forwards and sent its activations, which stay
    # unreceived at the last stage. Neither stage failed on its own, so neither was broken: the
    # driver raised InvalidArguments and ran the next call, with those activations holding both
    # of the last stage's message slots (max_unexpected=2). Stage 0's first send then waited for
    # a slot for good, and the last stage for that activation: the call hung.
    rng = np.random.default_rng(0)
    parts = [
        pipeline.FunctionPart(NumpyLinear(rng, 8, 8, tanh=True)),
        pipeline.FunctionPart(NumpyLinear(rng, 8, 2, tanh=False), loss=mse),
    ]
    x = rng.standard_normal((4, 8)).astype(np.float32)
    y = np.zeros((4, 2), np.float32)
    async with nodes(3, only={1: {"limits": tensorwire.Limits(max_unexpected=2)}}) as ns:
        async with pipeline.Stage(ns[0], parts[0]), pipeline.Stage(ns[1], parts[1]):
            release = asyncio.Event()

            @ns[1].method()
            async def hold() -> None:  # holds the last stage's node's only slot for a while
                await release.wait()

            async with await pipeline.Pipeline.connect(ns[2], [ns[0].address, ns[1].address]) as pipe:
                other = await ns[2].connect(ns[1].address)
                ns[1].methods.limits = CallLimits(max_concurrent=1, max_arg_bytes=0)
                holding = asyncio.create_task(other.call("hold"))
                await asyncio.sleep(0.1)
                run = asyncio.create_task(pipe.evaluate(x, y, microbatches=2))
                await asyncio.sleep(0.5)  # stage 0 finishes its forwards meanwhile
                release.set()
                with pytest.raises(tensorwire.InvalidArguments, match="the limit here is 0"):
                    async with asyncio.timeout(10):
                        await run
                await holding
                await other.aclose()
                ns[1].methods.limits = CallLimits()
                # the next call ends at once: refused, as the stages are broken until the next connect
                try:
                    async with asyncio.timeout(10):
                        with pytest.raises(tensorwire.BrokenResourceError, match=r"until the next Pipeline\.connect"):
                            await pipe.evaluate(x, y, microbatches=2)
                except TimeoutError:
                    pytest.fail("the evaluate after the refused one hung")
            async with await pipeline.Pipeline.connect(ns[2], [ns[0].address, ns[1].address]) as again:
                assert (await again.evaluate(x, y, microbatches=2)).loss > 0


class _SlowState(NumpyLinear):
    """A layer whose state() takes a while between its tensors (copying a large model)."""

    def state(self) -> dict[str, np.ndarray]:
        w = self.w.copy()
        time.sleep(0.3)
        return {"w": w, "b": self.b.copy()}


@pytest.mark.timeout(60)
async def test_state_of_a_stage_that_computes_on_the_loop_is_never_torn_by_a_step() -> None:
    # With offload=False a stage runs its part's code on the loop, but state() ran in the worker
    # thread all the same, beside a step's optimizer update on the loop: pipe.state() called
    # during a step returned stage 0's w from before the update and its b from after, a set of
    # parameters the model never had.
    rng = np.random.default_rng(0)
    parts = [
        pipeline.FunctionPart(_SlowState(rng, 4, 4, tanh=True)),
        pipeline.FunctionPart(NumpyLinear(rng, 4, 2, tanh=False), loss=mse),
    ]
    x = rng.standard_normal((8, 4)).astype(np.float32)
    y = rng.standard_normal((8, 2)).astype(np.float32)
    async with stages(parts, offload=False) as (addresses, driver):
        async with await pipeline.Pipeline.connect(driver, addresses) as pipe:
            before = (await pipe.state())[0]
            _, during = await asyncio.gather(pipe.step(x, y, microbatches=2), pipe.state())
            after = (await pipe.state())[0]
            assert not np.array_equal(before["b"], after["b"]) and not np.array_equal(before["w"], after["w"])
            snapshot = during[0]
            whole = [all(np.array_equal(snapshot[k], ref[k]) for k in ("w", "b")) for ref in (before, after)]
            assert any(whole), {k: [np.array_equal(snapshot[k], r[k]) for r in (before, after)] for k in ("w", "b")}


@pytest.mark.timeout(60)
async def test_a_pipeline_and_its_stages_refuse_calls_from_another_loop_and_serve_on() -> None:
    """README (Lifecycle): pipelines and stages, as nodes and peers, belong to their loop; a
    call from another loop raises ConfigurationError at once. pipe.step from another thread's
    loop got that error only from the first stage call it made, after the other stages had
    begun the step: the pipeline was broken (BrokenResourceError) for every later step on its
    own loop, until a new Pipeline.connect; and pipe.aclose (or a stage's) from another loop
    closed it on that loop, whose tasks then belonged to nobody."""
    rng = np.random.default_rng(5)
    parts = [
        pipeline.FunctionPart(NumpyLinear(rng, 4, 4, tanh=True)),
        pipeline.FunctionPart(NumpyLinear(rng, 4, 2, tanh=False), loss=mse),
    ]
    x = rng.standard_normal((8, 4)).astype(np.float32)
    y = rng.standard_normal((8, 2)).astype(np.float32)
    async with nodes(3) as ns:
        async with pipeline.Stage(ns[0], parts[0]) as first, pipeline.Stage(ns[1], parts[1]):
            async with await pipeline.Pipeline.connect(ns[2], [ns[0].address, ns[1].address]) as pipe:
                calls = {
                    "pipeline.step": lambda: pipe.step(x, y, microbatches=2),
                    "pipeline.forward": lambda: pipe.forward(x, microbatches=2),
                    "pipeline.evaluate": lambda: pipe.evaluate(x, y, microbatches=2),
                    "pipeline.state": pipe.state,
                    "pipeline.aclose": pipe.aclose,
                    "stage.aclose": first.aclose,
                }
                for what, make in calls.items():
                    err = await asyncio.to_thread(on_another_loop, make)
                    # the pipeline serves on, on its own loop (it was broken, or closed)
                    result = await asyncio.wait_for(pipe.step(x, y, microbatches=2), 20)
                    assert np.isfinite(result.loss)
                    assert isinstance(err, tensorwire.ConfigurationError), (what, err)
                    assert f"{what} was called on an event loop that is not the node's" in str(err), err
                assert len(await pipe.forward(x, microbatches=2)) == len(x)
