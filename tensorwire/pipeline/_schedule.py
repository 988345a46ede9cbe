"""Pipeline schedules as data: per stage, the list of actions (``F3`` = forward of microbatch 3,
``B3`` = its backward) that stage runs in order during one step.

A schedule is checked before it runs by playing it in unit time: at each step every stage runs
its next action if what that action needs is there (a forward needs the previous stage's forward
of the same microbatch, a backward the next stage's backward of it and this stage's own forward).
A schedule that gets stuck would deadlock the real pipeline, whatever the transport; one that
finishes gives the step-by-stage grid (``Schedule.grid``) and the bubble fraction. The error for
a bad schedule is that grid, played as far as it goes, with the stuck actions marked.

Sends never block a stage (they are tasks, awaited when the step ends) and every message has a
tag of its own (step, direction, microbatch), so the order in which one stage sends and its
neighbour receives does not matter, with one exception that the player models too: a receiver
holds at most ``Limits.max_unexpected`` unreceived messages from one peer (1024 by default). A
message sent while that many earlier ones on its link wait unreceived does not leave the sender
until one of them is received, so a stage that waits for it before receiving those waits forever.
"""

from __future__ import annotations

import enum
import numbers
import re
from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from dataclasses import dataclass

from .._checks import check_arguments
from ..errors import ScheduleError
from ..transports import Limits

__all__ = ["SCHEDULES", "Action", "Kind", "Schedule", "get_schedule", "gpipe", "one_f_one_b"]


class Kind(enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"


#: the one spelling of an action, the one ``str(action)`` writes and the driver sends each stage:
#: ASCII digits and no leading zero (``F0``, ``B12``), so that ``F03`` or a fullwidth or Arabic-Indic digit
#: cannot name the same action as ``F3`` or ``F1`` in a schedule someone reads
_ACTION = re.compile(r"([FB])(0|[1-9][0-9]*)", re.ASCII)


def _count(value: object) -> int | None:
    """``value`` as an int if it is an integer (numpy's too, from a config array), else None;
    a bool is not a count."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None
    return int(value)


@dataclass(frozen=True, slots=True)
class Action:
    """One unit of work on one stage: the forward or backward pass of one microbatch."""

    kind: Kind
    microbatch: int

    def __post_init__(self) -> None:
        if not isinstance(self.kind, Kind):
            raise ScheduleError(
                f"an Action's kind is Kind.FORWARD or Kind.BACKWARD, not {self.kind!r} "
                "(Action.parse reads the notation: Action.parse('F0'))"
            )
        microbatch = _count(self.microbatch)
        if microbatch is None or microbatch < 0:
            raise ScheduleError(f"an Action's microbatch is an int from 0, not {self.microbatch!r}")
        object.__setattr__(self, "microbatch", microbatch)

    def __str__(self) -> str:
        return f"{self.kind.value}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """``"F3"`` -> Action(FORWARD, 3)."""
        if not isinstance(text, str):
            raise ScheduleError(f"an action is a string such as 'F0' or 'B3', not {text!r}")
        match = _ACTION.fullmatch(text.strip())
        if match is None:
            raise ScheduleError(
                f"{text!r} is not an action: write F<microbatch> or B<microbatch> in ASCII digits with no "
                "leading zero, e.g. F0, B3, B12"
            )
        return cls(Kind(match[1]), int(match[2]))


def F(i: int) -> Action:  # noqa: N802 - reads like the notation
    return Action(Kind.FORWARD, i)


def B(i: int) -> Action:  # noqa: N802
    return Action(Kind.BACKWARD, i)


_Key = tuple[int, Kind, int]  # (stage, kind, microbatch)
_Link = tuple[int, Kind]  # the messages that ``stage`` receives of ``kind``: (stage, kind)

#: unreceived messages a receiver holds from one peer unless told otherwise (``Limits``' default)
DEFAULT_MAX_UNEXPECTED = Limits().max_unexpected
# how much of a bad schedule its error shows: the steps before it stopped, the first missing actions
_SHOWN_STEPS, _SHOWN_ACTIONS = 20, 8
_UNLIMITED = 2**63 - 1  # a max_unexpected no link reaches: a schedule's order alone is judged


@dataclass(slots=True)
class _Links:
    """The messages on each link, in the order they were sent, and how many wait unreceived."""

    limits: tuple[int, ...]  # per receiving stage
    sent: dict[_Link, list[int]]
    index: dict[_Key, int]  # (receiving stage, kind, microbatch) -> its place on the link
    waiting: dict[_Link, int]


@dataclass(frozen=True, slots=True)
class _Play:
    """What playing a schedule in unit time gave: the timeline, and where it got stuck."""

    rows: list[list[Action | None]]  # rows[step][stage]
    stuck: dict[int, str]  # stage -> why its next action cannot run
    missing: dict[int, list[Action]]  # stage -> actions it never runs


@dataclass(frozen=True, slots=True)
class Schedule:
    """Per stage, the actions of one training step in the order that stage runs them.

    ``str(schedule)`` is one line per stage (``stage 0: F0 F1 B0 B1``) and ``Schedule.parse``
    reads it back. ``validate()`` raises ScheduleError with the grid when the schedule cannot
    run; ``grid()`` draws the timeline; ``bubble`` is the idle fraction of that timeline.

    ``forward_only``: a schedule of forwards alone (``F0 F1 ...``), for a step that computes no
    gradients (``Pipeline.forward``); ``forwards()`` makes one from any schedule.
    """

    name: str
    num_microbatches: int
    stages: tuple[tuple[Action, ...], ...]
    forward_only: bool = False

    def __post_init__(self) -> None:
        # the types only (validate() judges the values), so that checking never fails with a
        # TypeError or AttributeError from deep inside the player
        m = _count(self.num_microbatches)
        if m is None:
            raise ScheduleError(f"num_microbatches must be an int, not {self.num_microbatches!r}")
        object.__setattr__(self, "num_microbatches", m)
        if isinstance(self.stages, (str, bytes, bytearray)) or not isinstance(self.stages, Iterable):
            raise ScheduleError(f"a Schedule's stages are one tuple of Actions per stage, not {self.stages!r}")
        stages = []
        for s, acts in enumerate(self.stages):
            if isinstance(acts, (str, bytes, bytearray)) or not isinstance(acts, Iterable):
                raise ScheduleError(f"stage {s}'s actions must be a tuple of Actions, not {acts!r}")
            row = tuple(acts)
            bad = next((a for a in row if not isinstance(a, Action)), None)
            if bad is not None:
                raise ScheduleError(
                    f"stage {s}'s actions must be Actions, not {bad!r} (Schedule.from_actions reads strings)"
                )
            stages.append(row)
        object.__setattr__(self, "stages", tuple(stages))
        if not isinstance(self.forward_only, bool):
            raise ScheduleError(f"forward_only must be a bool, not {self.forward_only!r}")

    def forwards(self) -> Schedule:
        """This schedule's forwards alone, in the order each stage runs them: the forward-only
        schedule of the same name (itself, if it is one)."""
        if self.forward_only:
            return self
        stages = tuple(tuple(a for a in acts if a.kind is Kind.FORWARD) for acts in self.stages)
        return Schedule(self.name, self.num_microbatches, stages, forward_only=True)

    @property
    def num_stages(self) -> int:
        """How many stages the schedule drives (one row of actions each)."""
        return len(self.stages)

    def __str__(self) -> str:
        return "\n".join(f"stage {s}: {' '.join(map(str, acts))}" for s, acts in enumerate(self.stages))

    @classmethod
    def parse(
        cls, text: str, *, num_microbatches: int | None = None, name: str = "custom", forward_only: bool = False
    ) -> Schedule:
        """Read ``stage 0: F0 F1 B0 B1`` lines (the ``stage N:`` prefix is optional, stages in
        order; blank lines are ignored). ``num_microbatches`` defaults to the largest microbatch named plus one."""
        if not isinstance(text, str):
            raise ScheduleError(f"Schedule.parse reads text, one line per stage, not {type(text).__name__}")
        stages: list[tuple[Action, ...]] = []
        for lineno, line in enumerate(text.splitlines()):
            if not line.strip():  # blank lines separate nothing
                continue
            head, sep, body = line.partition(":")
            if sep:
                label = head.strip().removeprefix("stage").strip()
                if label != str(len(stages)):
                    raise ScheduleError(f"line {lineno + 1}: expected 'stage {len(stages)}:', got {head.strip()!r}")
            else:
                body = head
            stages.append(tuple(Action.parse(tok) for tok in body.split()))
        if not stages:
            raise ScheduleError("a schedule needs at least one stage")
        if num_microbatches is None:
            num_microbatches = 1 + max((a.microbatch for acts in stages for a in acts), default=0)
        return cls(name, num_microbatches, tuple(stages), forward_only=forward_only)

    @classmethod
    def from_actions(
        cls, stages: Iterable[Iterable[Action | str]], num_microbatches: int, name: str = "custom"
    ) -> Schedule:
        """One list of actions (``Action`` or ``"F0"``) per stage, in stage order."""
        # (bytes are iterable too, as ints: b"1f1b" read as stage 0's actions 49, 102, ...)
        if isinstance(stages, (str, bytes, bytearray)) or not isinstance(stages, Iterable):
            raise ScheduleError(
                f"a schedule is a name ({', '.join(SCHEDULES)}), a Schedule, or one list of actions per "
                f"stage, not {stages!r}"
            )
        rows = []
        for s, acts in enumerate(stages):
            if isinstance(acts, str):  # iterated, it would give 'F', '0', ' ', ...
                raise ScheduleError(
                    f"stage {s}'s actions are one string, {acts!r}: give a list per stage "
                    f"({acts.split()!r}), or pass the one-line-per-stage text to Schedule.parse"
                )
            if isinstance(acts, (bytes, bytearray)) or not isinstance(acts, Iterable):
                raise ScheduleError(f"stage {s}'s actions must be a list of actions such as 'F0', not {acts!r}")
            rows.append(tuple(a if isinstance(a, Action) else Action.parse(a) for a in acts))
        return cls(name, num_microbatches, tuple(rows))

    # -- checking -----------------------------------------------------------------------------
    def _play(self, max_unexpected: int | Sequence[int] | None = None) -> _Play:
        p, m = self.num_stages, self.num_microbatches
        done: dict[_Key, int] = {}
        pos = [0] * p
        rows: list[list[Action | None]] = []
        links = _Links(_limits(max_unexpected, p), {}, {}, {})
        # each stage's actions as a set: whether a stage runs an action at all is asked at every
        # step a stage waits, and a scan of its row made the play quadratic in m
        runs = [frozenset(acts) for acts in self.stages]
        while True:
            row: list[Action | None] = [None] * p
            stuck: dict[int, str] = {}
            for s in range(p):
                if pos[s] >= len(self.stages[s]):
                    continue
                action = self.stages[s][pos[s]]
                why = self._blocked(s, action, done, pos, links, runs)
                if why is None:
                    row[s] = action
                else:
                    stuck[s] = why
            if not any(a is not None for a in row):
                break
            step = len(rows)
            for s, ran in enumerate(row):
                if ran is not None:
                    done[(s, ran.kind, ran.microbatch)] = step
                    pos[s] += 1
                    _travel(links, s, ran, p)
            rows.append(row)
        missing = {}
        kinds = (Kind.FORWARD,) if self.forward_only else tuple(Kind)
        if not stuck:
            for s in range(p):
                lack = [a for k in kinds for i in range(m) if (s, k, i) not in done for a in [Action(k, i)]]
                if lack:
                    missing[s] = lack
        return _Play(rows, stuck, missing)

    def _blocked(
        self, s: int, a: Action, done: dict[_Key, int], pos: list[int], links: _Links, runs: list[frozenset[Action]]
    ) -> str | None:
        """Why stage ``s`` cannot run ``a`` now (None: it can); ``runs``: each stage's actions."""
        p, m, i = self.num_stages, self.num_microbatches, a.microbatch
        if i >= m:
            return f"{a} names microbatch {i}, but the schedule has {m} (0..{m - 1})"
        if (s, a.kind, i) in done:
            return f"{a} runs a second time on stage {s} (first at step {done[(s, a.kind, i)]})"
        if a.kind is Kind.BACKWARD and self.forward_only:
            return f"{a} is a backward, and this schedule is forward-only"
        if a.kind is Kind.BACKWARD and (s, Kind.FORWARD, i) not in done:
            # every action before pos[s] has run, so an F(i) that did not run is still to come, if any
            later = F(i) in runs[s]
            return f"{a} comes before F{i} on stage {s}" if later else f"{a} but stage {s} never runs F{i}"
        n = s - 1 if a.kind is Kind.FORWARD else s + 1
        need = "activation" if a.kind is Kind.FORWARD else "gradient"
        if not 0 <= n < p:
            return None
        if (n, a.kind, i) in done:
            ahead, limit = _ahead(links, s, a.kind, i, done)
            if ahead < limit:
                return None
            return (
                f"{a} waits for the {need} of {a} from stage {n}, which cannot arrive: {ahead} {need}s sent "
                f"before it on that link are still unreceived, and stage {s} holds at most {limit} "
                f"unreceived messages from a neighbour (Limits.max_unexpected)"
            )
        there = pos[n] < len(self.stages[n])
        if a not in runs[n]:
            state = "which it never runs"
        elif there:
            state = f"which is stuck at {self.stages[n][pos[n]]}"
        else:
            state = "which has finished"
        return f"{a} waits for the {need} of {a} from stage {n}, {state}"

    def validate(self, *, max_unexpected: int | Sequence[int] | None = None) -> Schedule:
        """Raise ScheduleError, with the grid pointing at the problem, unless this schedule
        runs to the end: every microbatch forward then backward once on every stage, forwards
        in stage order, backwards in reverse, no stage waiting forever on a neighbour (a
        ``forward_only`` schedule: every microbatch forward once on every stage, and nothing else).

        ``max_unexpected`` is how many unreceived messages a stage holds from one neighbour
        (its node's ``Limits.max_unexpected``; one number for every stage or one per stage;
        default 1024): a message with that many unreceived ones ahead of it on its link stays
        with the sender, so a stage that waits for it before receiving those would wait forever."""
        if self.num_microbatches < 1:
            raise ScheduleError(f"a schedule needs at least one microbatch, not {self.num_microbatches}")
        if not self.stages:
            raise ScheduleError("a schedule needs at least one stage")
        play = self._play(max_unexpected)
        if play.stuck or play.missing:
            raise ScheduleError(self._explain(play))
        return self

    @property
    def valid(self) -> bool:
        """Whether ``validate()`` accepts the schedule (it says why not)."""
        try:
            self.validate()
        except ScheduleError:
            return False
        return True

    def timeline(self) -> list[list[Action | None]]:
        """``rows[step][stage]``: what each stage runs at each unit step (None: idle)."""
        self.validate()
        return self._play().rows

    @property
    def bubble(self) -> float:
        """Idle fraction of the unit-time timeline (forward and backward cost the same):
        (p-1)/(m+p-1) for GPipe and 1F1B."""
        rows = self.timeline()
        cells = len(rows) * self.num_stages
        return 1 - sum(a is not None for row in rows for a in row) / cells if cells else 0.0

    def peak_activations(self, stage: int) -> int:
        """Most microbatches whose forward ran and backward did not, on ``stage``: how many
        sets of activations that stage holds at once (m for GPipe, at most p-stage for 1F1B; 0
        for a forward-only schedule, which keeps none)."""
        s = _count(stage)
        if s is None or not 0 <= s < self.num_stages:
            raise ScheduleError(f"stage {stage!r} is not in 0..{self.num_stages - 1}")
        if self.forward_only:
            return 0
        stage = s
        live = peak = 0
        for a in self.stages[stage]:
            live += 1 if a.kind is Kind.FORWARD else -1
            peak = max(peak, live)
        return peak

    # -- drawing --------------------------------------------------------------------------------
    def grid(self, *, max_unexpected: int | Sequence[int] | None = None) -> str:
        """The step-by-stage timeline of a valid schedule, or of an invalid one as far as it runs,
        with the stuck actions marked ``>F3<`` in a last row."""
        return self._draw(self._play(max_unexpected))

    def _draw(self, play: _Play, steps: int | None = None) -> str:
        """``play``'s grid; with ``steps``, only its last that many steps (where it stopped) and
        a line that says which it left out."""
        p = self.num_stages
        width = max([len(f">{a}<") for acts in self.stages for a in acts] + [len(f"stage {p - 1}")])
        head = "step  " + " ".join(f"{'stage ' + str(s):<{width}}" for s in range(p))
        lines = [head.rstrip()]
        skipped = 0 if steps is None or len(play.rows) <= steps + 1 else len(play.rows) - steps
        if skipped:
            lines.append(f"{'...':>4}  steps 0..{skipped - 1} left out (Schedule.grid() draws them all)")
        for step, row in enumerate(play.rows[skipped:], start=skipped):
            cells = " ".join(f"{str(a) if a is not None else '.':<{width}}" for a in row)
            lines.append(f"{step:>4}  {cells}".rstrip())
        if play.stuck:
            ran = [sum(r[s] is not None for r in play.rows) for s in range(p)]
            marks = [f">{self.stages[s][ran[s]]}<" if s in play.stuck else "" for s in range(p)]
            lines.append(("stuck " + " ".join(f"{c:<{width}}" for c in marks)).rstrip())
        return "\n".join(lines)

    def _explain(self, play: _Play) -> str:
        p, m = self.num_stages, self.num_microbatches
        if play.stuck:
            roots = [s for s, why in sorted(play.stuck.items()) if "which is stuck at" not in why]
            if roots:
                what = f"stage {roots[0]}: {play.stuck[roots[0]]}"
            else:
                what = f"deadlock: stages {', '.join(map(str, sorted(play.stuck)))} wait on each other"
        else:
            first = min(play.missing)
            what = f"stage {first} never runs {_some(play.missing[first])}"
        lines = [f"schedule {self.name!r} (p={p}, m={m}) cannot run: {what}", self._draw(play, _SHOWN_STEPS)]
        lines += [f"  stage {s}: {why}" for s, why in sorted(play.stuck.items())]
        lines += [f"  stage {s} never runs {_some(acts)}" for s, acts in sorted(play.missing.items())]
        return "\n".join(lines)


def _some(actions: list[Action]) -> str:
    """The first ``_SHOWN_ACTIONS`` of ``actions``, and how many more there are."""
    shown = ", ".join(map(str, actions[:_SHOWN_ACTIONS]))
    more = len(actions) - _SHOWN_ACTIONS
    return f"{shown}, ... ({more} more)" if more > 0 else shown


#: iterables that are no sequence of per-stage limits
_NOT_PER_STAGE = (str, bytes, bytearray, memoryview, Mapping, Set)


def _limits(max_unexpected: int | Sequence[int] | None, p: int) -> tuple[int, ...]:
    if max_unexpected is None:
        return (DEFAULT_MAX_UNEXPECTED,) * p
    bad = ScheduleError(f"max_unexpected must be a positive int or one per stage ({p}), not {max_unexpected!r}")
    if isinstance(max_unexpected, numbers.Integral):
        given: tuple[object, ...] = (max_unexpected,) * p
    elif isinstance(max_unexpected, _NOT_PER_STAGE) or not isinstance(max_unexpected, Iterable):
        # text and bytes iterate to characters or ints, a dict to its keys, a set in no order;
        # a 0-d numpy array (a count from a config array) iterates not at all (numpy's TypeError)
        raise bad
    elif getattr(max_unexpected, "ndim", 1) != 1:
        raise bad
    else:
        given = tuple(max_unexpected)
    limits = tuple(_count(n) for n in given)
    if len(limits) != p or any(n is None or n < 1 for n in limits):
        raise bad
    return tuple(n for n in limits if n is not None)


def _travel(links: _Links, s: int, a: Action, p: int) -> None:
    """Stage ``s`` ran ``a``: it received its input (unless it is the first of its direction)
    and sent its output to the next stage in that direction (unless it is the last)."""
    to = s + 1 if a.kind is Kind.FORWARD else s - 1
    came = s - 1 if a.kind is Kind.FORWARD else s + 1
    if 0 <= came < p:
        links.waiting[(s, a.kind)] -= 1
    if 0 <= to < p:
        order = links.sent.setdefault((to, a.kind), [])
        links.index[(to, a.kind, a.microbatch)] = len(order)
        order.append(a.microbatch)
        links.waiting[(to, a.kind)] = links.waiting.get((to, a.kind), 0) + 1


def _ahead(links: _Links, s: int, kind: Kind, i: int, done: dict[_Key, int]) -> tuple[int, int]:
    """(unreceived messages sent before microbatch ``i``'s on the link into stage ``s``, the
    limit on that link). The receiver's message slots go to the oldest unreceived messages."""
    limit = links.limits[s]
    if links.waiting[(s, kind)] <= limit:  # every message on the link has its slot
        return 0, limit
    k = links.index[(s, kind, i)]
    received = sum((s, kind, j) in done for j in links.sent[(s, kind)][:k])
    return k - received, limit


# -- generators ---------------------------------------------------------------------------------
def _check_sizes(num_stages: int, num_microbatches: int) -> tuple[int, int]:
    """(p, m) as ints: positive integers (numpy's too)."""
    p, m = _count(num_stages), _count(num_microbatches)
    if p is None or p < 1:
        raise ScheduleError(f"num_stages must be a positive int, not {num_stages!r}")
    if m is None or m < 1:
        raise ScheduleError(f"num_microbatches must be a positive int, not {num_microbatches!r}")
    return p, m


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """GPipe: every stage runs all forwards, then all backwards. Holds m activations per stage."""
    p, m = _check_sizes(num_stages, num_microbatches)
    acts = tuple([F(i) for i in range(m)] + [B(i) for i in range(m)])
    return Schedule("gpipe", m, tuple(acts for _ in range(p)))


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """1F1B: stage s runs p-1-s forwards to fill the pipe, then alternates one forward and one
    backward, then drains the remaining backwards. Same bubble as GPipe, but stage s holds at
    most p-s microbatches' activations instead of m."""
    p, m = _check_sizes(num_stages, num_microbatches)
    stages = []
    for s in range(p):
        warmup = min(p - 1 - s, m)
        acts = [F(i) for i in range(warmup)]
        for i in range(m - warmup):
            acts += [F(warmup + i), B(i)]
        acts += [B(i) for i in range(m - warmup, m)]
        stages.append(tuple(acts))
    return Schedule("1f1b", m, tuple(stages))


SCHEDULES: dict[str, Callable[[int, int], Schedule]] = {"gpipe": gpipe, "1f1b": one_f_one_b}


def get_schedule(name: str) -> Callable[[int, int], Schedule]:
    """The generator of a named schedule: ``get_schedule("1f1b")(num_stages, num_microbatches)``."""
    key = name.lower().replace("-", "").replace("_", "") if isinstance(name, str) else name
    try:
        return SCHEDULES[key]
    except (KeyError, TypeError):
        hint = ""
        if isinstance(name, str) and any(_ACTION.fullmatch(tok) for tok in name.replace(":", " ").split()):
            # actions written out, as str(schedule) prints them: not a name misspelt
            hint = " (a schedule written out as text, one line of actions per stage, is read by Schedule.parse(text))"
        raise ScheduleError(f"no schedule named {name!r}; known: {', '.join(SCHEDULES)}{hint}") from None


@check_arguments
def make_schedule(
    schedule: str | Schedule | Sequence[Sequence[str]],
    num_stages: int,
    num_microbatches: int,
    *,
    max_unexpected: int | Sequence[int] | None = None,
    forward_only: bool = False,
) -> Schedule:
    """A validated schedule for ``num_stages`` and ``num_microbatches`` from a name, a Schedule or
    one list of actions per stage (``max_unexpected``: as in ``Schedule.validate``).
    ``forward_only``: for a step without backwards, which runs the schedule's forwards alone (a
    training schedule, one with backwards, must still be one a training step runs: an invalid
    schedule is refused whichever call uses it); otherwise a forward-only schedule is refused (a
    training step needs its backwards)."""
    # the sizes first, whatever the schedule: a Schedule's were only compared with them, so
    # p="2" was "for p=2 ...; this step has p=2" and True or 2.0 passed for 1 or 2
    num_stages, num_microbatches = _check_sizes(num_stages, num_microbatches)
    if isinstance(schedule, str):
        sched = get_schedule(schedule)(num_stages, num_microbatches)
    elif isinstance(schedule, Schedule):
        sched = schedule
    else:
        sched = Schedule.from_actions(schedule, num_microbatches)
    if sched.forward_only and not forward_only:
        raise ScheduleError(
            f"schedule {sched.name!r} is forward-only: a training step runs each microbatch's forward and "
            "backward on every stage (Pipeline.forward runs forward-only schedules)"
        )
    if sched.num_stages != num_stages or sched.num_microbatches != num_microbatches:
        raise ScheduleError(
            f"schedule {sched.name!r} is for p={sched.num_stages}, m={sched.num_microbatches}; "
            f"this step has p={num_stages}, m={num_microbatches}"
        )
    if forward_only:
        if any(a.kind is Kind.BACKWARD for acts in sched.stages for a in acts):
            # its order as a training step: the backwards do not run here, so the links' limits
            # are judged on the forwards alone, below
            sched.validate(max_unexpected=_UNLIMITED)
        sched = sched.forwards()
    return sched.validate(max_unexpected=max_unexpected)
