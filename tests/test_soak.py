"""benchmarks/soak.py --into, briefly, on tcp and ucx: worker processes receive into out= buffers
and cancel some of those recvs part way, so that the soak reaches what its plain run never does
(a cancelled recv giving its message back, and the out= it leaves). A few seconds of it must
lose, corrupt and late-write nothing, and must really have cancelled recvs that had taken their
message. The long runs are in docs/benchmarks.md."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

_TRANSPORTS = [
    "tcp",
    pytest.param(
        "ucx",
        marks=pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="ucxx is not installed"),
    ),
]


def _count(report: str, label: str) -> int:
    """The number on the report's row ``label`` (its first column, indented)."""
    found = re.search(rf"^ +{re.escape(label)} +(\d+)$", report, re.M)
    assert found is not None, f"no row {label!r} in:\n{report}"
    return int(found.group(1))


def _soak(transport: str, env: dict[str, str], seed: int) -> str:
    """One 5 s soak's report, every promise of it checked: nothing lost, corrupted or written late."""
    run = subprocess.run(
        [sys.executable, "benchmarks/soak.py", "--into", "--transport", transport, "--duration", "5",
         "--peers", "2", "--max-mib", "16", "--seed", str(seed)],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    report = run.stdout
    assert run.returncode == 0, report + run.stderr[-4000:]
    assert f"soak over {transport}" in report and "received into out=" in report, report
    assert re.search(r"^lost: 0, corrupted: 0, late writes: 0, workers crashed: 0 -> OK$", report, re.M), report
    accounted = re.search(r"accounted for: (\d+) of (\d+); acknowledged twice: 0$", report, re.M)
    assert accounted is not None and accounted.group(1) == accounted.group(2), report
    assert _count(report, "their out= written after the cancel") == 0, report
    assert _count(report, "recvs into out=") > 0, report
    return report


def _reached_the_cancel_paths(report: str) -> bool:
    """Whether the soak cancelled recvs, one of them after it had taken its message. Its cancels
    are timed, so a loaded host can miss them: a worker that falls behind finds every message
    landed and its recvs done before their cancel (CI met 0 of 90 recvs cancelled at load 7)."""
    return _count(report, "cancelled (random)") > 0 and _count(report, "after they took their message (given back)") > 0


@pytest.mark.timeout(420)
@pytest.mark.parametrize("transport", _TRANSPORTS)
def test_soak_into_out_loses_nothing_and_cancelled_recvs_leave_out_alone(transport: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if transport == "ucx":
        # The soak SIGKILLs workers while they send. One killed in the middle of a send over UCX's
        # shared-memory FIFOs (posix, sysv) blocks the hub's receive FIFO for good, a UCX limitation
        # (docs/ucx.md): the next worker's data connection never opens. A CI run met it once in
        # about 40 (restart rate 0.1: 2 of 5 runs). This test is about out= and cancelled recvs, so
        # it runs as docs/ucx.md advises where processes may be killed: cma and tcp, no FIFOs.
        env["UCX_TLS"] = "^posix,sysv"
    # every run must keep every promise; one of up to three (seeds 7, 8, 9) must have reached
    # the cancel paths, or the test proves nothing about them
    reports = []
    for seed in (7, 8, 9):
        reports.append(_soak(transport, env, seed))
        if _reached_the_cancel_paths(reports[-1]):
            return
    pytest.fail("no soak cancelled a recv that had taken its message:\n" + "\n".join(reports))
