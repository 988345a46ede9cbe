"""Where the kernel's views of this machine are read from: /sys and /proc, or the trees named by
``TENSORWIRE_SYSFS`` / ``TENSORWIRE_PROCFS`` (a recorded copy of another machine's). Read by the
doctor and by the memory layer's GPUDirect check; ``read_text`` also reads the verbs transport's
port and GID files (under /sys/class/infiniband)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["PROC", "SYS", "read_text"]

# (set but empty is unset: Path("") is the current directory, whose trees, or none, would be
# taken for this machine's)
SYS = Path(os.environ.get("TENSORWIRE_SYSFS") or "/sys")
PROC = Path(os.environ.get("TENSORWIRE_PROCFS") or "/proc")
_CHUNK = 1 << 16


def read_text(path: str | os.PathLike[str]) -> str | None:
    """A kernel file's text, stripped; None where it is absent or unreadable.

    Read with ``os.read`` into bytes, not through a text file object: an RDMA port's GID table
    is 128-1024 sysfs files, read on every verbs probe and listen, and a file object per read
    made that three times slower (0.6-1 s for rxe's 1024 GIDs in the emulated Soft-RoCE guest,
    0.2-0.3 s this way)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        # a short read is the end: one read for an attribute, no second one to see the end
        chunks = [os.read(fd, _CHUNK)]
        while len(chunks[-1]) == _CHUNK:
            chunks.append(os.read(fd, _CHUNK))
    except OSError:
        return None
    finally:
        os.close(fd)
    return b"".join(chunks).decode(errors="replace").strip()
