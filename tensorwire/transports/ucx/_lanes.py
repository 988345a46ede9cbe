"""What UCX lanes (``transport/device``, as ``ucp_ep_query`` names them) mean for the bytes.

Pure functions of the lane names, so that a path and a receipt say the same thing. Which
protocol UCX picks over those lanes per message is its own choice (``UCX_PROTO_INFO=used``
shows it); what the lanes settle is what is possible at all:

- every lane is tcp: every byte goes through the kernel's TCP stack;
- get/put reach the owner's memory without the owner's CPU only over a lane that can: cma,
  knem or xpmem (the reader's process copies, one copy) or an RDMA transport. Without one, UCX
  emulates get/put with its own active messages over the other lanes (sysv/posix shared-memory
  FIFOs, tcp; a put over tcp lanes alone is the tcp transport's own "zero-copy" put, whose
  bytes the owner's worker receives into the memory), and the owner's UCX worker serves them:
  its event loop must run (measured: with ``TLS="^cma"`` a read from a SIGSTOPped owner never
  completes, nor with ``TLS="tcp"`` an 8 MiB write within 1.5 s; over cma both do).
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "CUDA_TLS",
    "ONE_SIDED_TLS",
    "RDMA_TLS",
    "describe",
    "one_sided_direct",
    "rdma",
    "kernel_copy",
    "tcp_only",
]

# UCX transports that move bytes by RDMA, and those that move GPU memory
RDMA_TLS = ("rc", "dc", "ud", "srd", "gga", "ib")
CUDA_TLS = ("cuda", "gdr")
# transports over which a get/put reaches registered host memory without the owner's CPU
ONE_SIDED_TLS = ("cma", "knem", "xpmem", "rc", "dc", "gga")
# transports that move bytes by get/put only and carry none of UCX's active messages: with no
# other lane UCX cannot create an endpoint (TLS="cma": every connect, either way, failed with
# UCX's bare "Destination is unreachable"), so the probe offers no ucx (and the doctor says why)
NO_MESSAGES_TLS = ("cma", "knem", "cuda_copy", "cuda_ipc", "gdr_copy", "rocm_copy", "rocm_ipc")
_SHM_FIFO = ("sysv", "posix")
_SINGLE_COPY = ("cma", "knem", "xpmem")


def _tl(lane: str) -> str:
    return lane.split("/", 1)[0]


def tcp_only(lanes: Iterable[str]) -> bool:
    """Every lane is UCX's tcp transport (bytes through the kernel's TCP stack)."""
    tls = [_tl(lane) for lane in lanes]
    return bool(tls) and all(t == "tcp" for t in tls)


def rdma(lanes: Iterable[str]) -> bool:
    """Some lane is an RDMA transport."""
    return any(_tl(lane).startswith(RDMA_TLS) for lane in lanes)


def one_sided_direct(lanes: Iterable[str]) -> bool:
    """Some lane lets a get/put reach host memory without the owner's CPU (see the module)."""
    return any(_tl(lane).startswith(ONE_SIDED_TLS) for lane in lanes)


def kernel_copy(lanes: Iterable[str]) -> bool:
    """Some lane copies between two processes of this machine in the kernel (cma's
    process_vm_readv/writev, knem): a copy it makes from memory this process has let go fails
    there, cleanly. (xpmem maps the other's memory and copies in user space.)"""
    return any(_tl(lane).startswith(("cma", "knem")) for lane in lanes)


def describe(lanes: Iterable[str]) -> str:
    """How bytes can move over these lanes, in words: "shared memory (cma single copy)",
    "kernel TCP", "RDMA", "CUDA IPC", and what get/put need of the owner."""
    tls = [_tl(lane) for lane in lanes]
    if not tls or tls == ["ucx"]:
        return "lanes unknown"
    parts = []
    if rdma(tls):
        parts.append("RDMA")
    shm = [t for t in dict.fromkeys(tls) if t.startswith(_SINGLE_COPY)]
    if any(t in _SHM_FIFO for t in tls) or shm:
        parts.append(f"shared memory ({', '.join(shm)} single copy)" if shm else "shared memory (copied via FIFOs)")
    if any(t.startswith("cuda_ipc") for t in tls):
        parts.append("CUDA IPC")
    if "tcp" in tls:
        parts.append("kernel TCP")
    known = ("tcp", "cuda", "gdr", *_SHM_FIFO, *_SINGLE_COPY, *RDMA_TLS)
    parts += sorted({t for t in tls if not t.startswith(known)})
    text = ", ".join(parts)
    if not one_sided_direct(tls):
        text += "; get/put emulated by UCX: the owner's worker serves them"
    return text
