"""The GPU benchmarks' device code, run on this machine with tensorwire's stand-in for a GPU.

``benchmarks/kv_rows.py --memory cuda`` runs only where a GPU is lent, which is rarely; its
device code (the pool exposed from device memory in a child process, reads into views of one
device buffer, the byte checks) is the same with ``--memory host-engine``, numpy posing as device
memory. This runs it for real, two processes over tcp (and, with ``--pool-memory host``, over
ucx: one-sided gets staged through the chunks), so that the next GPU run does not find a
broken script. The script checks every cell's bytes and exits 1 when any came back wrong.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tensorwire.memory._cuda import cuda_device_count

ROOT = Path(__file__).resolve().parent.parent


def _kv_rows(*argv: str, timeout: float = 100, path: str = "") -> subprocess.CompletedProcess[str]:
    """``benchmarks/kv_rows.py argv...`` in a process of its own, this checkout's tensorwire
    (after ``path``, a folder of modules that go first)."""
    return subprocess.run(
        [sys.executable, "benchmarks/kv_rows.py", *argv], cwd=ROOT, capture_output=True, text=True,
        timeout=timeout, env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (path, str(ROOT)) if p)},
    )  # fmt: skip


def _rows(tmp_path: Path, *argv: str, path: str = "") -> tuple[list[dict[str, object]], str]:
    """A run that must succeed: its table rows (``--json``) and what it printed."""
    rows_file = tmp_path / "rows.json"
    proc = _kv_rows(*argv, "--json", str(rows_file), path=path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(rows_file.read_text()), proc.stdout


@pytest.mark.timeout(120)
def test_kv_rows_reads_blocks_into_device_memory(tmp_path: Path) -> None:
    rows, stdout = _rows(
        tmp_path, "--memory", "host-engine", "--transports", "tcp", "--pool-mib", "8", "--total-mib", "2",
        "--block-kib", "64", "1024", "--inflight", "4", "--batch", "8", "--repeat", "1",
    )  # fmt: skip
    # 2 block sizes x (4 in flight, batches of 8, one batch of all)
    assert len(rows) == 6, rows
    assert {r["memory"] for r in rows} == {"host-engine"}
    # host-engine memory is not registered with tcp: its owner serves every read
    assert {r["protocol"] for r in rows} == {"owner-assisted"}
    assert "tcp: path tcp" in stdout and "the pool is in host-engine memory" in stdout, stdout


@pytest.mark.timeout(120)
def test_kv_rows_reads_a_host_pool_into_device_memory_one_sided(tmp_path: Path) -> None:
    """``--pool-memory host`` over ucx: one-sided gets of a host pool into device memory, staged
    through the reader's chunks (the path of CUDA tensors on verbs)."""
    if importlib.util.find_spec("ucxx") is None:  # not imported here: the script's processes load it
        pytest.skip("ucxx is not installed: the ucx variant needs it")
    rows, stdout = _rows(
        tmp_path, "--memory", "host-engine", "--pool-memory", "host", "--transports", "ucx", "--pool-mib", "16",
        "--total-mib", "8", "--block-kib", "64", "4096", "--inflight", "2", "--batch", "4", "--repeat", "1",
    )  # fmt: skip
    assert len(rows) == 6, rows
    assert {(r["memory"], r["pool_memory"], r["protocol"]) for r in rows} == {("host-engine", "host", "one-sided")}
    assert "the pool is in host memory" in stdout, stdout


@pytest.mark.timeout(120)
def test_kv_rows_skips_a_transport_that_cannot_run_and_measures_the_rest(tmp_path: Path) -> None:
    """As on a GPU machine where ucxx did not install: the ucx row says why it was skipped and
    the tcp rows are measured (the child that served ucx used to die first, failing the run)."""
    hidden = tmp_path / "hidden"
    (hidden / "ucxx").mkdir(parents=True)
    (hidden / "ucxx" / "__init__.py").write_text('raise ImportError("ucxx hidden by the test")\n')
    rows, stdout = _rows(
        tmp_path, "--memory", "host-engine", "--transports", "ucx", "tcp", "--pool-mib", "8", "--total-mib", "2",
        "--block-kib", "64", "--inflight", "1", "--batch", "4", "--repeat", "1", path=str(hidden),
    )  # fmt: skip
    assert "| ucx | skipped: " in stdout and "ucxx hidden by the test" in stdout, stdout
    assert {r["transport"] for r in rows} == {"tcp"} and len(rows) == 3, rows


def test_kv_rows_with_cuda_memory_and_no_gpu_says_why() -> None:
    if cuda_device_count():
        pytest.skip("a GPU is here: tests/gpu and scripts/gpu_check.sh run the cuda variant")
    proc = _kv_rows("--memory", "cuda", timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--memory cuda needs" in proc.stderr, proc.stderr
