"""Every error tensorwire raises, in one tree.

::

    TensorWireError
    ├── ConfigurationError             bad argument or setting (also ValueError)
    │   ├── ArgumentError              arguments the call does not take: an unknown option, one
    │   │                              too many positional ones (also TypeError)
    │   └── ScheduleError              a pipeline schedule that cannot run (shows the grid)
    ├── TensorError
    │   ├── UnsupportedTensorError     not a tensor tensorwire can move (also TypeError)
    │   └── ShapeMismatchError         out= or a declared shape does not fit (also ValueError)
    ├── ControlPlaneError              the gRPC control plane failed or refused
    │   ├── AuthenticationError        wrong or missing token / credentials
    │   ├── NegotiationError           no shared transport satisfies require=, another
    │   │                              protocol version, an answer no honest node gives
    │   └── HandleNotFound             no such exposed tensor (never exposed, revoked, re-exposed)
    ├── TransportError                 the data plane failed
    │   ├── TransportUnavailable       a transport cannot be used here (lists alternatives)
    │   ├── ConnectError               the data-plane connection could not be opened
    │   ├── ProtocolError              a malformed, hostile or unauthenticated frame
    │   ├── RegistrationError          memory could not be registered with the device (memlock)
    │   ├── TransferError              a transfer failed part way
    │   │   ├── IntegrityError         a checksum did not match: the message was not delivered
    │   │   └── MessageRefused         past the peer's limits: none of it was sent, the channel stays
    │   └── PeerDisconnected           the peer went away; pending operations fail with this
    ├── RemoteError                    a remote method failed: its type name, message, traceback text
    │   ├── MethodNotFound             the peer offers no method by that name
    │   └── InvalidArguments           arguments that do not fit the method's signature or limits
    ├── DeadlineExceeded               an RPC ran past its deadline, on either side (also TimeoutError)
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

import copy
from typing import TypeVar

__all__ = [
    "ArgumentError",
    "AuthenticationError",
    "BrokenResourceError",
    "BusyResourceError",
    "ClosedResourceError",
    "ConfigurationError",
    "ConnectError",
    "ConnectTimeout",
    "ControlPlaneError",
    "DeadlineExceeded",
    "HandleNotFound",
    "IntegrityError",
    "InvalidArguments",
    "MessageRefused",
    "MethodNotFound",
    "NegotiationError",
    "PeerDisconnected",
    "ProtocolError",
    "RegistrationError",
    "RemoteError",
    "ResourceError",
    "ScheduleError",
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


class ArgumentError(ConfigurationError, TypeError):
    """A call of tensorwire's API with arguments it does not take: an unknown option (the
    message lists the valid ones and suggests the nearest), too many positional arguments, a
    missing one. Also a TypeError, which Python raises for such a call of a plain function, so
    code that catches that keeps working."""


class ScheduleError(ConfigurationError):
    """A pipeline schedule cannot run (an action out of order, missing, or waiting forever on a
    neighbour); the message draws the step-by-stage grid as far as it runs and marks the problem."""


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
    """The nodes cannot agree on a data path: no transport both share satisfies the
    ``require=`` policy, they speak other protocol versions (of the control plane or of the
    chosen transport), or the server's handshake answer is one no honest node gives (a lease,
    node id, session id or secret out of bounds)."""


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


class RegistrationError(TransportError):
    """Memory could not be registered with the RDMA device (pinned memory over RLIMIT_MEMLOCK,
    an address the device cannot map); the message says which limit and how to raise it."""


class TransferError(TransportError):
    """A transfer failed part way."""


class IntegrityError(TransferError):
    """A frame's checksum did not match its bytes; the message is not delivered."""


class MessageRefused(TransferError):
    """A send the peer would refuse (its payload past the peer's ``max_message_bytes``, its
    header past ``max_header_bytes``), refused at the sender before any byte of it went out; the
    channel stays open and the tag goes on, so the caller may send something smaller."""


class PeerDisconnected(TransportError):
    """The peer closed or died; every pending operation with it fails with this."""


class RemoteError(TensorWireError):
    """A method called on a peer raised. The remote exception's type name, message and
    traceback text come back as ``remote_type``, ``remote_message`` and ``remote_traceback``
    (the traceback is also attached as a note, so it prints with this error)."""

    def __init__(
        self,
        message: str,
        *,
        remote_type: str = "",
        remote_message: str = "",
        remote_traceback: str = "",
        method: str = "",
    ) -> None:
        super().__init__(message)
        self.remote_type = remote_type
        self.remote_message = remote_message
        self.remote_traceback = remote_traceback
        self.method = method
        if remote_traceback:
            self.add_note(f"remote traceback:\n{remote_traceback.rstrip()}")


class MethodNotFound(RemoteError):
    """The peer offers no method by that name; the message lists the ones it does."""


class InvalidArguments(RemoteError):
    """The arguments do not fit the method's signature, a tensor breaks a declared limit, or the
    serving node could not receive them (no memory for them; ``remote_type`` "TransferError"):
    the node refused the call before its method ran."""


class DeadlineExceeded(TensorWireError, TimeoutError):
    """An RPC ran past its deadline (``peer.call(..., _deadline=s)`` or an enclosing
    ``tensorwire.rpc.deadline``); the server cancels the method when it runs out there too."""


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


_E = TypeVar("_E", bound=BaseException)


def fresh(exc: _E, depth: int = 8) -> _E:
    """A copy of ``exc`` (a channel's failure) to raise or to fail one operation with: its class,
    message, attributes and causes (copied too, ``depth`` deep), and no traceback. A channel
    raises its failure at every later call and fails every pending operation with it; raising
    the one object each time would grow its traceback by each raiser's frames, and the failure
    the channel keeps would keep their locals alive (a failed send's tensor, its memory
    registration) after the caller let go; so would the traceback of the first failure's cause
    (the socket error under a send's write). An exception that its arguments cannot rebuild as
    it was is ``exc`` itself."""
    try:
        twin = copy.copy(exc)
        if type(twin) is not type(exc) or twin.args != exc.args or str(twin) != str(exc):
            return exc
    except Exception:  # (rebuilding it raised, or comparing its arguments did: an array's)
        return exc
    cause = exc.__cause__
    twin.__cause__ = fresh(cause, depth - 1) if cause is not None and depth > 0 else cause
    twin.__suppress_context__ = exc.__suppress_context__
    twin.__traceback__ = None
    if hasattr(exc, "__notes__"):
        twin.__notes__ = list(exc.__notes__)  # (notes added to one copy stay its own)
    return twin
