"""`tensorwire doctor`: RDMA devices, GPUs, GPUDirect readiness and placement read from sysfs/procfs,
and a real handshake against a given address."""

from __future__ import annotations

import importlib.util
import json
import os
import resource
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tensorwire import _doctor
from tensorwire._sysfs import read_text

pytestmark = pytest.mark.timeout(90)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


@pytest.fixture
def fake_machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """A sysfs/procfs layout as a two-socket RoCE box with one GPU presents it (the real one has none)."""
    sys_root, proc = tmp_path / "sys", tmp_path / "proc"
    pci_nic = sys_root / "devices" / "pci0000:80" / "0000:81:00.0"
    _write(pci_nic / "numa_node", "1")
    (pci_nic / "net" / "ens1f0").mkdir(parents=True)
    dev = sys_root / "class" / "infiniband" / "mlx5_0"
    dev.mkdir(parents=True)
    (dev / "device").symlink_to(pci_nic)
    port = dev / "ports" / "1"
    _write(port / "state", "4: ACTIVE")
    _write(port / "link_layer", "Ethernet")
    _write(port / "rate", "100 Gb/sec (4X EDR)")
    for i, (gid, kind) in enumerate(
        [
            ("fe80:0000:0000:0000:0a00:27ff:fe00:0001", "IB/RoCE v1"),
            ("fe80:0000:0000:0000:0a00:27ff:fe00:0001", "RoCE v2"),
            ("0000:0000:0000:0000:0000:ffff:0a00:0001", "IB/RoCE v1"),
            ("0000:0000:0000:0000:0000:ffff:0a00:0001", "RoCE v2"),
            ("0000:0000:0000:0000:0000:0000:0000:0000", ""),
        ]
    ):
        _write(port / "gids" / str(i), gid)
        _write(port / "gid_attrs" / "types" / str(i), kind)
    _write(
        proc / "driver" / "nvidia" / "version", "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.1  (proprietary)"
    )
    _write(
        proc / "driver" / "nvidia" / "gpus" / "0000:17:00.0" / "information",
        "Model: \t\t NVIDIA H100 80GB HBM3\nIRQ: 1",
    )
    _write(sys_root / "bus" / "pci" / "devices" / "0000:17:00.0" / "numa_node", "0")
    monkeypatch.setattr(_doctor, "SYS", sys_root)
    monkeypatch.setattr(_doctor, "PROC", proc)
    return sys_root, proc


def test_read_text_reads_a_kernel_file_whole_and_none_where_it_cannot(tmp_path: Path) -> None:
    # one read for an attribute; a /proc file longer than a read's chunk is read to its end
    big = tmp_path / "maps"
    big.write_bytes(b"x" * (3 << 16) + b"end\n")
    text = read_text(big)
    assert text is not None and len(text) == (3 << 16) + 3 and text.endswith("xend")
    (tmp_path / "state").write_text("4: ACTIVE\n")
    assert read_text(str(tmp_path / "state")) == "4: ACTIVE"
    assert read_text(tmp_path / "absent") is None and read_text(tmp_path) is None


def test_rdma_devices_ports_and_roce_v2_gid(fake_machine: tuple[Path, Path]) -> None:
    (dev,) = _doctor.rdma_devices()
    assert dev["name"] == "mlx5_0" and dev["numa_node"] == 1 and dev["netdevs"] == ["ens1f0"]
    assert dev["pci"] == "0000:81:00.0"
    (port,) = dev["ports"]
    assert port["state"] == "ACTIVE" and port["link_layer"] == "Ethernet"
    assert [g["index"] for g in port["gids"]] == [0, 1, 2, 3]  # the all-zero GID is not listed
    text = _doctor.render(_doctor.report())
    # the RoCE v2 GID shown is the first v2 entry (IPv6 link-local here), with its index
    assert "RoCE v2 GID index 1" in text


def test_gpu_placement_and_gpudirect_reasons(fake_machine: tuple[Path, Path]) -> None:
    rep = _doctor.report()
    (gpu,) = rep["gpus"]
    assert gpu == {"pci": "0000:17:00.0", "model": "NVIDIA H100 80GB HBM3", "numa_node": 0}
    gd = rep["gpudirect"]
    assert not gd["peermem"] and not gd["dmabuf"] and not gd["ready"]
    assert any("nvidia-peermem" in why for why in gd["why_not"])
    assert any("open kernel modules" in why for why in gd["why_not"])
    # the GPU sits on node 0, the NIC on node 1
    assert rep["placement"] == ["GPU 0000:17:00.0 (NUMA 0): no RDMA device on its NUMA node; traffic crosses sockets"]
    if resource.getrlimit(resource.RLIMIT_MEMLOCK)[0] != resource.RLIM_INFINITY:
        assert "ENOMEM" in rep["memlock"]["warning"]  # RDMA devices present and memlock limited
    text = _doctor.render(rep)
    assert "GPUDirect RDMA: not ready" in text and "traffic crosses sockets" in text


def test_peermem_loaded_makes_gpudirect_ready(fake_machine: tuple[Path, Path]) -> None:
    sys_root, _ = fake_machine
    (sys_root / "module" / "nvidia_peermem").mkdir(parents=True)
    gd = _doctor.gpudirect()
    assert gd["peermem"] and gd["ready"] and gd["why_not"] == []


def test_dma_buf_readiness_is_judged_by_the_recorded_machines_kernel(fake_machine: tuple[Path, Path]) -> None:
    """With TENSORWIRE_PROCFS naming a recorded copy of another machine's /proc, the doctor
    read its driver there but judged dma-buf by this machine's kernel (platform.release()): a
    recorded 5.4 box with NVIDIA's open modules was 'GPUDirect RDMA: ready (dmabuf=True)'
    wherever the doctor ran on 5.12 or later, and the reverse. The kernel's own release is in
    the tree (sys/kernel/osrelease), as it is in /proc."""
    _, proc = fake_machine
    _write(proc / "driver" / "nvidia" / "version", "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.1")
    _write(proc / "sys" / "kernel" / "osrelease", "5.4.0-150-generic")
    gd = _doctor.gpudirect()
    assert not gd["dmabuf"] and not gd["ready"], gd
    assert "dma-buf needs Linux >= 5.12 (this is 5.4.0-150-generic)" in gd["why_not"], gd
    _write(proc / "sys" / "kernel" / "osrelease", "6.8.0-49-generic")
    gd = _doctor.gpudirect()
    assert gd["dmabuf"] and gd["ready"] and gd["why_not"] == [], gd


def test_an_empty_tensorwire_sysfs_or_procfs_reads_the_real_trees(tmp_path: Path) -> None:
    """``TENSORWIRE_SYSFS=`` (set, empty: an env file's or a chart's unset value) was the path
    '', the current directory: the doctor listed whatever RDMA devices and NVIDIA driver a
    tree under it held (or none where the machine has them), and so did the GPUDirect check
    behind a ucx path's ``gpudirect``. Empty is unset: /sys and /proc."""
    _write(tmp_path / "class" / "infiniband" / "mlx5_9" / "ports" / "1" / "state", "4: ACTIVE")
    _write(tmp_path / "driver" / "nvidia" / "version", "NVRM version: NVIDIA UNIX Open Kernel Module  580.1")
    env = {**os.environ, "TENSORWIRE_SYSFS": "", "TENSORWIRE_PROCFS": ""}
    out = subprocess.run(
        [sys.executable, "-m", "tensorwire.cli", "doctor", "--json"],
        capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    real = json.loads(subprocess.run(
        [sys.executable, "-m", "tensorwire.cli", "doctor", "--json"], capture_output=True, text=True, timeout=60,
    ).stdout)  # fmt: skip
    assert [d["name"] for d in rep["rdma_devices"]] == [d["name"] for d in real["rdma_devices"]], rep["rdma_devices"]
    assert rep["gpudirect"] == real["gpudirect"], rep["gpudirect"]


def test_this_machine_has_no_rdma_and_says_so() -> None:
    rep = _doctor.report()
    if rep["rdma_devices"]:
        pytest.skip("this machine has RDMA devices")
    text = _doctor.render(rep)
    assert "RDMA devices: none" in text


def _serve() -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tensorwire.cli", "serve", "--address", "127.0.0.1:0", "--transports", "tcp"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    return proc, line.split("serving at")[1].strip()


def test_doctor_address_reports_the_negotiated_path() -> None:
    proc, address = _serve()
    try:
        out = subprocess.run(
            [sys.executable, "-m", "tensorwire.cli", "doctor", address, "--json"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        conn = json.loads(out.stdout)["connect"]
        # the server only offers tcp, so that is what the handshake picks; ucx is passed over
        assert conn["transport"] == "tcp" and conn["rdma"] is False
        assert conn["lanes"] and conn["summary"].startswith("tcp [")
        table = subprocess.run(
            [sys.executable, "-m", "tensorwire.cli", "doctor", address], capture_output=True, text=True, timeout=60
        )
        assert f"connect {address}: tcp [" in table.stdout
    finally:
        proc.terminate()
        proc.wait(10)
        assert proc.stdout is not None
        proc.stdout.close()


def test_doctor_address_that_does_not_answer_fails_clearly() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "tensorwire.cli", "doctor", "127.0.0.1:9", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1
    conn = json.loads(out.stdout)["connect"]
    assert "error" in conn and conn["address"] == "127.0.0.1:9"


async def test_doctor_address_that_accepts_but_never_answers_says_what_it_may_be() -> None:
    # a listener that takes the connection and says nothing (no tensorwire node, or one too
    # busy): the doctor said only "no answer within 10 s", and bench "took longer than 10.0 s"
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        conn = await _doctor.probe_address(address, None, 0.5)
    assert conn["error"] == (
        f"ConnectTimeout: connecting to {address} took longer than 0.5 s: nothing answered the handshake. "
        f"{address} may not be a tensorwire node (check the address and port), a firewall may drop the "
        "connection, or the node is too busy to answer in time"
    ), conn


def test_passed_over_names_only_transports_ranked_above_the_pick(monkeypatch: pytest.MonkeyPatch) -> None:
    from tensorwire.transports import DEFAULT_PREFERENCE, Capabilities

    caps = Capabilities(memory_kinds=("host",), lanes=("sysv/memory", "cma/memory"))
    verbs_why = "pyverbs is not installed"

    def probe_all(_names: object, *, ucx: bool) -> tuple[dict[str, object], dict[str, str]]:
        usable = {n: (None, caps) for n in ("inproc", "tcp", *(("ucx",) if ucx else ()))}
        return usable, {"verbs": verbs_why, **({} if ucx else {"ucx": "no libucx"})}

    assert DEFAULT_PREFERENCE.index("ucx") < DEFAULT_PREFERENCE.index("verbs") < DEFAULT_PREFERENCE.index("tcp")
    monkeypatch.setattr(_doctor, "probe_all", lambda names: probe_all(names, ucx=True))
    rep = _doctor.report()
    # verbs ranks below ucx: it was never a candidate, so it was not passed over
    assert rep["connect_to_another_process"] == {"transport": "ucx", "passed_over": []}
    assert "not verbs" not in _doctor.render(rep).split("a connect to another machine")[0]
    # across machines those shared-memory lanes give way to tcp, which verbs ranks above
    assert rep["connect_to_another_machine"]["transport"] == "tcp"
    assert rep["connect_to_another_machine"]["passed_over"][1:] == [f"verbs: {verbs_why}"]
    monkeypatch.setattr(_doctor, "probe_all", lambda names: probe_all(names, ucx=False))
    pick = _doctor.report()["connect_to_another_process"]
    assert pick == {"transport": "tcp", "passed_over": ["ucx: no libucx", f"verbs: {verbs_why}"]}


@pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="ucxx is not installed")
def test_ucx_with_only_shared_memory_lanes_reaches_another_machine_over_tcp() -> None:
    # UCX limited to shared memory cannot make an endpoint to another machine, so the handshake
    # passes ucx over for tcp; the doctor said nothing at all about another machine
    env = {**os.environ, "UCX_TLS": "sm,self"}
    args = [sys.executable, "-m", "tensorwire.cli", "doctor"]
    out = subprocess.run([*args, "--json"], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    assert rep["connect_to_another_process"]["transport"] == "ucx"
    machine = rep["connect_to_another_machine"]
    assert machine is not None and machine["transport"] == "tcp", machine
    why, *below = machine["passed_over"]  # then verbs, where it is unusable (it ranks above tcp)
    assert why.startswith("ucx: across machines no lane") and "reach only this machine" in why
    verbs = rep["transports"]["verbs"]
    assert below == ([] if verbs["usable"] else [f"verbs: {verbs['reason']}"]), below
    table = subprocess.run(args, capture_output=True, text=True, timeout=60, env=env).stdout
    assert "a connect to another machine would use: tcp\n  not ucx: across machines no lane" in table


@pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="ucxx is not installed")
def test_ucx_with_no_lane_for_messages_is_passed_over_as_the_handshake_does() -> None:
    """UCX_TLS=cma: UCX lists a lane, but one that only moves get/put, so it cannot create an
    endpoint and a real connect passes ucx over for tcp; the doctor said ucx."""
    import asyncio

    import tensorwire
    from tensorwire.transports.ucx import ucx_config

    async def real() -> str:
        options = {"transports": ("ucx", "tcp")}  # two nodes here, as two processes would be
        async with tensorwire.start("127.0.0.1:0", **options) as a, tensorwire.start("127.0.0.1:0", **options) as b:
            peer = await a.connect(b.address)
            await peer.aclose()
            return peer.path.transport

    with ucx_config(TLS="cma"):
        pick = _doctor.report()["connect_to_another_process"]
        assert asyncio.run(real()) == "tcp"
    assert pick["transport"] == "tcp", pick
    assert any(why.startswith("ucx: no lane carries messages") for why in pick["passed_over"]), pick


def test_no_rdma_devices_names_the_tree_it_looked_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # TENSORWIRE_SYSFS points the doctor at a recorded tree: it said "no /sys/class/infiniband"
    monkeypatch.setattr(_doctor, "SYS", tmp_path)
    text = _doctor.render(_doctor.report())
    assert f"RDMA devices: none (nothing in {tmp_path / 'class' / 'infiniband'})" in text


def test_a_tcp_pick_also_says_what_another_machine_would_get() -> None:
    """Where a connect here takes tcp (UCX with only tcp lanes, or no UCX at all), the doctor
    left out the line for another machine, which it printed where the pick was ucx."""
    env = {**os.environ, "UCX_TLS": "tcp"}
    args = [sys.executable, "-m", "tensorwire.cli", "doctor"]
    out = subprocess.run([*args, "--json"], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    here = rep["connect_to_another_process"]
    assert here["transport"] == "tcp", here
    assert rep["connect_to_another_machine"] == here  # the same transport, for the same reasons
    table = subprocess.run(args, capture_output=True, text=True, timeout=60, env=env).stdout
    assert "a connect to another machine would use: tcp (as to another process here)\n" in table, table


def test_another_machine_gets_what_the_handshake_picks_after_ucx(monkeypatch: pytest.MonkeyPatch) -> None:
    """UCX whose only lanes off this machine are tcp gives way across machines, to the next
    transport the handshake would pick: verbs where it is usable (the doctor said tcp)."""
    from tensorwire.transports import Capabilities

    ucx = Capabilities(lanes=("sysv/memory", "cma/memory", "tcp/eth0"))
    verbs = Capabilities(rdma=True, lanes=("rxe0:1",))
    usable = {name: (None, Capabilities()) for name in ("inproc", "tcp")} | {"ucx": (None, ucx), "verbs": (None, verbs)}
    monkeypatch.setattr(_doctor, "probe_all", lambda names: (usable, {}))
    rep = _doctor.report()
    assert rep["connect_to_another_process"] == {"transport": "ucx", "passed_over": []}
    machine = rep["connect_to_another_machine"]
    assert machine["transport"] == "verbs", machine
    assert [why.split(":")[0] for why in machine["passed_over"]] == ["ucx"], machine
