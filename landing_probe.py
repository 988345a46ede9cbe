import asyncio, sys
from tensorwire.testing._conformance import _landing_size, connected_pair, MiB
from tensorwire import Limits
async def main(t, extra):
    for name, lim, kw in (("cancelled_recv", None, dict(cap=32*MiB, turns=14, seconds=0.03, out=True)),
                          ("into_out", None, dict(cap=16*MiB, turns=14, out=True)),
                          ("mid_payload", Limits(recv_buffer_bytes=4*MiB), dict(cap=24*MiB, turns=14, above=4*MiB))):
        async with connected_pair(t, limits=lim, **extra) as (a, b):
            got = [await _landing_size(a, b, **kw) // MiB for _ in range(5)]
            print(f"{t:7} {name:15} MiB picked: {got}", flush=True)
t = sys.argv[1]
asyncio.run(main(t, {"lease_seconds": 30.0, "connect_timeout": 60.0} if t == "verbs" else {}))
