"""tensorwire: move tensors between processes and machines as fast as the wire allows,
and say honestly how they moved.

    async with tensorwire.start("127.0.0.1:0") as node:
        peer = await node.connect("10.0.0.2:5555")
        await peer.send({"x": x}, tag="act")
        y = await peer.recv(tag="grad")
"""

from typing import TYPE_CHECKING

from . import errors
from .errors import *  # noqa: F403 - the error tree is part of the top-level API

if TYPE_CHECKING:
    from ._node import Node, NodeConfig, start
    from ._onesided import Handle, RemoteHandle
    from ._path import Path
    from ._peer import Peer
    from .control import TLSConfig
    from .rpc import CallReceipt
    from .transports import Capabilities, Limits, Receipt

__version__ = "0.1.0"

# The API loads on first use: ``import tensorwire`` itself is quick (the command line's entry
# point can then catch a Ctrl-C that comes while the rest loads), and ``tensorwire.Node`` or
# ``from tensorwire import start`` load it all. None of it imports torch or CuPy.
_LAZY = {
    "Node": "._node",
    "NodeConfig": "._node",
    "start": "._node",
    "Handle": "._onesided",
    "RemoteHandle": "._onesided",
    "Path": "._path",
    "Peer": "._peer",
    "TLSConfig": ".control",
    "CallReceipt": ".rpc",
    "Capabilities": ".transports",
    "Limits": ".transports",
    "Receipt": ".transports",
}
_SUBMODULES = ("metrics", "native", "pipeline", "testing")


def __getattr__(name: str) -> object:
    import importlib

    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value  # later lookups skip this function
        return value
    if name in _SUBMODULES:  # (``import tensorwire.pipeline`` works too)
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'tensorwire' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY, *_SUBMODULES})


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
