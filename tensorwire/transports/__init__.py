"""The data plane: the transport contract, the registry, and the built-in transports."""

from ._base import Capabilities, Channel, ChannelState, Limits, Receipt, Session, Transport, TransportContext
from ._registry import DEFAULT_PREFERENCE, KNOWN, get_transport, probe_all

__all__ = [
    "DEFAULT_PREFERENCE",
    "KNOWN",
    "Capabilities",
    "Channel",
    "ChannelState",
    "Limits",
    "Receipt",
    "Session",
    "Transport",
    "TransportContext",
    "get_transport",
    "probe_all",
]
