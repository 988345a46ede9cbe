"""What the GPU test files share: a child process on the same GPU whose UCX says which protocols
it used."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from tensorwire.transports.ucx import used_protocols


@pytest.fixture
def cuda_ipc_child() -> Callable[..., contextlib.AbstractAsyncContextManager[Any]]:
    """``async with cuda_ipc_child(code, *argv) as address:`` runs ``python -c code *argv`` with
    ``UCX_PROTO_INFO=used`` and yields the address the child prints as its first line (JSON).
    After the block the child must exit 0, and UCX's own account of the protocols it used (the
    tables it prints as its worker goes) must show cuda_ipc moving CUDA memory: the lanes a path
    names are what UCX may use, this is what it did. The child is killed on any way out."""

    @contextlib.asynccontextmanager
    async def start(code: str, *argv: str) -> AsyncIterator[Any]:
        env = {**os.environ, "UCX_PROTO_INFO": "used"}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", code, *argv, stdout=asyncio.subprocess.PIPE, env=env
        )
        try:
            assert proc.stdout is not None
            line = await asyncio.wait_for(proc.stdout.readline(), 60)
            assert line, f"the child exited before it listened (exit status {await proc.wait()})"
            yield json.loads(line)
            tables = (await asyncio.wait_for(proc.stdout.read(), 30)).decode(errors="replace")
            assert await asyncio.wait_for(proc.wait(), 30) == 0
            used = used_protocols(tables)
            assert any("cuda" in u.operation and "cuda_ipc" in u.lanes for u in used), (
                "UCX did not say it moved CUDA memory with cuda_ipc (a silent fallback?); the protocols "
                f"it used: {used}\n{tables[-4000:]}"
            )
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()

    return start
