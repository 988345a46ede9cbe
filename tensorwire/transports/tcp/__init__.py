"""Staged TCP: length-prefixed frames on one stream per peer, zero-copy on host memory."""

from ._channel import TcpChannel
from ._transport import TcpTransport

__all__ = ["TcpChannel", "TcpTransport"]
