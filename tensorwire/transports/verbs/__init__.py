"""ibverbs through pyverbs: RC queue pairs, SEND/RECV rings for headers and small messages,
RDMA READ for payloads, RDMA READ/WRITE with rkeys for one-sided access.

Importing this package does not import pyverbs; the transport does, when a node starts it.
"""

from ._channel import RemoteKey, VerbsChannel
from ._dmabuf import dmabuf_status, register_cuda
from ._transport import DEVICE_ENV, VerbsTransport
from ._verbs import Port, choose_gid, choose_port

__all__ = [
    "DEVICE_ENV",
    "Port",
    "RemoteKey",
    "VerbsChannel",
    "VerbsTransport",
    "choose_gid",
    "choose_port",
    "dmabuf_status",
    "register_cuda",
]
