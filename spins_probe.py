"""How many loop turns a recv of N MiB takes to complete, per transport (temporary probe)."""
import asyncio, sys, time
import numpy as np
from tensorwire.testing import connected_pair
from tensorwire import Limits
MiB = 1 << 20

async def turns(a, b, n, out, tag):
    x = np.random.default_rng(1).integers(0, 255, size=n, dtype=np.uint8)
    o = np.zeros_like(x) if out else None
    recv = asyncio.ensure_future(b.recv(tag=tag, out=o) if out else b.recv(tag=tag))
    send = asyncio.ensure_future(a.send(x, tag=tag))
    t0 = time.perf_counter(); k = 0
    while not recv.done():
        await asyncio.sleep(0); k += 1
    await send
    return k, time.perf_counter() - t0

async def main(transport, sizes, extra):
    for label, lim, out in (("eager out=", None, True), ("rdv no out (rbuf 4MiB)", Limits(recv_buffer_bytes=4 * MiB), False)):
        async with connected_pair(transport, limits=lim, **extra) as (a, b):
            await turns(a, b, MiB, out, "w")
            for s in sizes:
                r = [await turns(a, b, s * MiB, out, "t") for _ in range(3)]
                print(f"{transport:6} {label:24} {s:3} MiB: turns {[k for k, _ in r]} secs {[round(t, 3) for _, t in r]}", flush=True)

t = sys.argv[1]
extra = {"lease_seconds": 30.0, "connect_timeout": 60.0} if t == "verbs" else {}
asyncio.run(main(t, [int(s) for s in sys.argv[2].split(",")], extra))
