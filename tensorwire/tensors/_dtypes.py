"""The dtypes tensorwire moves, by wire name.

bfloat16 and the float8 types come from ml_dtypes (a core dependency, imported on first need),
so a numpy-only process can receive what a torch process sends.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping

import numpy as np

from ..errors import UnsupportedTensorError

__all__ = ["DTYPES", "big_endian", "dtype_from_name", "dtype_name", "is_wire_dtype"]

_NUMPY: dict[str, np.dtype] = {
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
}
_ML_DTYPES = ("bfloat16", "float8_e4m3fn", "float8_e5m2")  # (ml_dtypes' attribute names too)

_NAMES: dict[np.dtype, str] = {dt: name for name, dt in _NUMPY.items()}


class _Dtypes(Mapping[str, np.dtype]):
    """Wire name -> numpy dtype. ml_dtypes' three are looked up on first need: importing
    ml_dtypes takes about 0.7 s (its extension's start), which every process that imported
    tensorwire paid, CLI and test children included, most never moving a bfloat16. A process
    that holds an ml_dtypes array has imported it already; one that receives one imports it
    here."""

    def __init__(self) -> None:
        self._all: dict[str, np.dtype] | None = None

    def _full(self) -> dict[str, np.dtype]:
        if self._all is None:
            import ml_dtypes

            extra = {name: np.dtype(getattr(ml_dtypes, name)) for name in _ML_DTYPES}
            _NAMES.update({dt: name for name, dt in extra.items()})
            self._all = {**_NUMPY, **extra}
        return self._all

    def __getitem__(self, name: str) -> np.dtype:
        dt = _NUMPY.get(name)
        if dt is not None:
            return dt
        if name in _ML_DTYPES:
            return self._full()[name]
        raise KeyError(name)

    def __contains__(self, name: object) -> bool:
        return name in _NUMPY or name in _ML_DTYPES

    def __iter__(self) -> Iterator[str]:
        yield from _NUMPY
        yield from _ML_DTYPES

    def __len__(self) -> int:
        return len(_NUMPY) + len(_ML_DTYPES)


_DTYPES = _Dtypes()
DTYPES: Mapping[str, np.dtype] = _DTYPES


def _name_of(dt: np.dtype) -> str | None:
    name = _NAMES.get(dt)
    if name is None and "ml_dtypes" in sys.modules:  # (an ml_dtypes dtype: its names were not looked up yet)
        _DTYPES._full()
        name = _NAMES.get(dt)
    return name


def is_wire_dtype(dtype: np.dtype) -> bool:
    """Whether ``dtype`` (a numpy dtype) has a wire name."""
    return _name_of(dtype) is not None


def dtype_name(dtype: np.dtype) -> str:
    """The wire name of a numpy dtype; raises UnsupportedTensorError for others."""
    dt = np.dtype(dtype)
    name = _name_of(dt)
    if name is None:
        if dt.byteorder == ">" or (dt.byteorder == "=" and np.little_endian is False):
            raise big_endian(dt)
        raise UnsupportedTensorError(f"dtype {dt!s} is not supported; supported: {', '.join(DTYPES)}")
    return name


def big_endian(dtype: np.dtype) -> UnsupportedTensorError:
    """The refusal of a big-endian dtype, named by the wire name of its native twin as well: a
    byte-swapped bfloat16 is ``>V2`` to numpy, a plain void type to the reader."""
    name = _name_of(dtype.newbyteorder("="))
    shown = f"{name} ({dtype.str})" if name is not None else str(dtype)
    return UnsupportedTensorError(f"big-endian dtype {shown} is not supported; convert to native order")


def dtype_from_name(name: str) -> np.dtype:
    """The numpy dtype of a wire dtype name (``"bfloat16"``, ``"float32"``, ...)."""
    try:
        return DTYPES[name]
    except KeyError:
        raise UnsupportedTensorError(f"unknown dtype {name!r}; supported: {', '.join(DTYPES)}") from None
