"""What this process holds, read from /proc: its listening tcp ports (whoever opened them:
gRPC, the tcp transport, UCX) and its connections to a port, for tests that check a close let go
of everything. Imported by the tests and by the child processes some of them start (the tests
folder on ``sys.path``)."""

from __future__ import annotations

import os
from collections.abc import Iterator


def _our_sockets() -> Iterator[list[str]]:
    """The rows of /proc/self/net/tcp and tcp6 (split into columns) of this process's sockets."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    for table in ("tcp", "tcp6"):
        with open(f"/proc/self/net/{table}") as f:
            for line in f.read().splitlines()[1:]:
                cols = line.split()
                if cols[9] in inodes:
                    yield cols


def _port(column: str) -> int:
    return int(column.rpartition(":")[2], 16)


def listening_ports() -> list[int]:
    """The tcp ports (IPv4 and IPv6) this process listens on, sorted, one entry per socket."""
    return sorted(_port(cols[1]) for cols in _our_sockets() if cols[3] == "0A")  # (state LISTEN)


def connections_to(port: int) -> int:
    """How many of this process's tcp sockets (IPv4 and IPv6) are connected to ``port``: the
    client ends of its connections to a server of its own there."""
    # (state ESTABLISHED, and its remote end is at port)
    return sum(1 for cols in _our_sockets() if cols[3] == "01" and _port(cols[2]) == port)
