"""The data plane: the transport contract, the registry, and the built-in transports."""

from ._base import Capabilities, Channel, ChannelState, Limits, Receipt, Session, Transport, TransportContext
from ._registry import DEFAULT_PREFERENCE, KNOWN, get_transport, probe_all


def __getattr__(name: str) -> object:
    # the built-in transports load on first use: ``tensorwire.transports.ucx.ucx_config(...)``
    # after a bare ``import tensorwire`` (tensorwire.transports.ucx does not import ucxx)
    if name in ("inproc", "tcp", "ucx", "verbs"):
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
