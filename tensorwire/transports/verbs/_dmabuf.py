"""GPU memory for the verbs transport through dma-buf: CUDA exports a device allocation as a
dma-buf file descriptor (``cuMemGetHandleForAddressRange``), the RDMA device registers that
(``ibv_reg_dmabuf_mr``, pyverbs' ``DmaBufMR``), and the NIC then reads and writes GPU memory
with no copy through the host.

This needs a CUDA driver that exports dma-bufs (``CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED``), a
kernel with dma-buf support in the RDMA driver, and rdma-core >= 34. ``dmabuf_status()`` says
whether all of that is here, and if not, why not, without touching a GPU context.
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Any

from ...errors import RegistrationError
from ._verbs import pv, registration_error

__all__ = ["CudaRegion", "dmabuf_status", "register_cuda"]

_CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = 124
_CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD = 1
_PAGE = 1 << 16  # CUDA allocations are 64 KiB aligned; the exported range must be page aligned


@functools.cache
def _libcuda() -> Any:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


@functools.cache
def dmabuf_status() -> tuple[bool, str]:
    """(usable, reason): can CUDA memory be registered through dma-buf here?"""
    try:
        if not hasattr(pv().mr, "DmaBufMR"):
            return False, "this pyverbs has no DmaBufMR (rdma-core >= 34 needed)"
    except ImportError as exc:
        return False, f"pyverbs does not import: {exc}"
    cuda = _libcuda()
    if cuda is None:
        return False, "no CUDA driver (libcuda.so.1) on this machine"
    if not hasattr(cuda, "cuMemGetHandleForAddressRange"):
        return False, "the CUDA driver cannot export dma-bufs (cuMemGetHandleForAddressRange missing; CUDA >= 11.7)"
    if cuda.cuInit(0) != 0:
        return False, "cuInit failed (no usable GPU)"
    count = ctypes.c_int()
    if cuda.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value == 0:
        return False, "no CUDA GPU"
    dev = ctypes.c_int()
    supported = ctypes.c_int()
    if (
        cuda.cuDeviceGet(ctypes.byref(dev), 0) != 0
        or cuda.cuDeviceGetAttribute(ctypes.byref(supported), _CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, dev) != 0
        or not supported.value
    ):
        return False, "the GPU or its driver does not support dma-buf export (open kernel modules needed)"
    return True, "CUDA dma-buf export available"


class CudaRegion:
    """GPU memory registered through dma-buf. RDMA addresses it by ``iova`` (the offset into
    the exported range), locally with ``lkey`` and remotely with ``rkey``."""

    __slots__ = ("fd", "iova", "length", "lkey", "mr", "rkey")

    def __init__(self, mr: Any, fd: int, iova: int, length: int) -> None:
        self.mr = mr
        self.fd = fd
        self.iova = iova
        self.length = length
        self.lkey: int = mr.lkey
        self.rkey: int = mr.rkey

    def close(self) -> None:
        mr, self.mr = self.mr, None
        if mr is not None:
            mr.close()
            os.close(self.fd)


def register_cuda(pd: Any, ptr: int, nbytes: int, access: int) -> CudaRegion:
    """Register ``nbytes`` of CUDA device memory at ``ptr`` with the protection domain ``pd``."""
    ok, why = dmabuf_status()
    if not ok:
        raise RegistrationError(f"cannot register GPU memory with the RDMA device: {why}")
    cuda = _libcuda()
    base = ptr & ~(_PAGE - 1)
    span = (ptr + nbytes - base + _PAGE - 1) & ~(_PAGE - 1)
    fd = ctypes.c_int(-1)
    rc = cuda.cuMemGetHandleForAddressRange(
        ctypes.byref(fd), ctypes.c_uint64(base), ctypes.c_size_t(span), _CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0
    )
    if rc != 0 or fd.value < 0:
        raise RegistrationError(f"CUDA could not export {span} bytes at {base:#x} as a dma-buf (CUresult {rc})")
    offset = ptr - base
    v = pv()
    try:
        mr = v.mr.DmaBufMR(pd, nbytes, access, dmabuf=fd.value, offset=offset)
    except v.pyverbs_error.PyverbsError as exc:
        os.close(fd.value)
        raise registration_error(exc, nbytes, "GPU memory (dma-buf)") from exc
    return CudaRegion(mr, fd.value, offset, nbytes)
