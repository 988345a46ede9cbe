"""Watching a VerbsChannel post its RDMA READs, for the host's tests (a fake queue pair:
tests/test_verbs.py) and the guest's (Soft-RoCE: tests/verbs, which import it from /proj/tests)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pytest

if TYPE_CHECKING:
    from tensorwire.transports.verbs import VerbsChannel
    from tensorwire.transports.verbs._channel import _Incoming


def watch_post_reads(monkeypatch: pytest.MonkeyPatch, channel: VerbsChannel) -> list[_Incoming]:
    """The entries ``channel._post_reads`` has run for (what a fault-in that ended goes on
    with, posting READs or finding its entry gone), each listed once that call has returned;
    ``channel._post_reads`` is watched so for the rest of the test."""
    post_reads = channel._post_reads
    ran: list[_Incoming] = []

    def watched(entry: _Incoming, dests: list[np.ndarray]) -> None:
        post_reads(entry, dests)
        ran.append(entry)

    monkeypatch.setattr(channel, "_post_reads", watched)
    return ran
