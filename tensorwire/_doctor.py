"""``tensorwire doctor``: why this machine will or will not get RDMA, and which path a connect takes.

Everything here is read from the running system (sysfs, procfs, the loaded libucx, a real
handshake when an address is given); nothing is guessed from package names alone. The report is
a plain dict so that ``--json`` prints exactly what the table shows.
"""

from __future__ import annotations

import asyncio
import importlib.util
import platform
import resource
from pathlib import Path as FsPath
from typing import Any

import numpy as np

from . import __version__
from ._sysfs import PROC, SYS
from ._sysfs import read_text as _read
from .control._negotiate import _tcp_only, tcp_lanes_only
from .errors import TensorWireError
from .memory._gpudirect import gpudirect_status
from .transports import DEFAULT_PREFERENCE, probe_all
from .transports.ucx._lanes import NO_MESSAGES_TLS, one_sided_direct


def _numa(device_dir: FsPath) -> int | None:
    """NUMA node of a PCI device (None when unknown; the kernel says -1 on single-node machines)."""
    text = _read(device_dir / "numa_node")
    if text is None:
        return None
    try:
        node = int(text)
    except ValueError:
        return None
    return node if node >= 0 else None


def _pci_of(device_dir: FsPath) -> str | None:
    try:
        return device_dir.resolve().name
    except OSError:
        return None


def rdma_devices() -> list[dict[str, Any]]:
    """RDMA devices with their ports: state, link layer, RoCE v2 GIDs, NUMA node, backing netdev."""
    ib = SYS / "class" / "infiniband"
    if not ib.is_dir():
        return []
    out: list[dict[str, Any]] = []
    for dev in sorted(ib.iterdir()):
        ports = []
        for port in sorted((dev / "ports").iterdir()) if (dev / "ports").is_dir() else []:
            gids = []
            types = port / "gid_attrs" / "types"
            for gid_file in (
                sorted((port / "gids").iterdir(), key=lambda p: int(p.name)) if (port / "gids").is_dir() else []
            ):
                gid = _read(gid_file)
                if not gid or gid.replace(":", "").strip("0") == "":
                    continue
                gids.append({"index": int(gid_file.name), "gid": gid, "type": _read(types / gid_file.name) or "?"})
            ports.append(
                {
                    "port": int(port.name),
                    "state": (_read(port / "state") or "?").split(":")[-1].strip(),
                    "link_layer": _read(port / "link_layer") or "?",
                    "rate": _read(port / "rate") or "?",
                    "gids": gids,
                }
            )
        netdevs = (
            sorted(p.name for p in (dev / "device" / "net").iterdir()) if (dev / "device" / "net").is_dir() else []
        )
        out.append(
            {
                "name": dev.name,
                "pci": _pci_of(dev / "device"),
                "numa_node": _numa(dev / "device"),
                "netdevs": netdevs,
                "ports": ports,
            }
        )
    return out


def gpus() -> list[dict[str, Any]]:
    """NVIDIA GPUs the driver exposes, with PCI address, model and NUMA node."""
    root = PROC / "driver" / "nvidia" / "gpus"
    if not root.is_dir():
        return []
    out = []
    for bus in sorted(root.iterdir()):
        info = _read(bus / "information") or ""
        model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("Model")), "?")
        pci = bus.name.lower()
        out.append({"pci": pci, "model": model, "numa_node": _numa(SYS / "bus" / "pci" / "devices" / pci)})
    return out


def gpudirect() -> dict[str, Any]:
    """Whether a NIC can DMA straight into GPU memory: nvidia-peermem or dma-buf, and why not."""
    return gpudirect_status(SYS, PROC)


def placement(rdma: list[dict[str, Any]], gpu_list: list[dict[str, Any]]) -> list[str]:
    """One line per GPU: the RDMA devices on its NUMA node, or a warning that traffic crosses sockets."""
    lines = []
    for g in gpu_list:
        same = [d["name"] for d in rdma if d["numa_node"] is not None and d["numa_node"] == g["numa_node"]]
        if not rdma:
            lines.append(f"GPU {g['pci']}: no RDMA device to pair with")
        elif g["numa_node"] is None:
            lines.append(f"GPU {g['pci']}: NUMA node unknown (single-node machine?)")
        elif same:
            lines.append(f"GPU {g['pci']} (NUMA {g['numa_node']}): same node as {', '.join(same)}")
        else:
            lines.append(
                f"GPU {g['pci']} (NUMA {g['numa_node']}): no RDMA device on its NUMA node; traffic crosses sockets"
            )
    return lines


def ucx_report() -> dict[str, Any]:
    """UCX as this process would load it: version, library, transports, RDMA."""
    if importlib.util.find_spec("ucxx") is None:
        return {"installed": False, "reason": "ucxx is not installed (pip install 'tensorwire[ucx]')"}
    try:
        from .transports.ucx._lanes import RDMA_TLS
        from .transports.ucx._ucp import load, loaded_library
        from .transports.ucx._worker import context_resources, ucx_options

        resources = context_resources(tuple(sorted(ucx_options().items())))
        ucp = load()
        transports = sorted({t for t, _ in resources})
        return {
            "installed": True,
            "version": ".".join(str(v) for v in ucp.version()),
            "libucp": ucp.path,
            "libucxx": loaded_library("libucxx.so"),
            "transports": transports,
            "devices": [f"{t}/{d}" for t, d in resources],
            "rdma": any(t.startswith(RDMA_TLS) for t in transports),
            "rdma_transports": [t for t in transports if t.startswith(RDMA_TLS)],
        }
    except Exception as exc:
        return {"installed": True, "error": f"{type(exc).__name__}: {exc}"}


async def probe_address(address: str, token: str | None, wait_s: float) -> dict[str, Any]:
    """Connect to a running node for real and report the path the handshake chose, and why."""
    from . import NodeConfig, start

    try:
        async with start("127.0.0.1:0", config=NodeConfig(auth_token=token)) as node:
            # the connect's own timeout says why it had no answer; this one only backs it up
            async with asyncio.timeout(wait_s + 5):
                peer = await node.connect(address, connect_timeout=wait_s)
            try:
                path = peer.path
                return {
                    "address": address,
                    "transport": path.transport,
                    "lanes": list(path.lanes),
                    "rdma": path.rdma,
                    "gpudirect": path.gpudirect,
                    "passed_over": [f"{n}: {r}" for n, r in path.passed_over],
                    "summary": str(path),
                }
            finally:
                await peer.aclose()
    except TensorWireError as exc:  # (first: a ConnectTimeout is a TimeoutError too)
        return {"address": address, "error": f"{type(exc).__name__}: {exc}"}
    except TimeoutError:
        return {"address": address, "error": f"no answer within {wait_s + 5:g} s"}


_ONE_MACHINE_TLS = ("self", "sysv", "posix", "cma", "knem", "xpmem", "cuda_copy", "cuda_ipc", "gdr_copy")


def _pick(
    usable: dict[str, tuple[Any, Any]], unusable: dict[str, str]
) -> tuple[str | None, list[str], dict[str, Any] | None]:
    """What a connect to another tensorwire process with this machine's setup would choose,
    by the handshake's rules (a transport whose lanes are all tcp gives way to tcp), and what
    ranks above it and why not; then the same for a peer on another machine set up the same,
    by the same rules, with only the UCX lanes that leave this machine (shared memory does not):
    None where nothing is usable."""
    remote = [n for n in DEFAULT_PREFERENCE if n != "inproc"]

    def choose(across: bool) -> tuple[str | None, list[str], tuple[str, ...]]:
        passed: list[str] = []
        for i, name in enumerate(remote):
            if name not in usable:
                passed.append(f"{name}: {unusable[name]}")
                continue
            caps = usable[name][1]
            lanes, tcp_only, where = caps.lanes, _tcp_only(caps), ""
            if across and name == "ucx":
                lanes = tuple(lane for lane in caps.lanes if not lane.split("/")[0].startswith(_ONE_MACHINE_TLS))
                if lanes != caps.lanes:  # (else all is as for a process here)
                    tcp_only, where = bool(lanes) and tcp_lanes_only(lanes), "across machines "
                if not lanes:  # UCX cannot make an endpoint to another machine
                    shown = ", ".join(caps.lanes) or "none"
                    passed.append(f"ucx: across machines no lane ({shown} reach only this machine)")
                    continue
            if name != "tcp" and "tcp" in remote[i + 1 :] and "tcp" in usable and tcp_only:
                passed.append(f"{name}: {where}{_TCP_ONLY} ({', '.join(lanes)})")
                continue
            if name == "ucx" and lanes and all(lane.split("/")[0] in NO_MESSAGES_TLS for lane in lanes):
                # (here only across machines: a context with no other lane offers no ucx at all)
                passed.append(
                    f"ucx: {where}no lane carries messages, so UCX cannot create an endpoint ({', '.join(lanes)})"
                )
                continue
            return name, passed, lanes
        return None, passed, ()

    pick, passed, _ = choose(across=False)
    far, far_passed, far_lanes = choose(across=True)
    machine: dict[str, Any] | None = None
    if far is not None:
        machine = {"transport": far, "passed_over": far_passed}
        if far == "ucx":
            machine["lanes"] = list(far_lanes)
    return pick, passed, machine


_TCP_ONLY = "only tcp lanes: tensorwire's tcp transport moves those bytes with less machinery"


def report(address: str | None = None, token: str | None = None, timeout: float = 10.0) -> dict[str, Any]:
    usable, unusable = probe_all(DEFAULT_PREFERENCE)
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)

    def lim(v: int) -> str:
        return "unlimited" if v == resource.RLIM_INFINITY else f"{v // 1024} KiB"

    transports: dict[str, Any] = {
        n: {"usable": True, "rdma": c.rdma, "one_sided": c.one_sided, "memory": list(c.memory_kinds)}
        for n, (_, c) in usable.items()
    }
    ucx_caps = usable["ucx"][1] if "ucx" in usable else None
    if ucx_caps is not None and ucx_caps.one_sided and not one_sided_direct(ucx_caps.lanes):
        # (UCX_TLS=posix, or a container without cma): rkeys still work, but UCX emulates each
        # get/put over its message lanes and the owner's event loop serves it
        transports["ucx"]["one_sided_emulated"] = True
        transports["ucx"]["note"] = (
            f"one-sided get/put emulated by UCX: none of its lanes here ({', '.join(ucx_caps.lanes)}) reaches a "
            "peer's memory without the peer's CPU (cma, knem, xpmem or RDMA), so the owner's event loop serves "
            "every read and write (receipts say one-sided-emulated)"
        )
    transports.update({n: {"usable": False, "reason": r} for n, r in unusable.items()})
    remote_pick, passed, machine_pick = _pick(usable, unusable)
    rdma = rdma_devices()
    gpu_list = gpus()
    if "verbs" in unusable and not rdma:
        transports["verbs"]["note"] = "this machine has no RDMA device, so verbs would have nothing to use anyway"
    out: dict[str, Any] = {
        "tensorwire": __version__,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "transports": transports,
        "preference": list(DEFAULT_PREFERENCE),
        "connect_to_another_process": {"transport": remote_pick, "passed_over": passed},
        "connect_to_another_machine": machine_pick,
        "rdma_devices": rdma,
        "memlock": {
            "soft": lim(soft),
            "hard": lim(hard),
            "warning": (
                "memlock is limited: RDMA registration of large tensors will fail with ENOMEM "
                "(raise it: ulimit -l unlimited, or LimitMEMLOCK=infinity for a service)"
                if rdma and soft != resource.RLIM_INFINITY
                else None
            ),
        },
        "gpus": gpu_list,
        "gpudirect": gpudirect(),
        "placement": placement(rdma, gpu_list),
        "ucx": ucx_report(),
    }
    if address is not None:
        out["connect"] = asyncio.run(probe_address(address, token, timeout))
    return out


def render(rep: dict[str, Any]) -> str:
    lines = [
        f"tensorwire {rep['tensorwire']} (python {rep['python']}, numpy {rep['numpy']})",
        "transports (preference order):",
    ]
    for name in rep["preference"]:
        t = rep["transports"][name]
        if t["usable"]:
            one_sided = "emulated" if t.get("one_sided_emulated") else t["one_sided"]
            lines.append(f"  {name:7} usable   rdma={t['rdma']} one_sided={one_sided} memory={','.join(t['memory'])}")
        else:
            lines.append(f"  {name:7} unusable {t['reason']}")
        if t.get("note"):
            lines.append(f"          ({t['note']})")
    pick = rep["connect_to_another_process"]
    lines.append(f"a connect to another process on this machine would use: {pick['transport']}")
    lines += [f"  not {line}" for line in pick["passed_over"]]
    machine = rep.get("connect_to_another_machine")
    if machine is not None:
        lanes = f" [{', '.join(machine['lanes'])}]" if machine.get("lanes") else ""
        same = machine["transport"] == pick["transport"] and machine.get("passed_over") == pick["passed_over"]
        if same:  # its reasons are the lines above
            lanes += " (as to another process here)"
        lines.append(f"a connect to another machine would use: {machine['transport']}{lanes}")
        lines += [] if same else [f"  not {line}" for line in machine.get("passed_over", [])]
    if not rep["rdma_devices"]:
        lines.append(f"RDMA devices: none (nothing in {SYS / 'class' / 'infiniband'})")
    else:
        lines.append("RDMA devices:")
        for d in rep["rdma_devices"]:
            numa = "?" if d["numa_node"] is None else d["numa_node"]
            lines.append(f"  {d['name']} pci={d['pci']} numa={numa} netdev={','.join(d['netdevs']) or '-'}")
            for p in d["ports"]:
                v2 = [g for g in p["gids"] if "v2" in g["type"].lower()]
                gid = f"RoCE v2 GID index {v2[0]['index']} ({v2[0]['gid']})" if v2 else f"{len(p['gids'])} GIDs"
                lines.append(f"    port {p['port']}: {p['state']} {p['link_layer']} {p['rate']}; {gid}")
    lock = rep["memlock"]
    lines.append(f"memlock limit: soft {lock['soft']}, hard {lock['hard']}")
    if lock["warning"]:
        lines.append(f"  warning: {lock['warning']}")
    if not rep["gpus"]:
        lines.append("GPUs: none visible")
    else:
        lines.append("GPUs:")
        lines += [
            f"  {g['pci']} {g['model']} numa={'?' if g['numa_node'] is None else g['numa_node']}" for g in rep["gpus"]
        ]
    gd = rep["gpudirect"]
    if gd["driver"] is None:
        lines.append("GPUDirect RDMA: no (no NVIDIA driver loaded)")
    else:
        state = "ready" if gd["ready"] else "not ready"
        lines.append(f"GPUDirect RDMA: {state} (peermem={gd['peermem']}, dmabuf={gd['dmabuf']}); {gd['driver']}")
        lines += [f"  {why}" for why in gd["why_not"]]
    lines += [f"  {line}" for line in rep["placement"]]
    ucx = rep["ucx"]
    if not ucx["installed"]:
        lines.append(f"UCX: {ucx['reason']}")
    elif "error" in ucx:
        lines.append(f"UCX: unusable ({ucx['error']})")
    else:
        rdma_tls = ", ".join(ucx["rdma_transports"]) or "none (this libucx has no verbs/RDMA transports)"
        lines.append(f"UCX {ucx['version']} from {ucx['libucp']}")
        lines.append(f"  transports: {', '.join(ucx['devices'])}")
        lines.append(f"  RDMA transports: {rdma_tls}")
    conn = rep.get("connect")
    if conn is not None:
        if "error" in conn:
            lines.append(f"connect {conn['address']}: failed: {conn['error']}")
        else:
            lines.append(f"connect {conn['address']}: {conn['summary']}")
    return "\n".join(lines)
