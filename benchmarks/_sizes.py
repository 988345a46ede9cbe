"""Sizes on the command line and in tables, shared by the benchmark scripts: the ones
`tensorwire bench` parses and prints (tensorwire._bench._wire), so the two never drift."""

from __future__ import annotations

from tensorwire._bench._wire import fmt_size, parse_sizes

__all__ = ["GiB", "MiB", "fmt_size", "parse_size"]

MiB = 1 << 20
GiB = 1 << 30


def parse_size(text: str) -> int:
    """``4K``, ``1M``, ``0.25G``, ``16MiB`` or a plain number of bytes."""
    (size,) = parse_sizes(text)
    return size
