"""Soak: many peers, random sizes, random cancellations and peer restarts; nothing lost or corrupted.

    python benchmarks/soak.py [--duration 60] [--peers 4] [--max-mib 256] [--seed 0] [--transport tcp]
                               [--checksum] [--engine | --strided] [--into]

A hub node in this process talks to worker processes. Each message carries an id, a crc32c of its
payload and the payload itself (0 B to --max-mib, log-uniform). A worker verifies the crc of every
message it receives and answers with the id and the verdict. The hub cancels some of its sends at
random moments (asyncio.wait_for with a short deadline), workers cancel some of their recvs at
random moments, and the hub SIGKILLs and restarts a random worker from time to time.

``--engine`` sends each payload as "device" memory of a HostEngine (tensorwire.tensors.EngineArray):
it then takes the path a CUDA tensor takes (tcp: staged through pinned chunks on copy lanes; ucx:
posted by pointer after its producer event), with chunks poisoned on reuse, so a chunk handed
back too early shows up as a crc mismatch. ``--strided`` sends each payload as a strided view
(every other byte of a buffer twice its size): packed into C order on the way out, in a copy
thread from 1 MiB, with sends cancelled while they pack.

``--into`` has the workers receive each payload into an out= buffer of their own, of the size a
"meta" message sent just before it tells them (a send the hub cancels still carries its payload
in one message, as without --into). Some of those recvs are cancelled, after a random time or a
few loop turns after they took their message (its bytes landing in out=, or being copied there):
the cancel must give the message back whole to the next recv, with out= or without, and leave
out= alone from then on. Each cancelled out= is filled with a marker, and checked once the
message has come and again after the next one: a byte that is not the marker is a late write.
The workers grant 8 MiB of buffer credit, so that a larger message waits for its recv
(rendezvous), and some recvs are cancelled between taking it and pulling it.

Accounting, per message the hub tried to send:
  verified   the worker acknowledged it with a matching crc
  cancelled  the send was cancelled (delivered whole or not at all: both are fine)
  failed     the send raised an error from the tree (counted by type; e.g. a killed worker)
  corrupted  a worker saw a crc mismatch or the hub got a wrong crc back      -> must be 0
  lost       the send returned, its worker stayed alive, yet no answer came   -> must be 0
  crashed    a worker exited on its own (an error reached its recv)            -> must be 0
  late       --into: a cancelled recv's out= was written after the cancel     -> must be 0
Every message attempted ends one way: verified, corrupted, failed, unacknowledged when its worker
was killed, cancelled and never delivered, or lost. The report adds them up ("accounted for"),
and one that does not add up, or a message acknowledged twice, fails the run too.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import random
import sys
import time

import crc32c
import numpy as np
from _sizes import MiB
from _soak import kill_and_reap, random_size

import tensorwire
from tensorwire.memory import HostEngine
from tensorwire.tensors import EngineArray

INTO = 2  # the tag of --into payloads; the worker (below) names it too

WORKER = r"""
import asyncio, random, sys, time
import crc32c, numpy as np, tensorwire

INTO = 2  # the tag of --into payloads (an int tag is its own wire tag: the mailbox is asked about it)
MARK = 0xA5  # what a cancelled recv's out= holds from its cancel on: a later write into it shows

def crc_ok(data, crc):
    return crc32c.crc32c(memoryview(np.ascontiguousarray(data)).cast("B")) == crc

async def plain(peer, rng):
    while True:
        if rng.random() < 0.2:  # a recv cancelled at a random moment must lose nothing
            try:
                msg = await asyncio.wait_for(peer.recv(tag="soak"), rng.uniform(0, 0.01))
            except TimeoutError:
                continue
        else:
            msg = await peer.recv(tag="soak")
        await peer.send({"id": msg["id"], "ok": bool(crc_ok(msg["data"], msg["crc"]))}, tag="ack")

async def cancel_at_random(recv, mailbox, rng):
    # Cancel the recv after a random time (its message may not have come yet), or a few loop
    # turns after it took its message (its bytes landing in out=, or copied there). None if it
    # finished first; else whether it had taken its message, which the cancel must then give
    # back, whole, to the next recv.
    if rng.random() < 0.5:
        await asyncio.wait([recv], timeout=rng.uniform(0, 0.02))
    else:
        await asyncio.sleep(0)  # the recv has reached the mailbox: posted, or it took a message queued
        give_up = time.monotonic() + 1
        while not recv.done() and mailbox.has_posted(INTO) and time.monotonic() < give_up:
            await asyncio.sleep(0)
        for _ in range(rng.choice((0, rng.randrange(1, 16)))):  # 0: before the recv resumes
            if recv.done():
                break
            await asyncio.sleep(0)
    if recv.done():
        return None
    taken = not mailbox.has_posted(INTO)  # this is the only recv on the tag: posted means unmatched
    recv.cancel()
    await asyncio.wait([recv])
    return taken if recv.cancelled() else None

async def into(peer, rng):
    # Each payload into an out= of its size (a "meta" message says which), a share of the recvs
    # cancelled part way. A cancelled recv's out= gets the marker, and must keep it once the
    # message has come whole to a later recv, and once the next message has too.
    mailbox = peer.channel.mailbox
    watched = []  # cancelled out= buffers of the previous message, checked once more
    while True:
        meta = await peer.recv(tag="meta")
        ack = {"id": meta["id"], "recvs": 0, "cancels": 0, "given_back": 0, "late": 0}
        cancelled = []
        while True:
            if cancelled and rng.random() < 0.3:  # a message given back goes to a recv without out= too
                got = await peer.recv(tag=INTO)
                break
            out = np.empty(meta["n"], np.uint8)
            ack["recvs"] += 1
            recv = asyncio.ensure_future(peer.recv(tag=INTO, out=out))
            if rng.random() < 0.3:
                taken = await cancel_at_random(recv, mailbox, rng)
                if taken is not None:
                    ack["cancels"] += 1
                    ack["given_back"] += taken
                    out.fill(MARK)
                    cancelled.append(out)
                    continue
            got = await recv
            break
        late = [o for o in watched + cancelled if not (o == MARK).all()]
        watched = [o for o in cancelled if not any(o is b for b in late)]
        ack["late"] = len(late)
        ack["ok"] = bool(got.size == meta["n"] and crc_ok(got, meta["crc"]))
        await peer.send(ack, tag="ack")

async def main(address, seed, transport, into_out):
    # --into: a message past 8 MiB of buffered credit waits for its recv (rendezvous), so that
    # some recvs are cancelled between taking their message and pulling it (given back unread)
    limits = tensorwire.Limits(recv_buffer_bytes=8 << 20) if into_out else tensorwire.Limits()
    async with tensorwire.start("127.0.0.1:0", transports=(transport,), limits=limits) as node:
        peer = await node.connect(address)
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(plain(peer, random.Random(seed)))
                if into_out:
                    tg.create_task(into(peer, random.Random(seed + 1)))
        except* tensorwire.PeerDisconnected:
            pass  # the hub went away

asyncio.run(main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4] == "into"))
"""


class Worker:
    def __init__(self, slot: int) -> None:
        self.slot = slot
        self.proc: asyncio.subprocess.Process | None = None
        self.peer: tensorwire.Peer | None = None
        self.pending: dict[int, tuple[int, float]] = {}  # id -> (nbytes, sent_at)
        self.cancelled: set[int] = set()  # ids whose send was cancelled: may never arrive
        self.generation = 0


async def run(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    nprng = np.random.default_rng(args.seed)
    stats: collections.Counter[str] = collections.Counter()
    failures: collections.Counter[str] = collections.Counter()
    moved = 0
    next_id = 0
    pool = nprng.integers(0, 255, size=args.max_mib * MiB, dtype=np.uint8)  # random bytes, sliced per message
    engine = HostEngine() if args.engine else None  # poisons its staging chunks on reuse

    async with tensorwire.start("127.0.0.1:0", transports=(args.transport,), checksum=args.checksum) as hub:
        workers = [Worker(i) for i in range(args.peers)]

        async def launch(w: Worker) -> None:
            w.generation += 1
            w.proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-c",
                WORKER,
                hub.address,
                str(args.seed * 100 + w.slot * 10 + w.generation),
                args.transport,
                "into" if args.into else "plain",
            )
            w.peer = await asyncio.wait_for(hub.accept(), 30)
            w.pending = {}
            w.cancelled = set()

        async def stop(w: Worker) -> None:
            assert w.proc is not None
            if not await kill_and_reap(w.proc):  # it had exited on its own (a recv raised?): fails the run
                stats["crashed"] += 1

        async def kill(w: Worker) -> None:
            await stop(w)
            stats["restarts"] += 1
            stats["unacked_at_kill"] += len(w.pending)  # died with the worker, reported separately
            if w.peer is not None:
                await w.peer.aclose()

        async def drain_acks(w: Worker, wait: float) -> None:
            assert w.peer is not None
            while any(mid not in w.cancelled for mid in w.pending):  # cancelled ones may never come
                try:
                    ack = await asyncio.wait_for(w.peer.recv(tag="ack"), wait)
                except TimeoutError:
                    return
                except tensorwire.TensorWireError as exc:
                    failures[f"ack {type(exc).__name__}"] += 1
                    return
                entry = w.pending.pop(ack["id"], None)
                if entry is None:  # each message is sent once: a second ack means it arrived twice
                    stats["duplicated"] += 1
                    continue
                stats["verified" if ack["ok"] else "corrupted"] += 1
                for key in ("recvs", "cancels", "given_back", "late"):  # --into: counted by the worker
                    stats[key] += ack.get(key, 0)

        for w in workers:
            await launch(w)
        t_end = time.monotonic() + args.duration
        t0 = time.monotonic()
        while time.monotonic() < t_end:
            w = rng.choice(workers)
            assert w.peer is not None
            if rng.random() < args.restart_rate:
                await kill(w)
                await launch(w)
                continue
            size = random_size(rng, args.max_mib * MiB)
            start = rng.randrange(0, len(pool) - size + 1)
            data = pool[start : start + size]
            crc = crc32c.crc32c(memoryview(data))
            payload = EngineArray(engine, data) if engine is not None and size else data
            if args.strided and size:  # every other byte of a buffer twice the size: packed to send
                wide = np.empty((size, 2), np.uint8)
                wide[:, 0] = data
                payload = wide[:, 0]
            msg = {"id": next_id, "crc": crc, "data": payload}
            next_id += 1
            stats["attempted"] += 1
            try:
                if rng.random() < 0.1:  # cancel this send at a random moment
                    try:
                        await asyncio.wait_for(w.peer.send(msg, tag="soak"), rng.uniform(0, 0.02))
                    except TimeoutError:
                        stats["cancelled"] += 1
                        # delivered whole or not at all: if it arrives, it is verified like any other
                        w.pending[msg["id"]] = (size, time.monotonic())
                        w.cancelled.add(msg["id"])
                        continue
                elif args.into:
                    # the worker receives the payload into an out= of the size this tells it
                    await w.peer.send({"id": msg["id"], "n": size, "crc": crc}, tag="meta")
                    if rng.random() < 0.25:  # the recv waits, posted, when its message comes
                        await asyncio.sleep(rng.uniform(0, 0.002))
                    await w.peer.send(payload, tag=INTO)
                else:
                    await w.peer.send(msg, tag="soak")
            except tensorwire.TensorWireError as exc:
                stats["failed"] += 1
                failures[type(exc).__name__] += 1
                continue
            moved += size
            w.pending[msg["id"]] = (size, time.monotonic())
            if len(w.pending) > 8:
                await drain_acks(w, 30)
        elapsed = time.monotonic() - t0
        lost = 0
        cancelled_not_delivered = 0
        for w in workers:
            await drain_acks(w, 30)
            for mid in w.pending:  # the worker is alive and answered everything it got
                if mid in w.cancelled:
                    cancelled_not_delivered += 1
                else:
                    lost += 1
            await stop(w)

    if engine is not None:
        engine.close()
    summed = (" with frame checksums" if args.checksum else "") + (", payloads in HostEngine memory" if engine else "")
    summed += ", strided payloads" if args.strided else ""
    summed += ", received into out=" if args.into else ""
    print(
        f"soak over {args.transport}{summed}: {elapsed:.1f} s, {args.peers} worker processes, "
        f"sizes 0 B..{args.max_mib} MiB"
    )
    rows = [
        ("messages attempted", stats["attempted"]),
        ("verified by a worker", stats["verified"]),
        ("sends cancelled (random)", stats["cancelled"]),
        ("  of those never delivered", cancelled_not_delivered),
        ("sends that raised (failures below)", stats["failed"]),
        ("worker restarts (SIGKILL)", stats["restarts"]),
        ("workers that exited on their own", stats["crashed"]),
        ("unacknowledged when their worker was killed", stats["unacked_at_kill"]),
        ("bytes moved (completed sends)", f"{moved / 1e9:.2f} GB ({moved / elapsed / 1e9:.2f} GB/s)"),
    ]
    if args.into:  # as the acks counted them: a killed worker's last message is not among them
        rows[2:2] = [
            ("recvs into out=", stats["recvs"]),
            ("  cancelled (random)", stats["cancels"]),
            ("    after they took their message (given back)", stats["given_back"]),
            ("  their out= written after the cancel", stats["late"]),
        ]
    for name, value in rows:
        print(f"  {name:<46} {value}")
    print("  failures by type: " + (", ".join(f"{k}={v}" for k, v in sorted(failures.items())) or "none"))
    # a message given back and then lost, or delivered twice (a second ack), shows here
    outcomes = ("verified", "corrupted", "failed", "unacked_at_kill")
    accounted = sum(stats[k] for k in outcomes) + cancelled_not_delivered + lost
    print(f"  accounted for: {accounted} of {stats['attempted']}; acknowledged twice: {stats['duplicated']}")
    corrupted, crashed, late = stats["corrupted"], stats["crashed"], stats["late"]
    sound = accounted == stats["attempted"] and stats["duplicated"] == 0
    verdict = "OK" if sound and lost == corrupted == crashed == late == 0 else "FAILED"
    late_writes = f"late writes: {late}, " if args.into else ""
    print(f"lost: {lost}, corrupted: {corrupted}, {late_writes}workers crashed: {crashed} -> {verdict}")
    return 0 if verdict == "OK" else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--max-mib", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--restart-rate", type=float, default=0.01, help="chance per step to kill and restart a worker")
    p.add_argument("--transport", default="tcp")
    p.add_argument("--checksum", action="store_true", help="crc32c on every staged-TCP payload frame (both ways)")
    p.add_argument("--engine", action="store_true", help="send payloads as HostEngine 'device' memory (staged path)")
    p.add_argument(
        "--strided", action="store_true", help="send payloads as strided views (packed; 1 MiB and up in a copy thread)"
    )
    p.add_argument(
        "--into", action="store_true", help="workers receive into out= buffers, cancelling some recvs part way"
    )
    return asyncio.run(run(p.parse_args()))


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
