"""The README and docs/ as a new user meets them: their code runs against real nodes, the names
and numbers they quote are the code's, and the command lines they show are accepted.

Code blocks are found by the heading they sit under and the text they open with, so a block
that is moved or rewritten fails here by name instead of being skipped. A snippet runs as
written except for what a loopback test must change, each change made on the syntax tree and
checked to have happened once: a partner's address for "10.0.0.2:5555", "127.0.0.1:0" for a
fixed port, a recorded address before a stage waits for ever, a ``break`` for a loop's ``...``.
What a snippet's comments say it prints or returns is compared with what it printed or
returned. tests/test_cli.py runs the commands themselves (demo, serve --parent, doctor); here
their flags are compared with the README's, and the first line serve and stage print.
"""

from __future__ import annotations

import ast
import asyncio
import builtins
import contextlib
import dataclasses
import doctest
import importlib
import importlib.util
import inspect
import itertools
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import urllib.request
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tensorwire
from tensorwire import pipeline
from tensorwire.cli import main as cli_main

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
HAVE_UCX = importlib.util.find_spec("ucxx") is not None

pytestmark = pytest.mark.timeout(120)


# -- reading the pages -------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the block's first line of code, 1-based
    lang: str
    heading: str  # the last heading above it
    text: str

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """Every fenced code block of ``page`` (indented ones, in list items, too), with its heading."""
    lines = page.read_text().splitlines()
    found, heading, i = [], "", 0
    while i < len(lines):
        fence = re.fullmatch(r"( *)```([\w-]*)\s*", lines[i])
        if fence:
            indent = len(fence[1])
            end = next((j for j in range(i + 1, len(lines)) if lines[j].rstrip() == " " * indent + "```"), None)
            assert end is not None, f"{page.name}:{i + 1}: a code block that never closes"
            text = "".join(line[indent:] + "\n" for line in lines[i + 1 : end])
            found.append(Block(page, i + 2, fence[2], heading, text))
            i = end + 1
            continue
        if title := re.fullmatch(r"#{1,6} (.+)", lines[i]):
            heading = title[1].strip()
        i += 1
    return found


def block(page: Path, heading: str, opening: str) -> Block:
    """The one code block under ``heading`` whose text starts with ``opening``."""
    hits = [b for b in blocks(page) if b.heading == heading and b.text.startswith(opening)]
    assert len(hits) == 1, f"{page.name}: {len(hits)} blocks under {heading!r} open with {opening!r}"
    return hits[0]


def prose(page: Path) -> str:
    """The page with runs of whitespace made one space, for phrases that wrap across lines."""
    return " ".join(page.read_text().split())


def spans(page: Path) -> list[str]:
    """The text of every `inline code` span (also one that wraps), whitespace made one space."""
    text = re.sub(r"^ *```.*?^ *```", "", page.read_text(), flags=re.M | re.S)
    return [" ".join(s.split()) for s in re.findall(r"`([^`]+)`", text)]


def python_blocks() -> list[Block]:
    return [b for page in PAGES for b in blocks(page) if b.lang == "python"]


# -- running snippets --------------------------------------------------------------------------
class _Edit(ast.NodeTransformer):
    """Rewrites of a snippet's tree, each of which must apply exactly once."""

    def __init__(self, block: Block) -> None:
        self.block = block
        self.constants: dict[str, ast.expr] = {}  # a string constant -> what replaces it
        self.for_body: ast.stmt | None = None  # replaces an ``async for``'s lone ``...``
        self.with_start: list[ast.stmt] = []  # put at the top of ``async with tensorwire.start(...) as node:``
        self.done: dict[str, int] = {}

    def _did(self, what: str) -> None:
        self.done[what] = self.done.get(what, 0) + 1

    def visit_Constant(self, node: ast.Constant) -> ast.expr:
        if isinstance(node.value, str) and node.value in self.constants:
            self._did(repr(node.value))
            return ast.copy_location(self.constants[node.value], node)
        return node

    def visit_AsyncFor(self, node: ast.AsyncFor) -> ast.AST:
        self.generic_visit(node)
        body = node.body
        if self.for_body is not None and len(body) == 1 and isinstance(body[0], ast.Expr):
            if isinstance(body[0].value, ast.Constant) and body[0].value.value is Ellipsis:
                self._did("async for ...")
                node.body = [ast.copy_location(self.for_body, body[0])]
        return node

    def visit_AsyncWith(self, node: ast.AsyncWith) -> ast.AST:
        self.generic_visit(node)
        starts = [
            item
            for item in node.items
            if isinstance(item.context_expr, ast.Call)
            and ast.unparse(item.context_expr.func) == "tensorwire.start"
            and isinstance(item.optional_vars, ast.Name)
            and item.optional_vars.id == "node"
        ]
        if starts and self.with_start:
            self._did("async with tensorwire.start(...) as node")
            node.body = [*self.with_start, *node.body]
        return node

    def check(self, **expected: int) -> None:
        assert self.done == expected, f"{self.block}: the snippet changed, its edits did not apply: {self.done}"


def _stmt(source: str) -> ast.stmt:
    return ast.parse(source).body[0]


def _compile(block: Block, tree: ast.Module | None = None) -> Any:
    tree = tree or ast.parse(block.text)
    ast.fix_missing_locations(tree)
    ast.increment_lineno(tree, block.line - 1)  # tracebacks point into the page
    return compile(tree, str(block.page), "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True)


async def run_snippet(code: Any, namespace: dict[str, Any]) -> None:
    result = eval(code, namespace)  # compiled with top-level await: a coroutine where it awaits
    if inspect.iscoroutine(result):
        await result


def comment_of(block: Block, code: str) -> str:
    """The comment on the line of ``block`` that holds ``code``, with the comment-only lines
    right below it that continue it."""
    lines = block.text.splitlines()
    at = next(i for i, line in enumerate(lines) if code in line)
    parts = [lines[at].split("#", 1)[1]]
    for line in lines[at + 1 :]:
        if not line.lstrip().startswith("#"):
            break
        parts.append(line.lstrip()[1:])
    return " ".join(" ".join(parts).split())


def ellipsis_pattern(text: str) -> re.Pattern[str]:
    """``text`` as a pattern in which each "..." stands for any text."""
    return re.compile(".*?".join(re.escape(piece) for piece in text.split("...")), re.S)


@contextlib.asynccontextmanager
async def pair(transport: str) -> AsyncIterator[tuple[tensorwire.Node, tensorwire.Peer]]:
    """A node, and a peer of another node connected to it, both offering ``transport`` only."""
    async with (
        tensorwire.start("127.0.0.1:0", transports=(transport,)) as node,
        tensorwire.start("127.0.0.1:0", transports=(transport,)) as other,
    ):
        yield node, await other.connect(node.address)


# -- every snippet is Python a user can paste -------------------------------------------------
@pytest.mark.parametrize("snippet", python_blocks(), ids=str)
def test_every_python_block_compiles(snippet: Block) -> None:
    if snippet.text.lstrip().startswith(">>>"):
        test = doctest.DocTestParser().get_doctest(snippet.text, {}, str(snippet), str(snippet.page), snippet.line)
        assert test.examples, f"{snippet}: a >>> block without examples"
        for example in test.examples:
            compile(example.source, str(snippet), "single", dont_inherit=True)
    else:
        _compile(snippet)  # SyntaxError names the page and line


def test_the_pages_have_the_blocks_this_file_runs() -> None:
    # guards the heading-based lookup itself: a page that lost its blocks would skip nothing here
    assert len([b for b in blocks(README) if b.lang == "python"]) >= 6
    assert any(b.text.startswith(">>> ") for b in blocks(ROOT / "docs" / "pipeline.md"))


# -- README: Use --------------------------------------------------------------------------------
# the other machine of the README's first snippet, in a process of its own, installed without
# the ucx and verbs extras (their modules cannot be imported there, as on a plain `pip install .`)
PARTNER = r"""
import asyncio, sys
sys.modules["ucxx"] = sys.modules["pyverbs"] = None
import numpy as np, tensorwire

async def main():
    async with tensorwire.start("127.0.0.1:0") as node:
        print(node.address, flush=True)
        peer = await node.accept()
        msg = await peer.recv(tag="act")
        assert msg["step"] == 3 and np.array_equal(msg["x"], np.ones((4, 4))), msg
        await peer.send(np.full((4, 4), 2.0), tag="grad")
        back = await node.connect((await asyncio.to_thread(sys.stdin.readline)).strip())
        print("connected back", flush=True)
        await asyncio.to_thread(sys.stdin.read)  # until the test is done
        await back.aclose()

asyncio.run(main())
"""


async def test_use_snippet_runs_against_a_node_in_another_process(capsys: pytest.CaptureFixture[str]) -> None:
    use = block(README, "Use", "import asyncio, numpy as np, tensorwire")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    partner = await asyncio.create_subprocess_exec(
        sys.executable, "-c", PARTNER, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
    )
    assert partner.stdin is not None and partner.stdout is not None
    try:
        async with asyncio.timeout(60):
            address = (await partner.stdout.readline()).decode().strip()
            assert address.startswith("127.0.0.1:"), f"the partner did not start: {address!r}"

            def announce(node_address: str) -> None:  # the partner connects back, for `async for`
                assert partner.stdin is not None
                partner.stdin.write(node_address.encode() + b"\n")

            tree = ast.parse(use.text)
            edit = _Edit(use)
            edit.constants["10.0.0.2:5555"] = ast.Constant(address)
            edit.for_body = ast.Break()
            edit.with_start = [_stmt("_announce(node.address)")]
            tree = edit.visit(tree)
            run = [s for s in tree.body if ast.unparse(s) == "asyncio.run(main())"]
            assert len(run) == 1, f"{use}: the snippet no longer ends in asyncio.run(main())"
            tree.body.remove(run[0])  # it runs on this test's loop instead
            edit.check(**{"'10.0.0.2:5555'": 1, "async for ...": 1, "async with tensorwire.start(...) as node": 1})
            namespace: dict[str, Any] = {"__name__": "readme_use", "_announce": announce}
            await run_snippet(_compile(use, tree), namespace)
            await namespace["main"]()
            assert (await partner.stdout.readline()).decode().strip() == "connected back"
    finally:
        partner.stdin.close()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(30):
                await partner.wait()
        if partner.returncode is None:
            partner.kill()
            await partner.wait()
    assert partner.returncode == 0, "the partner process failed (its traceback is above)"
    printed = capsys.readouterr().out.strip()
    said = comment_of(use, "print(peer.path)")
    assert ellipsis_pattern(said).fullmatch(printed), f"README says {said!r}, the snippet printed {printed!r}"


# -- README: one-sided (and docs/ucx.md's) ------------------------------------------------------
ONE_SIDED_TRANSPORTS = ["tcp", pytest.param("ucx", marks=pytest.mark.skipif(not HAVE_UCX, reason="no ucxx"))]


@pytest.mark.parametrize("transport", ONE_SIDED_TRANSPORTS)
async def test_one_sided_snippet_reads_and_writes_what_it_says(transport: str) -> None:
    snippet = block(README, "One-sided reads and writes", "kv = np.zeros((32, 1024, 128), np.float16)")
    rng = np.random.default_rng(0)
    shape = (32, 1024, 128)
    new_values = rng.standard_normal(shape).astype(np.float16)
    new_rows = rng.standard_normal((8, *shape[1:])).astype(np.float16)
    row3, row9 = (rng.standard_normal(shape[1:]).astype(np.float16) for _ in range(2))
    async with pair(transport) as (node, peer):
        ns: dict[str, Any] = {"np": np, "node": node, "peer": peer, "buf": np.full(shape, 9, np.float16)}
        ns |= {"new_values": new_values, "new_rows": new_rows, "ids": [1, 5, 9], "row3": row3, "row9": row9}
        await run_snippet(_compile(snippet), ns)
        kv, h = ns["kv"], ns["h"]
        # the whole read came before any write; each write reached the owner's tensor
        assert not ns["buf"].any(), "read(h, out=buf) did not land in buf"
        want = new_values.copy()
        want[4:12] = new_rows
        blocks_want = [want[i].copy() for i in (1, 5, 9)]  # as they were when read_many ran
        want[3], want[9] = row3, row9
        assert np.array_equal(kv, want)
        assert np.array_equal(ns["block"], new_values[7])
        assert len(ns["blocks"]) == 3 and all(map(np.array_equal, ns["blocks"], blocks_want))
        # "over ucx ... h.direct is True ... the receipt says protocol='one-sided'"; tcp: owner-assisted
        assert h.direct is (transport == "ucx")
        assert ns["receipt"].protocol == ("one-sided" if transport == "ucx" else "owner-assisted")
        # "later reads/writes/lookups: HandleNotFound"
        with pytest.raises(tensorwire.HandleNotFound):
            await peer.lookup("kv/3")
        with pytest.raises(tensorwire.HandleNotFound):
            await peer.read(h[7])
        with pytest.raises(tensorwire.HandleNotFound):
            await peer.write(h[7], row3)
    # "h[4:12][1] works too"; a step, a tuple, an index out of range, a 0-d handle do not
    assert h[4:12][1].shape == h[5].shape == shape[1:]
    assert h[-2:].shape == (2, *shape[1:])
    for bad in (lambda: h[::2], lambda: h[1, 2], lambda: h[32], lambda: h[7][0][0][0]):
        with pytest.raises(tensorwire.ShapeMismatchError):
            bad()


@pytest.mark.skipif(not HAVE_UCX, reason="no ucxx")
async def test_ucx_page_one_sided_snippet() -> None:
    snippet = block(ROOT / "docs" / "ucx.md", "One-sided expose / lookup / read / write", "handle = node.expose(kv")
    kv = np.arange(1 << 16, dtype=np.float32)
    src = -kv
    async with pair("ucx") as (node, peer):
        ns: dict[str, Any] = {"node": node, "peer": peer, "kv": kv, "buf": np.empty_like(kv), "src": src}
        await run_snippet(_compile(snippet), ns)
        assert ns["h"].direct
        assert np.array_equal(ns["buf"], np.arange(1 << 16, dtype=np.float32)) and np.array_equal(kv, src)
        with pytest.raises(tensorwire.HandleNotFound):
            await peer.read(ns["h"])


# -- README: tensor RPC --------------------------------------------------------------------------
async def test_rpc_snippet_calls_streams_and_receives_in_place() -> None:
    snippet = block(README, "Tensor RPC", '@node.method("forward")')
    async with pair("tcp") as (node, peer):

        @node.method("double")  # the snippet calls these two without defining them
        async def double(x: Any) -> Any:
            return x * 2

        @node.method("generate")
        async def generate(prompt: Any) -> AsyncIterator[Any]:
            for i in range(3):
                yield prompt + i

        x = np.arange(6.0).reshape(3, 2)
        ns: dict[str, Any] = {"node": node, "peer": peer, "x": x, "m": x > 2, "buf": np.empty_like(x)}
        ns["prompt"] = np.arange(4)
        await run_snippet(_compile(snippet), ns)
        assert ns["out"]["rows"] == 3 and np.array_equal(ns["out"]["y"], x * 2)
        assert ns["y"] is ns["buf"] and np.array_equal(ns["buf"], x * 2), "_out=buf: the result lands in buf"
        assert np.array_equal(ns["chunk"], np.arange(4) + 2)
        receipt = ns["receipt"]
        assert np.array_equal(ns["z"], x * 2) and isinstance(receipt, tensorwire.CallReceipt)
        assert receipt.transport == "tcp" and receipt.args_inline and receipt.result.nbytes >= x.nbytes

        # the CallLimits the README sets are the defaults it describes
        setting = next(s for s in spans(README) if s.startswith("node.methods.limits = tensorwire.rpc.CallLimits("))
        exec(setting, {"node": node, "tensorwire": tensorwire})
        assert node.methods.limits == tensorwire.rpc.CallLimits(), setting


async def test_metrics_snippet_serves_and_counts() -> None:
    """The README's Metrics snippet, on a free port: the endpoint serves tensorwire's metrics
    while it runs, and ``sent`` is the bytes sent over tcp so far (a message sent first)."""
    pytest.importorskip("prometheus_client")
    snippet = block(README, "Metrics", "import tensorwire.metrics")
    edit = _Edit(snippet)
    edit.constants["127.0.0.1:9464"] = ast.Constant("127.0.0.1:0")
    tree = edit.visit(ast.parse(snippet.text))
    edit.check(**{"'127.0.0.1:9464'": 1})
    closing = [s for s in tree.body if ast.unparse(s) == "await server.aclose()"]
    assert len(closing) == 1, f"{snippet}: the snippet no longer ends by closing its server"
    tree.body.remove(closing[0])  # this test closes it, after reading the endpoint
    async with pair("tcp") as (node, peer):
        await peer.send(np.zeros(1000, np.uint8), tag=1)
        await (node.peers[0]).recv(tag=1)
        ns: dict[str, Any] = {}
        await run_snippet(_compile(snippet, tree), ns)
    server = ns["server"]
    try:
        url = f"http://{server.address}/metrics"
        body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=10).read().decode())
        assert 'tensorwire_transfer_bytes_total{direct="true",memory="host",op="send"' in body, body
    finally:
        await server.aclose()
    assert ns["sent"] >= 1000 and ns["sent"] == tensorwire.metrics.snapshot().bytes("send", "tcp")


# -- README: stock gRPC clients -------------------------------------------------------------------
@pytest.fixture
def readme_stubs(tmp_path: Path) -> Path:
    """Stubs made by the README's own protoc command, in tmp_path (the README runs it from the
    repository root and writes there: the proto's path is made absolute, python is this one)."""
    pytest.importorskip("grpc_tools")
    protoc = block(README, "Tensor RPC", "cp proto/tensorwire/v1/control.proto .")
    command = protoc.text.strip().replace("cp proto/", f"cp {shlex.quote(str(ROOT))}/proto/")
    command = re.sub(r"^python |&& python ", lambda m: m[0].replace("python", shlex.quote(sys.executable)), command)
    made = subprocess.run(["bash", "-c", command], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    assert {"control_pb2.py", "control_pb2_grpc.py"} <= {p.name for p in tmp_path.iterdir()}
    return tmp_path


async def test_stock_grpc_snippets(readme_stubs: Path) -> None:
    import grpc
    from google.protobuf import json_format

    from tensorwire.control._pb import control_pb2, control_pb2_grpc

    client = block(README, "Tensor RPC", "import grpc, control_pb2 as pb, control_pb2_grpc as pb_grpc")
    curl = block(README, "Tensor RPC", "grpcurl -plaintext -d ")
    async with tensorwire.start("127.0.0.1:0", transports=("tcp",)) as node:

        @node.method("add")
        async def add(a: int, b: int) -> int:
            return a + b

        script = client.text.replace("HOST:PORT", node.address)
        assert script != client.text
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-E", "-c", script, cwd=readme_stubs, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, err.decode()
        listed, result = out.decode().splitlines()
        assert ast.literal_eval(listed) == ["add"]
        assert result == comment_of(client, "print(stub.Invoke(")

        # grpcurl's JSON, through the same messages
        request = re.search(r"-d '([^']*)'", curl.text)
        assert request is not None and "tensorwire.v1.Control/Invoke" in curl.text
        service = control_pb2.DESCRIPTOR.services_by_name["Control"]
        assert service.full_name == "tensorwire.v1.Control" and "Invoke" in service.methods_by_name
        async with grpc.aio.insecure_channel(node.address) as channel:
            reply = await control_pb2_grpc.ControlStub(channel).Invoke(
                json_format.Parse(request[1], control_pb2.InvokeRequest()), timeout=10
            )
        assert json.loads(json_format.MessageToJson(reply)) == json.loads(comment_of(curl, "Control/Invoke"))


async def test_the_status_each_error_gets_over_invoke_is_the_readmes() -> None:
    """The README's "errors map to statuses (...)": each exception it names for a method gets its
    status from Invoke, and one it does not name gets ``UNKNOWN`` ("other exceptions"). It used
    to name ValueError alone, while a method's KeyError, TypeError, PermissionError, TimeoutError
    and NotImplementedError got other statuses, and a tensor result ``FAILED_PRECONDITION``."""
    import grpc

    from tensorwire.control._pb import control_pb2, control_pb2_grpc

    text = prose(README)
    said = text[text.index("errors map to statuses (") : text.index("with details `")]
    named: dict[type[BaseException], str] = {}  # exception -> status, as the README pairs them
    pending: list[type[BaseException]] = []
    for word in re.findall(r"`(\w+)`", said):
        if word.isupper():
            named.update(dict.fromkeys(pending, word))
            pending = []
        elif isinstance(getattr(builtins, word, None), type):
            pending.append(getattr(builtins, word))
    assert named and not pending, said

    def expected(kind: type[BaseException]) -> str:
        return next((named[k] for k in kind.__mro__ if k in named), "UNKNOWN")

    kinds = {*named, KeyError, IndexError, TypeError, PermissionError, TimeoutError, NotImplementedError}
    kinds |= {FileNotFoundError, OSError, RuntimeError, ZeroDivisionError, AttributeError}
    async with tensorwire.start("127.0.0.1:0", transports=("tcp",)) as node:

        @node.method("fail")
        async def fail(kind: str) -> None:
            raise getattr(builtins, kind)("as asked")

        @node.method("tensor")
        async def tensor() -> Any:
            return np.zeros(2)

        got: dict[str, str] = {}
        async with grpc.aio.insecure_channel(node.address) as channel:
            stub = control_pb2_grpc.ControlStub(channel)
            for method, args in [("tensor", []), *(("fail", [k.__name__]) for k in kinds)]:
                request = control_pb2.InvokeRequest(method=method, args=[control_pb2.Value(str_value=a) for a in args])
                with pytest.raises(grpc.aio.AioRpcError) as failed:
                    await stub.Invoke(request, timeout=10)
                got[args[0] if args else method] = failed.value.code().name
    assert got.pop("tensor") == "FAILED_PRECONDITION"
    assert got == {k.__name__: expected(k) for k in kinds}, "Invoke's statuses for a method's errors vs the README's"
    assert "a result that holds a tensor `FAILED_PRECONDITION`" in said, said


# -- README and docs/pipeline.md: pipelines -----------------------------------------------------
def _numpy_part(rank: int, num_stages: int) -> pipeline.FunctionPart:
    from _pipeline_fixtures import NumpyLinear

    def mse(y: np.ndarray, target: np.ndarray) -> tuple[float, np.ndarray]:
        return float(((y - target) ** 2).mean()), 2 * (y - target) / y.size

    last = rank == num_stages - 1
    layer = NumpyLinear(np.random.default_rng(rank), 4, 4, tanh=not last)
    return pipeline.FunctionPart(layer, loss=mse if last else None)


@contextlib.asynccontextmanager
async def _stages(
    snippet: Block, tree: ast.stmt, n: int, namespace: Callable[[], dict[str, Any]]
) -> AsyncIterator[list[str]]:
    """Serve ``n`` copies of ``snippet``'s stage statement ``tree`` as tasks, each in a
    ``namespace()`` of its own, and yield their addresses: "0.0.0.0:5000" binds "127.0.0.1:0", and
    each stage records its address before it waits for ever."""
    bound: list[str] = []
    edit = _Edit(snippet)
    edit.constants["0.0.0.0:5000"] = ast.Constant("127.0.0.1:0")
    edit.with_start = [_stmt("_bound.append(node.address)")]
    module = edit.visit(ast.Module([tree], []))
    edit.check(**{"'0.0.0.0:5000'": 1, "async with tensorwire.start(...) as node": 1})
    code = _compile(snippet, module)
    tasks = [asyncio.create_task(run_snippet(code, namespace() | {"_bound": bound})) for _ in range(n)]
    try:
        async with asyncio.timeout(30):
            while len(bound) < n:
                for task in tasks:
                    if task.done():
                        task.result()  # a stage that failed to start says why
                await asyncio.sleep(0.01)
        yield bound
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _split(tree: ast.Module) -> tuple[list[ast.stmt], ast.stmt, ast.stmt, list[ast.stmt]]:
    """What comes before a snippet's two ``async with`` statements, the two, and what follows."""
    at = [i for i, s in enumerate(tree.body) if isinstance(s, ast.AsyncWith)]
    assert len(at) == 2 and at[1] == at[0] + 1, "the snippet is no longer a stage then a driver"
    return tree.body[: at[0]], tree.body[at[0]], tree.body[at[1]], tree.body[at[1] + 1 :]


async def test_readme_pipeline_snippet_trains_a_step(capsys: pytest.CaptureFixture[str]) -> None:
    snippet = block(README, "Pipeline-parallel stages", "from tensorwire import pipeline")
    head, stage, driver, tail = _split(ast.parse(snippet.text))  # the import, the stage, the driver, print
    ns: dict[str, Any] = {"tensorwire": tensorwire, "asyncio": asyncio, "build_part": _numpy_part}
    await run_snippet(_compile(snippet, ast.Module(head, [])), ns)
    async with _stages(snippet, stage, 2, ns.copy) as addresses:
        rng = np.random.default_rng(1)
        ns |= {"stage_addresses": addresses, "x": rng.standard_normal((16, 4)), "y": rng.standard_normal((16, 4))}
        await run_snippet(_compile(snippet, ast.Module([driver, *tail], [])), ns)
    r = ns["r"]  # "r.loss, r.bubble"
    assert np.isfinite(r.loss) and 0 <= r.bubble <= 1 and len(r.losses) == 8
    assert capsys.readouterr().out == pipeline.get_schedule("1f1b")(4, 8).grid() + "\n"


async def test_pipeline_page_stage_and_drive_snippets(capsys: pytest.CaptureFixture[str]) -> None:
    torch = pytest.importorskip("torch")
    page = ROOT / "docs" / "pipeline.md"
    serve = block(page, "Start stages", 'async with tensorwire.start("0.0.0.0:5000") as node:')
    drive = block(page, "Drive", "async with tensorwire.start() as node:")
    (stage,) = ast.parse(serve.text).body
    common: dict[str, Any] = {"tensorwire": tensorwire, "asyncio": asyncio, "pipeline": pipeline}

    def stage_namespace() -> dict[str, Any]:
        make_opt = lambda ps: torch.optim.SGD(ps, lr=0.1)
        return common | {"F": torch.nn.functional, "make_opt": make_opt, "module": torch.nn.Linear(4, 4)}

    async with _stages(serve, stage, 4, stage_namespace) as addresses:
        tree = ast.parse(drive.text)
        edit = _Edit(drive)
        for i, address in enumerate(addresses):
            edit.constants[f"h{i}:5000"] = ast.Constant(address)
        tree = edit.visit(tree)
        edit.check(**{f"'h{i}:5000'": 1 for i in range(4)})
        x, y = torch.randn(16, 4), torch.randn(16, 4)
        run_ns = common | {"batches": [(x, y), (x[:12], y[:12])]}  # shapes may change between steps
        await run_snippet(_compile(drive, tree), run_ns)
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 3 and len(ast.literal_eval(printed[0])) == 3, printed  # pipe.paths: one per link
    assert len(run_ns["params"]) == 4 and all(isinstance(p, dict) and p for p in run_ns["params"])


def test_pipeline_page_doctest_and_schedule_errors() -> None:
    page = ROOT / "docs" / "pipeline.md"
    session = block(page, "Schedules are data", ">>> from tensorwire.pipeline import get_schedule, Schedule")
    test = doctest.DocTestParser().get_doctest(session.text, {}, str(session), str(page), session.line)
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    out: list[str] = []
    runner.run(test, out=out.append)
    assert runner.failures == 0, "".join(out)
    # the refusals the page shows, made from the schedules they describe
    stuck = block(page, "Schedules are data", "schedule 'custom' (p=2, m=2) cannot run:")
    with pytest.raises(tensorwire.ScheduleError) as custom:
        pipeline.Schedule.parse("stage 0: F0 F1 B0 B1\nstage 1: F0 B1 F1 B0").validate()
    assert str(custom.value) == stuck.text.rstrip("\n")
    limit = block(page, "Schedules are data", "schedule 'reverse' (p=2, m=3) cannot run:")
    reverse = pipeline.Schedule.parse("stage 0: F0 F1 F2 B2 B1 B0\nstage 1: F2 B2 F1 B1 F0 B0", name="reverse")
    with pytest.raises(tensorwire.ScheduleError) as refused:
        reverse.validate(max_unexpected=2)
    assert str(refused.value).splitlines()[0] == limit.text.strip()
    reverse.validate()  # "GPipe and 1F1B ... no limit binds them": the default 1024 does not bind this one


# -- README: Development (the public conformance suite) -------------------------------------------
async def test_the_conformance_suites_own_example_gives_each_check_its_limits() -> None:
    """The README sends a new transport's author to ``tensorwire.testing``, whose docstring shows
    the test to write. Run as written, it passes on tcp for checks that carry tight limits in
    ``LIMITS``: the example once called ``connected_pair("tcp")`` without ``check=``, and five of
    those checks then failed on transports that keep the contract."""
    import tensorwire.testing as testing

    assert "from tensorwire.testing import CHECKS, connected_pair" in prose(README)
    lines = (testing.__doc__ or "").splitlines()[2:]  # the summary, a blank line, the example
    example = textwrap.dedent("\n".join(itertools.takewhile(lambda s: not s or s.startswith("    "), lines)))
    namespace: dict[str, Any] = {"pytest": pytest}
    exec(compile(example, testing.__file__ or "tensorwire/testing", "exec"), namespace)
    test = namespace["test_conformance"]
    (mark,) = [m for m in getattr(test, "pytestmark", []) if m.name == "parametrize"]
    values = list(mark.args[1])
    ids = [str(i) for i in mark.kwargs.get("ids") or values]
    assert sorted(ids) == sorted(testing.CHECKS), "the example no longer runs every check"
    for name in ("send_past_the_peers_limit_is_refused", "header_past_the_peers_limit_is_refused", "backpressure"):
        assert name in testing.LIMITS, name
        await test(values[ids.index(name)])


# -- names the pages use exist ------------------------------------------------------------------
def _resolve(dotted: str) -> object:
    """``tensorwire.a.b.C.d``: the longest importable module, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(dotted)


def test_every_tensorwire_name_the_pages_mention_exists() -> None:
    named = {
        name
        for page in PAGES
        for text in [page.read_text()]
        for name in re.findall(r"(?<![\w/.-])tensorwire(?:\.[A-Za-z_]\w*)+", text)
        if not name.startswith("tensorwire.v1.")  # the proto package, checked below
    }
    assert {"tensorwire.Limits", "tensorwire.rpc.current_deadline", "tensorwire.pipeline"} <= named
    missing = []
    for name in sorted(named):
        try:
            _resolve(name)
        except (ImportError, AttributeError) as exc:
            missing.append(f"{name}: {exc}")
    assert not missing, "names the pages use that do not exist:\n" + "\n".join(missing)
    from tensorwire.control._pb import control_pb2

    for name in {n for p in PAGES for n in re.findall(r"tensorwire\.v1\.[\w/]+", p.read_text())}:
        service, _, method = name.removeprefix("tensorwire.v1.").partition("/")
        if method:
            assert method in control_pb2.DESCRIPTOR.services_by_name[service].methods_by_name, name
        else:
            known = {*control_pb2.DESCRIPTOR.services_by_name, *control_pb2.DESCRIPTOR.message_types_by_name}
            assert service in known, name


# Errors of other libraries the pages name (asyncio's, grpc's; CuPy's and torch's out of memory)
FOREIGN_ERRORS = {"CancelledError", "UsageError", "OutOfMemoryError", "CUDARuntimeError"}


# Where the pages name a class by itself, where to find it. A `Class.attribute` of one of these
# must exist; an `...Error` must be tensorwire's own, a builtin or one of FOREIGN_ERRORS.
def _classes() -> dict[str, object]:
    import tensorwire.transports._credit as credit
    import tensorwire.transports._mailbox as mailbox
    import tensorwire.transports._remote as remote
    import tensorwire.transports.ucx as ucx
    from tensorwire.control._pb import control_pb2

    found: dict[str, object] = {}
    for module in (tensorwire, tensorwire.rpc, pipeline, tensorwire.transports, ucx, mailbox, credit, remote):
        found |= {k: v for k, v in vars(module).items() if inspect.isclass(v)}
    found |= {k: getattr(control_pb2, k) for k in control_pb2.DESCRIPTOR.message_types_by_name}
    return found


def test_every_class_attribute_and_error_the_pages_name_exists() -> None:
    classes = _classes()
    wrong, checked = [], 0
    for page in PAGES:
        for span in spans(page):
            for name, attr in re.findall(r"(?<![\w.])([A-Z]\w*[a-z]\w*)(?:\.([a-z_]\w*))?", span):
                if name in classes and attr:
                    checked += 1
                    cls = classes[name]
                    fields = getattr(getattr(cls, "DESCRIPTOR", None), "fields_by_name", {})  # protobuf
                    if not hasattr(cls, attr) and attr not in fields:
                        wrong.append(f"{page.name}: {name}.{attr}")
                elif (
                    name.endswith("Error")
                    and name not in classes.keys() | FOREIGN_ERRORS
                    and not hasattr(builtins, name)
                ):
                    wrong.append(f"{page.name}: {name}")
    assert checked >= 15, "the class lookup found too little to mean anything"
    assert not wrong, "named in the pages, missing in the code: " + ", ".join(wrong)


def test_option_receipt_and_limit_lists_match_the_code() -> None:
    text = prose(README)
    # "Node options (...), with their defaults: `transports` (...), ..., `ucx_options` (...)."
    options = text[text.index("Node options (") : text.index("Each is checked when it is given")]
    node_options = re.findall(r"`(\w+)` \(", options)  # `checksum` (False)
    limits = re.findall(r"`(\w+)` \d", options)  # `max_unexpected` 1024
    assert sorted(node_options) == sorted(f.name for f in dataclasses.fields(tensorwire.NodeConfig)), options
    assert sorted(limits) == sorted(f.name for f in dataclasses.fields(tensorwire.Limits)), options
    # "**Receipts**: `send` returns a `Receipt` with `transport`, ..., `memory` (...); ..."
    receipts = text[text.index("**Receipts**") :].split(" with ", 1)[1].split(";", 1)[0]
    named = set(re.findall(r"`(\w+)`", receipts))
    assert named == {f.name for f in dataclasses.fields(tensorwire.Receipt)}, receipts


def _size(n: int) -> str:
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return str(n)


def _shell_defaults(script: Path) -> dict[str, str]:
    """The defaults a shell script gives its variables: ``NAME=${NAME:-value}`` and
    ``${NAME:-value}`` where it is used."""
    return dict(re.findall(r"\$\{(\w+):-([^}]*)\}", script.read_text()))


def test_the_defaults_and_numbers_the_pages_quote_are_the_codes() -> None:
    import tensorwire.transports.ucx._channel as ucx_channel
    import tensorwire.transports.ucx._worker as ucx_worker
    import tensorwire.transports.verbs._channel as verbs_channel
    import tensorwire.transports.verbs._memory as verbs_memory
    import tensorwire.transports.verbs._queue as verbs_queue
    import tensorwire.transports.verbs._transport as verbs
    from tensorwire import _checks, _onesided, _peer
    from tensorwire.control import PROTOCOL_VERSION, _negotiate
    from tensorwire.control import _server as control_server
    from tensorwire.memory import _engine, _pinned
    from tensorwire.pipeline import _stage
    from tensorwire.rpc import _client, _protocol
    from tensorwire.tensors import _offload
    from tensorwire.transports import DEFAULT_PREFERENCE, _credit, _frames
    from tensorwire.transports.tcp import _channel as tcp_channel
    from tensorwire.transports.tcp._sockio import _HEADER_FILL, SMALL_READ

    config, limits, calls = tensorwire.NodeConfig(), tensorwire.Limits(), tensorwire.rpc.CallLimits()
    us = 1e6
    check = _shell_defaults(ROOT / "scripts" / "gpu_check.sh")  # docs/gpu.md describes its defaults
    unreserved = verbs.SLOTS - verbs_channel.RESERVE
    quoted: dict[Path, list[str]] = {
        README: [
            f"`transports` (preference order, `{', '.join(DEFAULT_PREFERENCE)}`)",
            f"`checksum` ({config.checksum}), `lease_seconds` ({config.lease_seconds:g})",
            f"`connect_timeout` ({config.connect_timeout:g})",
            *[
                f"`{f.name}` {_size(v) if f.name.endswith('_bytes') else f'{v:g}'}"
                for f in dataclasses.fields(limits)
                for v in [getattr(limits, f.name)]
            ],
            f"(`Limits.recv_buffer_bytes`, default {_size(limits.recv_buffer_bytes)} per peer",
            f"({limits.max_unexpected} by default)",
            f"(default lease {config.lease_seconds:g} s)",
            f"`max_header_bytes` at least {tensorwire.Limits.MIN_HEADER_BYTES}",
            f"`chunk_bytes` at least {tensorwire.Limits.MIN_CHUNK_BYTES}",
            f"`lease_seconds` from {tensorwire.NodeConfig.MIN_LEASE_SECONDS:g} s to about "
            f"{int(tensorwire.NodeConfig.MAX_LEASE_SECONDS / 86400)} days",
            f"at most 10**{round(np.log10(_checks.MAX_SECONDS))};",
            f"about {int(_checks.MAX_SECONDS / (365.25 * 86400))} years",
            f"`Limits` keeps that limit at {tensorwire.Limits.MIN_HEADER_BYTES // 1024} KiB or more",
            f"arguments up to {_size(_protocol.INLINE_BYTES)} ride inside the request",
            f"({_client._MAX_OUTSTANDING} calls at most)",
            f"plus up to {_protocol.STREAM_WINDOW - 1} taken",
            f"CallLimits(max_concurrent={calls.max_concurrent},",
            f"its `max_concurrent`, {calls.max_concurrent} by default",
            f"`Limits.max_unexpected` ({limits.max_unexpected} by default) of a receiver's slots",
            f"as many again, at least {_credit.own_slots(1)}, that",
            f"{_frames.HEADER.size}-byte frame headers",
            f"Payloads move in {_size(limits.chunk_bytes)} frames",
            f"one request carries up to {_onesided._MAX_REGIONS} regions",
            f"at the same control protocol version ({PROTOCOL_VERSION} now)",
            f"Host copies of {_size(_offload.OFF_LOOP_BYTES)} or more",
            f"run in one of {_offload._WORKERS} `tensorwire-copy` threads",
            f"-0x{-_peer.RESERVED_TAGS[0]:_X} to -0x{-_peer.RESERVED_TAGS[-1]:_X} are tensorwire's own",
            f"the header read takes up to {_size(_HEADER_FILL)} of payload along, and a rest\n  under "
            f"{_size(SMALL_READ)} is read through that buffer too",
            f"a ucx send whose payload segments are {_size(ucx_channel._ROUTE_FROM)} or more",
            f"or puts, are each {_size(ucx_channel._ROUTE_FROM)} or more says in its receipt's `route`",
            f"keeps the latest {tensorwire.Node.MAX_DEPARTED} such peers (`Node.MAX_DEPARTED`)",
            f"A handshake names at most {_negotiate.MAX_TRANSPORTS} transports, each name (and `require`) at "
            f"most {control_server.MAX_NAME_CHARS} characters, its node id at most "
            f"{tensorwire.NodeConfig.MAX_NODE_ID_CHARS}, its instance id at most "
            f"{control_server.MAX_INSTANCE_ID_CHARS} and its control address at most "
            f"{control_server.MAX_ADDRESS_CHARS},",
            f"cut to {control_server.MAX_REASON_CHARS} characters",
            f"`node_id` at most {tensorwire.NodeConfig.MAX_NODE_ID_CHARS} characters",
            f"`auth_token` at most {tensorwire.NodeConfig.MAX_AUTH_TOKEN_CHARS} printable ASCII characters",
            f"A name is a non-empty string of at most {_onesided.MAX_HANDLE_NAME_CHARS} characters",
            f"a node keeps at most {_onesided._MAX_ASKED} of them",
            f"an owner serves at most {_onesided._MAX_SERVED} of one peer's at once",
        ],
        ROOT / "docs" / "pipeline.md": [
            f"`Limits.max_unexpected` unreceived messages from one peer ({limits.max_unexpected} by default)",
            f"the lease (a silent peer, {config.lease_seconds:g} s by default)",
            f"Its configure waits up to {_stage._COMMIT_GRACE:g} s for a pending commit",
            f"`connect_timeout` (default: the driver node's, {config.connect_timeout:g} s)",
        ],
        ROOT / "docs" / "gpu.md": [
            f"a pool of {_pinned.DEPTH} page-locked host chunks of {_size(_pinned.CHUNK_BYTES)}",
            f"up to {_pinned.DEPTH} device-to-host chunk copies are queued ahead",
            f"host copies of {_size(_offload.OFF_LOOP_BYTES)} or more",
            f"`BUDGET={check['BUDGET']}` seconds",
            f"(`T_P2P={check['T_P2P']}`, `T_RAW={check['T_RAW']}`, `T_TESTS={check['T_TESTS']}`, "
            f"`T_SEQ={check['T_SEQ']}`, `T_KV={check['T_KV']}`, "
            f"`T_PACK={check['T_PACK']}` seconds)",
            f"a step is not started with under {int(check['MIN_STEP']) + 15} s left",
            f"a {check['T_TEST']} s limit per test (`T_TEST`",
            f"in {check['XDIST']} processes sharing the GPU",
            f"`{check['BENCH_ARGS']}` by default here",
        ],
        ROOT / "docs" / "benchmarks.md": [
            f"an eager message of up to {_size(tcp_channel._FAST_FRAME)} with its payload",
            f"a batch carries up to {_onesided._MAX_REGIONS} regions per request",
            f"spins up to {_engine._SPIN_SECONDS * us:g} us on the copy's event",
            f"(from {_size(_offload.OFF_LOOP_BYTES)} in a copy thread",
            f"`lease_seconds=1` in the tests, default {config.lease_seconds:g} s",
        ],
        ROOT / "docs" / "ucx.md": [
            f"keeps progressing for {ucx_worker._SPIN_IDLE * us:g} us ({ucx_worker._SPIN_ACTIVE * 1e3:g} ms while",
            f"then a {ucx_worker._FALLBACK * 1e3:g} ms fallback poll",
            f"a recv posted within {ucx_channel._ANSWER_WINDOW * us:g} us of this channel's last send",
            f"for up to {ucx_channel._WAIT_INLINE * us:g} us before it goes to the loop",
            f"up to {ucx_channel._WAIT_BACKOFF} recvs after each miss",
            f"ride in its MSG frame (up to {_size(ucx_channel._INLINE_MAX)})",
            f"are taken at once (up to {ucx_channel._CTRL_BURST})",
            f"(an eager message of up to {_size(ucx_channel._LAND_INLINE)})",
            f"at least every {ucx_channel._INLINE_STREAK} recvs answered so",
            f"moved nothing for {ucx_worker._STALL:g} s",
            f"A run of progress takes at most {ucx_worker._ROUNDS} rounds and {ucx_worker._BURST * 1e3:g} ms",
            f"({ucx_channel._LANDING_GRACE:g} s, `_LANDING_GRACE`)",
            f"a {ucx_channel._SEQ.bit_length()}-bit sequence",
        ],
        ROOT / "docs" / "verbs.md": [
            f"a ring of {verbs.SLOTS} receive buffers of {_size(verbs.SLOT_BYTES)}",
            f"and {verbs.SEND_SLOTS} send buffers",
            f"at most {verbs.MAX_RDMA} RDMA operations in flight per queue pair",
            f"keeping {verbs_channel.RESERVE} slots for CREDIT and BYE frames",
            f"Bounded ({verbs_memory._MAX_ENTRIES} entries, {_size(verbs_memory._MAX_BYTES)} pinned)",
            f"acknowledged in batches of {verbs_queue._ACK_BATCH}",
            f"a CREDIT frame goes once {unreserved // 4} data frames (a quarter of the unreserved ring)",
            f"or after {_credit.FLUSH_DELAY * 1e3:g} ms",
            f"once {unreserved // 2} (half the unreserved ring) are",
        ],
    }
    absent = [
        f"{page.name}: {phrase!r}"
        for page, phrases in quoted.items()
        for text in [prose(page)]
        for phrase in phrases
        if " ".join(phrase.split()) not in text
    ]
    assert not absent, "phrases made from the code's values, missing from the pages:\n" + "\n".join(absent)


# -- files, commands and links the pages name ----------------------------------------------------
_TOP = ("benchmarks", "scripts", "tests", "examples", "tensorwire", "proto", "docs", "transports", "memory", "tensors")


def test_every_file_and_anchor_the_pages_name_exists() -> None:
    missing = []
    for page in PAGES:
        text = page.read_text()
        for path in re.findall(rf"(?<![\w./-])((?:{'|'.join(_TOP)})/[\w./*-]*[\w*/])", text):
            path, _, test = path.partition("::")
            path = path.split(":")[0]
            where = [ROOT / path, ROOT / "tensorwire" / path]
            if not any(p.exists() or ("*" in path and list(ROOT.glob(path))) for p in where):
                missing.append(f"{page.name}: {path}")
        for path, test in re.findall(r"(tests/\w+\.py)::(\w+)", text):
            if f"def {test}(" not in (ROOT / path).read_text():
                missing.append(f"{page.name}: {path}::{test}")
        slugs = {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in re.findall(r"^#+ (.+)$", text, re.M)}
        for target, anchor in re.findall(r"\]\(([\w./-]*)#([\w-]+)\)", text):
            other = (page.parent / target).read_text() if target else text
            if target:
                slugs_there = {
                    re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in re.findall(r"^#+ (.+)$", other, re.M)
                }
            else:
                slugs_there = slugs
            if anchor not in slugs_there:
                missing.append(f"{page.name}: #{anchor}")
    assert not missing, "named in the pages, not in the repository:\n" + "\n".join(missing)


def test_the_scripts_subcommands_and_variables_the_pages_name_exist() -> None:
    """`bash scripts/rxe-vm.sh run2 ...` and `gpu_check.sh --install-only` are what those scripts
    take, and a command for the guest says what the guest will run; a TENSORWIRE_/TW_ variable a
    page names is read somewhere in the repository; the variables docs/gpu.md sets for
    scripts/gpu_check.sh are ones it reads."""
    code = "".join(
        f.read_text(errors="replace")
        for top in ("tensorwire", "scripts", "tests", "benchmarks")
        for f in (ROOT / top).rglob("*")
        if f.suffix in (".py", ".sh") and f.resolve() != Path(__file__).resolve()
    )
    wrong, seen = [], 0
    for page in PAGES:
        for name in set(re.findall(r"\b(?:TENSORWIRE|TW)_[A-Z0-9_]+\b", page.read_text())):
            if name not in code:
                wrong.append(f"{page.name}: {name} (read nowhere)")
        for command in spans(page) + [b.text for b in blocks(page)]:
            for script, word in re.findall(r"\b([\w-]+\.sh)[ \t]+(--[a-z][\w-]*|[a-z][\w-]*)", command):
                source = (ROOT / "scripts" / script).read_text()
                seen += 1
                if not (f'"{word}"' in source if word.startswith("-") else re.search(rf"^\s+{word}\)", source, re.M)):
                    wrong.append(f"{page.name}: {script} {word}")
            # a guest's command in double quotes is expanded by the host's shell first: its
            # $PYTHONPATH would be the host's (the guest has /opt/pydeps and /proj on its own)
            if re.search(r"\.sh run2? ", command):
                wrong += [
                    f"{page.name}: {q!r} ($ in double quotes)" for q in re.findall(r'"([^"]*)"', command) if "$" in q
                ]
    check = (ROOT / "scripts" / "gpu_check.sh").read_text()
    for span in spans(ROOT / "docs" / "gpu.md"):
        for name in re.findall(r"(?<![\w$])([A-Z][A-Z0-9_]+)=", span):
            if not name.startswith(("UCX_", "TENSORWIRE_")) and not re.search(rf"\$\{{?{name}\b", check):
                wrong.append(f"gpu.md: {name} (gpu_check.sh does not read it)")
    assert seen >= 6, "the script lookup found too little to mean anything"
    assert not wrong, "script commands and variables of the pages that do not work: " + ", ".join(dict.fromkeys(wrong))


# What a reader brings to a snippet: the objects the text around it names (a node, a peer, your
# tensors and model parts) and what an earlier snippet of the page made. Any other name a snippet
# reads must be assigned or imported in it: a result it never assigned (`receipt.memory` after an
# `await peer.send(...)` whose receipt was dropped) is a NameError for whoever pastes it.
GIVEN = {
    *("node", "peer", "np", "torch", "asyncio", "tensorwire", "pipeline", "F"),  # the usual imports
    *("x", "y", "s", "m", "buf", "kv", "src", "ids", "new_values", "new_rows", "row3", "row9", "prompt"),
    *("gpu_row", "gpu_rows", "h", "module", "make_opt", "make_layers", "build_part", "batches"),
    *("stage_addresses", "child_stdout", "used_protocols"),
}


def _free_names(tree: ast.Module) -> set[str]:
    bound, used = set(dir(builtins)), set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Name):
            (used if isinstance(n.ctx, ast.Load) else bound).add(n.id)
        elif isinstance(n, ast.Import | ast.ImportFrom):
            bound |= {(a.asname or a.name).split(".")[0] for a in n.names}
        elif isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound.add(n.name)
        elif isinstance(n, ast.arguments):
            bound |= {a.arg for a in [*n.posonlyargs, *n.args, *n.kwonlyargs, n.vararg, n.kwarg] if a}
    return used - bound


_RECEIVERS: dict[str, Any] = {"node": tensorwire.Node, "peer": tensorwire.Peer, "pipe": pipeline.Pipeline}


def _callee(func: ast.expr, imported: dict[str, str]) -> tuple[Any, bool] | None:
    """What a snippet's call calls, where the page's names say (``peer.recv`` is ``Peer.recv``),
    and whether it is a method taken from its class (its ``self`` not yet bound)."""
    dotted = ast.unparse(func)
    if not re.fullmatch(r"[A-Za-z_][\w.]*", dotted):
        return None
    head, *rest = dotted.split(".")
    if head in _RECEIVERS and rest:
        obj: Any = _RECEIVERS[head]
    elif head in imported:
        obj = _resolve(imported[head])
    elif head in ("tensorwire", "pipeline") and rest:
        obj = tensorwire if head == "tensorwire" else pipeline
    else:
        return None
    for name in rest:
        obj = getattr(obj, name)
    return obj, head in _RECEIVERS and inspect.isfunction(obj)


def test_every_snippet_reads_only_names_it_makes_or_a_reader_has() -> None:
    free = {
        str(b): sorted(_free_names(ast.parse(b.text)) - GIVEN)
        for b in python_blocks()
        if not b.text.lstrip().startswith(">>>")
    }
    assert not {k: v for k, v in free.items() if v}, "snippets that read names nobody gave them"


def test_every_call_in_the_snippets_fits_its_signature() -> None:
    """The snippets that cannot run here (CUDA ones, a part file's build_part) still call the API
    with arguments it takes: each call of a tensorwire function, class or method is bound to its
    signature with stand-ins for the arguments."""
    wrong, checked = [], 0
    for b in python_blocks():
        if b.text.lstrip().startswith(">>>"):
            continue
        tree = ast.parse(b.text)
        imported = {
            a.asname or a.name: f"{n.module}.{a.name}"
            for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("tensorwire")
            for a in n.names
        }
        for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
            found = _callee(call.func, imported)
            if found is None or any(isinstance(a, ast.Starred) for a in call.args):
                continue
            target, unbound = found
            args = [None] * (len(call.args) + unbound)
            try:
                inspect.signature(target).bind(*args, **{k.arg: None for k in call.keywords if k.arg})
            except TypeError as exc:
                wrong.append(f"{b}: {ast.unparse(call)}: {exc}")
            checked += 1
    assert checked >= 40, f"only {checked} calls checked: the lookup finds too little to mean anything"
    assert not wrong, "calls the API does not take:\n" + "\n".join(wrong)


def test_the_metric_names_and_labels_the_pages_and_docstring_name_are_served() -> None:
    """Every ``tensorwire_*`` metric the pages name (a query's selector labels too) is one the
    collector serves, and the ``tensorwire.metrics`` docstring, where the README sends its
    reader for the list, names every metric with exactly the labels it has."""
    pytest.importorskip("prometheus_client")
    import tensorwire.metrics

    served: dict[str, set[str]] = {}
    for family in tensorwire.metrics.collector().collect():
        labels = set(family._labelnames)
        suffixes = {"counter": ["_total"], "histogram": ["", "_bucket", "_sum", "_count"]}.get(family.type, [""])
        served |= {family.name + suffix: labels for suffix in suffixes}
    wrong = []
    for page in PAGES:
        for name, selector in re.findall(r"\b(tensorwire_\w+)(\{[^}]*\})?", prose(page)):
            if name not in served:
                wrong.append(f"{page.name}: {name}")
            for label in re.findall(r"(\w+)\s*[!=]~?", selector):
                if label not in served.get(name, set()):
                    wrong.append(f"{page.name}: {name} has no label {label!r}")
    assert not wrong, "metrics the pages name that are not served: " + ", ".join(wrong)
    doc = " ".join((tensorwire.metrics.__doc__ or "").split())
    listed: dict[str, set[str]] = {}
    for names, labels in re.findall(r"- ((?:``tensorwire_\w+``(?: and )?)+) \{([^}]*)\}", doc):
        for name in re.findall(r"``(tensorwire_\w+)``", names):
            listed[name] = {label.strip() for label in labels.split(",")}
    families = {n: ls for n, ls in served.items() if not n.endswith(("_bucket", "_sum", "_count"))}
    assert listed == families, "tensorwire.metrics' docstring lists other metrics or labels than it serves"


def test_the_idle_cpu_checks_the_readme_names_are_the_tests_there_are() -> None:
    """The README says which transports' tests hold two idle nodes under 5% of a core: it said
    every transport's did, where only tcp's and ucx's call ``idle_cpu_percent``."""
    from tensorwire.transports import KNOWN

    called = {
        name
        for path in (ROOT / "tests").rglob("test_*.py")
        for name in re.findall(r"idle_cpu_percent\(\s*[\"'](\w+)[\"']", path.read_text())
    }
    assert called, "no test calls idle_cpu_percent any more"
    tested, untested = sorted(called), sorted(set(KNOWN) - called)
    phrase = f"the {' and '.join(tested)} tests assert under 5% of a core"
    if untested:
        phrase += f"; {' and '.join(untested)} have no such test"
    assert phrase in prose(README), f"README should say {phrase!r}"


def test_benchmark_flags_the_pages_use_exist() -> None:
    used: dict[str, set[str]] = {}
    for page in PAGES:
        for span in spans(page) + [b.text for b in blocks(page)]:
            for line in span.splitlines():
                for name, args in re.findall(r"\b(\w+)\.py((?:\s+(?:--?[\w-]+|[^\s`#-][^\s`]*))*)", line):
                    if (ROOT / "benchmarks" / f"{name}.py").exists():
                        used.setdefault(name, set()).update(re.findall(r"(?<!\S)(--[a-z][\w-]*)", args))
    assert used.get("soak_ops") and used.get("pipeline"), used

    def source(name: str) -> str:
        """The script's text, and that of the shared parser where it builds its own on it."""
        text = (ROOT / "benchmarks" / f"{name}.py").read_text()
        if "make_parser(" in text:
            text += (ROOT / "benchmarks" / "_two_process.py").read_text()
        return text

    unknown = [
        f"benchmarks/{name}.py {flag}"
        for name, flags in sorted(used.items())
        for flag in sorted(flags)
        if f'"{flag}"' not in source(name)
    ]
    assert not unknown, "flags the pages pass that the benchmarks do not take: " + ", ".join(unknown)


def test_the_two_commands_are_what_ci_and_the_package_run() -> None:
    first, second = (b.text.strip() for b in blocks(README) if b.heading == "Two commands" and b.lang == "bash")
    assert first.endswith(".venv/bin/tensorwire demo")
    assert 'tensorwire = "tensorwire._entry:main"' in (ROOT / "pyproject.toml").read_text()
    assert second in (ROOT / ".ci" / "run").read_text(), "CI no longer runs the README's test command verbatim"


# -- the command line ------------------------------------------------------------------------------
def _help(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as done:
        cli_main([*argv, "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


def _flags(text: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])(--[a-z][\w-]*)", text)) - {"--help"}


def _usage_entries() -> dict[str, str]:
    """The README's command-line block: each subcommand's usage and description text."""
    usage = block(README, "Command line", "tensorwire demo").text
    entries: dict[str, str] = {}
    current = ""
    for line in usage.splitlines():
        if line.startswith("tensorwire "):
            current = line.split()[1]
            entries[current] = ""
        entries[current] += line + "\n"
    return entries


def test_readme_command_line_block_is_the_parsers(capsys: pytest.CaptureFixture[str]) -> None:
    entries = _usage_entries()
    checked = 0
    commands = re.search(r"\{([\w,-]+)\}", _help(capsys))
    assert commands is not None
    assert sorted(entries) == sorted(c for c in commands[1].split(",") if not c.startswith("_"))
    for command, entry in entries.items():
        text = _help(capsys, command)
        assert _flags(entry) == _flags(text), f"README's `tensorwire {command}` vs its --help"
        # "[--size-mib 256]", "[--sizes 4K,1M,64M]", "[--device cpu]" (not a metavar: "[--token T]")
        quoted = re.findall(r"\[(--[\w-]+) ([a-z0-9][^\s\]]*)\]", entry)
        options = {o.split()[0].rstrip(","): " ".join(o.split()) for o in re.split(r"\n  (?=-)", text)}
        for flag, default in quoted:
            assert f"(default {default})" in options.get(flag, ""), (
                f"README's `tensorwire {command}` gives {flag} the default {default}; its --help: {options.get(flag)}"
            )
        checked += len(quoted)
        if "[ADDRESS]" in entry:
            assert re.search(r"\[ADDRESS\]", text), f"{command}: no optional ADDRESS"
    assert checked >= 6, "the README's command-line block quotes fewer defaults than it did"


def test_command_lines_in_the_pages_use_real_flags(capsys: pytest.CaptureFixture[str]) -> None:
    helps: dict[str, str] = {}
    seen = 0
    for page in PAGES:
        for b in blocks(page):
            if b.lang != "bash":
                continue
            for line in b.text.splitlines():
                m = re.search(r"(?:^|/|\s)tensorwire (\w+)(.*)", line.split("#")[0])
                if m is None:
                    continue
                seen += 1
                if m[1] not in helps:
                    helps[m[1]] = _help(capsys, m[1])
                assert _flags(m[2]) <= _flags(helps[m[1]]), f"{b}: {line.strip()}"
    assert seen >= 3


STAGE_PART = """
import numpy as np
from tensorwire.pipeline import FunctionPart

class Scale:
    def forward(self, x):
        return 2 * x, None
    def backward(self, ctx, grad):
        return 2 * grad

def build_part(rank, num_stages):
    return FunctionPart(Scale())
"""


async def test_serve_and_stage_print_where_they_serve_and_exit_143_on_sigterm(tmp_path: Path) -> None:
    (tmp_path / "part.py").write_text(STAGE_PART)
    said = prose(README)
    serve_line = re.search(r"`(tensorwire node <id> serving at [\d.:]+)`", said)
    stage_line = re.search(r"`(tensorwire stage serving at [\d.:]+)`", said)
    assert serve_line and stage_line
    page = ROOT / "docs" / "pipeline.md"
    prints = comment_of(block(page, "Start stages", "tensorwire stage --part "), "# prints:")
    assert prints.startswith("prints: "), prints

    def pattern(example: str) -> re.Pattern[str]:
        text = re.escape(example).replace(re.escape("<id>"), "[0-9a-f]+")
        return re.compile(re.sub(r"127\\\.0\\\.0\\\.1:\d+", r"127\\.0\\.0\\.1:\\d+", text))

    cli = [sys.executable, "-m", "tensorwire.cli"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    runs = {
        "serve": ([*cli, "serve", "--transports", "tcp"], pattern(serve_line[1])),
        "stage": ([*cli, "stage", "--part", f"{tmp_path / 'part.py'}:build_part", "--transports", "tcp"],
                  pattern(stage_line[1])),
    }  # fmt: skip
    procs = {
        name: await asyncio.create_subprocess_exec(*argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        for name, (argv, _) in runs.items()
    }
    try:
        for name, proc in procs.items():
            assert proc.stdout is not None
            async with asyncio.timeout(60):
                first = (await proc.stdout.readline()).decode().strip()
            assert runs[name][1].fullmatch(first), f"{name} printed {first!r}"
            if name == "stage":  # docs/pipeline.md's, for the --address it shows
                assert first.rsplit(" ", 1)[0] == prints.removeprefix("prints: ").rsplit(" ", 1)[0], prints
            proc.send_signal(signal.SIGTERM)
        for name, proc in procs.items():
            _, err = await asyncio.wait_for(proc.communicate(), 30)
            assert b"Traceback" not in err, f"{name}: {err.decode()}"
        stage = procs["stage"]  # serve's exit on SIGTERM is tests/test_cli.py's
        assert stage.returncode == 128 + signal.SIGTERM, stage.returncode
    finally:
        for proc in procs.values():
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


def test_helpers_find_what_they_should() -> None:
    # the pattern helpers the tests above compare with: a wrong one would pass anything
    assert ellipsis_pattern("tcp [x ...] (y); ...").fullmatch("tcp [x 1.2:3] (y); not z: w")
    assert not ellipsis_pattern("tcp [x ...] (y)").fullmatch("ucx [x 1] (y)")
    fake = Block(README, 1, "python", "h", "print(a)  # one\n          # two\nb = 1  # not this\n")
    assert comment_of(fake, "print(a)") == "one two"
    assert _flags("[--size-mib 256] [--parent PID] --x") == {"--size-mib", "--parent", "--x"}


def test_the_public_names_the_pages_mention_work_after_a_bare_import() -> None:
    """`tensorwire.transports.ucx.ucx_config(TLS="tcp")` (README, docs/ucx.md) and
    `tensorwire.testing.idle_cpu_percent` raised AttributeError after `import tensorwire` in a
    fresh process: those packages loaded only when something else had imported them."""
    named = sorted(
        {
            name
            for page in PAGES
            for name in re.findall(r"(?<![\w/.-])tensorwire(?:\.[A-Za-z_]\w*)+", page.read_text())
            if not name.startswith("tensorwire.v1.") and not any(p.startswith("_") for p in name.split("."))
        }
    )
    assert {"tensorwire.transports.ucx.ucx_config", "tensorwire.testing.idle_cpu_percent"} <= set(named)
    code = (
        "import functools, sys, tensorwire\n"
        "bad = []\n"
        "for name in sys.argv[1:]:\n"
        "    try:\n"
        "        functools.reduce(getattr, name.split('.')[1:], tensorwire)\n"
        "    except AttributeError as exc:\n"
        "        bad.append(f'{name}: {exc}')\n"
        "print('\\n'.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code, *named], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", "after `import tensorwire` these do not resolve:\n" + out.stdout
