"""Tensors: one adapter for numpy, torch, DLPack and buffers; pytrees; wire headers."""

from ._device import Device, DeviceTensor, EngineArray, parse_device
from ._dtypes import DTYPES, dtype_from_name, dtype_name
from ._message import (
    Outgoing,
    Spec,
    decode_header,
    decode_header_sized,
    match_out,
    prepare,
    prepare_off_loop,
    rebuild,
    wire_nbytes,
    with_scalars,
)
from ._view import TensorView, as_view, byte_view, is_tensor

__all__ = [
    "DTYPES",
    "Device",
    "DeviceTensor",
    "EngineArray",
    "Outgoing",
    "Spec",
    "TensorView",
    "as_view",
    "byte_view",
    "decode_header",
    "decode_header_sized",
    "dtype_from_name",
    "dtype_name",
    "is_tensor",
    "match_out",
    "wire_nbytes",
    "with_scalars",
    "parse_device",
    "prepare",
    "prepare_off_loop",
    "rebuild",
]
