"""Edges of the tensor adapter and message headers: what a sender accepts, a receiver must too."""

from __future__ import annotations

import asyncio
import importlib.util
from typing import Any

import numpy as np
import pytest

import tensorwire
from tensorwire.tensors import decode_header, prepare, rebuild
from tensorwire.testing import connected_pair

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("key", [np.float64(1.5), np.float64("nan"), np.int64(3)], ids=repr)
def test_a_numpy_number_is_no_dict_key(key: object) -> None:
    """np.float64 is a float, but a numpy scalar travels as a tensor: as a dict key it made a
    header with a tensor for a key, which the receiver refuses."""
    with pytest.raises(tensorwire.UnsupportedTensorError, match="dict key"):
        prepare({key: np.arange(3)})


def test_numpy_strings_as_dict_keys_travel_as_strings() -> None:
    msg = prepare({np.str_("k"): 1, np.bytes_(b"b"): 2})
    tree, specs = decode_header(msg.header, max_message_bytes=1 << 20)
    assert specs == [] and [k.WhichOneof("kind") for k in tree.dict.keys] == ["str_value", "bytes_value"]


@pytest.mark.parametrize("transport", ["tcp", "inproc"])
async def test_a_numpy_float_key_fails_the_send_alone(transport: str) -> None:
    """Refused at the sender; over tcp the receiver's ProtocolError closed the channel."""
    async with connected_pair(transport) as (a, b), asyncio.timeout(20):
        with pytest.raises(tensorwire.UnsupportedTensorError, match="dict key"):
            await a.send({np.float64(0.5): np.arange(3)}, tag="k")
        await a.send({0.5: np.arange(3)}, tag="k")
        got = await b.recv(tag="k")
        assert list(got) == [0.5] and np.array_equal(got[0.5], np.arange(3))


def test_many_strided_leaves_over_one_range_are_checked_without_comparing_every_pair(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The columns of a matrix as out= buffers (read_many): their bounds all overlap, and
    comparing every pair exactly took a second for a thousand on the event loop. They are
    checked by marking the bytes each covers; np.shares_memory runs only to name a clash."""
    from tensorwire.errors import ShapeMismatchError
    from tensorwire.tensors._message import refuse_shared

    calls = []
    real = np.shares_memory
    monkeypatch.setattr(np, "shares_memory", lambda *a, **k: calls.append(1) or real(*a, **k))
    m = np.zeros((4, 1000), np.float32)
    columns = [m[:, i] for i in range(1000)]
    refuse_shared(columns, "{first} {second}")
    assert not calls  # (before: 499,500 comparisons)
    with pytest.raises(ShapeMismatchError, match=r"^3 999$"):
        refuse_shared([*columns[:999], m[1:3, 3]], "{first} {second}")
    interleaved = m.reshape(-1)
    refuse_shared([interleaved[i::16] for i in range(16)], "{first} {second}")  # share nothing
    with pytest.raises(ShapeMismatchError, match=r"^0 16$"):
        refuse_shared([*(interleaved[i::16] for i in range(16)), interleaved[::32]], "{first} {second}")


@pytest.mark.parametrize("make", ["numpy", "torch"])
def test_an_empty_tensor_whose_shape_a_receiver_refuses_is_refused_at_the_sender(make: str) -> None:
    """np.empty((0, 2**62), np.int8) holds no bytes, but its header claims a shape every
    receiver refuses as impossible (a ProtocolError that closed tcp and ucx channels)."""
    shape = (0, 2**62)
    if make == "torch":
        torch = pytest.importorskip("torch")
        t: object = torch.empty(shape, dtype=torch.int8)
    else:
        t = np.empty(shape, np.int8)
    with pytest.raises(tensorwire.UnsupportedTensorError, match="2\\*\\*62 bytes"):
        prepare({"x": t})
    fits = np.empty((0, 2**61), np.int8)  # the largest that still passes
    _, specs = decode_header(prepare(fits).header, max_message_bytes=1)
    assert specs[0].shape == fits.shape


@pytest.mark.parametrize("dtype", ["float64", "float32", "int64"])
def test_an_empty_torch_tensor_past_what_numpy_can_index_gets_the_impossible_shape_refusal(dtype: str) -> None:
    """torch makes an empty tensor of shape (0, 2**61) of any dtype, which numpy cannot view (its
    dimensions count past what it indexes): float64's was refused with numpy's own "array is too
    big; `arr.size * arr.dtype.itemsize` is larger than the maximum possible size" as "no numpy
    view", not as the impossible shape it is (int8's, which numpy views, was)."""
    torch = pytest.importorskip("torch")
    t = torch.empty((0, 2**61), dtype=getattr(torch, dtype))
    with pytest.raises(tensorwire.UnsupportedTensorError) as err:
        prepare({"x": t})
    assert str(err.value) == (
        f"a {dtype} tensor of shape [0, {2**61}] cannot be sent: its dimensions (empty ones counted as 1) "
        "describe 2**62 bytes or more, which no receiver accepts"
    )
    fits = torch.empty((0, 2**59), dtype=torch.float32)  # 2**61 bytes: it still travels
    _, specs = decode_header(prepare(fits).header, max_message_bytes=1)
    assert specs[0].shape == (0, 2**59)


def test_a_byte_swapped_bfloat16_array_is_refused_by_its_name() -> None:
    """A big-endian bfloat16 (or float8) array was refused as "big-endian dtype >V2", a plain
    void type to the reader: ml_dtypes' types have no str of their own."""
    import ml_dtypes

    from tensorwire.tensors import as_view, dtype_name

    for dt, name in [(ml_dtypes.bfloat16, "bfloat16"), (ml_dtypes.float8_e4m3fn, "float8_e4m3fn"), ("f4", "float32")]:
        swapped = np.zeros(3, dt).view(np.dtype(dt).newbyteorder(">"))
        refusal = f"big-endian dtype {name} ({swapped.dtype.str}) is not supported; convert to native order"
        with pytest.raises(tensorwire.UnsupportedTensorError) as err:
            as_view(swapped)
        assert str(err.value) == refusal
        with pytest.raises(tensorwire.UnsupportedTensorError) as err:
            dtype_name(swapped.dtype)
        assert str(err.value) == refusal


@pytest.mark.parametrize("transport", ["tcp", "inproc"])
async def test_an_impossible_empty_shape_fails_the_send_alone(transport: str) -> None:
    async with connected_pair(transport) as (a, b), asyncio.timeout(20):
        with pytest.raises(tensorwire.UnsupportedTensorError):
            await a.send(np.empty((0, 2**62), np.int8), tag="z")
        await a.send(np.empty((0, 2**61), np.int8), tag="z")
        got = await b.recv(tag="z")
        assert got.shape == (0, 2**61) and got.dtype == np.int8


def test_integers_of_up_to_1000_digits_travel_as_their_digits() -> None:
    """Ints of 995-1000 digits were refused as 'beyond 1000 digits'; an int subclass beyond
    64 bits travelled as its str() ("E.BIG" for an (int, Enum) member), a header the receiver
    refuses (a ProtocolError that closed the channel)."""
    import enum

    class E(int, enum.Enum):
        BIG = 2**70

    values = [10**999, -(10**999) + 1, 10**1000 - 1, E.BIG]
    tree, _ = decode_header(prepare(values).header, max_message_bytes=1 << 20)
    assert rebuild(tree, [], []) == [10**999, -(10**999) + 1, 10**1000 - 1, 2**70]
    with pytest.raises(tensorwire.UnsupportedTensorError, match="1000 digits"):
        prepare(10**1000)


def _list_of_tensors(places: list[int]) -> bytes:
    """The header of ``[x, y]`` (two float64[3]) with its tree's tensor places replaced."""
    from tensorwire.control._pb import wire_pb2

    header = wire_pb2.MessageHeader.FromString(prepare([np.arange(3.0), np.ones(3)]).header)
    del header.tree.list.items[:]
    for place in places:
        header.tree.list.items.add(tensor=place)
    return header.SerializeToString()


@pytest.mark.parametrize(
    ("places", "match"),
    [([0, 0], "tensor 0 twice"), ([1, 0], "tensor 1 where tensor 0 comes next"), ([0], "1 of its 2")],
    ids=["one-tensor-twice", "out-of-order", "one-left-out"],
)
def test_a_header_whose_tree_does_not_place_each_tensor_once_in_order_is_refused(places: list[int], match: str) -> None:
    """A sender writes tensor i as the i-th tensor leaf it meets, each once. A header from a
    broken or hostile peer whose tree names tensor 0 twice passed: the recv returned one array
    twice (``got[0] is got[1]``) and tensor 1's bytes were dropped unseen; one that places the
    tensors out of order filled ``out=`` by wire order but a plain recv by place, two answers."""
    with pytest.raises(tensorwire.ProtocolError, match=match):
        decode_header(_list_of_tensors(places), max_message_bytes=1 << 20)
    _, specs = decode_header(_list_of_tensors([0, 1]), max_message_bytes=1 << 20)  # (as we write it)
    assert len(specs) == 2


@pytest.mark.parametrize("second", ["a", 1, True], ids=repr)
def test_a_header_whose_dict_repeats_a_key_is_refused(second: object) -> None:
    """A sender's dict holds each key once. A header from a broken or hostile peer repeating
    one ({"a": x, "a": y}, or {1: x, True: y}: one key in Python) passed: the recv returned
    one entry, the other tensor's bytes dropped unseen. Two NaN keys are two keys, and pass."""
    from tensorwire.control._pb import wire_pb2

    first = "a" if second == "a" else 1
    header = wire_pb2.MessageHeader.FromString(prepare({first: np.arange(3.0), "b": np.ones(3)}).header)
    header.tree.dict.keys[1].CopyFrom(wire_pb2.MessageHeader.FromString(prepare({second: 0}).header).tree.dict.keys[0])
    with pytest.raises(tensorwire.ProtocolError, match="repeats a key"):
        decode_header(header.SerializeToString(), max_message_bytes=1 << 20)
    tree, specs = decode_header(
        prepare({float("nan"): np.ones(2), float("nan"): np.zeros(2)}).header, max_message_bytes=1 << 20
    )
    assert len(rebuild(tree, specs, [np.ones(2), np.zeros(2)])) == 2


@pytest.mark.parametrize("make", ["numpy", "torch"])
async def test_a_broadcast_view_too_large_to_pack_fails_the_send_with_a_transfer_error(make: str) -> None:
    """A stride-0 view (np.broadcast_to, torch's expand) is packed into C order before it is sent;
    one larger than memory raised numpy's MemoryError (1 PiB here: past any address space)."""
    if make == "torch":
        torch = pytest.importorskip("torch")
        big: object = torch.zeros(1, dtype=torch.int8).expand(2**50)
    else:
        big = np.broadcast_to(np.zeros(1, np.int8), (2**50,))
    async with connected_pair("tcp") as (a, b), asyncio.timeout(20):
        with pytest.raises(tensorwire.TransferError, match="out of memory"):
            await a.send(big, tag="b")
        await a.send(np.arange(3), tag="b")
        assert np.array_equal(await b.recv(tag="b"), np.arange(3))


def _read_only(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


@pytest.mark.parametrize(
    "make_out",
    [
        lambda: _read_only(np.zeros(3)),
        lambda: np.zeros(6)[::2],
        lambda: (lambda z: [z, z])(np.zeros(3)),
        lambda: np.zeros(3, ">f8"),
    ],
    ids=["read-only", "strided", "shared", "big-endian"],
)
async def test_an_rpc_out_no_result_could_land_in_is_refused_before_the_method_runs(make_out: Any) -> None:
    """call(..., _out=) with a read-only, strided or shared buffer sent the call, ran the method
    and then dropped its result as not fitting: a method with effects had them for nothing."""
    async with connected_pair("tcp") as (a, b), asyncio.timeout(20):
        runs = []

        @b.node.method("take")
        async def take() -> Any:
            runs.append(1)
            return np.arange(3.0)

        with pytest.raises((tensorwire.ShapeMismatchError, tensorwire.UnsupportedTensorError)):
            await a.call("take", _out=make_out())
        assert runs == []
        assert np.array_equal(await a.call("take", _out=np.zeros(3)), np.arange(3.0))


@pytest.mark.parametrize("transport", ["tcp", "inproc"])
async def test_a_recv_into_out_returns_the_messages_signed_zero(transport: str) -> None:
    """-0.0 == 0.0, so a recv whose out= held 0.0 where the message carried -0.0 returned out=
    as it was: the sign the sender sent was lost."""
    async with connected_pair(transport) as (a, b), asyncio.timeout(20):
        await a.send({"loss": -0.0, "x": np.ones(2)}, tag="z")
        out = {"loss": 0.0, "x": np.zeros(2)}
        got = await b.recv(tag="z", out=out)
        assert str(got["loss"]) == "-0.0" and got["x"] is out["x"] and np.array_equal(out["x"], np.ones(2))
        await a.send([np.ones(2), float("nan")], tag="z")
        out2 = [np.zeros(2), float("nan")]
        assert await b.recv(tag="z", out=out2) is out2  # (a NaN is the NaN it was sent as)


_UCX = pytest.param(
    "ucx", marks=pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="ucxx is not installed")
)


@pytest.mark.parametrize("transport", ["tcp", "inproc", _UCX])
async def test_a_read_into_an_out_whose_elements_share_memory_is_refused(transport: str) -> None:
    """A strided out= is read into through a copy, and one whose elements share bytes (torch's
    expand, as_strided windows) kept the last row of each shared element: reading [[0, 1, 2],
    [3, 4, 5]] into zeros(1, 3).expand(2, 3) returned out= holding [[3, 4, 5], [3, 4, 5]]."""
    torch = pytest.importorskip("torch")
    async with connected_pair(transport) as (a, b), asyncio.timeout(20):
        src = np.arange(6, dtype=np.float32).reshape(2, 3)
        b.node.expose(src, name="t")
        h = await a.lookup("t")
        windows = np.lib.stride_tricks.as_strided(np.zeros(4, np.float32), (2, 3), (4, 4), writeable=True)
        for out in (torch.zeros(1, 3).expand(2, 3), windows):
            with pytest.raises(tensorwire.ShapeMismatchError, match="share memory"):
                await a.read(h, out=out)
            assert not np.asarray(out).any()  # nothing landed
        columns = np.zeros((3, 4), np.float32)[:, 1:3].T  # strided, each element its own: still read into
        assert (await a.read(h, out=columns)) is columns and np.array_equal(columns, src)


@pytest.mark.parametrize("transport", ["tcp", "inproc", _UCX])
async def test_a_recv_or_read_into_a_torch_tensor_tells_autograd(transport: str) -> None:
    """Bytes received into a torch tensor bypassed its version counter, so a backward pass that
    had saved it used the new values in silence (x.grad came out [5, 5, 5] where w was 1 in the
    forward pass); torch's own in-place writes, even under no_grad, make that backward raise."""
    torch = pytest.importorskip("torch")
    async with connected_pair(transport) as (a, b), asyncio.timeout(20):
        b.node.expose(np.full(3, 7.0, np.float32), name="w")
        h = await a.lookup("w")
        for land in ("recv", "read"):
            w = torch.ones(3, requires_grad=True)
            x = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
            y = (w * x).sum()  # saves w for x's gradient
            if land == "recv":
                await b.send(torch.full((3,), 5.0), tag="w")
                await a.recv(tag="w", out=w)
            else:
                await a.read(h, out=w)
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                y.backward()
        with torch.inference_mode():  # no counter to tell: received into all the same
            inf = torch.zeros(3)
        await b.send(torch.full((3,), 5.0), tag="w")
        assert (await a.recv(tag="w", out=inf)) is inf and inf.tolist() == [5.0, 5.0, 5.0]


@pytest.mark.parametrize("transport", ["tcp", "inproc"])
async def test_a_recv_into_out_returns_the_messages_nan_payload(transport: str) -> None:
    """Every NaN has the same hex(): a recv whose out= held a NaN where the message carried a NaN
    of another payload returned out='s NaN, not the bits the sender sent."""
    import struct

    sent = struct.unpack("<d", struct.pack("<Q", 0x7FF8DEADBEEF0001))[0]
    async with connected_pair(transport) as (a, b), asyncio.timeout(20):
        await a.send({"loss": sent, "x": np.ones(2)}, tag="n")
        got = await b.recv(tag="n", out={"loss": float("nan"), "x": np.zeros(2)})
        assert struct.pack("<d", got["loss"]) == struct.pack("<d", sent)


@pytest.mark.parametrize("transport", ["tcp", "inproc"])
async def test_values_arrive_as_their_plain_types_as_the_readme_says(transport: str) -> None:
    """The README's list of conversions: a container subclass arrives as its base container with
    its items (a dict's keys in order), a numpy scalar as a 0-d array of its dtype, a Parameter
    as a plain tensor (np.matrix: the conformance suite)."""
    import collections

    pair = collections.namedtuple("pair", "a b")
    sent: list[tuple[Any, type, Any]] = [
        (pair(np.arange(2), 3), tuple, None),
        (collections.OrderedDict([("z", 1), ("a", np.ones(1))]), dict, ["z", "a"]),
        (np.float32(2.5), np.ndarray, np.dtype(np.float32)),
        (np.int16(-3), np.ndarray, np.dtype(np.int16)),
    ]
    if importlib.util.find_spec("torch") is not None:
        import torch

        sent += [(torch.Size([2, 3]), tuple, None), (torch.nn.Parameter(torch.ones(2)), torch.Tensor, None)]
    async with connected_pair(transport) as (a, b), asyncio.timeout(30):
        for obj, kind, detail in sent:
            await a.send(obj, tag="plain")
            got = await b.recv(tag="plain")
            assert type(got) is kind, (type(obj), type(got))
            if kind is dict:
                assert list(got) == detail
            elif kind is np.ndarray:
                assert got.dtype == detail and np.array_equal(got, np.asarray(obj))
            elif kind is tuple:
                assert all(np.array_equal(x, y) for x, y in zip(got, obj, strict=True))
            else:
                assert bool((got == obj).all())


@pytest.mark.parametrize("transport", ["tcp", "inproc"])
async def test_long_distinct_dict_keys_are_not_kept_after_their_sends(transport: str) -> None:
    """The sender keeps each str key's encoding for the next message with the same keys (a
    state dict's names), up to 65,536 keys whatever their length: a dict keyed by a distinct
    512 KiB text per send kept every key and its encoding, 100 sends 100 MiB, never let go."""
    import gc
    import tracemalloc
    import uuid

    prefix = uuid.uuid4().hex
    async with connected_pair(transport) as (a, b), asyncio.timeout(20):
        await a.send({"warm": np.ones(1)}, tag="k")
        await b.recv(tag="k")
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for i in range(100):
                await a.send({f"{prefix}{i}" + "x" * (512 << 10): np.ones(1)}, tag="k")
                await b.recv(tag="k")
            gc.collect()
            kept = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
    assert kept < 16 << 20, f"{kept / 2**20:.0f} MiB kept after the sends"


def test_long_specs_a_peer_sends_are_not_kept_after_their_messages() -> None:
    """A receiver keeps each spec it checked, by its bytes, for the next header that repeats it
    (8,192 of them), whatever their length: a peer naming a distinct long framework in each
    message's spec (the receiver takes any name) made it keep every spec twice over (its bytes
    and its Spec), 96 messages of a 256 KiB name 48 MiB, never let go."""
    import gc
    import tracemalloc
    import uuid

    from tensorwire.control._pb import wire_pb2

    prefix = uuid.uuid4().hex
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(96):
            header = wire_pb2.MessageHeader()
            header.tensors.add(dtype="float32", shape=[1], nbytes=4, framework=f"{prefix}{i}" + "x" * (256 << 10))
            header.tree.tensor = 0
            _, specs = decode_header(header.SerializeToString(), max_message_bytes=1 << 20)
            assert specs[0].shape == (1,)
            del header, specs
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert kept < 16 << 20, f"{kept / 2**20:.0f} MiB kept after the messages"


@pytest.mark.parametrize("transport", ["tcp", "inproc"])
async def test_a_result_that_does_not_fit_out_is_named_by_the_places_of_the_callers_out(transport: str) -> None:
    """A call's result lands in ``_out`` through a recv into ``(RESULT, _out)``, and the misfit
    was named by the place in that wrapper: ``_out=[x]`` for a dict result said "out=[1] is a
    list where the message has a dict", a place the caller's ``_out`` does not have."""
    async with connected_pair(transport) as (a, b), asyncio.timeout(20):

        @b.node.method("kv")
        async def kv() -> dict[str, Any]:
            return {"k": np.ones(2), "v": np.zeros(2)}

        misfits = [
            ([np.empty(2)], "_out= is a list where the message has a dict"),
            ({"v": np.empty(2), "k": np.empty(2)}, "_out= has the keys ['v', 'k'] where the message has ['k', 'v']"),
            ({"k": np.empty(2), "v": [np.empty(2)]}, "_out=['v'] is a list where the message has a tensor"),
        ]
        for out, said in misfits:
            with pytest.raises(tensorwire.ShapeMismatchError) as info:
                await a.call("kv", _out=out)
            assert f"(it was dropped): {said}" in str(info.value), str(info.value)
        got = await a.call("kv", _out={"k": np.empty(2), "v": np.empty(2)})
        assert np.array_equal(got["k"], np.ones(2))


def test_a_numpy_bool_key_is_refused_as_numpys_not_as_bool() -> None:
    """A numpy scalar as a dict key is refused (it travels as a tensor), by its type's name:
    np.True_'s is "bool", so the refusal read "dict key of type bool is not supported", where
    Python's bools are keys a message carries."""
    with pytest.raises(tensorwire.UnsupportedTensorError) as info:
        prepare({np.True_: 1})
    said = str(info.value)
    assert "numpy.bool" in said and "bool(k)" in said and "None, bool, int, float, str or bytes" in said, said
    assert prepare({True: 1}).specs == []
