"""A stage server process, as ``tensorwire stage`` runs it.

    tensorwire stage --part mymodel:build_part --address 0.0.0.0:5000
    tensorwire stage --part ./examples/pipeline_mlp.py:build_part

``--part`` names a function ``build_part(rank, num_stages) -> Part`` (a module path or a file
path, then ``:`` and the function's name). It is called once a driver has said which rank this
stage is, so one command line serves any position in the pipeline.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..errors import ConfigurationError
from ._stage import Stage

__all__ = ["load_factory", "serve_stage"]


def load_factory(spec: str) -> Callable[[int, int], Any]:
    """``"package.module:build"`` or ``"path/to/file.py:build"`` -> the function."""
    where, sep, name = spec.rpartition(":")
    relative = where.startswith(".") and not where.endswith(".py")  # ".mod", or "./file" without .py
    if not sep or not where or not name or relative:
        raise ConfigurationError(f"--part {spec!r} is not MODULE:FUNCTION or FILE.py:FUNCTION")
    try:
        if where.endswith(".py"):
            path = Path(where).resolve()
            module_spec = importlib.util.spec_from_file_location(f"_tensorwire_part_{path.stem}", path)
            if module_spec is None or module_spec.loader is None:
                raise ConfigurationError(f"cannot load {path}")
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[module_spec.name] = module
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except (ImportError, OSError) as exc:
        raise ConfigurationError(f"--part {spec!r}: cannot import {where}: {exc}") from exc
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ConfigurationError(f"--part {spec!r}: {where} has no function {name!r}")
    return fn  # type: ignore[no-any-return]


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
