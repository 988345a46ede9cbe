"""Soak for RPC and one-sided reads and writes: random calls, cancellations, re-exposes and kills.

    python benchmarks/soak_ops.py [--duration 60] [--peers 3] [--concurrency 4] [--max-mib 64]
                                  [--seed 0] [--restart-rate 0.005] [--transport tcp]
                                  [--engine [--by-pointer | --host-regions]]

``benchmarks/soak.py`` does this for send/recv; this script does it for the rest of the peer API.
A hub node in this process drives worker processes, each of which exposes one uint8 tensor named
"region" and serves a few RPC methods. ``--concurrency`` tasks on the hub pick a worker and an
operation at random, over and over:

  crc        call a method with a random tensor; it answers the tensor's crc32c
  echo       call a method that returns its tensor (into ``_out=`` half the time); check its crc
  deadline   a method that sleeps longer than ``_deadline`` (DeadlineExceeded), or shorter (result)
  raises     a method that raises ValueError (RemoteError naming it); an unknown one (MethodNotFound)
  stream     a streaming method's items (known content), sometimes left early
  write-read write random bytes to the region, read them back, ask the worker for its crc too
  rows       the same through rows and batches: the region cut at up to 40 random places, the
             pieces (``h[a:b]``) written with ``write_many`` and read with ``read_many``, shuffled
  reexpose   the worker unexposes the region (awaiting every peer's acknowledgement) and exposes a
             new one, while 0-2 reads of the old handle race it (each returns the old content
             whole or fails with HandleNotFound); then the old handle must fail with
             HandleNotFound, and a new lookup works
  restart    SIGKILL a worker and start a new one (--restart-rate, per operation)

``--engine`` puts the regions in "device" memory of a HostEngine (``EngineArray``: host memory
that goes every way CUDA memory does, on a stream of the worker's) and makes the hub's write
sources and read buffers device memory half the time: the one-sided paths of CUDA tensors
(served by the owner through staging, or staged around the one-sided gets and puts), with
staging chunks poisoned on reuse. ``--by-pointer`` (ucx) also declares that memory registrable
and postable by pointer, as ucx takes CUDA memory where UCX has cuda lanes, so the gets and puts
go at its addresses after the streams' events. ``--host-regions`` keeps the regions in the
workers' host memory instead: over ucx the hub's reads into its device buffers and writes from
them are then one-sided gets and puts through its staging chunks (the path of CUDA tensors on
verbs, or on a ucx without cuda lanes), cancelled and cut short by kills like the rest.

Every operation but restart is cancelled at a random moment now and then (asyncio.wait_for with
a short limit); a cancelled write leaves the region's content unknown until the next write. A
cancelled read's buffer is then filled with a marker, and must still hold it after the next read
of that region has completed ("a cancelled read never writes into out afterwards").
Operations on one worker's region take turns; everything else runs concurrently.

Problems, each of which fails the run (exit 1):
  corrupted     a checked crc or value did not match
  unexpected    an error from the error tree while the worker stayed alive, or the wrong error
  escaped       an exception from outside the error tree (a bug: everything must be in the tree),
                or a CancelledError that no one asked for
  late writes   a cancelled read wrote into its buffer afterwards
  hung          an operation took longer than --hang seconds
  crashed       a worker exited on its own
Errors of an operation whose worker was killed while it ran are expected and counted apart.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import ctypes
import gc
import operator
import os
import random
import resource
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import crc32c
import numpy as np
from _sizes import MiB
from _soak import kill_and_reap, random_size

import tensorwire
from tensorwire.memory import HostEngine, wait_event
from tensorwire.tensors import EngineArray
from tensorwire.testing import host_engine_by_pointer

MARK = 0xA5  # what a cancelled read's buffer is filled with afterwards

WORKER = r"""
import asyncio, sys
import crc32c, numpy as np, tensorwire

def crc(a):
    return crc32c.crc32c(memoryview(np.ascontiguousarray(a)).cast("B"))

def pattern(seed, n):
    return np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint8)

async def main(address, transport, region_bytes, engine_mode):
    engine = None
    if engine_mode != "host":
        from tensorwire.memory import HostEngine
        from tensorwire.tensors import EngineArray
        engine = HostEngine()
        stream = engine.stream()  # the owner's: its served writes land on a lane of this stream

    def region(n):  # a region's memory, and the numpy array that holds its bytes
        a = np.zeros(n, np.uint8)
        return (a if engine is None else EngineArray(engine, a, stream=stream)), a

    async with tensorwire.start("127.0.0.1:0", transports=(transport,)) as node:
        if engine_mode == "by-pointer":
            from tensorwire.testing import host_engine_by_pointer
            host_engine_by_pointer(transport=node.transports.get(transport))
        state = {}
        tensor, state["region"] = region(region_bytes)
        node.expose(tensor, name="region")

        @node.method("crc")
        async def crc_of(x):
            return {"crc": crc(x), "n": int(x.nbytes)}

        @node.method("echo")
        async def echo(x):
            return x

        @node.method("sleep")
        async def sleep(seconds):
            await asyncio.sleep(seconds)
            return "woke"

        @node.method("raises")
        async def raises(text):
            raise ValueError(text)

        @node.method("gen")
        async def gen(n, size, seed):
            for i in range(n):
                yield pattern(seed + i, size)

        @node.method("region_crc")
        async def region_crc():
            return {"crc": crc(state["region"]), "n": int(state["region"].nbytes)}

        async def swap(nbytes):
            await node.unexpose("region")  # every peer holding a key has let go of the old one
            tensor, state["region"] = region(nbytes)
            node.expose(tensor, name="region")

        swaps = {}  # token -> the swap's task, or None: settled before it came (a no-op then)

        @node.method("reexpose")
        async def reexpose(nbytes, token):
            if token not in swaps:
                swaps[token] = asyncio.ensure_future(swap(nbytes))
            if swaps[token] is not None:
                await asyncio.shield(swaps[token])  # a cancelled caller must not leave no region
            return nbytes

        @node.method("settle")
        async def settle(token):
            # after a cancelled reexpose: it either swapped, or never will; then the region's state
            task = swaps.setdefault(token, None)
            if task is not None:
                await task
            return await region_crc()

        peer = await node.connect(address)
        try:
            await peer.recv(tag="never")  # serve until the hub goes away
        except tensorwire.PeerDisconnected:
            return

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]))
"""


def crc(a: Any) -> int:
    return crc32c.crc32c(memoryview(np.ascontiguousarray(a)).cast("B"))


def zeros_crc(n: int) -> int:
    """The crc of a freshly exposed region of ``n`` zero bytes."""
    return crc(np.zeros(n, np.uint8))


def pattern(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint8)


def usage() -> tuple[int, int, int]:
    """This process's resident memory (bytes), open file descriptors and asyncio tasks (Linux),
    after a garbage collection and giving freed heap back (so what stays is what is held)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return rss, len(os.listdir("/proc/self/fd")), len(asyncio.all_tasks())


class Problem(Exception):
    """An operation's outcome broke a promise; the message says which."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class Worker:
    def __init__(self, slot: int) -> None:
        self.slot = slot
        self.proc: asyncio.subprocess.Process | None = None
        self.peer: tensorwire.Peer | None = None
        self.generation = 0  # bumped the moment a kill starts: in-flight errors are then expected
        self.ready = asyncio.Event()
        self.region = asyncio.Lock()  # one region operation at a time
        self.handle: tensorwire.RemoteHandle | None = None
        self.region_bytes = 0
        self.content: int | None = None  # crc of what the region holds; None after a cancelled write


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.pool = np.random.default_rng(args.seed).integers(0, 256, size=args.max_mib * MiB, dtype=np.uint8)
        self.outcomes: collections.Counter[tuple[str, str]] = collections.Counter()  # (op, outcome)
        self.problems: collections.Counter[str] = collections.Counter()
        self.examples: dict[str, str] = {}
        self.crashed = 0
        self.moved = 0
        self.workers = [Worker(i) for i in range(args.peers)]
        self.hub: tensorwire.Node | None = None
        self.launching = asyncio.Lock()  # hub.accept() must hand each launch its own worker
        self.resources: list[tuple[str, int, int, int]] = []  # (when, RSS bytes, open fds, asyncio tasks)
        self.engine = HostEngine() if args.engine else None  # poisons its staging chunks on reuse
        self.stream = self.engine.stream() if self.engine is not None else None
        flags = {"by-pointer": args.by_pointer, "host-regions": args.host_regions, "engine": args.engine}
        self.mode = next((mode for mode, on in flags.items() if on), "host")  # the first flag given, in that order

    # -- helpers -----------------------------------------------------------------------------
    def data(self, n: int) -> np.ndarray:
        start = self.rng.randrange(0, len(self.pool) - n + 1)
        return self.pool[start : start + n]

    def dev(self, a: np.ndarray) -> Any:
        """``a`` as a one-sided call gets it: itself, or (--engine, half the time) HostEngine
        "device" memory over the same bytes (so a read into it lands in ``a``), on a stream of
        the hub's half of those times."""
        if self.engine is None or self.rng.random() < 0.5:
            return a
        return EngineArray(self.engine, a, stream=self.stream if self.rng.random() < 0.5 else None)

    async def settle(self) -> None:
        """Wait for the hub's stream (--engine): a read into memory of a stream lands ordered
        before that stream's next work, as a CUDA read does, and may still be landing when it
        returns (or, cancelled, be finishing its queued copies); the host looks at the bytes
        only after that, as it would after a CUDA stream synchronize."""
        if self.engine is not None:
            await wait_event(self.engine, self.engine.record_on(self.stream))

    def cancel_after(self) -> float | None:
        """A random short limit for this operation (asyncio.wait_for), or None: run it whole."""
        return self.rng.uniform(0, 0.02) if self.rng.random() < 0.12 else None

    async def maybe_cancelled(self, aw: Awaitable[Any], limit: float | None) -> tuple[bool, Any]:
        """(True, result), or (False, None) when our own limit cancelled it. An error the
        operation raises itself (DeadlineExceeded is a TimeoutError too) propagates."""
        if limit is None:
            return True, await aw
        task = asyncio.ensure_future(aw)
        try:
            return True, await asyncio.wait_for(asyncio.shield(task), limit)
        except TimeoutError:
            if task.done() and not task.cancelled():
                return True, task.result()  # finished as the limit hit (or raised its own error)
            task.cancel()
            try:
                return True, await task  # it may finish (or fail) before the cancel lands
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    raise  # the operation as a whole is being cancelled (--hang)
                return False, None
        except asyncio.CancelledError:
            task.cancel()  # the operation as a whole is being cancelled: so is this part of it
            raise

    def check(self, ok: bool, what: str) -> None:
        if not ok:
            raise Problem("corrupted", what)

    # -- workers -----------------------------------------------------------------------------
    async def launch(self, w: Worker) -> None:
        assert self.hub is not None
        w.region_bytes = max(1, random_size(self.rng, self.args.max_mib * MiB))
        async with self.launching:
            w.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-c", WORKER, self.hub.address, self.args.transport, str(w.region_bytes),
                "host" if self.mode == "host-regions" else self.mode,
            )  # fmt: skip
            w.peer = await asyncio.wait_for(self.hub.accept(), 60)
        if self.mode == "by-pointer":  # what the worker declared of its transport, for our gets and puts
            host_engine_by_pointer(w.peer)
        w.handle = None
        w.content = zeros_crc(w.region_bytes)
        w.ready.set()

    async def stop(self, w: Worker) -> None:
        assert w.proc is not None
        if not await kill_and_reap(w.proc):
            self.crashed += 1

    async def restart(self, w: Worker) -> None:
        if not w.ready.is_set():
            return  # another task is restarting it
        w.ready.clear()
        w.generation += 1
        await self.stop(w)
        assert w.peer is not None
        await w.peer.aclose()
        async with w.region:  # a region operation still running on the old worker must not
            await self.launch(w)  # write its idea of the region over the new worker's

    # -- operations --------------------------------------------------------------------------
    async def op_crc(self, w: Worker, peer: tensorwire.Peer) -> str:
        x = self.data(random_size(self.rng, self.args.max_mib * MiB))
        done, got = await self.maybe_cancelled(peer.call("crc", x), self.cancel_after())
        if not done:
            return "cancelled"
        self.check(got == {"crc": crc(x), "n": x.nbytes}, f"crc of {x.nbytes} B: {got}")
        self.moved += x.nbytes
        return "verified"

    async def op_echo(self, w: Worker, peer: tensorwire.Peer) -> str:
        x = self.data(random_size(self.rng, self.args.max_mib * MiB // 2))
        out = np.empty_like(x) if self.rng.random() < 0.5 else None
        done, got = await self.maybe_cancelled(peer.call("echo", x, _out=out), self.cancel_after())
        if not done:
            return "cancelled"
        if out is not None:
            self.check(got is out, "echo with _out= returned another object")
        self.check(got.shape == x.shape and crc(got) == crc(x), f"echo of {x.nbytes} B")
        self.moved += 2 * x.nbytes
        return "verified"

    async def op_deadline(self, w: Worker, peer: tensorwire.Peer) -> str:
        if self.rng.random() < 0.5:
            try:
                await peer.call("sleep", 5.0, _deadline=self.rng.uniform(0.001, 0.05))
            except tensorwire.DeadlineExceeded:
                return "verified"
            raise Problem("unexpected", "a 5 s sleep under a 50 ms deadline returned")
        done, got = await self.maybe_cancelled(peer.call("sleep", 0.001, _deadline=60.0), self.cancel_after())
        if not done:
            return "cancelled"
        self.check(got == "woke", f"sleep returned {got!r}")
        return "verified"

    async def op_raises(self, w: Worker, peer: tensorwire.Peer) -> str:
        if self.rng.random() < 0.3:
            try:
                await peer.call("no-such-method")
            except tensorwire.MethodNotFound:
                return "verified"
            raise Problem("unexpected", "an unknown method returned")
        text = f"soak {self.rng.randrange(1 << 30)}"
        try:
            await peer.call("raises", text)
        except tensorwire.RemoteError as exc:
            if exc.remote_type != "ValueError" or text not in exc.remote_message:
                raise Problem("corrupted", f"RemoteError {exc.remote_type}: {exc.remote_message}") from exc
            return "verified"
        raise Problem("unexpected", "a raising method returned")

    async def op_stream(self, w: Worker, peer: tensorwire.Peer) -> str:
        n = self.rng.randrange(0, 9)
        size = random_size(self.rng, self.args.max_mib * MiB // 8)
        seed = self.rng.randrange(1 << 30)
        leave = self.rng.randrange(0, n + 1) if self.rng.random() < 0.3 else n

        async def consume() -> int:
            count = 0
            items = peer.stream("gen", n, size, seed)
            try:
                async for item in items:
                    if count >= leave:
                        break
                    self.check(crc(item) == crc(pattern(seed + count, size)), f"stream item {count} of {n}")
                    count += 1
                    self.moved += size
            finally:
                await items.aclose()  # type: ignore[attr-defined]
            return count

        done, count = await self.maybe_cancelled(consume(), self.cancel_after())
        if not done:
            return "cancelled"
        self.check(count == min(n, leave), f"stream gave {count} items of {n} (left at {leave})")
        return "verified"

    async def lookup(self, w: Worker, peer: tensorwire.Peer) -> tensorwire.RemoteHandle:
        if w.handle is None:
            w.handle = await peer.lookup("region")
            self.check(w.handle.nbytes == w.region_bytes, f"lookup says {w.handle.nbytes} B, not {w.region_bytes}")
            one_sided = self.mode == "by-pointer" or (self.mode == "host-regions" and self.args.transport != "tcp")
            if self.mode != "host" and w.handle.direct != one_sided:
                # HostEngine memory is served by its owner unless declared taken by pointer; host
                # memory is one-sided where the transport is
                raise Problem("unexpected", f"the region's handle is {'' if w.handle.direct else 'not '}one-sided")
        return w.handle

    async def op_write_read(self, w: Worker, peer: tensorwire.Peer) -> str:
        return await self.write_read(w, peer, rows=False)

    async def op_rows(self, w: Worker, peer: tensorwire.Peer) -> str:
        return await self.write_read(w, peer, rows=True)

    async def write_read(self, w: Worker, peer: tensorwire.Peer, *, rows: bool) -> str:
        """Write the region, read it back, compare with the owner's crc; ``rows``: the region cut
        at up to 40 random places, the pieces written with write_many and read with read_many
        in a random order."""
        async with w.region:
            h = await self.lookup(w, peer)
            n = h.nbytes
            cuts = sorted(self.rng.sample(range(1, n), min(n - 1, self.rng.randrange(41)))) if rows and n > 1 else []
            pieces = list(zip([0, *cuts], [*cuts, n], strict=True))
            self.rng.shuffle(pieces)
            handles = [h[a:b] for a, b in pieces]

            def write(src: np.ndarray) -> Awaitable[Any]:
                if rows:
                    return peer.write_many(handles, [self.dev(src[a:b]) for a, b in pieces])
                return peer.write(h, self.dev(src))

            async def read(out: np.ndarray) -> None:
                if not rows:
                    into = self.dev(out)
                    self.check(await peer.read(h, out=into) is into, "read(out=) returned another object")
                    return
                outs = [self.dev(out[a:b]) for a, b in pieces]
                got = await peer.read_many(handles, outs=outs)
                self.check(all(map(operator.is_, got, outs)), "read_many(outs=) returned other objects")

            outcome = "verified"
            if self.rng.random() < 0.8:  # else read what is there
                src = self.data(h.nbytes)
                done, _ = await self.maybe_cancelled(write(src), self.cancel_after())
                w.content = crc(src) if done else None
                self.moved += h.nbytes if done else 0
                outcome = "verified" if done else "cancelled"
            cancelled_out: np.ndarray | None = None
            out = np.empty(h.nbytes, np.uint8)
            done, _ = await self.maybe_cancelled(read(out), self.cancel_after())
            await self.settle()
            if not done:
                out.fill(MARK)
                cancelled_out, out = out, np.empty(h.nbytes, np.uint8)
                await read(out)
                await self.settle()
                outcome = "cancelled"
            self.moved += h.nbytes
            if w.content is not None:
                self.check(crc(out) == w.content, f"read back {h.nbytes} B")
            theirs = await peer.call("region_crc")
            self.check(theirs == {"crc": crc(out), "n": h.nbytes}, f"the owner's crc of {h.nbytes} B")
            w.content = theirs["crc"]
            if cancelled_out is not None and not bool((cancelled_out == MARK).all()):
                raise Problem("late writes", f"a cancelled read of {h.nbytes} B wrote into its buffer afterwards")
            return outcome

    async def op_reexpose(self, w: Worker, peer: tensorwire.Peer) -> str:
        async with w.region:
            old = await self.lookup(w, peer)
            before = w.content  # what a read racing the revocation may see, whole (None: unknown)
            racing = [
                asyncio.ensure_future(peer.read(old, out=np.empty(old.nbytes, np.uint8)))
                for _ in range(self.rng.randrange(0, 3))
            ]
            try:
                outcome = await self.reexpose(w, peer, old)
            finally:
                results = await asyncio.gather(*racing, return_exceptions=True)
            for got in results:
                if isinstance(got, tensorwire.HandleNotFound):
                    continue  # revoked first: fine
                if isinstance(got, BaseException):
                    raise got
                if before is not None:
                    self.check(crc(got) == before, f"a read racing a re-expose of {old.nbytes} B")
            return outcome

    async def reexpose(self, w: Worker, peer: tensorwire.Peer, old: tensorwire.RemoteHandle) -> str:
        nbytes = max(1, random_size(self.rng, self.args.max_mib * MiB))
        token = self.rng.randrange(1 << 62)
        done, got = await self.maybe_cancelled(peer.call("reexpose", nbytes, token), self.cancel_after())
        w.handle = None
        if not done:  # the worker may or may not re-expose: settle it, and find out
            theirs = await peer.call("settle", token)
            w.region_bytes, w.content = theirs["n"], theirs["crc"]
            return "cancelled"
        self.check(got == nbytes, f"reexpose returned {got!r}")
        w.region_bytes, w.content = nbytes, zeros_crc(nbytes)
        try:
            await peer.read(old, out=np.empty(old.nbytes, np.uint8))
        except tensorwire.HandleNotFound:
            pass
        else:
            raise Problem("unexpected", "a read through a revoked handle succeeded")
        await self.lookup(w, peer)
        return "verified"

    # -- the driver --------------------------------------------------------------------------
    async def one(self, name: str, op: Callable[[Worker, tensorwire.Peer], Awaitable[str]]) -> None:
        w = self.rng.choice(self.workers)
        while not w.ready.is_set():  # woken by a launch, it may be restarting again by now
            await w.ready.wait()
        generation, peer = w.generation, w.peer
        assert peer is not None
        try:
            async with asyncio.timeout(self.args.hang):
                outcome = await op(w, peer)
        except (Problem, tensorwire.TensorWireError) as exc:  # the tree's timeouts are TensorWireErrors
            if w.generation != generation:
                outcome = "failed (worker killed)"  # e.g. a region crc that changed as it died
            else:
                outcome = exc.kind if isinstance(exc, Problem) else "unexpected"
                text = str(exc) if isinstance(exc, Problem) else f"{type(exc).__name__}: {exc}"
                self.problem(outcome, f"{name}: {text}")
        except TimeoutError:  # asyncio.timeout's own
            self.problem("hung", f"{name}: no outcome after {self.args.hang} s")
            outcome = "hung"
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # the run itself is being cancelled
            self.problem("escaped", f"{name}: a CancelledError nobody asked for")  # it looks like ours
            outcome = "escaped"
        except Exception as exc:
            self.problem("escaped", f"{name}: {type(exc).__name__}: {exc}")
            outcome = "escaped"
        self.outcomes[name, outcome] += 1

    def problem(self, kind: str, text: str) -> None:
        self.problems[kind] += 1
        self.examples.setdefault(kind, text)
        print(f"PROBLEM {kind}: {text}", file=sys.stderr, flush=True)

    async def driver(self, t_end: float) -> None:
        ops: list[tuple[str, Callable[[Worker, tensorwire.Peer], Awaitable[str]], float]] = [
            ("crc", self.op_crc, 3),
            ("echo", self.op_echo, 3),
            ("deadline", self.op_deadline, 1),
            ("raises", self.op_raises, 1),
            ("stream", self.op_stream, 2),
            ("write-read", self.op_write_read, 3),
            ("rows", self.op_rows, 2),
            ("reexpose", self.op_reexpose, 1),
        ]
        weights = [weight for _, _, weight in ops]
        while time.monotonic() < t_end:
            if self.rng.random() < self.args.restart_rate:
                w = self.rng.choice(self.workers)
                await self.restart(w)
                self.outcomes["restart", "SIGKILL"] += 1
                continue
            name, op, _ = self.rng.choices(ops, weights)[0]
            await self.one(name, op)

    async def run(self) -> int:
        async with tensorwire.start("127.0.0.1:0", transports=(self.args.transport,)) as hub:
            self.hub = hub
            for w in self.workers:
                await self.launch(w)
            self.resources.append(("start", *usage()))
            t0 = time.monotonic()
            await asyncio.gather(*(self.driver(t0 + self.args.duration) for _ in range(self.args.concurrency)))
            elapsed = time.monotonic() - t0
            self.resources.append(("end", *usage()))
            for w in self.workers:
                await self.stop(w)
        if self.engine is not None:
            self.engine.close()
        return self.report(elapsed)

    def report(self, elapsed: float) -> int:
        a = self.args
        print(
            f"soak of RPC and one-sided ops over {a.transport}: {elapsed:.1f} s, {a.peers} worker processes, "
            f"{a.concurrency} concurrent, sizes 0 B..{a.max_mib} MiB, seed {a.seed}"
            + {"host": "", "engine": "; regions and half the buffers in HostEngine memory",
               "by-pointer": "; regions and half the buffers in HostEngine memory, taken by pointer",
               "host-regions": "; half the buffers in HostEngine memory, the regions in host memory"}[self.mode]
        )  # fmt: skip
        names = sorted({name for name, _ in self.outcomes})
        kinds = sorted({kind for _, kind in self.outcomes}, key=lambda k: (k != "verified", k != "cancelled", k))
        print(f"  {'operation':<11}" + "".join(f"{k:>24}" for k in kinds))
        for name in names:
            print(f"  {name:<11}" + "".join(f"{self.outcomes[name, k]:>24}" for k in kinds))
        print(f"  bytes moved: {self.moved / 1e9:.2f} GB ({self.moved / elapsed / 1e9:.2f} GB/s)")
        if self.engine is not None:  # given up on: an operation of a closing channel may still touch them
            pools = {d: self.engine.pool(d) for d in ("in", "out")}
            print("  staging chunks retired: " + ", ".join(f"{d} {p.retired} of {p.depth}" for d, p in pools.items()))
        seen = ", ".join(f"{w} RSS {rss / MiB:.0f} MiB, {fds} fds, {n} tasks" for w, rss, fds, n in self.resources)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(f"  hub (same workers alive): {seen}; peak RSS {peak:.0f} MiB")
        for kind, text in self.examples.items():
            print(f"  first {kind}: {text}")
        bad = dict(self.problems)
        if self.crashed:
            bad["crashed"] = self.crashed
        verdict = "FAILED" if bad else "OK"
        print("problems: " + (", ".join(f"{k}={v}" for k, v in sorted(bad.items())) or "none") + f" -> {verdict}")
        return 1 if bad else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--peers", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=4, help="operations in flight on the hub")
    p.add_argument("--max-mib", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--restart-rate", type=float, default=0.005, help="chance per operation to restart a worker")
    p.add_argument("--transport", default="tcp")
    p.add_argument("--hang", type=float, default=120.0, help="seconds after which an operation counts as hung")
    p.add_argument("--engine", action="store_true", help="regions and half the buffers in HostEngine 'device' memory")
    p.add_argument("--by-pointer", action="store_true", help="with --engine over ucx: that memory taken by pointer")
    p.add_argument("--host-regions", action="store_true", help="with --engine: the regions in host memory")
    args = p.parse_args()
    if args.by_pointer and not (args.engine and args.transport == "ucx"):
        p.error("--by-pointer goes with --engine --transport ucx (the transport whose gets take device pointers)")
    if args.host_regions and (not args.engine or args.by_pointer):
        p.error("--host-regions goes with --engine, and not with --by-pointer")
    return asyncio.run(Soak(args).run())


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
