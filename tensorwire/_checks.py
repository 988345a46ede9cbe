"""Checks for configuration values. A wrong value is a ConfigurationError raised where it is
given, naming the setting, the value and what is allowed; a right one comes back as a plain
``int``, ``float`` or ``bool`` (numpy scalars included), so nothing later trips over its type."""

from __future__ import annotations

import difflib
import functools
import inspect
import ipaddress
import math
import numbers
import operator
import re
from collections.abc import Callable, Collection, Coroutine, Iterable
from typing import Any, Final, NoReturn, TypeVar

import numpy as np

from .errors import ArgumentError, ConfigurationError

__all__ = [
    "MAX_SECONDS",
    "MISSING",
    "check_arguments",
    "check_bool",
    "check_int",
    "check_options",
    "check_seconds",
    "hide_misspelt",
    "portless",
    "refuse_misspelt",
    "join_address",
    "split_address",
    "take_missing",
]

C = TypeVar("C", bound=Callable[..., Any])

MAX_SECONDS = 1e9  # ~31 years; a gRPC deadline overflows past ~9e9 s


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


MISSING: Final[object] = _Missing()
"""What a verb under ``hide_misspelt`` finds in a required parameter its caller did not give."""


def check_int(what: str, value: object, lo: int, hi: int | None = None) -> int:
    """``value`` as an int in ``[lo, hi]`` (no upper bound where ``hi`` is None)."""
    allowed = f"an int of at least {lo}" if hi is None else f"an int from {lo} to {_bound(hi)}"
    if isinstance(value, (bool, np.bool_)) or not hasattr(type(value), "__index__"):
        raise ConfigurationError(f"{what} must be {allowed}, not {value!r}")
    try:
        n = operator.index(value)  # type: ignore[arg-type]
    except TypeError:  # (an __index__ that refuses: numpy's, of an array that is not one integer)
        raise ConfigurationError(f"{what} must be {allowed}, not {value!r}") from None
    if n < lo or (hi is not None and n > hi):
        raise ConfigurationError(f"{what} must be {allowed}, not {value!r}")
    return n


def _bound(n: int) -> str:
    """2**64 - 1 rather than its 20 digits: the size of a wire field reads better."""
    k = (n + 1).bit_length() - 1
    return f"2**{k} - 1" if k >= 16 and n + 1 == 1 << k else str(n)


def as_real(value: object) -> float | None:
    """``value`` as a float if it is a real number (numpy's and ``Fraction`` too; an int past any
    float as an infinity of its sign), else None: a bool is not one."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        return None
    try:
        return float(value)
    except OverflowError:  # an int (or a Fraction) past any float
        return math.inf if value > 0 else -math.inf  # type: ignore[operator]  # (Real has no __gt__ in typeshed)


def check_seconds(what: str, value: object, lo: float = 0.0, hi: float = MAX_SECONDS) -> float:
    """``value`` as a finite number of seconds above ``lo`` (at least ``lo`` where it is not 0)
    and at most ``hi``."""
    top = int(hi) if float(hi).is_integer() else hi
    allowed = f"a number of seconds > 0 and at most {top}" if lo == 0 else f"a number of seconds from {lo} to {top}"
    s = as_real(value)
    if s is None or not (math.isfinite(s) and (s > 0 if lo == 0 else s >= lo) and s <= hi):
        raise ConfigurationError(f"{what} must be {allowed}, not {value!r}")
    return s


def check_bool(what: str, value: object) -> bool:
    """``value`` as a bool: True or False (numpy's too), never a truthy stand-in like 2 or 'no'."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise ConfigurationError(f"{what} must be True or False, not {value!r}")


_PORT = re.compile(r"[0-9]{1,5}")
# a DNS name or an IPv4 address. gRPC reads its target as a URI, so a host with other characters
# is not the one it dials: "h?:5000" and "h#:5000" dialled h at port 443 (the rest a query or a
# fragment), "%31" is an escape for "1", "u@h" a user, "h/x" a path
_NAME = re.compile(r"[A-Za-z0-9_.-]+")
_HOSTS = (
    "the host must be a DNS name (ASCII letters, digits, '-', '_' and '.'; an international name in "
    "its xn-- form), an IPv4 address, or an IPv6 address in brackets ('[::1]:5000')"
)


def _is_ipv6(host: str) -> bool:
    """Whether ``host`` is an IPv6 address, with a zone (``fe80::1%eth0``) of name characters."""
    try:
        ipaddress.IPv6Address(host)
    except ValueError:
        return False
    _, _, zone = host.partition("%")
    return not zone or _NAME.fullmatch(zone) is not None


def portless(address: str) -> str | None:
    """Why ``address`` is an IPv6 host in brackets with no port (``[::1]``), else None: read as
    host:port, what follows its last colon would be taken for the port, and the error would ask
    for the brackets that are there."""
    if address.startswith("[") and address.endswith("]"):
        return f"has no port: write HOST:PORT, as in '{address}:5000'"
    return None


def join_address(host: str, port: int) -> str:
    """``host:port`` as ``split_address`` reads it back: an IPv6 host in brackets (``[::1]:5000``)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def split_address(address: object, *, lowest_port: int = 0) -> tuple[str, int]:
    """``"host:port"`` (an IPv6 host in brackets: ``"[::1]:5000"``) as (host, port), with the
    port from ``lowest_port`` to 65535; ConfigurationError otherwise."""
    if not isinstance(address, str):
        raise ConfigurationError(f"an address is a 'host:port' string, not {address!r}")
    if (no_port := portless(address)) is not None:
        raise ConfigurationError(f"address {address!r} {no_port}")
    if any(c <= " " or c == "\x7f" for c in address):  # gRPC cut a host at a NUL and dialled the rest
        raise ConfigurationError(f"address {address!r} holds a control character or a space")
    host, sep, port = address.rpartition(":")
    if not sep or not host:
        raise ConfigurationError(f"address {address!r} is not host:port")
    if "[" in host or "]" in host:
        if not (host.startswith("[") and host.endswith("]") and _is_ipv6(host[1:-1])):
            raise ConfigurationError(f"address {address!r}: {_HOSTS}, not {host!r}")
        host = host[1:-1]
    elif ":" in host:
        raise ConfigurationError(f"address {address!r}: write an IPv6 host in brackets, as in '[::1]:5000'")
    elif not _NAME.fullmatch(host):
        raise ConfigurationError(f"address {address!r}: {_HOSTS}, not {host!r}")
    if not _PORT.fullmatch(port) or not lowest_port <= int(port) <= 65535:
        raise ConfigurationError(f"address {address!r}: the port must be a number from {lowest_port} to 65535")
    return host, int(port)


def check_options(what: str, given: Iterable[str], allowed: Collection[str]) -> None:
    """ArgumentError for the first name in ``given`` that is not ``allowed``, with the nearest
    allowed name (a typo is the likely cause) and the whole list."""
    for name in given:
        if name not in allowed:
            near = difflib.get_close_matches(name, allowed, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ArgumentError(f"{what} has no option {name!r}{hint}; its options are: {', '.join(allowed)}")


def _misfit(what: str, signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """ArgumentError where ``args`` and ``kwargs`` do not fit ``signature``; else nothing."""
    params = signature.parameters.values()
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        named = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        check_options(what, kwargs, named)
    try:
        signature.bind(*args, **kwargs)
    except TypeError as exc:
        plain = signature.replace(
            parameters=[p.replace(annotation=p.empty) for p in params], return_annotation=signature.empty
        )
        raise ArgumentError(f"{what}: {exc}; it takes {what.removesuffix('()')}{plain}") from None


def _as_called(fn: Callable[..., Any]) -> tuple[inspect.Signature, bool]:
    """``fn``'s signature as its caller sees it, and whether it takes self (or cls): the caller
    does not give that, so it is left out of what is checked and shown."""
    signature = inspect.signature(fn)
    bound = next(iter(signature.parameters), None) in ("self", "cls")
    if bound:
        signature = signature.replace(parameters=list(signature.parameters.values())[1:])
    return signature, bound


def hide_misspelt(fn: C) -> C:
    """``fn`` (as it is: no wrapper) showing a signature without its ``**_misspelt``, and taking
    ``MISSING`` for each required parameter its caller leaves out.

    A per-message verb (``peer.send``, ``recv``, ``read``, ...) cannot afford check_arguments'
    frame, so it takes ``**_misspelt: Never`` (mypy flags a misspelt option at the call) and
    begins ``if _misspelt or obj is MISSING: refuse_misspelt(Peer.verb, _misspelt, obj=obj)``:
    about 40 ns a call, one empty dict and an identity check per required parameter. Python
    checks required parameters before anything else, so without the ``MISSING`` defaults (set
    here, at run time: mypy still sees them required) a misspelt required name (``scr=`` for
    ``src``) was its bare "missing 1 required positional argument". ``help()`` and
    ``inspect.signature`` show the parameters as written, the required ones required."""
    signature = inspect.signature(fn)
    kept = [p for p in signature.parameters.values() if p.kind is not p.VAR_KEYWORD]
    if len(kept) != len(signature.parameters) - 1 or "_misspelt" not in signature.parameters:
        raise TypeError(f"{fn.__qualname__} takes no **_misspelt to hide")
    return take_missing(fn, signature.replace(parameters=kept))


def take_missing(fn: C, signature: inspect.Signature | None = None) -> C:
    """``fn`` (as it is: no wrapper) taking ``MISSING`` for each required parameter its caller
    leaves out, and showing ``signature`` (its own where None), the required ones required: its
    body checks ``if name is MISSING: refuse_misspelt(Cls.verb, (), name=name)``, for an
    ArgumentError instead of Python's bare "missing 1 required positional argument" where
    check_arguments' frame costs too much (``peer.call``, whose ``**kwargs`` are the method's)."""
    shown = inspect.signature(fn) if signature is None else signature
    fn.__signature__ = shown  # type: ignore[attr-defined]
    params = list(shown.parameters.values())
    positional = [p for p in params[1:] if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]  # (after self)
    required = [p for p in positional if p.default is p.empty]
    if required:
        fn.__defaults__ = (MISSING,) * len(required) + (fn.__defaults__ or ())
    keyword = {p.name: MISSING for p in params if p.kind is p.KEYWORD_ONLY and p.default is p.empty}
    if keyword:
        fn.__kwdefaults__ = {**(fn.__kwdefaults__ or {}), **keyword}
    return fn


def refuse_misspelt(fn: Callable[..., Any], misspelt: Iterable[str], **required: Any) -> NoReturn:
    """The ArgumentError check_arguments raises for a call of ``fn`` that does not fit, for a
    verb under ``hide_misspelt``: the options it caught in its ``**_misspelt`` (the nearest
    real one to each, and them all), or else the ``required`` parameters (name=value) that
    came as ``MISSING``."""
    signature, _ = _as_called(fn)
    given = {name: value for name, value in required.items() if value is not MISSING}
    _misfit(f"{fn.__qualname__}()", signature, (), {**given, **dict.fromkeys(misspelt)})
    raise AssertionError(f"{fn.__qualname__} takes {list(misspelt)} and {given}")  # (_misfit raised: they fit)


def check_arguments(target: C) -> C:
    """Make a call of ``target`` (a class, a function, a coroutine function) with arguments it
    does not take raise ArgumentError, which says what it takes, instead of Python's bare
    TypeError (a dataclass's ``__init__`` named no valid field). A call that fits costs one
    more frame: the arguments are looked at only once the call has raised a TypeError, which
    is passed on as it is where they fit."""
    cls = target if isinstance(target, type) else None
    fn: Callable[..., Any] = getattr(target, "__init__") if cls is not None else target  # noqa: B009
    what = f"{cls.__name__}()" if cls is not None else f"{fn.__qualname__}()"
    signature, bound = _as_called(fn)

    def refit(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        _misfit(what, signature, args[1:] if bound else args, kwargs)

    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def call_async(*args: Any, **kwargs: Any) -> Any:
            try:
                coro: Coroutine[Any, Any, Any] = fn(*args, **kwargs)
            except TypeError:
                refit(args, kwargs)
                raise
            return await coro

        return call_async  # type: ignore[return-value]

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except TypeError:
            refit(args, kwargs)
            raise

    if cls is None:
        return call  # type: ignore[return-value]
    setattr(cls, "__init__", call)  # noqa: B010
    return target
