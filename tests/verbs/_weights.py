"""The seconds each test of ``tests/verbs`` took in a Soft-RoCE guest, so that the two guests'
shards (``TW_GUEST_SHARD``) take about the same time. ``guest_seconds.json`` holds them; refresh
it from a guest run with ``--durations=0`` (docs/verbs.md says how):

    python3 tests/verbs/_weights.py GUEST_LOG > tests/verbs/guest_seconds.json

A test missing from the file (a new one) weighs the median of those listed. A stale file makes
the halves uneven, never wrong: every test is in exactly one shard whatever the weights."""

from __future__ import annotations

import json
import re
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

SECONDS = Path(__file__).with_name("guest_seconds.json")
# pytest's --durations lines, as the guest prints them ("[a] " or "[guest] " before them)
_LINE = re.compile(r"^(?:\[\w+\] )?\s*(\d+(?:\.\d+)?)s (?:setup|call|teardown)\s+(tests/verbs/.+\S)$")


def seconds_in(log: str) -> dict[str, float]:
    """Each test's seconds in a pytest ``--durations=0`` report: setup, call and teardown summed."""
    seconds: dict[str, float] = {}
    for line in log.splitlines():
        if m := _LINE.match(line.rstrip()):
            seconds[m[2]] = round(seconds.get(m[2], 0.0) + float(m[1]), 2)
    return dict(sorted(seconds.items()))


def shards(ids: Sequence[str], n: int, seconds: dict[str, float]) -> list[list[int]]:
    """The positions in ``ids`` of each of ``n`` shards: longest first, each to the shard with the
    fewest seconds so far (the first such on a tie), so the split is the same in every guest."""
    guess = statistics.median(seconds.values()) if seconds else 1.0
    weight = [seconds.get(nodeid, guess) for nodeid in ids]
    loads = [0.0] * n
    picked: list[list[int]] = [[] for _ in range(n)]
    for i in sorted(range(len(ids)), key=lambda i: (-weight[i], i)):
        k = loads.index(min(loads))
        loads[k] += weight[i]
        picked[k].append(i)
    return [sorted(positions) for positions in picked]


def load() -> dict[str, float]:
    """The stored seconds ({} without the file: every test then weighs the same)."""
    try:
        return {str(k): float(v) for k, v in json.loads(SECONDS.read_text()).items()}
    except FileNotFoundError:
        return {}


if __name__ == "__main__":
    print(json.dumps(seconds_in(Path(sys.argv[1]).read_text()), indent=1))
