"""Whether a NIC on this machine can DMA straight into GPU memory (GPUDirect RDMA), from what the
kernel shows: the nvidia-peermem module, or dma-buf export (NVIDIA's open kernel modules on
Linux >= 5.12). Read by the doctor and by transports that report ``gpudirect``."""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Any

from .._sysfs import PROC, SYS, read_text

__all__ = ["gpudirect_status"]


def gpudirect_status(sys_root: Path = SYS, proc_root: Path = PROC) -> dict[str, Any]:
    """{driver, peermem, dmabuf, ready, why_not}: ``ready`` when either way is there, else the
    reasons. The roots are /sys and /proc unless ``TENSORWIRE_SYSFS``/``TENSORWIRE_PROCFS`` say."""
    driver = read_text(proc_root / "driver" / "nvidia" / "version")
    peermem = (sys_root / "module" / "nvidia_peermem").is_dir() or (sys_root / "module" / "nv_peer_mem").is_dir()
    # dma-buf export of GPU memory needs the open kernel modules (the "Open" flavour in the
    # version string) and a kernel with dma-buf support in the RDMA core (5.12+): the kernel
    # whose /proc this is (a recorded copy of another machine's too), as its driver is
    release = read_text(proc_root / "sys" / "kernel" / "osrelease") or platform.release()
    try:
        major, minor = (int(x) for x in release.split(".")[:2])
        kernel_ok = (major, minor) >= (5, 12)
    except ValueError:
        kernel_ok = False
    open_modules = driver is not None and "Open Kernel Module" in driver
    reasons = []
    if driver is None:
        reasons.append("no NVIDIA driver loaded")
    else:
        if not peermem:
            reasons.append("nvidia-peermem is not loaded (modprobe nvidia-peermem)")
        if not open_modules:
            reasons.append("dma-buf needs NVIDIA's open kernel modules")
        if not kernel_ok:
            reasons.append(f"dma-buf needs Linux >= 5.12 (this is {release})")
    dmabuf = driver is not None and open_modules and kernel_ok
    return {
        "driver": driver.splitlines()[0] if driver else None,
        "peermem": peermem,
        "dmabuf": dmabuf,
        "ready": peermem or dmabuf,
        "why_not": [] if (peermem or dmabuf) else reasons,
    }
