"""The conformance suite over every transport available here."""

import pytest

from tensorwire.testing import CHECKS, connected_pair

TRANSPORTS = ["tcp", "inproc"]


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("name", list(CHECKS))
async def test_conformance(transport: str, name: str) -> None:
    async with connected_pair(transport, check=name) as (a, b):
        await CHECKS[name](a, b)
