"""Tests that need a real RDMA device: they run inside the Soft-RoCE guest
(``tests/test_verbs_vm.py`` boots it) and skip, with the reason, anywhere verbs cannot run."""

import os
from pathlib import Path

import pytest

from tensorwire.transports.verbs import VerbsTransport

from . import _weights

_HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _keep_shard(config, items)
    if VerbsTransport.probe() is not None:
        return
    skip = pytest.mark.skip(reason=f"verbs cannot run here: {VerbsTransport.unavailable_reason()}")
    for item in filter(_ours, items):
        item.add_marker(skip)


def _ours(item: pytest.Item) -> bool:
    """Whether ``item`` is one of this folder's tests (this conftest's hooks see every item)."""
    return _HERE in Path(str(item.fspath)).parents


def _keep_shard(config: pytest.Config, items: list[pytest.Item]) -> None:
    """TW_GUEST_SHARD=K/N keeps the Kth of N shards, counting from 0 (the two guests of
    ``tests/test_verbs_vm.py`` run one each), of about the same seconds by the guest's times in
    ``guest_seconds.json`` (``_weights.py``); every test is in exactly one of the N shards."""
    shard = os.environ.get("TW_GUEST_SHARD", "")
    if not shard:
        return
    k, n = shard_of(shard)
    ours = list(filter(_ours, items))
    kept = set(_weights.shards([item.nodeid for item in ours], n, _weights.load())[k])
    dropped = {id(item) for i, item in enumerate(ours) if i not in kept}
    config.hook.pytest_deselected(items=[item for item in ours if id(item) in dropped])
    items[:] = [item for item in items if id(item) not in dropped]


def shard_of(shard: str) -> tuple[int, int]:
    """``K/N`` read as the numbers (K, N); pytest's usage error for anything else."""
    try:
        k, n = map(int, shard.split("/"))
    except ValueError:  # (not two numbers, or a digit int() does not read: "²")
        k, n = -1, 0
    if not 0 <= k < n:
        raise pytest.UsageError(f"TW_GUEST_SHARD must be K/N with 0 <= K < N, not {shard!r}")
    return k, n
