"""How much CPU two idle nodes burn: a transport's wait for the network must sleep, not spin."""

from __future__ import annotations

import subprocess
import sys

__all__ = ["idle_cpu_percent"]

_SCRIPT = """
import asyncio, resource, sys, time
import numpy as np, tensorwire
def say(what):
    print(what, flush=True)
async def main(transport, seconds):
    async with tensorwire.start(transports=(transport,)) as a, tensorwire.start(transports=(transport,)) as b:
        assert transport in a.offers, a.unusable
        say("started")
        p = await a.connect(b.address); q = await b.accept()
        say("connected")
        await p.send(np.ones(1 << 20), tag=1); await q.recv(tag=1)
        await q.send(np.ones(8), tag=2); await p.recv(tag=2)
        say("exchanged")
        await asyncio.sleep(0.2)
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
        await asyncio.sleep(seconds)
        r1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
        cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
        say(f"idle cpu {100 * cpu / (t1 - t0):.2f}%")
say("imported")
asyncio.run(main(sys.argv[1], float(sys.argv[2])))
"""


def idle_cpu_percent(transport: str, seconds: float = 2.0, timeout: float = 30.0) -> float:
    """Two nodes joined over ``transport`` in a process of their own, after a transfer each way,
    then left idle for ``seconds``: the process's CPU time over that time, in percent of one
    core. Leases and heartbeats cost a few tenths of a percent; a loop woken for nothing, or a
    progress thread that spins, costs tens. Raises AssertionError with the child's output if it
    fails, or if it has not finished within ``timeout`` seconds (the output then says how far it
    got: imported, started, connected, exchanged)."""
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _SCRIPT, transport, str(seconds)],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        # what the child wrote so far comes as bytes, text=True or not
        out, err = (b.decode(errors="replace") if isinstance(b, bytes) else b or "" for b in (exc.stdout, exc.stderr))
        steps = " -> ".join(out.split()) or "nothing (not even imported)"
        raise AssertionError(
            f"the idle {transport} nodes did not finish in {timeout:.0f} s; they got as far as: {steps}\n{err}"
        ) from None
    if proc.returncode != 0 or "idle cpu " not in proc.stdout:
        raise AssertionError(f"the idle {transport} nodes failed: {proc.stdout}{proc.stderr}")
    return float(proc.stdout.split("idle cpu ")[1].split("%")[0])
