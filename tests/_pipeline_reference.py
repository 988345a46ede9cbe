"""The same training step in one process, for the pipeline tests to compare against."""

from __future__ import annotations

from typing import Any

import numpy as np


def mse(y: np.ndarray, target: np.ndarray) -> tuple[float, np.ndarray]:
    diff = y - target
    return float(np.mean(diff * diff)), (2 * diff / diff.size).astype(np.float32)


def one_process_step(layers: list[Any], x: np.ndarray, y: np.ndarray, loss_fn: Any = mse) -> float:
    """Forward the whole batch through ``layers`` (zero_grad/forward/backward/step objects),
    ``loss_fn`` (mean squared error) and its gradient, backward, one optimizer step each;
    returns the loss."""
    h, ctxs = x, []
    for layer in layers:
        layer.zero_grad()
        h, ctx = layer.forward(h)
        ctxs.append(ctx)
    loss, grad = loss_fn(h, y)
    for layer, ctx in zip(reversed(layers), reversed(ctxs), strict=True):
        grad = layer.backward(ctx, grad)
    for layer in layers:
        layer.step()
    return loss


def call_chain(modules: list[Any], x: Any) -> Any:
    """The modules run one after the other in one process, each called as a pipeline stage is:
    a tuple unpacked as positional arguments, a dict as keyword arguments, anything else as is
    (``torch.distributed.pipelining``'s convention, and TorchPart's)."""
    for module in modules:
        if isinstance(x, tuple):
            x = module(*x)
        elif isinstance(x, dict):
            x = module(**x)
        else:
            x = module(x)
        if type(x) is list:
            x = tuple(x)
    return x
