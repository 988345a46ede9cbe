"""Sizes on the command line and in tables, shared by the benchmark scripts."""

from __future__ import annotations

MiB = 1 << 20
GiB = 1 << 30
UNITS = {"K": 1 << 10, "M": MiB, "G": GiB}


def parse_size(text: str) -> int:
    """``4K``, ``1M``, ``0.25G``, ``16MiB`` or a plain number of bytes."""
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    return int(float(text[:-1]) * UNITS[text[-1]]) if text[-1] in UNITS else int(text)


def fmt_size(n: int) -> str:
    for unit, v in (("GiB", GiB), ("MiB", MiB), ("KiB", 1 << 10)):
        if n >= v and n % v == 0:
            return f"{n // v} {unit}"
    return f"{n} B"
