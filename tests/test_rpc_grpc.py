"""A stock gRPC client lists a node's methods and invokes scalar ones.

The client runs in another process with stubs generated here by grpc_tools.protoc from
proto/tensorwire/v1/control.proto; it never imports tensorwire.
"""

from __future__ import annotations

import asyncio
import gc
import json
import shutil
import sys
import uuid
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _polling import awhile, live_frames

import tensorwire

ROOT = Path(__file__).resolve().parent.parent

CLIENT = r"""
import json, sys
import grpc
import control_pb2 as pb, control_pb2_grpc as pb_grpc

def value(v):
    kind = v.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "list_value":
        return [value(x) for x in v.list_value.items]
    if kind == "map_value":
        return {k: value(x) for k, x in v.map_value.entries.items()}
    if kind == "bytes_value":
        return {"bytes": v.bytes_value.hex()}
    return getattr(v, kind)

out = {}
token = sys.argv[2] if len(sys.argv) > 2 else None
metadata = [("authorization", "Bearer " + token)] if token else None
with grpc.insecure_channel(sys.argv[1]) as channel:
    stub = pb_grpc.ControlStub(channel)
    try:
        listed = stub.ListMethods(pb.ListMethodsRequest(), timeout=5, metadata=metadata)
        out["methods"] = {m.name: [m.signature, m.streaming, m.doc, m.max_arg_bytes] for m in listed.methods}
    except grpc.RpcError as exc:
        out["methods"] = exc.code().name

    def invoke(key, method, *args, timeout=5, **kwargs):
        req = pb.InvokeRequest(method=method, args=list(args))
        for k, v in kwargs.items():
            req.kwargs[k].CopyFrom(v)
        try:
            out[key] = {"result": value(stub.Invoke(req, timeout=timeout, metadata=metadata).result)}
        except grpc.RpcError as exc:
            trailing = dict(exc.trailing_metadata() or ())
            out[key] = {
                "code": exc.code().name,
                "details": exc.details(),
                "type": trailing.get("tensorwire-remote-type"),
                "traceback": (trailing.get("tensorwire-traceback-bin") or b"").decode(),
            }

    V = pb.Value
    invoke("add", "add", V(int_value=2), V(int_value=3))
    invoke("add_kw", "add", V(int_value=2**40), b=V(int_value=-1))
    invoke(
        "describe", "describe", V(str_value="x"),
        dims=V(list_value=pb.ValueList(items=[V(int_value=1), V(float_value=2.5), V(bool_value=True), V()])),
        blob=V(bytes_value=b"\x00\xff"),
    )
    invoke("fail", "fail", V(str_value="bad input"))
    invoke("boom", "boom")
    invoke("nope", "nope")
    invoke("wrong_args", "add", V(int_value=1), V(int_value=2), V(int_value=3))
    invoke("slow", "slow", V(float_value=30.0), timeout=0.3)
    invoke("tensor", "tensor")
    invoke("stream", "count", V(int_value=3))
    invoke("selfcancel", "selfcancel", timeout=10)
    invoke("surrogate", "surrogate")
    invoke("halt", "halt")
    invoke("relay", "relay")
assert "tensorwire" not in sys.modules
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def stubs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    protoc = pytest.importorskip("grpc_tools.protoc")
    import grpc_tools

    src = tmp_path_factory.mktemp("proto")
    out = tmp_path_factory.mktemp("stubs")
    # at the top of its own include path, so the generated modules are plain top-level ones and
    # nothing in them is named tensorwire
    shutil.copy(ROOT / "proto" / "tensorwire" / "v1" / "control.proto", src / "control.proto")
    include = Path(grpc_tools.__file__).parent / "_proto"
    rc = protoc.main(
        ["protoc", f"-I{src}", f"-I{include}", f"--python_out={out}", f"--grpc_python_out={out}", "control.proto"]
    )
    assert rc == 0, "protoc failed"
    (out / "client.py").write_text(CLIENT)
    return out


async def _stock_client(stubs: Path, address: str, *extra: str) -> dict[str, Any]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-E",  # PYTHON* variables ignored; the generated stubs sit next to the script
        str(stubs / "client.py"),
        address,
        *extra,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=stubs,
    )
    stdout, stderr = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, stderr.decode()
    result: dict[str, Any] = json.loads(stdout)
    return result


class _Halt(BaseException):
    """Neither an Exception nor a cancellation: a framework's "abort this request", say."""


def _register(node: tensorwire.Node) -> dict[str, list[str]]:
    seen: dict[str, list[str]] = {"cancelled": []}

    @node.method()
    async def add(a: int, b: int = 0) -> int:
        """Adds two integers.

        Longer text that ListMethods leaves out."""
        return a + b

    @node.method()
    async def describe(name: str, dims: list[Any], blob: bytes = b"") -> dict[str, Any]:
        return {"name": name, "dims": dims, "n": len(dims), "blob": blob, "nothing": None}

    @node.method()
    async def fail(message: str) -> None:
        raise ValueError(message)

    @node.method()
    async def boom() -> None:
        raise RuntimeError("kaput")

    @node.method()
    async def slow(seconds: float) -> None:
        try:
            await asyncio.sleep(seconds)
        except asyncio.CancelledError:
            seen["cancelled"].append("slow")
            raise

    @node.method()
    async def tensor() -> np.ndarray:
        return np.ones(3)

    @node.method()
    async def count(n: int) -> Any:
        for i in range(n):
            yield i

    @node.method()
    async def selfcancel() -> None:
        """Awaits work that something else cancels: the CancelledError is the method's own."""
        work = asyncio.ensure_future(asyncio.sleep(30))
        asyncio.get_running_loop().call_later(0.05, work.cancel)
        await work

    @node.method()
    async def surrogate() -> None:
        raise ValueError("bad \udcff text")

    @node.method()
    async def halt() -> None:
        """Raises what a TaskGroup raises when a child raised a BaseException."""

        async def stop() -> None:
            raise _Halt("stop")

        async with asyncio.TaskGroup() as tg:
            tg.create_task(stop())

    return seen


@pytest.mark.multiprocess
async def test_stock_grpc_client_lists_and_invokes(stubs: Path) -> None:
    async with (
        tensorwire.start("127.0.0.1:0", transports=("tcp",)) as node,
        tensorwire.start("127.0.0.1:0", transports=("tcp",)) as other,
    ):
        seen = _register(node)
        peer = await other.connect(node.address)
        back = await node.accept()

        @node.method()
        async def relay() -> None:
            """Calls a method that the node at the other end does not have."""
            await back.call("not_there")

        out = await _stock_client(stubs, node.address)
        # tensorwire peers see the same methods and keep working alongside
        assert await peer.call("add", 40, b=2) == 42

    methods = out["methods"]
    assert sorted(methods) == "add boom count describe fail halt relay selfcancel slow surrogate tensor".split()
    assert methods["add"][:3] == ["(a: int, b: int = 0)", False, "Adds two integers."]
    assert methods["count"][1] is True and methods["add"][3] > 0
    assert out["add"] == {"result": 5}
    assert out["add_kw"] == {"result": 2**40 - 1}
    assert out["describe"] == {
        "result": {"name": "x", "dims": [1, 2.5, True, None], "n": 4, "blob": {"bytes": "00ff"}, "nothing": None}
    }
    fail = out["fail"]
    assert fail["code"] == "INVALID_ARGUMENT" and fail["details"] == "ValueError: bad input"
    assert fail["type"] == "ValueError" and "raise ValueError(message)" in fail["traceback"]
    boom = out["boom"]
    assert boom["code"] == "UNKNOWN" and boom["details"] == "RuntimeError: kaput" and boom["type"] == "RuntimeError"
    nope = out["nope"]
    assert nope["code"] == "UNIMPLEMENTED" and nope["type"] == "MethodNotFound" and "add" in nope["details"]
    wrong = out["wrong_args"]
    assert wrong["code"] == "INVALID_ARGUMENT" and wrong["type"] == "InvalidArguments" and "add" in wrong["details"]
    assert out["slow"]["code"] == "DEADLINE_EXCEEDED"
    assert seen["cancelled"] == ["slow"], "the gRPC deadline must cancel the method"
    assert out["tensor"]["code"] == "FAILED_PRECONDITION" and "ndarray" in out["tensor"]["details"]
    assert out["stream"]["code"] == "INVALID_ARGUMENT" and "streaming" in out["stream"]["details"]
    # a CancelledError of the method's own is an error like any (a status at once, not never)
    assert out["selfcancel"]["code"] == "UNKNOWN" and out["selfcancel"]["type"] == "CancelledError"
    # text that is not valid UTF-8 travels escaped
    surrogate = out["surrogate"]
    assert surrogate["code"] == "INVALID_ARGUMENT" and surrogate["details"] == "ValueError: bad \\udcff text"
    # a BaseException of the method's own gets a status at once, not the client's deadline
    halt = out["halt"]
    assert halt["code"] == "UNKNOWN" and halt["type"] == "BaseExceptionGroup" and "_Halt" in halt["traceback"], halt
    # the MethodNotFound of a call the method makes is the method's error: relay itself exists
    relay = out["relay"]
    assert relay["code"] == "UNKNOWN" and relay["type"] == "MethodNotFound", relay
    assert "not_there" in relay["details"] and "await back.call" in relay["traceback"], relay


@pytest.mark.multiprocess
async def test_stock_grpc_client_needs_the_token(stubs: Path) -> None:
    async with tensorwire.start("127.0.0.1:0", transports=("tcp",), auth_token="s3cret") as node:
        _register(node)
        denied = await _stock_client(stubs, node.address)
        allowed = await _stock_client(stubs, node.address, "s3cret")
    assert denied["methods"] == "UNAUTHENTICATED" and denied["add"]["code"] == "UNAUTHENTICATED"
    assert allowed["add"] == {"result": 5} and "add" in allowed["methods"]


@pytest.mark.parametrize("depth", [48, 49, 60])
def test_values_nest_only_as_deep_as_protobuf_decodes(depth: int) -> None:
    """value_to_pb claimed 64 levels, but protobuf's decoder stops at 100 message levels (two a
    level): a 60-deep result escaped as protobuf's DecodeError (an UNKNOWN status), not as the
    ValueError that makes Invoke answer FAILED_PRECONDITION with the reason."""
    from tensorwire.control._pb import control_pb2
    from tensorwire.rpc._grpc import value_from_pb, value_to_pb

    nested: Any = 1
    for _ in range(depth):
        nested = [nested]
    if depth > 48:
        with pytest.raises(ValueError, match="nested deeper than 48 levels"):
            value_to_pb(nested)
        return
    wire = control_pb2.InvokeResponse(result=value_to_pb(nested)).SerializeToString()
    assert value_from_pb(control_pb2.InvokeResponse.FromString(wire).result) == nested


def test_numpy_scalars_travel_to_grpc_clients_as_their_values() -> None:
    # a method returning x.sum() (np.float32, np.int64) answered FAILED_PRECONDITION: "int64
    # cannot travel over the control plane"
    from tensorwire.rpc._grpc import value_from_pb, value_to_pb

    result = {"sum": np.float32(1.5), "n": np.int64(-7), "ok": np.bool_(True), "rows": [np.uint8(3), np.float16(0.5)]}
    back = value_from_pb(value_to_pb(result))
    assert back == {"sum": 1.5, "n": -7, "ok": True, "rows": [3, 0.5]}
    assert [type(back[k]) for k in ("sum", "n", "ok")] == [float, int, bool]
    with pytest.raises(ValueError, match="does not fit in 64 bits"):
        value_to_pb(np.uint64(2**63))
    with pytest.raises(ValueError, match="complex64 cannot travel"):
        value_to_pb(np.complex64(1j))
    with pytest.raises(ValueError, match="ndarray cannot travel"):
        value_to_pb(np.array(1.0, np.float32))  # a 0-d array is a tensor, not a scalar


async def test_a_result_grpc_cannot_carry_is_no_argument_error() -> None:
    """A method whose result Invoke cannot carry (an int past 64 bits, a tensor) answered
    FAILED_PRECONDITION typed "InvalidArguments: big's result: ...", which README keeps for
    arguments that do not fit: the arguments were right and the method ran. It is typed as
    ``peer.call`` types a result that cannot be sent, UnsupportedTensorError, "could not be sent"."""
    import grpc

    from tensorwire.control._pb import control_pb2, control_pb2_grpc

    async with tensorwire.start("127.0.0.1:0", transports=("tcp",)) as node:
        ran: list[str] = []

        @node.method()
        async def big() -> int:
            ran.append("big")
            return 2**70

        @node.method()
        async def tensor() -> np.ndarray:
            ran.append("tensor")
            return np.ones(3)

        async with grpc.aio.insecure_channel(node.address) as ch:
            stub = control_pb2_grpc.ControlStub(ch)
            for name, why in (("big", "does not fit in 64 bits"), ("tensor", "ndarray cannot travel")):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.Invoke(control_pb2.InvokeRequest(method=name), timeout=10)
                err = info.value
                trailing = dict(err.trailing_metadata() or ())
                assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, err
                assert trailing.get("tensorwire-remote-type") == "UnsupportedTensorError", trailing
                details = err.details() or ""
                assert details.startswith(f"UnsupportedTensorError: {name}'s result could not be sent"), details
                assert why in details, details
            assert ran == ["big", "tensor"]


def _kept(marker: str) -> list[Any]:
    """The lists alive here whose first item is ``marker``, once the garbage is collected (a
    list takes no weak reference: an argument list decoded on the server is found this way)."""
    gc.collect()
    return [o for o in gc.get_objects() if type(o) is list and o and type(o[0]) is str and o[0] == marker]


@pytest.mark.parametrize("failure", ["method raises", "bad arguments", "no such method", "result cannot travel"])
async def test_a_failed_invoke_keeps_nothing_of_its_call(failure: str) -> None:
    """gRPC keeps the last call its server served, with the error of its abort, until its next
    call comes; that error's traceback held Invoke's frames (their locals: the request, the
    decoded arguments) and its context the exception the call failed with (through its traceback
    the method's own frames, and theirs). A failed Invoke with a large argument kept it, and
    whatever its method had made, for as long as the node served no other control call."""
    import grpc

    from tensorwire.control._pb import control_pb2, control_pb2_grpc
    from tensorwire.rpc._grpc import value_to_pb

    marker = f"an argument of a failed call {uuid.uuid4().hex}"
    async with tensorwire.start("127.0.0.1:0", transports=("tcp",)) as node:
        made: list[weakref.ref[np.ndarray]] = []

        @node.method()
        async def refuse(items: list[Any]) -> None:
            scratch = np.ones(len(items))  # (a local of the method's own frame)
            made.append(weakref.ref(scratch))
            raise ValueError(f"refused {len(items)} items")

        @node.method()
        async def tensor(items: list[Any]) -> np.ndarray:
            result = np.ones(len(items))
            made.append(weakref.ref(result))
            return result

        method, args, code = {
            "method raises": ("refuse", 1, grpc.StatusCode.INVALID_ARGUMENT),
            "bad arguments": ("refuse", 2, grpc.StatusCode.INVALID_ARGUMENT),
            "no such method": ("nothing", 1, grpc.StatusCode.UNIMPLEMENTED),
            "result cannot travel": ("tensor", 1, grpc.StatusCode.FAILED_PRECONDITION),
        }[failure]
        request = control_pb2.InvokeRequest(method=method, args=[value_to_pb([marker, *range(1000)])] * args)
        async with grpc.aio.insecure_channel(node.address) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await control_pb2_grpc.ControlStub(ch).Invoke(request, timeout=10)
            assert info.value.code() == code, info.value
            del info
        # (no control call comes after it: gRPC still holds the failed one. The handler, on this
        # loop too, may still be ending as the status reaches the client: its frames live until
        # it has; it is given a moment to, then looked at)
        frames = ("Invoke", "invoke", "_fail", "run_local")
        await awhile(lambda: not _kept(marker) and not live_frames(*frames), 5, pause=0.05)
        assert not _kept(marker), "a failed Invoke's arguments are kept after it"
        assert len(made) == (failure in ("method raises", "result cannot travel"))
        assert all(ref() is None for ref in made), "what the method of a failed Invoke made is kept after it"
        assert not live_frames(*frames), "a failed Invoke's frames are kept after it"
