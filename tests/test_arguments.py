"""A call of the API with arguments it does not take (an unknown option, a typo of one, a
positional argument too many) raises ArgumentError, from the error tree: a ConfigurationError
that names the valid options and the nearest one, and, as Python's own error for such a call
is, a TypeError. The dataclasses' generated ``__init__`` raised a bare TypeError, as did
``Node.connect``, ``Stage``, ``Pipeline.connect`` and the rest, while ``start(bogus=1)`` gave a
ConfigurationError. Wrong kinds of values given to the pipeline's entry points are refused where
they are given, not later on a stage."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import tensorwire
from tensorwire import ArgumentError, ConfigurationError, Limits, NodeConfig, TLSConfig, metrics, pipeline
from tensorwire._checks import check_arguments
from tensorwire.rpc import CallLimits
from tensorwire.testing import connected_pair

pytestmark = pytest.mark.timeout(60)


class _Layer:
    def forward(self, x: Any) -> tuple[Any, None]:
        return x, None

    def backward(self, ctx: Any, grad: Any) -> Any:
        return grad


# (what is called, how, the option misspelt in it, the valid option the error should suggest)
UNKNOWN: list[tuple[str, Callable[[], object], str, str]] = [
    ("NodeConfig", lambda: NodeConfig(lease_second=1.0), "lease_second", "lease_seconds"),
    ("Limits", lambda: Limits(max_unexpcted=4), "max_unexpcted", "max_unexpected"),
    ("TLSConfig", lambda: TLSConfig(cafile="ca.pem"), "cafile", "ca_file"),
    ("CallLimits", lambda: CallLimits(max_concurent=2), "max_concurent", "max_concurrent"),
    ("start", lambda: tensorwire.start(transport=("tcp",)), "transport", "transports"),
    ("make_schedule", lambda: pipeline.make_schedule("gpipe", 2, 2, forwards_only=1), "forwards_only", "forward_only"),
    ("FunctionPart", lambda: pipeline.FunctionPart(_Layer(), los=None), "los", "loss"),
    ("split", lambda: pipeline.split(np.ones(4), microbatch=2), "microbatch", "microbatches"),
    ("metrics.serve", lambda: metrics.serve(adress="127.0.0.1:0"), "adress", "address"),
]


@pytest.mark.parametrize(("what", "call", "given", "meant"), UNKNOWN, ids=[u[0] for u in UNKNOWN])
def test_an_unknown_option_is_an_argument_error_that_lists_the_options(
    what: str, call: Callable[[], object], given: str, meant: str
) -> None:
    with pytest.raises(ArgumentError) as info:
        call()
    err = info.value
    assert isinstance(err, ConfigurationError) and isinstance(err, TypeError)  # `except TypeError` still works
    text = str(err)
    assert f"has no option {given!r} (did you mean {meant!r}?)" in text, text
    assert meant in text.partition("its options are: ")[2], text


def test_the_error_lists_every_valid_field() -> None:
    with pytest.raises(ArgumentError, match="has no option 'bogus'; its options are: ") as info:
        NodeConfig(bogus=1)  # type: ignore[call-arg]
    listed = str(info.value).partition("its options are: ")[2].split(", ")
    assert listed == [
        "transports",
        "auth_token",
        "limits",
        "connect_timeout",
        "lease_seconds",
        "checksum",
        "tls",
        "node_id",
        "ucx_options",
        "goodbye_seconds",
    ]
    with pytest.raises(ArgumentError, match=r"'bogus'; its options are: cert_file, key_file, ca_file, require"):
        TLSConfig(bogus=1)  # type: ignore[call-arg]
    with pytest.raises(ArgumentError, match=r"start\(\) has no option 'bogus'; its options are: transports, "):
        tensorwire.start(bogus=1)


TOO_MANY: list[tuple[str, Callable[[], object]]] = [
    ("NodeConfig", lambda: NodeConfig(*range(11))),  # type: ignore[arg-type]
    ("Limits", lambda: Limits(*range(8))),  # type: ignore[arg-type]
    ("TLSConfig", lambda: TLSConfig(None, None, None, False, None, None)),  # type: ignore[call-arg]
    ("start", lambda: tensorwire.start("127.0.0.1:0", ("tcp",))),  # type: ignore[misc]
    ("split", lambda: pipeline.split(np.ones(4), 2, 0)),  # type: ignore[call-arg]
]


@pytest.mark.parametrize(("what", "call"), TOO_MANY, ids=[t[0] for t in TOO_MANY])
def test_a_positional_argument_too_many_is_an_argument_error_that_shows_the_signature(
    what: str, call: Callable[[], object]
) -> None:
    with pytest.raises(ArgumentError, match=rf"^{what}\(\): too many positional arguments; it takes {what}\("):
        call()


async def test_the_node_and_pipeline_entry_points_say_what_they_take() -> None:
    async with connected_pair("tcp") as (a, _b):
        node = a.node
        no_timeout = (
            r"Node.connect\(\) has no option 'timeout' \(did you mean 'connect_timeout'\?\); its options are: add"
        )
        with pytest.raises(ArgumentError, match=no_timeout):
            await node.connect(_b.node.address, timeout=1)  # type: ignore[call-arg]
        with pytest.raises(ArgumentError, match=r"Node.connect\(\): too many positional .* Node.connect\(address, \*"):
            await node.connect(_b.node.address, "tcp")  # type: ignore[misc]
        with pytest.raises(ArgumentError, match=r"'max_args_bytes' \(did you mean 'max_arg_bytes'\?\)"):
            node.method("m", max_args_bytes=1)  # type: ignore[call-arg]
        with pytest.raises(ArgumentError, match=r"Node.expose\(\): too many positional arguments"):
            node.expose(np.ones(3), "x")  # type: ignore[misc]
        with pytest.raises(ArgumentError, match=r"Stage\(\) has no option 'bulid' \(did you mean 'build'\?\)"):
            pipeline.Stage(node, bulid=lambda rank, n: _Layer())  # type: ignore[call-arg]
        with pytest.raises(ArgumentError, match=r"Stage\(\): missing a required argument: 'node'"):
            pipeline.Stage()  # type: ignore[call-arg]
        with pytest.raises(ArgumentError, match=r"'connect_timout' \(did you mean 'connect_timeout'\?\)"):
            await pipeline.Pipeline.connect(node, [_b.node.address], connect_timout=1)  # type: ignore[call-arg]
        assert not node.methods  # nothing was registered by the refused Stage
    with pytest.raises(ArgumentError, match=r"start\(\) has no option 'bogus'"):
        async with connected_pair("tcp", bogus=1):
            pass


async def test_the_pipeline_refuses_values_of_the_wrong_kind_where_they_are_given() -> None:
    """``build=5`` was taken and failed at the driver's connect as the stage's RemoteError
    (TypeError: 'int' object is not callable), as did ``connect_timeout="x"``; ``offload="no"``
    switched offloading on; ``loss=5`` failed on the last stage's first backward;
    ``transports="tcp"`` asked for transports 't', 'c' and 'p'."""
    async with connected_pair("tcp") as (a, b):
        node = a.node
        with pytest.raises(ConfigurationError, match="build= is a function build"):
            pipeline.Stage(node, build=5)  # type: ignore[arg-type]
        with pytest.raises(ConfigurationError, match="offload must be True or False, not 'no'"):
            pipeline.Stage(node, _Layer(), offload="no")  # type: ignore[arg-type]
        with pytest.raises(ConfigurationError, match="loss= is a function"):
            pipeline.Stage(node, _Layer(), loss=5)  # type: ignore[arg-type]
        with pytest.raises(ConfigurationError, match="loss= is a function"):
            pipeline.FunctionPart(_Layer(), loss="mse")  # type: ignore[arg-type]
        assert not node.methods
        async with pipeline.Stage(b.node, _Layer()):
            with pytest.raises(ConfigurationError, match="connect_timeout must be a number of seconds"):
                await pipeline.Pipeline.connect(node, [b.node.address], connect_timeout="x")  # type: ignore[arg-type]
            with pytest.raises(ConfigurationError, match="transports is a sequence of names"):
                await pipeline.Pipeline.connect(node, [b.node.address], transports="tcp")
            async with await pipeline.Pipeline.connect(node, [b.node.address]) as pipe:
                with pytest.raises(ArgumentError, match=r"'microbatch' \(did you mean 'microbatches'\?\)"):
                    await pipe.forward(np.ones((4, 2)), microbatch=2)  # type: ignore[call-arg]
                out = await pipe.forward(np.ones((4, 2)), microbatches=2)  # the pipeline is unharmed
                assert np.array_equal(out, np.ones((4, 2)))


async def test_the_peers_lookup_and_batch_verbs_and_unexpose_say_what_they_take() -> None:
    """These raised Python's bare TypeError ("got an unexpected keyword argument"), and
    ``node.unexpose(None)`` a HandleNotFound ("None is not exposed"). (send, recv, read, write
    and their ``*_with_receipt`` twins are not wrapped: the check's coroutine frame costs about
    0.6 us a call, 3.1% of an 8-byte inproc round trip; see the next test.)"""
    async with connected_pair("tcp") as (a, b):
        b.node.expose(np.zeros((4, 2)), name="t")
        h = await a.lookup("t")
        misfits: list[tuple[str, Callable[[], Any]]] = [
            (r"Peer.lookup\(\) has no option 'nmae' \(did you mean 'name'\?\)", lambda: a.lookup(nmae="t")),
            (r"Peer.read_many\(\) has no option 'out' \(did you mean 'outs'\?\)", lambda: a.read_many([h], out=[])),
            (r"Peer.read_many_with_receipt\(\): too many positional", lambda: a.read_many_with_receipt([h], None)),
            (r"Peer.write_many\(\): missing a required argument: 'srcs'", lambda: a.write_many([h])),
        ]  # fmt: skip
        for said, call in misfits:
            with pytest.raises(ArgumentError, match=said):
                await call()
        with pytest.raises(ArgumentError, match=r"Node.unexpose\(\) has no option 'nmae'"):
            b.node.unexpose(nmae="t")  # type: ignore[call-arg]
        for name in (None, 5, b"t"):
            with pytest.raises(ConfigurationError, match="unexpose takes the name a tensor was exposed under, not "):
                b.node.unexpose(name)  # type: ignore[arg-type]
        assert np.array_equal(await a.read(h), np.zeros((4, 2)))  # nothing was unexposed
        await b.node.unexpose("t")


@pytest.mark.parametrize("transport", ["tcp", "inproc"])
async def test_the_per_message_verbs_refuse_a_misspelt_option_before_anything_moves(transport: str) -> None:
    """send, recv, read, write and their ``*_with_receipt`` twins raised Python's bare TypeError
    for a misspelt option (check_arguments' frame was too dear there): they catch it in a
    hidden ``**_misspelt`` and raise check_arguments' ArgumentError before anything is sent,
    queued, read or written, so the calls after it go as if it had not been made; their
    signatures (``help``, ``inspect.signature``) show only the options they take. So do a
    misspelt required argument (``scr=`` for ``src``) and a missing one, which were still the
    bare TypeError: Python refused the call before the body could look at ``**_misspelt``."""
    ones = np.ones((4, 2))
    async with connected_pair(transport) as (a, b):
        b.node.expose(np.zeros((4, 2)), name="t")
        h = await a.lookup("t")
        misfits: list[tuple[str, Callable[[], Any]]] = [
            (r"send\(\) has no option 'deadlien'; its options are: obj, tag$", lambda: a.send(ones, tag=1, deadlien=3)),
            (r"send\(\) has no option 'tga' \(did you mean 'tag'\?\)", lambda: a.send(ones, tga=1)),
            (r"recv\(\) has no option 'out_' \(did you mean 'out'\?\)", lambda: b.recv(tag=1, out_=np.empty(2))),
            (r"recv_with_receipt\(\) has no option 'devcie' \(did you mean 'device'\?\)",
             lambda: b.recv_with_receipt(tag=1, devcie="cpu")),
            (r"read\(\) has no option 'outt' \(did you mean 'out'\?\)", lambda: a.read(h, outt=np.empty((4, 2)))),
            (r"read_with_receipt\(\) has no option 'tag'; its options are: handle, out, device",
             lambda: a.read_with_receipt(h, tag=1)),
            (r"write\(\) has no option 'sync'; its options are: handle, src", lambda: a.write(h, ones, sync=True)),
            # a misspelt or missing required argument: Python's "missing 1 required positional
            # argument" came before the body could look at ``**_misspelt``
            (r"send\(\) has no option 'ojb' \(did you mean 'obj'\?\)", lambda: a.send(ojb=ones, tag=1)),
            (r"send\(\): missing a required argument: 'obj'; it takes Peer.send\(obj, \*, tag=0\)$",
             lambda: a.send(tag=1)),
            (r"read\(\) has no option 'hadnle' \(did you mean 'handle'\?\)", lambda: a.read(hadnle=h)),
            (r"read\(\): missing a required argument: 'handle'", lambda: a.read(out=np.empty((4, 2)))),
            (r"read_with_receipt\(\) has no option 'handel' \(did you mean 'handle'\?\)",
             lambda: a.read_with_receipt(handel=h)),
            (r"read_with_receipt\(\): missing a required argument: 'handle'", lambda: a.read_with_receipt()),
            (r"write\(\) has no option 'scr' \(did you mean 'src'\?\); its options are: handle, src$",
             lambda: a.write(h, scr=ones)),
            (r"write\(\) has no option 'hnadle' \(did you mean 'handle'\?\)", lambda: a.write(hnadle=h, src=ones)),
            (r"write\(\): missing a required argument: 'src'; it takes Peer.write\(handle, src\)$",
             lambda: a.write(h)),
            (r"write\(\): missing a required argument: 'handle'", lambda: a.write(src=ones)),
        ]  # fmt: skip
        for said, call in misfits:
            with pytest.raises(ArgumentError, match=rf"^Peer\.{said}"):
                await call()
        async with asyncio.timeout(10):  # (a recv the bad one had queued would take the message)
            assert (await a.send(np.arange(2.0), tag=1)).nbytes == 16
            assert np.array_equal(await b.recv(tag=1), np.arange(2.0))  # not ``ones``: that was not sent
            assert np.array_equal(await a.read(h), np.zeros((4, 2)))  # and nothing was written
        for verb in (a.send, a.recv, a.recv_with_receipt, a.read, a.read_with_receipt, a.write):
            assert "_misspelt" not in str(inspect.signature(verb)), verb
        assert list(inspect.signature(a.send).parameters) == ["obj", "tag"]
        assert list(inspect.signature(tensorwire.Peer.write).parameters) == ["self", "handle", "src"]
        assert str(inspect.signature(a.write)).startswith("(handle: 'RemoteHandle', src: 'Any')")  # still required
        assert str(inspect.signature(a.read)).startswith("(handle: 'RemoteHandle', *, out: 'Any' = None")
        with pytest.raises(TypeError, match="positional"):  # (Python's, as before: not an option)
            await a.send(ones, 1)  # type: ignore[call-arg]


async def test_a_call_or_stream_without_a_method_name_is_an_argument_error() -> None:
    """``peer.call()``, ``stream()`` and their receipt twins with no method name raised Python's
    bare TypeError ("Peer.call() missing 1 required positional argument: 'name'"), not a
    TensorWireError as everything tensorwire raises is; their signatures still show ``name``
    required, and a call that names its method is served as before."""
    async with connected_pair("tcp") as (a, b):

        @b.node.method("echo")
        async def echo(x: int) -> int:
            return x

        said = r"\(\): missing a required argument: 'name'; it takes Peer\."
        with pytest.raises(ArgumentError, match=rf"^Peer\.call{said}call\(name, /, \*args, _deadline="):
            await a.call()  # type: ignore[call-arg]
        with pytest.raises(ArgumentError, match=rf"^Peer\.call_with_receipt{said}"):
            await a.call_with_receipt(_deadline=5)  # type: ignore[call-arg]
        with pytest.raises(ArgumentError, match=rf"^Peer\.stream{said}"):
            a.stream()  # type: ignore[call-arg]
        with pytest.raises(ArgumentError, match=rf"^Peer\.stream_with_receipts{said}"):
            a.stream_with_receipts()  # type: ignore[call-arg]
        for verb in ("call", "call_with_receipt", "stream", "stream_with_receipts"):
            name = inspect.signature(getattr(tensorwire.Peer, verb)).parameters["name"]
            assert name.default is inspect.Parameter.empty and name.kind is name.POSITIONAL_ONLY, verb
        async with asyncio.timeout(10):
            assert await a.call("echo", 3) == 3


def test_a_type_error_from_inside_a_call_that_fits_passes_unchanged() -> None:
    """Only a call whose arguments do not fit becomes an ArgumentError: a TypeError the body
    raises is the body's (a bug, or a deliberate one) and reaches the caller as it was."""

    @check_arguments
    def fails(x: int, *, y: int = 0) -> None:
        raise TypeError("from the body")

    with pytest.raises(TypeError, match=r"^from the body$") as info:
        fails(1, y=2)
    assert not isinstance(info.value, ArgumentError)
    with pytest.raises(ArgumentError, match=r"fails\(\): missing a required argument: 'x'; it takes .*fails\(x, \*"):
        fails()  # type: ignore[call-arg]


def test_the_checked_api_keeps_its_signatures_and_kinds() -> None:
    """help(), inspect and the README's signature check see the real parameters; a coroutine
    function stays one."""
    import inspect

    assert str(inspect.signature(NodeConfig)).startswith("(transports: 'tuple[str, ...]' = ")
    assert list(inspect.signature(tensorwire.Node.connect).parameters)[:2] == ["self", "address"]
    assert inspect.iscoroutinefunction(tensorwire.Node.connect)
    assert inspect.iscoroutinefunction(pipeline.Pipeline.connect)
    assert inspect.iscoroutinefunction(pipeline.Pipeline.step)
    assert NodeConfig(lease_seconds=2.0).lease_seconds == 2.0 and Limits(8192).recv_buffer_bytes == 8192


@pytest.mark.parametrize("transport", ["tcp", "inproc"])
async def test_tags_past_64_bits_and_a_name_exposed_now_are_refused_as_the_readme_says(transport: str) -> None:
    """README (Tags, One-sided): an int tag is 64 bits, -2**63 to 2**63 - 1, and any other is
    a ConfigurationError before anything moves (the README named ints and strings only); a
    name is exposed again only after ``unexpose`` (``expose`` of a name exposed now is a
    ConfigurationError), which is what invalidates the old handles."""
    async with connected_pair(transport) as (a, b):
        for tag in (-(2**63), 2**63 - 1):
            await a.send(np.arange(2), tag=tag)
            np.testing.assert_array_equal(await b.recv(tag=tag), np.arange(2))
        for tag in (-(2**63) - 1, 2**63):
            with pytest.raises(ConfigurationError, match="does not fit in 64 bits"):
                await a.send(np.arange(2), tag=tag)
            with pytest.raises(ConfigurationError, match="does not fit in 64 bits"):
                await b.recv(tag=tag)
        kv = np.zeros(4)
        b.node.expose(kv, name="kv")
        old = await a.lookup("kv")
        with pytest.raises(ConfigurationError, match="already exposed; unexpose it first"):
            b.node.expose(kv, name="kv")
        await b.node.unexpose("kv")
        b.node.expose(kv, name="kv")
        with pytest.raises(tensorwire.HandleNotFound):
            await a.read(old)
        np.testing.assert_array_equal(await a.read(await a.lookup("kv")), kv)
