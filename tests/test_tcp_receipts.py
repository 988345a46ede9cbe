"""A tcp recv's receipt says ``direct`` only where the payload's bytes went straight into the
recv's memory: counted here apart, by the socket reads themselves, between two real nodes on
loopback."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import numpy as np
import pytest

import tensorwire
from tensorwire.transports.tcp import _sockio

pytestmark = pytest.mark.timeout(60)

KiB = 1024
# around the read-ahead threshold (64 KiB) and the header read's fill (16 KiB), then large ones
# (5 MiB goes in more than one DATA frame, each with its own header read)
SIZES = (16 * KiB, 64 * KiB - 1, 64 * KiB, 64 * KiB + 1, 70 * KiB, 80 * KiB, 96 * KiB, 128 * KiB, 256 * KiB)
SIZES += (1 << 20, 5 << 20)


class _Reads:
    """Bytes each ``recv_into`` of this process landed in a read-ahead buffer, or elsewhere."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.ahead = self.straight = 0
        plain = socket.socket.recv_into

        def recv_into(sock: socket.socket, buf: Any, *args: Any) -> int:
            n = plain(sock, buf, *args)
            obj = buf.obj if isinstance(buf, memoryview) else buf
            if isinstance(obj, bytearray) and len(obj) == _sockio._BUFSIZE:
                self.ahead += n
            else:
                self.straight += n
            return n

        monkeypatch.setattr(socket.socket, "recv_into", recv_into)


async def test_a_tcp_receipt_says_direct_only_where_the_payload_went_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """A recv posted before its message (with ``out=``, or arrays of its own): ``direct`` must
    say whether most of the payload went by ``recv_into`` straight into the recv's memory.
    Before, tcp guessed by size (64 KiB or more: direct), and a 64 KiB message said direct though
    all of it went through the read-ahead buffer (the header read takes the first 16 KiB along,
    the rest is under 64 KiB: no byte went straight in); so did the 64-80 KiB ones."""
    reads = _Reads(monkeypatch)
    async with (
        tensorwire.start("127.0.0.1:0", transports=("tcp",)) as na,
        tensorwire.start("127.0.0.1:0", transports=("tcp",)) as nb,
    ):
        a = await asyncio.wait_for(na.connect(nb.address), 20)
        b = await asyncio.wait_for(anext(aiter(nb)), 20)
        seen = []
        for n in SIZES:
            for with_out in (True, False):
                src = np.full(n, n % 251, np.uint8)
                out = np.empty(n, np.uint8) if with_out else None
                recv = asyncio.ensure_future(b.recv_with_receipt(tag=7, out=out))
                for _ in range(3):  # posted before the message comes
                    await asyncio.sleep(0)
                reads.ahead = reads.straight = 0
                await asyncio.wait_for(a.send(src, tag=7), 20)
                got, receipt = await asyncio.wait_for(recv, 20)
                assert np.array_equal(got, src) and (out is None or got is out)
                straight = min(reads.straight, n)  # (a credit frame the other way lands ahead)
                assert not receipt.staged and receipt.protocol in ("eager", "rendezvous"), (n, receipt)
                assert receipt.direct is (2 * straight > n), (n, with_out, straight, receipt)
                seen.append((n, receipt.direct))
        assert all(direct for n, direct in seen if n >= 1 << 20), seen  # large ones still say direct
