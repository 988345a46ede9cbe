"""``peer.call_with_receipt`` and ``peer.stream_with_receipts``: the receipts say how each of a
call's messages really moved (the channel's own receipts, not a summary made up after), over
every transport available here.

ucx runs twice, as in the conformance suite: over UCX's tcp transport only, and over shared memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
from collections.abc import AsyncIterator, Iterator
from typing import Any

import numpy as np
import pytest

import tensorwire
from tensorwire.memory import HostEngine
from tensorwire.rpc import CallReceipt
from tensorwire.rpc._protocol import INLINE_BYTES, Kind, meta
from tensorwire.tensors import EngineArray
from tensorwire.testing import connected_pair
from tensorwire.transports import Limits, Receipt

pytestmark = pytest.mark.timeout(60)

_NO_UCXX = importlib.util.find_spec("ucxx") is None
_ucx = pytest.mark.skipif(_NO_UCXX, reason="ucxx is not installed (pip install 'tensorwire[ucx]')")

# (transport, UCX options) by test id
VARIANTS: dict[str, tuple[str, dict[str, str] | None]] = {
    "tcp": ("tcp", None),
    "inproc": ("inproc", None),
    "ucx-tls=tcp": ("ucx", {"TLS": "tcp"}),
    "ucx-tls=sm": ("ucx", {"TLS": "sm,self"}),
}
TRANSPORTS = [pytest.param(v, id=v, marks=_ucx if v.startswith("ucx") else ()) for v in VARIANTS]
ENVELOPE = meta(1, None, Kind.UNARY, -1).nbytes  # the request's int64 envelope, always in the request
MiB = 1 << 20


@contextlib.contextmanager
def _options(variant: str) -> Iterator[None]:
    options = VARIANTS[variant][1]
    if options is None:
        yield
        return
    from tensorwire.transports.ucx import ucx_config

    with ucx_config(**options):
        yield


@contextlib.asynccontextmanager
async def _pair(variant: str, limits: Limits | None = None) -> AsyncIterator[tuple[tensorwire.Peer, tensorwire.Peer]]:
    """Two nodes over ``variant``; b serves echo, fail, sleep and count."""
    with _options(variant):
        async with connected_pair(VARIANTS[variant][0], limits=limits) as (a, b):

            @b.node.method("echo")
            async def echo(*args: Any, **kwargs: Any) -> Any:
                return args[0] if len(args) == 1 and not kwargs else {"args": args, "kwargs": kwargs}

            @b.node.method("fail")
            async def fail(x: Any) -> None:
                raise ValueError("no thanks")

            @b.node.method("sleep")
            async def sleep(seconds: float) -> None:
                await asyncio.sleep(seconds)

            @b.node.method("count")
            async def count(n: int, size: int) -> AsyncIterator[np.ndarray]:
                for i in range(n):
                    yield np.full(size, i, np.uint8)

            yield a, b


@pytest.fixture(params=TRANSPORTS)
async def pair(request: pytest.FixtureRequest) -> AsyncIterator[tuple[tensorwire.Peer, tensorwire.Peer]]:
    async with _pair(request.param) as peers:
        yield peers


def _on_path(peer: tensorwire.Peer, *receipts: Receipt | None) -> None:
    """Every receipt names the transport and lanes the peer's path says it uses."""
    for r in receipts:
        assert r is not None
        assert r.transport == peer.path.transport and r.lanes == peer.channel.lanes, (r, peer.path)


def _whole(receipt: CallReceipt) -> None:
    """The conveniences agree with the parts, and the call's time covers its messages' (sent
    and received one after another within it)."""
    parts = [r for r in (receipt.request, receipt.args, receipt.result) if r is not None]
    assert receipt.nbytes == sum(r.nbytes for r in parts)
    assert receipt.transport == receipt.request.transport
    assert receipt.args_inline == (receipt.args is None)
    assert receipt.seconds >= sum(r.seconds for r in parts) > 0, receipt


# -- where the arguments went ------------------------------------------------------------------
async def test_small_arguments_ride_in_the_request(pair: tuple[tensorwire.Peer, tensorwire.Peer]) -> None:
    a, _ = pair
    x = np.arange(256, dtype=np.float32)
    y, receipt = await a.call_with_receipt("echo", x)
    assert isinstance(receipt, CallReceipt) and np.array_equal(y, x)
    assert receipt.args is None and receipt.args_inline
    assert receipt.request.nbytes == ENVELOPE + x.nbytes, receipt.request
    assert receipt.result.nbytes == x.nbytes and receipt.result.memory == "host"
    assert not receipt.request.packed
    _on_path(a, receipt.request, receipt.result)
    _whole(receipt)


async def test_large_arguments_travel_apart(pair: tuple[tensorwire.Peer, tensorwire.Peer]) -> None:
    a, _ = pair
    x = np.random.default_rng(1).integers(0, 256, MiB, dtype=np.uint8)
    scale = np.arange(3, dtype=np.float64)
    got, receipt = await a.call_with_receipt("echo", x, scale=scale)
    assert np.array_equal(got["args"][0], x) and np.array_equal(got["kwargs"]["scale"], scale)
    assert receipt.args is not None and not receipt.args_inline
    assert receipt.request.nbytes == ENVELOPE, receipt.request  # the envelope alone
    assert receipt.args.nbytes == x.nbytes + scale.nbytes, receipt.args  # positional and keyword
    assert receipt.result.nbytes == x.nbytes + scale.nbytes
    _on_path(a, receipt.request, receipt.args, receipt.result)
    _whole(receipt)


@pytest.mark.parametrize("variant", TRANSPORTS)
async def test_inline_up_to_the_limit_and_apart_past_it(variant: str) -> None:
    """Arguments of INLINE_BYTES ride in the request; one byte more go apart."""
    async with _pair(variant) as (a, _):
        for n, inline in ((INLINE_BYTES, True), (INLINE_BYTES + 1, False)):
            x = np.full(n, 7, np.uint8)
            y, receipt = await a.call_with_receipt("echo", x)
            assert np.array_equal(y, x)
            assert receipt.args_inline is inline, (n, receipt)
            if inline:
                assert receipt.request.nbytes == ENVELOPE + n
            else:
                assert receipt.args is not None and receipt.args.nbytes == n and receipt.request.nbytes == ENVELOPE


async def test_concurrent_calls_each_get_their_own_receipt(pair: tuple[tensorwire.Peer, tensorwire.Peer]) -> None:
    a, _ = pair
    sizes = [1 + 9_001 * i for i in range(24)]  # some inline, some apart, all different

    async def one(n: int) -> tuple[int, Any, CallReceipt]:
        y, receipt = await a.call_with_receipt("echo", np.full(n, n % 251, np.uint8))
        return n, y, receipt

    for n, y, receipt in await asyncio.gather(*(one(n) for n in sizes)):
        assert y.nbytes == n and int(y[0]) == n % 251
        assert receipt.result.nbytes == n, (n, receipt)
        if n <= INLINE_BYTES:
            assert receipt.args is None and receipt.request.nbytes == ENVELOPE + n, (n, receipt)
        else:
            assert receipt.args is not None and receipt.args.nbytes == n, (n, receipt)


# -- how the transport moved them --------------------------------------------------------------
@pytest.mark.parametrize("variant", TRANSPORTS)
async def test_protocols_are_the_transports_own(variant: str) -> None:
    """With room to buffer, the large arguments and result go eager; where the peer buffers
    nothing (recv_buffer_bytes=0) every message waits for its recv and the receipts say
    rendezvous: they are what the channel did, not a label of the call's."""
    x = np.random.default_rng(2).integers(0, 256, MiB, dtype=np.uint8)
    async with _pair(variant) as (a, _):
        _, receipt = await a.call_with_receipt("echo", x)
        assert receipt.args is not None
        assert receipt.args.protocol == "eager" and receipt.result.protocol == "eager", receipt
        assert receipt.request.protocol in ("eager", "inline"), receipt.request
    async with _pair(variant, Limits(recv_buffer_bytes=0)) as (a, _):
        out = np.empty_like(x)
        for args in ((x,), (x[:100],)):  # arguments apart, and inline
            _, receipt = await a.call_with_receipt("echo", *args, _out=out[: args[0].size])
            assert out[:100].tobytes() == x[:100].tobytes()
            protocols = [r.protocol for r in (receipt.request, receipt.args, receipt.result) if r is not None]
            assert protocols == ["rendezvous"] * len(protocols), receipt


async def test_out_is_reported_direct(pair: tuple[tensorwire.Peer, tensorwire.Peer]) -> None:
    """A result received into ``_out=`` is direct, except one that rode in its reply's frame
    ("inline": ucx sends 100 bytes so, and the receiver copies them out of the frame) or a
    small one tcp read through its read-ahead buffer (100 bytes: copied out of it)."""
    a, _ = pair
    for n in (100, 3 * MiB):
        x = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
        out = np.zeros(n, np.uint8)
        got, receipt = await a.call_with_receipt("echo", x, _out=out)
        assert got is out and np.array_equal(out, x)
        r = receipt.result
        # (inproc copies the sender's bytes straight into _out=, whatever their size)
        assert r.direct == (n > 64 * 1024 or r.transport == "inproc"), r
        assert not r.staged and r.memory == "host" and r.nbytes == n, r
        _on_path(a, r)


@pytest.mark.parametrize("variant", TRANSPORTS)
async def test_device_out_is_reported_staged(variant: str) -> None:
    """Device memory (host-engine memory, which goes every way CUDA memory does) as argument
    and as ``_out=``: these channels stage it through host memory (tcp always; ucx and inproc
    unless they take it by pointer), and the receipts say so and name the memory kind, where
    a host ``_out=`` of the same call is direct (test_out_is_reported_direct)."""
    engine = HostEngine()
    try:
        async with _pair(variant) as (a, _):
            for n in (1000, MiB):  # the argument inline, and apart
                x = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
                out = EngineArray(engine, np.zeros(n, np.uint8))
                got, receipt = await a.call_with_receipt("echo", EngineArray(engine, x), _out=out)
                assert got is out and np.array_equal(out.array, x)
                if receipt.args is None:
                    sent, nbytes = receipt.request, ENVELOPE + n
                else:
                    sent, nbytes = receipt.args, n
                    assert receipt.request.memory == "host", receipt.request  # the envelope alone
                assert sent.memory == "host-engine" and sent.nbytes == nbytes and sent.staged, (n, sent)
                r = receipt.result
                assert r.memory == "host-engine" and r.nbytes == n and r.staged and not r.direct, (n, r)
                _on_path(a, sent, r)
    finally:
        engine.close()


async def test_a_non_contiguous_argument_says_packed(pair: tuple[tensorwire.Peer, tensorwire.Peer]) -> None:
    a, _ = pair
    small = np.arange(2000, dtype=np.float64).reshape(40, 50)[:, ::2]  # 8000 bytes: inline
    y, receipt = await a.call_with_receipt("echo", small)
    assert np.array_equal(y, small)
    assert receipt.args is None and receipt.request.packed and not receipt.request.direct, receipt.request
    assert receipt.request.nbytes == ENVELOPE + small.nbytes
    large = np.arange(200_000, dtype=np.float64).reshape(400, 500)[:, ::2]  # 800 kB: apart
    y, receipt = await a.call_with_receipt("echo", large)
    assert np.array_equal(y, large)
    assert receipt.args is not None and receipt.args.packed and not receipt.args.direct, receipt.args
    assert not receipt.request.packed and receipt.args.nbytes == large.nbytes
    _, receipt = await a.call_with_receipt("echo", np.ascontiguousarray(large))
    assert receipt.args is not None and not receipt.args.packed, receipt.args


# -- failures raise as they do from call -------------------------------------------------------
async def test_failures_raise_as_from_call(pair: tuple[tensorwire.Peer, tensorwire.Peer]) -> None:
    a, _ = pair
    for x in (np.zeros(4), np.zeros(MiB, np.uint8)):  # the error after inline and apart arguments
        with pytest.raises(tensorwire.RemoteError, match="no thanks") as info:
            await a.call_with_receipt("fail", x)
        assert info.value.remote_type == "ValueError"
    with pytest.raises(tensorwire.MethodNotFound):
        await a.call_with_receipt("nope")
    with pytest.raises(tensorwire.DeadlineExceeded):
        await a.call_with_receipt("sleep", 30.0, _deadline=0.2)
    with pytest.raises(tensorwire.ShapeMismatchError):
        await a.call_with_receipt("echo", np.zeros(8), _out=np.zeros(9))
    y, receipt = await a.call_with_receipt("echo", np.ones(3))  # and the peer still answers
    assert np.array_equal(y, np.ones(3)) and receipt.result.nbytes == 24


async def test_call_still_returns_the_bare_result(pair: tuple[tensorwire.Peer, tensorwire.Peer]) -> None:
    a, _ = pair
    x = np.arange(5.0)
    y = await a.call("echo", x)
    assert isinstance(y, np.ndarray) and np.array_equal(y, x)
    out = np.zeros(5)
    assert await a.call("echo", x, _out=out) is out


# -- streams -----------------------------------------------------------------------------------
async def test_stream_items_come_with_their_receipts(pair: tuple[tensorwire.Peer, tensorwire.Peer]) -> None:
    a, _ = pair
    for size in (100, MiB):
        seen = []
        async for item, receipt in a.stream_with_receipts("count", 5, size):
            assert isinstance(receipt, Receipt)
            assert receipt.nbytes == size == item.nbytes, receipt
            _on_path(a, receipt)
            seen.append(int(item[0]))
        assert seen == list(range(5))
    plain = [int(item[0]) async for item in a.stream("count", 3, 10)]  # stream: bare items still
    assert plain == [0, 1, 2]


def test_call_receipt_is_exported_at_the_top() -> None:
    assert tensorwire.CallReceipt is CallReceipt
    assert "CallReceipt" in tensorwire.__all__ and "CallReceipt" in tensorwire.rpc.__all__
