"""Pipeline schedules as data: generation for any p and m, validation, the grid, parsing; and
bad arguments to the schedule API and to ``split``, which raise tensorwire errors."""

from __future__ import annotations

import graphlib
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorwire import ConfigurationError, ScheduleError, ShapeMismatchError, UnsupportedTensorError
from tensorwire.pipeline import Action, Kind, Schedule, get_schedule, gpipe, make_schedule, one_f_one_b, split
from tensorwire.testing import peak_allocation

sizes = st.tuples(st.integers(1, 8), st.integers(1, 24))


def runs(schedule: Schedule) -> bool:
    """An independent verdict: the schedule is complete (every F and B once per stage) and the
    graph of program order plus data dependencies has no cycle."""
    p, m = schedule.num_stages, schedule.num_microbatches
    want = sorted((k.value, i) for k in Kind for i in range(m))
    for acts in schedule.stages:
        if sorted((a.kind.value, a.microbatch) for a in acts) != want:
            return False
    graph: dict[tuple[int, str, int], set[tuple[int, str, int]]] = {}
    for s, acts in enumerate(schedule.stages):
        for j, a in enumerate(acts):
            node = (s, a.kind.value, a.microbatch)
            deps = graph.setdefault(node, set())
            if j:
                prev = acts[j - 1]
                deps.add((s, prev.kind.value, prev.microbatch))
            if a.kind is Kind.FORWARD and s > 0:
                deps.add((s - 1, "F", a.microbatch))
            if a.kind is Kind.BACKWARD:
                deps.add((s, "F", a.microbatch))
                if s < p - 1:
                    deps.add((s + 1, "B", a.microbatch))
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError:
        return False
    return True


@settings(max_examples=150, deadline=None)
@given(sizes, st.sampled_from(["gpipe", "1f1b"]))
def test_generated_schedules_are_valid_with_the_theoretical_bubble(size: tuple[int, int], name: str) -> None:
    p, m = size
    sched = get_schedule(name)(p, m)
    assert sched.num_stages == p and sched.num_microbatches == m
    sched.validate()
    assert runs(sched)
    for acts in sched.stages:
        assert sorted((a.kind.value, a.microbatch) for a in acts) == sorted(
            (k.value, i) for k in Kind for i in range(m)
        )
    rows = sched.timeline()
    assert len(rows) == 2 * (m + p - 1)  # fill, 2m units of work, drain
    assert sched.bubble == pytest.approx((p - 1) / (m + p - 1))
    for s in range(p):
        peak = sched.peak_activations(s)
        assert peak == (m if name == "gpipe" else min(p - s, m))
    assert Schedule.parse(str(sched), name=name) == sched


@st.composite
def perturbed(draw: st.DrawFn) -> Schedule:
    """A valid schedule with a few swaps, drops or duplicates: some still run, most do not."""
    p, m = draw(st.integers(1, 5)), draw(st.integers(1, 6))
    stages = [list(acts) for acts in draw(st.sampled_from([gpipe, one_f_one_b]))(p, m).stages]
    for _ in range(draw(st.integers(0, 3))):
        s = draw(st.integers(0, p - 1))
        acts = stages[s]
        op = draw(st.sampled_from(["swap", "drop", "dup", "move"]))
        j = draw(st.integers(0, len(acts) - 1))
        if op == "swap" and j + 1 < len(acts):
            acts[j], acts[j + 1] = acts[j + 1], acts[j]
        elif op == "drop" and len(acts) > 1:
            del acts[j]
        elif op == "dup":
            acts.insert(draw(st.integers(0, len(acts))), acts[j])
        elif op == "move":
            acts.insert(draw(st.integers(0, len(acts) - 1)), acts.pop(j))
    return Schedule("perturbed", m, tuple(tuple(a) for a in stages))


@settings(max_examples=400, deadline=None)
@given(perturbed())
def test_validation_agrees_with_the_dependency_graph(sched: Schedule) -> None:
    ok = runs(sched)
    assert sched.valid == ok, str(sched)
    if not ok:
        with pytest.raises(ScheduleError) as err:
            sched.validate()
        message = str(err.value)
        assert "cannot run" in message and "step  stage 0" in message
        assert ">" in message or "never runs" in message  # the grid points at the problem


def test_invalid_schedule_prints_the_grid_pointing_at_the_error() -> None:
    sched = Schedule.parse(
        """
        stage 0: F0 F1 B0 B1
        stage 1: F0 B1 F1 B0
        """
    )
    with pytest.raises(ScheduleError) as err:
        sched.validate()
    assert str(err.value) == (
        "schedule 'custom' (p=2, m=2) cannot run: stage 1: B1 comes before F1 on stage 1\n"
        "step  stage 0 stage 1\n"
        "   0  F0      .\n"
        "   1  F1      F0\n"
        "stuck >B0<    >B1<\n"
        "  stage 0: B0 waits for the gradient of B0 from stage 1, which is stuck at B1\n"
        "  stage 1: B1 comes before F1 on stage 1"
    )


def test_deadlock_between_neighbours_is_named() -> None:
    # stage 1 wants microbatch 1 first, but stage 0 will not send it before B0 comes back
    sched = Schedule.parse("F0 B0 F1 B1\nF1 F0 B0 B1")
    with pytest.raises(ScheduleError, match=r"deadlock: stages 0, 1 wait on each other") as err:
        sched.validate()
    assert "stuck >B0<    >F1<" in str(err.value)
    assert "F1 waits for the activation of F1 from stage 0, which is stuck at B0" in str(err.value)


@pytest.mark.parametrize(
    ("text", "m", "needle"),
    [
        ("F0 B0 F1 B1\nF0 B0 F1", 2, "stage 0: B1 waits for the gradient of B1 from stage 1, which it never runs"),
        ("F0 B0 F0 B0", 1, "F0 runs a second time on stage 0 (first at step 0)"),
        ("F0 F5 B0 B5", 2, "F5 names microbatch 5, but the schedule has 2 (0..1)"),
        ("F0 B0", 2, "stage 0 never runs F1, B1"),
        ("B0 F0", 1, "B0 comes before F0 on stage 0"),
    ],
)
def test_each_kind_of_mistake_is_explained(text: str, m: int, needle: str) -> None:
    with pytest.raises(ScheduleError) as err:
        Schedule.parse(text, num_microbatches=m).validate()
    assert needle in str(err.value)


def test_a_bad_schedule_of_many_microbatches_gets_an_error_a_user_can_read() -> None:
    """The error drew every step of the grid and listed every missing action: one B listed twice
    at the end of GPipe on 4 stages x 1000 microbatches was 2,009 lines (70 KB), and 500
    backwards missing on every stage a line of 3 KB a stage. It now draws the steps just before
    where the schedule got stuck, says how many it left out (``grid()`` draws them all), and
    lists the first missing actions and how many more."""
    stages = list(gpipe(4, 1000).stages)
    stages[0], stages[3] = stages[0][:-1], (*stages[3], stages[3][-1])
    with pytest.raises(ScheduleError) as err:
        Schedule("custom", 1000, tuple(stages)).validate()
    message = str(err.value)
    lines = message.splitlines()
    assert len(lines) < 40 and len(message) < 3000, f"{len(lines)} lines, {len(message)} bytes"
    assert lines[0] == (
        "schedule 'custom' (p=4, m=1000) cannot run: stage 3: B999 runs a second time on stage 3 (first at step 2002)"
    )
    assert lines[1] == "step  stage 0 stage 1 stage 2 stage 3"
    assert "steps 0..1984 left out (Schedule.grid() draws them all)" in lines[2]
    assert lines[3].startswith("1985  ") and "2002  B996    B997    B998    B999" in lines
    assert lines[-2:] == [
        "stuck                         >B999<",
        "  stage 3: B999 runs a second time on stage 3 (first at step 2002)",
    ]

    missing = tuple(
        tuple(a for a in acts if not (a.kind is Kind.BACKWARD and a.microbatch >= 500))
        for acts in gpipe(4, 1000).stages
    )
    with pytest.raises(ScheduleError) as err:
        Schedule("custom", 1000, missing).validate()
    message = str(err.value)
    assert len(message) < 3000, f"{len(message)} bytes"
    assert "cannot run: stage 0 never runs B500, B501, B502, B503, B504, B505, B506, B507, ... (492 more)" in message
    assert "  stage 3 never runs B500, B501, B502, B503, B504, B505, B506, B507, ... (492 more)" in message


def test_a_valid_grid() -> None:
    assert one_f_one_b(2, 2).grid() == (
        "step  stage 0 stage 1\n   0  F0      .\n   1  F1      F0\n   2  .       B0\n"
        "   3  B0      F1\n   4  .       B1\n   5  B1      ."
    )


def test_names_parsing_and_sizes() -> None:
    assert get_schedule("1F1B") is one_f_one_b and get_schedule("GPipe") is gpipe
    with pytest.raises(ScheduleError, match="known: gpipe, 1f1b"):
        get_schedule("interleaved")
    assert Action.parse(" B12 ") == Action(Kind.BACKWARD, 12) and str(Action(Kind.FORWARD, 3)) == "F3"
    for bad in ("X1", "F", "F-1", "f1"):
        with pytest.raises(ScheduleError, match="is not an action"):
            Action.parse(bad)
    with pytest.raises(ScheduleError, match="expected 'stage 1:'"):
        Schedule.parse("stage 0: F0 B0\nstage 2: F0 B0")


@pytest.mark.parametrize("bad", ["F00", "F03", "B010", "F\u0661", "F\uff11", "B1\u0663", "F\u00b2", "F+1", "F 1"])
def test_action_parse_refuses_all_but_the_printed_spelling(bad: str) -> None:
    # str(action) is the one spelling (ASCII digits, no leading zero) and what the driver sends
    # each stage: another spelling of the same microbatch is refused when it is read, naming it
    with pytest.raises(ScheduleError, match="is not an action") as info:
        Action.parse(bad)
    assert repr(bad) in str(info.value)
    with pytest.raises(ScheduleError, match="is not an action"):
        Schedule.parse(f"stage 0: F0 {bad}")
    with pytest.raises(ScheduleError, match="is not an action"):
        Schedule.from_actions([["F0", bad]], 2)


@given(st.sampled_from(Kind), st.integers(min_value=0, max_value=10**6))
def test_action_round_trips_through_its_text(kind: Kind, microbatch: int) -> None:
    action = Action(kind, microbatch)
    assert Action.parse(str(action)) == action and str(Action.parse(str(action))) == str(action)
    for p, m in [(0, 4), (4, 0), (True, 3), (2, 1.5)]:
        with pytest.raises(ScheduleError):
            gpipe(p, m)  # type: ignore[arg-type]
    with pytest.raises(ScheduleError, match="for p=2, m=3; this step has p=4, m=3"):
        make_schedule(gpipe(2, 3), 4, 3)
    assert make_schedule([["F0", "B0"], ["F0", "B0"]], 2, 1).valid
    assert issubclass(ScheduleError, ConfigurationError)


def test_blank_lines_are_ignored() -> None:
    want = Schedule.parse("stage 0: F0 B0\nstage 1: F0 B0")
    for text in ("stage 0: F0 B0\n\nstage 1: F0 B0", "F0 B0\n   \nF0 B0\n\n", "\n\nstage 0: F0 B0\n\t\nstage 1: F0 B0"):
        got = Schedule.parse(text)
        assert got == want and got.valid, text


@pytest.mark.parametrize(
    ("call", "error", "needle"),
    [
        (lambda: make_schedule(None, 2, 2), ScheduleError, "a schedule is a name (gpipe, 1f1b), a Schedule, or"),
        (lambda: make_schedule(3, 2, 2), ScheduleError, "one list of actions per stage, not 3"),
        (lambda: make_schedule([[0, 1]], 1, 1), ScheduleError, "an action is a string such as 'F0' or 'B3', not 0"),
        (lambda: make_schedule([None], 1, 1), ScheduleError, "stage 0's actions must be a list of actions"),
        (lambda: Action.parse(3), ScheduleError, "an action is a string"),
        (lambda: Schedule.parse(None), ScheduleError, "Schedule.parse reads text, one line per stage, not NoneType"),
        (lambda: Schedule.parse("F0 B0", num_microbatches=1.5), ScheduleError, "num_microbatches must be an int"),
        (lambda: Action("F", 0), ScheduleError, "an Action's kind is Kind.FORWARD or Kind.BACKWARD, not 'F'"),
        (lambda: Action(Kind.FORWARD, -1), ScheduleError, "an Action's microbatch is an int from 0, not -1"),
        (lambda: Schedule("x", 1, (("F0", "B0"),)), ScheduleError, "stage 0's actions must be Actions, not 'F0'"),
        (lambda: Schedule.parse("F0 B0").peak_activations(5), ScheduleError, "stage 5 is not in 0..0"),
        (lambda: Schedule.parse("F0 B0").validate(max_unexpected="4"), ScheduleError, "max_unexpected must be"),
        (lambda: split(np.float32(1.0), 1), ShapeMismatchError, "a 0-d tensor (float32) has no first dimension"),
        (lambda: split(None, 1), UnsupportedTensorError, "a batch is a tensor, a list of samples, or a tuple"),
        (
            lambda: split({"ids": np.zeros((4, 2)), "mask": np.zeros(3)}, 2),
            ShapeMismatchError,
            "element 'mask' of the batch has 3 samples but element 'ids' has 4",
        ),
        (lambda: split(np.zeros(4), 2.0), ConfigurationError, "microbatches must be a positive int, not 2.0"),
    ],
    ids=[
        "schedule-None",
        "schedule-int",
        "action-int",
        "stage-None",
        "Action.parse-int",
        "parse-None",
        "m-float",
        "Action-str-kind",
        "Action-negative",
        "Schedule-of-strings",
        "peak-bad-stage",
        "limit-str",
        "split-scalar",
        "split-None",
        "split-dict-lengths",
        "split-float-m",
    ],
)
def test_bad_arguments_raise_tensorwire_errors(call: Callable[[], Any], error: type[Exception], needle: str) -> None:
    # the old code raised TypeError, AttributeError or IndexError from deep inside
    with pytest.raises(error) as err:
        call()
    assert needle in str(err.value), err.value


@pytest.mark.parametrize(
    "limit",
    [np.array(4), b"\x04\x04", bytearray(b"\x04\x04"), {4: "a", 5: "b"}, {4, 5}],
    ids=["0-d-array", "bytes", "bytearray", "dict", "set"],
)
def test_max_unexpected_is_one_int_or_a_sequence_of_one_per_stage(limit: Any) -> None:
    # a 0-d numpy array raised numpy's TypeError ("iteration over a 0-d array") from _limits;
    # bytes were taken as the ints they iterate to (b"\x04\x04": limits 4 and 4), a dict as its
    # keys and a set in whatever order it iterates
    sched = gpipe(2, 2)
    with pytest.raises(ScheduleError, match=r"max_unexpected must be a positive int or one per stage \(2\)"):
        sched.validate(max_unexpected=limit)
    with pytest.raises(ScheduleError, match="max_unexpected must be"):
        make_schedule("gpipe", 2, 2, max_unexpected=limit, forward_only=True)
    for fine in (4, np.int64(4), [4, 4], (4, np.int64(4)), np.array([4, 4]), iter([4, 4])):
        assert sched.validate(max_unexpected=fine) is sched


def test_one_string_per_stage_is_explained() -> None:
    with pytest.raises(ScheduleError) as err:
        make_schedule(["F0 F1 B0 B1", "F0 F1 B0 B1"], 2, 2)  # not "'F' is not an action"
    assert "stage 0's actions are one string, 'F0 F1 B0 B1': give a list per stage (['F0', 'F1', 'B0', 'B1'])" in (
        str(err.value)
    )
    assert "Schedule.parse" in str(err.value)


@pytest.mark.parametrize("text", [str(gpipe(2, 2)), "F0 F1 B0 B1", "stage 0: F0 B0"])
def test_a_schedule_written_out_as_text_is_pointed_to_schedule_parse(text: str) -> None:
    # the old error took the text for a misspelt name: "no schedule named 'stage 0: F0 F1 B0 B1\nstage 1:
    # ...'; known: gpipe, 1f1b", though it is what str(schedule) prints and Schedule.parse reads
    with pytest.raises(ScheduleError) as err:
        make_schedule(text, 2, 2)
    assert "Schedule.parse" in str(err.value), err.value
    with pytest.raises(ScheduleError) as err:
        make_schedule("interleaved", 2, 2)  # a name is still only a name
    assert "Schedule.parse" not in str(err.value) and "known: gpipe, 1f1b" in str(err.value)


@pytest.mark.parametrize(
    ("schedule", "needle"),
    [
        (b"1f1b", "a schedule is a name (gpipe, 1f1b), a Schedule, or one list of actions per stage, not b'1f1b'"),
        (bytearray(b"gpipe"), "not bytearray(b'gpipe')"),
        ([b"F0 B0", b"F0 B0"], "stage 0's actions must be a list of actions such as 'F0', not b'F0 B0'"),
    ],
    ids=["bytes", "bytearray", "bytes-per-stage"],
)
def test_a_schedule_in_bytes_is_named_as_given(schedule: Any, needle: str) -> None:
    # bytes were iterated as ints: "stage 0's actions must be a list of actions such as 'F0', not 49"
    # for b"1f1b", "an action is a string such as 'F0' or 'B3', not 70" for [b"F0 B0", ...]
    with pytest.raises(ScheduleError) as err:
        make_schedule(schedule, 2, 1)
    assert needle in str(err.value), err.value
    with pytest.raises(ScheduleError) as err:
        Schedule("x", 1, schedule)  # "stage 0's actions must be ..., not 49" (or 70)
    assert repr(schedule[0] if isinstance(schedule, list) else schedule) in str(err.value), err.value


def test_numpy_integers_are_counts() -> None:
    # from a numpy config array, say: np.int64 is an integer like any other (bools are not)
    p, m = np.int64(2), np.int64(4)
    for make in (gpipe, one_f_one_b):
        sched = make(p, m)  # type: ignore[arg-type]
        assert sched.valid and sched == make(2, 4) and type(sched.num_microbatches) is int
    assert make_schedule("1f1b", 2, m, max_unexpected=np.int64(1)) == one_f_one_b(2, 4)  # type: ignore[arg-type]
    assert make_schedule([["F0", "B0"]], 1, np.int64(1)).valid  # type: ignore[arg-type]
    assert Action(Kind.FORWARD, np.int64(3)) == Action.parse("F3")  # type: ignore[arg-type]
    assert [len(c) for c in split(np.zeros(10), m)] == [3, 3, 2, 2]  # type: ignore[arg-type]
    with pytest.raises(ScheduleError, match="num_microbatches must be a positive int"):
        gpipe(2, np.bool_(True))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("schedule", "p", "m", "needle"),
    [
        (gpipe(2, 2), "2", 2, "num_stages must be a positive int, not '2'"),
        (gpipe(2, 2), 2, 2.0, "num_microbatches must be a positive int, not 2.0"),
        (gpipe(1, 1), True, 1, "num_stages must be a positive int, not True"),
        ([["F0", "B0"], ["F0", "B0"]], 2.0, 1, "num_stages must be a positive int, not 2.0"),
    ],
    ids=["Schedule-p-str", "Schedule-m-float", "Schedule-p-bool", "lists-p-float"],
)
def test_make_schedule_checks_the_sizes_it_is_given_with_a_schedule(schedule: Any, p: Any, m: Any, needle: str) -> None:
    # with a Schedule or per-stage lists, the old make_schedule only compared the sizes: p="2"
    # said "schedule 'gpipe' is for p=2, m=2; this step has p=2, m=2", and True or 2.0 passed
    # (True == 1, 2.0 == 2), as a name's generator refuses them
    with pytest.raises(ScheduleError) as err:
        make_schedule(schedule, p, m)
    assert needle in str(err.value), err.value


def _alternating(p: int, m: int) -> Schedule:
    """Odd stages take their forwards, even stages their backwards, in reverse order: a valid
    schedule in which the stages wait for each other most of the time."""
    rows = []
    for s in range(p):
        forwards = range(m) if s % 2 == 0 else reversed(range(m))
        backwards = range(m) if s % 2 == 1 else reversed(range(m))
        rows.append([f"F{i}" for i in forwards] + [f"B{i}" for i in backwards])
    return Schedule.from_actions(rows, m, name="alternating")


def _calls_per_cell(sched: Schedule) -> float:
    """Python calls made by ``validate()`` per cell (step x stage) of the schedule's timeline."""
    calls = 0

    def count(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        calls += event == "call"

    before = sys.getprofile()
    sys.setprofile(count)
    try:
        sched.validate()
    finally:
        sys.setprofile(before)
    return calls / (len(sched.timeline()) * sched.num_stages)


def test_validating_costs_the_same_per_step_of_the_timeline_whatever_the_microbatch_count() -> None:
    # the old player scanned a stage's whole row each time a stage waited (does the neighbour
    # run this action at all?): 42 calls per cell at m=32, 132 at m=128, and pipe.step held its
    # event loop 98 s validating this valid schedule for 8 stages and 1000 microbatches
    small, large = _calls_per_cell(_alternating(4, 32)), _calls_per_cell(_alternating(4, 128))
    assert large <= 1.25 * small, (small, large)


def _valid(sched: Schedule, max_unexpected: int) -> bool:
    try:
        sched.validate(max_unexpected=max_unexpected)
    except ScheduleError:
        return False
    return True


def _reverse(m: int) -> Schedule:
    """Stage 1 takes its forwards in reverse order: each needs every activation sent before it."""
    return Schedule.from_actions(
        [
            [f"F{i}" for i in range(m)] + [f"B{i}" for i in range(m)],
            [f"F{i}" for i in reversed(range(m))] + [f"B{i}" for i in range(m)],
        ],
        m,
        name="reverse",
    )


def test_the_message_limit_of_a_link_is_played() -> None:
    # a receiver holds at most max_unexpected unreceived messages from one neighbour: the rest
    # stay with the sender until one is received, so waiting for one of them first deadlocks
    sched = _reverse(3)
    assert sched.valid  # 1024 by default
    sched.validate(max_unexpected=3)
    with pytest.raises(ScheduleError) as err:
        sched.validate(max_unexpected=2)
    assert str(err.value) == (
        "schedule 'reverse' (p=2, m=3) cannot run: stage 1: F2 waits for the activation of F2 from stage 0, "
        "which cannot arrive: 2 activations sent before it on that link are still unreceived, and stage 1 holds "
        "at most 2 unreceived messages from a neighbour (Limits.max_unexpected)\n"
        "step  stage 0 stage 1\n"
        "   0  F0      .\n"
        "   1  F1      .\n"
        "   2  F2      .\n"
        "stuck >B0<    >F2<\n"
        "  stage 0: B0 waits for the gradient of B0 from stage 1, which is stuck at F2\n"
        "  stage 1: F2 waits for the activation of F2 from stage 0, which cannot arrive: 2 activations sent "
        "before it on that link are still unreceived, and stage 1 holds at most 2 unreceived messages from a "
        "neighbour (Limits.max_unexpected)"
    )
    # gradients too, and per stage: stage 0 receives B2 B1 B0 and wants B0 first
    backwards = Schedule.parse("F0 F1 F2 B0 B1 B2\nF0 F1 F2 B2 B1 B0")
    backwards.validate(max_unexpected=[3, 1])  # stage 1 receives activations in order
    with pytest.raises(ScheduleError, match="stage 0: B0 waits for the gradient of B0 from stage 1, which cannot"):
        backwards.validate(max_unexpected=[2, 1024])
    # the default limit: what the probe ran into at 1100 microbatches
    _reverse(1000).validate()
    with pytest.raises(ScheduleError, match="1099 activations sent before it on that link are still unreceived"):
        _reverse(1100).validate()
    for bad in (0, [4], [1, 0], True):
        with pytest.raises(ScheduleError, match="max_unexpected must be"):
            sched.validate(max_unexpected=bad)  # type: ignore[arg-type]
    assert make_schedule("gpipe", 2, 3, max_unexpected=1).valid
    assert sched.grid(max_unexpected=2).endswith("stuck >B0<    >F2<")


@settings(max_examples=150, deadline=None)
@given(perturbed(), st.integers(1, 8))
def test_a_limit_binds_only_past_the_messages_in_flight(sched: Schedule, limit: int) -> None:
    # a link carries m messages a step, so a limit of m or more never binds; gpipe and 1f1b
    # receive in the order they send, so no limit binds them at all
    m = sched.num_microbatches
    assert sched.valid == _valid(sched, max(limit, m))
    for make in (gpipe, one_f_one_b):
        make(sched.num_stages, m).validate(max_unexpected=1)


@pytest.mark.timeout(60)
def test_importing_the_pipeline_needs_no_torch() -> None:
    code = (
        "import sys, tensorwire\n"
        "assert 'tensorwire.pipeline' not in sys.modules\n"
        "from tensorwire.pipeline import FunctionPart, Stage, get_schedule\n"
        "assert tensorwire.pipeline.Stage is Stage and get_schedule('gpipe')(2, 2).valid\n"
        "assert 'torch' not in sys.modules, 'the pipeline imported torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_scalar_in_a_batch_is_not_repeated_before_the_split_is_known_to_fit() -> None:
    # the old split made each plain scalar's column, a list of one entry per microbatch, before
    # it split the tensors: 10**7 microbatches of a 4-sample batch allocated 80 MB first
    with peak_allocation() as mem, pytest.raises(ShapeMismatchError, match="a batch of 4 cannot be split into"):
        split((1.0, np.zeros(4)), 10**7)
    assert mem["peak"] < 1 << 20, mem
    assert split({"lr": 0.5, "x": np.arange(3)}, 2)[1]["lr"] == 0.5
