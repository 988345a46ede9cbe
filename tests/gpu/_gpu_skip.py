"""What every GPU test module does first: CuPy with a CUDA device, or the module skips with why."""

from __future__ import annotations

import warnings
from typing import Any

import pytest


def cupy_with_a_device(what: str) -> Any:
    """CuPy, for a test module that needs a CUDA device (``what``: "the ... tests"); skips the
    module with the reason where CuPy is missing or finds no device."""
    with warnings.catch_warnings():  # CuPy's own import-time notices are not ours to fail on
        warnings.simplefilter("ignore")
        cp = pytest.importorskip("cupy", reason=f"CuPy is not installed: {what} need it", exc_type=ImportError)
    from tensorwire.memory._cuda import cuda_device_count

    if cuda_device_count() == 0:
        pytest.skip("CuPy is installed but finds no CUDA device", allow_module_level=True)
    return cp
