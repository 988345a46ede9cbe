"""Which loopbacks this machine has, for tests that bind or dial both."""

from __future__ import annotations

import socket


def has_ipv6_loopback() -> bool:
    """Whether a listener can bind ::1 here (a host or container without IPv6 has none)."""
    try:
        with socket.create_server(("::1", 0), family=socket.AF_INET6):
            return True
    except OSError:
        return False
