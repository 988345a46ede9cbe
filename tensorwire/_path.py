"""What a peer's data path is, and why: the honest answer to 'did I get the fast path?'."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Path"]


@dataclass(frozen=True, slots=True)
class Path:
    """The negotiated data path of one peer.

    transport: the transport that carries the bytes ("tcp", "inproc", "ucx", ...).
    lanes: what carries them inside that transport ("tcp x1 stream 127.0.0.1:4242").
    rdma / gpudirect: whether bytes move by RDMA, and GPU memory without staging.
    passed_over: (transport, reason) for each transport preferred over this one and not used.
    """

    transport: str
    lanes: tuple[str, ...]
    rdma: bool
    gpudirect: bool
    memory_kinds: tuple[str, ...]
    passed_over: tuple[tuple[str, str], ...]

    def __str__(self) -> str:
        lanes = ", ".join(self.lanes) or "-"
        kind = "RDMA" if self.rdma else "staged through the kernel" if self.transport == "tcp" else "direct"
        text = f"{self.transport} [{lanes}] ({kind})"
        if self.passed_over:
            text += "; not " + "; not ".join(f"{n}: {r}" for n, r in self.passed_over)
        return text
