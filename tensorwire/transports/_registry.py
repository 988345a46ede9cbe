"""Transports by name, loaded lazily; unusable ones say why and what would install them."""

from __future__ import annotations

import importlib
import importlib.util

from ..errors import TransportUnavailable
from ._base import Capabilities, Transport

__all__ = ["DEFAULT_PREFERENCE", "KNOWN", "get_transport", "probe_all"]

# Fastest first. inproc only applies to peers in the same process.
DEFAULT_PREFERENCE: tuple[str, ...] = ("inproc", "ucx", "verbs", "tcp")

# name -> (module:class, python module it needs, pip extra)
KNOWN: dict[str, tuple[str | None, str | None, str | None]] = {
    "inproc": ("tensorwire.transports.inproc:InprocTransport", None, None),
    "tcp": ("tensorwire.transports.tcp:TcpTransport", None, None),
    "ucx": ("tensorwire.transports.ucx:UcxTransport", "ucxx", "ucx"),
    "verbs": ("tensorwire.transports.verbs:VerbsTransport", "pyverbs", "verbs"),
}


def _why_missing(name: str) -> str:
    _, needs, extra = KNOWN[name]
    if needs is not None and importlib.util.find_spec(needs) is None:
        return f"{needs} is not installed (pip install 'tensorwire[{extra}]')"
    return f"the {name} transport is not part of this tensorwire version"


def get_transport(name: str) -> type[Transport]:
    """The transport class for ``name``; TransportUnavailable says what exists and why not."""
    entry = KNOWN.get(name)
    if entry is None:
        raise TransportUnavailable(f"unknown transport {name!r}; known: {', '.join(KNOWN)}")
    target = entry[0]
    if target is None:
        raise TransportUnavailable(f"{name}: {_why_missing(name)}; usable here: {', '.join(usable_names())}")
    module, _, cls = target.partition(":")
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        raise TransportUnavailable(f"{name}: {_why_missing(name)} ({exc})") from exc
    transport: type[Transport] = getattr(mod, cls)
    return transport


def usable_names() -> list[str]:
    return [n for n, (target, _, _) in KNOWN.items() if target is not None]


def probe_all(
    names: tuple[str, ...] | list[str],
) -> tuple[dict[str, tuple[type[Transport], Capabilities]], dict[str, str]]:
    """Probe each named transport: (usable name -> (class, capabilities), unusable name -> reason)."""
    usable: dict[str, tuple[type[Transport], Capabilities]] = {}
    unusable: dict[str, str] = {}
    for name in names:
        if KNOWN.get(name, (None,))[0] is None and name in KNOWN:
            unusable[name] = _why_missing(name)
            continue
        try:
            cls = get_transport(name)
        except TransportUnavailable as exc:
            unusable[name] = str(exc)
            continue
        caps = cls.probe()
        if caps is None:
            unusable[name] = cls.unavailable_reason()
        else:
            usable[name] = (cls, caps)
    return usable, unusable
