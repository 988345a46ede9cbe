"""The verbs transport where it cannot run (this host: no RDMA device, no pyverbs) and its pure
parts: the honest reason in probe() and peer.path, the wire format, and the GID choice over a
sysfs tree laid out as the kernel lays it out. Its behaviour on a real verbs stack is tested in
the Soft-RoCE guest (tests/verbs, run by tests/test_verbs_vm.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import tensorwire
from tensorwire.errors import ProtocolError
from tensorwire.transports import probe_all
from tensorwire.transports.verbs import VerbsTransport, choose_gid, choose_port
from tensorwire.transports.verbs._wire import Offer, QpInfo

pytestmark = pytest.mark.timeout(30)
MAPPED = "0000:0000:0000:0000:0000:ffff"


def _port(root: Path, dev: str, port: int, gids: list[tuple[str, str]], link: str = "Ethernet") -> None:
    base = root / dev / "ports" / str(port)
    (base / "gids").mkdir(parents=True)
    (base / "gid_attrs" / "types").mkdir(parents=True)
    (base / "gid_attrs" / "ndevs").mkdir(parents=True)
    (base / "state").write_text("4: ACTIVE\n")
    (base / "link_layer").write_text(link + "\n")
    for i, (gid, typ) in enumerate(gids):
        (base / "gids" / str(i)).write_text(gid + "\n")
        (base / "gid_attrs" / "types" / str(i)).write_text(typ + "\n")
        (base / "gid_attrs" / "ndevs" / str(i)).write_text("eth0\n")
    for i in range(len(gids), len(gids) + 2):  # unused entries are zero, as in the kernel
        (base / "gids" / str(i)).write_text("0000:0000:0000:0000:0000:0000:0000:0000\n")


def _ip(a: int, b: int, c: int, d: int) -> str:
    return f"{MAPPED}:{a:02x}{b:02x}:{c:02x}{d:02x}"


def test_probe_says_why_not_here() -> None:
    if VerbsTransport.probe() is not None:
        pytest.skip("this machine has a usable RDMA port")
    usable, unusable = probe_all(["verbs", "tcp"])
    assert "verbs" not in usable and "tcp" in usable
    reason = unusable["verbs"]
    assert reason == VerbsTransport.unavailable_reason()
    assert "pyverbs is not installed" in reason or "RDMA" in reason, reason


async def test_path_reports_why_verbs_was_passed_over() -> None:
    if VerbsTransport.probe() is not None:
        pytest.skip("this machine has a usable RDMA port")
    async with (
        tensorwire.start("127.0.0.1:0", transports=("verbs", "tcp")) as na,
        tensorwire.start("127.0.0.1:0", transports=("verbs", "tcp")) as nb,
    ):
        a = await na.connect(nb.address)
        assert a.path.transport == "tcp"
        why = dict(a.path.passed_over)["verbs"]
        assert VerbsTransport.unavailable_reason() in why, why
        with pytest.raises(tensorwire.NegotiationError, match="verbs"):
            await na.connect(nb.address, require="rdma")
        await a.send(np.arange(3))
        b = await nb.accept()
        assert np.array_equal(await b.recv(), np.arange(3))


def test_gid_choice_prefers_roce_v2_ipv4_mapped(tmp_path: Path) -> None:
    _port(
        tmp_path,
        "rxe0",
        1,
        [
            ("fe80:0000:0000:0000:5054:00ff:fe12:3456", "RoCE v2"),  # link-local: index 0, not routable
            (_ip(10, 0, 0, 1), "IB/RoCE v1"),
            (_ip(10, 0, 0, 1), "RoCE v2"),
            (_ip(192, 168, 1, 5), "RoCE v2"),
        ],
    )
    assert choose_gid(str(tmp_path), "rxe0", 1)[0] == 2  # first v2 IPv4-mapped, not index 0
    assert choose_gid(str(tmp_path), "rxe0", 1, "192.168.1.5")[0] == 3  # the node's own address
    assert choose_gid(str(tmp_path), "rxe0", 1, "10.9.9.9")[0] == 2
    port = choose_port("192.168.1.5", root=str(tmp_path))
    assert not isinstance(port, str)
    assert (port.device, port.gid_index, port.gid_type) == ("rxe0", 3, "RoCE v2")
    assert port.gid == bytes(10) + b"\xff\xff" + bytes([192, 168, 1, 5])


def test_gid_choice_without_v2_or_on_infiniband(tmp_path: Path) -> None:
    _port(tmp_path, "roce0", 1, [(_ip(10, 0, 0, 1), "IB/RoCE v1")])
    assert choose_gid(str(tmp_path), "roce0", 1) is None
    assert "no RoCE v2 GID" in str(choose_port(root=str(tmp_path)))
    _port(tmp_path, "mlx5_0", 1, [("fe80:0000:0000:0000:0002:c903:0001:0002", "IB/RoCE v1")], link="InfiniBand")
    port = choose_port(root=str(tmp_path))
    assert not isinstance(port, str) and port.device == "mlx5_0" and port.gid_index == 0 and not port.roce
    assert "no RDMA device" in str(choose_port(root=str(tmp_path / "none")))
    assert "no RDMA port" in str(choose_port(root=str(tmp_path), want="mlx5_0:2"))


def test_a_wildcard_bootstrap_host_is_dialled_at_the_host_whose_control_plane_answered() -> None:
    from tensorwire.transports import Capabilities, Limits, TransportContext

    transport = VerbsTransport(TransportContext("n", "127.0.0.1", Limits()), Capabilities())
    gid = bytes(10) + b"\xff\xff" + bytes([10, 0, 2, 15])
    for wildcard in ("0.0.0.0", "::"):
        offer = Offer(1, True, 1, 0, 3, gid, wildcard, 40001)
        assert Offer.unpack(transport.dial_address(offer.pack(), "10.0.2.15")).host == "10.0.2.15"
        assert Offer.unpack(transport.dial_address(offer.pack(), "[fd00::5]")).host == "fd00::5"
    named = Offer(1, True, 1, 0, 3, gid, "10.0.2.16", 40001).pack()
    assert transport.dial_address(named, "10.0.2.15") == named
    assert transport.dial_address(b"garbage", "10.0.2.15") == b"garbage"  # connect says what is wrong


def test_offer_and_qp_info_round_trip_and_reject_garbage() -> None:
    gid = bytes(10) + b"\xff\xff" + bytes([10, 0, 2, 15])
    offer = Offer(1, True, 1, 0, 3, gid, "10.0.2.15", 40001)
    assert Offer.unpack(offer.pack()) == offer
    for bad in (b"", b"TWU1" + bytes(40), offer.pack()[:-3], offer.pack()[:20]):
        with pytest.raises(ProtocolError):
            Offer.unpack(bad)
    info = QpInfo(0x1234, 0xABCDE, 1, 0, 3, 1, 64, 16384, gid)
    assert QpInfo.unpack(info.pack()) == info
    with pytest.raises(ProtocolError):
        QpInfo.unpack(QpInfo(0, 1, 1, 0, 3, 1, 64, 16384, gid).pack())  # qpn 0
    with pytest.raises(ProtocolError):
        QpInfo.unpack(QpInfo(5, 1, 1, 0, 3, 1, 1, 16384, gid).pack())  # a ring of one slot
