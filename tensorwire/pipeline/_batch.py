"""Batches and the pytrees stages pass: cutting a batch into microbatches and joining the last
stage's microbatch outputs back into one batch, and the few tree walks the parts need.

A batch is a tensor (numpy, torch, ...), a list of samples (label rows, say), or a tuple or dict
of those (several inputs: ids and an attention mask), cut element by element along the first
dimension; plain scalars (None, bool, int, float, str) in a tuple or dict go to every
microbatch as they are. ``join`` undoes ``split``.

Every walk stops where the wire would: a tree nested past ``MAX_DEPTH`` levels is the wire's
UnsupportedTensorError, not Python's RecursionError some thousand levels down.
"""

from __future__ import annotations

import itertools
import numbers
import sys
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from .._checks import check_arguments
from ..errors import ConfigurationError, ShapeMismatchError, UnsupportedTensorError
from ..tensors._tree import MAX_DEPTH

__all__ = ["join", "num_samples", "split", "tree_leaves", "tree_map", "no_gradient"]

_SCALARS = (type(None), bool, int, float, str, bytes)


def _check_depth(depth: int) -> None:
    """Refuse, as the wire does, a container ``depth`` levels deep whose items would be deeper
    than ``MAX_DEPTH``."""
    if depth >= MAX_DEPTH:
        raise UnsupportedTensorError(f"pytree is nested deeper than {MAX_DEPTH} levels")


def tree_map(fn: Callable[[Any], Any], obj: Any) -> Any:
    """``obj`` with ``fn`` applied to every leaf of its tuples, lists and dicts (lists and dicts
    stay lists and dicts; a tuple subclass becomes a tuple, as on the wire)."""
    return _tree_map(fn, obj, 0)


def _tree_map(fn: Callable[[Any], Any], obj: Any, depth: int) -> Any:
    if isinstance(obj, (tuple, list, dict)) and obj:
        _check_depth(depth)
    if isinstance(obj, tuple):
        return tuple(_tree_map(fn, v, depth + 1) for v in obj)
    if isinstance(obj, list):
        return [_tree_map(fn, v, depth + 1) for v in obj]
    if isinstance(obj, dict):
        return {k: _tree_map(fn, v, depth + 1) for k, v in obj.items()}
    return fn(obj)


def tree_leaves(obj: Any) -> list[Any]:
    """The leaves of ``obj`` in the order the wire carries them (dicts in insertion order)."""
    return _tree_leaves(obj, 0)


def _tree_leaves(obj: Any, depth: int) -> list[Any]:
    if isinstance(obj, (tuple, list, dict)) and obj:
        _check_depth(depth)
    if isinstance(obj, (tuple, list)):
        return [leaf for v in obj for leaf in _tree_leaves(v, depth + 1)]
    if isinstance(obj, dict):
        return [leaf for v in obj.values() for leaf in _tree_leaves(v, depth + 1)]
    return [obj]


def no_gradient(grad: Any) -> bool:
    """Whether ``grad`` says that no gradient reaches an output at all: None, or a tuple, list
    or dict whose every leaf is None."""
    return all(leaf is None for leaf in tree_leaves(grad))


def _structured(batch: Any) -> bool:
    return isinstance(batch, (tuple, dict))


def _scalar(obj: Any) -> bool:
    return isinstance(obj, _SCALARS) and not isinstance(obj, np.generic)


def num_samples(batch: Any) -> int | None:
    """How many samples ``batch`` (or one microbatch of it) holds: its first dimension, or that
    of the first element of a tuple or dict that has one (None: no element has one)."""
    return _num_samples(batch, 0)


def _num_samples(batch: Any, depth: int) -> int | None:
    if _structured(batch):
        if batch:
            _check_depth(depth)
        for v in batch.values() if isinstance(batch, dict) else batch:
            n = _num_samples(v, depth + 1)
            if n is not None:
                return n
        return None
    if _scalar(batch):
        return None
    try:
        return len(batch)
    except Exception:  # TypeError: no length; a nested torch tensor's RuntimeError (split names it)
        return None


@check_arguments
def split(batch: Any, microbatches: int) -> list[Any]:
    """Split a batch along its first dimension into ``microbatches`` parts whose sizes differ by
    at most one: a tensor (numpy or torch) or a list of samples is sliced; a tuple or dict is
    split element by element (every element the same number of samples; plain scalars in it go
    to every part), each part a tuple or dict of the same keys."""
    if isinstance(microbatches, bool) or not isinstance(microbatches, numbers.Integral) or microbatches < 1:
        raise ConfigurationError(f"microbatches must be a positive int, not {microbatches!r}")
    _check_nesting(batch)  # here, once: a refusal deep down would be wrapped by every level above
    return _split(batch, int(microbatches))


def _check_nesting(batch: Any) -> None:
    """Refuse a batch whose tuples and dicts (what ``_split`` descends into) nest past the wire's
    depth."""
    level, depth = [batch], 0
    while level:
        level = [v for b in level if _structured(b) for v in (b.values() if isinstance(b, dict) else b)]
        if level:
            _check_depth(depth)
        depth += 1


def _split(batch: Any, microbatches: int) -> list[Any]:
    if _structured(batch):
        return _split_structured(batch, microbatches)
    if isinstance(batch, (str, bytes)) or not hasattr(batch, "__getitem__"):
        raise UnsupportedTensorError(
            "a batch is a tensor, a list of samples, or a tuple or dict of those, split along the first "
            f"dimension; not {type(batch).__name__}"
        )
    try:
        n = len(batch)
    except TypeError:
        raise ShapeMismatchError(
            f"a 0-d tensor ({type(batch).__name__}) has no first dimension to split into microbatches"
        ) from None
    except Exception as exc:
        raise _uncuttable(batch, exc) from exc
    if n < microbatches:
        raise ShapeMismatchError(f"a batch of {n} cannot be split into {microbatches} microbatches")
    base, extra = divmod(n, microbatches)
    bounds = list(itertools.accumulate([base + (i < extra) for i in range(microbatches)], initial=0))
    try:
        return [batch[a:b] for a, b in itertools.pairwise(bounds)]
    except Exception as exc:
        raise _uncuttable(batch, exc) from exc


def _uncuttable(batch: Any, exc: Exception) -> UnsupportedTensorError:
    """A batch with ``__getitem__`` whose length or slices its own code refuses: a torch tensor of
    another layout (a sparse one raised NotImplementedError from the driver's step, a CSR or
    nested one RuntimeError)."""
    layout, what = getattr(batch, "layout", None), type(batch).__name__
    if getattr(batch, "is_nested", False) is True:
        what = f"nested {what}"
    elif layout is not None:
        what += f" of layout {layout}"
    why = str(exc).strip().partition("\n")[0].partition(". ")[0][:200]
    return UnsupportedTensorError(
        f"a {what} cannot be cut along its first dimension into microbatches ({type(exc).__name__}: {why}): "
        "give a dense tensor, a list of samples, or a tuple or dict of those"
    )


def _split_structured(batch: tuple[Any, ...] | dict[Any, Any], microbatches: int) -> list[Any]:
    items = list(batch.items()) if isinstance(batch, dict) else list(enumerate(batch))
    if not items:
        raise UnsupportedTensorError(f"an empty {type(batch).__name__} has nothing to split into microbatches")
    columns: list[Iterable[Any]] = []
    first: tuple[Any, int] | None = None  # (key, samples) of the first element split
    for key, value in items:
        if _scalar(value):
            # repeated lazily: a count no element can be split into must fail as it does alone,
            # not allocate a list of that many first
            columns.append(itertools.repeat(value, microbatches))
            continue
        n = num_samples(value)
        if n is not None and first is not None and n != first[1]:
            raise ShapeMismatchError(
                f"element {key!r} of the batch has {n} samples but element {first[0]!r} has {first[1]}: "
                "every element of a tuple or dict batch is split along the same first dimension"
            )
        try:
            columns.append(_split(value, microbatches))
        except (ShapeMismatchError, UnsupportedTensorError) as exc:
            raise type(exc)(f"element {key!r} of the batch: {exc}") from exc
        if n is not None and first is None:
            first = (key, n)
    if first is None:
        raise UnsupportedTensorError("a tuple or dict batch needs at least one element to split (not only scalars)")
    if isinstance(batch, dict):
        keys = [k for k, _ in items]
        return [dict(zip(keys, parts, strict=True)) for parts in zip(*columns, strict=True)]
    return [tuple(parts) for parts in zip(*columns, strict=True)]


@check_arguments
def join(parts: list[Any]) -> Any:
    """The microbatch outputs ``parts`` (a list, one output per microbatch) as one batch, the
    inverse of ``split``: tensors are concatenated along their first dimension (numpy with
    numpy, torch with torch, of one dtype), lists of samples one after the other, tuples and
    dicts element by element (a dict's keys in any order; the first microbatch's order kept);
    a leaf with no first dimension (a 0-d tensor, a plain scalar, None) in every microbatch
    becomes the list of its microbatch values. Anything else is a ShapeMismatchError that
    names the element."""
    if not isinstance(parts, list):
        raise ConfigurationError(
            f"join takes a list of microbatch outputs (one per microbatch, as split gives them), not a "
            f"{type(parts).__name__}"
        )
    if not parts:
        raise ShapeMismatchError("there are no microbatch outputs to join")
    return _join(parts, "the output", 0)


def _join(parts: list[Any], where: str, depth: int) -> Any:
    head = parts[0]
    for i, part in enumerate(parts):
        if type(part) is not type(head) and not (isinstance(part, tuple) and isinstance(head, tuple)):
            raise ShapeMismatchError(
                f"{where} of microbatch {i} is a {type(part).__name__}, of microbatch 0 a {type(head).__name__}: "
                "microbatch outputs are joined only when they have one structure"
            )
    if isinstance(head, tuple):
        if any(len(p) != len(head) for p in parts):
            raise ShapeMismatchError(f"{where} is a tuple of different lengths in different microbatches")
        if head:
            _check_depth(depth)
        return tuple(_join([p[k] for p in parts], f"{where}[{k}]", depth + 1) for k in range(len(head)))
    if isinstance(head, dict):
        if any(p.keys() != head.keys() for p in parts):
            raise ShapeMismatchError(f"{where} is a dict with different keys in different microbatches")
        if head:
            _check_depth(depth)
        return {k: _join([p[k] for p in parts], f"{where}[{k!r}]", depth + 1) for k in head}
    if isinstance(head, list):  # a list of samples, as split cuts one
        return [sample for p in parts for sample in p]
    flat = [_scalar(p) or getattr(p, "ndim", 0) == 0 for p in parts]
    if all(flat):
        return list(parts)
    if any(flat):
        i = flat.index(not flat[0])
        dims = [getattr(p, "ndim", 0) for p in (parts[0], parts[i])]
        raise ShapeMismatchError(
            f"{where} has {dims[0]} dimensions in microbatch 0 and {dims[1]} in microbatch {i}: a leaf with no "
            "first dimension becomes the list of its values only when it has none in every microbatch"
        )
    dtypes = [getattr(p, "dtype", None) for p in parts]
    odd = next((i for i, d in enumerate(dtypes) if d != dtypes[0]), None)
    if odd is not None:
        raise ShapeMismatchError(
            f"{where} is {dtypes[0]} in microbatch 0 and {dtypes[odd]} in microbatch {odd}: microbatch outputs "
            "are joined only when they have one dtype (nothing is converted)"
        )
    return _concatenate(parts, where)


def _concatenate(parts: list[Any], where: str) -> Any:
    torch = sys.modules.get("torch")
    try:
        if torch is not None and isinstance(parts[0], torch.Tensor):
            return torch.cat(parts)
        if isinstance(parts[0], np.ndarray):
            return np.concatenate(parts)
        module = sys.modules.get(type(parts[0]).__module__.partition(".")[0])
        concatenate = getattr(module, "concatenate", None)
        if concatenate is None:
            raise UnsupportedTensorError(
                f"{where} is a {type(parts[0]).__name__}, which tensorwire cannot join along its first dimension"
            )
        return concatenate(parts)
    except (ValueError, RuntimeError, TypeError) as exc:
        shapes = [tuple(getattr(p, "shape", ())) for p in parts]
        raise ShapeMismatchError(
            f"{where} cannot be joined along the first dimension: the microbatches' shapes are {shapes[:8]} ({exc})"
        ) from exc
