"""What the benchmarks that compare this checkout with another (tcp_hol, ucx_hol) share: one run
of a tree in a process of its own (``--one``: it prints one JSON row), the trees run in turns,
and the table of each value's median and range per tree, with this/other where there are two."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # this checkout


def trees(against: Path | None) -> dict[str, Path]:
    """The checkouts to run: this one, and ``against`` (as "other") if given."""
    return {"this": ROOT} if against is None else {"other": against.resolve(), "this": ROOT}


def run_tree(script: Path, tree: Path, argv: list[str]) -> dict[str, float]:
    """``script --one ARGV`` with ``tree`` first on the path: the JSON row it printed last."""
    env = dict(os.environ, PYTHONPATH=str(tree), TENSORWIRE_TREE=str(tree))  # (for scripts that put their own first)
    cmd = [sys.executable, str(script), "--one", *argv]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True, cwd=tree).stdout
    row: dict[str, float] = json.loads(out.strip().splitlines()[-1])
    return row


def in_turns(
    script: Path, checkouts: dict[str, Path], argv: list[str], rounds: int, label: str = ""
) -> dict[str, list[dict[str, float]]]:
    """``rounds`` runs of each checkout, in turns (noise then falls on both alike); each row is
    also written to stderr as it comes."""
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in checkouts}
    for r in range(rounds):
        for name, tree in checkouts.items():
            runs[name].append(run_tree(script, tree, argv))
            print(f"{label}round {r + 1} {name}: {json.dumps(runs[name][-1])}", file=sys.stderr, flush=True)
    return runs


def print_table(runs: dict[str, list[dict[str, float]]], width: int = 22) -> None:
    """Each value's median and range per checkout, and this/other of the medians."""
    head = f"{'':>{width}} |"
    for name in runs:
        head += f" {name + ' median':>14} | {name + ' range':>21} |"
    if "other" in runs:
        head += f" {'this/other':>10}"
    print(head)
    print("-" * len(head))
    for key in runs["this"][0]:
        line = f"{key:>{width}} |"
        medians = {}
        for name, rows in runs.items():
            values = [row[key] for row in rows]
            medians[name] = statistics.median(values)
            line += f" {medians[name]:>14.2f} | {min(values):>9.2f} - {max(values):>9.2f} |"
        if "other" in runs:
            line += f" {medians['this'] / medians['other']:>9.2f}x" if medians["other"] else f" {'-':>10}"
        print(line)
