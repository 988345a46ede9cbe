"""Pipeline stages on a GPU other than the first: a stage receives its activations and gradients
on its part's device, not on the event loop thread's current one (cuda:0).

Needs two CUDA devices and torch; skips with a reason elsewhere (tests/test_pipeline_edges.py
covers on the CPU that a stage asks for its part's device).
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest
from _gpu_skip import cupy_with_a_device
from _pipeline_fixtures import stages

cp = cupy_with_a_device("the pipeline GPU tests")

from tensorwire import pipeline  # noqa: E402
from tensorwire.memory._cuda import cuda_device_count  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(cuda_device_count() < 2, reason="needs two CUDA devices")]


@pytest.mark.timeout(120)
async def test_a_stage_on_cuda_1_receives_on_cuda_1_and_leaves_gpu_0_alone() -> None:
    # the old stage received where its event loop thread's current device was, cuda:0, while
    # TorchPart made cuda:1 current in its compute thread only: a stage on cuda:1 (rank r of
    # a box's `tensorwire stage` processes on cuda:r) took every activation and gradient on
    # GPU 0 and copied it across
    torch = pytest.importorskip("torch", reason="torch is not installed: the TorchPart tests need it")
    if torch.cuda.device_count() < 2:
        pytest.skip("torch sees fewer than two CUDA devices")

    class Arrivals(pipeline.TorchPart):
        """A TorchPart that notes the device of each input and gradient as the stage got it."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.arrived: list[str] = []

        def forward_loss(self, x: Any, target: Any, weight: float, needs_input_grad: bool) -> tuple[float, Any]:
            self.arrived.append(str(x.device))
            return super().forward_loss(x, target, weight, needs_input_grad)

        def backward(self, ctx: Any, grad: Any) -> Any:
            if grad is not None:
                self.arrived.append(str(grad.device))
            return super().backward(ctx, grad)

    torch.manual_seed(0)
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1)
    first = Arrivals(torch.nn.Linear(8, 8).to("cuda:1"), optimizer=sgd)
    last = Arrivals(torch.nn.Linear(8, 2).to("cuda:1"), optimizer=sgd, loss=torch.nn.functional.mse_loss)
    x, y = torch.randn(12, 8), torch.randn(12, 2)  # host tensors: only the stages put anything on a GPU
    assert torch.cuda.current_device() == 0  # the event loop thread's, where the old stage received
    torch.cuda.synchronize(0)
    torch.cuda.reset_peak_memory_stats(0)
    before = torch.cuda.memory_allocated(0)
    async with stages([first, last], "tcp", offload=True) as (addresses, driver):
        async with await pipeline.Pipeline.connect(driver, addresses) as pipe:
            for _ in range(2):
                async with asyncio.timeout(60):
                    result = await pipe.step(x, y, microbatches=3, schedule="1f1b")
                assert math.isfinite(result.loss), result.loss
    assert last.arrived == ["cuda:1"] * 6, last.arrived  # activations
    assert first.arrived == ["cuda:1"] * 6, first.arrived  # gradients
    assert torch.cuda.max_memory_allocated(0) == before, "a stage on cuda:1 allocated on GPU 0"
