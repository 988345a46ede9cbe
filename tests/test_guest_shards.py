"""The split of ``tests/verbs`` over the two Soft-RoCE guests, checked on the host: the shards
that ``TW_GUEST_SHARD`` selects, and how ``tests/test_verbs_vm.py`` reads the two guests' output
back into one suite's (no guest boots here)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
from test_verbs_vm import _PAIR_SPLIT, _SPLIT, PYPI_CMD, _failures, _guest_cmd, _results, parse_guests
from verbs import _weights
from verbs._weights import seconds_in, shards
from verbs.conftest import shard_of

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.timeout(120)


def _collected(shard: str | None, *paths: str) -> tuple[int, list[str], str]:
    env = {k: v for k, v in os.environ.items() if k != "TW_GUEST_SHARD"}
    if shard is not None:
        env["TW_GUEST_SHARD"] = shard
    # (without hypothesis's plugin, which no test collected here uses: it took 0.6 of each
    # collection's 1.4 CPU-s)
    plugins_off = ["-p", "no:cacheprovider", "-p", "no:xdist", "-p", "no:hypothesispytest"]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", *plugins_off, "--collect-only", "-q", *paths],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
    )
    return proc.returncode, [line for line in proc.stdout.splitlines() if "::" in line], proc.stdout + proc.stderr


def test_the_two_guest_shards_split_tests_verbs_into_halves() -> None:
    rc, everything, out = _collected(None, "tests/verbs")
    assert rc == 0 and len(everything) > 20, out
    halves = [_collected(f"{k}/2", "tests/verbs") for k in (0, 1)]
    assert all(rc == 0 for rc, _, _ in halves), halves
    first, second = (set(ids) for _, ids, _ in halves)
    assert first | second == set(everything) and not first & second
    # about the same seconds in a guest: apart by no more than its longest test (every other
    # test of the 89 in collection order, on 2026-12-03: 127.7 s and 101.7 s, 14.2 s the longest)
    seconds = _weights.load()
    assert set(everything) <= set(seconds), "tests/verbs/guest_seconds.json lacks tests: refresh it"
    first_s, second_s = (sum(seconds[nodeid] for nodeid in half) for half in (first, second))
    assert abs(first_s - second_s) <= max(seconds.values()), (first_s, second_s)


def test_the_seconds_of_a_guest_run_are_read_from_its_durations_report() -> None:
    log = """[a] ============================== slowest durations ===============================
[a] 14.20s call     tests/verbs/test_verbs_guest.py::test_long[x y]
[a] 0.50s setup    tests/verbs/test_verbs_guest.py::test_long[x y]
[a] 0.02s teardown tests/verbs/test_verbs_guest.py::test_long[x y]
[a] 1.00s call     tests/verbs/test_conformance_verbs.py::test_conformance[every_dtype]
[a] 2.00s call     tests/test_config.py::test_not_a_guest_test
[a] (31 durations < 0.005s hidden.  Use -vv to show these durations.)
 3.50s call     tests/verbs/test_goodbye_verbs.py::test_plain
"""
    assert seconds_in(log) == {
        "tests/verbs/test_conformance_verbs.py::test_conformance[every_dtype]": 1.0,
        "tests/verbs/test_goodbye_verbs.py::test_plain": 3.5,
        "tests/verbs/test_verbs_guest.py::test_long[x y]": 14.72,
    }


def test_shards_take_the_longest_tests_first_and_weigh_an_unknown_one_the_median() -> None:
    ids = ["a", "b", "c", "d", "e", "new"]
    seconds = {"a": 10.0, "b": 6.0, "c": 5.0, "d": 4.0, "e": 1.0}  # median 5: "new" weighs 5
    # a(10) -> 0; b(6) -> 1; c(5) -> 1 (11); new(5) -> 0 (15); d(4) -> 1 (15); e(1) -> 0 (a tie)
    assert shards(ids, 2, seconds) == [[0, 4, 5], [1, 2, 3]]
    assert shards(ids, 1, seconds) == [list(range(6))]
    # no seconds at all: every test weighs the same, and the shards take turns
    assert shards(ids, 2, {}) == [[0, 2, 4], [1, 3, 5]]
    assert shards(ids, 4, {}) == [[0, 4], [1, 5], [2], [3]]


def test_a_shard_leaves_tests_outside_tests_verbs_alone() -> None:
    _, alone, out = _collected(None, "tests/test_config.py")
    rc, with_shard, out = _collected("1/2", "tests/test_config.py", "tests/verbs/test_goodbye_verbs.py")
    assert rc == 0, out
    assert set(alone) <= set(with_shard), out


def test_a_bad_shard_is_a_usage_error() -> None:
    rc, _, out = _collected("a/2", "tests/verbs")
    assert rc == 4 and "TW_GUEST_SHARD must be K/N with 0 <= K < N, not 'a/2'" in out, out


@pytest.mark.parametrize("shard", ["2/2", "1", "a/2", "-1/2", "0/0", "\u00b2/2", "0/2/2", "1/2/", ""])
def test_a_shard_other_than_k_of_n_is_refused(shard: str) -> None:
    with pytest.raises(
        pytest.UsageError, match=re.escape(f"TW_GUEST_SHARD must be K/N with 0 <= K < N, not {shard!r}")
    ):
        shard_of(shard)


@pytest.mark.parametrize(("shard", "k", "n"), [("0/2", 0, 2), ("1/2", 1, 2), ("2/3", 2, 3), ("0/1", 0, 1)])
def test_a_shard_k_of_n_is_read_as_its_numbers(shard: str, k: int, n: int) -> None:
    assert shard_of(shard) == (k, n)


def test_each_guest_runs_its_side_of_the_exchange_then_its_half() -> None:
    a, b = _guest_cmd("a", "export PYPI=1"), _guest_cmd("b")
    assert "two_node a" in a and "TW_GUEST_SHARD=0/2 " in a
    assert a.endswith(f"; (export PYPI=1; TW_GUEST_SHARD=0/2 {PYPI_CMD})")
    assert "two_node b" in b and "TW_GUEST_SHARD=1/2 " in b and "PYPI" not in b
    assert _guest_cmd("b", "export PYPI=1").endswith(f"; (export PYPI=1; TW_GUEST_SHARD=1/2 {PYPI_CMD})")


def _side(role: str, pair_rc: int, suite: list[str], suite_rc: int, after: Sequence[str] = ()) -> list[str]:
    lines = ["TWO_NODE_OK", f"{_PAIR_SPLIT} {pair_rc}", *suite]
    lines += [f"{_SPLIT} {suite_rc}", *after]
    return [f"[{role}] {line}" for line in lines]


def _run2(a: list[str], b: list[str], host: Sequence[str] = ()) -> str:
    return "\n".join([*a, *b, *host])


def test_both_halves_make_one_suite_and_the_exchange_its_own_result() -> None:
    a = _side("a", 0, ["PASSED tests/verbs/x.py::one", "VERBS_STACK pyverbs 44"], 0, ["exit code 0"])
    b = _side("b", 0, ["PASSED tests/verbs/x.py::two", "SKIPPED [1] tests/verbs/y.py:3: dma-buf"], 0, ["exit code 0"])
    runs = parse_guests(0, _run2(a, b), debian_only=True)
    assert set(runs["single"]) == {"debian"}
    rc, suite = runs["single"]["debian"]
    expected = {"tests/verbs/x.py::one": "PASSED", "tests/verbs/x.py::two": "PASSED", "tests/verbs/y.py:3:": "SKIPPED"}
    assert rc == 0 and _results(suite) == expected
    assert "[guest] VERBS_STACK pyverbs 44" in suite and "TWO_NODE_OK" not in suite
    pair_rc, pair = runs["pair"]
    assert pair_rc == 0 and "[a] TWO_NODE_OK" in pair and "[b] TWO_NODE_OK" in pair and "x.py" not in pair


def test_a_failed_half_fails_the_suite_and_its_tracebacks_are_kept() -> None:
    failed = ["=== FAILURES ===", "Traceback of two", "=== short test summary info ===", "FAILED tests/verbs/x.py::two"]
    a = _side("a", 0, ["=== FAILURES ===", "Traceback of one", "=== short test summary info ==="], 1)
    runs = parse_guests(1, _run2(a, _side("b", 0, failed, 1)), debian_only=True)
    rc, suite = runs["single"]["debian"]
    assert rc == 1 and runs["pair"][0] == 0
    assert re.search("Traceback of one(.|\n)*Traceback of two", _failures(suite)), _failures(suite)
    runs = parse_guests(1, _run2(_side("a", 0, [], 0), _side("b", 0, failed, 1)), debian_only=True)
    assert runs["single"]["debian"][0] == 1


def test_the_pypi_halves_after_the_debian_halves_are_a_stack_of_their_own() -> None:
    a = _side("a", 0, ["PASSED tests/verbs/x.py::one"], 0, ["PASSED tests/verbs/x.py::pypi_one", "exit code 0"])
    b = _side("b", 0, ["PASSED tests/verbs/x.py::two"], 0, ["FAILED tests/verbs/x.py::pypi_two", "exit code 3"])
    runs = parse_guests(3, _run2(a, b), debian_only=False)
    assert runs["single"]["debian"][0] == 0 and "pypi_" not in runs["single"]["debian"][1]
    rc, pypi = runs["single"]["pypi"]
    assert rc == 3 and _results(pypi) == {
        "tests/verbs/x.py::pypi_one": "PASSED",
        "tests/verbs/x.py::pypi_two": "FAILED",
    }
    # a half that never got to its run on PyPI's pyverbs fails that run too
    b = [f"[b] {line}" for line in ("TWO_NODE_OK", f"{_PAIR_SPLIT} 0", "PASSED tests/verbs/x.py::two")]
    assert parse_guests(0, _run2(a, b), debian_only=False)["single"]["pypi"][0] == 99


def test_a_guest_that_did_not_get_past_the_exchange_fails_everything() -> None:
    a = ["[a] booting", "[a] exit code 1"]
    runs = parse_guests(1, _run2(a, _side("b", 0, [], 0), ["(killed after 2400 s)"]), debian_only=False)
    assert runs["pair"][0] == 1 and runs["single"]["debian"][0] == 1 and runs["single"]["pypi"][0] == 1
    assert "(killed after 2400 s)" in runs["pair"][1]


def test_a_half_killed_before_its_end_fails_the_suite_and_says_so() -> None:
    a = _side("a", 0, ["PASSED tests/verbs/x.py::one"], 0)
    b = [f"[b] {line}" for line in ("TWO_NODE_OK", f"{_PAIR_SPLIT} 0", "PASSED tests/verbs/x.py::two")]
    runs = parse_guests(0, _run2(a, b, ["(killed after 2400 s)"]), debian_only=True)
    rc, suite = runs["single"]["debian"]
    assert rc == 99 and suite.endswith("(killed after 2400 s)")
