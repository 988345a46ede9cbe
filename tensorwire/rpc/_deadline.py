"""Deadlines that travel with calls.

``asyncio.timeout`` cannot be read from inside the code it wraps, so a deadline that should
travel to the server is either given to the call (``peer.call(..., _deadline=2.0)``) or set
for a block with ``async with tensorwire.rpc.deadline(2.0):``, which is an ``asyncio.timeout``
that calls made inside it can see. A method served by this node runs with its caller's
deadline set the same way, so calls it makes in turn inherit what is left of it.

A deadline further away than ``MAX_DEADLINE`` seconds (about 31 years), ``math.inf`` among them,
is no deadline; ``-math.inf``, like any deadline at or below zero, has already passed.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import math
from collections.abc import AsyncIterator

from .._blocks import async_block
from .._checks import as_real
from ..errors import ConfigurationError
from ._protocol import MAX_DEADLINE

__all__ = ["Unbounded", "current_deadline", "deadline", "effective_deadline", "timeout_at"]


class Unbounded:
    """What ``asyncio.timeout_at(None)`` is, a block with no deadline, for the calls that have
    none (most): it enters and leaves doing nothing, and never expires. ``asyncio.timeout(None)``
    costs ~1.8 us a block (it looks its task up and keeps state for a ``reschedule`` that these
    blocks never make), three of them a call; this, a tenth of that. Stateless: one is shared."""

    __slots__ = ()

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc: object) -> None:
        return None

    def when(self) -> float | None:
        return None

    def expired(self) -> bool:
        return False


_UNBOUNDED = Unbounded()


def timeout_at(when: float | None) -> asyncio.Timeout | Unbounded:
    """``asyncio.timeout_at(when)``, or a shared ``Unbounded`` where ``when`` is None (no deadline),
    for blocks that are never rescheduled."""
    return _UNBOUNDED if when is None else asyncio.timeout_at(when)


class _Scope:
    """A ``deadline()`` block, or a call being served: the absolute ``loop.time()`` by which it
    must finish, while it is ``open``. A task started inside copies the context, scope and all,
    and may outlive it (a method's background work): once the block or call has ended its
    deadline is no longer that task's, as an ``asyncio.timeout`` stops applying at the end of its
    block, and the task is under the scope around it (``outer``), if that is still open."""

    __slots__ = ("open", "outer", "when")

    def __init__(self, when: float | None, outer: _Scope | None) -> None:
        self.when = when
        self.outer = outer
        self.open = True


_DEADLINE: contextvars.ContextVar[_Scope | None] = contextvars.ContextVar("tensorwire_rpc_deadline", default=None)


def _when() -> float | None:
    """The deadline of the innermost scope still open here, or None."""
    scope = _DEADLINE.get()
    while scope is not None and not scope.open:
        scope = scope.outer
    return None if scope is None else scope.when


def _check_seconds(seconds: object, what: str) -> float:
    """Any real number of seconds (numpy's and ``Fraction`` too, as the node's own timeouts
    take), infinities included; not a bool, not NaN."""
    value = as_real(seconds)
    if value is None or math.isnan(value):
        raise ConfigurationError(f"{what} must be a number of seconds, not {seconds!r}")
    return value


class _Scoped:
    """Run the block under the deadline ``when``, a scope that closes as the block ends. A class,
    not a generator (``_blocks.block``): every served call enters one, and a generator's block
    costs ~1 us more; like a ``block``, it leaves the block's exception (a served method's own
    error) as it is."""

    __slots__ = ("_scope", "_token")

    def __init__(self, when: float | None, outer: _Scope | None) -> None:
        self._scope = _Scope(when, outer)
        self._token: contextvars.Token[_Scope | None] | None = None

    def __enter__(self) -> None:
        self._token = _DEADLINE.set(self._scope)

    def __exit__(self, *exc: object) -> None:
        self._scope.open = False
        assert self._token is not None
        _DEADLINE.reset(self._token)


@async_block
async def deadline(seconds: float) -> AsyncIterator[None]:
    """An ``asyncio.timeout(seconds)`` whose remaining time travels with the calls made inside.

    Expiry raises the built-in ``TimeoutError`` here, like ``asyncio.timeout``; servers cancel
    the calls that were running for it. Nested deadlines keep the earlier one.
    """
    seconds = _check_seconds(seconds, "deadline")
    loop = asyncio.get_running_loop()
    when: float | None = None if seconds > MAX_DEADLINE else loop.time() + seconds
    outer = _when()
    if outer is not None:
        when = outer if when is None else min(when, outer)
    with _Scoped(when, _DEADLINE.get()):
        async with asyncio.timeout_at(when):
            yield


def current_deadline() -> float | None:
    """Seconds left before the enclosing ``deadline()`` block, or the call being served, must
    finish; None if there is none."""
    when = _when()
    if when is None:
        return None
    return when - asyncio.get_running_loop().time()


def effective_deadline(explicit: float | None) -> float | None:
    """The seconds a call may take: the smaller of ``explicit`` and the enclosing deadline."""
    left = current_deadline()
    if explicit is not None:
        explicit = _check_seconds(explicit, "_deadline")
        if explicit > MAX_DEADLINE:  # +inf among them; -inf has passed long ago
            explicit = None
    if explicit is None:
        return left
    return explicit if left is None else min(explicit, left)


def served_under(when: float | None) -> contextlib.AbstractContextManager[None]:
    """Serve a call under its caller's absolute deadline ``when`` (None: none) for the block:
    what the method calls inherits what is left of it, and tasks it starts that outlive the
    call do not. The caller's deadline replaces whatever this task had (no outer scope)."""
    return _Scoped(when, None)
