"""What UCX says it did: the protocols it selected, from its ``UCX_PROTO_INFO=used`` report.

A path names the lanes an endpoint has (``peer.path``); which protocol UCX then picks for each
transfer is its own decision, made per message size and memory type, and it can fall back (for
example from cuda_ipc to a host-staged copy when it cannot map the other process's memory)
without an error. With ``UCX_PROTO_INFO=used`` in the environment UCX prints, when a worker is
destroyed, a table per operation of every protocol it selected and how often; ``used_protocols``
reads those tables back, so a test or a benchmark can hold UCX to the path it was told.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["UsedProtocol", "used_protocols"]


class UsedProtocol(NamedTuple):
    operation: str  # e.g. "tagged message by ucp_tag_send* from cuda/GPU0"
    sizes: str  # the message sizes this row covers, e.g. "5029..inf"
    protocol: str  # e.g. "rendezvous zero-copy read from remote"
    lanes: str  # e.g. "cuda_ipc/cuda" or "cma/memory"
    times: int  # how often UCX selected it


def used_protocols(text: str) -> list[UsedProtocol]:
    """Every protocol UCX's ``UCX_PROTO_INFO=used`` report in ``text`` says it selected at least
    once. Each table has a header row ``| <context> <cfg> | <operation> |`` and rows
    ``| <times> <sizes> | <protocol> | <lanes> |``; log prefixes before the first ``|`` and rows
    without a count (UCX does not count short active messages) are ignored."""
    used: list[UsedProtocol] = []
    operation = ""
    for line in text.splitlines():
        cells = [c.strip() for c in line.split("|")[1:-1]]
        if len(cells) == 2:
            operation = cells[1]
        elif len(cells) == 3 and operation:
            first = cells[0].split()
            if len(first) == 2 and first[0].isdigit() and int(first[0]) > 0:
                used.append(UsedProtocol(operation, first[1], cells[1], cells[2], int(first[0])))
    return used
