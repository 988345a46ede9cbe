"""How calls travel on a peer's data plane: reserved tags and the shape of each message.

Every message is an ordinary tensorwire message (a pytree), sent with ``Channel.send`` on a
reserved tag, so calls get the transport's zero-copy paths, credit and interleaving for free.

caller -> server
    REQUEST_TAG     (meta, method, args, kwargs)      arguments inline
                    (meta, method)                    arguments follow on args_tag after GO
                    meta = int64[id, deadline_ns, kind, nbytes, window]
                        deadline_ns -1: none; nbytes -1: inline; window: a stream's first credit
    args_tag(id)    (args, kwargs)                    only after GO
    args_tag(id)    None                              tombstone: the caller gave up part way
    CONTROL_TAG     (CANCEL, id, ArgsState) | (CREDIT, id, n) | (WITHDRAW, id, 0)
                    WITHDRAW (after CANCEL): the terminal reply that waits for the caller's
                    go-ahead (rendezvous) will never get it: take it back, answer CANCELLED
server -> caller, all on reply_tag(id)
    (GO,)                       admitted: send the arguments now
    (ITEM, value)               one item of a streaming method (no more than the caller's credit:
                                the window it asked for, then what it grants; STREAM_WINDOW at most)
    (RESULT, value)             terminal
    (ERROR, code, type, message, traceback)                            terminal
                                code UNSENT: the method returned or yielded a value that could
                                not be sent (type: the error that stopped it; no traceback)
    (CANCELLED,)                terminal: the call was cancelled as its caller asked

Every call the server sees ends with exactly one terminal message, so a caller that gives up
can drain its reply tag and leave nothing behind. A large reply it has not asked for yet it
leaves unpulled and has taken back (WITHDRAW): its bytes never move just to be dropped, and a
caller without the memory for it does not hold up the server's call for good. The server
cancels a reply's send for that alone, when none of it can have moved: a send cancelled as it
completes may still arrive whole, and a CANCELLED after it would be left unread.
``deadline_ns`` is the time that was left when the caller sent the request; clocks are never
compared. The call id and deadline travel in the ``meta`` tensor rather than in the pytree so
that the header of a request repeats exactly from call to call, and both ends' header caches hit.

Replies and requests use message slots of the receiving side's channel (``Limits.max_unexpected``)
until they are received, like any message; the caller keeps what it has outstanding within its
peer's and its own slots (see ``_client``), so that cancellations and credit always get through.
Error text always travels: anything that cannot be encoded is escaped (``safe_text``).
"""

from __future__ import annotations

import enum
import math
import struct
import traceback
from typing import Any

import numpy as np

from .. import _metrics
from .._checks import MAX_SECONDS
from ..errors import DeadlineExceeded, InvalidArguments, MethodNotFound, RemoteError

__all__ = [
    "CONTROL_TAG",
    "INLINE_BYTES",
    "ArgsState",
    "REQUEST_TAG",
    "STREAM_WINDOW",
    "Code",
    "Control",
    "Kind",
    "Reply",
    "Request",
    "args_tag",
    "brief_error",
    "describe",
    "error_reply",
    "meta",
    "parse_request",
    "raise_error",
    "reply_tag",
    "safe_text",
    "traceback_text",
    "unsent_reply",
]

_BASE = -0x7477_5250_0000_0000  # "twRP": below the one-sided range, far from hashed string tags
REQUEST_TAG = _BASE - 1
CONTROL_TAG = _BASE - 2
# requests, control messages, replies and arguments apart, up to the top of tensorwire's reserved
# tags (_peer.RESERVED_TAGS): the metrics call their messages "rpc"
_metrics.traffic_tags(range(CONTROL_TAG, -0x7477_0000_0000_0000 + 1), "rpc")
INLINE_BYTES = 64 * 1024  # arguments up to this size ride in the request itself
STREAM_WINDOW = 16  # stream items in flight before the caller must acknowledge
_MAX_TEXT = 16 * 1024
# a deadline further away than this (about 31 years) is no deadline at all; nanoseconds of it
# would overflow int64 long before a float of seconds does
MAX_DEADLINE = MAX_SECONDS


def reply_tag(call_id: int) -> int:
    return _BASE + 2 * call_id


def args_tag(call_id: int) -> int:
    return _BASE + 2 * call_id + 1


class Kind(enum.IntEnum):
    UNARY = 0
    STREAM = 1


class Reply(enum.IntEnum):
    GO = 0
    ITEM = 1
    RESULT = 2
    ERROR = 3
    CANCELLED = 4


TERMINAL = frozenset((Reply.RESULT, Reply.ERROR, Reply.CANCELLED))


class Control(enum.IntEnum):
    CANCEL = 0
    CREDIT = 1
    WITHDRAW = 2


class ArgsState(enum.IntEnum):
    """What a cancelling caller says of the arguments it was to send after GO."""

    NONE = 0  # it never started sending them: nothing will come
    SENT = 1  # they went out whole
    INTERRUPTED = 2  # the send was cut short (they may or may not arrive); a tombstone follows


class Code(enum.IntEnum):
    RAISED = 0  # the method raised
    NOT_FOUND = 1
    INVALID = 2
    DEADLINE = 3
    UNSENT = 4  # the method returned (or yielded) a value that could not be sent back


def _deadline_ns(deadline: float | None) -> int:
    """A deadline as the envelope carries it: nanoseconds, -1 for none (past MAX_DEADLINE, or not finite)."""
    if deadline is None or math.isnan(deadline) or deadline > MAX_DEADLINE:
        return -1
    return 0 if deadline <= 0 else int(deadline * 1e9)


def meta(call_id: int, deadline: float | None, kind: Kind, nbytes: int, window: int = 0) -> np.ndarray:
    """The request's int64 envelope; a deadline past MAX_DEADLINE (or not finite) travels as none."""
    return np.array((call_id, _deadline_ns(deadline), int(kind), nbytes, window), np.int64)


_META = struct.Struct("=5q")  # (the envelope's five int64s, as a native int64 array holds them)


def fill_meta(head: np.ndarray, call_id: int, deadline: float | None, kind: Kind, nbytes: int, window: int = 0) -> None:
    """Write ``meta(...)`` into ``head``, a C-contiguous int64 array of five (a call's first
    tensor): packed straight into its memory, without the array ``meta`` makes."""
    _META.pack_into(head, 0, call_id, _deadline_ns(deadline), int(kind), nbytes, window)  # type: ignore[arg-type, unused-ignore]  # numpy < 2.5 stubs


class Request:
    """A parsed request envelope."""

    __slots__ = ("args", "call_id", "deadline", "error", "kind", "kwargs", "method", "nbytes", "window")

    def __init__(
        self,
        call_id: int,
        method: str,
        kind: Kind,
        deadline: float | None,
        nbytes: int,
        window: int = STREAM_WINDOW,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.call_id = call_id
        self.method = method
        self.kind = kind
        self.deadline = deadline
        self.nbytes = nbytes  # -1: the arguments came inline
        self.window = window  # a stream's first credit (1..STREAM_WINDOW)
        self.args = args
        self.kwargs = kwargs or {}
        self.error: InvalidArguments | None = None


_INT64 = np.dtype(np.int64)
_KINDS = {int(k): k for k in (Kind.UNARY, Kind.STREAM)}  # (what a request may ask for)


def parse_request(env: object) -> Request | None:
    """Validate a received envelope; None if it is not one (hostile or broken peer)."""
    if not isinstance(env, tuple) or len(env) not in (2, 4):
        return None
    m, method = env[0], env[1]
    if not (isinstance(m, np.ndarray) and m.dtype == _INT64 and m.shape == (5,)):
        return None
    if not isinstance(method, str):
        return None
    call_id, dl, k, nbytes, window = m.tolist()
    kind = _KINDS.get(k)
    if not 0 < call_id < 1 << 60 or kind is None or dl < -1:
        return None
    deadline = None if dl < 0 else dl / 1e9
    window = min(max(window, 1), STREAM_WINDOW)
    if len(env) == 2:
        return Request(call_id, method, kind, deadline, nbytes, window) if nbytes >= 0 else None
    if nbytes != -1:
        return None
    req = Request(call_id, method, kind, deadline, -1, window)
    try:
        req.args, req.kwargs = split_args(env[2], env[3])
    except InvalidArguments as exc:
        req.error = exc
    return req


def split_args(args: object, kwargs: object) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The positional and keyword arguments as sent; anything else raises InvalidArguments."""
    if isinstance(args, (tuple, list)) and isinstance(kwargs, dict) and all(isinstance(k, str) for k in kwargs):
        return tuple(args), kwargs
    raise InvalidArguments("malformed call arguments: expected a tuple and a dict with string keys")


def safe_text(text: object) -> str:
    """``text`` as a string that encodes as UTF-8: lone surrogates and the like escaped
    (backslashreplace); anything but a string is first given to ``str``."""
    if not isinstance(text, str):
        text = describe(text)
    try:
        text.encode()
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode()
    return text


def describe(obj: object) -> str:
    """``str(obj)``, or what is known of it when its ``__str__`` raises (a ``__str__`` that
    returns something other than a string makes ``str`` raise TypeError). Whatever it raises:
    ``str`` never awaits, so a CancelledError or GeneratorExit out of it is the object's own, not
    a cancellation of ours, and escaping here it would cost the reply (its caller would wait
    for good). Only Ctrl-C and exit go on."""
    try:
        return str(obj)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:
        return f"<{safe_text(type(obj).__name__)} whose str() raised {safe_text(type(exc).__name__)}>"


def _clip(text: object) -> str:
    text = safe_text(text)
    return text if len(text) <= _MAX_TEXT else text[: _MAX_TEXT // 2] + "\n...\n" + text[-_MAX_TEXT // 2 :]


def traceback_text(exc: BaseException) -> str:
    """The traceback of ``exc`` as text; empty if even that fails."""
    try:
        return "".join(traceback.format_exception(exc))
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException:  # a hostile exception (its str(), notes, cause) must not cost the reply
        return ""


def error_reply(exc: BaseException, code: Code = Code.RAISED) -> tuple[Any, ...]:
    """The ERROR message for ``exc``: type name, message and traceback text, never the object.
    Never raises, and its text always encodes."""
    if isinstance(exc, RemoteError) and exc.remote_type:
        name, message = exc.remote_type, exc.remote_message or describe(exc)
    else:
        name, message = type(exc).__name__, describe(exc)
    tb = "" if code is not Code.RAISED else traceback_text(exc)
    return (Reply.ERROR, int(code), _clip(name), _clip(message), _clip(tb))


def unsent_reply(what: str, exc: BaseException) -> tuple[Any, ...]:
    """The ERROR message for a value the method returned or yielded (``what``: "f's result")
    that could not be sent: typed as the error that stopped it, so that code matching on the type
    keeps working, and worded as what it is, not as something the method raised."""
    name = type(exc).__name__
    message = f"{what} could not be sent ({name}): {describe(exc)}"
    return (Reply.ERROR, int(Code.UNSENT), _clip(name), _clip(message), "")


def _ascii(text: object, limit: int) -> str:
    out = safe_text(text).encode("ascii", "backslashreplace").decode()
    return out if len(out) <= limit else out[: limit - 3] + "..."


def brief_error(name: object, message: object, code: Code = Code.RAISED, note: object = "") -> tuple[Any, ...]:
    """An ERROR message whose header stays a few hundred bytes whatever it says (ASCII, clipped,
    no traceback): the reply of last resort when a fuller one does not fit the caller's limits.
    ``note`` (clipped first) follows the start of ``message``."""
    tail = f" [{_ascii(note, 200)}]" if note else ""
    return (Reply.ERROR, int(code), _ascii(name, 64), _ascii(message, 400 - len(tail)) + tail, "")


def raise_error(msg: tuple[Any, ...], method: str, where: str) -> None:
    """Raise the error an ERROR message describes, as the caller's error tree has it."""
    try:
        _, code, name, message, tb = msg
        code = Code(code)
    except (ValueError, TypeError):
        raise RemoteError(f"{method} on {where} failed with an unreadable error reply", method=method) from None
    kw = {"remote_type": str(name), "remote_message": str(message), "remote_traceback": str(tb), "method": method}
    if code is Code.NOT_FOUND:
        raise MethodNotFound(f"{where}: {message}", **kw)
    if code is Code.INVALID:
        raise InvalidArguments(f"{method} on {where}: {message}", **kw)
    if code is Code.DEADLINE:
        raise DeadlineExceeded(f"{method} on {where}: {message}")
    if code is Code.UNSENT:
        raise RemoteError(f"{method} on {where}: {message}", **kw)
    raise RemoteError(f"{method} on {where} raised {name}: {message}", **kw)
