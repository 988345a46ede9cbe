"""What a stage computes: its part of the model, behind one small interface.

A ``Part`` runs the forward of one microbatch and keeps what its backward needs in a context;
runs the backward from the gradient of its output and returns the gradient of its input; sums
its parameters' gradients over the microbatches of a step; and steps its own optimizer. The last
stage's part also computes the loss. For a step without backwards (``Pipeline.forward`` and
``Pipeline.evaluate``) ``infer`` and ``infer_loss`` compute the output or the loss alone, keeping
nothing for a backward.

Two kinds come with tensorwire: ``TorchPart`` wraps an ``nn.Module`` (autograd does the
backward) and ``FunctionPart`` wraps any object with an explicit ``forward``/``backward`` (a numpy
layer, say), so the pipeline needs torch only where a stage uses it. torch is imported when a
TorchPart is made, never by ``import tensorwire``.
"""

from __future__ import annotations

import importlib
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Any, Protocol, runtime_checkable

import numpy as np

from .._blocks import block
from .._checks import check_arguments
from ..errors import ConfigurationError, ShapeMismatchError, UnsupportedTensorError
from ._batch import no_gradient, tree_leaves, tree_map

__all__ = ["FunctionPart", "Layer", "Part", "TorchPart", "as_part"]


class Part(ABC):
    """One stage's share of the model. Subclass it for another framework."""

    #: whether this part computes a loss: a training step and ``Pipeline.evaluate`` need one on
    #: the last stage (a pipeline that only runs ``Pipeline.forward`` does not)
    has_loss: bool = False
    #: whether a dict input reaches the part's code as keyword arguments (``TorchPart``), so that
    #: its keys must be str; the driver then refuses another key before any stage runs
    keyword_dicts: bool = False
    #: where the part computes ("cuda:1", a torch.device, ...): a stage receives the part's
    #: activations and gradients there (a CUDA device; anything else is received where the
    #: sender's tensors were, host memory for host tensors). None: where the sender's were
    device: Any = None

    @abstractmethod
    def forward(self, x: Any, needs_input_grad: bool) -> tuple[Any, Any]:
        """Run the forward of one microbatch: (output, context for its backward)."""

    def infer(self, x: Any) -> Any:
        """Forward only (``Pipeline.forward``): the output for ``x``, with nothing kept for a
        backward and no gradient touched. By default ``forward`` with its context dropped."""
        return self.forward(x, False)[0]

    @abstractmethod
    def forward_loss(self, x: Any, target: Any, weight: float, needs_input_grad: bool) -> tuple[float, Any]:
        """Last stage: forward and loss of one microbatch, the loss scaled by ``weight`` (its share
        of the batch). Returns (unscaled loss, context)."""

    def infer_loss(self, x: Any, target: Any) -> float:
        """Last stage, evaluation (``Pipeline.evaluate``): the loss of one microbatch, unscaled,
        with nothing kept for a backward and no gradient touched. By default ``forward_loss``
        with its context dropped."""
        return self.forward_loss(x, target, 1.0, False)[0]

    @abstractmethod
    def backward(self, ctx: Any, grad: Any) -> Any:
        """Backward of one microbatch from the gradient of its output (None after
        ``forward_loss``, or when no gradient reaches the output): add to the parameters'
        gradients, return the input's gradient (None when ``needs_input_grad`` was False or no
        gradient reaches the input)."""

    @abstractmethod
    def zero_grad(self) -> None:
        """Forget the gradients summed so far (called before each step's first microbatch)."""

    @abstractmethod
    def step(self) -> None:
        """Apply the step's summed gradients with this part's optimizer."""

    @abstractmethod
    def state(self) -> dict[str, Any]:
        """Parameters (and buffers) by name, as tensors, for checks and checkpoints."""


@runtime_checkable
class Layer(Protocol):
    """Anything with an explicit backward, for ``FunctionPart``:

    forward(x) -> (y, ctx);  backward(ctx, grad_y) -> grad_x, adding to its own gradients;
    optionally step() (apply and clear the gradients), zero_grad() and state(). Where no
    gradient reaches the layer's output (a later stage detached it), its backward is not called
    for that microbatch, and the stage passes no gradient on.

    ``x`` and ``y`` may be any pytree the wire carries (a tensor, or a tuple, list or dict of
    tensors and plain scalars): a layer gets what the previous stage's layer returned, as it
    was. ``grad_y`` then has ``y``'s structure, with None for a leaf no gradient reaches, and
    ``grad_x`` is what the previous stage's backward gets."""

    def forward(self, x: Any) -> tuple[Any, Any]:
        """The layer's output for ``x``, and what its backward needs (``ctx``)."""
        ...

    def backward(self, ctx: Any, grad: Any) -> Any:
        """The gradient for the input, given ``ctx`` and the output's gradient; adds to the
        layer's own parameter gradients."""
        ...


class _LossContext:
    """What ``FunctionPart.forward_loss`` keeps for the backward: the layer's own context and the
    (scaled) gradient the loss gave. A type of its own, so that a layer's context is never taken
    for one (a ``None`` gradient from the next stage means "no gradient", not "last stage")."""

    __slots__ = ("ctx", "grad")

    def __init__(self, ctx: Any, grad: Any) -> None:
        self.ctx, self.grad = ctx, grad


@check_arguments
class FunctionPart(Part):
    """A stage made of a ``Layer``: numpy or anything else that does its own backward.

    ``loss(y, target) -> (loss, grad_y)`` makes it the last stage; the pipeline scales both by
    the microbatch's share of the batch, so the step's loss is the batch mean when ``loss`` is a
    mean over its microbatch. ``device``: the CUDA device the layer computes on ("cuda:1"): the
    stage receives its inputs and gradients there (``Part.device``); the layer makes it current.
    """

    def __init__(
        self, layer: Layer, *, loss: Callable[[Any, Any], tuple[Any, Any]] | None = None, device: Any = None
    ) -> None:
        if not (callable(getattr(layer, "forward", None)) and callable(getattr(layer, "backward", None))):
            raise ConfigurationError(f"{type(layer).__name__} needs forward(x) -> (y, ctx) and backward(ctx, grad)")
        check_loss(loss)
        self.layer = layer
        self.device = device
        self.loss = loss
        self.has_loss = loss is not None

    def forward(self, x: Any, needs_input_grad: bool) -> tuple[Any, Any]:
        y, ctx = self.layer.forward(x)
        return y, ctx

    def forward_loss(self, x: Any, target: Any, weight: float, needs_input_grad: bool) -> tuple[float, Any]:
        if self.loss is None:
            raise ConfigurationError("this stage has no loss, so it cannot be the last stage")
        y, ctx = self.layer.forward(x)
        value, grad = self.loss(y, target)
        return float(value), _LossContext(ctx, tree_map(lambda g: None if g is None else g * weight, grad))

    def infer_loss(self, x: Any, target: Any) -> float:
        """The layer's forward and the loss; the loss's gradient and the layer's context are
        dropped (nothing reaches the layer's backward or its gradients)."""
        if self.loss is None:
            raise ConfigurationError("this stage has no loss, so it cannot evaluate one")
        y, _ = self.layer.forward(x)
        value, _ = self.loss(y, target)
        return float(value)

    def backward(self, ctx: Any, grad: Any) -> Any:
        if isinstance(ctx, _LossContext):  # after forward_loss: the loss gave the output's gradient
            ctx, grad = ctx.ctx, ctx.grad
        elif no_gradient(grad):
            # no gradient reaches this stage's output (a later stage's result does not depend on
            # it, as TorchPart says): none reaches its parameters or its input, and the layer's
            # backward is not called with None
            return None
        return self.layer.backward(ctx, grad)

    def zero_grad(self) -> None:
        fn = getattr(self.layer, "zero_grad", None)
        if fn is not None:
            fn()

    def step(self) -> None:
        fn = getattr(self.layer, "step", None)
        if fn is not None:
            fn()

    def state(self) -> dict[str, Any]:
        fn = getattr(self.layer, "state", None)
        return dict(fn()) if fn is not None else {}


def _torch() -> Any:
    try:
        return importlib.import_module("torch")
    except ImportError as exc:
        raise ConfigurationError("TorchPart needs torch: pip install 'tensorwire[torch]'") from exc


@check_arguments
class TorchPart(Part):
    """A stage made of an ``nn.Module`` (any callable whose parameters are torch tensors).

    optimizer: a ``torch.optim.Optimizer`` over the module's parameters, or a callable that
        makes one from them (``lambda ps: torch.optim.SGD(ps, lr=0.1)``); None: no update.
    loss: ``loss(output, target) -> scalar tensor`` on the last stage, a mean over the
        microbatch (as ``F.mse_loss`` or ``F.cross_entropy``); the pipeline scales it by the
        microbatch's share of the batch, so gradients equal those of the whole batch's mean.

    Activations keep their shape, dtype and device kind across the wire; shapes may change from
    step to step. A module may return a tensor, or a tuple (a list is taken as one), or a dict
    of tensors and plain scalars, as ``torch.distributed.pipelining`` stages do: the next
    stage's module is called with a tuple unpacked as positional arguments (a dict as keyword
    arguments, so its keys must be str: another key is refused with UnsupportedTensorError), and
    the last stage's loss gets its module's output as it is. Floating-point and complex tensors of
    the input get gradients; integer and bool ones (masks, position ids) pass forward and get
    None, as does any leaf no gradient reaches (None, not zeros). The module may change its
    input in place (``nn.ReLU(inplace=True)`` first): it gets each input tensor through an
    identity step of autograd, not the leaf whose gradient goes back.
    """

    keyword_dicts = True

    def __init__(
        self,
        module: Any,
        *,
        optimizer: Any = None,
        loss: Callable[[Any, Any], Any] | None = None,
    ) -> None:
        torch = _torch()
        self._torch = torch
        if not callable(module):
            raise ConfigurationError(f"{type(module).__name__} is not callable")
        check_loss(loss)
        self.module = module
        params = list(module.parameters()) if hasattr(module, "parameters") else []
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            optimizer = optimizer(params)
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise ConfigurationError("optimizer= must be a torch Optimizer or make one from the parameters")
        self.optimizer = optimizer
        self.params = params
        # where the module computes: inputs, gradients and targets that arrive elsewhere move there
        self.device = params[0].device if params else None
        self._threads: set[int] = set()  # threads whose current CUDA device is this part's
        self.loss = loss
        self.has_loss = loss is not None

    def _enter(self) -> None:
        """Make the module's GPU current in the calling thread (and give the thread its CUDA
        context) the first time a thread runs this part: stage code runs in a worker thread."""
        if self.device is not None and self.device.type == "cuda":
            ident = threading.get_ident()
            if ident not in self._threads:
                cuda = self._torch.cuda
                cuda.set_device(self.device)
                # set_device does nothing where the thread's device already is this one (cuda:0
                # in every fresh thread), which leaves the thread without a current context: the
                # first cuBLAS call then binds one itself and warns. A runtime call binds it here.
                cuda.current_stream(self.device).query()
                self._threads.add(ident)

    def _leaf(self, v: Any, needs_input_grad: bool) -> Any:
        """One input leaf: a tensor (an array becomes one) detached from the wire buffer's
        history, on the module's device, taking a gradient where it is floating point or
        complex."""
        torch = self._torch
        if isinstance(v, np.ndarray):
            v = torch.as_tensor(v)
        if not isinstance(v, torch.Tensor):
            return v  # a plain scalar (None, a flag) goes to the module as it is
        t = v.detach()
        if self.device is not None and t.device != self.device:
            t = t.to(self.device)
        if needs_input_grad and (t.is_floating_point() or t.is_complex()):
            t.requires_grad_(True)
        return t

    def _leaves(self, x: Any, needs_input_grad: bool) -> Any:
        """``x`` as the module (or the loss) gets it: a tuple or dict leaf by leaf (``_leaf``),
        anything else one tensor (a list of samples becomes one)."""
        if isinstance(x, (tuple, dict)):
            return tree_map(lambda v: self._leaf(v, needs_input_grad), x)
        torch = self._torch
        return self._leaf(x if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x)), needs_input_grad)

    def _input(self, x: Any, needs_input_grad: bool) -> tuple[Any, Any]:
        """(the leaves whose gradients go back, what the module gets): one tensor (a list of
        samples becomes one), or a tuple or dict of leaves (positional or keyword arguments).
        The module gets each leaf that takes a gradient through an identity step of autograd
        (no copy): a leaf itself cannot be changed in place, its output can, and the leaf's
        gradient is the same."""
        self._enter()
        if isinstance(x, dict):
            _check_keywords(x, "the stage's input")
        leaves = self._leaves(x, needs_input_grad)
        if not needs_input_grad:
            return leaves, leaves
        identity = _identity(self._torch)
        return leaves, tree_map(
            lambda t: identity.apply(t) if isinstance(t, self._torch.Tensor) and t.requires_grad else t, leaves
        )

    def _call(self, x_in: Any) -> Any:
        if isinstance(x_in, tuple):
            return self.module(*x_in)
        if isinstance(x_in, dict):
            return self.module(**x_in)
        return self.module(x_in)

    def _output(self, y: Any) -> Any:
        """The module's output as the next stage gets it: a tensor, or a tuple (a list becomes
        one, as in torch.distributed.pipelining) or dict of tensors and plain scalars."""
        torch = self._torch
        if type(y) is list:
            y = tuple(y)
        if isinstance(y, dict):
            _check_keywords(y, "the output of the stage's module")
        for leaf in tree_leaves(y):
            if not isinstance(leaf, (torch.Tensor, type(None), bool, int, float, str, bytes)):
                raise UnsupportedTensorError(
                    f"TorchPart's module returned a {type(y).__name__} with a leaf of type {type(leaf).__name__}: a "
                    "TorchPart stage passes on a tensor, or a tuple or dict of tensors and plain scalars "
                    "(return those, or write a Part of your own)"
                )
        return y

    def forward(self, x: Any, needs_input_grad: bool) -> tuple[Any, Any]:
        leaves, x_in = self._input(x, needs_input_grad)
        with self._torch.enable_grad():
            y = self._output(self._call(x_in))
        return tree_map(self._detached, y), (leaves, y, False)

    def _detached(self, v: Any) -> Any:
        return v.detach() if isinstance(v, self._torch.Tensor) else v

    @block
    def _evaluating(self) -> Iterator[None]:
        """Under ``torch.no_grad()``, the module (and each submodule) in eval mode (dropout off,
        batch norm on its running statistics; ``.eval()``, so a module that overrides
        ``train()`` is told), then back in the mode it was in (each submodule in its own)."""
        module = self.module
        modules = list(module.modules()) if hasattr(module, "modules") else []
        modes = [(m, m.training) for m in modules if isinstance(getattr(m, "training", None), bool)]
        switch = bool(modes) and callable(getattr(module, "train", None))
        try:
            if switch:
                module.eval()  # eval() is train(False), which a module may override
            for m, _ in modes:  # and every submodule off, whatever an override did
                m.training = False
            with self._torch.no_grad():
                yield
        finally:
            if switch:
                module.train(modes[0][1])
            for m, mode in modes:
                m.training = mode

    def infer(self, x: Any) -> Any:
        """Forward only: the module's output for ``x``, computed in eval mode under
        ``torch.no_grad()`` (``_evaluating``)."""
        _, x_in = self._input(x, False)
        with self._evaluating():
            return tree_map(self._detached, self._output(self._call(x_in)))

    def infer_loss(self, x: Any, target: Any) -> float:
        """Evaluation: the loss of ``x`` against ``target``, computed as ``infer`` computes its
        output (eval mode, ``torch.no_grad()``), so nothing is kept and no gradient touched."""
        if self.loss is None:
            raise ConfigurationError("this stage has no loss, so it cannot evaluate one")
        _, x_in = self._input(x, False)
        target = self._target(target)
        with self._evaluating():
            return _scalar(self._torch, self.loss(self._call(x_in), target))

    def _target(self, target: Any) -> Any:
        """A microbatch's target as the loss gets it: a tensor (an array becomes one), or a tuple
        or dict of them, on the module's device."""
        return self._leaves(target, False)

    def forward_loss(self, x: Any, target: Any, weight: float, needs_input_grad: bool) -> tuple[float, Any]:
        if self.loss is None:
            raise ConfigurationError("this stage has no loss, so it cannot be the last stage")
        leaves, x_in = self._input(x, needs_input_grad)
        target = self._target(target)
        with self._torch.enable_grad():
            loss = self.loss(self._call(x_in), target)
            value = _scalar(self._torch, loss)
            scaled = loss * weight
        return value, (leaves, scaled, True)

    def backward(self, ctx: Any, grad: Any) -> Any:
        self._enter()
        torch = self._torch
        leaves, out, is_loss = ctx
        if is_loss:
            outs, grads = [out], [None]
        elif no_gradient(grad):
            # no gradient reaches this stage's output (the next stage's result does not depend
            # on it): as in one process, none reaches its parameters or its input either
            return None
        else:
            outs, grads = _matched(out, grad)
        pairs = []
        for o, g in zip(outs, grads, strict=True):
            if not isinstance(o, torch.Tensor) or not o.requires_grad:
                continue  # an integer output, or one that depends on no parameter or input
            if g is None and not is_loss:
                continue  # no gradient reaches this leaf
            if g is not None:
                g = g if isinstance(g, torch.Tensor) else torch.as_tensor(np.asarray(g))
                if g.device != o.device:
                    g = g.to(o.device)
            pairs.append((o, g))
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        # None, not zeros, for each input leaf no gradient reaches: the previous stages'
        # parameters then get none, as in one process (zeros would still move them by weight
        # decay or momentum)
        return tree_map(lambda t: t.grad if isinstance(t, torch.Tensor) and t.requires_grad else None, leaves)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def step(self) -> None:
        self._enter()
        if self.optimizer is not None:
            self.optimizer.step()

    def state(self) -> dict[str, Any]:
        if hasattr(self.module, "state_dict"):
            return {k: v.detach().clone() for k, v in self.module.state_dict().items()}
        return {}


def _matched(out: Any, grad: Any) -> tuple[list[Any], list[Any]]:
    """(output leaves, their gradients) in one order: a dict's gradient by key (a next stage's
    backward may build its dict in another order than the output's), a tuple's or list's
    element by element, anything else leaf by leaf in order."""
    keys: list[Any] | None = None
    if isinstance(out, dict) and isinstance(grad, dict):
        if grad.keys() != out.keys():
            raise ShapeMismatchError(
                f"the gradient that came back is a dict with the keys {sorted(map(repr, grad))}, the output it is "
                f"for has {sorted(map(repr, out))}: the next stage's backward must return one gradient (or None) "
                "per leaf of its input"
            )
        keys = list(out)
    elif isinstance(out, (tuple, list)) and isinstance(grad, (tuple, list)) and len(out) == len(grad):
        keys = list(range(len(out)))
    if keys is not None:
        outs, grads = [], []
        for key in keys:
            o, g = _matched(out[key], grad[key])
            outs += o
            grads += g
        return outs, grads
    outs, grads = tree_leaves(out), tree_leaves(grad)
    if len(grads) != len(outs):
        raise ShapeMismatchError(
            f"the gradient that came back has {len(grads)} leaves, the output it is for {len(outs)}: "
            "the next stage's backward must return one gradient (or None) per leaf of its input"
        )
    return outs, grads


def _scalar(torch: Any, loss: Any) -> float:
    """The value of what a TorchPart's loss returned, which must be a scalar tensor."""
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        tensor = isinstance(loss, torch.Tensor)
        what = f"a tensor of shape {tuple(loss.shape)}" if tensor else type(loss).__name__
        raise ConfigurationError(f"the loss returned {what}, not a scalar tensor (reduce it, e.g. with a mean)")
    return float(loss.detach())


def _check_keywords(d: dict[Any, Any], what: str) -> None:
    """A TorchPart calls the next module with a dict as keyword arguments: its keys are str."""
    for key in d:
        if not isinstance(key, str):
            raise UnsupportedTensorError(
                f"{what} is a dict with the key {key!r} ({type(key).__name__}): a TorchPart stage calls its "
                "module with a dict as keyword arguments, whose names are str (use str keys, a tuple, or a "
                "FunctionPart, which takes the dict as it is)"
            )


_IDENTITY: Any = None


def _identity(torch: Any) -> Any:
    """An autograd Function that passes its input on unchanged (no copy) and the gradient back
    unchanged: what a stage's module gets in place of an input leaf, so that it may change it
    in place (``nn.ReLU(inplace=True)``), which torch refuses on a leaf that takes a gradient."""
    global _IDENTITY
    if _IDENTITY is None:

        class _Identity(torch.autograd.Function):  # type: ignore[misc]
            @staticmethod
            def forward(ctx: Any, t: Any) -> Any:
                return t.detach()  # the same memory, not a view of the leaf for autograd

            @staticmethod
            def backward(ctx: Any, grad: Any) -> Any:
                return grad

        _IDENTITY = _Identity
    return _IDENTITY


def check_loss(loss: object) -> None:
    """``loss=`` is a function or None: anything else failed only on the last stage's first
    backward, as a TypeError from inside the step."""
    if loss is not None and not callable(loss):
        raise ConfigurationError(f"loss= is a function loss(output, target) or None, not {loss!r}")


def as_part(obj: Any, *, optimizer: Any = None, loss: Callable[..., Any] | None = None) -> Part:
    """A Part for ``obj``: itself if it is one, a TorchPart for a torch module, a FunctionPart
    for a Layer (forward/backward)."""
    if isinstance(obj, Part):
        if optimizer is not None or loss is not None:
            raise ConfigurationError("pass optimizer= and loss= to the Part itself")
        return obj
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.nn.Module):
        return TorchPart(obj, optimizer=optimizer, loss=loss)
    if isinstance(obj, Layer):
        if optimizer is not None:
            raise ConfigurationError("a Layer steps its own parameters (its step()); optimizer= is for torch modules")
        return FunctionPart(obj, loss=loss)
    raise ConfigurationError(
        f"{type(obj).__name__} is not a stage part: pass a torch nn.Module, an object with "
        "forward(x) -> (y, ctx) and backward(ctx, grad), or a Part"
    )
