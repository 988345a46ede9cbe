"""Raw ucxx between two processes on one GPU: what UCX itself moves CUDA memory at (cuda_ipc on
one node), with no tensorwire in the way, beside the device's own copy.

    python benchmarks/gpu_ucx_raw.py [--sizes 1M,16M,256M,1G] [--memory cuda|host] [--json rows.json]

The wire under ``benchmarks/gpu_p2p.py``'s "ucx cuda" rows: the same sizes, the same pattern
(a batch of transfers answered by one 8-byte message, median over batches after a warm-up),
from a CuPy array in this process into one in a child process, with each side's ucxx worker
progressed by a busy loop (the fastest way to drive ucxx) and the UCX options tensorwire's
contexts get (``MEMTYPE_CACHE=n``). Two rows per size:

  seq     each send waits for its completion before the next, and the receiver posts each
          receive into the same array after the last completed: what ``peer.send`` /
          ``peer.recv(out=)`` do in gpu_p2p (tensorwire's ratio to this row is its overhead)
  window  the batch's sends and receives (into separate arrays) all posted at once, as osu_bw
          and ucx_perftest's tag_bw do: what pipelining could reach

Then one-sided: this process registers an array (``ucp_mem_map``, ``ucp_rkey_pack``, as
``node.expose`` does) and the child, its CUDA in use by then, reads it with ``ucp_get_nbx`` at
1, 16 and 64 MiB: on the first H200 run tensorwire's one-sided reads of CUDA memory went UCX's
"software emulation" (docs/gpu.md), and this says whether raw UCX does the same.
The child's UCX names the protocols it used (UCX_PROTO_INFO=used), as gpu_p2p prints them.
``--memory host`` runs the same over host memory (numpy; on a machine without a GPU, this
checks the script itself). Speed is never asserted: exit 0 unless a transfer broke.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's tensorwire

import numpy as np
from _sizes import GiB, MiB, fmt_size, parse_size

from tensorwire.transports.ucx import used_protocols

HELLO, DATA, ACK, SUM, KEY, GOT = 1, 2, 3, 4, 5, 6
GET_SIZES = (1 << 20, 16 << 20, 64 << 20)  # one-sided: small enough for an emulated get (~0.5 GB/s)


def plan(n: int) -> tuple[int, int]:
    """(transfers per batch, timed batches), as gpu_p2p's (a batch more: raw costs little)."""
    return (5, 5) if n <= 16 * MiB else (4, 3) if n <= GiB else (2, 3)


def _raw() -> Any:
    """ucx_p2p.py's raw ucxx (busy-loop progress) with the UCX options every tensorwire context gets
    (_worker._BASE_OPTIONS)."""
    from ucx_p2p import _Raw

    return _Raw("default", {"MEMTYPE_CACHE": "n"})


def _xp(memory: str) -> Any:
    if memory == "cuda":
        import cupy

        return cupy
    return np


def _sum(xp: Any, a: Any) -> int:
    return int(a.sum(dtype=xp.int64))


def child(address: str, memory: str, sizes: list[int]) -> None:
    xp = _xp(memory)
    r = _raw()
    r.connect(bytes.fromhex(address))
    mine = bytes(r.worker.address)
    r.wait(r.send(np.frombuffer(len(mine).to_bytes(4, "little") + mine, np.uint8), HELLO))
    ack = np.zeros(8, np.uint8)
    for n in sizes:
        window, batches = plan(n)
        out = xp.empty(n, xp.uint8)
        # seq: one array, each receive after the last
        for _ in range(1 + batches):
            for _ in range(window):
                r.wait(r.recv(out, DATA))
            r.wait(r.send(ack, ACK))
        total = np.array([_sum(xp, out)], np.int64)
        # window: a batch's receives at once, each into its own array
        outs = [out] + [xp.empty(n, xp.uint8) for _ in range(window - 1)]
        for _ in range(1 + batches):
            r.wait(*[r.recv(o, DATA) for o in outs])
            r.wait(r.send(ack, ACK))
        total[0] += sum(_sum(xp, o) for o in outs)
        r.wait(r.send(total, SUM))
        del out, outs
    # one-sided: the parent's array, registered there, read (ucp_get) into one of ours, each get
    # waited for before the next; the times go back to the parent
    from tensorwire.transports.ucx._ucp import load

    ucp = load()
    info = np.zeros(4096, np.uint8)
    r.wait(r.recv(info, KEY))
    addr, klen = int.from_bytes(info[:8].tobytes(), "little"), int.from_bytes(info[8:12].tobytes(), "little")
    rkey = ucp.rkey_unpack(r.ep.handle, info[12 : 12 + klen].tobytes())
    times = np.zeros(len(GET_SIZES), np.float64)
    for i, n in enumerate(GET_SIZES):
        out = xp.empty(n, xp.uint8)
        ptr = int(out.data.ptr) if xp is not np else out.ctypes.data
        took = []
        for _ in range(6):
            t0 = time.perf_counter()
            r.wait_raw(ucp, ucp.get(r.ep.handle, ptr, n, addr, rkey))
            took.append(time.perf_counter() - t0)
        times[i] = statistics.median(took[1:])
        del out
    ucp.rkey_destroy(rkey)
    r.wait(r.send(times, GOT))
    # the parent closes its endpoint first and then says so on stdin; meanwhile keep progressing
    import select

    while not select.select([sys.stdin], [], [], 0.001)[0]:
        r.worker.progress()
    sys.stdin.readline()
    r.close()


def d2d_seconds(xp: Any, x: Any, count: int) -> float:
    """The device's own copy of ``x`` (CUDA-event timed), or numpy's on the host."""
    y = xp.empty_like(x)
    y[...] = x
    times = []
    for _ in range(count):
        if xp is np:
            t0 = time.perf_counter()
            np.copyto(y, x)
            times.append(time.perf_counter() - t0)
            continue
        start, stop = xp.cuda.Event(), xp.cuda.Event()
        start.record()
        y[...] = x
        stop.record()
        stop.synchronize()
        times.append(xp.cuda.get_elapsed_time(start, stop) / 1e3)
    return statistics.median(times)


def parent(args: argparse.Namespace) -> int:
    xp = _xp(args.memory)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    r = _raw()
    env = {**os.environ, "UCX_PROTO_INFO": "used"}
    proc = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--child",
            bytes(r.worker.address).hex(),
            "--memory",
            args.memory,
            "--sizes",
            args.sizes,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    hello = np.zeros(4096, np.uint8)
    r.wait(r.recv(hello, HELLO))
    k = int.from_bytes(hello[:4].tobytes(), "little")
    r.connect(hello[4 : 4 + k].tobytes())
    ack = np.zeros(8, np.uint8)
    if args.memory == "cuda":
        import cupy

        dev = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"]
        print(f"device: {dev.decode() if isinstance(dev, bytes) else dev}, CuPy {cupy.__version__}", flush=True)
    rows: dict[int, dict[str, float]] = {}
    broke = False
    for n in sizes:
        window, batches = plan(n)
        x = xp.asarray(np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8))
        want = _sum(xp, x)
        row = rows[n] = {"d2d copy": n / d2d_seconds(xp, x, 10) / 1e9}
        seq, win = [], []
        for b in range(1 + batches):
            t0 = time.perf_counter()
            a = r.recv(ack, ACK)
            for _ in range(window):
                r.wait(r.send(x, DATA))
            r.wait(a)
            if b:
                seq.append((time.perf_counter() - t0) / window)
        for b in range(1 + batches):
            t0 = time.perf_counter()
            a = r.recv(ack, ACK)
            r.wait(*[r.send(x, DATA) for _ in range(window)], a)
            if b:
                win.append((time.perf_counter() - t0) / window)
        total = np.zeros(1, np.int64)
        r.wait(r.recv(total, SUM))
        if int(total[0]) != want * (1 + window):
            print(f"{fmt_size(n)}: the receiver holds byte sum {int(total[0])}, want {want * (1 + window)}")
            broke = True
        row["raw seq"] = n / statistics.median(seq) / 1e9
        row["raw window"] = n / statistics.median(win) / 1e9
        print(f"  {fmt_size(n)}: " + ", ".join(f"{k} {v:.2f} GB/s" for k, v in row.items()), flush=True)
        del x
    # one-sided: an array of ours registered (ucp_mem_map, as node.expose does), its key to the
    # child, which reads it (ucp_get) at each of GET_SIZES
    from tensorwire.transports.ucx._ucp import load

    ucp = load()
    region = xp.asarray(np.random.default_rng(0).integers(0, 256, max(GET_SIZES), dtype=np.uint8))
    ptr = int(region.data.ptr) if xp is not np else region.ctypes.data
    memh = ucp.mem_map(r.ctx.handle, ptr, region.nbytes)
    key = ucp.rkey_pack(r.ctx.handle, memh)
    r.wait(r.send(np.frombuffer(ptr.to_bytes(8, "little") + len(key).to_bytes(4, "little") + key, np.uint8), KEY))
    got = np.zeros(len(GET_SIZES), np.float64)
    r.wait(r.recv(got, GOT))
    ucp.mem_unmap(r.ctx.handle, memh)
    gets = {n: n / t / 1e9 for n, t in zip(GET_SIZES, got, strict=True)}
    print("  one-sided get: " + ", ".join(f"{fmt_size(n)} {v:.2f} GB/s" for n, v in gets.items()), flush=True)
    r.close()
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write("closed\n")
    proc.stdin.close()
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline:
        r.worker.progress()
    report = proc.stdout.read()
    if proc.poll() is None:
        proc.kill()
    print()
    for p in used_protocols(report):
        if args.memory != "cuda" or "cuda" in p.operation:
            print(f"ucx used: {p.protocol} on {p.lanes} for {p.operation}, {p.sizes} bytes ({p.times}x)")
    print()
    print("| size     | d2d copy GB/s | raw seq GB/s | seq/d2d | raw window GB/s | window/d2d |")
    print("|----------|---------------|--------------|---------|-----------------|------------|")
    for n, row in rows.items():
        d2d = row["d2d copy"]
        print(
            f"| {fmt_size(n):8} | {d2d:13.1f} | {row['raw seq']:12.2f} | {row['raw seq'] / d2d:6.2f}x "
            f"| {row['raw window']:15.2f} | {row['raw window'] / d2d:9.2f}x |"
        )
    print(
        "\nGB/s: the array's bytes once per transfer, median over batches after a warm-up; seq: each "
        "transfer completed before the next (as peer.send/peer.recv in gpu_p2p); window: a batch in flight at once."
    )
    print(
        "one-sided get: the child reads this process's registered array (ucp_mem_map, ucp_rkey_pack; "
        "ucp_get_nbx), each get waited for, median of 5 after one; the 'ucx used' lines say over which lane "
        "(software emulation: no lane for it; docs/gpu.md)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({str(n): row for n, row in rows.items()}))
    return 1 if broke or proc.returncode not in (0, None) else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1M,16M,256M,1G", help="comma-separated sizes, e.g. 1M,1G")
    parser.add_argument("--memory", choices=("cuda", "host"), default="cuda")
    parser.add_argument("--json", help="also write the rows (GB/s per size) to this file")
    parser.add_argument("--child", metavar="ADDRESS", help=argparse.SUPPRESS)
    args = parser.parse_args()
    try:
        import ucxx  # noqa: F401
    except ImportError as exc:
        print(f"gpu_ucx_raw: needs ucxx ({exc})", file=sys.stderr)
        return 2
    if args.child:
        child(args.child, args.memory, [parse_size(s) for s in args.sizes.split(",")])
        return 0
    if args.memory == "cuda":
        from tensorwire.memory._cuda import cuda_device_count

        if cuda_device_count() == 0:
            print("gpu_ucx_raw: needs a CUDA GPU and CuPy (--memory host runs it over host memory)", file=sys.stderr)
            return 2
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
