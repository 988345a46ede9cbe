"""Pipeline parallelism: stage servers that pass activations forward and gradients backward
through tensorwire peers, microbatch after microbatch, as a schedule says.

    # on each stage's machine (or: tensorwire stage --part mymodel:build_part)
    async with tensorwire.start("0.0.0.0:5000") as node, pipeline.Stage(node, build=build_part):
        await asyncio.Event().wait()

    # on the driver
    async with tensorwire.start() as node:
        pipe = await pipeline.Pipeline.connect(node, stage_addresses)
        result = await pipe.step(x, y, microbatches=8, schedule="1f1b")
        outputs = await pipe.forward(x, microbatches=8)      # forward only: the last stage's outputs
        val = await pipe.evaluate(x, y, microbatches=8)       # the loss, no gradient, no update

Schedules are data (``get_schedule("1f1b")(num_stages, num_microbatches)``): per stage a list
of actions (``F0``, ``B3``) that is validated before it runs and drawn as a step-by-stage grid.
torch is needed only by stages that wrap a torch module; ``import tensorwire`` never imports it.
"""

from ._batch import join, split
from ._driver import EvalResult, Pipeline, StepResult
from ._part import FunctionPart, Layer, Part, TorchPart, as_part
from ._schedule import SCHEDULES, Action, Kind, Schedule, get_schedule, gpipe, make_schedule, one_f_one_b
from ._stage import Stage

__all__ = [
    "SCHEDULES",
    "Action",
    "EvalResult",
    "FunctionPart",
    "Kind",
    "Layer",
    "Part",
    "Pipeline",
    "Schedule",
    "Stage",
    "StepResult",
    "TorchPart",
    "as_part",
    "get_schedule",
    "join",
    "gpipe",
    "make_schedule",
    "one_f_one_b",
    "split",
]
