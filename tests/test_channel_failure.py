"""A channel's failure, raised again at every later call and for every pending operation, keeps
none of those operations' frames alive: a caller that let go of a failed send's tensor (or a
failed recv's ``out=``) gets its memory back, on real nodes over tcp and inproc on loopback."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Awaitable

import numpy as np
import pytest
from _polling import collected, eventually

import tensorwire
from tensorwire.testing import connected_pair
from tensorwire.transports import ChannelState
from tensorwire.transports._base import fresh

pytestmark = pytest.mark.timeout(60)

_BIG = 64 << 20  # past every transport's eager limit: a send waits for its recv


@pytest.mark.parametrize("transport", ["tcp", "inproc"])
@pytest.mark.parametrize("case", ["send after", "recv after", "send pending"])
async def test_a_failed_operations_memory_is_freed_once_its_caller_lets_go(transport: str, case: str) -> None:
    """The peer aborts; a send of a large array pending then, or a send or a recv into one made
    after, fails. Before, the channel kept one exception object as its failure and raised it each
    time: each raise added the raising frames to its traceback, so the array stayed alive, with
    every frame that held it, for as long as the channel did (on verbs its memory registration too)."""
    async with connected_pair(transport) as (a, b):
        x = np.ones(_BIG, np.uint8)
        gone = weakref.ref(x)
        pending = asyncio.ensure_future(a.send(x, tag="t")) if case == "send pending" else None
        for _ in range(3):  # (it starts: its frame holds x)
            await asyncio.sleep(0)
        b.abort()
        await eventually(lambda: a.channel.state is not ChannelState.OPEN)
        if pending is not None:
            failing: Awaitable[object] = pending
        elif case == "send after":
            failing = a.send(x, tag="t")
        else:
            failing = a.recv(tag="t", out=x)
        with pytest.raises(tensorwire.PeerDisconnected):
            await failing
        del x, pending, failing

        await collected(gone)
        with pytest.raises(tensorwire.PeerDisconnected):  # the failure is still told, as before
            await a.send(np.ones(4), tag="t")


def test_a_copied_failure_keeps_class_message_attributes_and_cause() -> None:
    """``fresh`` copies what a caller reads (class, message, attributes, cause) and no traceback; an
    exception that its arguments cannot rebuild stays itself."""

    class TwoArgs(tensorwire.TransferError):
        def __init__(self, what: str, n: int) -> None:
            super().__init__(f"{what}: {n}")

    cause = OSError("reset")
    try:
        raise tensorwire.RemoteError("it failed", remote_type="KeyError", method="m") from cause
    except tensorwire.RemoteError as exc:
        original = exc
    twin = fresh(original)
    assert twin is not original and type(twin) is tensorwire.RemoteError
    assert str(twin) == "it failed" and twin.remote_type == "KeyError" and twin.method == "m"
    assert type(twin.__cause__) is OSError and str(twin.__cause__) == "reset" and twin.__cause__.__traceback__ is None
    assert twin.__traceback__ is None and original.__traceback__ is not None
    odd = TwoArgs("lost", 3)
    assert fresh(odd) is odd
