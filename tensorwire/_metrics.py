"""What moved and how, counted as it moves.

The data plane counts every transfer here in plain Python numbers (a dict lookup and a few
additions in a tally of its thread's own, under a microsecond), whether or not anyone asked for a Receipt; the
control plane counts the peers it opened, the connects that failed and the requests it refused.
Nothing here imports prometheus_client: ``tensorwire.metrics`` turns these numbers into
Prometheus metrics when something collects them.
"""

from __future__ import annotations

import bisect
import threading
import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._node import Node
    from ._path import Path
    from .transports import Receipt

#: upper bounds (seconds) of the transfer-time histogram's buckets
BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0)

_lock = threading.Lock()  # for what is shared between threads (not the transfers' tallies)
# Transfers are tallied per thread, so that counting one takes no lock: each thread that counts
# (an event loop's) has its own dict, listed in _tallies, which a snapshot sums. Key: (op,
# traffic, transport, protocol, direct, staged, memory); value: [transfers, bytes, sum of
# seconds, then the count of each BUCKETS' bucket and of the one above them (not cumulative)].
_Tally = dict[tuple[str, str, str, str, bool, bool, str], list[Any]]
_local = threading.local()
_tallies: list[_Tally] = []
# the tallies of threads that have ended, added up: a thread's tally leaves _tallies as it
# ends (a program that runs each job on a new thread with a loop of its own kept a tally for
# every thread it ever ran, and summed them all at each scrape)
_retired: _Tally = {}
# (transport, side, passed_over) -> peers opened
_peers: dict[tuple[str, str, str], int] = {}
# error class name -> failed connects
_connect_failures: dict[str, int] = {}
# what was refused or dropped ("control", "tcp", ...) -> how many
_refusals: dict[str, int] = {}
_nodes: weakref.WeakSet[Node] = weakref.WeakSet()
_EMPTY = [0, 0, 0.0] + [0] * (len(BUCKETS) + 1)
# tensorwire's own tag ranges and what travels on them, narrowest first ("messages": the rest)
_traffic: list[tuple[range, str]] = []
_reserved = range(0)  # from the lowest to the highest of them: anything outside is "messages"


def traffic_tags(tags: range, name: str) -> None:
    """Say that messages on ``tags`` are ``name``'s traffic (called by the layers that own
    reserved tags as they load: "rpc", "one-sided", "pipeline", "bench")."""
    global _reserved
    _traffic.append((tags, name))
    _traffic.sort(key=lambda entry: len(entry[0]))
    _reserved = range(min(r.start for r, _ in _traffic), max(r.stop for r, _ in _traffic))


def traffic_of(tag: int) -> str:
    """What a message on ``tag`` is for: "messages" (the user's own tags, pipeline activations
    among them), "rpc", "one-sided" (owner-assisted requests and replies), "pipeline" (a
    stage's hellos and aborts) or "bench"."""
    if tag in _reserved:
        for tags, name in _traffic:
            if tag in tags:
                return name
    return "messages"


class _Owner:
    """Held in a thread's local storage beside its tally: dropped when the thread ends."""

    __slots__ = ("__weakref__",)


def _mine() -> _Tally:
    """This thread's tally (made, and listed for snapshots, at its first count)."""
    try:
        mine: _Tally = _local.tally
    except AttributeError:
        mine = _local.tally = {}
        _local.owner = owner = _Owner()
        with _lock:
            _tallies.append(mine)
        weakref.finalize(owner, _retire, mine).atexit = False  # (at exit nobody reads them)
    return mine


def _retire(tally: _Tally) -> None:
    """A thread has ended: add its tally, which nothing counts into any more, to ``_retired``."""
    with _lock:
        _tallies[:] = [t for t in _tallies if t is not tally]
        for key, counts in tally.items():
            total = _retired.get(key)
            if total is None:
                _retired[key] = list(counts)
            else:
                for i, n in enumerate(counts):
                    total[i] += n


def moved(
    op: str,
    traffic: str,
    transport: str,
    protocol: str,
    direct: bool,
    staged: bool,
    memory: str,
    nbytes: int,
    seconds: float,
) -> None:
    """One transfer: ``op`` is "send" or "recv" (a message), "read" or "write" (one-sided).
    A recv is not timed: its time runs from its call, mostly a wait for the sender (tensorwire's
    own listening loops wait for as long as they serve)."""
    mine = _mine()
    key = (op, traffic, transport, protocol, direct, staged, memory)
    tally = mine.get(key)
    if tally is None:
        tally = mine[key] = _EMPTY.copy()
    tally[0] += 1
    tally[1] += nbytes
    if op != "recv":
        tally[2] += seconds
        tally[3 + bisect.bisect_left(BUCKETS, seconds)] += 1


def transferred(op: str, r: Receipt, tag: int | None = None) -> None:
    """One transfer, as its receipt tells it: a message on ``tag``, or a one-sided operation.
    (``moved``'s work, written out again: this runs for every message, and a call less is a
    tenth of its cost.)"""
    if tag is None:
        traffic = "one-sided"
    elif tag in _reserved:
        traffic = traffic_of(tag)
    else:
        traffic = "messages"
    try:
        mine: _Tally = _local.tally
    except AttributeError:
        mine = _mine()
    key = (op, traffic, r.transport, r.protocol, r.direct, r.staged, r.memory)
    tally = mine.get(key)
    if tally is None:
        tally = mine[key] = _EMPTY.copy()
    tally[0] += 1
    tally[1] += r.nbytes
    if op != "recv":
        seconds = r.seconds
        tally[2] += seconds
        tally[3 + bisect.bisect_left(BUCKETS, seconds)] += 1


_counting = (moved, transferred)


def _not_counted(*_: Any) -> None:
    return None


def count_transfers(on: bool) -> None:
    """Count transfers (the default), or not: off, ``moved`` and ``transferred`` do nothing."""
    global moved, transferred
    moved, transferred = _counting if on else (_not_counted, _not_counted)  # type: ignore[assignment]


def node_started(node: Node) -> None:
    with _lock:  # a scrape may be reading the set from another thread
        _nodes.add(node)


def peer_opened(side: str, path: Path, remote_instance: str) -> None:
    """A peer's data path opened; ``side`` is "connect" or "accept". The transports preferred
    over the one taken are part of the count: a fallback is visible at a glance. Not inproc for
    a peer whose node (``remote_instance``, its ``Node.instance_id``: node ids may repeat
    across processes) is not one of this process's: inproc never carries such a peer, and,
    first in the default order, it was named for every peer between two processes, so that
    each of them looked like a fallback. Names come from the other side too
    (a client's preference order, a server's reply: up to 32 of any 64 characters), so a name
    tensorwire does not know counts as "other": a peer that made up a new one at each connect
    made a new label value, kept for ever, each time."""
    from .transports import KNOWN  # (imported here: the transports import this module)

    with _lock:
        here = any(node.instance_id == remote_instance for node in _nodes)
    passed = dict.fromkeys(
        name if name in KNOWN else "other" for name, _ in path.passed_over if here or name != "inproc"
    )
    key = (path.transport, side, ",".join(passed))
    with _lock:
        _peers[key] = _peers.get(key, 0) + 1


def connect_failed(exc: BaseException) -> None:
    """Count a failed connect by the class of ``tensorwire.errors`` it is (a private subclass, such
    as the control client's NodeClosing, by the public class above it), else by its own name."""
    public = next((c for c in type(exc).__mro__ if c.__module__ == "tensorwire.errors"), type(exc))
    name = public.__name__
    with _lock:
        _connect_failures[name] = _connect_failures.get(name, 0) + 1


def refused(kind: str) -> None:
    with _lock:
        _refusals[kind] = _refusals.get(kind, 0) + 1


def snapshot() -> dict[str, Any]:
    """A consistent copy of every count (see ``tensorwire.metrics.snapshot``)."""
    with _lock:
        nodes = list(_nodes)
        # a transport's gauge says 0 once its last peer closed, rather than vanishing
        open_peers = {transport: 0 for transport, _, _ in _peers}
    stranded: dict[str, tuple[int, int]] = {}
    for node in nodes:
        for peer in list(node.peers):
            if not peer.closed:
                open_peers[peer.path.transport] = open_peers.get(peer.path.transport, 0) + 1
        for name, transport in list(node.transports.items()):
            sends, nbytes = transport.stranded()
            had = stranded.get(name, (0, 0))
            stranded[name] = (had[0] + sends, had[1] + nbytes)
    with _lock:
        # the ended threads' counts with the list of the others: a tally is in one or the other
        tallies = [{key: list(counts) for key, counts in _retired.items()}, *_tallies]
        peers, failures, refusals = dict(_peers), dict(_connect_failures), dict(_refusals)
    transfers: _Tally = {}
    for mine in tallies:
        # list() of a dict's items, and of a tally, is taken whole while its thread may be
        # counting (the interpreter lock is held throughout): a count is in it or not yet
        for key, tally in list(mine.items()):
            counts = list(tally)
            total = transfers.get(key)
            if total is None:
                transfers[key] = counts
            else:
                for i, n in enumerate(counts):
                    total[i] += n
    seconds: dict[tuple[str, str], list[Any]] = {}  # (op, transport) -> [buckets..., above, sum]
    for key, tally in transfers.items():
        if key[0] == "recv":
            continue
        hist = seconds.setdefault((key[0], key[2]), [0] * (len(BUCKETS) + 1) + [0.0])
        for i, n in enumerate(tally[3:]):
            hist[i] += n
        hist[-1] += tally[2]
    return {
        "transfers": {k: (v[0], v[1]) for k, v in transfers.items()},
        "seconds": seconds,
        "peers_opened": peers,
        "peers_open": open_peers,
        "connect_failures": failures,
        "refusals": refusals,
        "stranded": stranded,
    }
