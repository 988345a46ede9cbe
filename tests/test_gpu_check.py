"""scripts/gpu_check.sh on this machine: its steps, its time budget and its verdict.

A task lent a GPU has 15 minutes of device time, the machine's start and any rerun included, so
the check runs its steps in order under one budget (BUDGET), never starts a step it cannot give
45 s, and ends with the line that reruns what did not pass. Without a GPU it must say so and exit
2, however its steps went. Where a test needs the check to see a GPU that is not here, a stand-in
``cupy`` that only counts one device goes first on PYTHONPATH: the check's steps then run (and
fail) for real, which is what the rerun line is about. Where a test checks only which benchmarks a
step starts and what the summary makes of their output, a stand-in PYTHON answers for them.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tensorwire.memory._cuda import cuda_device_count

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(
    cuda_device_count() > 0, reason="a GPU is here: these runs of the check would run its GPU steps for real"
)

_ONE_GPU = '''"""A stand-in for CuPy that only says there is one CUDA device (tests/test_gpu_check.py)."""
__version__ = "0+stand-in"


class _Runtime:
    @staticmethod
    def getDeviceCount():
        return 1


class cuda:
    runtime = _Runtime
'''

_CPU_TORCH = '''"""A stand-in for a torch built without CUDA (tests/test_gpu_check.py)."""
__version__ = "0+stand-in"


class version:
    cuda = None


class cuda:
    @staticmethod
    def is_available():
        return False
'''


# the check's PYTHON where a test checks which benchmarks a step starts and what the summary says of
# them, not the benchmarks: each one (python benchmarks/X.py ARGS) prints a row of its table, one
# the summary shows, naming what it was asked to run, and fails at once (a real one, failing on the
# stand-in CuPy, spent 3-4 s importing torch and tensorwire's benchmark helpers); all else is Python
_BENCH_STAND_IN = """#!/usr/bin/env bash
case "${1:-}" in
    benchmarks/*) echo "| stand-in row: $*"; exit 1 ;;
esac
exec %s "$@"
"""


def _check(
    tmp_path: Path, *, one_gpu: bool = False, stand_in_benchmarks: bool = False, **env: str
) -> subprocess.CompletedProcess[str]:
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    if stand_in_benchmarks:
        python = tmp_path / "python"
        python.write_text(_BENCH_STAND_IN % shlex.quote(sys.executable))
        python.chmod(0o755)
        env = {"PYTHON": str(python), **env}
    # the machine and version report (python start-ups that import CuPy, torch, ucxx and tensorwire:
    # ~5 s a run here) only where a test asks for it (REPORT="1")
    # the tests step's pytest processes (three, with XDIST=2) without hypothesis's plugin: its import
    # took 0.5 CPU-s of each one's 0.7 here, and no test the check runs here uses it
    full = {
        **os.environ,
        "PYTHON": sys.executable,
        "OUT": str(out),
        "REPORT": "0",
        "PYTEST_ADDOPTS": "-p no:hypothesispytest",
        **env,
    }
    if one_gpu:
        fake = tmp_path / "stand-in"
        (fake / "cupy").mkdir(parents=True, exist_ok=True)
        (fake / "cupy" / "__init__.py").write_text(_ONE_GPU)
        full["PYTHONPATH"] = os.pathsep.join(p for p in (str(fake), os.environ.get("PYTHONPATH", "")) if p)
    return subprocess.run(
        ["bash", "scripts/gpu_check.sh"], cwd=ROOT, env=full, capture_output=True, text=True, timeout=150
    )


def test_gpu_check_stops_at_once_when_its_python_does_not_run(tmp_path: Path) -> None:
    # before the guard a missing interpreter read as "all present" and went on to fail every step
    missing = tmp_path / "no-such-python"
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh"],
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "PYTHON": str(missing), "OUT": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"GPU CHECK: FAIL: {missing} does not run here" in proc.stdout
    assert "== dependencies" not in proc.stdout


def test_gpu_check_runs_the_steps_named_in_their_order_and_fails_without_a_gpu(tmp_path: Path) -> None:
    # a tensorwire that is not this checkout's comes first on the path the check is given; the
    # steps must run this checkout's (on a GPU machine none is installed, and a benchmark run as a
    # script found none: kv_rows.py failed to import tensorwire there)
    shadow = tmp_path / "shadow" / "tensorwire"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text('raise ImportError("not the tensorwire of this checkout")\n')
    # and a stand-in torch, built for no CUDA as the CPU one here is, for the report's torch line
    # (importing the real one took 1.6 of this test's 6.5 CPU-s; no step here uses torch)
    (shadow.parent / "torch").mkdir()
    (shadow.parent / "torch" / "__init__.py").write_text(_CPU_TORCH)
    proc = _check(
        tmp_path, STEPS="pack kv bogus", BUDGET="100", T_PACK="1000", PYTHONPATH=str(shadow.parent), REPORT="1"
    )
    out = proc.stdout
    assert proc.returncode == 2, out + proc.stderr
    # the report the other runs here leave out (REPORT=0), from this checkout's tensorwire too
    for part in (
        "== machine",
        "python 3.",
        "== packages the GPU code calls",
        "tensorwire 0.",
        "transports (preference",
        "torch 0+stand-in | built for CUDA None | cuda available False\n",
    ):
        assert part in out, out
    pack, kv = out.index("benchmarks/gpu_pack.py --gib 0.5"), out.index("benchmarks/kv_rows.py --memory cuda")
    assert pack < kv, "the steps run in the order STEPS names them"
    limit = re.search(r"gpu_pack.py .*\(limit (\d+)s\)$", out, re.M)
    assert limit and 30 <= int(limit[1]) <= 100 - 15, "a step's limit is what the budget has left, if less"
    assert "gpu_p2p.py" not in out and "== GPU tests" not in out, "a step STEPS does not name does not run"
    assert re.search(r"^step pack: exit 2, \d+ s$", out, re.M), out  # the benchmark's own "no GPU here"
    assert re.search(r"^step kv: exit 2, \d+ s$", out, re.M), out  # not 1: the shadow's ImportError
    assert "not the tensorwire of this checkout" not in out
    assert "== unknown step 'bogus' (steps: p2p raw tests seq kv pack)" in out and "step bogus: no such step" in out
    assert out.rstrip().endswith(
        "GPU CHECK: FAIL: CuPy finds no CUDA GPU here, so the GPU tests skip and the benchmarks cannot run"
    ), "all skipped is no pass of the GPU check"
    assert (tmp_path / "out" / "tensorwire-gpu-check.log").read_text().rstrip().endswith("the benchmarks cannot run")


def test_gpu_check_starts_no_step_the_budget_cannot_hold_and_says_how_to_rerun(tmp_path: Path) -> None:
    # 44 s: whatever the set-up took, under 45 s are left for the first step
    proc = _check(tmp_path, one_gpu=True, STEPS="p2p tests", BUDGET="44")
    out = proc.stdout
    assert proc.returncode == 1, out + proc.stderr
    for step in ("p2p", "tests"):
        assert re.search(rf"^== {step}: not started: -?\d+ s of the 44 s budget left, a step needs 45$", out, re.M), out
        assert f"step {step}: not run: the budget ran out" in out
    assert "benchmarks/gpu_p2p.py" not in out and "== GPU tests" not in out
    assert "GPU CHECK: FAIL (steps not passed: p2p tests)" in out
    # nothing of the tests ran, so all of them again, not the last-failed ones
    assert out.rstrip().endswith('rerun on this warm machine: STEPS="p2p tests" bash scripts/gpu_check.sh'), out


def test_the_seq_step_runs_ucx_seq_its_eager_ab_then_staged_tcp_with_default_and_small_chunks(tmp_path: Path) -> None:
    # every benchmark is a stand-in that prints one row and fails; what is checked is what the step
    # starts, in which order, and that the summary names each A/B run (ucx at 1 GiB eager; the
    # staging chunk at 1 MiB, where the first H200 run missed staged tcp's goal) with its own rows
    proc = _check(tmp_path, one_gpu=True, stand_in_benchmarks=True, STEPS="seq", SMALL_CHUNK="128K", EAGER_CREDIT="3G")
    out = proc.stdout
    assert proc.returncode == 1, out + proc.stderr
    runs = re.findall(r"^== GPU benchmark: \S+ benchmarks/(.*) \(limit \d+s\)$", out, re.M)
    assert runs == [
        "ucx_seq.py --memory cuda --sizes 1M,1G --repeat 1 --timeline",
        "ucx_seq.py --memory cuda --sizes 1G --repeat 1 --credit 3G",
        "gpu_p2p.py --no-ucx --sizes 1M --timeline",
        "gpu_p2p.py --no-ucx --sizes 1M --chunk 128K --timeline",
    ], out
    summary = out[out.index("== summary") :]
    said = [
        summary.index(s)
        for s in ("ucx_seq: ", "ucx_seq eager (credit 3G):", "staged tcp (timeline): ", "staged tcp (small): ")
    ]
    assert said == sorted(said), summary
    # each run's table under its own heading, from its own log
    rows = [m.start() for m in re.finditer(r"^\| stand-in row: benchmarks/", summary, re.M)]
    assert len(rows) == 4 and all(a < r < b for a, r, b in zip(said, rows, [*said[1:], len(summary)], strict=True)), (
        summary
    )
    for run, row in zip(runs, rows, strict=True):
        assert summary.startswith(f"| stand-in row: benchmarks/{run}\n", row), summary
    assert re.search(r"^step seq: exit 1, \d+ s$", out, re.M), out
    assert out.rstrip().endswith('rerun on this warm machine: STEPS="seq" bash scripts/gpu_check.sh'), out


@pytest.mark.timeout(120)  # two runs of the check, the first out of its 20 s step (10 s of kill grace)
def test_gpu_check_names_the_failed_and_the_unfinished_tests_and_reruns_them(tmp_path: Path) -> None:
    # two GPU tests of ours: one fails at once, one sleeps past the step
    (tmp_path / "conftest.py").write_text(
        'def pytest_configure(config):\n    config.addinivalue_line("markers", "gpu: needs a CUDA GPU")\n'
    )
    fails, hang = tmp_path / "test_fails.py", tmp_path / "test_hang.py"
    fails.write_text("import pytest\n\n\n@pytest.mark.gpu\ndef test_fails_at_once():\n    assert 1 == 2\n")
    # it sleeps until the file "woken" is next to it: in the first run only
    hang.write_text(
        "import time\nfrom pathlib import Path\n\nimport pytest\n\n\n@pytest.mark.gpu\n"
        "def test_sleeps_past_the_step():\n"
        "    while not Path(__file__).with_name('woken').exists():\n        time.sleep(0.1)\n"
    )
    # not a real GPU test failing on the stand-in CuPy (tests/gpu/test_pack.py's took its step 6 s
    # here, 11-13 s with two busy loops on the two cores): pytest, its 2 workers and this failure
    # take 4 s (6-7 s with the busy loops; over 14 s once, the suite run with -n 8 on two cores),
    # so a limit of 20 s holds them, and the sleeper runs out of it (a GPU machine's steps need at
    # least 30 s, MIN_STEP)
    tests = f"{fails} {hang}"
    proc = _check(tmp_path, one_gpu=True, STEPS="tests", TESTS=tests, XDIST="2", T_TESTS="20", MIN_STEP="20")
    out = proc.stdout
    assert proc.returncode == 1, out + proc.stderr
    head = re.search(rf"^== GPU tests: .* -m gpu {re.escape(tests)} .*\(limit 20s\)$", out, re.M)
    assert head, out
    if "-n 2" not in head[0]:
        pytest.fail(f"pytest-xdist is a dev dependency: the tests should run in 2 processes\n{head[0]}")
    assert re.search(r"^step tests: ran out of its \d+ s \(exit 124\)$", out, re.M), out
    # pytest, interrupted at the step's limit, still summed up what had failed
    assert re.search(r"^(\[gw\d\] )?FAILED \S*test_fails.py::test_fails_at_once", out, re.M), out
    running = re.search(r"^tests ran out of time in: (.*)$", out, re.M)
    assert running and running[1].endswith("::test_sleeps_past_the_step"), out
    assert "GPU CHECK: FAIL (steps not passed: tests)" in out
    # the step ran out of time: the rerun takes every test, those that failed first (LF=1, pytest's
    # --lf, left out each test the step had not finished, the sleeper here, for good)
    assert out.rstrip().endswith('rerun on this warm machine: STEPS="tests" FF=1 bash scripts/gpu_check.sh'), out
    # the rerun, the sleeper woken: it must run again (and now pass), so the step ends without
    # waiting out its limit
    (tmp_path / "woken").touch()
    again = _check(tmp_path, one_gpu=True, STEPS="tests", FF="1", TESTS=tests, XDIST="2", T_TESTS="20", MIN_STEP="20")
    out = again.stdout
    assert again.returncode == 1, out + again.stderr
    assert re.search(r"^== GPU tests: .* --ff .*\(limit 20s\)$", out, re.M), out
    assert re.search(r"^tests: +1 failed, 1 passed in .*\(exit 1, \d+ s\)$", out, re.M), "the rerun left out a test"
    log = (tmp_path / "out" / "tensorwire-gpu-tests.log").read_text()
    assert re.search(r"PASSED +\S*::test_sleeps_past_the_step|::test_sleeps_past_the_step PASSED", log), log
    assert out.rstrip().endswith('rerun on this warm machine: STEPS="tests" LF=1 bash scripts/gpu_check.sh'), out
