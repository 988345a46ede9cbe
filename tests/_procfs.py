"""What this process holds, read from /proc: its listening tcp ports (whoever opened them:
gRPC, the tcp transport, UCX), for tests that check a close let go of everything. Imported by
the tests and by the child processes some of them start (the tests folder on ``sys.path``)."""

from __future__ import annotations

import os


def listening_ports() -> list[int]:
    """The tcp ports (IPv4 and IPv6) this process listens on, sorted, one entry per socket."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    ports = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/self/net/{table}") as f:
            for line in f.read().splitlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # state LISTEN, and the socket is ours
                    ports.append(int(cols[1].rpartition(":")[2], 16))
    return sorted(ports)


def connections_to(port: int) -> int:
    """How many of this process's tcp sockets (IPv4 and IPv6) are connected to ``port``: the
    client ends of its connections to a server of its own there."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    count = 0
    for table in ("tcp", "tcp6"):
        with open(f"/proc/self/net/{table}") as f:
            for line in f.read().splitlines()[1:]:
                cols = line.split()
                if cols[3] == "01" and cols[9] in inodes and int(cols[2].rpartition(":")[2], 16) == port:
                    count += 1  # (state ESTABLISHED, ours, and its remote end is at port)
    return count
