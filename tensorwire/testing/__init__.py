"""Conformance checks every transport must pass, usable from any test suite.

    from tensorwire.testing import CHECKS, connected_pair

    @pytest.mark.parametrize("name", CHECKS)
    async def test_conformance(name):
        async with connected_pair("tcp", check=name) as (a, b):
            await CHECKS[name](a, b)

A check takes two connected peers (``a`` connected to ``b``) and raises AssertionError (or an
error from the tree) when the transport breaks the contract. Some checks need tight limits; they
carry them in ``LIMITS`` and ``connected_pair(..., check=name)`` applies them (without it,
those checks fail on a transport that keeps the contract). ``exchange`` sends one message
from ``a`` into ``b``'s ``recv(out=...)`` with the recv posted first or the send started first;
``cancel_recv_at_every_step`` cancels such recvs at every step of a transfer and checks that
nothing is lost and no cancelled ``out=`` is written afterwards. ``busy_stream(engine)`` holds a
host-engine stream busy until its gate is set (a framework's earlier work, for stream-order tests);
``slow_sends(peer)`` holds each of a peer's sends up for 50 ms, as backpressure does;
``time_scale(factor)`` lets the checks' bounded waits take longer on an emulated transport;
``peak_allocation()`` measures the peak of traced host allocations in its body;
``idle_cpu_percent(transport)`` the CPU two idle nodes joined over it burn (in a process of their
own); ``host_engine_by_pointer`` declares that channels (and a transport's registrations) take
host-engine memory by pointer, as ucx does CUDA memory where UCX has cuda lanes.

``PACK_LAYOUTS`` are strided views (of numpy or CuPy arrays) that reach every copy kind of
``tensorwire.native``'s pack and unpack.
"""

from ._conformance import (
    CHECKS,
    LIMITS,
    busy_stream,
    cancel_recv_at_every_step,
    connected_pair,
    exchange,
    host_engine_by_pointer,
    peak_allocation,
    slow_sends,
    time_scale,
)
from ._idle import idle_cpu_percent
from ._layouts import PACK_LAYOUTS

__all__ = [
    "CHECKS",
    "LIMITS",
    "PACK_LAYOUTS",
    "busy_stream",
    "cancel_recv_at_every_step",
    "connected_pair",
    "exchange",
    "host_engine_by_pointer",
    "idle_cpu_percent",
    "peak_allocation",
    "slow_sends",
    "time_scale",
]
