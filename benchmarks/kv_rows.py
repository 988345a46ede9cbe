"""Scattered row reads of an exposed tensor (KV-cache blocks) against one read of the same bytes.

    python benchmarks/kv_rows.py [--transports ucx tcp] [--pool-mib 256] [--block-kib 16 64 256 1024]
                                 [--total-mib 32] [--inflight 1 8] [--batch 16] [--repeat 3]
                                 [--memory host|cuda] [--pool-memory host]

A child process exposes a uint8 pool of --pool-mib as ``pool`` (its content from a seeded
generator). This process connects over each transport, looks the pool up and, for each block
size, reads --total-mib worth of blocks at random distinct places, each block into its place
in one buffer: single reads (``peer.read(h[a:b], out=...)``) with 1 or 8 in flight, and
batches (``peer.read_many(handles, outs=...)``) of 16 blocks and of all of them. The
baseline, in the same run and the same process: one read of a contiguous range of the same
total size (``h[0:total]``). Rows: GB/s and the ratio to the baseline, best of --repeat turns,
and the median latency of one block read alone. Every read's bytes are checked once per cell.

Over ucx the reads are one-sided gets at an offset; over tcp each is a request the owner's node
answers ("owner-assisted"): the table's protocol column says which. Speed is never asserted;
the script exits 1 only when bytes came back wrong or something crashed.

``--memory cuda`` puts the pool and the reader's buffer on GPU 0 (CuPy arrays), as a KV cache
is: over ucx with cuda lanes the gets go from device memory to device memory (cuda_ipc between
two processes on one GPU), over tcp the owner stages the blocks through pinned host memory.
Every timed read (the baseline's too) ends with a wait for the reader's current stream, so it
counts bytes in place, and the device's own copy of the contiguous bytes is printed as the
ceiling. (``--memory host-engine``, not listed in --help: numpy posing as device memory,
tensorwire's stand-in for a GPU, for running this script's device code on a machine without one.)

``--pool-memory host`` keeps the pool in the child's host memory whatever --memory says: a KV
cache offloaded to CPU memory and read back into the GPU. Where the transport cannot write the
reader's memory by pointer (verbs, ucx without cuda lanes, and host-engine memory on any) those
are one-sided gets into pinned staging chunks, each chunk copied up while the next are got.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from typing import Any

import numpy as np
from _sizes import MiB
from _two_process import stop_child

import tensorwire
from tensorwire.memory import wait_event
from tensorwire.tensors import EngineArray

SEED = 7


def pool_bytes(nbytes: int) -> np.ndarray:
    return np.random.default_rng(SEED).integers(0, 256, nbytes, dtype=np.uint8)


class Memory:
    """Where the pool and the reader's buffer live: ``host`` (numpy), ``cuda`` (CuPy, the current
    device) or ``host-engine`` (numpy posing as device memory, see the module's docstring)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.engine: Any = None
        if kind == "cuda":
            import cupy

            from tensorwire.memory._cuda import CudaEngine

            self.cp = cupy
            self.cuda = CudaEngine.get(cupy.cuda.Device().id)  # looked up once: settle() is timed
        elif kind == "host-engine":
            from tensorwire.memory import HostEngine

            self.engine = HostEngine(poison=False)

    def put(self, a: np.ndarray) -> Any:
        """``a`` copied into this memory."""
        if self.kind == "cuda":
            return self.cp.asarray(a)
        if self.kind == "host-engine":
            return EngineArray(self.engine, a)
        return a

    def zeros(self, n: int) -> Any:
        if self.kind == "cuda":
            return self.cp.zeros(n, self.cp.uint8)
        return self.put(np.zeros(n, np.uint8))

    def view(self, buf: Any, a: int, b: int) -> Any:
        """Bytes ``a:b`` of ``buf``, a view (a read into it lands in ``buf``)."""
        if self.kind == "host-engine":
            return EngineArray(self.engine, buf.array[a:b])
        return buf[a:b]

    def fetch(self, buf: Any) -> np.ndarray:
        """``buf``'s bytes in host memory, for the checks (untimed)."""
        if self.kind == "cuda":
            return self.cp.asnumpy(buf)
        return buf.array if self.kind == "host-engine" else buf

    async def zero(self, buf: Any) -> None:
        (buf.array if self.kind == "host-engine" else buf).fill(0)
        await self.settle()

    async def settle(self) -> None:
        """Wait until the work queued on the current stream is done: a read into CUDA memory may
        still be landing, on that stream, when it returns. The library's own wait (an event on
        the stream, polled off the loop), so UCX's progress goes on meanwhile."""
        if self.kind == "cuda":
            engine = self.cuda
            await wait_event(engine, engine.record_on(int(self.cp.cuda.get_current_stream().ptr)))

    def d2d_gbps(self, buf: Any) -> float:
        """The device's own copy of ``buf``'s bytes, GB/s (CUDA events; best of 6)."""
        cp = self.cp
        dst = cp.empty_like(buf)
        best = float("inf")
        for _ in range(6):
            start, stop = cp.cuda.Event(), cp.cuda.Event()
            start.record()
            cp.cuda.runtime.memcpyAsync(dst.data.ptr, buf.data.ptr, buf.nbytes, cp.cuda.runtime.memcpyDeviceToDevice,
                                        cp.cuda.get_current_stream().ptr)  # fmt: skip
            stop.record()
            stop.synchronize()
            best = min(best, cp.cuda.get_elapsed_time(start, stop) / 1e3)
        return buf.nbytes / best / 1e9

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()


async def child(transport: str, nbytes: int, memory: str) -> None:
    mem = Memory(memory)
    pool = mem.put(pool_bytes(nbytes))
    await mem.settle()  # a copy up from pageable memory may still be landing; gets ignore streams
    async with tensorwire.start("127.0.0.1:0", transports=(transport,)) as node:
        node.expose(pool, name="pool")
        print(json.dumps({"address": node.address}), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent is done
    mem.close()


async def gather_blocks(peer: tensorwire.Peer, h: tensorwire.RemoteHandle, starts: np.ndarray, block: int,
                        out: Any, mode: str, mem: Memory) -> str:  # fmt: skip
    """Read the blocks at ``starts`` into consecutive places of ``out``: ``N`` single reads in
    flight at a time, or ``batch N``: ``read_many`` of N blocks at a time; the protocol the
    receipts named."""
    places = [mem.view(out, j * block, (j + 1) * block) for j in range(len(starts))]
    handles = [h[s : s + block] for s in starts.tolist()]
    protocols: set[str] = set()
    if mode.startswith("batch"):
        n = int(mode.split()[1]) if mode != "batch" else len(handles)
        for k in range(0, len(handles), n):
            _, receipt = await peer.read_many_with_receipt(handles[k : k + n], outs=places[k : k + n])
            protocols.add(receipt.protocol)
        return ",".join(sorted(protocols))
    it = iter(zip(handles, places, strict=True))

    async def lane() -> None:
        for sub, place in it:
            _, receipt = await peer.read_with_receipt(sub, out=place)
            protocols.add(receipt.protocol)

    await asyncio.gather(*[lane() for _ in range(int(mode))])
    return ",".join(sorted(protocols))


async def measure(transport: str, args: argparse.Namespace, notes: list[str]) -> list[dict[str, object]]:
    pool_n = args.pool_mib * MiB
    total = args.total_mib * MiB
    # this side's node first: a transport that cannot run here raises TransportUnavailable (a
    # skipped row) before a child is started that would die of it
    async with tensorwire.start("127.0.0.1:0", transports=(transport,)) as node:
        return await _measure(node, transport, args, notes, pool_n, total)


async def _measure(
    node: tensorwire.Node, transport: str, args: argparse.Namespace, notes: list[str], pool_n: int, total: int
) -> list[dict[str, object]]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--child", transport, str(pool_n), args.pool_memory or args.memory,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stdin is not None
    rows: list[dict[str, object]] = []
    mem = Memory(args.memory)
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 60)
        if not line:
            raise RuntimeError(f"the {transport} child exited before it listened")
        address = json.loads(line)["address"]
        expected = pool_bytes(pool_n)
        rng = np.random.default_rng(1)
        peer = await node.connect(address)
        h = await peer.lookup("pool")
        notes.append(f"{transport}: path {peer.path}; the pool is in {h.memory} memory")
        out = mem.zeros(total)
        whole = h[0:total]

        async def baseline() -> float:
            await mem.settle()
            t0 = time.perf_counter()
            await peer.read(whole, out=out)
            await mem.settle()
            return time.perf_counter() - t0

        await baseline()
        if not await asyncio.to_thread(np.array_equal, mem.fetch(out), expected[:total]):  # off the loop
            raise AssertionError(f"{transport}: the contiguous read came back wrong")
        for kib in args.block_kib:
            block = kib << 10
            n = total // block
            lat = []
            first = mem.view(out, 0, block)
            for _ in range(min(200, max(20, 4 * MiB // block))):
                s = int(rng.integers(0, pool_n // block)) * block
                t0 = time.perf_counter()
                await peer.read(h[s : s + block], out=first)
                await mem.settle()
                lat.append(time.perf_counter() - t0)
            for k in [str(i) for i in args.inflight] + [f"batch {b}" for b in args.batch] + ["batch"]:
                best = base = float("inf")
                protocol = ""
                for turn in range(args.repeat):
                    base = min(base, await baseline())
                    starts = rng.choice(pool_n // block, n, replace=False) * block
                    await mem.zero(out)
                    t0 = time.perf_counter()
                    protocol = await gather_blocks(peer, h, starts, block, out, k, mem)
                    await mem.settle()
                    best = min(best, time.perf_counter() - t0)
                    if turn == 0:
                        got = mem.fetch(out)[: n * block]
                        if not await asyncio.to_thread(_blocks_are, got, expected, starts, block):
                            raise AssertionError(f"{transport}: blocks of {kib} KiB came back wrong")
                rows.append({
                    "transport": transport, "memory": args.memory, "pool_memory": args.pool_memory or args.memory,
                    "path": str(peer.path.transport),
                    "protocol": protocol, "block_kib": kib, "blocks": n, "inflight": k,
                    "gbps": n * block / best / 1e9, "base_gbps": total / base / 1e9,
                    "ratio": (n * block / best) / (total / base), "lat_us": statistics.median(lat) * 1e6,
                })  # fmt: skip
                print(_line(rows[-1]), flush=True)
    finally:
        proc.stdin.close()
        await stop_child(proc)
        mem.close()
    return rows


def _blocks_are(got: np.ndarray, expected: np.ndarray, starts: np.ndarray, block: int) -> bool:
    """``got`` holds the blocks of ``expected`` at ``starts``, end to end (a check off the loop)."""
    return bool(np.array_equal(got, expected.reshape(-1, block)[starts // block].reshape(-1)))


HEADER = (
    "| transport | protocol | block | blocks | reads | GB/s | contiguous GB/s | ratio | one block µs |\n"
    "|---|---|---|---|---|---|---|---|---|"
)


def _line(r: dict[str, object]) -> str:
    return (
        f"| {r['transport']} | {r['protocol']} | {r['block_kib']} KiB | {r['blocks']} | {r['inflight']} "
        f"| {r['gbps']:.2f} | {r['base_gbps']:.2f} | {r['ratio']:.2f}x | {r['lat_us']:.0f} |"
    )


def _no_gpu() -> str:
    """Why --memory cuda cannot run here, or "" when it can."""
    try:
        import cupy
    except ImportError as exc:
        return f"needs CuPy and a CUDA GPU ({exc})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError as exc:
        return f"needs a CUDA GPU, and CUDA does not start here ({exc})"
    return "" if count else "needs a CUDA GPU, and CuPy sees none here"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--transports", nargs="+", default=["ucx", "tcp"])
    parser.add_argument("--pool-mib", type=int, default=256)
    parser.add_argument("--total-mib", type=int, default=32, help="bytes read per cell")
    parser.add_argument("--block-kib", type=int, nargs="+", default=[16, 64, 256, 1024])
    parser.add_argument("--inflight", type=int, nargs="+", default=[1, 8], help="single reads in flight")
    parser.add_argument("--batch", type=int, nargs="+", default=[16], help="read_many of this many blocks (and of all)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument(
        "--memory", choices=["host", "cuda", "host-engine"], default="host", metavar="{host,cuda}",
        help="where the pool and the reader's buffer live (cuda: GPU 0, through CuPy)",
    )  # fmt: skip
    parser.add_argument("--pool-memory", choices=["host"], help="the pool in host memory whatever --memory says")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        asyncio.run(child(args.child[0], int(args.child[1]), args.child[2]))
        return 0
    if args.total_mib > args.pool_mib:
        parser.error("--total-mib is at most --pool-mib")
    if args.memory == "cuda":
        why = _no_gpu()
        if why:
            print(f"kv_rows: --memory cuda {why}", file=sys.stderr)
            return 2
        import cupy

        mem = Memory("cuda")
        name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
        print(f"device: {name}, CuPy {cupy.__version__}; its own copy of {args.total_mib} MiB (the ceiling): "
              f"{mem.d2d_gbps(mem.zeros(args.total_mib * MiB)):.1f} GB/s", flush=True)  # fmt: skip
    print(f"memory: {args.memory}; the pool: {args.pool_memory or args.memory}", flush=True)
    print(HEADER, flush=True)
    rows = []
    notes: list[str] = []
    for transport in args.transports:
        try:
            rows += asyncio.run(measure(transport, args, notes))
        except tensorwire.TransportUnavailable as exc:
            print(f"| {transport} | skipped: {exc} |", flush=True)
    for note in notes:
        print(note)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
