"""The ucx channel's wait for the consumer streams of a CUDA receive before UCX may write into its
memory (``_targets_ready``), with the host copy engine standing in for a GPU: a stream with
nothing queued lets the receive be posted at once, without a turn of the event loop (on the first
H200 run the wait cost 173 us of every CUDA receive, for event waits of 4 us); a busy one is
waited for without blocking the loop, and the message failing meanwhile ends the wait."""

from __future__ import annotations

import asyncio
import types
from typing import Any

import numpy as np
import pytest

from tensorwire.errors import PeerDisconnected
from tensorwire.memory import DeviceBuffer, Event, HostEngine
from tensorwire.tensors import DeviceTensor
from tensorwire.transports.ucx._channel import _targets_ready

pytestmark = pytest.mark.timeout(30)


class _Gate(Event):
    """An event that completes when the test says so."""

    def __init__(self) -> None:
        self.open = False

    def query(self) -> bool:
        return self.open

    def synchronize(self) -> None:  # pragma: no cover (never called: wait_event polls)
        raise AssertionError("the loop must not block on a device event")


class _GatedEngine(HostEngine):
    """A host engine whose every stream stays busy until the gate opens."""

    def __init__(self, gate: _Gate) -> None:
        super().__init__()
        self.gate = gate

    def record_on(self, stream: int | None) -> Event:
        return self.gate


def _arrival(engine: HostEngine, streams: list[int | None]) -> Any:
    """What ``_targets_ready`` reads of an arrival: its device destinations and ``done``."""
    dest = []
    for stream in streams:
        mem = np.zeros(64, np.uint8)
        buf = DeviceBuffer(engine, mem.ctypes.data, mem.nbytes, 0, mem)
        dest.append(DeviceTensor(buf, "uint8", (64,), "cupy", stream))
    return types.SimpleNamespace(dest=dest, done=asyncio.get_running_loop().create_future())


async def test_idle_consumer_streams_let_the_receive_post_without_a_turn_of_the_loop() -> None:
    engine = HostEngine()  # a stream it runs no lane for has nothing queued: its event is done at once
    arrival = _arrival(engine, [7, None, 8])
    step = _targets_ready(arrival).__await__()
    with pytest.raises(StopIteration):  # finished within its first step: no task, no loop turn
        step.send(None)


async def test_a_busy_consumer_stream_is_waited_for_and_a_failure_ends_the_wait() -> None:
    gate = _Gate()
    arrival = _arrival(_GatedEngine(gate), [7])
    wait = asyncio.ensure_future(_targets_ready(arrival))
    await asyncio.sleep(0.05)
    assert not wait.done(), "the receive was posted before its consumer stream's work was done"
    gate.open = True
    await asyncio.wait_for(wait, 5)

    gate.open = False
    arrival = _arrival(_GatedEngine(gate), [7])
    wait = asyncio.ensure_future(_targets_ready(arrival))
    await asyncio.sleep(0.05)
    arrival.done.set_exception(PeerDisconnected("the peer went away"))
    with pytest.raises(PeerDisconnected, match="went away"):
        await asyncio.wait_for(wait, 5)
