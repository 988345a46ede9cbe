"""Messages of many leaves: the header written by hand as protobuf writes it, planned and rebuilt
at the receiver, and a large pytree flattened off the event loop after its containers are copied
at the call."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import importlib.util
import math
import random
import sys
import threading
from collections.abc import Iterator
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np
import pytest
from _lines import counting_lines

import tensorwire
from tensorwire.control._pb import wire_pb2
from tensorwire.tensors import _message, _offload, byte_view, decode_header, prepare, prepare_off_loop, rebuild
from tensorwire.testing import connected_pair

pytestmark = pytest.mark.timeout(60)

LARGE = 2048  # tensors: more than a message flattens on the loop (``_message.ON_LOOP_LEAVES``)

HAVE_TORCH = importlib.util.find_spec("torch") is not None


class _Color(enum.IntEnum):
    RED = 3


class _Pair(NamedTuple):
    a: Any
    b: Any


class _Bytes(bytes):
    def __len__(self) -> int:  # (what it says of itself is not what it holds)
        return 99


def _scalar(r: random.Random) -> Any:
    return r.choice(
        [None, True, False, r.randrange(-(2**63), 2**63), 2**64 + r.randrange(9), -(10**30), r.random() * 1e300,
         float("nan"), -0.0, "é" * r.randrange(70), b"\x00\xff" * r.randrange(70), _Color.RED, np.str_("s"),
         _Bytes(b"abc")]
    )  # fmt: skip


def _tensor(r: random.Random) -> Any:
    dtype = r.choice([np.float32, np.int8, np.uint64, np.bool_, np.complex64, ml_dtypes.bfloat16, np.float16])
    return r.choice(
        [
            np.zeros(r.randrange(5), dtype),
            np.arange(24, dtype=np.int64).reshape(2, 3, 4)[:, ::2],  # packed
            np.ones((1, 3), np.float32)[::-1],  # C order, with a negative stride in a dimension of 1
            np.zeros((0, 5), np.int32),
            np.float64(2.5),
            np.ones((2, 200), dtype),  # a stride of more than one varint byte
        ]
    )


def _tree(r: random.Random, depth: int = 0) -> Any:
    kind = r.randrange(10) if depth < 5 else 0
    if kind <= 1:
        return _scalar(r)
    if kind <= 3:
        return _tensor(r)
    width = 160 if depth == 0 else 5
    if kind == 4:
        return [_tree(r, depth + 1) for _ in range(r.randrange(width))]
    if kind == 5:
        return tuple(_tree(r, depth + 1) for _ in range(r.randrange(5)))
    if kind == 6:
        return _Pair(_tree(r, depth + 1), _tree(r, depth + 1))
    if kind == 7:
        return collections.OrderedDict((r.choice("abc"), _tree(r, depth + 1)) for _ in range(3))
    keys = [f"k{r.randrange(200)}", r.randrange(-5, 5), r.random(), True, None, b"b", 2**80, "ü"]
    return {r.choice(keys): _tree(r, depth + 1) for _ in range(r.randrange(width))}


def _same(got: Any, want: Any) -> bool:
    """The value a receiver should get for ``want``: containers as their wire kind (a NamedTuple
    is a tuple, an OrderedDict a dict), numpy scalars as 0-d arrays, scalars of the same type."""
    if isinstance(want, dict):
        return (
            type(got) is dict
            and len(got) == len(want)
            and all(
                _same(gk, wk) and _same(gv, wv) for (gk, gv), (wk, wv) in zip(got.items(), want.items(), strict=True)
            )
        )
    if isinstance(want, (list, tuple)):
        kind = tuple if isinstance(want, tuple) else list
        return type(got) is kind and len(got) == len(want) and all(map(_same, got, want))
    if isinstance(want, (np.ndarray, np.generic)) and not isinstance(want, (str, bytes)):
        want = np.asarray(want)
        return type(got) is np.ndarray and _described(got) == _described(want)
    if HAVE_TORCH and "torch" in sys.modules and isinstance(want, sys.modules["torch"].Tensor):
        return isinstance(got, type(want)) and bool((got == want).all())
    if isinstance(want, float) and math.isnan(want):
        return type(got) is float and math.isnan(got)
    kind = {_Color: int, np.str_: str, _Bytes: bytes}.get(type(want), type(want))
    return type(got) is kind and bool(got == want)


def _described(arr: np.ndarray) -> tuple[Any, ...]:
    return arr.dtype, arr.shape, arr.tobytes()


def test_headers_are_what_protobuf_writes_and_read_back_as_sent() -> None:
    """Headers are written by hand, field by field: each must be the bytes protobuf itself
    writes for that MessageHeader (parsed and written again, nothing changes), and decode to the
    pytree that was sent."""
    r = random.Random(7)
    for _ in range(150):
        obj = _tree(r)
        msg = prepare(obj)
        header = msg.header
        assert wire_pb2.MessageHeader.FromString(header).SerializeToString() == header
        assert msg.tree.SerializeToString() == wire_pb2.MessageHeader.FromString(header).tree.SerializeToString()
        tree, specs = decode_header(header, max_message_bytes=1 << 40)
        assert _same(rebuild(tree, specs, list(msg.arrays)), obj)


def test_a_header_protobuf_writes_otherwise_is_read_as_protobuf_reads_it() -> None:
    """Headers are cut into specs and tree as we write them; any other encoding protobuf reads
    (fields in another order, the tree written twice and merged, an unknown field) is read by
    protobuf whole, with the same result."""
    obj = {"a": np.zeros(3), "b": [1, "x", None, (np.ones(2, np.int8), 2**70)]}
    header = prepare(obj).header
    parsed = wire_pb2.MessageHeader.FromString(header)
    tree = parsed.tree.SerializeToString()
    specs = b"".join(b"\x0a" + bytes([s.ByteSize()]) + s.SerializeToString() for s in parsed.tensors)
    want = decode_header(header, max_message_bytes=1 << 20)
    for other in (b"\x12" + bytes([len(tree)]) + tree + specs, header + b"\x18\x05"):
        assert decode_header(other, max_message_bytes=1 << 20) == want
    one = prepare({"a": np.zeros(3)}).header
    twice = one + b"\x12\x02\x08\x00"  # (a second tree, merged into the first: a tensor now)
    merged, _ = decode_header(twice, max_message_bytes=1 << 20)
    assert merged == wire_pb2.MessageHeader.FromString(twice).tree and merged.HasField("tensor")
    with pytest.raises(tensorwire.ProtocolError, match="places 1 of its 2 tensors"):  # (the other's bytes unseen)
        decode_header(header + b"\x12\x02\x08\x00", max_message_bytes=1 << 20)
    with pytest.raises(tensorwire.ProtocolError, match="tree refers to tensor 7 of 2"):
        decode_header(specs + b"\x12\x02\x08\x07", max_message_bytes=1 << 20)
    with pytest.raises(tensorwire.ProtocolError, match="undecodable"):
        decode_header(header[:-1], max_message_bytes=1 << 20)


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_a_message_of_many_tensors_runs_few_lines_of_tensorwire_per_tensor(kind: str) -> None:
    """Flattening, encoding, decoding and rebuilding a dict of small tensors took 155 lines of
    tensorwire per numpy tensor and 183 per torch one (13-18 us each way: a send or recv of
    4,000 held the event loop for more than 50 ms); 72 and 95 now. Counted in lines, not seconds."""
    if kind == "torch":
        torch = pytest.importorskip("torch")
        make: Any = lambda: torch.ones(4, 4)
    else:
        make = lambda: np.ones((4, 4), np.float32)

    def lines(n: int) -> int:
        obj = {f"{n}.layer{i}.weight": make() for i in range(n)}  # (keys new to every cache)
        with counting_lines() as ran:
            msg = prepare(obj)
            tree, specs = decode_header(msg.header, max_message_bytes=1 << 40)
            got = rebuild(tree, specs, [s.allocate() for s in specs])
        assert list(got) == list(obj)
        return ran.count

    lines(10)  # (the specs of (4, 4) tensors made)
    per_tensor = (lines(2000) - lines(1000)) / 1000
    assert per_tensor < (100 if kind == "numpy" else 125), f"{per_tensor} lines of tensorwire per {kind} tensor"


def _many(n: int, r: random.Random, *, packing: bool = True) -> dict[str, Any]:
    """A pytree of n leaves of every kind a large message may hold (``packing``: and a strided
    one whose packing copy goes to a thread)."""
    torch = sys.modules.get("torch") if HAVE_TORCH else None
    out: dict[str, Any] = {}
    for i in range(n):
        k = i % 9
        if k == 0:
            out[f"w{i}"] = np.full((2, 3), i, np.float32)
        elif k == 1 and torch is not None:
            out[f"t{i}"] = torch.full((3,), float(i), dtype=torch.bfloat16 if i % 2 else torch.float32)
        elif k == 2:
            out[f"s{i}"] = np.arange(12, dtype=np.int16).reshape(3, 4)[:, ::2] + i  # packed
        elif k == 3:
            out[f"n{i}"] = [None, i, f"v{i}", b"b", 1.5, True]
        elif k == 4:
            out[f"d{i}"] = collections.OrderedDict(a=np.float64(i), b=(np.zeros(0, np.int8), _Pair(i, "x")))
        elif k == 5:
            out[f"g{i}"] = np.int32(i)
        elif k == 6:
            out[f"e{i}"] = np.ones((2, 2), ml_dtypes.bfloat16)
        else:
            out[f"x{i}"] = r.random()
    if packing:
        out["big"] = np.arange(2 * (1 << 18), dtype=np.float32)[::2]  # 1 MiB packed, in a copy thread
    return out


async def test_a_large_message_is_flattened_while_the_loop_turns() -> None:
    """A message of more than ``ON_LOOP_LEAVES`` host tensors is copied (its containers) at the
    call and flattened in a copy thread: at a few microseconds a tensor, flattening 10,000 on
    the loop held it for tens of milliseconds. The message is the one ``prepare`` makes."""
    assert getattr(_message, "ON_LOOP_LEAVES", 0) < LARGE
    obj = _many(LARGE, random.Random(1), packing=False)  # (no copy for a thread but the flattening)
    turns = 0

    async def tick() -> None:
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    ticker = asyncio.ensure_future(tick())
    await asyncio.sleep(0)
    try:
        preparing = prepare_off_loop(obj)
        before = turns
        got = await preparing
        assert turns > before, "the loop did not turn while the message was flattened"
    finally:
        ticker.cancel()
    want = prepare(obj)
    assert got.header == want.header and got.packed == want.packed and got.nbytes == want.nbytes
    assert [bytes(s) for s in got.segments()] == [bytes(s) for s in want.segments()]


def test_a_large_message_of_other_leaves_is_flattened_at_the_call() -> None:
    """A leaf that is no host array or tensor (a buffer a caller may resize), or an object no
    message holds, past the first ``ON_LOOP_LEAVES``: the message is flattened at the call, as
    any other, and what it refuses is refused there."""
    leaves: list[Any] = [np.ones(2) for _ in range(LARGE)]
    assert prepare_off_loop([*leaves, bytearray(b"xy")]).ready is not None
    with pytest.raises(tensorwire.UnsupportedTensorError, match="cannot send object"):
        prepare_off_loop([*leaves, object()])
    assert prepare_off_loop([*leaves, "s", 3, None]).ready is None


@pytest.mark.parametrize("n", [20, LARGE])
@pytest.mark.parametrize("transport", ["tcp", "inproc"])
async def test_a_message_arrives_as_it_was_at_the_call(transport: str, n: int) -> None:
    """The caller may change its dicts and lists once the send has started, and reshape its
    numpy arrays in place: the receiver gets the pytree as it was at the call, large or not.
    A message with a packing copy for a thread took its other tensors' shapes only once that
    copy was done, so a tensor reshaped meanwhile travelled with its new shape. Every leaf kind,
    thousands of them, round trip."""
    obj = _many(n, random.Random(3))
    want = _many(n, random.Random(3))
    async with connected_pair(transport) as (a, b), asyncio.timeout(30):
        recv = asyncio.ensure_future(b.recv(tag="m"))
        sending = asyncio.ensure_future(a.send(obj, tag="m"))
        await asyncio.sleep(0)  # (the send has started: the message is its own now)
        obj.pop("w0")
        obj["new"] = np.zeros(3)
        obj["n3"].append("more")
        obj["d4"]["a"] = "changed"
        obj["w9"].shape = (3, 2)
        obj["e6"].shape = (4,)
        await sending
        got = await recv
        assert _same(got, want)


@contextlib.contextmanager
def _copy_threads_held() -> Iterator[None]:
    """Every copy thread of the process busy until the block ends: what is handed to one (a
    large message to flatten) waits for the block's end."""
    gate, running = threading.Event(), threading.Semaphore(0)

    def hold() -> None:
        running.release()
        gate.wait(30)

    held = [_offload._executor().submit(hold) for _ in range(_offload._WORKERS)]
    try:
        for _ in held:
            assert running.acquire(timeout=10), "a copy thread did not start"
        yield
    finally:
        gate.set()
        for f in held:
            f.result(10)


@pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed")
@pytest.mark.parametrize("change", ["resize_", "set_", ".data ="])
@pytest.mark.parametrize("n", [20, LARGE])
@pytest.mark.parametrize("transport", ["tcp", "inproc"])
async def test_a_torch_tensor_changed_in_place_after_the_call_travels_as_it_was(
    transport: str, n: int, change: str
) -> None:
    """A CPU torch tensor given a new shape, memory or dtype in place (``resize_``, ``set_``,
    ``.data =``) once the send has started arrives as it was at the call, large message or not.
    A message of more than ``ON_LOOP_LEAVES`` tensors kept its torch tensors themselves for the
    copy thread that flattens it: a change made before that thread met the tensor (here, the
    copy threads held busy meanwhile) travelled: (7,) with four bytes of whatever followed,
    (5,) zeros, (2,) float64."""
    import torch

    obj = {f"t{i}": torch.full((3,), float(i)) for i in range(n)}
    async with connected_pair(transport) as (a, b), asyncio.timeout(30):
        recv = asyncio.ensure_future(b.recv(tag="m"))
        with _copy_threads_held():
            sending = asyncio.ensure_future(a.send(obj, tag="m"))
            await asyncio.sleep(0)  # (the send was called: the message is its own now)
            t = obj[f"t{n - 1}"]  # (past the leaves met at the call, as the thread's copy)
            if change == "resize_":
                # torch refuses where numpy shares the memory: a tensor of a message flattened at the call
                with contextlib.suppress(RuntimeError) if n <= _message.ON_LOOP_LEAVES else contextlib.nullcontext():
                    t.resize_(7)
            elif change == "set_":
                t.set_(torch.zeros(5))
            else:
                t.data = torch.zeros(2, dtype=torch.float64)
        await sending
        got = await recv
    assert len(got) == n
    for i in (0, n - 1):
        g = got[f"t{i}"]
        assert isinstance(g, torch.Tensor) and g.dtype is torch.float32 and tuple(g.shape) == (3,), (i, g)
        assert torch.equal(g, torch.full((3,), float(i))), (i, g)


@pytest.mark.parametrize("transport", ["tcp", "inproc"])
async def test_a_strided_array_packed_in_a_thread_travels_with_its_shape_at_the_call(transport: str) -> None:
    """A strided numpy array of ``OFF_LOOP_BYTES`` or more is packed in a copy thread once the
    send awaits that copy. The thread packed the caller's own array object, so an array the
    caller reshaped in place meanwhile (``x.shape = ...``, which numpy allows where no copy is
    needed) travelled with its new shape: (1024, 2, 512) where the send was called with
    (2048, 512). The other leaves of such a message were already kept as they were."""
    base = np.arange(2048 * 1024, dtype=np.float64).reshape(2048, 1024)
    x = base[:, ::2]  # 4 MiB, strided: packed in a thread
    want = x.copy()
    async with connected_pair(transport) as (a, b), asyncio.timeout(30):
        recv = asyncio.ensure_future(b.recv(tag="m"))
        with _copy_threads_held():
            sending = asyncio.ensure_future(a.send({"x": x, "flat": np.ones(2)}, tag="m"))
            await asyncio.sleep(0)  # (the send was called: the message is its own now)
            x.shape = (1024, 2, 512)
        await sending
        got = await recv
    assert got["x"].shape == want.shape and np.array_equal(got["x"], want)


@pytest.mark.parametrize("transport", ["tcp", "inproc"])
async def test_a_large_message_with_a_key_no_message_has_fails_its_send_alone(transport: str) -> None:
    """Found in the copy thread, a bad dict key fails that send only: the channel goes on, and
    a send made after it on the same tag still arrives."""
    n = LARGE
    bad = {**{f"k{i}": np.ones(2) for i in range(n)}, (1, 2): np.ones(2)}
    async with connected_pair(transport) as (a, b), asyncio.timeout(30):
        with pytest.raises(tensorwire.UnsupportedTensorError, match="dict key of type tuple"):
            await a.send(bad, tag="k")
        await a.send({f"k{i}": np.full(2, i) for i in range(n)}, tag="k")
        got = await b.recv(tag="k")
        assert len(got) == n and np.array_equal(got[f"k{n - 1}"], np.full(2, n - 1))


def test_byte_views_are_the_arrays_bytes() -> None:
    """numpy's own dtypes through the buffer protocol, the others (ml_dtypes, empty) as before:
    flat, the array's own bytes, writable where the array is."""
    ro = np.arange(4.0)
    ro.flags.writeable = False
    grid = np.arange(4).reshape(2, 2).view(np.recarray)  # (a subclass whose reshape may keep dimensions)
    for arr in (np.arange(6, dtype=np.int16).reshape(2, 3), np.array(1.5), grid, np.ones(3, ml_dtypes.bfloat16),
                np.zeros((0, 3)), ro, np.ones(5, np.bool_)):  # fmt: skip
        view = byte_view(arr)
        assert view.ndim == 1 and view.format == "B" and bytes(view) == arr.tobytes()
        assert view.readonly == (not arr.flags.writeable)
