"""The conformance suite over the verbs transport (inside the Soft-RoCE guest).

The guest is emulated (qemu TCG, tens of times slower than hardware), so the control plane's
wall-clock lease is scaled to match, and so are the checks' bounds on their waits (``time_scale``:
10 s became too little for some steps on a loaded host); what the checks assert is unchanged.
"""

import pytest

from tensorwire.testing import CHECKS, connected_pair, time_scale

EMULATED = {"lease_seconds": 30.0, "connect_timeout": 60.0, "goodbye_seconds": 5.0}
EMULATED_WAITS = 4.0


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", list(CHECKS))
async def test_conformance(name: str) -> None:
    async with connected_pair("verbs", check=name, **EMULATED) as (a, b):
        assert a.path.rdma and a.path.lanes[0].startswith("rc/")
        with time_scale(EMULATED_WAITS):
            await CHECKS[name](a, b)
