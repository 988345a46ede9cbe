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

# Taken by the threads that change what is shared between threads, never by a scrape: a scrape
# copies what it reads whole, with dict() and list() of builtin containers, which run no Python
# code. (A scrape that held it while it built its copies could let go of the interpreter lock
# meanwhile, and an event loop counting a peer then waited for every other thread's turn: in 20 s
# of back-to-back scrapes from three threads, 307 waits of 1-36 ms, 1.75 s in all.)
_lock = threading.Lock()
# Transfers are tallied per thread, so that counting one takes no lock: each thread that counts
# (an event loop's) has its own dict, listed in _tallies, which a snapshot sums. Key: (op,
# traffic, transport, protocol, direct, staged, memory); value: [transfers, bytes, sum of
# seconds, then the count of each BUCKETS' bucket and of the one above them (not cumulative)].
_Tally = dict[tuple[str, str, str, str, bool, bool, str], list[Any]]
_local = threading.local()
# First, the tallies of the threads that have ended, added up: a thread's tally leaves the list
# as it ends (a program that runs each job on a new thread with a loop of its own kept a tally
# for every thread it ever ran, and summed them all at each scrape). The list, and that sum, are
# replaced, never changed, so that a scrape reads both at one moment without a lock: a tally is
# in the sum or in the list.
_tallies: list[_Tally] = [{}]
# (transport, side, passed_over) -> peers opened
_peers: dict[tuple[str, str, str], int] = {}
# error class name -> failed connects
_connect_failures: dict[str, int] = {}
# what was refused or dropped ("control", "tcp", ...) -> how many
_refusals: dict[str, int] = {}
# the nodes started here: weak references, which leave the set as their nodes go (a set, not a
# WeakSet, whose iteration is Python code: list() of a set is taken whole)
_nodes: set[weakref.ref[Node]] = set()
_EMPTY = [0, 0, 0.0] + [0] * (len(BUCKETS) + 1)
# tensorwire's own tag ranges and what travels on them, narrowest first ("messages": the rest)
_traffic: list[tuple[range, str]] = []
_reserved = range(0)  # from the lowest to the highest of them: anything outside is "messages"


def traffic_tags(tags: range, name: str) -> None:
    """Say that messages on ``tags`` are ``name``'s traffic (called by the layers that own
    reserved tags as they load: "rpc", "one-sided", "pipeline", "bench")."""
    global _traffic, _reserved
    with _lock:
        # a new list, not this one sorted in place: a loop in another thread may be counting a
        # message meanwhile, and a list being sorted is empty until the sort ends (an rpc
        # request counted then was the user's message)
        traffic = sorted([*_traffic, (tags, name)], key=lambda entry: len(entry[0]))
        _traffic = traffic
        _reserved = range(min(r.start for r, _ in traffic), max(r.stop for r, _ in traffic))


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
    global _tallies
    try:
        mine: _Tally = _local.tally
    except AttributeError:
        mine = _local.tally = {}
        _local.owner = owner = _Owner()
        with _lock:
            _tallies = [*_tallies, mine]
        weakref.finalize(owner, _retire, mine).atexit = False  # (at exit nobody reads them)
    return mine


def _retire(tally: _Tally) -> None:
    """A thread has ended: add its tally, which nothing counts into any more, to the sum of
    the ended threads'."""
    global _tallies
    with _lock:
        retired = {key: list(counts) for key, counts in _tallies[0].items()}
        for key, counts in tally.items():
            total = retired.setdefault(key, [0] * len(counts))
            for i, n in enumerate(counts):
                total[i] += n
        _tallies = [retired, *(t for t in _tallies[1:] if t is not tally)]


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
    if op == "recv":
        tally[0] += 1
        tally[1] += nbytes
    else:
        # the bucket first: between the additions no other thread takes its turn (they call
        # nothing), so that a scrape sees all of a transfer or none of it
        bucket = 3 + bisect.bisect_left(BUCKETS, seconds)
        tally[0] += 1
        tally[1] += nbytes
        tally[2] += seconds
        tally[bucket] += 1


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
    if op == "recv":
        tally[0] += 1
        tally[1] += r.nbytes
    else:
        seconds = r.seconds
        bucket = 3 + bisect.bisect_left(BUCKETS, seconds)  # (first: see moved)
        tally[0] += 1
        tally[1] += r.nbytes
        tally[2] += seconds
        tally[bucket] += 1


_counting = (moved, transferred)


def _not_counted(*_: Any) -> None:
    return None


def count_transfers(on: bool) -> None:
    """Count transfers (the default), or not: off, ``moved`` and ``transferred`` do nothing."""
    global moved, transferred
    moved, transferred = _counting if on else (_not_counted, _not_counted)  # type: ignore[assignment]


def node_started(node: Node) -> None:
    _nodes.add(weakref.ref(node, _nodes.discard))


def _live_nodes() -> list[Node]:
    return [node for ref in list(_nodes) if (node := ref()) is not None]


def peer_opened(side: str, path: Path, remote_instance: str) -> None:
    """A peer's data path opened; ``side`` is "connect" or "accept". The transports preferred
    over the one taken are part of the count: a fallback is visible at a glance. Not inproc for
    a peer whose node (``remote_instance``, its ``Node.instance_id``: node ids may repeat
    across processes) is not one of this process's: inproc never carries such a peer, and,
    first in the default order, it was named for every peer between two processes, so that
    each of them looked like a fallback. Names come from the other side too
    (a client's preference order, a server's reply: up to 32 of any 64 characters), so a name
    tensorwire does not know counts as "other": a peer that made up a new one at each connect
    made a new label value, kept for ever, each time. The names are sorted: one set, one value."""
    from .transports import KNOWN  # (imported here: the transports import this module)

    here = any(node.instance_id == remote_instance for node in _live_nodes())
    passed = {name if name in KNOWN else "other" for name, _ in path.passed_over if here or name != "inproc"}
    # sorted: in the order of the connect's preference, one set made a label value per order
    key = (path.transport, side, ",".join(sorted(passed)))
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
    tallies = _tallies  # (see _lock)
    peers, failures, refusals = dict(_peers), dict(_connect_failures), dict(_refusals)
    # a transport's gauge says 0 once its last peer closed, rather than vanishing
    open_peers = {transport: 0 for transport, _, _ in peers}
    stranded: dict[str, tuple[int, int]] = {}
    for node in _live_nodes():
        for peer in list(node.peers):
            if not peer.closed:
                open_peers[peer.path.transport] = open_peers.get(peer.path.transport, 0) + 1
        for name, transport in dict(node.transports).items():  # (it grows as the node starts)
            sends, nbytes = transport.stranded()
            had = stranded.get(name, (0, 0))
            stranded[name] = (had[0] + sends, had[1] + nbytes)
    transfers: _Tally = {}
    for mine in tallies:
        # a copy of a dict, and of a tally, is taken whole while its thread may be counting: a
        # count is in it or not yet. (Not list(mine.items()): on Python 3.11 the tuples it makes
        # can start a garbage collection, whose finalizers are Python code that lets the
        # counting thread in, and a key it added then failed the scrape.)
        for key, tally in mine.copy().items():
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
