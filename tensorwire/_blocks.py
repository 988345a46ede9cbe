"""Context managers written as generators, as ``contextlib``'s are, that leave the exception
leaving their block as it is.

``contextlib.contextmanager`` (and its async twin) sets ``__traceback__`` on the exception that
leaves its block through the generator. An exception that is a frozen dataclass refuses that
assignment, so the block's own error (an RPC method's, a torch module's) became
``FrozenInstanceError``. The blocks tensorwire runs user code in use these instead."""

from __future__ import annotations

import functools
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Generator, Iterator
from types import TracebackType
from typing import ParamSpec

__all__ = ["async_block", "block"]

_P = ParamSpec("_P")


class _Block:
    __slots__ = ("_gen",)

    def __init__(self, gen: Generator[None, None, None]) -> None:
        self._gen = gen

    def __enter__(self) -> None:
        next(self._gen)

    def __exit__(self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if typ is None:
            try:
                next(self._gen)
            except StopIteration:
                return
            raise RuntimeError("a block's generator did not stop")
        if exc is None:
            exc = typ()
        try:
            self._gen.throw(exc)
        except StopIteration as stop:
            if stop is exc:
                return
            raise RuntimeError("a block's generator swallowed the exception of its block") from exc
        except RuntimeError as err:  # (PEP 479: a StopIteration raised in the block comes back so)
            if err is exc or (isinstance(exc, StopIteration) and err.__cause__ is exc):
                return
            raise
        except BaseException as err:
            if err is exc:
                return  # (re-raised as it is, its __traceback__ untouched)
            raise
        raise RuntimeError("a block's generator did not stop after an exception")


class _AsyncBlock:
    __slots__ = ("_gen",)

    def __init__(self, gen: AsyncGenerator[None, None]) -> None:
        self._gen = gen

    async def __aenter__(self) -> None:
        await anext(self._gen)

    async def __aexit__(
        self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        gen = self._gen
        if typ is None:
            try:
                await anext(gen)
            except StopAsyncIteration:
                return
            raise RuntimeError("a block's generator did not stop")
        if exc is None:
            exc = typ()
        try:
            await gen.athrow(exc)
        except StopAsyncIteration as stop:
            if stop is exc:
                return
            raise RuntimeError("a block's generator swallowed the exception of its block") from exc
        except RuntimeError as err:
            if err is exc or (isinstance(exc, (StopIteration, StopAsyncIteration)) and err.__cause__ is exc):
                return
            raise
        except BaseException as err:
            if err is exc:
                return
            raise
        raise RuntimeError("a block's generator did not stop after an exception")


def block(fn: Callable[_P, Iterator[None]]) -> Callable[_P, _Block]:
    """``contextlib.contextmanager`` for a generator that yields once (nothing), leaving the
    block's exception as it is. The generator must not swallow it (none of tensorwire's do)."""

    @functools.wraps(fn)
    def make(*args: _P.args, **kwargs: _P.kwargs) -> _Block:
        return _Block(fn(*args, **kwargs))  # type: ignore[arg-type]  # (a generator function's)

    return make


def async_block(fn: Callable[_P, AsyncIterator[None]]) -> Callable[_P, _AsyncBlock]:
    """``contextlib.asynccontextmanager`` as ``block`` is ``contextmanager``."""

    @functools.wraps(fn)
    def make(*args: _P.args, **kwargs: _P.kwargs) -> _AsyncBlock:
        return _AsyncBlock(fn(*args, **kwargs))  # type: ignore[arg-type]  # (an async generator function's)

    return make
