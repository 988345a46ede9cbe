"""tensorwire's ucx transport against raw ucxx, two processes on loopback.

For each UCX_TLS setting (UCX's default choice, which on one machine is shared memory, and
tcp) this measures, in the same run:

- send/recv bandwidth, 1 MiB .. 512 MiB: raw ucxx tag send/recv (worker progressed by a busy
  loop, the fastest way to drive ucxx) against ``peer.send`` / ``peer.recv(out=...)``; each
  transfer is timed from the send to an 8-byte acknowledgement, on both sides the same way;
- the 8-byte round trip (ping-pong, median);
- one-sided put and get: ucp_put_nbx / ucp_get_nbx through tensorwire's bindings on raw
  handles with a busy loop, against ``UcxChannel.put`` / ``get`` driven by the node's loop.

Goals: tensorwire ucx >= 0.9x raw ucxx bandwidth at >= 1 MiB; 8-byte round trip within 1.5x
of raw ucxx. Run: ``python benchmarks/ucx_p2p.py [--sizes-mib 1 4 ...] [--tls default tcp]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

MiB = 1 << 20
SIZES = [1, 4, 16, 64, 256, 512]
RTT_ITERS = 3000


def _reps(nbytes: int) -> int:
    """Timed repetitions (each of _window messages): about 1 GiB per size and operation."""
    return max(3, min(10, (1 << 30) // (nbytes * _window(nbytes))))


def _window(nbytes: int) -> int:
    """Messages in flight at once for the bandwidth rows (as osu_bw does), both raw and tensorwire."""
    return max(1, min(8, (64 * MiB) // nbytes))


def _options(tls: str) -> dict[str, str]:
    return {} if tls == "default" else {"TLS": tls}


# -- raw ucxx -------------------------------------------------------------------------------
class _Raw:
    def __init__(self, tls: str) -> None:
        from tensorwire.transports.ucx._worker import import_ucxx

        self.lib = import_ucxx()
        from ucxx._lib.arr import Array

        self.Array = Array
        feats = self.lib.Feature
        self.ctx = self.lib.UCXContext(
            {"WARN_UNUSED_ENV_VARS": "n", **_options(tls)}, feature_flags=(feats.TAG, feats.RMA, feats.WAKEUP)
        )
        self.worker = self.lib.UCXWorker(self.ctx)
        self.ep: Any = None

    def connect(self, address: bytes) -> None:
        addr = self.lib.UCXAddress.create_from_buffer(address)
        self.ep = self.worker.create_endpoint_from_worker_address(addr, False)

    def wait(self, *reqs: Any) -> None:
        w = self.worker
        while not all(r.completed for r in reqs):
            w.progress()
        for r in reqs:
            r.check_error()

    def send(self, buf: Any, tag: int) -> Any:
        return self.ep.tag_send(self.Array(buf), self.lib.UCXXTag(tag))

    def recv(self, buf: Any, tag: int) -> Any:
        return self.worker.tag_recv(self.Array(buf), self.lib.UCXXTag(tag))

    def wait_raw(self, ucp: Any, req: int | None) -> None:
        if req is None:
            return
        w = self.worker
        while not ucp.request_done(req):
            w.progress()
        status = ucp.request_finish(req)
        if status:
            raise RuntimeError(ucp.status_string(status))


def raw_server(tls: str, sizes: list[int]) -> dict[str, Any]:
    from tensorwire.transports.ucx._ucp import load

    r = _Raw(tls)
    ucp = load()
    child = subprocess.Popen(
        [sys.executable, __file__, "_raw-client", tls, bytes(r.worker.address).hex(), json.dumps(sizes)],
        stdout=subprocess.PIPE,
        text=True,
    )
    hello = np.zeros(4096, np.uint8)
    r.wait(r.recv(hello, 1))
    n = int.from_bytes(hello[:4].tobytes(), "little")
    r.connect(hello[4 : 4 + n].tobytes())
    ack = np.zeros(8, np.uint8)
    out: dict[str, Any] = {"bw": {}, "put": {}, "get": {}}
    for size in sizes:
        buf = np.ones(size * MiB, np.uint8)
        win = _window(buf.nbytes)
        times = []
        for i in range(_reps(buf.nbytes) + 1):
            t0 = time.perf_counter()
            a = r.recv(ack, 3)
            r.wait(*[r.send(buf, 2) for _ in range(win)], a)
            if i:
                times.append(time.perf_counter() - t0)
        out["bw"][size] = win * buf.nbytes / min(times) / 1e9
    x = np.zeros(8, np.uint8)
    lat = []
    for _ in range(RTT_ITERS):
        t0 = time.perf_counter()
        a = r.recv(x, 5)
        r.wait(r.send(x, 4), a)
        lat.append(time.perf_counter() - t0)
    out["rtt_us"] = statistics.median(lat[100:]) * 1e6
    # one-sided: register a region, give the child its rkey, let it put and get
    region = np.zeros(max(sizes) * MiB, np.uint8)
    memh = ucp.mem_map(r.ctx.handle, region.ctypes.data, region.nbytes)
    rkey = ucp.rkey_pack(r.ctx.handle, memh)
    info = np.frombuffer(region.ctypes.data.to_bytes(8, "little") + len(rkey).to_bytes(4, "little") + rkey, np.uint8)
    r.wait(r.send(info, 6))
    done = np.zeros(8, np.uint8)
    r.wait(r.recv(done, 7))
    ucp.mem_unmap(r.ctx.handle, memh)
    # keep progressing until the child exits: its endpoint close (a flush) needs this side
    t_end = time.monotonic() + 60
    while child.poll() is None and time.monotonic() < t_end:
        r.worker.progress()
    assert child.stdout is not None
    result = json.loads(child.stdout.read().strip().splitlines()[-1])
    out["put"], out["get"] = result["put"], result["get"]
    return out


def raw_client(tls: str, address: str) -> None:
    from tensorwire.transports.ucx._ucp import load

    r = _Raw(tls)
    ucp = load()
    r.connect(bytes.fromhex(address))
    mine = bytes(r.worker.address)
    r.wait(r.send(np.frombuffer(len(mine).to_bytes(4, "little") + mine, np.uint8), 1))
    ack = np.zeros(8, np.uint8)
    sizes = SIZES_ARG
    for size in sizes:
        bufs = [np.empty(size * MiB, np.uint8) for _ in range(_window(size * MiB))]
        for _ in range(_reps(size * MiB) + 1):
            r.wait(*[r.recv(b, 2) for b in bufs])
            r.wait(r.send(ack, 3))
    x = np.zeros(8, np.uint8)
    for _ in range(RTT_ITERS):
        r.wait(r.recv(x, 4))
        r.wait(r.send(x, 5))
    info = np.zeros(4096, np.uint8)
    r.wait(r.recv(info, 6))
    addr = int.from_bytes(info[:8].tobytes(), "little")
    klen = int.from_bytes(info[8:12].tobytes(), "little")
    rkey = ucp.rkey_unpack(r.ep.handle, info[12 : 12 + klen].tobytes())
    res: dict[str, dict[int, float]] = {"put": {}, "get": {}}
    for size in sizes:
        buf = np.ones(size * MiB, np.uint8)
        for op in ("put", "get"):
            times = []
            for i in range(_reps(buf.nbytes) + 1):
                t0 = time.perf_counter()
                if op == "put":
                    r.wait_raw(ucp, ucp.put(r.ep.handle, buf.ctypes.data, buf.nbytes, addr, rkey))
                    r.wait_raw(ucp, ucp.flush(r.ep.handle))
                else:
                    r.wait_raw(ucp, ucp.get(r.ep.handle, buf.ctypes.data, buf.nbytes, addr, rkey))
                if i:
                    times.append(time.perf_counter() - t0)
            res[op][size] = buf.nbytes / min(times) / 1e9
    ucp.rkey_destroy(rkey)
    r.wait(r.send(np.zeros(8, np.uint8), 7))
    print(json.dumps(res), flush=True)


# -- tensorwire -----------------------------------------------------------------------------
async def tw_server(tls: str, sizes: list[int]) -> dict[str, Any]:
    import tensorwire
    from tensorwire.transports.ucx import ucx_config

    out: dict[str, Any] = {"bw": {}, "put": {}, "get": {}}
    with ucx_config(**_options(tls)):
        async with tensorwire.start("127.0.0.1:0", transports=("ucx",)) as node:
            child = await asyncio.create_subprocess_exec(
                sys.executable, __file__, "_tw-client", tls, node.address, json.dumps(sizes)
            )
            peer = await node.accept()
            out["path"] = str(peer.path)
            ack = np.zeros(1, np.uint8)
            for size in sizes:
                buf = np.ones(size * MiB, np.uint8)
                win = _window(buf.nbytes)
                times = []
                for i in range(_reps(buf.nbytes) + 1):
                    t0 = time.perf_counter()
                    await asyncio.gather(*[peer.send(buf, tag=2) for _ in range(win)])
                    await peer.recv(tag=3, out=ack)
                    if i:
                        times.append(time.perf_counter() - t0)
                out["bw"][size] = win * buf.nbytes / min(times) / 1e9
            x = np.zeros(1, np.float64)
            lat = []
            for _ in range(RTT_ITERS):
                t0 = time.perf_counter()
                await peer.send(x, tag=4)
                await peer.recv(tag=5, out=x)
                lat.append(time.perf_counter() - t0)
            out["rtt_us"] = statistics.median(lat[100:]) * 1e6
            region = np.zeros(max(sizes) * MiB, np.uint8)
            transport = node.transports["ucx"]
            with transport.register(region) as mr:  # type: ignore[attr-defined]
                await peer.send({"addr": mr.address, "rkey": mr.rkey}, tag=6)
                result = await peer.recv(tag=7)
            out["put"], out["get"] = result["put"], result["get"]
            await child.wait()
    return out


async def tw_client(tls: str, address: str) -> None:
    import tensorwire
    from tensorwire.transports.ucx import ucx_config

    with ucx_config(**_options(tls)):
        async with tensorwire.start("127.0.0.1:0", transports=("ucx",)) as node:
            peer = await node.connect(address)
            ack = np.zeros(1, np.uint8)
            for size in SIZES_ARG:
                bufs = [np.empty(size * MiB, np.uint8) for _ in range(_window(size * MiB))]
                for _ in range(_reps(size * MiB) + 1):
                    await asyncio.gather(*[peer.recv(tag=2, out=b) for b in bufs])
                    await peer.send(ack, tag=3)
            x = np.zeros(1, np.float64)
            for _ in range(RTT_ITERS):
                await peer.recv(tag=4, out=x)
                await peer.send(x, tag=5)
            info = await peer.recv(tag=6)
            ch = peer.channel
            rkey = ch.remote_key(info["rkey"])  # type: ignore[attr-defined]
            res: dict[str, dict[int, float]] = {"put": {}, "get": {}}
            for size in SIZES_ARG:
                buf = np.ones(size * MiB, np.uint8)
                for op in ("put", "get"):
                    times = []
                    for i in range(_reps(buf.nbytes) + 1):
                        t0 = time.perf_counter()
                        if op == "put":
                            await ch.put(buf, info["addr"], rkey)  # type: ignore[attr-defined]
                        else:
                            await ch.get(info["addr"], rkey, buf)  # type: ignore[attr-defined]
                        if i:
                            times.append(time.perf_counter() - t0)
                    res[op][size] = buf.nbytes / min(times) / 1e9
            rkey.close()
            await peer.send(res, tag=7)
            await peer.aclose()


# -- report ---------------------------------------------------------------------------------
def _row(tls: str, op: str, size: str, raw: float, tw: float, unit: str, goal: float | None, lower: bool) -> str:
    ratio = (raw / tw if lower else tw / raw) if raw and tw else float("nan")
    verdict = "" if goal is None else ("PASS" if ratio >= goal else "MISS")
    fmt = "{:9.1f} us" if unit == "us" else "{:7.2f} GB/s"
    return f"{tls:8} {op:10} {size:>8} {fmt.format(raw):>13} {fmt.format(tw):>13} {ratio:6.2f}x  {verdict}"


def main() -> int:
    global SIZES_ARG
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-mib", type=int, nargs="+", default=SIZES)
    p.add_argument("--tls", nargs="+", default=["default", "tcp"], help="UCX_TLS settings ('default' = UCX's choice)")
    args = p.parse_args()
    SIZES_ARG = args.sizes_mib
    lines = [
        "ratio = tensorwire / raw for bandwidth, raw / tensorwire for latency; goals: bandwidth >= 0.9x at >= 1 MiB, "
        "8-byte round trip within 1.5x (ratio >= 0.67)",
        f"{'UCX_TLS':8} {'op':10} {'size':>8} {'raw ucxx':>13} {'tensorwire':>13} {'ratio':>7}  goal",
    ]
    for tls in args.tls:
        raw = raw_server(tls, SIZES_ARG)
        tw = asyncio.run(tw_server(tls, SIZES_ARG))
        print(f"# UCX_TLS={tls}: tensorwire path {tw['path']}", flush=True)
        for s in SIZES_ARG:
            lines.append(_row(tls, "send/recv", f"{s} MiB", raw["bw"][s], tw["bw"][s], "GB/s", 0.9, False))
        lines.append(_row(tls, "round trip", "8 B", raw["rtt_us"], tw["rtt_us"], "us", 1 / 1.5, True))
        for op in ("put", "get"):
            for s in SIZES_ARG:
                lines.append(_row(tls, op, f"{s} MiB", raw[op][str(s)], tw[op][s], "GB/s", 0.9, False))
    print("\n".join(lines))
    return 0


SIZES_ARG: list[int] = SIZES

if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_raw-client":
        SIZES_ARG = json.loads(sys.argv[4]) if len(sys.argv) > 4 else SIZES
        raw_client(sys.argv[2], sys.argv[3])
    elif len(sys.argv) > 1 and sys.argv[1] == "_tw-client":
        SIZES_ARG = json.loads(sys.argv[4]) if len(sys.argv) > 4 else SIZES
        asyncio.run(tw_client(sys.argv[2], sys.argv[3]))
    else:
        sys.exit(main())
