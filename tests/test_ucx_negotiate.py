"""Negotiation around a transport whose lanes are all kernel TCP (UCX with UCX_TLS=tcp): it
gives way to tensorwire's tcp transport when both sides have it, and says so. No UCX needed."""

from tensorwire.control import Offer, choose
from tensorwire.control._convert import offer_from_pb, offer_to_pb
from tensorwire.transports import Capabilities

TCP = Capabilities(lanes=("tcp",))
UCX_SM = Capabilities(lanes=("sysv/memory", "cma/memory", "tcp/lo"))
UCX_TCP = Capabilities(lanes=("tcp/lo", "tcp/eth0"), tcp_only=True)


def _offers(ucx: Capabilities, *, tcp: bool = True) -> dict[str, Offer]:
    offers = {"ucx": Offer("ucx", 1, b"u", ucx)}
    if tcp:
        offers["tcp"] = Offer("tcp", 1, b"t", TCP)
    return offers


def _choose(local: dict[str, Offer], remote: dict[str, Offer], preference=("ucx", "tcp")):  # type: ignore[no-untyped-def]
    return choose(preference, local, remote, {}, {}, "any", lambda _n, _a: None)


def test_tcp_only_ucx_gives_way_to_tcp() -> None:
    choice = _choose(_offers(UCX_TCP), _offers(UCX_SM))
    assert choice.name == "tcp"
    assert "only tcp lanes on server" in dict(choice.passed_over)["ucx"]


def test_peer_tcp_only_judged_by_lanes() -> None:
    """A peer that predates the tcp_only field: its lanes say the same thing."""
    remote = _offers(Capabilities(lanes=("tcp/eth0",)))
    choice = _choose(_offers(UCX_SM), remote)
    assert choice.name == "tcp"
    assert "only tcp lanes on client" in dict(choice.passed_over)["ucx"]


def test_ucx_with_shared_memory_is_kept() -> None:
    assert _choose(_offers(UCX_SM), _offers(UCX_SM)).name == "ucx"


def test_tcp_only_ucx_is_used_when_tcp_is_not_an_option() -> None:
    assert _choose(_offers(UCX_TCP, tcp=False), _offers(UCX_TCP, tcp=False)).name == "ucx"
    assert _choose(_offers(UCX_TCP), _offers(UCX_TCP), preference=("ucx",)).name == "ucx"
    # tcp preferred *before* ucx: nothing to give way to
    assert _choose(_offers(UCX_TCP), _offers(UCX_TCP), preference=("tcp", "ucx")).name == "tcp"


def test_tcp_only_travels_in_the_handshake() -> None:
    """tcp_only survives the protobuf round trip, so a peer's flag counts even when its lane
    names do not look like tcp (a future UCX naming its lanes differently)."""
    odd = Capabilities(lanes=("sockets/eth0",), tcp_only=True, one_sided=True)
    back = offer_from_pb(offer_to_pb(Offer("ucx", 1, b"u", odd)))
    assert back.capabilities == odd
    remote = {"ucx": back, "tcp": Offer("tcp", 1, b"t", TCP)}
    choice = _choose(_offers(UCX_SM), remote)
    assert choice.name == "tcp"
    assert "only tcp lanes on client" in dict(choice.passed_over)["ucx"]
