"""Transports by name, loaded lazily; unusable ones say why and what would install them."""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
import threading
from collections.abc import Iterable

from ..errors import TransportUnavailable
from . import _frames
from ._base import Capabilities, Transport

__all__ = ["DEFAULT_PREFERENCE", "KNOWN", "get_transport", "load", "loaded", "probe_all"]

log = logging.getLogger(__name__)

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


_loading = threading.Lock()  # one load at a time: a second node starting meanwhile waits for the first's


def loaded(names: Iterable[str], *, checksum: bool = False) -> bool:
    """Whether ``load(names)`` has nothing left to import (a node's second start skips it)."""
    if _loading.locked():  # another node's load is under way: what it imports may be half made
        return False
    if checksum and "crc32c" not in sys.modules:
        return False
    for name in names:
        target = KNOWN.get(name, (None,))[0]
        if target is not None and target.partition(":")[0] not in sys.modules:
            return False
        if name == "ucx" and "ucxx" not in sys.modules and importlib.util.find_spec("ucxx") is not None:
            return False
    return True


def load(names: Iterable[str], *, checksum: bool = False) -> None:
    """Import the named transports' modules, and what ucx's probe imports (the UCX libraries,
    then ucxx), in the calling thread; with ``checksum``, crc32c too (tcp loads it on first use).
    A node runs this in a worker thread before it probes on its loop: imported there, the same
    modules stopped the loop for as long as they took (the longest loop gap at a fresh ucx
    node's start was 50-80 ms here, ~17 ms with this); a pure-Python import in a thread lets
    the loop run at every switch of the GIL. The probes then find them imported.

    Never raises: what fails here fails again in the probe, which says why. (An import the loop
    thread begins meanwhile waits for this one's module and gets it whole; two threads could
    only deadlock on a circular import at module level, which this package does not have.)"""
    with _loading:
        for name in names:
            try:
                _load(name)
            except Exception as exc:
                log.debug("loading the %s transport ahead of its probe failed: %r", name, exc)
        if checksum:
            try:
                _frames.crc32c(b"")
            except Exception as exc:
                log.debug("loading crc32c ahead of its first use failed: %r", exc)


def _load(name: str) -> None:
    target = KNOWN.get(name, (None,))[0]
    if target is None:
        return
    if name == "ucx":
        # ucxx's import would load UCX through ctypes.CDLL, holding the GIL for ~0.4 s even in
        # this thread: first open the same libraries with the GIL released
        from .ucx import _load as ucx_libraries

        if ucx_libraries.wanted():
            ucx_libraries.preload()
    importlib.import_module(target.partition(":")[0])
    if name == "ucx" and importlib.util.find_spec("ucxx") is not None:
        # through the transport's own import, which undoes the environment edits ucxx's makes
        from .ucx._worker import import_ucxx

        import_ucxx()


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
