"""Where the kernel's views of this machine are read from: /sys and /proc, or the trees named by
``TENSORWIRE_SYSFS`` / ``TENSORWIRE_PROCFS`` (a recorded copy of another machine's). Read by the
doctor and by the memory layer's GPUDirect check."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["PROC", "SYS", "read_text"]

SYS = Path(os.environ.get("TENSORWIRE_SYSFS", "/sys"))
PROC = Path(os.environ.get("TENSORWIRE_PROCFS", "/proc"))


def read_text(path: Path) -> str | None:
    """A kernel file's text, stripped; None where it is absent or unreadable."""
    try:
        return path.read_text().strip()
    except OSError:
        return None
