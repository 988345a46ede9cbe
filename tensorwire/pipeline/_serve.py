"""A stage server process, as ``tensorwire stage`` runs it.

    tensorwire stage --part mymodel:build_part --address 0.0.0.0:5000
    tensorwire stage --part ./examples/pipeline_mlp.py:build_part

``--part`` names a function ``build_part(rank, num_stages) -> Part`` (a module path or a file
path, then ``:`` and the function's name). It is called once a driver has said which rank this
stage is, so one command line serves any position in the pipeline, and may take as long as it
needs (loading weights): the driver links the stages once every one has built, and its
``connect_timeout`` bounds only that linking.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..errors import ConfigurationError
from ..rpc._protocol import describe
from ._stage import Stage

__all__ = ["load_factory", "serve_stage"]


def load_factory(spec: str) -> Callable[[int, int], Any]:
    """``"package.module:build"`` or ``"path/to/file.py:build"`` -> the function. Modules are
    found as ``python -m`` and ``python FILE.py`` find them: a MODULE in the current directory,
    and what a FILE.py imports beside it (the ``tensorwire`` script's own ``sys.path`` has
    neither: it starts with the script's directory)."""
    where, sep, name = spec.rpartition(":")
    relative = where.startswith(".") and not where.endswith(".py")  # ".mod", or "./file" without .py
    if not sep or not where or not name or relative:
        raise ConfigurationError(f"--part {spec!r} is not MODULE:FUNCTION or FILE.py:FUNCTION")
    loading = None
    try:
        if where.endswith(".py"):
            path = Path(where).resolve()
            _search_first(str(path.parent))
            module_spec = importlib.util.spec_from_file_location(f"_tensorwire_part_{path.stem}", path)
            if module_spec is None or module_spec.loader is None:
                raise ConfigurationError(f"cannot load {path}")
            module = importlib.util.module_from_spec(module_spec)
            loading = module_spec.name
            sys.modules[loading] = module
            module_spec.loader.exec_module(module)
        else:
            _search_first(os.getcwd())
            module = importlib.import_module(where)
    except (ImportError, OSError) as exc:
        _forget(loading)
        raise ConfigurationError(f"--part {spec!r}: cannot import {where}: {describe(exc)}") from exc
    except Exception as exc:  # the user's module failed while it loaded: say where, not a traceback
        _forget(loading)
        raise ConfigurationError(f"--part {spec!r}: loading {where} raised {_where_it_raised(exc, where)}") from exc
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ConfigurationError(f"--part {spec!r}: {where} has no function {name!r}")
    return fn  # type: ignore[no-any-return]


def _search_first(directory: str) -> None:
    """Put ``directory`` at the front of ``sys.path`` (kept: a part may import later, when the
    driver names its rank); importlib's caches are dropped, so files written since are seen."""
    if directory not in sys.path:
        sys.path.insert(0, directory)
    importlib.invalidate_caches()


def _forget(name: str | None) -> None:
    """Drop a part module that failed to load from ``sys.modules`` (a retry loads it anew)."""
    if name is not None:
        sys.modules.pop(name, None)


def _where_it_raised(exc: Exception, where: str) -> str:
    """``SyntaxError: invalid syntax (parts.py, line 3)``, or ``ValueError: bad (parts.py,
    line 7)``: the error and the last line of the part's own file it came from (else the
    deepest line outside the import machinery: a module the part imports, say)."""
    text = f"{type(exc).__name__}: {describe(exc)}"  # the user's exception: its str() may raise
    if isinstance(exc, SyntaxError):
        return text  # its text names the file and line
    frames = traceback.extract_tb(exc.__traceback__)
    own = [f for f in frames if "importlib" not in f.filename and not f.filename.startswith("<frozen")]
    if where.endswith(".py"):
        path = str(Path(where).resolve())
        own = [f for f in own if f.filename == path] or own
    if own:
        text += f" ({own[-1].filename}, line {own[-1].lineno})"
    return text


async def serve_stage(
    address: str,
    part: str | Callable[[int, int], Any],
    *,
    ready: Callable[[str], None] | None = None,
    offload: bool = True,
    transports: Sequence[str] | None = None,
    auth_token: str | None = None,
) -> None:
    """Serve one stage at ``address`` until cancelled. ``ready(address)`` is called once the
    node listens (port 0 picks a free port; the bound address is passed)."""
    from .._node import start

    build = load_factory(part) if isinstance(part, str) else part
    options: dict[str, Any] = {"auth_token": auth_token}
    if transports:
        options["transports"] = tuple(transports)
    async with start(address, **options) as node, Stage(node, build=build, offload=offload):
        if ready is not None:
            ready(node.address)
        await asyncio.Event().wait()
