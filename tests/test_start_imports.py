"""A node's first start imports its transports' modules (for ucx: the UCX libraries and ucxx)
in a worker thread, so the event loop goes on meanwhile. On the loop they stopped it for as
long as they took: the longest loop gap at a fresh ucx node's start was 50-80 ms here (median
of 5), ~17 ms with them in a thread. Each test runs in a fresh process, where nothing is imported yet."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(60)

# A transport module whose import takes 0.3 s longer (a slow disk, a cold page cache): the
# loop must turn meanwhile. Another task on the loop imports the same module while the
# start's import is under way: it waits for that one and gets the module whole (an import
# lock shared by two threads, neither deadlocked nor handed a half-made module).
SCRIPT = """
import asyncio, importlib, importlib.abc, json, sys, threading, time
import tensorwire

start = tensorwire.start  # the API, imported before the loop runs: what follows is the start alone
transports, slow = sys.argv[1].split(","), sys.argv[2]
turns = 0
seen = {}
importing = threading.Event()


class Slow(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != slow:
            return None
        for finder in sys.meta_path:
            spec = None if finder is self else finder.find_spec(name, path, target)
            if spec is not None:
                break
        real = spec.loader.exec_module

        def exec_module(module):
            before = turns
            importing.set()
            time.sleep(0.3)
            real(module)
            seen.update(turns=turns - before, on_loop_thread=threading.current_thread() is threading.main_thread())

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, Slow())


async def count():
    global turns
    while True:
        await asyncio.sleep(0)
        turns += 1


async def race():
    while not importing.is_set():
        await asyncio.sleep(0.001)
    # (the loop turns a while first: this import blocks it until the start's import ends, and
    # had it come before the counter's next turn, the turns counted above stayed 0)
    await asyncio.sleep(0.05)
    module = importlib.import_module(slow)  # on the loop's thread, while the start imports it
    return [name for name in ("TcpTransport", "UcxTransport") if hasattr(module, name)]


async def main():
    counter = asyncio.create_task(count())
    racer = asyncio.create_task(race())
    async with start(transports=tuple(transports)) as node:
        offers = list(node.offers)
    got = await racer
    counter.cancel()
    print(json.dumps({**seen, "offers": offers, "race": got}))


asyncio.run(main())
"""


def _start(transports: str, slow: str) -> dict[str, object]:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SCRIPT), transports, slow],
        capture_output=True,
        text=True,
        timeout=45,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result: dict[str, object] = json.loads(proc.stdout.splitlines()[-1])
    return result


@pytest.mark.parametrize(
    ("transports", "slow", "cls"),
    [
        ("tcp", "tensorwire.transports.tcp._transport", "TcpTransport"),
        ("ucx,tcp", "tensorwire.transports.ucx._transport", "UcxTransport"),
    ],
    ids=["tcp", "ucx"],
)
def test_the_loop_turns_while_the_first_start_imports_the_transports(transports: str, slow: str, cls: str) -> None:
    if "ucx" in transports and importlib.util.find_spec("ucxx") is None:
        pytest.skip("ucxx is not installed")
    got = _start(transports, slow)
    assert got["offers"] == transports.split(","), got
    assert got["on_loop_thread"] is False, got
    assert isinstance(got["turns"], int) and got["turns"] > 0, got  # 0 where the loop's thread imported it
    assert got["race"] == [cls], got


def test_a_first_start_on_a_loop_without_a_default_executor_still_starts() -> None:
    """With the loop's default executor shut down there is no worker thread to import in: the
    modules import in the probes, on the loop, as before. (A ucx node's start raised
    RuntimeError('Executor shutdown has been called') there, from its preloading of UCX.)"""
    transports = ("ucx", "tcp") if importlib.util.find_spec("ucxx") is not None else ("tcp",)
    code = f"""
import asyncio, tensorwire
start = tensorwire.start
async def main():
    await asyncio.get_running_loop().shutdown_default_executor()
    async with start(transports={transports!r}) as node:
        print(list(node.offers))
asyncio.run(main())
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=45, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.split("\n")[-2] == str(list(transports)), proc.stdout


def test_crc32c_loads_only_where_checksums_are_asked_for() -> None:
    """The crc32c package's import reads its installed metadata (importlib.metadata, email,
    argparse, zipfile: ~50 modules, ~30 ms at a first start); a tcp node without checksums
    starts, connects and moves a tensor without it. A node with checksum=True has it loaded by
    its start (in the worker thread, before any channel), and its frames carry checksums."""
    code = """
import asyncio, json, sys
import numpy as np
import tensorwire
start = tensorwire.start
seen = {}
async def main():
    async with start("127.0.0.1:0", transports=("tcp",)) as a, start("127.0.0.1:0", transports=("tcp",)) as b:
        p = await a.connect(b.address)
        q = await b.accept()
        await p.send(np.arange(10))
        assert np.array_equal(await q.recv(), np.arange(10))
        seen["plain"] = "crc32c" in sys.modules
    async with start("127.0.0.1:0", transports=("tcp",), checksum=True) as c:
        seen["started"] = "crc32c" in sys.modules
        async with start("127.0.0.1:0", transports=("tcp",)) as d:
            p = await d.connect(c.address)
            q = await c.accept()
            await p.send(np.arange(10))
            assert np.array_equal(await q.recv(), np.arange(10))
            seen["checked"] = p.channel.checksum and q.channel.checksum
asyncio.run(main())
print(json.dumps(seen))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=45, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1]) == {"plain": False, "started": True, "checked": True}
