"""Load the UCX libraries off the event loop, before ucxx is imported.

Importing ucxx first loads the libraries of the libucx wheel (``libucx.load_library``), and
their constructors take about 0.4 s. That load goes through ``ctypes.CDLL``, which holds the
GIL while ``dlopen`` runs, so even an import in another thread stops the loop for that long.
:func:`preload` opens the same files, in the same order and with the same flags, through a
ctypes call to libc's ``dlopen``, which releases the GIL; a node runs it in a thread before it
probes ucx. The import that follows finds the libraries loaded and takes tens of milliseconds.

Nothing here raises: where anything differs from what is expected (no libucx wheel, a system
UCX preferred, a file that does not open), preloading stops and the import loads UCX as before.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import os
import sys
import threading

log = logging.getLogger(__name__)

__all__ = ["preload", "wanted"]

_lock = threading.Lock()
_tried = False  # once per process: what it loaded stays loaded, what failed would fail again


def wanted() -> bool:
    """Whether :func:`preload` has anything to do: ucxx not imported yet and not tried before."""
    if _tried or "ucxx" in sys.modules:
        return False
    # libucx loads the system's UCX instead when asked to; preloading the wheel's would overrule that
    return os.getenv("RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY", "false").lower() == "false"


def preload() -> None:
    """Open the libucx wheel's libraries with the GIL released (call it in a thread)."""
    global _tried
    with _lock:  # a second node starting meanwhile waits here, off the loop, for the first's load
        if _tried:
            return
        _tried = True
        try:
            _open_all()
        except Exception as exc:  # a libucx laid out otherwise: ucxx's import loads UCX as before
            log.debug("ucx: not preloading the UCX libraries: %r", exc)


def _open_all() -> None:
    try:
        load = importlib.import_module("libucx.load")
    except ImportError:
        return  # no libucx wheel: ucxx finds UCX its own way, or is not installed
    if load.__file__ is None:
        return
    names = list(load.UCX_LIBRARIES)
    folder = os.path.join(os.path.dirname(load.__file__), "lib")  # where libucx looks first
    # what libucx passes to ctypes.CDLL, which adds RTLD_NOW on its own
    flags = int(getattr(load, "PREFERRED_LOAD_FLAG", os.RTLD_LOCAL)) | os.RTLD_NOW
    dlopen = ctypes.CDLL(None).dlopen
    dlopen.restype = ctypes.c_void_p
    dlopen.argtypes = [ctypes.c_char_p, ctypes.c_int]
    for name in names:
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            log.debug("ucx: preloading stopped at %s, which is not there", path)
            return
        # a call through ctypes releases the GIL while the library loads; the handle stays open
        # for good, as it would after libucx's own load
        if not dlopen(os.fsencode(path), flags):
            log.debug("ucx: preloading %s failed; ucxx's import will load UCX", path)
            return
