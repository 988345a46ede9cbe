"""The dtypes tensorwire moves, by wire name.

bfloat16 and the float8 types come from ml_dtypes (a core dependency), so a numpy-only process
can receive what a torch process sends.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from ..errors import UnsupportedTensorError

__all__ = ["DTYPES", "big_endian", "dtype_from_name", "dtype_name"]

DTYPES: dict[str, np.dtype] = {
    "bool": np.dtype(np.bool_),
    "int8": np.dtype(np.int8),
    "int16": np.dtype(np.int16),
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
    "uint8": np.dtype(np.uint8),
    "uint16": np.dtype(np.uint16),
    "uint32": np.dtype(np.uint32),
    "uint64": np.dtype(np.uint64),
    "float16": np.dtype(np.float16),
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "complex64": np.dtype(np.complex64),
    "complex128": np.dtype(np.complex128),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
    "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2),
}

_NAMES: dict[np.dtype, str] = {dt: name for name, dt in DTYPES.items()}


def dtype_name(dtype: np.dtype) -> str:
    """The wire name of a numpy dtype; raises UnsupportedTensorError for others."""
    dt = np.dtype(dtype)
    name = _NAMES.get(dt)
    if name is None:
        if dt.byteorder == ">" or (dt.byteorder == "=" and np.little_endian is False):
            raise big_endian(dt)
        raise UnsupportedTensorError(f"dtype {dt!s} is not supported; supported: {', '.join(DTYPES)}")
    return name


def big_endian(dtype: np.dtype) -> UnsupportedTensorError:
    """The refusal of a big-endian dtype, named by the wire name of its native twin as well: a
    byte-swapped bfloat16 is ``>V2`` to numpy, a plain void type to the reader."""
    name = _NAMES.get(dtype.newbyteorder("="))
    shown = f"{name} ({dtype.str})" if name is not None else str(dtype)
    return UnsupportedTensorError(f"big-endian dtype {shown} is not supported; convert to native order")


def dtype_from_name(name: str) -> np.dtype:
    """The numpy dtype of a wire dtype name (``"bfloat16"``, ``"float32"``, ...)."""
    try:
        return DTYPES[name]
    except KeyError:
        raise UnsupportedTensorError(f"unknown dtype {name!r}; supported: {', '.join(DTYPES)}") from None
