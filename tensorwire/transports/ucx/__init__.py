"""UCX through ucxx: tag send/recv for messages, put/get over remote keys for one-sided access.

Importing this package does not import ucxx; the transport does, when a node starts it.
"""

from ._channel import UcxChannel
from ._proto_info import UsedProtocol, used_protocols
from ._transport import ADDRESS_MAGIC, UcxTransport
from ._ucp import MemoryRegion, RemoteKey
from ._worker import ucx_config, ucx_options

__all__ = [
    "ADDRESS_MAGIC",
    "MemoryRegion",
    "RemoteKey",
    "UcxChannel",
    "UcxTransport",
    "UsedProtocol",
    "ucx_config",
    "ucx_options",
    "used_protocols",
]
