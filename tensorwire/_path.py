"""What a peer's data path is, and why: the honest answer to 'did I get the fast path?'."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Path"]


@dataclass(frozen=True, slots=True)
class Path:
    """The negotiated data path of one peer.

    transport: the transport that carries the bytes ("tcp", "inproc", "ucx", ...).
    lanes: what carries them inside that transport ("tcp x1 stream 127.0.0.1:4242", an IPv6
        peer in brackets: "tcp x1 stream [::1]:4242"; for ucx the lanes of the endpoint to this
        peer, "cma/memory", "tcp/lo").
    rdma / gpudirect: whether bytes move by RDMA, and GPU memory by RDMA to and from the NIC
        with no host staging (GPUDirect RDMA; for ucx: only where the endpoint has an RDMA lane,
        not merely where this node lists one). GPU memory moved by CUDA IPC on one machine is
        not gpudirect: the lanes say "cuda_ipc".
    passed_over: (transport, reason) for each transport preferred over this one and not used:
        by the connecting side's preference order, which decides, and on the accepting side by
        that node's own order too (a transport it prefers that the other side did not ask for).
    """

    transport: str
    lanes: tuple[str, ...]
    rdma: bool
    gpudirect: bool
    memory_kinds: tuple[str, ...]
    passed_over: tuple[tuple[str, str], ...]

    def __post_init__(self) -> None:
        if self.transport == "ucx" and self.rdma:
            from .transports.ucx._lanes import rdma

            # rdma comes from the transport's capabilities (its context lists an RDMA
            # transport); a peer on this machine (shared memory) or one without RDMA gets an
            # endpoint without such a lane, and its bytes do not move by RDMA
            if not rdma(self.lanes):
                object.__setattr__(self, "rdma", False)
                object.__setattr__(self, "gpudirect", False)

    @property
    def how(self) -> str:
        """How the bytes move, in words ("RDMA", "kernel TCP", "shared memory (cma single copy)")."""
        if self.transport == "ucx":
            from .transports.ucx._lanes import describe

            return describe(self.lanes)
        if self.rdma:
            return "RDMA"
        if self.transport == "tcp":
            return "kernel TCP"
        if self.transport == "inproc":
            return "same process, one copy"
        return "direct"

    def __str__(self) -> str:
        lanes = ", ".join(self.lanes) or "-"
        text = f"{self.transport} [{lanes}] ({self.how})"
        if self.passed_over:
            text += "; not " + "; not ".join(f"{n}: {r}" for n, r in self.passed_over)
        return text
