"""`tensorwire bench --device cuda` on a GPU: CuPy tensors sent, received into a CuPy buffer,
stamped and summed on the device, in process and through the command line. Skips with a reason
without CuPy or a CUDA device (tests/test_bench_cli.py checks the error there)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from typing import Any

import pytest
from _gpu_skip import cupy_with_a_device

cp = cupy_with_a_device("the CUDA bench tests")

import tensorwire  # noqa: E402
from tensorwire import _bench  # noqa: E402
from tensorwire._bench import _server  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]


async def test_bench_moves_cuda_tensors_and_checks_them_on_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    device = _bench.bench_device("cuda:0")
    async with (
        tensorwire.start("127.0.0.1:0", transports=("tcp",)) as server,
        tensorwire.start("127.0.0.1:0", transports=("tcp",)) as client,
    ):
        peer = await client.connect(server.address)
        served = await server.accept()
        task = asyncio.ensure_future(_server.serve_bench(served, enabled=True))
        try:
            report = await _bench.run_bench(peer, [4096, 1 << 20], seconds=0.1, device=device)
            assert [r.size for r in report.rows] == [4096, 1 << 20]
            assert all(r.gbps > 0 and r.raw_gbps > 0 for r in report.rows)
            assert all(r.staged for r in report.rows), "staged tcp moves CUDA memory through host chunks"
            assert report.to_json()["device"] == "cuda:0"

            receive = _server._receive

            async def tail_lost(p: Any, out: Any, count: int) -> dict[str, int]:
                landed = await receive(p, out, count)
                out[-1:] = out[-1:] ^ 0xFF  # on the device
                return landed

            monkeypatch.setattr(_server, "_receive", tail_lost)
            with pytest.raises(tensorwire.IntegrityError, match="did not land whole"):
                await _bench.run_bench(peer, [4096], seconds=0.05, device=device)
        finally:
            await peer.aclose()
            await asyncio.wait_for(task, 10)


def test_bench_command_line_on_cuda() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "tensorwire.cli", "bench", "--device", "cuda", "--sizes", "64K,4M", "--seconds", "0.2",
         "--json"], capture_output=True, text=True, timeout=100,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(out.stdout)
    assert report["device"].startswith("cuda:") and [r["size"] for r in report["rows"]] == [65536, 4 << 20]
    assert all(r["gbps"] > 0 for r in report["rows"])
