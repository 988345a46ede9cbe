"""One-sided expose / lookup / read / write (owner-assisted on tcp and inproc)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.util
from collections.abc import AsyncIterator

import grpc
import numpy as np
import pytest

import tensorwire
from tensorwire._onesided import _OPS_TAG, _tags
from tensorwire.control._pb import control_pb2, control_pb2_grpc
from tensorwire.memory import HostEngine
from tensorwire.tensors._device import EngineArray
from tensorwire.testing import connected_pair
from tensorwire.transports._credit import own_slots

EVERY_TRANSPORT = ["tcp", "inproc"] + (["ucx"] if importlib.util.find_spec("ucxx") is not None else [])


@pytest.mark.parametrize("transport", ["tcp", "inproc"])
async def test_read_write_both_directions(transport: str) -> None:
    async with connected_pair(transport) as (a, b):
        kv = np.arange(1 << 20, dtype=np.float32).reshape(1024, 1024)
        a.node.expose(kv, name="kv/3")
        h = await b.lookup("kv/3")
        assert (h.dtype, h.shape, h.nbytes) == ("float32", (1024, 1024), 4 << 20)
        out = np.empty_like(kv)
        got, receipt = await b.read_with_receipt(h, out=out)
        assert got is out
        assert np.array_equal(out, kv)
        assert receipt.protocol == "owner-assisted" and receipt.transport == transport
        new = np.full_like(kv, 7.0)
        r = await b.write(h, new)
        assert r.protocol == "owner-assisted" and not h.direct
        assert np.array_equal(kv, new), "write did not land in the exposed memory"
        assert a.node.exposures.served == 2  # the owner's node answered both
        # the accepting side can look up the connecting side's tensors too
        w = np.ones(10, np.int64)
        b.node.expose(w, name="weights")
        hw = await a.lookup("weights")
        assert np.array_equal(await a.read(hw), w)


async def test_large_read_lands_in_place_and_concurrent_ops() -> None:
    async with connected_pair("tcp") as (a, b):
        big = np.random.default_rng(0).integers(0, 255, 96 << 20, dtype=np.uint8)
        a.node.expose(big, name="big")
        small = [np.full(100, i) for i in range(8)]
        for i, s in enumerate(small):
            a.node.expose(s, name=f"s{i}")
        h = await b.lookup("big")
        hs = [await b.lookup(f"s{i}") for i in range(8)]
        results = await asyncio.gather(b.read(h), *[b.read(x) for x in hs])
        assert np.array_equal(results[0], big)
        for i, r in enumerate(results[1:]):
            assert np.array_equal(r, small[i])


async def test_revoked_and_reexposed_handles_fail_clearly() -> None:
    async with connected_pair("tcp") as (a, b):
        x = np.arange(10)
        a.node.expose(x, name="x")
        h = await b.lookup("x")
        a.node.unexpose("x")
        with pytest.raises(tensorwire.HandleNotFound, match="not exposed"):
            await b.read(h)
        with pytest.raises(tensorwire.HandleNotFound):
            await b.write(h, np.zeros(10, x.dtype))
        with pytest.raises(tensorwire.HandleNotFound):
            await b.lookup("x")
        a.node.expose(np.arange(10), name="x")
        with pytest.raises(tensorwire.HandleNotFound, match="again"):
            await b.read(h)  # stale generation
        assert np.array_equal(await b.read(await b.lookup("x")), np.arange(10))
        # nothing lingers in the mailboxes after failed operations
        await asyncio.sleep(0.05)
        assert list(b.channel.mailbox._arrived) == []


async def test_bad_input_gets_clear_errors() -> None:
    async with connected_pair("tcp") as (a, b):
        ro = np.arange(4)
        ro.flags.writeable = False
        a.node.expose(ro, name="ro")
        with pytest.raises(tensorwire.ConfigurationError):
            a.node.expose(np.arange(3), name="ro")
        with pytest.raises(tensorwire.ShapeMismatchError):
            a.node.expose(np.arange(12).reshape(3, 4).T, name="nc")
        with pytest.raises(tensorwire.HandleNotFound):
            a.node.unexpose("never")
        h = await b.lookup("ro")
        with pytest.raises(tensorwire.ShapeMismatchError):
            await b.read(h, out=np.empty(5, np.int64))
        with pytest.raises(tensorwire.ShapeMismatchError):
            await b.write(h, np.zeros(4, np.float32))
        with pytest.raises(tensorwire.HandleNotFound, match="read-only"):
            await b.write(h, np.zeros(4, np.int64))
        assert np.array_equal(ro, np.arange(4))


@pytest.mark.timeout(30)
async def test_a_handle_indexed_by_an_array_or_tensor_says_so_with_a_tensorwire_error() -> None:
    """Arrays and tensors define ``__index__`` but raise TypeError from it unless they hold a
    single integer: ``h[np.array([1, 2])]`` and ``h[torch.tensor(1.5)]`` raised that TypeError,
    and a slice step that is an array (``h[1:4:np.array([1, 1])]``) numpy's ValueError, where
    every other bad index is a ShapeMismatchError. One that holds a single integer indexes as
    numpy does."""
    torch = pytest.importorskip("torch")
    async with connected_pair("tcp") as (a, b):
        kv = np.arange(30, dtype=np.float32).reshape(10, 3)
        a.node.expose(kv, name="kv")
        h = await b.lookup("kv")
        bad = [np.array([1, 2]), np.array(1.5), torch.tensor([1, 2]), torch.tensor(1.5), np.float64(1)]
        for index in bad:
            with pytest.raises(tensorwire.ShapeMismatchError, match="indexed by an int or a slice"):
                h[index]
        for step in (np.array([1, 1]), torch.tensor([1, 1]), 1.0, 2, -1):
            with pytest.raises(tensorwire.ShapeMismatchError, match="step 1"):
                h[1:4:step]
        for index in (np.array(2), np.int64(-3), torch.tensor(7)):
            assert np.array_equal(await b.read(h[index]), kv[index])
        assert np.array_equal(await b.read(h[1 : 4 : np.array(1)]), kv[1:4])
        assert np.array_equal(await b.read(h[torch.tensor(2) : np.int32(5)]), kv[2:5])


@pytest.mark.timeout(30)
@pytest.mark.parametrize("transport", ["tcp", "inproc"])
async def test_a_write_from_bytes_lands_through_the_owner_as_it_does_one_sided(transport: str) -> None:
    """A write's source is checked as ``as_view`` sees it (``bytes`` is a uint8 tensor there, and
    over ucx it is put as one), but the owner-served write sent the source object itself, in which
    ``bytes`` is a scalar: the owner refused it, and the writer got HandleNotFound "out=[0] is a
    tensor where the message has a scalar", with nothing written."""
    async with connected_pair(transport) as (a, b):
        x = np.zeros(16, np.uint8)
        a.node.expose(x, name="x")
        h = await b.lookup("x")
        receipt = await b.write(h[2:6], b"abcd")
        assert receipt.protocol == "owner-assisted" and receipt.nbytes == 4
        await b.write_many([h[8:10], h[12:16]], [b"xy", bytearray(b"wxyz")])
        assert x.tobytes() == b"\0\0abcd\0\0xy\0\0wxyz"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("transport", EVERY_TRANSPORT)
async def test_a_handle_whose_dtype_was_changed_by_hand_is_a_shape_mismatch_on_every_transport(transport: str) -> None:
    """A handle retyped to a dtype of the same size (``dataclasses.replace``) names the same
    bytes, so the span check let it through: over ucx it read and wrote the owner's float32 as
    int32 without a word; through the owner a read failed with TransferError "unexpected answer
    from the owner" and a write with HandleNotFound, of a tensor that was there."""
    async with connected_pair(transport) as (a, b):
        x = np.arange(8, dtype=np.float32)
        a.node.expose(x, name="x")
        h = await b.lookup("x")
        retyped = dataclasses.replace(h, dtype="int32")
        for op in (lambda: b.read(retyped), lambda: b.write(retyped, np.zeros(8, np.int32))):
            with pytest.raises(tensorwire.ShapeMismatchError, match="changed by hand"):
                await op()
        with pytest.raises(tensorwire.ShapeMismatchError, match="changed by hand"):
            await b.read_many([h[0], retyped[2:4]])
        assert np.array_equal(x, np.arange(8, dtype=np.float32))
        assert np.array_equal(await b.read(h), x)  # the peer goes on


@pytest.mark.timeout(30)
@pytest.mark.parametrize("transport", EVERY_TRANSPORT)
async def test_a_handle_whose_offset_was_moved_off_its_elements_is_a_shape_mismatch_on_every_transport(
    transport: str,
) -> None:
    """A handle whose offset was changed by hand to one inside the tensor but not on an element
    (``dataclasses.replace(h[0], offset=3)``) names bytes that straddle two elements. Over ucx
    the range check let it through: the read returned [2**40, 2**41, ...] for rows of 0..7, and a
    write put its bytes across the owner's elements; through the owner it was refused as "not
    within" a tensor it is within (HandleNotFound). Found by a probe of hand-changed handles
    written beside tests/test_model_onesided.py."""
    async with connected_pair(transport) as (a, b):
        x = np.arange(32, dtype=np.int64).reshape(8, 4)
        a.node.expose(x, name="x")
        h = await b.lookup("x")
        for offset in (3, 32 + 4):
            moved = dataclasses.replace(h[0], offset=offset)
            with pytest.raises(tensorwire.ShapeMismatchError, match="not on an element"):
                await b.read(moved)
            with pytest.raises(tensorwire.ShapeMismatchError, match="not on an element"):
                await b.write(moved, np.full(4, -1, np.int64))
            with pytest.raises(tensorwire.ShapeMismatchError, match="not on an element"):
                await b.read_many([h[1], moved])
        assert np.array_equal(x, np.arange(32, dtype=np.int64).reshape(8, 4)), "a write landed"
        on = dataclasses.replace(h[0], offset=8)  # on an element: elements 1..4, as h[0] is 0..3
        assert np.array_equal(await b.read(on), [1, 2, 3, 4])


@pytest.mark.parametrize("bit", ["conj", "neg"])
async def test_a_torch_view_with_the_conj_or_neg_bit_is_not_exposed(bit: str) -> None:
    """Its values live in no memory: exposing one exposed a resolved copy that peers read as a
    stale snapshot (writes to the tensor never showed). Refused; a numpy scalar, immutable, may
    still be exposed (read-only)."""
    torch = pytest.importorskip("torch")
    base = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    view = base.conj() if bit == "conj" else base.conj().imag
    async with connected_pair("tcp") as (a, b):
        with pytest.raises(tensorwire.UnsupportedTensorError, match=f"cannot be exposed: .*{bit} bit"):
            a.node.expose(view, name="v")
        with pytest.raises(tensorwire.HandleNotFound):
            await b.lookup("v")  # nothing was published
        a.node.expose(view.resolve_conj().resolve_neg(), name="v")  # the advice works
        a.node.expose(np.float32(2.5), name="s")
        h = await b.lookup("s")
        assert not h.writable and await b.read(h) == np.float32(2.5)


async def test_row_requests_the_handle_could_not_make_get_an_error_answer() -> None:
    """The owner checks every region a request names (a peer may send anything): outside the
    tensor, misaligned, malformed -> an error answer naming it, nothing read or written."""
    async with connected_pair("tcp") as (a, b):
        kv = np.arange(40, dtype=np.int32).reshape(10, 4)
        a.node.expose(kv, name="kv")
        h = await b.lookup("kv")
        bad = [(4, [10, 4]), (2, [1, 4]), (-16, [1, 4]), (160, [1]), ("0", [1, 4]), (0, [1, -4]),
               (0, "4"), (0, [1.0, 4]), (None, None), (0, [1] * 65),
               (0, [0, 2**62])]  # no bytes, but numpy has no array of it ("array is too big")  # fmt: skip
        good = {"name": "kv", "generation": h.generation, "offset": 0, "shape": [1, 4]}
        for op in ("read", "write"):
            for offset, shape in bad:
                reply, data = _tags()
                region = {"name": "kv", "generation": h.generation, "offset": offset, "shape": shape}
                await b._send_own({"op": op, "regions": [good, region], "reply": reply, "data": data}, tag=_OPS_TAG)
                if op == "write":
                    await b._send_own(np.full(4, -1, np.int32), tag=data)
                answer = await asyncio.wait_for(b._recv_own(tag=reply), 5)
                assert isinstance(answer, dict) and answer["error"], (op, offset, shape, answer)
                assert "not within" in answer["error"] or "malformed" in answer["error"], answer
        for regions in ("x", [], [good] * 257, [5], [{**good, "name": 5}], [{**good, "generation": 0}]):
            reply, _ = _tags()
            await b._send_own({"op": "read", "regions": regions, "reply": reply}, tag=_OPS_TAG)
            answer = await asyncio.wait_for(b._recv_own(tag=reply), 5)
            assert isinstance(answer, dict) and answer["error"], (regions, answer)
        assert np.array_equal(kv, np.arange(40).reshape(10, 4)), "a refused write reached the tensor"
        assert np.array_equal(await b.read(h[9]), kv[9])  # the service still answers
        await asyncio.sleep(0.05)
        assert list(b.channel.mailbox._arrived) == [] and list(a.channel.mailbox._arrived) == []


@pytest.mark.timeout(30)
@pytest.mark.parametrize("transport", ["tcp", "inproc"])
async def test_a_request_whose_fields_are_not_what_the_owner_sends_gets_an_error_answer(transport: str) -> None:
    """A peer may send anything where the owner expects an operation's name or a generation,
    tensors too. Compared with ``==``, an array answers with an array, whose truth numpy refuses:
    an array for the generation killed the task serving the request (never answered), and one
    for the op killed the owner's service of the whole channel (every later owner-assisted
    read or write on it, and every revocation notice, waited for good). An op it does not know
    was never answered either."""
    async with connected_pair(transport) as (a, b):
        a.node.expose(np.arange(8.0), name="x")
        h = await b.lookup("x")
        good = {"name": "x", "generation": h.generation, "offset": 0, "shape": [8]}
        for req in (
            {"op": "read", "regions": [{**good, "generation": np.array([h.generation, h.generation])}]},
            {"op": "read", "regions": [{**good, "generation": float(h.generation)}]},
            {"op": np.array([1, 2]), "regions": [good]},
            {"op": "frobnicate", "regions": [good]},
        ):
            reply, _ = _tags()
            await b._send_own({**req, "reply": reply}, tag=_OPS_TAG)
            answer = await asyncio.wait_for(b._recv_own(tag=reply), 5)
            assert isinstance(answer, dict) and isinstance(answer["error"], str) and answer["error"], (req, answer)
        async with asyncio.timeout(5):
            assert np.array_equal(await b.read(h[1:3]), [1.0, 2.0])  # the service still answers


def test_an_owners_answer_is_read_by_the_types_of_its_fields() -> None:
    """The other way round: an owner's answer whose fields are tensors (a broken or hostile
    owner) raised numpy's ValueError in the requester, where truth was asked of them."""
    from tensorwire._onesided import _error_of, _owner_error

    assert _error_of({"ok": True}) is None and _error_of({"error": ""}) is None
    assert _error_of({"error": "gone"}) == "gone"
    assert _error_of(["a", "list"]) == "unexpected answer"
    assert "unexpected answer" in str(_error_of({"error": np.array([1, 2])}))
    assert (
        _owner_error({"error": "x", "mismatch": np.array([1, 2]), "failed": np.array([1, 2])})
        is tensorwire.HandleNotFound
    )
    assert _owner_error({"error": "x", "failed": True}) is tensorwire.TransferError


@pytest.mark.timeout(30)
@pytest.mark.parametrize("transport", EVERY_TRANSPORT)
@pytest.mark.parametrize("shape", [(0, 2**62), (-2, 8)], ids=["empty-too-big", "negative"])
async def test_a_handle_given_a_shape_no_array_has_is_a_tensorwire_error(
    transport: str, shape: tuple[int, ...]
) -> None:
    """A handle changed by hand (or one a broken owner's lookup answer gave) to a shape no array
    can have, its ``nbytes`` agreeing: a read allocated its result with np.empty, and indexing
    its rows called ``slice.indices``; numpy's and Python's ValueError escaped."""
    async with connected_pair(transport) as (a, b):
        a.node.expose(np.arange(16, dtype=np.float64), name="x")
        h = await b.lookup("x")
        bad = dataclasses.replace(h, shape=shape, nbytes=8 * int(np.prod(shape, dtype=object)))
        with pytest.raises(tensorwire.TensorWireError):
            async with asyncio.timeout(5):
                await b.read(bad)
        if shape[0] < 0:
            with pytest.raises(tensorwire.ShapeMismatchError):
                bad[0:1]
        assert np.array_equal(await b.read(h[2:4]), [2.0, 3.0])


async def test_read_only_and_strided_out_buffers() -> None:
    async with connected_pair("tcp") as (a, b):
        kv = np.arange(24, dtype=np.int64).reshape(4, 6)
        a.node.expose(kv, name="kv")
        h = await b.lookup("kv")
        ro = np.empty((4, 6), np.int64)
        ro.flags.writeable = False
        with pytest.raises(tensorwire.ShapeMismatchError, match="read-only"):
            await b.read(h, out=ro)
        strided = np.zeros((6, 4), np.int64).T
        got, receipt = await b.read_with_receipt(h, out=strided)
        assert got is strided and np.array_equal(strided, kv) and receipt.packed
        assert np.array_equal(await b.read(h), kv)  # nothing of the refused read lingers


async def test_read_only_host_engine_memory_is_neither_written_nor_received_into() -> None:
    """A read-only array posing as device memory (``EngineArray``) is exposed read-only, and
    refused as a read's or a recv's out=, as a read-only host array is. Before, it counted as
    writable: the owner's host-engine lane thread died on the copy into it, and the write (and
    the owner's ``unexpose``, waiting for that write) hung for good."""
    from tensorwire.memory import HostEngine
    from tensorwire.tensors import EngineArray

    engine = HostEngine()
    try:
        async with connected_pair("tcp") as (a, b):
            frozen = np.zeros(100_000, np.uint8)
            frozen.flags.writeable = False
            a.node.expose(EngineArray(engine, frozen), name="ro")
            h = await b.lookup("ro")
            assert not h.writable
            async with asyncio.timeout(10):
                with pytest.raises(tensorwire.HandleNotFound, match="read-only"):
                    await b.write(h, np.ones(100_000, np.uint8))
                with pytest.raises(tensorwire.TensorWireError, match="read-only"):
                    await b.read(h, out=EngineArray(engine, frozen))
                await a.node.unexpose("ro")  # no write of it is left under way
                await a.send(np.ones(100_000, np.uint8), tag="t")
                with pytest.raises(tensorwire.TensorWireError, match="read-only"):
                    await b.recv(tag="t", out=EngineArray(engine, frozen))
                assert (await b.recv(tag="t") == 1).all()  # the refused message stayed for the next recv
            assert not frozen.any()
    finally:
        engine.close()


async def test_cancelled_read_never_writes_out_after_cancel() -> None:
    async with connected_pair("tcp") as (a, b):
        src = np.full(64 << 20, 3, np.uint8)
        a.node.expose(src, name="src")
        h = await b.lookup("src")
        for delay in (0.0, 0.005, 0.02):
            out = np.zeros_like(src)
            task = asyncio.ensure_future(b.read(h, out=out))
            await asyncio.sleep(delay)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            if task.cancelled():
                snapshot = out.copy()
                await asyncio.sleep(0.3)
                assert np.array_equal(out, snapshot), "out= written after the read was cancelled"
        assert np.array_equal(await b.read(h), src)  # the channel is still fine


async def test_lookup_requires_a_session_and_its_secret() -> None:
    async with connected_pair("tcp") as (a, b):
        a.node.expose(np.arange(3), name="secret-weights")
        async with grpc.aio.insecure_channel(a.node.address) as ch:
            stub = control_pb2_grpc.ControlStub(ch)
            for sid, proof in [("nope", b""), (b.session.id, b"forged" * 6)]:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.Lookup(
                        control_pb2.LookupRequest(session_id=sid, name="secret-weights", proof=proof), timeout=5
                    )
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert np.array_equal(await b.read(await b.lookup("secret-weights")), np.arange(3))


@pytest.mark.parametrize("transport", ["tcp", "inproc"])
@pytest.mark.parametrize("op", ["read", "write"])
async def test_an_owner_that_fails_to_move_the_bytes_answers_with_a_transfer_error(transport: str, op: str) -> None:
    """The owner's node could not send a read's regions (or take a write's bytes) although the
    channel is up: the requester gets a TransferError saying so at once, instead of waiting for
    an answer that never comes, and the next operation works. (A failure is injected into the
    owner's peer: one send of tensors, or one recv into the exposed tensor, raises.)"""
    async with connected_pair(transport) as (a, b):
        kv = np.arange(1024, dtype=np.int64)
        a.node.expose(kv, name="kv")
        h = await b.lookup("kv")
        real_send, real_recv = a._send_own, a._recv_own_with_receipt
        injected = []

        async def failing_send(obj, *, tag):  # type: ignore[no-untyped-def]
            if op == "read" and isinstance(obj, list) and not injected:
                injected.append(tag)
                raise tensorwire.TransferError("injected: the device copy failed")
            return await real_send(obj, tag=tag)

        async def failing_recv(*, tag, out=None, **kw):  # type: ignore[no-untyped-def]
            if op == "write" and out is not None and not injected:
                injected.append(tag)
                raise tensorwire.TransferError("injected: the device copy failed")
            return await real_recv(tag=tag, out=out, **kw)

        # the owner takes a write's bytes with a receipt (its answer says how they came)
        a._send_own, a._recv_own_with_receipt = failing_send, failing_recv  # type: ignore[method-assign]
        call = b.read(h[3:9]) if op == "read" else b.write(h[3:9], np.zeros(6, np.int64))
        with pytest.raises(tensorwire.TransferError, match="injected: the device copy failed"):
            await asyncio.wait_for(call, 10)
        assert injected
        await asyncio.sleep(0.05)
        assert np.array_equal(await asyncio.wait_for(b.read(h[3:9]), 10), kv[3:9])
        await asyncio.wait_for(b.write(h[0], np.int64(-1)), 10)
        assert kv[0] == -1
        assert not a.channel.mailbox._arrived, "the failed write's payload lingers at the owner"


@pytest.mark.parametrize("transport", ["tcp", "inproc"])
async def test_read_device_argument(transport: str) -> None:
    """``device=`` says where a read without out= allocates, as recv's does; bad ones and
    ``out=`` with ``device=`` fail before anything moves."""
    from tensorwire.tensors._device import cuda_usable

    async with connected_pair(transport) as (a, b):
        kv = np.arange(64, dtype=np.float32).reshape(8, 8)
        a.node.expose(kv, name="kv")
        h = await b.lookup("kv")
        assert h.memory == "host" and h[2].memory == "host"
        got = await b.read(h[2], device="cpu")
        assert isinstance(got, np.ndarray) and np.array_equal(got, kv[2])
        (got,) = await b.read_many([h[3]], device="cpu")
        assert np.array_equal(got, kv[3])
        with pytest.raises(tensorwire.ConfigurationError, match="unknown device"):
            await b.read(h[2], device="tpu")
        with pytest.raises(tensorwire.ConfigurationError, match="not both"):
            await b.read(h[2], out=np.empty(8, np.float32), device="cpu")
        if not cuda_usable():
            with pytest.raises(tensorwire.UnsupportedTensorError):
                await b.read(h[2], device="cuda")
        assert a.node.exposures.served == 2


async def test_cancelled_writes_leave_nothing_at_the_owner() -> None:
    """A write cancelled while the last bytes of its payload were going out still delivers them
    (a frame once started is finished); the owner takes the payload and answers ok, and the
    writer's 'payload will not come' note used to stay on the owner's data tag for good, each
    one holding a message slot of the writer's until its sends blocked (about 1 in 6 cancelled
    16 MiB writes here). The writer now asks the owner to drop that note."""
    async with connected_pair("tcp", limits=tensorwire.Limits(max_unexpected=64)) as (a, b):
        size = 16 << 20
        dst = np.zeros(size, np.uint8)
        a.node.expose(dst, name="x")
        h = await b.lookup("x")
        rng = np.random.default_rng(1)
        for _ in range(60):
            task = asyncio.ensure_future(b.write(h, np.full(size, 1, np.uint8)))
            for _ in range(int(rng.integers(0, 40))):
                await asyncio.sleep(0)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await b.write(h, np.full(size, 9, np.uint8))  # a whole write after them all
        assert (dst == 9).all()
        async with asyncio.timeout(10):
            while a.channel.mailbox._arrived or b.channel._window.slots < 64 + own_slots(64):  # noqa: ASYNC110 - no event to wait on
                await asyncio.sleep(0.02)


async def test_what_is_not_a_handle_or_a_name_is_refused_clearly() -> None:
    """None, a str or an int where a handle belongs used to raise a bare AttributeError; a long
    unknown name came back as RESOURCE_EXHAUSTED, the refusal echoing all of it."""
    async with connected_pair("tcp") as (a, b):
        a.node.expose(np.arange(4), name="x")
        h = await b.lookup("x")
        for bad in (None, "x", 3):
            with pytest.raises(tensorwire.ConfigurationError, match="RemoteHandle"):
                await b.read(bad)  # type: ignore[arg-type]
            with pytest.raises(tensorwire.ConfigurationError, match="RemoteHandle"):
                await b.write(bad, np.arange(4))  # type: ignore[arg-type]
            with pytest.raises(tensorwire.ConfigurationError, match="RemoteHandle"):
                await b.read_many([h, bad])  # type: ignore[list-item]
            with pytest.raises(tensorwire.ConfigurationError, match="RemoteHandle"):
                await b.write_many([bad], [np.arange(4)])  # type: ignore[list-item]
        for bad_name in (None, 3, b"x"):
            with pytest.raises(tensorwire.ConfigurationError, match="name"):
                await b.lookup(bad_name)  # type: ignore[arg-type]
        # (a name expose() would refuse is refused before the round trip: see test_control_inputs)
        with pytest.raises(tensorwire.ConfigurationError, match="at most 256 characters"):
            await b.lookup("y" * 20_000)
        with pytest.raises(tensorwire.HandleNotFound, match="is not exposed"):
            await b.lookup("y" * 256)
        assert np.array_equal(await b.read(h), np.arange(4))


@pytest.mark.parametrize("transport", ["tcp", "inproc"])
@pytest.mark.parametrize("how", ["cancel", "abort"])
async def test_unexpose_waits_for_a_write_being_received_but_not_for_one_that_stopped(transport: str, how: str) -> None:
    """``await node.unexpose()`` waits for the owner-assisted writes still landing in the tensor
    (it used to return at once, and they went on landing), but not for long on one whose writer
    stops part way: cancelled (the rest of the payload never comes) or gone (its channel closes,
    as a dead peer's lease closes it). Afterwards nothing lands."""
    async with connected_pair(transport, limits=tensorwire.Limits(recv_buffer_bytes=4 << 20)) as (a, b):
        n = 64 << 20
        dst = np.zeros(n, np.uint8)
        a.node.expose(dst, name="x")
        h = await b.lookup("x")
        write = asyncio.ensure_future(b.write(h, np.ones(n, np.uint8)))
        async with asyncio.timeout(10):
            while not dst.any():  # noqa: ASYNC110 - polling the bytes landing is the point
                await asyncio.sleep(0)
        assert not dst.all(), "the write was over before it could be seen under way"
        revocation = a.node.unexpose("x")
        assert not revocation.done(), "the unexpose did not wait for the write landing in the tensor"
        if how == "cancel":
            write.cancel()
        else:
            b.abort()
        with contextlib.suppress(asyncio.CancelledError, tensorwire.TensorWireError):
            await asyncio.wait_for(write, 10)
        async with asyncio.timeout(10):
            await revocation
        landed = int(np.count_nonzero(dst))
        await asyncio.sleep(0.05)
        assert int(np.count_nonzero(dst)) == landed, "a write landed after `await node.unexpose()` returned"


@pytest.mark.parametrize("transport", ["tcp", "inproc"])
async def test_a_batch_of_one_handle_or_of_nothing_is_refused_clearly(transport: str) -> None:
    """``read_many(h)`` iterated the handle's rows through ``__getitem__`` and failed with "row 8 is
    out of range"; ``write_many([h], None)`` with a bare TypeError; ``for row in h`` too."""
    async with connected_pair(transport) as (a, b):
        x = np.arange(8, dtype=np.int32)
        a.node.expose(x, name="x")
        h = await b.lookup("x")
        with pytest.raises(tensorwire.ConfigurationError, match="not one handle"):
            await b.read_many(h)  # type: ignore[arg-type]
        with pytest.raises(tensorwire.ConfigurationError, match="not one handle"):
            await b.read_many_with_receipt(h)  # type: ignore[arg-type]
        with pytest.raises(tensorwire.ConfigurationError, match="not one handle"):
            await b.write_many(h, [x])  # type: ignore[arg-type]
        for bad in (None, 3, "ab", b"ab"):
            with pytest.raises(tensorwire.ConfigurationError, match="sequence"):
                await b.write_many([h], bad)  # type: ignore[arg-type]
            with pytest.raises(tensorwire.ConfigurationError, match="sequence"):
                await b.read_many(bad)  # type: ignore[arg-type]
            if bad is not None:  # (outs=None: all allocated)
                with pytest.raises(tensorwire.ConfigurationError, match="sequence"):
                    await b.read_many([h], outs=bad)  # type: ignore[arg-type]
        with pytest.raises(tensorwire.ConfigurationError, match="not iterable"):
            [row for row in h]
        with pytest.raises(tensorwire.ConfigurationError, match="not iterable"):
            list(h)
        # what is a batch still is: a tuple, a generator, rows listed by index
        got = await b.read_many(h[i] for i in range(2))
        assert [int(g) for g in got] == [0, 1]
        assert np.array_equal(np.stack(await b.read_many(tuple(h[i] for i in range(8)))), x)
        await b.write_many((h[0], h[1]), (np.int32(5) * np.ones((), np.int32), np.full((), 6, np.int32)))
        assert x[:2].tolist() == [5, 6] and a.node.exposures.served


@pytest.mark.timeout(30)
@pytest.mark.parametrize("transport", ["tcp", "inproc"])
async def test_a_batch_the_owner_refuses_part_way_says_which_handles_moved(transport: str) -> None:
    """Through the owner, a batch of more than 256 regions goes as several requests, each checked
    by the owner as it comes. One naming a tensor unexposed before the batch began is refused
    after the first 256 rows moved. Before, the error named only the refused tensor: the caller
    could not tell that rows 0-255 were written (or read), and strided outs of the rows read
    before were left unfilled though their bytes had come."""
    async with connected_pair(transport) as (a, b):
        rows = np.zeros((300, 4), np.float32)
        gone = np.zeros(4, np.float32)
        a.node.expose(rows, name="rows")
        a.node.expose(gone, name="gone")
        h, g = await b.lookup("rows"), await b.lookup("gone")
        await a.node.unexpose("gone")
        handles = [h[i] for i in range(299)] + [g]
        with pytest.raises(tensorwire.HandleNotFound, match=r"of this batch of 300 handles, 0-255 were written") as e:
            await asyncio.wait_for(b.write_many(handles, [np.full(4, 7, np.float32)] * 300), 10)
        assert "'gone' is not exposed" in str(e.value) and "the rest were not" in str(e.value)
        assert (rows[:256] == 7).all() and not rows[256:].any()
        strided = np.zeros((300, 8), np.float32)
        outs = [strided[i, ::2] for i in range(300)]
        with pytest.raises(tensorwire.HandleNotFound, match=r"0-255 were read into their outs"):
            await asyncio.wait_for(b.read_many(handles, outs=outs), 10)
        assert (strided[:256, ::2] == 7).all() and not strided[256:].any()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("transport", ["tcp", "inproc"])
async def test_a_write_batch_naming_a_read_only_handle_writes_nothing(transport: str) -> None:
    """The lookup says a handle is read-only, so a write batch naming one is refused before
    anything moves. Through the owner it was refused only when the request naming it came: a
    batch of 300 rows and then a read-only tensor wrote rows 0-255 first."""
    async with connected_pair(transport) as (a, b):
        rows = np.zeros((300, 4), np.int32)
        ro = np.zeros(4, np.int32)
        ro.flags.writeable = False
        a.node.expose(rows, name="rows")
        a.node.expose(ro, name="ro")
        h, r = await b.lookup("rows"), await b.lookup("ro")
        assert not r.writable
        with pytest.raises(tensorwire.HandleNotFound, match="'ro' is exposed read-only; nothing was written"):
            await b.write_many([h[i] for i in range(300)] + [r], [np.ones(4, np.int32)] * 301)
        assert not rows.any(), f"{int(rows[:, 0].sum())} rows were written"


@pytest.mark.parametrize("bit", ["conj", "neg"])
async def test_a_torch_view_with_the_conj_or_neg_bit_as_out_is_refused_saying_why(bit: str) -> None:
    """Its values live in no memory, so no read can land in it: the error says so and what to
    do, as recv's does. It said "out= buffer is read-only" of a tensor that is not."""
    torch = pytest.importorskip("torch")
    async with connected_pair("tcp") as (a, b):
        a.node.expose(np.zeros(2, np.complex64 if bit == "conj" else np.float32), name="x")
        h = await b.lookup("x")
        base = torch.zeros(2, dtype=torch.complex64)
        out = base.conj() if bit == "conj" else base.conj().imag
        for read in (lambda: b.read(h, out=out), lambda: b.read_many([h], outs=[out])):
            with pytest.raises(tensorwire.ShapeMismatchError, match=f"out= Tensor is read-only .*{bit} bit"):
                await read()


async def test_the_receipt_of_a_batch_in_several_requests_says_how_every_part_moved() -> None:
    """Through the owner, a batch of more than 256 regions goes as several requests; its receipt
    must say how all of them moved. It said how the last one did: 256 small rows read into
    device memory (a host engine's, which inproc stages through host memory) and two large rows
    (512 KiB) into host memory, and the batch was reported direct and not staged when the large
    rows came after the small ones, staged when they came first."""
    engine = HostEngine()
    try:
        async with connected_pair("inproc") as (a, b):
            small = np.arange(256 * 4, dtype=np.int32).reshape(256, 4)
            big = np.arange(2 * 65536, dtype=np.int32).reshape(2, 65536)
            a.node.expose(small, name="small")
            a.node.expose(big, name="big")
            hs, hb = await b.lookup("small"), await b.lookup("big")
            rows, bigs = [hs[i] for i in range(256)], [hb[0], hb[1]]
            said = []
            for small_first in (True, False):
                douts = [EngineArray(engine, np.zeros(4, np.int32)) for _ in rows]
                if small_first:
                    handles, outs = rows + bigs, [*douts, None, None]
                else:
                    handles, outs = bigs + rows, [None, None, *douts]
                got, receipt = await b.read_many_with_receipt(handles, outs=outs)
                assert np.array_equal(np.stack([d.array for d in douts]), small)
                assert np.array_equal(np.stack(got[256:] if small_first else got[:2]), big)
                assert receipt.protocol == "owner-assisted" and receipt.nbytes == small.nbytes + big.nbytes, receipt
                said.append((receipt.direct, receipt.staged))
            assert said == [(False, True), (False, True)], f"small rows first, then last: (direct, staged) {said}"
    finally:
        engine.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("transport", ["tcp", "inproc"])
async def test_a_batch_whose_buffers_or_rows_overlap_is_refused_before_anything_moves(transport: str) -> None:
    """``read_many`` into out= buffers that share memory, and ``write_many`` naming the same rows
    twice, are ShapeMismatchErrors before any request goes. Before, the read's request went, the
    owner's answer came and the recv refused the buffers, and the read failed with 'unexpected
    answer from the owner' (a TransferError); the write went to the owner, which refused it, and
    the writer was told the tensor was not exposed (HandleNotFound)."""
    async with connected_pair(transport) as (a, b):
        x = np.arange(40, dtype=np.float32).reshape(10, 4)
        a.node.expose(x, name="x")
        h = await b.lookup("x")
        buf, wide = np.zeros(4, np.float32), np.zeros(8, np.float32)
        for outs in ([buf, buf], [wide[:4], wide[2:6]], [None, wide[:4], wide[3:7]]):
            handles = [h[i] for i in range(len(outs))]
            with pytest.raises(tensorwire.ShapeMismatchError, match="share memory"):
                await asyncio.wait_for(b.read_many(handles, outs=outs), 5)
        for handles in ([h[0], h[0]], [h[1:4], h[3]], [h[5], h[:], h[9]]):
            srcs = [np.ones(hh.shape, np.float32) for hh in handles]
            with pytest.raises(tensorwire.ShapeMismatchError, match="name the same bytes of 'x'"):
                await asyncio.wait_for(b.write_many(handles, srcs), 5)
        assert a.node.exposures.served == 0, "a refused batch reached the owner"
        assert np.array_equal(x, np.arange(40, dtype=np.float32).reshape(10, 4))
        # what shares no memory is still fine: interleaved strided outs, adjacent rows, one row twice read
        both = np.zeros((4, 2), np.float32)
        got = await asyncio.wait_for(b.read_many([h[2], h[3], h[2]], outs=[both[:, 0], both[:, 1], None]), 5)
        assert np.array_equal(both, x[2:4].T) and np.array_equal(got[2], x[2])
        await asyncio.wait_for(b.write_many([h[0:2], h[2]], [np.ones((2, 4), np.float32), np.ones(4, np.float32)]), 5)
        assert (x[:3] == 1).all() and x[3, 0] == 12


@pytest.mark.timeout(30)
async def test_expose_and_unexpose_on_a_closed_node_say_it_is_closed() -> None:
    """Before, ``unexpose`` on a closed node raised HandleNotFound (closing had emptied the table)
    while ``expose`` raised ClosedResourceError."""
    node = await tensorwire.start("127.0.0.1:0", transports=["tcp"])
    x = np.zeros(4, np.float32)
    node.expose(x, name="x")
    await node.aclose()
    with pytest.raises(tensorwire.ClosedResourceError):
        node.expose(x, name="y")
    for name in ("x", "never"):
        with pytest.raises(tensorwire.ClosedResourceError):
            node.unexpose(name)


@contextlib.asynccontextmanager
async def _limited(
    transport: str, owner: tensorwire.Limits, reader: tensorwire.Limits
) -> AsyncIterator[tuple[tensorwire.Peer, tensorwire.Peer]]:
    """An owner's peer and a reader's, their nodes with limits of their own."""
    async with (
        tensorwire.start("127.0.0.1:0", transports=(transport,), limits=owner) as na,
        tensorwire.start("127.0.0.1:0", transports=(transport,), limits=reader) as nb,
    ):
        a = await na.connect(nb.address)
        yield a, await nb.accept()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["tcp", "inproc"])
@pytest.mark.parametrize("small", ["owner", "reader"])
async def test_a_batch_goes_in_requests_whose_headers_each_end_accepts(transport: str, small: str) -> None:
    """Through the owner, a batch went as requests of 256 regions, however long their headers:
    each region repeats its tensor's name, so to an owner with ``max_header_bytes=1024`` a
    read_many of 10 rows of a 200-character name was a 2755-byte header, refused whole
    (MessageRefused), and 256 rows a 69 KB one. The tensors that answer a read come to the
    reader, within its own limit: 256 rows of a 4-d tensor made a 20 KB answer the owner could
    not send (TransferError). Each request and answer now fits the end that takes it."""
    small_limits = tensorwire.Limits(max_header_bytes=tensorwire.Limits.MIN_HEADER_BYTES)
    limits = (small_limits, tensorwire.Limits()) if small == "owner" else (tensorwire.Limits(), small_limits)
    async with _limited(transport, *limits) as (a, b):
        name = "n" * 200
        rows = np.zeros((300, 4), np.float32)
        blocks = np.zeros((300, 2, 3, 4, 5), np.float32)
        a.node.expose(rows, name=name)
        a.node.expose(blocks, name="b")
        h, hb = await b.lookup(name), await b.lookup("b")
        for n in (10, 300):
            served = a.node.exposures.served
            await asyncio.wait_for(b.write_many([h[i] for i in range(n)], [np.full(4, n, np.float32)] * n), 10)
            assert (rows[:n] == n).all() and not rows[n:].any()
            got, receipt = await asyncio.wait_for(b.read_many_with_receipt([h[i] for i in range(n)]), 10)
            assert np.array_equal(np.stack(got), rows[:n]) and receipt is not None
            assert receipt.protocol == "owner-assisted" and receipt.nbytes == n * 16, receipt
            if small == "owner":  # in several requests each way
                assert a.node.exposures.served - served > 2, a.node.exposures.served - served
        blocks[:] = np.arange(blocks.size, dtype=np.float32).reshape(blocks.shape)
        got = await asyncio.wait_for(b.read_many([hb[i] for i in range(256)]), 10)
        assert np.array_equal(np.stack(got), blocks[:256])
        await asyncio.wait_for(b.write_many([hb[i] for i in range(256)], [np.ones((2, 3, 4, 5), np.float32)] * 256), 10)
        assert (blocks[:256] == 1).all() and not (blocks[256:] == 1).any()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("transport", ["tcp", "inproc"])
async def test_a_region_whose_request_fits_no_header_the_owner_takes_is_refused_saying_what_to_do(
    transport: str,
) -> None:
    """A 256-character name of 4-byte characters is a 1 KiB name: no request naming it fits an
    owner's 1024-byte header limit. It is refused before anything moves, saying what to do."""
    small = tensorwire.Limits(max_header_bytes=tensorwire.Limits.MIN_HEADER_BYTES)
    async with _limited(transport, small, tensorwire.Limits()) as (a, b):
        name = "\U0001d4c1" * 256
        x = np.zeros((4, 4), np.float32)
        a.node.expose(x, name=name)
        a.node.expose(np.zeros(4, np.float32), name="ok")
        h, ok = await b.lookup(name), await b.lookup("ok")
        for call, verb in (
            (lambda: b.read_many([ok, h[0]]), "read"),
            (lambda: b.read(h), "read"),
            (lambda: b.write_many([ok, h[1]], [np.ones(4, np.float32)] * 2), "written"),
        ):
            with pytest.raises(tensorwire.MessageRefused, match=r"past the owner's 1024-byte limit") as e:
                await asyncio.wait_for(call(), 10)
            said = str(e.value)
            assert f"nothing was {verb}" in said and "shorter name" in said and "larger Limits.max_header_bytes" in said
        assert a.node.exposures.served == 0 and not x.any()
        assert np.array_equal(await b.read(ok), np.zeros(4, np.float32))  # the peer goes on


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["tcp", "inproc"])
@pytest.mark.parametrize("small", ["owner", "reader"])
async def test_a_batch_goes_in_messages_whose_payloads_each_end_accepts(transport: str, small: str) -> None:
    """Through the owner, a batch went as one request whatever its bytes: to a reader with
    ``max_message_bytes`` of 1 MiB the owner could not send the 4 MiB answer of a read_many of 16
    rows of 256 KiB (TransferError), and to such an owner that write_many's payload was refused at
    the writer (MessageRefused), though every row fits. Each message now fits the end that takes
    it: a write's payload the owner's limit, a read's answer the reader's."""
    limit = 1 << 20
    small_limits = tensorwire.Limits(max_message_bytes=limit)
    limits = (small_limits, tensorwire.Limits()) if small == "owner" else (tensorwire.Limits(), small_limits)
    async with _limited(transport, *limits) as (a, b):
        x = np.zeros((16, limit // 4), np.uint8)
        a.node.expose(x, name="x")
        h = await b.lookup("x")
        rows = [h[i] for i in range(16)]
        await asyncio.wait_for(b.write_many(rows, [np.full(limit // 4, i + 1, np.uint8) for i in range(16)]), 10)
        assert all((x[i] == i + 1).all() for i in range(16))
        wrote = a.node.exposures.served
        got, receipt = await asyncio.wait_for(b.read_many_with_receipt(rows), 10)
        assert np.array_equal(np.stack(got), x) and receipt is not None and receipt.nbytes == x.nbytes
        read = a.node.exposures.served - wrote
        assert (wrote, read) == ((4, 1) if small == "owner" else (1, 4)), (wrote, read)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("transport", ["tcp", "inproc"])
async def test_a_region_past_the_payload_limit_is_refused_before_anything_moves(transport: str) -> None:
    """A region whose bytes alone pass the ``max_message_bytes`` of the end that takes them fits
    in no message. A write_many went out in parts until that region's was refused at the writer,
    the rows before it written; a read of it was refused by the owner (TransferError). Both are
    now a MessageRefused before anything moves, saying what to do."""
    limit = 1 << 20
    async with connected_pair(transport, limits=tensorwire.Limits(max_message_bytes=limit)) as (a, b):
        rows = np.zeros((256, 4), np.float32)
        big = np.zeros(2 * limit, np.uint8)
        a.node.expose(rows, name="rows")
        a.node.expose(big, name="big")
        h, g = await b.lookup("rows"), await b.lookup("big")
        row_handles = [h[i] for i in range(256)]
        srcs = [np.ones(4, np.float32)] * 256 + [np.ones(2 * limit, np.uint8)]
        for call, verb, who in (
            (lambda: b.write_many([*row_handles, g], srcs), "written", "the owner's"),
            (lambda: b.read_many([*row_handles, g]), "read", "this node's"),
            (lambda: b.read(g), "read", "this node's"),
            (lambda: b.write(g, np.ones(2 * limit, np.uint8)), "written", "the owner's"),
        ):
            with pytest.raises(tensorwire.MessageRefused, match=rf"past {who} 1048576-byte message limit") as e:
                await asyncio.wait_for(call(), 10)
            said = str(e.value)
            assert f"nothing was {verb}" in said and "handle[a:b]" in said and "Limits.max_message_bytes" in said, said
        assert a.node.exposures.served == 0 and not rows.any() and not big.any()
        await asyncio.wait_for(b.write(g[:limit], np.ones(limit, np.uint8)), 10)  # what fits still goes
        assert big[:limit].all() and not big[limit:].any()
