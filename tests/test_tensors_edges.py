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
