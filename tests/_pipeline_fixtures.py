"""What the in-process pipeline tests build on: a numpy layer with its own backward (no torch
needed), real nodes on loopback, and stages serving parts with a driver node beside them."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

import tensorwire
from tensorwire import pipeline


class NumpyLinear:
    """y = act(x @ w + b) (x @ w with ``bias=False``), with its own backward and SGD step."""

    def __init__(
        self, rng: np.random.Generator, d_in: int, d_out: int, tanh: bool, lr: float = 0.05, bias: bool = True
    ) -> None:
        self.w = (rng.standard_normal((d_in, d_out)) / np.sqrt(d_in)).astype(np.float32)
        self.b = np.zeros(d_out, np.float32)  # with bias=False: not added, not trained, not in state()
        self.tanh, self.lr, self.bias = tanh, lr, bias
        self.zero_grad()

    def zero_grad(self) -> None:
        self.gw, self.gb = np.zeros_like(self.w), np.zeros_like(self.b)

    def forward(self, x: np.ndarray) -> tuple[np.ndarray, Any]:
        z = x @ self.w + self.b if self.bias else x @ self.w
        y = np.tanh(z) if self.tanh else z
        return y, (x, y)

    def backward(self, ctx: Any, grad: np.ndarray) -> np.ndarray:
        x, y = ctx
        if self.tanh:
            grad = grad * (1 - y * y)
        self.gw += x.T @ grad
        self.gb += grad.sum(axis=0)
        return grad @ self.w.T  # type: ignore[no-any-return]

    def step(self) -> None:
        self.w -= self.lr * self.gw
        if self.bias:
            self.b -= self.lr * self.gb

    def state(self) -> dict[str, np.ndarray]:
        if not self.bias:
            return {"w": self.w.copy()}
        return {"w": self.w.copy(), "b": self.b.copy()}


class CountingLinear(NumpyLinear):
    """A NumpyLinear that counts the forwards of every instance (reset ``forwards`` to 0 first)."""

    forwards = 0

    def forward(self, x: np.ndarray) -> tuple[np.ndarray, Any]:
        CountingLinear.forwards += 1
        return super().forward(x)


@contextlib.asynccontextmanager
async def nodes(
    n: int, transport: str = "tcp", *, only: dict[int, dict[str, Any]] | None = None, **options: Any
) -> AsyncIterator[list[tensorwire.Node]]:
    """``n`` nodes on loopback (port 0) offering ``transport`` alone; ``options`` are NodeConfig's,
    and ``only[i]`` node i's own (``limits=`` for one node, say)."""
    only = only or {}
    async with contextlib.AsyncExitStack() as stack:
        yield [
            await stack.enter_async_context(
                tensorwire.start("127.0.0.1:0", transports=(transport,), **{**options, **only.get(i, {})})
            )
            for i in range(n)
        ]


@contextlib.asynccontextmanager
async def stages(
    parts: list[Any],
    transport: str = "tcp",
    *,
    offload: bool = False,
    only: dict[int, dict[str, Any]] | None = None,
    **options: Any,
) -> AsyncIterator[tuple[list[str], tensorwire.Node]]:
    """Stages serving ``parts`` and one driver node, all on ``nodes(..., **options)``; yields
    (stage addresses, driver node). ``offload`` is the stages' (compute in a worker thread);
    ``only[s]``: NodeConfig options of stage s's node alone."""
    async with nodes(len(parts) + 1, transport, only=only, **options) as ns, contextlib.AsyncExitStack() as stack:
        for node, part in zip(ns, parts, strict=False):
            await stack.enter_async_context(pipeline.Stage(node, part, offload=offload))
        yield [n.address for n in ns[:-1]], ns[-1]
