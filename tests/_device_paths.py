"""What the device-edge tests share (tests/test_device_edges.py, tests/test_device_cancel.py):
the paths device memory takes over a real channel with the host engine standing in for a GPU,
and the small staging ring they run with, so that a few chunks fill it."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from typing import TypeVar

import pytest

from tensorwire.memory import HostEngine

CHUNK = 64 * 1024
DEPTH = 3
UCX = pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="ucxx is not installed")
# (transport, by pointer): tcp lands device bytes in out= through staging chunks; ucx by pointer
# lets UCX read and write the host engine's memory as it does CUDA memory; inproc and ucx's
# staged path copy device memory through host memory of ours
PATHS = [
    pytest.param("tcp", False, id="tcp"),
    pytest.param("inproc", False, id="inproc"),
    pytest.param("ucx", False, id="ucx-staged", marks=UCX),
    pytest.param("ucx", True, id="ucx-pointer", marks=UCX),
]

E = TypeVar("E", bound=HostEngine)


def small_rings(engine: E) -> Iterator[E]:
    """A fixture's body: ``engine`` with staging rings of DEPTH chunks of CHUNK bytes, closed after."""
    engine.pool("out").configure(CHUNK, DEPTH)
    engine.pool("in").configure(CHUNK, DEPTH)
    yield engine
    engine.close()
