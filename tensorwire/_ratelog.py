"""A warning log that a flood cannot flood: the first few events of each window are logged,
the rest counted and summed up in one line when the next window opens. Every event is counted
in the metrics too."""

from __future__ import annotations

import logging
import time

from . import _metrics

__all__ = ["RateLimitedLog"]


class RateLimitedLog:
    """Warn about the first ``per_window`` events in each ``window`` seconds, then count the
    rest: hostile connections or requests cannot fill the log. ``what`` names the events in the
    line that says how many were not logged; ``level``: that of every line (a warning unless
    said)."""

    def __init__(
        self, logger: logging.Logger, per_window: int, window: float, what: str, kind: str, level: int = logging.WARNING
    ) -> None:
        self._log, self._per, self._window, self._what = logger, per_window, window, what
        self._level = level
        self._kind = kind  # its label in the metrics' count of refusals (tensorwire_refusals_total)
        self._start = 0.0
        self._count = 0

    def warn(self, msg: str, *args: object) -> None:
        _metrics.refused(self._kind)
        now = time.monotonic()
        if now - self._start > self._window:
            if self._count > self._per:
                self._log.log(
                    self._level, "... and %d more %s in %.0f s", self._count - self._per, self._what, self._window
                )
            self._start, self._count = now, 0
        self._count += 1
        if self._count <= self._per:
            self._log.log(self._level, msg, *args)
