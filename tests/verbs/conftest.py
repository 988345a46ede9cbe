"""Tests that need a real RDMA device: they run inside the Soft-RoCE guest
(``tests/test_verbs_vm.py`` boots it) and skip, with the reason, anywhere verbs cannot run."""

from pathlib import Path

import pytest

from tensorwire.transports.verbs import VerbsTransport

_HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if VerbsTransport.probe() is not None:
        return
    skip = pytest.mark.skip(reason=f"verbs cannot run here: {VerbsTransport.unavailable_reason()}")
    for item in items:
        if _HERE in Path(str(item.fspath)).parents:
            item.add_marker(skip)
