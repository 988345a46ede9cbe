"""benchmarks/ucx_seq.py's --credit: the receiver's credit, which decides whether a message goes
eager or rendezvous (the A/B that scripts/gpu_check.sh's seq step runs at 1 GiB on a GPU: what
tensorwire's CTS round trip costs)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ucxx", reason="ucx_seq.py measures tensorwire's ucx transport against raw ucxx")

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("credit", "protocol"), [((), "eager"), (("--credit", "1M"), "rendezvous")])
def test_the_receivers_credit_decides_eager_or_rendezvous(credit: tuple[str, ...], protocol: str) -> None:
    # 1 MiB goes eager within the default credit (64 MiB); over 7/8 of a 1 MiB credit it waits
    # for the receiver's CTS: the child must have been given the credit
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("UCX_TLS", None)
    cmd = [sys.executable, "benchmarks/ucx_seq.py", "--sizes", "1M", "--repeat", "1", *credit]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=100, env=env)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    receipt = re.search(
        r"^tensorwire's last receipt: ucx (\S+) direct=True .*'direct': (\d+), 'staged': (\d+), 'copied': (\d+)}",
        out,
        re.M,
    )
    assert receipt and receipt[1] == protocol, out
    # every timed transfer landed (25), none copied on its way; an eager message that came before
    # its recv was posted lands staged (the receiver was slow to post: timing, under load), while
    # a rendezvous one waits for the receiver's CTS and always lands direct
    direct, staged, copied = map(int, receipt.groups()[1:])
    assert (direct + staged, copied) == (25, 0), out
    if protocol == "rendezvous":
        assert staged == 0, out
    assert re.search(r"^\| 1 MiB +\| +[\d.]+ \| +[\d.]+ \| +-?[\d.]+ \| +[\d.]+x \|$", out, re.M), out
