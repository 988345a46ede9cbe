"""Code that Python cannot do fast: CUDA pack/unpack kernels for strided tensors.

``pack(src)`` copies a CuPy array of any layout (transposed, sliced, negative strides, up to
8 dimensions, any item size) into one C-contiguous byte buffer in row-major element order,
the order a tensor travels on the wire; ``unpack(packed, dst)`` writes such a buffer back into
a possibly strided CuPy array. The kernels are CUDA C compiled at run time through CuPy's
NVRTC bindings, the first time a layout class needs one, and cached per class.

Importing this module never imports CuPy; calling ``pack``/``unpack`` without CuPy or a CUDA
device raises :class:`NativeUnavailableError`.
"""

from __future__ import annotations

from ._pack import NativeUnavailableError, pack, unpack

__all__ = ["NativeUnavailableError", "pack", "unpack"]
