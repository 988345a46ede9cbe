import logging

import pytest


@pytest.fixture(autouse=True)
def _quiet_grpc_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tensorwire")
