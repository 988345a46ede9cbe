"""Where a transfer's time goes: marks in both processes of a benchmark, paired per transfer.

``install()`` wraps a few of tensorwire's own functions (``Peer``'s send and recv, the ucx
channel's, the device-event waits, the loop's epoll) so that each records the moment it ran, by
message where it knows one, or counts its calls and their time; ``save`` writes them out.
``phases`` pairs the sender's k-th data send with the receiver's k-th data recv, and the ucx
channel's marks by message id (the sender's, which the receiver's ``Arrival`` carries), and gives
per transfer the spans between them; ``print_cells`` prints their medians per cell of the
benchmark (a row's size and kind). Both processes run on one machine, whose
``time.perf_counter`` (CLOCK_MONOTONIC) they share, so marks of the two can be subtracted.

This is a diagnostic of the two-process benchmarks' ``--timeline`` (``ucx_seq.py``,
``gpu_p2p.py``, ``staged_p2p.py``), not an API: it wraps private functions by name, and
``install`` fails loudly where one is gone, so that a rename breaks the test that runs it
(tests/test_bench_timeline.py) rather than leaving spans empty. A mark costs a microsecond or a
few, which the spans include: a marked turn runs 10-50% slower than an unmarked one on a 2-core
machine.
"""

from __future__ import annotations

import functools
import inspect
import json
import selectors
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

_pc = time.perf_counter
MARKS: list[tuple[float, str, int]] = []  # (time, what, message id or -1)
_SLEPT: list[tuple[float, float]] = []  # epoll waits that blocked: (start, end)
_COUNT: dict[str, int] = defaultdict(int)


def _mark(what: str, msg: int = -1) -> None:
    MARKS.append((_pc(), what, msg))


def _count(label: str, n: int = 1) -> None:
    _COUNT[label] += n


def _wrap(owner: Any, name: str, before: Any = None, after: Any = None) -> None:
    """Replace ``owner.name`` (a function or method, sync or async) by one that calls
    ``before(*args)`` first and ``after(token, *args)`` once it has ended (returned or raised),
    ``token`` being what ``before`` returned."""
    orig = getattr(owner, name)  # (AttributeError: a wrapped function is gone; see the docstring)
    if inspect.iscoroutinefunction(orig):

        @functools.wraps(orig)
        async def wrapped_async(*a: Any, **k: Any) -> Any:
            token = None if before is None else before(*a, **k)
            try:
                return await orig(*a, **k)
            finally:
                if after is not None:
                    after(token, *a, **k)

        setattr(owner, name, wrapped_async)
    else:

        @functools.wraps(orig)
        def wrapped(*a: Any, **k: Any) -> Any:
            token = None if before is None else before(*a, **k)
            try:
                return orig(*a, **k)
            finally:
                if after is not None:
                    after(token, *a, **k)

        setattr(owner, name, wrapped)


def _timed(owner: Any, name: str, label: str) -> None:
    """Count ``owner.name``'s calls and sum the time they took, under ``label``."""

    def done(t0: float, *a: Any, **k: Any) -> None:
        _count(label)
        _count(label + " us", round((_pc() - t0) * 1e6))

    _wrap(owner, name, lambda *a, **k: _pc(), done)


def install() -> None:
    """Wrap what marks a transfer, in this process (the sender or the receiver)."""
    from tensorwire import _peer, memory
    from tensorwire.memory import _cuda, _engine, _pinned, _pipeline
    from tensorwire.tensors import _device
    from tensorwire.transports import _mailbox
    from tensorwire.transports._frames import FrameType
    from tensorwire.transports.tcp import _channel as tcp_ch
    from tensorwire.transports.ucx import _channel as ch
    from tensorwire.transports.ucx import _worker

    peer, ucx = _peer.Peer, ch.UcxChannel

    def data(**k: Any) -> bool:
        return k.get("tag") == "data"

    # the application's calls (the benchmark's data messages only)
    _wrap(peer, "send", lambda *a, **k: data(**k) and _mark("send>"), lambda t, *a, **k: data(**k) and _mark("send<"))
    _wrap(
        peer,
        "recv_with_receipt",
        lambda *a, **k: data(**k) and _mark("recv>"),
        lambda t, *a, **k: data(**k) and _mark("recv<"),
    )
    # the sender: its MSG frame, its payload
    _wrap(ucx, "_frame", lambda self, ftype, **k: ftype == FrameType.MSG and _mark("msg", k.get("msg_id", 0)))
    _wrap(
        ucx,
        "_send_payload",
        lambda self, msg_id, segs: _mark("payload>", msg_id),
        lambda t, self, msg_id, segs: _mark("payload<", msg_id),
    )
    # the receiver: the message seen, its payload receive posted, landed
    _wrap(ch._Arrival, "__init__", after=lambda t, self, *a, **k: _mark("arrived", k.get("msg_id", -1)))
    _wrap(ucx, "_post_payload", after=lambda t, self, arrival: _mark("posted", arrival.msg_id))
    # what the control handler and the payload post take, in all
    _timed(ucx, "_handle_frame", "control handler runs")
    _timed(ucx, "_post_payload", "payload receive posts")
    _wrap(ch, "_landed", lambda arrival: _mark("landed", arrival.msg_id))
    # waits for device events, counted by who waited: the ucx channel (a producer's stream before
    # a send), the tcp channel, the staging pipeline (its copies down, on the sender) and pool
    # (chunks whose copies still run), the mailbox and device landing (copies up), and the
    # benchmark's own stream waits after each CUDA receive (through ``tensorwire.memory``)
    for module, who in (
        (ch, "ucx channel"),
        (tcp_ch, "tcp channel"),
        (_pipeline, "staging pipeline"),
        (_pinned, "staging pool"),
        (_mailbox, "mailbox"),
        (_device, "device landing"),
        (memory, "benchmark"),
    ):
        _timed(module, "wait_event", f"event waits ({who})")
    _timed(ch, "_targets_ready", "ucx consumer-stream waits")
    # CUDA's own bookkeeping per message: reading torch's or CuPy's current stream, and asking a
    # stream for an event (``record_on``: none where the stream is idle)
    _timed(_device, "_stream", "framework stream reads")
    _timed(_cuda.CudaEngine, "record_on", "CUDA record_on calls")
    _wrap(_engine._Poller, "watch", lambda *a, **k: _count("poller watches"))
    _wrap(_worker.Worker, "_progress", lambda *a, **k: _count("progress runs"))

    orig_select = selectors.EpollSelector.select

    def select(self: Any, timeout: float | None = None) -> Any:
        if timeout == 0:
            return orig_select(self, timeout)
        t0 = _pc()
        got = orig_select(self, timeout)
        _SLEPT.append((t0, _pc()))
        if not got and timeout is not None and timeout > 0:
            _count("epoll timeouts")
        return got

    selectors.EpollSelector.select = select  # type: ignore[method-assign]


def save(path: Path) -> None:
    path.write_text(json.dumps({"marks": MARKS, "slept": _SLEPT, "counts": dict(_COUNT)}))


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())  # type: ignore[no-any-return]


def _asleep(slept: list[list[float]], t0: float, t1: float) -> float:
    """Seconds of [t0, t1] that a process spent blocked in epoll."""
    return sum(max(0.0, min(b, t1) - max(a, t0)) for a, b in slept)


# the spans of a transfer: (name, from mark, to mark); the sender's marks are send>, msg, payload>,
# payload< and send<, the receiver's recv>, arrived, posted, landed, recv< and next recv>
SPANS = [
    ("send (all of it)", "send>", "send<"),
    ("recv (all of it)", "recv>", "recv<"),
    ("send -> its MSG frame", "send>", "msg"),
    ("MSG frame -> receiver has it", "msg", "arrived"),
    ("recv -> payload receive posted", "recv>", "posted"),
    ("receiver has it -> payload receive posted", "arrived", "posted"),
    ("MSG frame -> payload send begins", "msg", "payload>"),
    ("payload send: producer wait + UCX", "payload>", "payload<"),
    ("payload receive posted -> landed", "posted", "landed"),
    ("landed -> payload send done", "landed", "payload<"),
    ("landed -> recv returns", "landed", "recv<"),
    ("payload send done -> send returns", "payload<", "send<"),
    ("send -> recv returns (one transfer)", "send>", "recv<"),
    ("recv returns -> next recv", "recv<", "next recv>"),
]


def phases(sender: dict[str, Any], receiver: dict[str, Any]) -> tuple[list[dict[str, float]], dict[str, Any]]:
    """Per data transfer, in order, the moment of each mark: the k-th ``send`` with the k-th
    ``recv``, and (ucx) the channel's marks of that send's message, by its id (the MSG frame
    built inside the send); and the two processes' counters."""
    rows: list[dict[str, float]] = []
    by_msg: dict[int, dict[str, float]] = {}
    current: dict[str, float] | None = None  # the send under way
    for t, what, msg in sender["marks"]:
        if what == "send>":
            current = {"send>": t}
            rows.append(current)
        elif what == "send<":
            if current is not None:
                current["send<"] = t
            current = None
        elif what == "msg" and current is not None and "msg" not in current:
            current["msg"] = t
            by_msg[msg] = current
        elif what in ("payload>", "payload<") and msg in by_msg:
            by_msg[msg].setdefault(what, t)
    recvs = [t for t, what, _ in receiver["marks"] if what == "recv>"]
    recv_ends = [t for t, what, _ in receiver["marks"] if what == "recv<"]
    for t, what, msg in receiver["marks"]:
        if what in ("arrived", "posted", "landed") and msg in by_msg:
            by_msg[msg].setdefault(what, t)
    for k, row in enumerate(rows):
        if k < len(recvs):
            row["recv>"] = recvs[k]
        if k < len(recv_ends):
            row["recv<"] = recv_ends[k]
        if k + 1 < len(recvs) and k + 1 < len(rows):  # (the benchmark's own: a CUDA one waits for its stream)
            row["next recv>"] = recvs[k + 1]
        if "send>" in row and "recv<" in row:
            row["sender asleep"] = _asleep(sender["slept"], row["send>"], row["recv<"])
            row["receiver asleep"] = _asleep(receiver["slept"], row["send>"], row["recv<"])
    counts = {"sender": sender["counts"], "receiver": receiver["counts"]}
    return rows, counts


def print_cells(rows: list[dict[str, float]], cells: list[tuple[str, int]]) -> None:
    """``rows`` (``phases``, in order) cut into the benchmark's cells, ``(title, transfers)`` in the
    order they ran; a table per title (cells of one title, turns of a row say, put together), the
    first transfer of each cell (its warm-up) left out."""
    if sum(n for _, n in cells) != len(rows):
        raise RuntimeError(f"timeline: {len(rows)} transfers marked, {sum(n for _, n in cells)} sent")
    tables: dict[str, list[dict[str, float]]] = {}
    at = 0
    for title, n in cells:
        mine = rows[at : at + n]
        at += n
        mine[-1].pop("next recv>", None)  # (the next cell's first recv, after the commands between)
        tables.setdefault(title, []).extend(mine[1:])
    for title, mine in tables.items():
        print_phases(title, mine)


def print_phases(title: str, rows: list[dict[str, float]]) -> None:
    """Medians of each span over the transfers, in microseconds."""
    print(f"\n{title}: {len(rows)} transfers, microseconds (median, p10-p90)")
    head = "| span                                      | median |     p10-p90 |   n |"
    print(head)
    print("|" + "|".join("-" * len(c) for c in head.split("|")[1:-1]) + "|")
    extra = [("sender asleep in epoll", None, "sender asleep"), ("receiver asleep in epoll", None, "receiver asleep")]
    for name, a, b in [*SPANS, *extra]:
        if a is None:
            vals = [r[b] * 1e6 for r in rows if b in r]
        else:
            vals = [(r[b] - r[a]) * 1e6 for r in rows if a in r and b in r]
        if not vals:
            continue  # (a span of the ucx channel's marks, in a row over another transport)
        q = statistics.quantiles(vals, n=10) if len(vals) > 1 else [vals[0]] * 9
        print(f"| {name:41} | {statistics.median(vals):6.1f} | {q[0]:5.0f}-{q[-1]:<5.0f} | {len(vals):3} |")


def print_counts(counts: dict[str, Any]) -> None:
    """Each process's counters over the marked run (event waits, poller, progress runs, epoll)."""
    for side in ("sender", "receiver"):
        c = counts[side]
        said = ", ".join(f"{k} {v}" for k, v in sorted(c.items()))
        print(f"{side}'s counters over the marked run: {said or 'none'}")


class Marked:
    """A benchmark's parent side of ``--timeline``: ``Marked(on)`` marks this process (the sender)
    when ``on``; ``child_args`` marks the receiving child (``child_begins``/``child_ends`` there);
    ``report(cells)``, once the child has ended, prints the tables of ``print_cells`` and the
    counters."""

    def __init__(self, on: bool) -> None:
        self._dir: tempfile.TemporaryDirectory[str] | None = None
        self.child_args: list[str] = []
        if on:
            self._dir = tempfile.TemporaryDirectory(prefix="tensorwire-timeline-")
            self.child_args = ["--timeline-dir", self._dir.name]
            install()

    def report(self, title: str, cells: list[tuple[str, int]]) -> None:
        if self._dir is None:
            return
        path = Path(self._dir.name)
        print(f"\n{title} (marked: a few microseconds more a transfer)")
        try:
            save(path / "sender.json")
            rows, counts = phases(load(path / "sender.json"), load(path / "receiver.json"))
        except (OSError, ValueError) as exc:  # (the child died before it wrote its marks)
            print(f"timeline: no marks of the receiver's: {exc}")
            return
        finally:
            self._dir.cleanup()
            self._dir = None
        try:
            print_cells(rows, cells)
        except RuntimeError as exc:  # (a row that failed part way: its transfers are not all there)
            print(exc)
        print_counts(counts)


def child_begins(args: Any) -> None:
    """The receiving child's side: marked where the parent asked (``--timeline-dir``)."""
    if getattr(args, "timeline_dir", None):
        install()


def child_ends(args: Any) -> None:
    if getattr(args, "timeline_dir", None):
        save(Path(args.timeline_dir) / "receiver.json")
