"""Conversions between control-plane messages and tensorwire's own types."""

from __future__ import annotations

from ..transports import Capabilities
from ._negotiate import Offer
from ._pb import control_pb2

__all__ = ["caps_from_pb", "caps_to_pb", "offer_from_pb", "offer_to_pb"]


def caps_to_pb(caps: Capabilities) -> control_pb2.Capabilities:
    return control_pb2.Capabilities(
        memory_kinds=list(caps.memory_kinds),
        one_sided=caps.one_sided,
        rdma=caps.rdma,
        gpudirect=caps.gpudirect,
        lanes=list(caps.lanes),
        tcp_only=caps.tcp_only,
    )


def caps_from_pb(pb: control_pb2.Capabilities) -> Capabilities:
    return Capabilities(
        memory_kinds=tuple(pb.memory_kinds),
        one_sided=pb.one_sided,
        rdma=pb.rdma,
        gpudirect=pb.gpudirect,
        lanes=tuple(pb.lanes),
        tcp_only=pb.tcp_only,
    )


def offer_to_pb(offer: Offer, *, with_address: bool = True) -> control_pb2.TransportOffer:
    return control_pb2.TransportOffer(
        name=offer.name,
        version=offer.version,
        address=offer.address if with_address else b"",
        capabilities=caps_to_pb(offer.capabilities),
    )


def offer_from_pb(pb: control_pb2.TransportOffer) -> Offer:
    return Offer(pb.name, pb.version, pb.address, caps_from_pb(pb.capabilities))
