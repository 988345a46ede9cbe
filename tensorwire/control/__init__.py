"""The gRPC control plane: handshake, negotiation, health and reflection."""

from ._client import ControlClient
from ._negotiate import REQUIRE, Choice, Offer, check_require, choose
from ._server import PROTOCOL_VERSION, ControlServer
from ._tls import TLSConfig

__all__ = [
    "PROTOCOL_VERSION",
    "REQUIRE",
    "Choice",
    "ControlClient",
    "ControlServer",
    "Offer",
    "TLSConfig",
    "check_require",
    "choose",
]
