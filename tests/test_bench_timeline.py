"""benchmarks/ucx_seq.py --timeline: where a ucx transfer's time goes, phase by phase in both
processes (benchmarks/_timeline.py). It wraps tensorwire's private functions by name, so a rename
must fail here rather than leave the spans that the next GPU run reads (scripts/gpu_check.sh's
seq step) empty."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ucxx", reason="ucx_seq.py measures tensorwire's ucx transport against raw ucxx")

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_the_timeline_turn_marks_every_phase_of_every_transfer_in_both_processes() -> None:
    from tensorwire.transports.ucx._channel import _INLINE_MAX

    # (128 KiB: above what rides in the MSG frame, so its payload is a UCX message of its own)
    assert _INLINE_MAX < 128 << 10
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("UCX_TLS", None)
    cmd = [sys.executable, "benchmarks/ucx_seq.py", "--sizes", "128K,1M", "--repeat", "1", "--timeline"]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=150, env=env)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    tables = re.findall(r"^(128 KiB|1 MiB) \(\d+ us a transfer in this turn\): (\d+) transfers", out, re.M)
    # 1 warm-up transfer and 5 batches of 5 (gpu_ucx_raw.plan), the warm-up left out of the medians
    assert tables == [("128 KiB", "25"), ("1 MiB", "25")], out
    rows = re.findall(r"^\| ([^|]+?) +\| +([-\d.]+) \| +[-\d ]+\| +(\d+) \|$", out, re.M)
    spans = {}
    for name, median, n in rows:
        spans.setdefault(name, []).append((float(median), int(n)))
    for name in (
        "send -> its MSG frame",
        "MSG frame -> receiver has it",
        "receiver has it -> payload receive posted",
        "payload send: producer wait + UCX",
        "payload receive posted -> landed",
        "landed -> recv returns",
        "send -> recv returns (one transfer)",
        "recv returns -> next recv",
    ):
        got = spans.get(name)
        assert got is not None and len(got) == 2, f"{name}: {got}\n{out}"
        for median, n in got:
            # every transfer marked (the last recv has no next one); each span runs forward in
            # time, across the two processes too (their clocks are one: CLOCK_MONOTONIC)
            assert n == (24 if name == "recv returns -> next recv" else 25), f"{name}: {got}\n{out}"
            assert median > 0, f"{name}: {got}\n{out}"
    # a transfer's whole time holds each of its parts (per transfer, and so in the medians)
    wholes = spans["send -> recv returns (one transfer)"]
    for part in ("send -> its MSG frame", "MSG frame -> receiver has it", "payload receive posted -> landed"):
        for (whole, _), (median, _) in zip(wholes, spans[part], strict=True):
            assert whole > median, f"{part}\n{out}"
    for side in ("sender", "receiver"):
        said = re.search(rf"^{side}'s counters over the marked run: (.*)$", out, re.M)
        assert said and "progress runs" in said[1], out
    said = re.search(r"^receiver's counters over the marked run: (.*)$", out, re.M)
    assert said and re.search(r"control handler runs \d+", said[1]) and re.search(r"payload receive posts \d+", said[1])


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_staged_tcp_timeline_gives_each_row_its_spans_and_says_who_waited_for_copies() -> None:
    """staged_p2p.py --timeline (the CPU stand-in of gpu_p2p.py's tcp rows, which take the same
    flag on a GPU): a table per row, and the copy engine's waits counted on each side."""
    cmd = [sys.executable, "benchmarks/staged_p2p.py", "--sizes", "1M", "--turns", "2", "--timeline"]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=150)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    # two turns of 12 timed transfers and a warm-up each, per row
    tables = re.findall(r"^(tcp host|tcp staged) 1 MiB: (\d+) transfers", out, re.M)
    assert tables == [("tcp host", "24"), ("tcp staged", "24")], out
    rows = re.findall(r"^\| ([^|]+?) +\| +([-\d.]+) \| +[-\d ]+\| +(\d+) \|$", out, re.M)
    names = [name for name, _, _ in rows]
    for name in ("send (all of it)", "recv (all of it)", "send -> recv returns (one transfer)"):
        assert names.count(name) == 2, out
    assert "MSG frame -> receiver has it" not in names, "a ucx span in a tcp row"
    sender = re.search(r"^sender's counters over the marked run: (.*)$", out, re.M)
    receiver = re.search(r"^receiver's counters over the marked run: (.*)$", out, re.M)
    # the sender waits for each chunk's copy down; the stand-in's receiver (an engine without
    # streams) waits for its copies up on the host, at the landing
    assert sender and re.search(r"event waits \(staging pipeline\) (\d+)", sender[1]), out
    assert receiver and re.search(r"event waits \(device landing\) (\d+)", receiver[1]), out
