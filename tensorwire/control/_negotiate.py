"""Choosing the data path: the first transport in the preference order that both nodes can use
and that satisfies the ``require=`` policy. Every transport passed over gets a reason."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ..errors import ConfigurationError, NegotiationError
from ..transports import Capabilities, Transport

__all__ = [
    "MAX_TRANSPORTS",
    "REQUIRE",
    "Choice",
    "Offer",
    "as_accepted",
    "check_require",
    "choose",
    "shortfall",
]

REQUIRE = ("any", "rdma", "gpudirect")
MAX_TRANSPORTS = 32  # names in a preference order, offers or reasons in one handshake


@dataclass(frozen=True, slots=True)
class Offer:
    name: str
    version: int
    address: bytes
    capabilities: Capabilities


@dataclass(frozen=True, slots=True)
class Choice:
    name: str
    passed_over: tuple[tuple[str, str], ...]


def check_require(require: str) -> str:
    if require not in REQUIRE:
        raise ConfigurationError(f"require={require!r}; expected one of {', '.join(REQUIRE)}")
    return require


def _meets(require: str, caps: Capabilities, side: str) -> str | None:
    """Why ``caps`` (those of ``side``) fall short of ``require`` (None: they do not)."""
    if require == "rdma" and not caps.rdma:
        return f"has no RDMA lane on {side} ({_lanes_text(caps.lanes)})"
    if require == "gpudirect" and not caps.gpudirect:
        return f"cannot move GPU memory directly to the NIC on {side} (no GPUDirect)"
    return None


def shortfall(
    require: str, mine: Capabilities, theirs: Capabilities, used: tuple[str, ...], local_name: str, remote_name: str
) -> str | None:
    """Why a transport whose capabilities are ``mine`` here (``local_name``) and ``theirs`` at the
    other end falls short of ``require`` (None: it does not); ``used``: the lanes its endpoint
    between the two would really use (``()``: not known). The server judges its choice so, and
    the client the server's answer: a server that ignores ``require=`` (an older or faked one)
    must not hand it a slower path than it asked for."""
    why = _meets(require, mine, local_name) or _meets(require, theirs, remote_name)
    if why is None and require != "any" and used and not rdma_lane(used):
        # both sides list RDMA, but the endpoint between them has none (one machine: shared
        # memory), and the path would say rdma=False: not what was required
        why = f"has no RDMA lane between {local_name} and {remote_name} ({', '.join(used)})"
    return why


def _lanes_text(lanes: tuple[str, ...], most: int = 8, chars: int = 40) -> str:
    """Lanes as a refusal names them: a client's come from its handshake, of any number and
    length (32 lanes of 100 KB made a 3 MB refusal, logged whole and too big for gRPC)."""
    if not lanes:
        return "no lanes listed"
    shown = [lane if len(lane) <= chars else lane[: chars - 3] + "..." for lane in lanes[:most]]
    more = f", and {len(lanes) - most} more" if len(lanes) > most else ""
    return ", ".join(shown) + more


def tcp_lanes_only(lanes: tuple[str, ...]) -> bool:
    """Every lane (UCX's "transport/device" names) is tcp: bytes through the kernel's TCP stack."""
    from ..transports.ucx._lanes import tcp_only  # pure lane-name functions; imported late (cycle)

    return tcp_only(lanes)


def rdma_lane(lanes: tuple[str, ...]) -> bool:
    """Some lane moves bytes by RDMA."""
    from ..transports.ucx._lanes import rdma

    return rdma(lanes)


def _tcp_only(caps: Capabilities) -> bool:
    """Every lane goes through kernel TCP. The handshake carries ``tcp_only``; an offer from a
    node that predates that field is also judged by its lanes ("tcp" or "tcp/<device>")."""
    return caps.tcp_only or tcp_lanes_only(caps.lanes)


def _missing(
    name: str,
    local: Mapping[str, Offer],
    remote: Mapping[str, Offer],
    local_unusable: Mapping[str, str],
    remote_unusable: Mapping[str, str],
    local_name: str,
    remote_name: str,
) -> str:
    """Why ``name``, which ``local`` lacks, is not used: and why not on the other side too, where
    that lacks it as well (named for one side only, a user who fixed it there learnt of the
    other only at the next connect)."""
    reason = f"on {local_name}: {local_unusable.get(name, 'not enabled')}"
    if name not in remote:
        reason += f"; on {remote_name}: {remote_unusable.get(name, 'not enabled')}"
    return reason


def _endpoint_lanes(transports: Mapping[str, Transport] | None, name: str, address: bytes) -> tuple[str, ...]:
    """The lanes ``transports[name]`` would use with the peer at ``address`` (``()``: unknown)."""
    transport = (transports or {}).get(name)
    return transport.endpoint_lanes(address) if transport is not None else ()


def choose(
    preference: list[str] | tuple[str, ...],
    local: Mapping[str, Offer],
    remote: Mapping[str, Offer],
    local_unusable: Mapping[str, str],
    remote_unusable: Mapping[str, str],
    require: str,
    reachable: Callable[[str, bytes], str | None],
    *,
    local_name: str = "server",
    remote_name: str = "client",
    transports: Mapping[str, Transport] | None = None,
) -> Choice:
    """Pick a transport; raise NegotiationError listing why each one was not usable.

    ``transports``: this node's transport objects. Each one's ``endpoint_lanes(address)`` says
    which lanes it would really use with that peer once ``reachable`` said yes (a UCX
    endpoint's, which can be fewer than either side lists: two machines share no shared
    memory); left with tcp lanes only, it gives way to tcp as one that lists only tcp lanes does."""
    check_require(require)
    order = list(dict.fromkeys(preference))  # a name said twice counts once, where it came first
    if len(order) > MAX_TRANSPORTS:
        raise ConfigurationError(f"a preference order of {len(order)} transports; at most {MAX_TRANSPORTS}")
    passed: list[tuple[str, str]] = []
    for i, name in enumerate(order):
        if name not in local:
            lacking = _missing(name, local, remote, local_unusable, remote_unusable, local_name, remote_name)
            passed.append((name, lacking))
            continue
        if name not in remote:
            passed.append((name, f"on {remote_name}: {remote_unusable.get(name, 'not enabled')}"))
            continue
        mine, theirs = local[name], remote[name]
        if mine.version != theirs.version:
            passed.append((name, f"version {theirs.version} on {remote_name} != {mine.version} on {local_name}"))
            continue
        if name != "tcp" and "tcp" in order[i + 1 :] and "tcp" in local and "tcp" in remote:
            side = (
                local_name if _tcp_only(mine.capabilities) else remote_name if _tcp_only(theirs.capabilities) else None
            )
            if side is not None:
                reason = f"only tcp lanes on {side}: tensorwire's tcp transport moves those bytes with less machinery"
                passed.append((name, reason))
                continue
        why = reachable(name, theirs.address)
        if why is not None:
            if name == "ucx":
                # UCX's own words are a bare "Destination is unreachable": the lanes each side
                # offered say what had nothing in common (two machines with shared memory only,
                # TLS="posix" against TLS="sysv"); the other side's within bounds (``_lanes_text``)
                sides = ((local_name, mine), (remote_name, theirs))
                why += " (" + "; ".join(f"{side} lists {_lanes_text(o.capabilities.lanes)}" for side, o in sides) + ")"
            passed.append((name, why))
            continue
        fallback = name != "tcp" and "tcp" in order[i + 1 :] and "tcp" in local and "tcp" in remote
        used = _endpoint_lanes(transports, name, theirs.address) if fallback or require != "any" else ()
        if fallback and tcp_lanes_only(used):
            reason = (
                f"only tcp lanes between {local_name} and {remote_name} ({', '.join(used)}): "
                "tensorwire's tcp transport moves those bytes with less machinery"
            )
            passed.append((name, reason))
            continue
        why = shortfall(require, mine.capabilities, theirs.capabilities, used, local_name, remote_name)
        if why is not None:
            passed.append((name, f"require={require!r}: {name} {why}"))
            continue
        return Choice(name, tuple(passed))
    detail = "; ".join(f"{n}: {r}" for n, r in passed) or "no transports offered"
    raise NegotiationError(f"no transport satisfies require={require!r} ({detail})")


def as_accepted(
    choice: Choice,
    own: Sequence[str],
    followed: Sequence[str],
    local: Mapping[str, Offer],
    remote: Mapping[str, Offer],
    local_unusable: Mapping[str, str],
    remote_unusable: Mapping[str, str],
    *,
    local_name: str = "server",
    remote_name: str = "client",
) -> Choice:
    """``choice`` as the accepting node reports it. ``choose`` followed the connecting side's
    preference order (``followed``) and named what that order put first; this node's own order
    (``own``) may put others above the chosen transport too (ucx, when the client asked for tcp
    alone). Each of those gets its reason, in ``choose``'s words where a side lacks it, so that
    neither end's path is silent about a transport it prefers."""
    named = {name for name, _ in choice.passed_over}
    order = list(dict.fromkeys(own))
    above = order[: order.index(choice.name)] if choice.name in order else order
    asked = set(followed)
    decides = "the connecting side's order decides"
    more: list[tuple[str, str]] = []
    for name in above:
        if name in named:
            continue
        if name not in local:
            reason = _missing(name, local, remote, local_unusable, remote_unusable, local_name, remote_name)
        elif name not in remote:
            reason = f"on {remote_name}: {remote_unusable.get(name, 'not enabled')}"
        elif name not in asked:
            reason = f"not in {remote_name}'s preference order ({decides})"
        else:
            # in that order, but after the chosen one (those before it are named already)
            reason = f"{remote_name}'s preference order puts {choice.name} before it ({decides})"
        more.append((name, reason))
    return Choice(choice.name, (*choice.passed_over, *more))
