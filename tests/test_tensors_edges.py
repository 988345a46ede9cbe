"""Edges of the tensor adapter and message headers: what a sender accepts, a receiver must too."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import tensorwire
from tensorwire.tensors import decode_header, prepare
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
