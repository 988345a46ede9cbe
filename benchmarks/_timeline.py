"""Where a ucx transfer's time goes: marks in both processes, merged per message.

``install(role)`` wraps a few of tensorwire's own functions (the ucx channel's, the mailbox's,
``Peer``'s, the device-event waits, the loop's epoll) so that each records the moment it ran, by
message where it knows one, and ``save`` writes them out. ``phases`` pairs the sender's marks
with the receiver's by message id (the sender's, which the receiver's ``Arrival`` carries) and
gives, per transfer, the spans between them; ``print_phases`` prints their medians. Both
processes run on one machine, whose ``time.perf_counter`` (CLOCK_MONOTONIC) they share, so
marks of the two can be subtracted.

This is a diagnostic of ``ucx_seq.py --timeline`` (the gpu_p2p pattern between two processes),
not an API: it wraps private functions by name, and ``install`` fails loudly where one is gone,
so that a rename breaks the test that runs it (tests/test_bench_cli.py) rather than leaving
spans empty. A mark costs about a microsecond, which the spans include.
"""

from __future__ import annotations

import functools
import json
import selectors
import statistics
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


def _wrap(owner: Any, name: str, before: Any = None, after: Any = None) -> None:
    """Replace ``owner.name`` (a function or method, sync or async) by one that calls ``before(*args)``
    first and ``after(result, *args)`` once it returned."""
    orig = getattr(owner, name)  # (AttributeError: a wrapped function is gone; see the docstring)
    if _is_async(orig):

        @functools.wraps(orig)
        async def wrapped_async(*a: Any, **k: Any) -> Any:
            if before is not None:
                before(*a, **k)
            r = await orig(*a, **k)
            if after is not None:
                after(r, *a, **k)
            return r

        setattr(owner, name, wrapped_async)
    else:

        @functools.wraps(orig)
        def wrapped(*a: Any, **k: Any) -> Any:
            if before is not None:
                before(*a, **k)
            r = orig(*a, **k)
            if after is not None:
                after(r, *a, **k)
            return r

        setattr(owner, name, wrapped)


def _is_async(fn: Any) -> bool:
    import inspect

    return inspect.iscoroutinefunction(fn)


def _timed(owner: Any, name: str, label: str) -> None:
    """Count ``owner.name`` (sync or async) and sum the time its calls took, under ``label``."""
    orig = getattr(owner, name)

    def count(t0: float) -> None:
        _COUNT[label] += 1
        _COUNT[label + " us"] += round((_pc() - t0) * 1e6)

    if _is_async(orig):

        @functools.wraps(orig)
        async def wrapped_async(*a: Any, **k: Any) -> Any:
            t0 = _pc()
            try:
                return await orig(*a, **k)
            finally:
                count(t0)

        setattr(owner, name, wrapped_async)
    else:

        @functools.wraps(orig)
        def wrapped(*a: Any, **k: Any) -> Any:
            t0 = _pc()
            try:
                return orig(*a, **k)
            finally:
                count(t0)

        setattr(owner, name, wrapped)


def install(role: str) -> None:
    """Wrap what marks a transfer, in this process (``role``: "sender" or "receiver")."""
    from tensorwire import _peer
    from tensorwire.memory import _engine
    from tensorwire.transports._frames import FrameType
    from tensorwire.transports.ucx import _channel as ch
    from tensorwire.transports.ucx import _worker

    peer, ucx = _peer.Peer, ch.UcxChannel

    def data(**k: Any) -> bool:
        return k.get("tag") == "data"

    # the application's calls (the benchmark's data messages only)
    _wrap(peer, "send", lambda *a, **k: data(**k) and _mark("send>"), lambda r, *a, **k: data(**k) and _mark("send<"))
    _wrap(
        peer,
        "recv_with_receipt",
        lambda *a, **k: data(**k) and _mark("recv>"),
        lambda r, *a, **k: data(**k) and _mark("recv<"),
    )
    # the sender: its MSG frame, its payload
    _wrap(ucx, "_frame", lambda self, ftype, **k: ftype == FrameType.MSG and _mark("msg", k.get("msg_id", 0)))
    _wrap(
        ucx,
        "_send_payload",
        lambda self, msg_id, segs: _mark("payload>", msg_id),
        lambda r, self, msg_id, segs: _mark("payload<", msg_id),
    )
    # the receiver: the message seen, its payload receive posted, landed
    _wrap(ch._Arrival, "__init__", after=lambda r, self, *a, **k: _mark("arrived", self.msg_id))
    _wrap(ucx, "_post_payload", after=lambda r, self, arrival: _mark("posted", arrival.msg_id))
    # what the control handler and the payload post take, in all
    _timed(ucx, "_handle_frame", "control handler runs")
    _timed(ucx, "_post_payload", "payload receive posts")
    _wrap(ch, "_landed", lambda arrival: _mark("landed", arrival.msg_id))
    # waits: device events (the producer's before a send, the consumer's before a receive)
    _timed(ch, "wait_event", "event waits (ucx channel)")
    _timed(ch, "_targets_ready", "consumer-stream waits")
    _wrap(_engine._Poller, "watch", lambda *a, **k: _COUNT.__setitem__("poller watches", _COUNT["poller watches"] + 1))
    _wrap(_worker.Worker, "_progress", lambda *a, **k: _COUNT.__setitem__("progress runs", _COUNT["progress runs"] + 1))

    orig_select = selectors.EpollSelector.select

    def select(self: Any, timeout: float | None = None) -> Any:
        if timeout == 0:
            return orig_select(self, timeout)
        t0 = _pc()
        got = orig_select(self, timeout)
        _SLEPT.append((t0, _pc()))
        if not got and timeout is not None and timeout > 0:
            _COUNT["epoll timeouts"] += 1
        return got

    selectors.EpollSelector.select = select  # type: ignore[method-assign]
    MARKS.clear()
    _mark(f"role:{role}")


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
    """Per data transfer, the moment of each mark (sender's and receiver's, by message id; the
    application's ``send``/``recv`` paired in order), and the two processes' counters."""
    per: dict[int, dict[str, float]] = defaultdict(dict)
    sends: list[float] = []
    send_ends: list[float] = []
    order: list[int] = []
    for t, what, msg in sender["marks"]:
        if what == "send>":
            sends.append(t)
        elif what == "send<":
            send_ends.append(t)
        elif what == "msg" and len(sends) > len(order):  # the first MSG frame after a data send
            order.append(msg)
            per[msg]["send>"] = sends[-1]
            per[msg]["msg"] = t
        elif msg in per and what in ("payload>", "payload<"):
            per[msg][what] = t
    for msg, end in zip(order, send_ends, strict=False):
        per[msg]["send<"] = end
    recvs = [t for t, what, _ in receiver["marks"] if what == "recv>"]
    recv_ends = [t for t, what, _ in receiver["marks"] if what == "recv<"]
    for t, what, msg in receiver["marks"]:
        if msg in per and what in ("arrived", "posted", "landed"):
            per[msg].setdefault(what, t)
    rows = []
    for k, msg in enumerate(order):
        row = per[msg]
        if k < len(recvs):
            row["recv>"] = recvs[k]
        if k < len(recv_ends):
            row["recv<"] = recv_ends[k]
        if k + 1 < len(recvs) and k + 1 < len(order):  # (the benchmark's own: a CUDA one waits for its stream)
            row["next recv>"] = recvs[k + 1]
        if "send>" in row and "recv<" in row:
            row["sender asleep"] = _asleep(sender["slept"], row["send>"], row["recv<"])
            row["receiver asleep"] = _asleep(receiver["slept"], row["send>"], row["recv<"])
        rows.append(row)
    counts = {"sender": sender["counts"], "receiver": receiver["counts"]}
    return rows, counts


def print_phases(title: str, rows: list[dict[str, float]], skip: int = 1) -> None:
    """Medians of each span over the transfers (after ``skip`` warm-up ones), in microseconds."""
    rows = rows[skip:]
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
            print(f"| {name:41} |      - |           - |   0 |")
            continue
        q = statistics.quantiles(vals, n=10) if len(vals) > 1 else [vals[0]] * 9
        print(f"| {name:41} | {statistics.median(vals):6.1f} | {q[0]:5.0f}-{q[-1]:<5.0f} | {len(vals):3} |")


def print_counts(counts: dict[str, Any]) -> None:
    """Each process's counters over the whole turn (event waits, poller, progress runs, epoll)."""
    for side in ("sender", "receiver"):
        c = counts[side]
        said = ", ".join(f"{k} {v}" for k, v in sorted(c.items()))
        print(f"{side}'s counters over the whole turn: {said or 'none'}")
