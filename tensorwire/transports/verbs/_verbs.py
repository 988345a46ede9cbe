"""pyverbs as the verbs transport uses it: the lazy import, the port and GID choice, the
completion channel's file descriptor, and pyverbs errors turned into tensorwire ones.

Only APIs present in both Debian's pyverbs (rdma-core 44) and the PyPI ``pyverbs`` package (59)
are used, but for two that differ: the enums module (``pv``) and the completion channel's fd.
Everything about devices, ports and GIDs that can be read without opening the device comes from
sysfs (``/sys/class/infiniband``), so ``probe()`` has no side effects.

GID choice on RoCE (Ethernet link layer): the RoCE v2 GID that maps the IPv4 address the node
serves on (``::ffff:a.b.c.d``), else the first RoCE v2 IPv4-mapped GID, else the first RoCE v2
GID. Index 0 is usually the link-local IPv6 GID, whose packets do not route; it is taken only
when nothing better exists (and RoCE v1 GIDs never, without a v2 one). On InfiniBand the port
GID (index 0) is right, and addressing goes by LID.
"""

from __future__ import annotations

import errno
import functools
import importlib
import importlib.util
import ipaddress
import os
import resource
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from ..._sysfs import read_text
from ...errors import RegistrationError, TransportError

__all__ = [
    "SYSFS",
    "Port",
    "choose_gid",
    "choose_port",
    "comp_channel_fd",
    "errno_of",
    "find_spec",
    "memlock_text",
    "pv",
    "registration_error",
]

SYSFS = "/sys/class/infiniband"
_MAPPED = bytes(10) + b"\xff\xff"
_ZERO = bytes(16)
_EVENT_FD = "anon_inode:[infinibandevent]"


def find_spec() -> bool:
    return importlib.util.find_spec("pyverbs") is not None


@functools.cache
def pv() -> Any:
    """The pyverbs modules, imported once (ImportError if pyverbs is missing).

    ``enums`` is libibverbs' enums module: ``pyverbs.enums`` up to rdma-core 44 (plain ints),
    ``pyverbs.libibverbs_enums`` in later releases (``IntEnum``/``IntFlag`` members, which
    compare and combine as the ints do).
    """
    names = ("device", "pd", "cq", "mr", "qp", "addr", "wr", "pyverbs_error")
    modules = {n: importlib.import_module(f"pyverbs.{n}") for n in names}
    try:
        modules["enums"] = importlib.import_module("pyverbs.libibverbs_enums")
    except ModuleNotFoundError as exc:
        if exc.name != "pyverbs.libibverbs_enums":
            raise
        modules["enums"] = importlib.import_module("pyverbs.enums")
    return SimpleNamespace(**modules)


@dataclass(frozen=True, slots=True)
class Port:
    """One RDMA port and the GID this node uses on it."""

    device: str
    port: int
    link_layer: str  # "Ethernet" (RoCE) or "InfiniBand"
    gid_index: int
    gid: bytes  # 16 bytes
    gid_type: str  # "RoCE v2", "IB/RoCE v1", ...
    netdev: str

    @property
    def roce(self) -> bool:
        return self.link_layer == "Ethernet"

    def describe(self) -> str:
        return f"{self.device}:{self.port} gid[{self.gid_index}] {gid_text(self.gid)} ({self.gid_type})"


def _read(path: str) -> str:
    """A sysfs attribute's text, '' where it cannot be read."""
    return read_text(path) or ""


def gid_text(gid: bytes) -> str:
    """The colon form pyverbs' GID() and sysfs use."""
    h = gid.hex()
    return ":".join(h[i : i + 4] for i in range(0, 32, 4))


def _gids(root: str, device: str, port: int) -> list[tuple[int, bytes, str, str]]:
    """(index, gid, type, netdev) for every non-zero GID of the port."""
    base = f"{root}/{device}/ports/{port}"
    try:
        names = os.listdir(f"{base}/gids")
    except OSError:
        return []
    out = []
    for name in sorted(names, key=lambda n: int(n) if n.isdigit() else 1 << 30):
        if not name.isdigit():
            continue
        text = _read(f"{base}/gids/{name}").replace(":", "")
        try:
            gid = bytes.fromhex(text)
        except ValueError:
            continue
        if len(gid) != 16 or gid == _ZERO:
            continue
        out.append((int(name), gid, _read(f"{base}/gid_attrs/types/{name}"), _read(f"{base}/gid_attrs/ndevs/{name}")))
    return out


def choose_gid(root: str, device: str, port: int, host: str = "") -> tuple[int, bytes, str, str] | None:
    """The GID (index, gid, type, netdev) to use on an Ethernet port (module docstring)."""
    gids = _gids(root, device, port)
    v2 = [g for g in gids if "v2" in g[2].lower()]
    mapped = [g for g in v2 if g[1][:12] == _MAPPED]
    want: bytes | None = None
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        ip = None
    if isinstance(ip, ipaddress.IPv4Address):
        want = _MAPPED + ip.packed
    elif isinstance(ip, ipaddress.IPv6Address):
        want = ip.packed
    for g in v2:
        if want is not None and g[1] == want:
            return g
    if mapped:
        return mapped[0]
    routable = [g for g in v2 if g[1][:2] != b"\xfe\x80"]
    if routable:
        return routable[0]
    return v2[0] if v2 else None


def choose_port(host: str = "", root: str = SYSFS, want: str = "") -> Port | str:
    """The port to use (``want`` = "device" or "device:port" narrows it), or why there is none."""
    try:
        devices = sorted(os.listdir(root))
    except OSError:
        devices = []
    if not devices:
        return (
            f"no RDMA device ({root} is empty or missing; for Soft-RoCE: "
            "modprobe rdma_rxe && rdma link add rxe0 type rxe netdev eth0)"
        )
    want_dev, _, want_port = want.partition(":")
    reasons = []
    candidates: list[Port] = []
    for dev in devices:
        if want_dev and dev != want_dev:
            continue
        try:
            ports = sorted(int(p) for p in os.listdir(f"{root}/{dev}/ports") if p.isdigit())
        except OSError:
            continue
        for port in ports:
            if want_port and str(port) != want_port:
                continue
            base = f"{root}/{dev}/ports/{port}"
            state = _read(f"{base}/state")
            if "ACTIVE" not in state:
                reasons.append(f"{dev}:{port} is {state or 'in an unknown state'}")
                continue
            link = _read(f"{base}/link_layer") or "InfiniBand"
            if link == "Ethernet":
                g = choose_gid(root, dev, port, host)
                if g is None:
                    reasons.append(f"{dev}:{port} has no RoCE v2 GID (is an IP address set on its netdev?)")
                    continue
                candidates.append(Port(dev, port, link, g[0], g[1], g[2], g[3]))
            else:
                gids = _gids(root, dev, port)
                if not gids:
                    reasons.append(f"{dev}:{port} has no GID")
                    continue
                i, gid, typ, ndev = gids[0]
                candidates.append(Port(dev, port, link, i, gid, typ or "IB", ndev))
    if not candidates:
        if want and not reasons:
            return f"no RDMA port {want!r} (devices: {', '.join(devices)})"
        return "no usable RDMA port: " + "; ".join(reasons or ["none found"])
    try:
        ip = ipaddress.ip_address(host)
        mine = _MAPPED + ip.packed if isinstance(ip, ipaddress.IPv4Address) else ip.packed
        for c in candidates:  # the port whose GID is the address the node serves on
            if c.gid == mine:
                return c
    except ValueError:
        pass
    return candidates[0]


# completion-event descriptors (contexts' async event files, completion channels) this module
# knows about, so that a new completion channel's descriptor is the one event file nobody claimed
_claimed: set[int] = set()


def _event_fds() -> set[int]:
    out = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") == _EVENT_FD:
                out.add(int(name))
        except OSError:
            continue
    return out


def claim_event_fds() -> set[int]:
    """Claim the event files open now (call right after opening a device context, whose async
    event file is one of them); returns what was claimed, for ``unclaim``."""
    new = _event_fds() - _claimed
    _claimed.update(new)
    return new


def unclaim(fds: set[int]) -> None:
    _claimed.difference_update(fds)


def comp_channel_fd(channel: Any) -> int:
    """The file descriptor of a pyverbs CompChannel just created. Newer pyverbs has ``.fd``;
    rdma-core 44's does not, so it is found as the one completion-event file of this process
    that no context or channel has claimed (by number alone a before/after comparison would
    miss a descriptor number that another thread closed and the channel reused)."""
    fd = getattr(channel, "fd", None)
    if isinstance(fd, int) and fd >= 0:
        _claimed.add(fd)
        return fd
    found = _event_fds() - _claimed
    if len(found) != 1:
        raise TransportError(
            f"cannot tell the completion channel's file descriptor (unclaimed event files: {sorted(found)})"
        )
    fd = found.pop()
    _claimed.add(fd)
    return fd


def errno_of(exc: BaseException) -> int | None:
    code = getattr(exc, "error_code", None)
    if isinstance(code, int) and code > 0:
        return code
    code = getattr(exc, "errno", None)
    return code if isinstance(code, int) and code > 0 else None


def memlock_text() -> str:
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)

    def fmt(v: int) -> str:
        return "unlimited" if v == resource.RLIM_INFINITY else f"{v // 1024} KiB"

    return f"soft {fmt(soft)}, hard {fmt(hard)}"


def registration_error(exc: BaseException, nbytes: int, what: str = "memory") -> RegistrationError:
    """A failed ibv_reg_mr as a tensorwire error; ENOMEM names the memlock limit."""
    code = errno_of(exc)
    if code == errno.ENOMEM:
        return RegistrationError(
            f"registering {nbytes} bytes of {what} with the RDMA device failed: ENOMEM. Registered "
            f"memory is pinned and counts against RLIMIT_MEMLOCK ({memlock_text()}); raise it "
            "('ulimit -l unlimited', LimitMEMLOCK=infinity under systemd, --ulimit memlock=-1 in docker)"
        )
    return RegistrationError(f"registering {nbytes} bytes of {what} with the RDMA device failed: {exc}")
