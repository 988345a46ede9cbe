"""The control plane's side of tensor RPC: ListMethods and Invoke for stock gRPC clients.

Invoke carries scalars (and lists and string-keyed maps of them) as ``tensorwire.v1.Value``;
tensors never cross the control plane. A node started with ``auth_token`` asks for it in the
``authorization: Bearer <token>`` metadata.
"""

from __future__ import annotations

import asyncio
import hmac
from typing import TYPE_CHECKING, Any, NoReturn

import grpc
import numpy as np

from ..control._pb import control_pb2
from ..errors import DeadlineExceeded, InvalidArguments, MethodNotFound, RemoteError, UnsupportedTensorError
from ._protocol import describe, safe_text, traceback_text
from ._registry import methods_of
from ._server import run_local

if TYPE_CHECKING:
    from .._node import Node

__all__ = ["invoke", "list_methods", "value_from_pb", "value_to_pb"]

# Each level of a Value is two protobuf levels (Value, then ListValue or MapValue), and
# protobuf's decoder stops at 100: deeper failed in protobuf itself (a DecodeError out of
# value_to_pb, an UNKNOWN status) where it should be this module's ValueError.
_MAX_DEPTH = 48
_INT64 = 1 << 63

# how a method's own exception maps to a status (anything else: UNKNOWN)
_STATUS: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (NotImplementedError, grpc.StatusCode.UNIMPLEMENTED),
    (PermissionError, grpc.StatusCode.PERMISSION_DENIED),
    (TimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (LookupError, grpc.StatusCode.NOT_FOUND),
    (FileNotFoundError, grpc.StatusCode.NOT_FOUND),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
    (TypeError, grpc.StatusCode.INVALID_ARGUMENT),
)


def value_to_pb(obj: Any, depth: int = 0) -> control_pb2.Value:
    """A Python value as a Value; ValueError for what a Value cannot hold (tensors among them)."""
    if depth > _MAX_DEPTH:
        raise ValueError(f"nested deeper than {_MAX_DEPTH} levels")
    v = control_pb2.Value()
    if isinstance(obj, (np.bool_, np.integer, np.floating)):
        obj = obj.item()  # a numpy scalar (what x.sum() returns) travels as its Python value
    if obj is None:
        pass
    elif isinstance(obj, bool):
        v.bool_value = obj
    elif isinstance(obj, int):
        if not -_INT64 <= obj < _INT64:
            raise ValueError(f"integer {obj} does not fit in 64 bits")
        v.int_value = obj
    elif isinstance(obj, float):
        v.float_value = obj
    elif isinstance(obj, str):
        try:
            v.str_value = obj
        except UnicodeEncodeError as exc:
            raise ValueError(f"a string that is not valid UTF-8 ({exc.reason}): {safe_text(obj)[:64]!r}") from None
    elif isinstance(obj, bytes):
        v.bytes_value = obj
    elif isinstance(obj, (list, tuple)):
        v.list_value.SetInParent()
        v.list_value.items.extend(value_to_pb(x, depth + 1) for x in obj)
    elif isinstance(obj, dict):
        v.map_value.SetInParent()
        for k, x in obj.items():
            if not isinstance(k, str):
                raise ValueError(f"map keys must be strings for gRPC clients, not {type(k).__name__}")
            v.map_value.entries[k].CopyFrom(value_to_pb(x, depth + 1))
    else:
        raise ValueError(
            f"{type(obj).__name__} cannot travel over the control plane (only scalars, lists and maps); "
            "call this method through a tensorwire peer"
        )
    return v


def value_from_pb(v: control_pb2.Value, depth: int = 0) -> Any:
    if depth > _MAX_DEPTH:
        raise ValueError(f"nested deeper than {_MAX_DEPTH} levels")
    kind = v.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "list_value":
        return [value_from_pb(x, depth + 1) for x in v.list_value.items]
    if kind == "map_value":
        return {k: value_from_pb(x, depth + 1) for k, x in v.map_value.entries.items()}
    return getattr(v, kind)


def _authorized(node: Node, context: grpc.aio.ServicerContext) -> bool:
    token = node.config.auth_token
    if token is None:
        return True
    for key, value in context.invocation_metadata() or ():
        if key == "authorization" and isinstance(value, str):
            return hmac.compare_digest(value.encode(), f"Bearer {token}".encode())
    return False


async def _require_auth(node: Node, context: grpc.aio.ServicerContext) -> None:
    """Abort the call (UNAUTHENTICATED) unless it carries the node's token, where it has one."""
    if not _authorized(node, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "this node needs 'authorization: Bearer <token>' metadata")
        raise AssertionError("unreachable: abort raises")


async def list_methods(
    node: Node, request: control_pb2.ListMethodsRequest, context: grpc.aio.ServicerContext
) -> control_pb2.ListMethodsResponse:
    await _require_auth(node, context)
    reg = methods_of(node)
    resp = control_pb2.ListMethodsResponse()
    for name in sorted(reg):
        m = reg[name]
        resp.methods.add(
            name=m.name, signature=m.signature, streaming=m.streaming, doc=m.doc, max_arg_bytes=reg.arg_limit(m)
        )
    return resp


def _ascii(text: str) -> str:
    return text.encode("ascii", "replace").decode()[:256]


async def _fail(context: grpc.aio.ServicerContext, code: grpc.StatusCode, exc: BaseException) -> NoReturn:
    if isinstance(exc, RemoteError) and exc.remote_type:  # a remote error passed through
        name, message, tb = exc.remote_type, exc.remote_message, exc.remote_traceback
    else:
        name, message = type(exc).__name__, describe(exc)
        ours = isinstance(exc, (MethodNotFound, InvalidArguments, DeadlineExceeded))
        tb = "" if ours else traceback_text(exc)
    metadata: list[tuple[str, str | bytes]] = [("tensorwire-remote-type", _ascii(name))]
    if tb:
        metadata.append(("tensorwire-traceback-bin", safe_text(tb).encode()[-16384:]))
    await context.abort(code, safe_text(f"{name}: {message}")[:4096], trailing_metadata=tuple(metadata))
    raise AssertionError("unreachable: abort raises")


async def invoke(
    node: Node, request: control_pb2.InvokeRequest, context: grpc.aio.ServicerContext
) -> control_pb2.InvokeResponse:
    await _require_auth(node, context)
    try:
        args = [value_from_pb(v) for v in request.args]
        kwargs = {k: value_from_pb(v) for k, v in request.kwargs.items()}
    except ValueError as exc:
        await _fail(context, grpc.StatusCode.INVALID_ARGUMENT, InvalidArguments(f"unreadable arguments: {exc}"))
    try:
        result = await run_local(methods_of(node), request.method, args, kwargs, context.time_remaining())
    except MethodNotFound as exc:
        await _fail(context, grpc.StatusCode.UNIMPLEMENTED, exc)
    except InvalidArguments as exc:
        await _fail(context, grpc.StatusCode.INVALID_ARGUMENT, exc)
    except DeadlineExceeded as exc:
        await _fail(context, grpc.StatusCode.DEADLINE_EXCEEDED, exc)
    except Exception as exc:
        code = next((c for t, c in _STATUS if isinstance(exc, t)), grpc.StatusCode.UNKNOWN)
        await _fail(context, code, exc)
    except BaseException as exc:
        if isinstance(exc, (asyncio.CancelledError, KeyboardInterrupt, SystemExit)):
            raise  # the gRPC call was cancelled, or the process is stopping
        # the method's own (a BaseExceptionGroup out of its TaskGroup, say): a status, not silence
        await _fail(context, grpc.StatusCode.UNKNOWN, exc)
    try:
        value = value_to_pb(result)
    except ValueError as exc:  # the method ran on right arguments: its result is what cannot go (as peer.call says)
        unsent = UnsupportedTensorError(f"{request.method}'s result could not be sent over gRPC: {exc}")
        await _fail(context, grpc.StatusCode.FAILED_PRECONDITION, unsent)
    return control_pb2.InvokeResponse(result=value)
