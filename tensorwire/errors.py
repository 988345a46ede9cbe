"""Every error tensorwire raises, in one tree.

::

    TensorWireError
    ├── ConfigurationError             bad argument or setting (also ValueError)
    ├── TensorError
    │   ├── UnsupportedTensorError     not a tensor tensorwire can move (also TypeError)
    │   └── ShapeMismatchError         out= or a declared shape does not fit (also ValueError)
    ├── ControlPlaneError              the gRPC control plane failed or refused
    │   ├── AuthenticationError        wrong or missing token / credentials
    │   ├── NegotiationError           no shared transport satisfies require=
    │   └── HandleNotFound             no such exposed tensor (never exposed, revoked, re-exposed)
    ├── TransportError                 the data plane failed
    │   ├── TransportUnavailable       a transport cannot be used here (lists alternatives)
    │   ├── ConnectError               the data-plane connection could not be opened
    │   ├── ProtocolError              a malformed, hostile or unauthenticated frame
    │   ├── TransferError              a transfer failed part way
    │   │   └── IntegrityError         a checksum did not match: the message was not delivered
    │   └── PeerDisconnected           the peer went away; pending operations fail with this
    ├── ConnectTimeout                 connect/handshake ran past connect_timeout (also TimeoutError)
    └── ResourceError
        ├── ClosedResourceError        used after aclose() by this side
        ├── BrokenResourceError        unusable because of an earlier failure
        └── BusyResourceError          already in use by another task

Foreign errors (grpc.RpcError, OSError, ...) are wrapped at the boundary where they occur and
chained with ``raise ... from exc``; none reaches a user unwrapped. Deadlines are the caller's:
an ``asyncio.timeout`` around a data-plane call raises the built-in ``TimeoutError``.
"""

from __future__ import annotations

__all__ = [
    "AuthenticationError",
    "BrokenResourceError",
    "BusyResourceError",
    "ClosedResourceError",
    "ConfigurationError",
    "ConnectError",
    "ConnectTimeout",
    "ControlPlaneError",
    "HandleNotFound",
    "IntegrityError",
    "NegotiationError",
    "PeerDisconnected",
    "ProtocolError",
    "ResourceError",
    "ShapeMismatchError",
    "TensorError",
    "TensorWireError",
    "TransferError",
    "TransportError",
    "TransportUnavailable",
    "UnsupportedTensorError",
]


class TensorWireError(Exception):
    """Root of every error tensorwire raises."""


class ConfigurationError(TensorWireError, ValueError):
    """An argument or setting is invalid."""


class TensorError(TensorWireError):
    """A tensor cannot be moved as given."""


class UnsupportedTensorError(TensorError, TypeError):
    """The object is not a tensor, pytree or scalar tensorwire can move."""


class ShapeMismatchError(TensorError, ValueError):
    """A received message does not fit the ``out=`` buffer, or a declared shape changed."""


class ControlPlaneError(TensorWireError):
    """The gRPC control plane failed or refused a request."""


class AuthenticationError(ControlPlaneError):
    """The peer's token or credentials were missing or wrong."""


class NegotiationError(ControlPlaneError):
    """No transport both nodes share satisfies the ``require=`` policy."""


class HandleNotFound(ControlPlaneError):
    """The named tensor is not exposed by that peer (never was, was revoked, or was re-exposed)."""


class TransportError(TensorWireError):
    """The data plane failed."""


class TransportUnavailable(TransportError):
    """A transport cannot be used on this machine; the message lists what can."""


class ConnectError(TransportError):
    """The data-plane connection could not be opened or authenticated."""


class ProtocolError(TransportError):
    """A frame was malformed, hostile, or did not prove the session secret."""


class TransferError(TransportError):
    """A transfer failed part way."""


class IntegrityError(TransferError):
    """A frame's checksum did not match its bytes; the message is not delivered."""


class PeerDisconnected(TransportError):
    """The peer closed or died; every pending operation with it fails with this."""


class ConnectTimeout(TensorWireError, TimeoutError):
    """Connecting or handshaking took longer than ``connect_timeout``."""


class ResourceError(TensorWireError):
    """A resource is not in a state that allows the operation."""


class ClosedResourceError(ResourceError):
    """The resource was closed by this side."""


class BrokenResourceError(ResourceError):
    """The resource is unusable because of an earlier failure."""


class BusyResourceError(ResourceError):
    """The resource is already in use by another task."""
