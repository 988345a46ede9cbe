"""The suite's last resort against a hang (tests/_watchdog.py): a test stuck where pytest-timeout's
SIGALRM cannot reach it ends its pytest process soon after its timeout, with its stack."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

STUCK = """
import signal
import time

import pytest


@pytest.mark.timeout(1)
def test_stuck_where_the_alarm_cannot_reach():
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})  # (as a C call that never returns)
    time.sleep(40)
"""


@pytest.mark.timeout(60)
def test_a_test_stuck_past_its_timeout_ends_the_run_and_says_where(tmp_path: Path) -> None:
    (tmp_path / "test_stuck.py").write_text(textwrap.dedent(STUCK))
    env = dict(os.environ, PYTHONPATH=str(TESTS), TW_TEST_HANG_GRACE="1")
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "_watchdog", "-p", "no:cacheprovider", "-q", "test_stuck.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=35,  # (without the watchdog the test sleeps 40 s: this raises)
    )
    assert run.returncode != 0
    assert "Timeout (0:00:02)!" in run.stderr
    assert 'test_stuck.py", line 11 in test_stuck_where_the_alarm_cannot_reach' in run.stderr
