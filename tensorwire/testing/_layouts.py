"""Strided views that reach every copy kind of tensorwire.native, for numpy and CuPy alike."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

View = Callable[[Any], Any]

# name: (shape of a C-contiguous base array, the view of it to pack and unpack)
PACK_LAYOUTS: dict[str, tuple[tuple[int, ...], View]] = {
    "contiguous": ((37, 53), lambda a: a),
    "0d": ((), lambda a: a),
    "0d-index": ((5, 7), lambda a: a[2, 3, ...]),
    "empty": ((0, 5), lambda a: a),
    "empty-slice": ((4, 6), lambda a: a[:, 3:3]),
    "1d-step": ((301,), lambda a: a[::7]),
    "column": ((50, 40), lambda a: a[:, 7]),
    "transpose": ((67, 131), lambda a: a.T),
    "transpose-large": ((1030, 770), lambda a: a.T),
    "transpose-small": ((5, 9), lambda a: a.T),
    "permute3d": ((5, 40, 36), lambda a: a.transpose(2, 0, 1)),
    "nhwc-to-nchw": ((3, 17, 19, 33), lambda a: a.transpose(0, 3, 1, 2)),
    "negative": ((33, 65), lambda a: a[::-1, ::-1]),
    "negative-transpose": ((40, 50), lambda a: a[::-1].T),
    "negative-inner": ((64, 48), lambda a: a[:, ::-1]),
    "step-slice": ((64, 96), lambda a: a[1::3, 2::5]),
    "row-slice": ((64, 96), lambda a: a[:, 16:80]),
    "row-slice-odd": ((63, 97), lambda a: a[3:, 1:-2]),
    "step-large": ((1000, 2000), lambda a: a[:, ::2]),
    "size-one-dims": ((1, 30, 1, 20), lambda a: a[:, ::2, :, 1:]),
    "8d": ((2, 3, 2, 3, 2, 3, 2, 3), lambda a: a.transpose(7, 6, 5, 4, 3, 2, 1, 0)),
    "8d-slices": ((3, 4, 3, 4, 3, 4, 3, 4), lambda a: a[::2, 1:, ::-1, :, 1::2, :, ::-1, 1:3]),
    "8d-tiled": ((2, 2, 2, 20, 2, 2, 2, 24), lambda a: a.transpose(0, 1, 2, 7, 4, 5, 6, 3)),
}
