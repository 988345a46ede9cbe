"""Several tensors between stages: a stage's output (and so the next stage's input, and the
gradients flowing back) may be a tuple or dict of tensors, integer ones among them, as
``torch.distributed.pipelining`` users write stages. Trained over real nodes and checked against
the same modules trained in one process; and the wire limits count every leaf."""

from __future__ import annotations

import asyncio
import copy
import importlib.util
import re
from typing import Any

import numpy as np
import pytest
from _pipeline_fixtures import NumpyLinear, nodes, stages
from _pipeline_reference import call_chain, mse, one_process_step

import tensorwire
from tensorwire import pipeline
from tensorwire.rpc import CallLimits
from tensorwire.transports import Limits

_NO_UCX = importlib.util.find_spec("ucxx") is None
TRANSPORTS = ["tcp", pytest.param("ucx", marks=pytest.mark.skipif(_NO_UCX, reason="ucxx is not installed"))]
RTOL = 1e-5


def tuple_modules(seed: int = 0) -> list[Any]:
    """Four stages passing tuples and a dict: an int tensor (ids) travels along and feeds an
    embedding, a float leaf (aux) that no later stage uses gets no gradient, and a skip
    connection carries a gradient back along two paths."""
    torch = pytest.importorskip("torch")
    nn = torch.nn
    torch.manual_seed(seed)
    d = 8

    class First(nn.Module):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.aux = nn.Linear(d, d), nn.Linear(d, 3)

        def forward(self, x: Any, ids: Any) -> Any:
            return torch.tanh(self.lin(x)), ids, self.aux(x)

    class Second(nn.Module):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.emb = nn.Linear(d, d), nn.Embedding(4, d)

        def forward(self, h: Any, ids: Any, aux: Any) -> Any:  # aux is ignored: no gradient reaches it
            return {"g": torch.tanh(self.lin(h)) + self.emb(ids), "skip": h, "ids": ids}

    class Third(nn.Module):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(d, d)

        def forward(self, g: Any, skip: Any, ids: Any) -> Any:
            return [torch.tanh(self.lin(g)) + skip, ids]  # a list travels as a tuple, as in torch

    class Last(nn.Module):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(d, 2)

        def forward(self, h: Any, ids: Any) -> Any:
            return self.lin(h) * (1 + ids.unsqueeze(1))

    return [First(), Second(), Third(), Last()]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
async def test_tuple_and_dict_activations_train_as_in_one_process(schedule: str, transport: str) -> None:
    await train_tuple_modules(schedule, transport, "cpu")


@pytest.mark.gpu
@pytest.mark.timeout(120)
async def test_tuple_activations_on_cuda_stages_train_as_in_one_process() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    await train_tuple_modules("1f1b", "tcp", "cuda")


async def train_tuple_modules(schedule: str, transport: str, device: str) -> None:
    torch = pytest.importorskip("torch")
    modules = [m.to(device) for m in tuple_modules()]
    reference = copy.deepcopy(modules)
    aux_before = {k: v.clone() for k, v in modules[0].aux.state_dict().items()}

    def optimizer(ps: Any) -> Any:  # weight decay moves a parameter that gets zeros instead of None
        return torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.1)

    ref_opt = optimizer([p for m in reference for p in m.parameters()])
    loss_fn = torch.nn.functional.mse_loss
    parts = [
        pipeline.TorchPart(m, optimizer=optimizer, loss=loss_fn if i == 3 else None) for i, m in enumerate(modules)
    ]
    g = torch.Generator().manual_seed(1)
    async with stages(parts, transport, offload=True) as (addresses, driver):
        async with await pipeline.Pipeline.connect(driver, addresses) as pipe:
            for n in (12, 9, 16):
                x = torch.randn(n, 8, generator=g).to(device)
                ids = torch.randint(0, 4, (n,), generator=g).to(device)
                y = torch.randn(n, 2, generator=g).to(device)
                # the batch is a tuple too: split element by element, stage 0 called as First(x, ids)
                result = await pipe.step((x, ids), y, microbatches=4, schedule=schedule)
                ref_opt.zero_grad()
                want = loss_fn(call_chain(reference, (x, ids)), y)
                want.backward()
                ref_opt.step()
                assert result.loss == pytest.approx(want.item(), rel=RTOL)
            states = await pipe.state()
            probe = torch.randn(10, 8, generator=g).to(device), torch.randint(0, 4, (10,), generator=g).to(device)
            got = await pipe.forward(probe, microbatches=3)  # forward only, tuples all the way
            with torch.no_grad():
                torch.testing.assert_close(got.to(device), call_chain(reference, probe), rtol=RTOL, atol=1e-6)
    assert reference[0].aux.weight.grad is None  # what the pipeline must reproduce
    for name, value in modules[0].aux.state_dict().items():
        assert torch.equal(value, aux_before[name]), f"stage 0 aux.{name} moved without a gradient"
    for s, (state, module) in enumerate(zip(states, reference, strict=True)):
        want_state = module.state_dict()
        assert state.keys() == want_state.keys()
        for name, value in state.items():
            torch.testing.assert_close(
                value.to(device), want_state[name], rtol=RTOL, atol=1e-6, msg=f"stage {s} {name}"
            )


# -- numpy: a layer gets and returns whatever structure, the loss too ---------------------------
class Fork:
    """x -> (x @ w, x @ v): two branches, whose gradients meet again in the backward."""

    def __init__(self, rng: np.random.Generator, d: int) -> None:
        self.lin_w, self.lin_v = NumpyLinear(rng, d, d, tanh=True), NumpyLinear(rng, d, d, tanh=False)

    def forward(self, x: np.ndarray) -> tuple[Any, Any]:
        a, ca = self.lin_w.forward(x)
        b, cb = self.lin_v.forward(x)
        return (a, b), (ca, cb)

    def backward(self, ctx: Any, grad: Any) -> Any:
        ga, gb = grad
        out = self.lin_w.backward(ctx[0], ga)
        return out + self.lin_v.backward(ctx[1], gb) if gb is not None else out

    def zero_grad(self) -> None:
        self.lin_w.zero_grad()
        self.lin_v.zero_grad()

    def step(self) -> None:
        self.lin_w.step()
        self.lin_v.step()

    def state(self) -> dict[str, Any]:
        return {f"w.{k}": v for k, v in self.lin_w.state().items()} | {
            f"v.{k}": v for k, v in self.lin_v.state().items()
        }


class Join:
    """(a, b) -> (a * b, a): the first output goes to the loss, the second gets no gradient."""

    def __init__(self, rng: np.random.Generator, d: int) -> None:
        self.lin = NumpyLinear(rng, d, 2, tanh=False)

    def forward(self, x: Any) -> tuple[Any, Any]:
        a, b = x
        y, cy = self.lin.forward(a * b)
        return (y, a), (a, b, cy)

    def backward(self, ctx: Any, grad: Any) -> Any:
        a, b, cy = ctx
        gy, ga_direct = grad
        assert ga_direct is None  # the loss gave no gradient for that leaf
        gab = self.lin.backward(cy, gy)
        return (gab * b, gab * a)

    def zero_grad(self) -> None:
        self.lin.zero_grad()

    def step(self) -> None:
        self.lin.step()

    def state(self) -> dict[str, Any]:
        return self.lin.state()


def tuple_mse(y: Any, target: np.ndarray) -> tuple[float, Any]:
    out, _ = y
    diff = out - target
    return float(np.mean(diff * diff)), ((2 * diff / diff.size).astype(np.float32), None)


def numpy_tuple_layers(seed: int = 3) -> list[Any]:
    rng = np.random.default_rng(seed)
    return [NumpyLinear(rng, 6, 6, tanh=True), Fork(rng, 6), Join(rng, 6)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
async def test_numpy_layers_pass_tuples_and_get_tuples_of_gradients_with_none_leaves(schedule: str) -> None:
    layers, reference = numpy_tuple_layers(), numpy_tuple_layers()
    parts = [pipeline.FunctionPart(layer, loss=tuple_mse if i == 2 else None) for i, layer in enumerate(layers)]
    rng = np.random.default_rng(4)
    async with stages(parts) as (addresses, driver):
        async with await pipeline.Pipeline.connect(driver, addresses) as pipe:
            for n in (16, 10):
                x = rng.standard_normal((n, 6)).astype(np.float32)
                y = rng.standard_normal((n, 2)).astype(np.float32)
                result = await pipe.step(x, y, microbatches=4, schedule=schedule)
                assert result.loss == pytest.approx(one_process_step(reference, x, y, tuple_mse), rel=RTOL)
            states = await pipe.state()
    for s, (state, layer) in enumerate(zip(states, reference, strict=True)):
        want = layer.state()
        assert state.keys() == want.keys()
        for name, value in state.items():
            np.testing.assert_allclose(value, want[name], rtol=RTOL, atol=1e-6, err_msg=f"stage {s} {name}")


# -- the wire limits count every leaf ------------------------------------------------------------
@pytest.mark.timeout(60)
async def test_a_tuple_activation_past_the_next_nodes_limit_is_refused_naming_the_stage() -> None:
    # each leaf (2048 bytes) fits stage 1's 3000-byte message limit; the tuple (4096) does not
    rng = np.random.default_rng(0)

    class Twice(NumpyLinear):
        def forward(self, x: np.ndarray) -> tuple[Any, Any]:
            y, ctx = super().forward(x)
            return (y, y.copy()), ctx

    parts = [
        pipeline.FunctionPart(Twice(rng, 64, 64, tanh=True)),
        pipeline.FunctionPart(NumpyLinear(rng, 64, 2, tanh=False), loss=lambda y, t: (0.0, y)),
    ]
    x = rng.standard_normal((16, 64)).astype(np.float32)
    async with stages(parts, only={1: {"limits": Limits(max_message_bytes=3000)}}) as (addresses, driver):
        async with await pipeline.Pipeline.connect(driver, addresses) as pipe:
            with pytest.raises(tensorwire.RemoteError) as err:
                async with asyncio.timeout(10):
                    await pipe.step(x, np.zeros((16, 2), np.float32), microbatches=2)
    assert err.value.remote_type == "MessageRefused", err.value
    assert "stage 0 cannot send its activation of microbatch 0 to stage 1" in str(err.value)


@pytest.mark.timeout(60)
async def test_a_tuple_batch_past_a_stages_call_limits_counts_every_element() -> None:
    # stage 0's node takes 3000 argument bytes a call: each element of the (x, x2) batch (2048
    # bytes a step) fits, both together do not; refused at the driver before any stage starts
    rng = np.random.default_rng(0)

    class Pair(NumpyLinear):
        def forward(self, x: Any) -> tuple[Any, Any]:
            return super().forward(x[0] + x[1])

        def backward(self, ctx: Any, grad: Any) -> Any:
            g = super().backward(ctx, grad)
            return (g, g)

    parts = [
        pipeline.FunctionPart(Pair(rng, 16, 16, tanh=True)),
        pipeline.FunctionPart(NumpyLinear(rng, 16, 2, tanh=False), loss=lambda y, t: (0.0, np.zeros_like(y))),
    ]
    x = rng.standard_normal((32, 16)).astype(np.float32)
    y = np.zeros((32, 2), np.float32)
    async with nodes(3) as ns, pipeline.Stage(ns[0], parts[0]), pipeline.Stage(ns[1], parts[1]):
        ns[0].methods.limits = CallLimits(max_inflight_bytes=3000)
        async with await pipeline.Pipeline.connect(ns[2], [ns[0].address, ns[1].address]) as pipe:
            with pytest.raises(tensorwire.MessageRefused, match="4096 bytes of microbatches, past the 3000-byte"):
                await pipe.step((x, x), y, microbatches=2)
            with pytest.raises(tensorwire.MessageRefused, match="4096 bytes of microbatches, past the 3000-byte"):
                await pipe.forward({"a": x, "b": x}, microbatches=2)
            await pipe.step((x[:8], x[:8]), y[:8], microbatches=2)  # refused before it began: nothing broke
            out = await pipe.forward((x[:8], x[:8]), microbatches=2)
            assert out.shape == (8, 2)


# -- what a TorchPart takes and gives -------------------------------------------------------------
@pytest.mark.timeout(60)
async def test_a_dict_key_a_torch_stage_cannot_take_as_a_keyword_is_named() -> None:
    """A key that is no str reached ``module(**d)``: a raw TypeError ('keywords must be strings')
    from the stage, which broke every stage; now the driver refuses such a batch before any
    stage runs, and a stage whose module returns one says which key."""
    torch = pytest.importorskip("torch")

    class IntKeys(torch.nn.Module):  # type: ignore[misc]
        def forward(self, x: Any) -> Any:
            return {0: x, "y": x}

    class Takes(torch.nn.Module):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            return self.lin(next(iter(kwargs.values())) if kwargs else args[0])

    x, y = torch.randn(4, 4), torch.randn(4, 4)
    loss = torch.nn.functional.mse_loss
    async with stages([pipeline.TorchPart(Takes(), loss=loss)]) as (addresses, driver):
        async with await pipeline.Pipeline.connect(driver, addresses) as pipe:
            for batch in ({0: x}, {"x": x, (1, 2): x}):
                key = next(k for k in batch if not isinstance(k, str))
                with pytest.raises(tensorwire.UnsupportedTensorError, match=rf"the key {re.escape(repr(key))} "):
                    await pipe.step(batch, y, microbatches=2)
                with pytest.raises(tensorwire.UnsupportedTensorError, match=rf"the key {re.escape(repr(key))} "):
                    await pipe.forward(batch, microbatches=2)
            assert (await pipe.step({"x": x}, y, microbatches=2)).loss > 0  # refused at the driver: nothing broke
    async with stages([pipeline.TorchPart(IntKeys()), pipeline.TorchPart(Takes(), loss=loss)]) as (addresses, driver):
        async with await pipeline.Pipeline.connect(driver, addresses) as pipe:
            with pytest.raises(tensorwire.RemoteError) as failed:
                await pipe.step(x, y, microbatches=2)
            assert failed.value.remote_type == "UnsupportedTensorError", failed.value
            assert "the output of the stage's module is a dict with the key 0 (int)" in str(failed.value)


class _IntKeyLayer(NumpyLinear):
    """A numpy layer that takes and returns a dict with int keys (a FunctionPart keeps them)."""

    def forward(self, x: Any) -> tuple[Any, Any]:
        y, ctx = super().forward(x[0] if isinstance(x, dict) else x)
        return {0: y, 1: 3}, ctx

    def backward(self, ctx: Any, grad: Any) -> Any:
        g = super().backward(ctx, grad[0])
        return {0: g, 1: None}


@pytest.mark.timeout(60)
async def test_numpy_stages_keep_dicts_with_int_keys() -> None:
    """FunctionPart passes a dict as it is: int keys, which the wire carries, are allowed there."""
    rng = np.random.default_rng(3)

    class Last(NumpyLinear):
        def forward(self, x: Any) -> tuple[Any, Any]:
            return super().forward(x[0])

        def backward(self, ctx: Any, grad: Any) -> Any:
            return {0: super().backward(ctx, grad), 1: None}

    last = Last(rng, 4, 2, tanh=False)
    x = rng.standard_normal((6, 4)).astype(np.float32)
    y = rng.standard_normal((6, 2)).astype(np.float32)
    parts = [pipeline.FunctionPart(_IntKeyLayer(rng, 4, 4, tanh=True)), pipeline.FunctionPart(last, loss=mse)]
    async with stages(parts) as (addresses, driver):
        async with await pipeline.Pipeline.connect(driver, addresses) as pipe:
            assert (await pipe.step({0: x}, y, microbatches=2)).loss > 0
            assert (await pipe.forward({0: x}, microbatches=3)).shape == (6, 2)


@pytest.mark.timeout(60)
async def test_complex_activations_get_gradients_as_in_one_process() -> None:
    """Only floating-point input leaves took a gradient: a complex activation got none, and the
    first stage's parameters never moved."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)

    class ToComplex(torch.nn.Module):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x: Any) -> Any:
            return torch.fft.fft(self.lin(x))

    class FromComplex(torch.nn.Module):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 2)

        def forward(self, z: Any) -> Any:
            return self.lin(z.real + 2 * z.imag)

    await _train_against_one_process([ToComplex(), FromComplex()], torch.randn(6, 4), torch.randn(6, 2))


@pytest.mark.timeout(60)
async def test_a_stage_may_change_its_input_in_place() -> None:
    """The module got the leaf that takes the input's gradient, which torch refuses to change in
    place: ``nn.ReLU(inplace=True)`` first failed every training step ('a leaf Variable that
    requires grad is being used in an in-place operation')."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    nn = torch.nn
    first = nn.Linear(4, 4)
    second = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(4, 4))

    class Pair(nn.Module):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, h: Any) -> Any:
            return self.lin(h), h * 2

    class InPlacePair(nn.Module):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, a: Any, b: Any) -> Any:
            b.mul_(3)
            return self.lin(torch.relu_(a)) + b

    await _train_against_one_process([first, second, Pair(), InPlacePair()], torch.randn(6, 4), torch.randn(6, 4))


async def _train_against_one_process(modules: list[Any], x: Any, y: Any) -> None:
    """Two SGD steps through stages over tcp (1f1b) and in one process: equal parameters."""
    torch = pytest.importorskip("torch")
    reference = copy.deepcopy(modules)
    ref_opt = torch.optim.SGD([p for m in reference for p in m.parameters()], lr=0.1)
    loss = torch.nn.functional.mse_loss
    parts = [
        pipeline.TorchPart(
            m, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), loss=loss if i == len(modules) - 1 else None
        )
        for i, m in enumerate(modules)
    ]
    async with stages(parts, offload=True) as (addresses, driver):
        async with await pipeline.Pipeline.connect(driver, addresses) as pipe:
            for _ in range(2):
                await pipe.step(x, y, microbatches=2, schedule="1f1b")
                ref_opt.zero_grad()
                loss(call_chain(reference, x), y).backward()
                ref_opt.step()
    for s, (want, got) in enumerate(zip(reference, modules, strict=True)):
        for (name, p), q in zip(want.named_parameters(), got.parameters(), strict=True):
            torch.testing.assert_close(q.detach(), p.detach(), rtol=RTOL, atol=1e-6, msg=f"stage {s} {name}")


@pytest.mark.timeout(60)
async def test_a_dict_gradient_in_another_key_order_reaches_the_right_leaves() -> None:
    """A numpy stage after a torch stage that returns a dict built its gradient dict in another
    key order: the torch stage paired gradients with its outputs by position, so each went to
    the other output's layer (silently: both have one shape), and the parameters differed from
    one process by up to 0.2."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)

    class Two(torch.nn.Module):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)

        def forward(self, x: Any) -> Any:
            return {"a": self.a(x), "b": self.b(x)}

    class Mix:  # y = 2a + 3b, its gradient dict built "b" first
        def forward(self, d: dict[str, Any]) -> tuple[np.ndarray, None]:
            return np.asarray(d["a"]) * 2 + np.asarray(d["b"]) * 3, None

        def backward(self, ctx: Any, grad: np.ndarray) -> dict[str, np.ndarray]:
            return {"b": grad * 3, "a": grad * 2}

    module = Two()
    reference = copy.deepcopy(module)
    x = torch.randn(8, 4)
    y = np.random.default_rng(0).standard_normal((8, 3)).astype(np.float32)
    parts = [
        pipeline.TorchPart(module, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1)),
        pipeline.FunctionPart(Mix(), loss=mse),
    ]
    async with stages(parts) as (addresses, driver):
        async with await pipeline.Pipeline.connect(driver, addresses) as pipe, asyncio.timeout(30):
            got = await pipe.step(x, y, microbatches=3)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    out = reference(x)
    want = torch.nn.functional.mse_loss(out["a"] * 2 + out["b"] * 3, torch.as_tensor(y))
    want.backward()
    ref_opt.step()
    assert got.loss == pytest.approx(float(want.detach()), rel=RTOL)
    for (name, p), q in zip(reference.named_parameters(), module.parameters(), strict=True):
        torch.testing.assert_close(q.detach(), p.detach(), rtol=RTOL, atol=1e-6, msg=name)


class _Unwrapping(NumpyLinear):
    """A numpy layer that takes its input wrapped in tuples and dicts (their first item)."""

    def forward(self, x: Any) -> tuple[Any, Any]:
        while isinstance(x, (tuple, dict)):
            x = next(iter(x.values())) if isinstance(x, dict) else x[0]
        return super().forward(x)

    def backward(self, ctx: Any, grad: Any) -> Any:
        return None


@pytest.mark.timeout(60)
async def test_a_batch_no_call_could_carry_is_refused_before_any_stage_runs() -> None:
    """The driver checks the microbatches before any stage starts a step: a stage's call that
    fails at the driver while the other stages run the step breaks every stage until the next
    ``Pipeline.connect``. It checked a dict's keys as the items of a list, and a microbatch as
    a message of its own, not three levels deep in its stage's call: a dict batch keyed by a
    tuple or a numpy number, or one nested 30 deep, failed at the driver (UnsupportedTensorError)
    and every later step raised BrokenResourceError. Now each is refused up front, and the
    pipeline goes on; 29 deep still travels."""
    from tensorwire.tensors._tree import MAX_DEPTH

    rng = np.random.default_rng(3)
    parts = [
        pipeline.FunctionPart(_Unwrapping(rng, 4, 4, tanh=True)),
        pipeline.FunctionPart(NumpyLinear(rng, 4, 2, tanh=False), loss=mse),
    ]
    x = rng.standard_normal((6, 4)).astype(np.float32)
    y = rng.standard_normal((6, 2)).astype(np.float32)

    def nested(levels: int) -> Any:
        batch: Any = x
        for _ in range(levels):
            batch = (batch,)
        return batch

    refused = [
        ({(0, 1): x}, "dict key of type tuple"),
        ({np.float64(0.5): x}, "dict key of type numpy.float64"),
        (nested(MAX_DEPTH - 2), "pytree is nested deeper"),
    ]
    async with stages(parts) as (addresses, driver):
        async with await pipeline.Pipeline.connect(driver, addresses) as pipe:
            for batch, why in refused:
                refusal = f"microbatch 0 cannot be sent to stage 0: {why}"
                with pytest.raises(tensorwire.UnsupportedTensorError, match=refusal):
                    await pipe.step(batch, y, microbatches=2)
                assert (await pipe.step(x, y, microbatches=2)).loss > 0
            assert (await pipe.step(nested(MAX_DEPTH - 3), y, microbatches=2)).loss > 0


@pytest.mark.timeout(60)
async def test_a_batch_nested_thousands_deep_is_refused_as_the_wire_refuses_it() -> None:
    """The batch walks (split, join, num_samples, tree_map, tree_leaves) had no depth limit: a
    batch nested 3,000 tuples deep raised Python's RecursionError out of ``pipeline.split``,
    ``Pipeline.forward`` and ``Pipeline.step``. Each is now the wire's own refusal of a pytree
    past its depth (UnsupportedTensorError), and the pipeline goes on."""
    from tensorwire.pipeline._batch import no_gradient, num_samples, tree_leaves, tree_map
    from tensorwire.tensors._tree import MAX_DEPTH

    too_deep = f"pytree is nested deeper than {MAX_DEPTH} levels"
    rng = np.random.default_rng(5)
    x = rng.standard_normal((6, 4)).astype(np.float32)
    y = rng.standard_normal((6, 2)).astype(np.float32)
    deep: Any = x
    for i in range(3000):
        deep = (deep,) if i % 2 else {"k": deep}
    for walk in (
        lambda: pipeline.split(deep, 2),
        lambda: pipeline.join([deep, deep]),
        lambda: num_samples(deep),
        lambda: tree_map(lambda v: v, deep),
        lambda: tree_leaves(deep),
        lambda: no_gradient([deep]),
    ):
        with pytest.raises(tensorwire.UnsupportedTensorError, match=too_deep):
            walk()
    shallow: Any = x
    for _ in range(MAX_DEPTH - 3):
        shallow = (shallow,)
    assert len(pipeline.split(shallow, 2)) == 2

    parts = [
        pipeline.FunctionPart(_Unwrapping(rng, 4, 4, tanh=True)),
        pipeline.FunctionPart(NumpyLinear(rng, 4, 2, tanh=False), loss=mse),
    ]
    async with stages(parts) as (addresses, driver):
        async with await pipeline.Pipeline.connect(driver, addresses) as pipe, asyncio.timeout(30):
            with pytest.raises(tensorwire.UnsupportedTensorError, match=too_deep):
                await pipe.forward(deep, microbatches=2)
            with pytest.raises(tensorwire.UnsupportedTensorError, match=too_deep):
                await pipe.step(deep, y, microbatches=2)
            assert (await pipe.step(x, y, microbatches=2)).loss > 0


@pytest.mark.timeout(60)
async def test_a_torch_stage_output_nested_thousands_deep_fails_as_the_wire_refuses_it() -> None:
    """A TorchPart whose module returned an output 3,000 tuples deep failed its stage with
    "raised RecursionError" (its output's tree walks); now it is the wire's refusal of a pytree
    past its depth."""
    torch = pytest.importorskip("torch")
    from tensorwire.tensors._tree import MAX_DEPTH

    class Burying(torch.nn.Module):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x: Any) -> Any:
            y = self.lin(x)
            for _ in range(3000):
                y = (y,)
            return y

    async with stages([pipeline.TorchPart(Burying())]) as (addresses, driver):
        async with await pipeline.Pipeline.connect(driver, addresses) as pipe, asyncio.timeout(30):
            refusal = f"raised UnsupportedTensorError: pytree is nested deeper than {MAX_DEPTH} levels"
            with pytest.raises(tensorwire.RemoteError, match=refusal):
                await pipe.forward(torch.zeros(4, 4), microbatches=2)
