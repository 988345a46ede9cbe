"""What a one-sided operation's receipt says about the owner's side of it, checked against what
the owner did: real nodes on loopback, device memory played by a host engine (it goes every way
CUDA memory does), and the owner's own counts in ``tensorwire.metrics``."""

from __future__ import annotations

import importlib.util
from typing import Any

import numpy as np
import pytest

from tensorwire.memory import HostEngine
from tensorwire.metrics import snapshot
from tensorwire.tensors._device import EngineArray
from tensorwire.testing import connected_pair
from tensorwire.testing._conformance import _counted, _labels

pytestmark = pytest.mark.timeout(60)
TRANSPORTS = ["tcp", "inproc"] + (["ucx"] if importlib.util.find_spec("ucxx") is not None else [])


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_an_owner_served_device_exposure_says_staged(transport: str) -> None:
    """Device memory that its owner serves (no transport here registers host-engine memory, as
    none registers CUDA memory without cuda lanes) leaves or enters it through host staging
    buffers of the owner's, as the README says ("staged=True"). A read of it into host memory,
    and a write into it from host memory, said direct and not staged: the receipt told only the
    requester's side. A host exposure, the same way, stays direct."""
    engine = HostEngine()
    try:
        async with connected_pair(transport) as (a, b):
            kv = np.arange(64 * 256, dtype=np.float32).reshape(64, 256)
            a.node.expose(EngineArray(engine, kv), name="dkv")
            # (256 KiB: tcp reads a 64 KiB payload through its read-ahead buffer, not direct)
            a.node.expose(np.tile(kv, (4, 1)), name="hkv")
            hd, hh = await b.lookup("dkv"), await b.lookup("hkv")
            assert hd.memory == "host-engine" and not hd.direct, hd
            said = {}
            _, said["read into out="] = await b.read_with_receipt(hd, out=np.empty_like(kv))
            got, said["read"] = await b.read_with_receipt(hd[8:40])
            assert np.array_equal(got, kv[8:40])
            _, said["batch"] = await b.read_many_with_receipt([hh[0:32], hd[40:64]])
            before = snapshot()
            said["write"] = await b.write(hd[0:32], np.full((32, 256), 5, np.float32))
            owner = _counted(before, snapshot(), "recv")
            assert (kv[:32] == 5).all() and (kv[32:] != 5).all()
            for what, r in said.items():
                if what == "batch" and hh.direct:  # a mixed batch over ucx: its served part (test below)
                    assert r.protocol == "mixed", r
                    r = r.parts[1]
                assert r.protocol == "owner-assisted" and r.staged and not r.direct and r.memory == "host", (what, r)
            # the owner counted its own recv of the write's bytes as staged too
            assert any(staged and n == 32 * 256 * 4 for (_, _, _, _, staged, _), (_, n) in owner.items()), owner
            _, host = await b.read_with_receipt(hh, out=np.empty((256, 256), np.float32))
            wrote = await b.write(hh, np.tile(kv, (4, 1)))
            for r in (host, wrote):
                assert not r.staged and (r.direct or r.protocol != "owner-assisted"), r
    finally:
        engine.close()


@pytest.mark.skipif("ucx" not in TRANSPORTS, reason="ucxx is not installed")
async def test_a_batch_that_moves_both_ways_says_how_much_went_each_way() -> None:
    """Over ucx a host exposure moves one-sided and a device one is served by its owner (ucx
    registers no host-engine memory, as it registers no CUDA memory without cuda lanes). A
    batch of both, read or written, said "owner-assisted" for all of it, and the metrics counted
    the one-sided bytes as the owner's CPU's. It says "mixed" now, its parts say how each way
    went (the one-sided part first) and with how many bytes, and the metrics count each part
    under its own protocol. A batch that moves one way has no parts."""
    engine = HostEngine()
    try:
        async with connected_pair("ucx") as (a, b):
            kv = np.arange(64 * 256, dtype=np.float32).reshape(64, 256)
            dkv = kv + 0.5
            a.node.expose(EngineArray(engine, dkv), name="dkv")
            a.node.expose(kv, name="hkv")
            hd, hh = await b.lookup("dkv"), await b.lookup("hkv")
            assert hh.direct and not hd.direct, (hh, hd)
            one = "one-sided" if b.channel.one_sided_direct else "one-sided-emulated"
            row = 256 * 4
            before = snapshot()
            got, r = await b.read_many_with_receipt([hh[0:32], hd[40:64], hh[32:40]])
            counted = _counted(before, snapshot(), "read")
            assert np.array_equal(np.concatenate([got[0], got[2]]), kv[:40]) and np.array_equal(got[1], dkv[40:64])
            assert r.protocol == "mixed" and r.nbytes == 64 * row and r.staged and not r.direct, r
            assert [(p.protocol, p.nbytes) for p in r.parts] == [(one, 40 * row), ("owner-assisted", 24 * row)], r
            assert r.parts[0].direct and not r.parts[0].staged, r  # straight into the buffers allocated
            assert r.parts[1].staged and not r.parts[1].direct, r  # through the owner's staging buffers
            assert counted == {_labels(p, "one-sided"): (1, p.nbytes) for p in r.parts}, counted
            before = snapshot()
            w = await b.write_many([hh[0:8], hd[8:10]], [-kv[0:8], -dkv[8:10]])
            counted = _counted(before, snapshot(), "write")
            assert (kv[0:8] <= 0).all() and (dkv[8:10] < 0).all() and (kv[8:] > 0).all()
            assert w.protocol == "mixed" and [(p.protocol, p.nbytes) for p in w.parts] == [
                (one, 8 * row),
                ("owner-assisted", 2 * row),
            ], w
            assert w.parts[0].direct and w.parts[1].staged, w
            assert counted == {_labels(p, "one-sided"): (1, p.nbytes) for p in w.parts}, counted
            _, same = await b.read_many_with_receipt([hh[0:2], hh[4:5]])
            assert same.protocol == one and same.parts == (), same
            _, same = await b.read_many_with_receipt([hd[0:2], hd[4:5]])
            assert same.protocol == "owner-assisted" and same.parts == (), same
    finally:
        engine.close()


async def test_a_small_owner_served_write_over_tcp_says_what_the_owner_did() -> None:
    """The owner takes a tcp payload under 64 KiB through its channel's read-ahead buffer (a
    copy of tensorwire's: not direct, as the README says of such a payload at the receiver);
    the write's receipt said direct, which only its sender's side was, while the owner counted
    its recv of the same bytes as not direct. A large one lands in place: direct both ways."""
    async with connected_pair("tcp") as (a, b):
        kv = np.zeros((64, 1024), np.float32)
        a.node.expose(kv, name="kv")
        h = await b.lookup("kv")
        for rows, direct in ((h[3], False), (h, True)):
            src = np.full(rows.shape, 7, np.float32)
            before = snapshot()
            receipt = await b.write(rows, src)
            after = snapshot()
            owner = {k: v for k, v in _counted(before, after, "recv").items() if v[1] == src.nbytes}
            assert receipt.protocol == "owner-assisted" and receipt.direct is direct, receipt
            assert [k[3] for k in owner] == [direct], owner  # the owner's count says the same
            assert _counted(before, after, "write") == {
                ("one-sided", "tcp", "owner-assisted", direct, False, "host"): (1, src.nbytes)
            }
        assert (kv == 7).all()


@pytest.mark.parametrize("transport", ["tcp", "inproc"])
async def test_an_owner_served_read_lands_straight_in_its_buffer(transport: str) -> None:
    """The README: through the owner "the payload still moves straight between the exposed
    memory and your buffer". The reader posted its receive only once its request had gone, so
    over inproc the owner's reply to a small read (under 64 KiB) came first, waited in a buffer
    of tensorwire's and was copied into out= (the receipt said staged). Posted before the request
    goes, it lands in out= whatever the size."""
    async with connected_pair(transport) as (a, b):
        kv = np.arange(64 * 1024, dtype=np.float32).reshape(64, 1024)
        a.node.expose(kv, name="kv")
        h = await b.lookup("kv")
        for rows, want in ((h[3], kv[3]), (h[4:8], kv[4:8]), (h[0:32], kv[0:32])):
            out = np.empty(rows.shape, np.float32)
            for _ in range(3):
                got, receipt = await b.read_with_receipt(rows, out=out)
                assert got is out and np.array_equal(out, want)
                assert not receipt.staged, receipt
                # tcp reads a payload under 64 KiB through its read-ahead buffer (not direct)
                assert receipt.direct is (transport == "inproc" or out.nbytes >= 64 << 10), receipt


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("bit", ["conj", "neg"])
async def test_what_goes_from_a_torch_view_with_the_conj_or_neg_bit_says_packed(transport: str, bit: str) -> None:
    """Such a view has no memory that holds its values: its bytes go from a copy tensorwire
    resolved (torch's resolve_conj / resolve_neg), so every receipt of it says packed and not
    direct: a send, a call's arguments (inline and apart), a write and a batch write, owner-served
    or one-sided. They said packed=False and direct=True (a send over inproc, a write over ucx)."""
    torch = pytest.importorskip("torch")
    async with connected_pair(transport) as (a, b):

        @a.node.method("echo")
        async def echo(x: Any) -> Any:
            return x

        dtype = np.complex64 if bit == "conj" else np.float32
        x = np.zeros((2, 1 << 15), dtype)
        a.node.expose(x, name="x")
        h = await b.lookup("x")
        for n in (4, 1 << 15):  # inline or eager, and apart or rendezvous
            base = torch.arange(n, dtype=torch.float32) * (1 + 2j)
            src = base.conj() if bit == "conj" else base.conj().imag
            want = src.resolve_conj().resolve_neg().numpy()
            said = {"send": await b.send(src, tag="t")}
            assert np.array_equal(await a.recv(tag="t"), want)
            got, call = await b.call_with_receipt("echo", src)
            assert np.array_equal(got, want)
            said["call"] = call.args if call.args is not None else call.request
            said["write"] = await b.write(h[0][:n], src)
            said["write_many"] = await b.write_many([h[1][:n]], [src])
            assert np.array_equal(x[:, :n], np.stack([want, want]))
            for what, r in said.items():
                assert r.packed and not r.direct, (what, n, r)
