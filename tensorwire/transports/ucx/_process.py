"""Which process a ucx peer is, whether it is certainly gone, and whether it waits for the CPU
this process holds (``waiting_on``: see ``Worker._make_way``).

A send UCX never completes (a rendezvous to a peer that died: without peer error handling UCX
fails it neither in time nor on request) keeps its payload with the node for as long as UCX may
still hand that memory to the peer: over cma the receiver reads it with ``process_vm_readv``,
at whatever time it runs, and a peer that is only stopped (SIGSTOP, a stalled machine) would
read it late and deliver it as a good message. Once the peer's process no longer exists, no lane
can reach the payload through it any more, and the node may let it go (``Worker``'s sweep).

Each side of a ucx channel tells the other its pid, its start time (clock ticks after boot,
``/proc/self/stat``) and a tag of its kernel boot and pid namespace, inside the HMAC-proven
HELLO and WELCOME. A pid means something only to a process of the same boot and pid namespace;
with the start time, a pid the kernel reused for another process is told from the peer.

12 bytes: the WELCOME must stay within UCX's eager-short size over shared memory (92 bytes in
UCX 1.21: ``UCX_PROTO_INFO=used``, "eager short 0..92"). A longer one goes "eager copy-in
copy-out", which has the server attach the client's receive segment during the handshake;
otherwise that happens at the first such message, and a message to a client that died by then
fails at once (UCS_ERR_SHMEM_SEGMENT: PeerDisconnected) instead of waiting for its lease. The
start time and tag are kept to their low 32 bits: two that differ there certainly differ; two
that agree there but not in full are taken for the same (the payload is kept, as it is for a
peer that may still run).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import struct
from collections.abc import Callable
from typing import NamedTuple

__all__ = ["PROCESS", "ProcessId", "cpus_of", "gone", "me", "this_cpu", "visible", "waiting_on"]

PROCESS = struct.Struct("<III")  # pid, start time (clock ticks after boot), host tag: low 32 bits each
_NO_HOST = 0
_LOW = 0xFFFFFFFF


class ProcessId(NamedTuple):
    pid: int
    start: int  # clock ticks after boot (/proc/<pid>/stat, field 22), low 32 bits
    host: int  # the first 4 bytes of sha256(boot id, pid namespace); 0 where unknown

    def pack(self) -> bytes:
        return PROCESS.pack(self.pid, self.start, self.host)

    @classmethod
    def unpack(cls, data: bytes) -> ProcessId:
        return cls(*PROCESS.unpack(data))


def _stat(pid: int | str) -> tuple[str, int] | None:
    """(state, start time) of process ``pid`` as /proc shows it; None if it has no entry."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = text.rsplit(b")", 1)[1].split()  # (the command name may hold spaces and parentheses)
    return fields[0].decode(), int(fields[19])


def _host() -> int:
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            boot = f.read().strip()
        ns = os.stat("/proc/self/ns/pid")
    except OSError:
        return _NO_HOST
    return int.from_bytes(hashlib.sha256(b"%s|%d:%d" % (boot, ns.st_dev, ns.st_ino)).digest()[:4], "little") or 1


@functools.cache
def _mine(pid: int) -> ProcessId:
    try:
        # /proc of another pid namespace (unshare --pid without --mount-proc) names this process
        # by another pid: then no peer could find it there, nor tell its end
        stat = _stat("self") if os.readlink("/proc/self") == str(pid) else None
    except (OSError, ValueError, IndexError):
        stat = None
    if stat is None:
        return ProcessId(0, 0, _NO_HOST)
    return ProcessId(pid, stat[1] & _LOW, _host())


def me() -> ProcessId:
    """This process (pid 0 where /proc cannot tell: then no peer ever finds it gone)."""
    return _mine(os.getpid())  # (keyed by pid: a forked child is another process)


def _here(peer: ProcessId | None) -> bool:
    return peer is not None and peer.pid > 0 and peer.host != _NO_HOST and peer.host == me().host


def visible(peer: ProcessId | None) -> ProcessId | None:
    """``peer`` if this process sees it in /proc now, as it described itself (same kernel boot
    and pid namespace, that pid, that start time); else None. Only a process seen so can later
    be found gone: /proc mounted with ``hidepid`` hides other users' processes, and one never
    seen could not be told from one that has ended."""
    if not _here(peer):
        return None
    assert peer is not None
    try:
        stat = _stat(peer.pid)
    except (OSError, ValueError, IndexError):
        return None
    return peer if stat is not None and stat[1] & _LOW == peer.start and stat[0] not in ("Z", "X") else None


def gone(peer: ProcessId | None) -> bool:
    """True only if ``peer``'s process certainly no longer exists: it runs under this kernel
    boot and pid namespace, and its pid has no process, or one started at another time, or one
    whose every thread has exited (a zombie, whose memory is gone). False where it may still
    run, or this cannot be told (another machine, another namespace, no /proc). Meaningful for
    a process that was ``visible`` before."""
    if not _here(peer):
        return False
    assert peer is not None
    try:
        stat = _stat(peer.pid)
        if stat is None or stat[1] & _LOW != peer.start:
            return True
        if stat[0] not in ("Z", "X"):
            return False
        # a thread group leader that exited shows Z while its other threads may still run
        tasks = os.listdir(f"/proc/{peer.pid}/task")
        return all((s := _stat(f"{peer.pid}/task/{t}")) is None or s[0] in ("Z", "X") for t in tasks)
    except FileNotFoundError:
        return True  # (it went while it was being looked at)
    except (OSError, ValueError, IndexError):
        return False


def _getcpu() -> Callable[[], int] | None:
    try:
        getcpu = ctypes.CDLL(None).sched_getcpu
    except (OSError, AttributeError):
        return None
    getcpu.restype = ctypes.c_int
    getcpu.argtypes = ()
    return getcpu


_sched_getcpu = _getcpu()


def this_cpu() -> int:
    """The CPU this thread runs on now (glibc's ``sched_getcpu``, 0.3 us through ctypes here;
    Python 3.11 has no ``os.sched_getcpu``); -1 where that cannot be told."""
    if _sched_getcpu is None:
        return -1
    return _sched_getcpu()


def cpus_of(peer: ProcessId) -> frozenset[int] | None:
    """The CPUs that ``peer``'s main thread may run on (its affinity: one system call, no /proc
    read); None where that cannot be told."""
    if not _here(peer):
        return None
    try:
        return frozenset(os.sched_getaffinity(peer.pid))
    except OSError:
        return None


def waiting_on(peer: ProcessId, cpu: int) -> bool:
    """Whether ``peer``'s process waits to run on ``cpu``, which this thread holds: its main
    thread is runnable (state R) and last ran there (/proc/<pid>/stat, field 39). Running
    elsewhere, it shows that other CPU; sleeping, another state. About 8 us (an open, a read).
    False where /proc cannot tell, or the pid now names another process (another start time)."""
    if cpu < 0 or not _here(peer):
        return False
    try:
        fd = os.open(f"/proc/{peer.pid}/stat", os.O_RDONLY)
    except OSError:
        return False
    try:
        text = os.read(fd, 1024)
    except OSError:
        return False
    finally:
        os.close(fd)
    fields = text.rsplit(b")", 1)[-1].split()
    try:
        return fields[0] == b"R" and int(fields[36]) == cpu and int(fields[19]) & _LOW == peer.start
    except (IndexError, ValueError):
        return False
