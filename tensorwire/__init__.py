"""tensorwire: move tensors between processes and machines as fast as the wire allows,
and say honestly how they moved.

    async with tensorwire.start("127.0.0.1:0") as node:
        peer = await node.connect("10.0.0.2:5555")
        await peer.send({"x": x}, tag="act")
        y = await peer.recv(tag="grad")
"""

from . import errors
from ._node import Node, NodeConfig, start
from ._onesided import Handle, RemoteHandle
from ._path import Path
from ._peer import Peer
from .control import TLSConfig
from .errors import *  # noqa: F403 - the error tree is part of the top-level API
from .rpc import CallReceipt
from .transports import Capabilities, Limits, Receipt

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # these load on first use (``import tensorwire.pipeline`` works too); none imports torch or CuPy
    if name in ("metrics", "native", "pipeline", "testing"):
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'tensorwire' has no attribute {name!r}")


__all__ = [
    "CallReceipt",
    "Capabilities",
    "Handle",
    "Limits",
    "Node",
    "NodeConfig",
    "Path",
    "Peer",
    "Receipt",
    "RemoteHandle",
    "TLSConfig",
    "__version__",
    "errors",
    "start",
    *errors.__all__,
]
