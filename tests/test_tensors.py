"""The tensor adapter and message headers."""

import array
import asyncio
import importlib.util
import warnings

import ml_dtypes
import numpy as np
import pytest

import tensorwire
from tensorwire.tensors import DTYPES, as_view, decode_header, match_out, prepare, rebuild


def roundtrip(obj):
    msg = prepare(obj)
    tree, specs = decode_header(msg.header, max_message_bytes=1 << 40)
    arrays = [np.ascontiguousarray(a).copy() for a in msg.arrays]
    return rebuild(tree, specs, arrays), msg


@pytest.mark.parametrize("name", list(DTYPES))
def test_every_dtype_header_roundtrip(name: str) -> None:
    x = np.zeros((2, 3), dtype=DTYPES[name])
    got, msg = roundtrip(x)
    assert got.dtype == x.dtype and got.shape == (2, 3)
    assert msg.specs[0].dtype == name


def test_buffer_protocol_and_dlpack() -> None:
    v = as_view(bytearray(b"abc"))
    assert v.dtype == "uint8" and v.shape == (3,)
    v = as_view(array.array("f", [1.0, 2.0]))
    assert v.dtype == "float32"
    v = as_view(memoryview(np.arange(6, dtype=np.int16).reshape(2, 3)))
    assert v.shape == (2, 3) and v.dtype == "int16"

    class DL:
        def __init__(self) -> None:
            self.a = np.arange(4.0)

        def __dlpack__(self, **kw):
            return self.a.__dlpack__(**kw)

        def __dlpack_device__(self):
            return self.a.__dlpack_device__()

    assert as_view(DL()).shape == (4,)
    assert as_view(np.float32(3.0)).shape == ()


def test_unsupported_objects_get_clear_errors() -> None:
    with pytest.raises(tensorwire.UnsupportedTensorError, match="object"):
        prepare({"x": object()})
    with pytest.raises(tensorwire.UnsupportedTensorError, match="dtype"):
        prepare(np.array(["a", "b"]))
    with pytest.raises(tensorwire.UnsupportedTensorError, match="big-endian"):
        prepare(np.arange(3, dtype=">i4"))
    with pytest.raises(tensorwire.UnsupportedTensorError, match="key"):
        prepare({(1, 2): np.arange(2)})

    class Cuda:
        @property
        def __cuda_array_interface__(self) -> dict:
            return {"shape": (1,), "typestr": "<f4", "data": (0, False), "version": 3}

    with pytest.raises(tensorwire.UnsupportedTensorError, match="CUDA"):
        prepare(Cuda())
    deep: list = []
    for _ in range(100):
        deep = [deep]
    with pytest.raises(tensorwire.UnsupportedTensorError, match="deeper"):
        prepare(deep)


class _DLPackOnly:
    """An object of some library that offers nothing but DLPack, on device type ``kind``."""

    def __init__(self, kind: int) -> None:
        self.kind = kind

    def __dlpack__(self, **kw: object) -> object:
        raise AssertionError("imported without a CUDA device to import it to")

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.kind, 0


@pytest.mark.parametrize("kind", [2, 13], ids=["kDLCUDA", "kDLCUDAManaged"])
def test_dlpack_only_cuda_memory_without_a_device_says_so(kind: int) -> None:
    # on a GPU it is imported through CuPy (tests/gpu/test_cuda_p2p.py); here nothing can hold it
    with pytest.raises(tensorwire.UnsupportedTensorError, match=r"_DLPackOnly is CUDA memory \(DLPack\)"):
        prepare({"x": _DLPackOnly(kind)})


def test_dlpack_only_pinned_host_memory_is_refused_with_what_to_send() -> None:
    with pytest.raises(tensorwire.UnsupportedTensorError, match="page-locked host memory offered only through"):
        prepare(_DLPackOnly(3))


def test_non_contiguous_is_packed_and_strides_describe_wire() -> None:
    x = np.arange(12.0).reshape(3, 4).T
    msg = prepare(x)
    assert msg.packed and msg.arrays[0].flags.c_contiguous
    from tensorwire.control._pb import wire_pb2

    hdr = wire_pb2.MessageHeader.FromString(msg.header)
    assert list(hdr.tensors[0].shape) == [4, 3]
    assert list(hdr.tensors[0].strides) == [3, 1]
    got, _ = roundtrip(x)
    assert np.array_equal(got, x)


def test_contiguous_send_is_zero_copy() -> None:
    x = np.arange(100, dtype=np.float32)
    msg = prepare({"x": x})
    assert not msg.packed
    assert np.shares_memory(msg.arrays[0], x)


def test_match_out() -> None:
    _, specs = decode_header(prepare({"a": np.zeros(3, np.int8)}).header, max_message_bytes=100)
    out = {"a": np.empty(3, np.int8)}
    assert np.shares_memory(match_out(out, specs)[0], out["a"])
    with pytest.raises(tensorwire.ShapeMismatchError):
        match_out({"a": np.empty(4, np.int8)}, specs)
    ro = np.empty(3, np.int8)
    ro.flags.writeable = False
    with pytest.raises(tensorwire.ShapeMismatchError, match="read-only"):
        match_out(ro, specs)


def test_header_limits() -> None:
    header = prepare(np.zeros(1000, np.float64)).header
    with pytest.raises(tensorwire.ProtocolError, match="limit"):
        decode_header(header, max_message_bytes=100)
    with pytest.raises(tensorwire.ProtocolError):
        decode_header(b"\xff\xff\xff", max_message_bytes=100)


def test_bfloat16_via_ml_dtypes() -> None:
    x = np.array([1.5, -2.0], dtype=ml_dtypes.bfloat16)
    got, msg = roundtrip(x)
    assert msg.specs[0].dtype == "bfloat16" and got.dtype == x.dtype


_FRESH_BF16 = """
import sys
import numpy as np
import tensorwire
from tensorwire.tensors import decode_header, prepare, rebuild
assert "ml_dtypes" not in sys.modules, "import tensorwire imported ml_dtypes"
header = bytes.fromhex(sys.argv[1])
tree, specs = decode_header(header, max_message_bytes=1 << 20)
(arr,) = [s.allocate() for s in specs]  # (as a receiver does)
arr.view(np.uint8).reshape(-1)[:] = np.frombuffer(bytes.fromhex(sys.argv[2]), np.uint8)
got = rebuild(tree, specs, [arr])
print(got.dtype, got.astype(np.float32).tolist())
msg = prepare(got)
print(msg.specs[0].dtype)
"""


def test_a_process_that_never_imported_ml_dtypes_receives_and_sends_bfloat16() -> None:
    """ml_dtypes (about 0.7 s to import) is imported on first need, not by ``import
    tensorwire``: a fresh process still decodes a bfloat16 tensor, rebuilds it as ml_dtypes'
    bfloat16, and names it again when it sends it on."""
    import subprocess
    import sys

    x = np.array([1.5, -2.0, 3.25], dtype=ml_dtypes.bfloat16)
    msg = prepare(x)
    data = np.ascontiguousarray(msg.arrays[0]).view(np.uint8).tobytes()
    out = subprocess.run(
        [sys.executable, "-c", _FRESH_BF16, bytes(msg.header).hex(), data.hex()],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["bfloat16 [1.5, -2.0, 3.25]", "bfloat16"]


def test_torch_tensors_roundtrip() -> None:
    torch = pytest.importorskip("torch")
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.complex64, torch.float16):
        t = torch.arange(6).reshape(2, 3).to(dtype)
        got, msg = roundtrip({"t": t, "nc": t.T})
        assert msg.specs[0].framework == "torch"
        assert isinstance(got["t"], torch.Tensor) and got["t"].dtype == dtype
        assert torch.equal(got["nc"], t.T.contiguous())


def test_torch_tensors_without_one_buffer_are_refused_clearly() -> None:
    """A nested tensor used to raise torch's own RuntimeError from ``.numpy()`` (a pipeline stage
    returning one hung the step); sparse ones, a TypeError."""
    torch = pytest.importorskip("torch")
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged)
    sparse = torch.eye(3).to_sparse()
    for t, what in ((nested, "nested"), (sparse, "sparse")):
        with pytest.raises(tensorwire.UnsupportedTensorError, match=what):
            prepare({"x": t})


# -- what a recv may not write into, and what cannot be read ---------------------------------------
def _specs(obj: object) -> list:
    return decode_header(prepare(obj).header, max_message_bytes=1 << 40)[1]


def _matrix(a: object) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PendingDeprecationWarning)  # numpy would rather it were not used
        return np.matrix(a)


def test_ndarray_subclasses_are_moved_as_plain_arrays_over_their_memory(tmp_path) -> None:
    """np.matrix keeps two dimensions through reshape(-1): its byte view was one row long to a
    socket (tcp sent a sixth of the message and lost the stream) and could not be assigned to
    (a recv into one broke the channel). Read as the plain ndarray over the same memory, it and
    other subclasses (np.memmap) are sent whole and received into."""
    m = _matrix(np.arange(6.0).reshape(2, 3))
    msg = prepare(m)
    assert type(msg.arrays[0]) is np.ndarray and np.shares_memory(msg.arrays[0], m)
    assert [len(s) for s in msg.segments()] == [48] and bytes(msg.segments()[0]) == np.asarray(m).tobytes()
    assert len(tensorwire.tensors.byte_view(m)) == 48  # the backstop, for arrays from elsewhere
    mm = np.memmap(tmp_path / "mm", dtype=np.float64, mode="w+", shape=(2, 3))
    for out in (_matrix(np.zeros((2, 3))), mm):
        (target,) = match_out(out, _specs(m))
        assert type(target) is np.ndarray and np.shares_memory(target, out)
        tensorwire.tensors.byte_view(target)[:] = np.asarray(m).tobytes()
        assert np.array_equal(np.asarray(out), np.asarray(m))


def test_masked_arrays_are_refused() -> None:
    masked = np.ma.masked_array([1.0, 2.0, 3.0], mask=[0, 1, 0])
    with pytest.raises(tensorwire.UnsupportedTensorError, match="mask"):
        prepare({"x": masked})
    with pytest.raises(tensorwire.UnsupportedTensorError, match="mask"):
        match_out(np.ma.masked_array(np.zeros(3)), _specs(np.zeros(3)))


def test_a_numpy_scalar_out_is_refused_as_immutable() -> None:
    """np.asarray(np.float64(0)) is a new 0-d array: bytes received into it were lost."""
    specs = _specs(np.float64(42.0))
    for out in (np.float64(0.0), [np.float64(0.0)]):
        with pytest.raises(tensorwire.UnsupportedTensorError, match=r"numpy scalar .*immutable"):
            match_out(out, specs)
    zero_d = np.zeros((), np.float64)
    assert np.shares_memory(match_out([zero_d], specs)[0], zero_d)  # what to pass instead
    assert not as_view(np.float64(1.0)).array.flags.writeable


@pytest.mark.parametrize("bit", ["conj", "neg"])
def test_a_torch_out_with_the_conj_or_neg_bit_is_refused(bit: str) -> None:
    """Such a view's values exist only once resolved into a copy: a recv wrote into the copy and
    returned the caller's tensor untouched. Sending one sends its values."""
    torch = pytest.importorskip("torch")
    base = torch.zeros(2, dtype=torch.complex64)
    out = base.conj() if bit == "conj" else base.conj().imag
    assert out.is_conj() if bit == "conj" else out.is_neg()
    dtype = "complex64" if bit == "conj" else "float32"
    specs = _specs(np.zeros(2, dtype))
    with pytest.raises(tensorwire.UnsupportedTensorError, match=f"torch's {bit} bit"):
        match_out(out, specs)
    with pytest.raises(tensorwire.UnsupportedTensorError, match=f"torch's {bit} bit"):
        match_out({"a": [out]}, specs)
    src = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    sent = src.conj() if bit == "conj" else src.conj().imag
    got, _ = roundtrip(sent)
    assert torch.equal(got, sent.resolve_conj().resolve_neg())


@pytest.mark.parametrize("bit", ["conj", "neg"])
def test_a_torch_view_with_the_conj_or_neg_bit_is_sent_from_a_copy_and_says_packed(bit: str) -> None:
    """Its values are sent from a copy tensorwire resolved (``resolve_conj``/``resolve_neg``),
    so a receipt says packed and not direct; it said neither, as if the caller's own memory
    had gone on the wire. A plain torch tensor still goes from its own memory."""
    torch = pytest.importorskip("torch")
    base = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    view = base.conj() if bit == "conj" else base.conj().imag
    arr, copied = as_view(view).wire_array()
    assert copied and not np.shares_memory(arr, base.numpy())
    assert prepare(view).packed and prepare({"x": [view]}).packed
    plain = torch.ones(2)
    arr, copied = as_view(plain).wire_array()
    assert not copied and np.shares_memory(arr, plain.numpy()) and not prepare(plain).packed


@pytest.mark.parametrize("transport", ["tcp", "inproc"])
async def test_a_numpy_scalar_is_sent_from_a_copy_and_says_packed(transport: str) -> None:
    """A numpy scalar has no memory of the caller's to send from: ``as_view`` makes a 0-d copy,
    so its send's receipt says packed and not direct (it said direct=True, packed=False). A 0-d
    array is still direct. (It may still be exposed, read-only: test_onesided.)"""
    from tensorwire.testing import connected_pair

    arr, copied = as_view(np.float32(2.5)).wire_array()
    assert copied and arr.shape == ()
    async with connected_pair(transport) as (a, b):
        said = await a.send(np.float32(2.5), tag=1)
        assert await b.recv(tag=1) == np.float32(2.5)
        assert said.packed and not said.direct, said
        said = await a.send(np.array(2.5, np.float32), tag=1)
        assert float(await b.recv(tag=1)) == 2.5
        assert said.direct and not said.packed, said


class _FailingProtocol:
    """An object whose DLPack or CUDA array interface property fails when looked at."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __getattr__(self, name: str) -> object:
        if name == self.name:
            raise RuntimeError(f"{name} is broken")
        raise AttributeError(name)


def _unreadable() -> list:
    import mmap

    closed = mmap.mmap(-1, 16)
    closed.close()
    released = memoryview(bytearray(16))
    released.release()
    return [
        pytest.param(closed, id="closed-mmap"),
        pytest.param(released, id="released-memoryview"),
        pytest.param(_FailingProtocol("__dlpack__"), id="failing-dlpack"),
        pytest.param(_FailingProtocol("__cuda_array_interface__"), id="failing-cuda-array-interface"),
    ]


@pytest.mark.parametrize("obj", _unreadable())
def test_unreadable_buffers_are_refused(obj: object) -> None:
    """A closed mmap or released memoryview raised ValueError from memoryview(); an object whose
    protocol property fails, its own error: both from prepare, and from a recv's match_out."""
    with pytest.raises(tensorwire.UnsupportedTensorError):
        prepare({"x": obj})
    with pytest.raises(tensorwire.UnsupportedTensorError):
        match_out([obj], _specs([np.zeros(2, np.uint8)]))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_torch_tensors_of_more_than_64_dimensions_are_refused(dtype: str) -> None:
    """numpy holds at most 64 dimensions: .numpy() raised a plain ValueError (and the bfloat16
    path nothing caught at all)."""
    torch = pytest.importorskip("torch")
    t = torch.zeros([1] * 65, dtype=getattr(torch, dtype))
    with pytest.raises(tensorwire.UnsupportedTensorError, match="65 dimensions"):
        prepare(t)
    with pytest.raises(tensorwire.UnsupportedTensorError, match="65 dimensions"):
        match_out(t, _specs(np.zeros([1] * 64)))
    assert prepare(torch.zeros([1] * 64, dtype=getattr(torch, dtype))).specs[0].shape == (1,) * 64


def test_out_leaves_that_share_memory_are_refused() -> None:
    """recv(out=[buf, buf]) returned the second tensor twice, the first lost."""
    specs = _specs([np.zeros(4), np.zeros(4)])
    buf = np.zeros(4)
    with pytest.raises(tensorwire.ShapeMismatchError, match="out= tensors 0 and 1 share memory"):
        match_out([buf, buf], specs)
    x = np.zeros(7)
    with pytest.raises(tensorwire.ShapeMismatchError, match="share memory"):
        match_out((x[3:], x[:4]), specs)  # overlapping by one element, in any order
    y = np.zeros(8)
    left, right = match_out([y[:4], y[4:]], specs)  # touching is not sharing
    assert np.shares_memory(left, y) and np.shares_memory(right, y)
    empty = np.zeros(0)
    assert len(match_out([empty, empty], _specs([empty, empty]))) == 2  # no bytes, nothing to share


def test_overlap_of_many_out_leaves_is_found_quickly() -> None:
    """Sorted by address, not compared pair by pair: 20000 leaves of one buffer check fast, and
    the one pair that overlaps is named."""
    n = 20_000
    buf = np.zeros(n + 1, np.int8)
    leaves = [buf[i : i + 1] for i in range(n)]
    specs = _specs([np.zeros(1, np.int8)] * n)
    assert len(match_out(leaves, specs)) == n
    leaves[n // 3] = buf[n // 2 : n // 2 + 1]  # the same byte as leaf n // 2
    with pytest.raises(tensorwire.ShapeMismatchError, match=f"out= tensors {n // 3} and {n // 2} share memory"):
        match_out(leaves, specs)


def _odd_outs() -> list:
    import ctypes
    import mmap

    class Pair(ctypes.Structure):
        _fields_ = [("a", ctypes.c_int32), ("b", ctypes.c_int32)]

    closed = mmap.mmap(-1, 32)
    closed.close()
    released = memoryview(bytearray(32))
    released.release()
    return [
        _matrix(np.zeros((1, 4))),
        np.ma.masked_array(np.zeros(4)),
        np.rec.array(np.zeros(4, dtype=[("a", "f8")])),
        np.char.array(["abcd"] * 4),
        np.broadcast_to(np.zeros(1), (4,)),
        np.zeros(4, ">f8"),
        np.zeros(4, object),
        np.float64(0.0),
        np.void(b"12345678"),
        (Pair * 4)(),
        (ctypes.c_double * 4)(),
        array.array("d", [0.0] * 4),
        bytearray(32),
        b"x" * 32,
        "text",
        None,
        {1, 2},
        closed,
        released,
        _FailingProtocol("__dlpack__"),
        _FailingProtocol("__cuda_array_interface__"),
        _DLPackOnly(3),
    ]


@pytest.mark.parametrize(
    "spec", [np.zeros(4), np.zeros(4, np.complex64), [np.zeros(4), np.zeros(4)]], ids=["float64", "complex64", "two"]
)
def test_match_out_raises_only_tensorwire_errors(spec: object) -> None:
    """A recv's out= is matched where the message arrives (a transport's reader): any error but
    ours used to reach it, and there broke the whole channel."""
    specs = _specs(spec)
    outs = _odd_outs()
    torch = pytest.importorskip("torch")
    base = torch.zeros(4, dtype=torch.complex64)
    outs += [
        base.conj(),
        base.conj().imag,
        torch.zeros([1] * 65),
        torch.zeros([1] * 65, dtype=torch.bfloat16),
        torch.eye(4).to_sparse(),
        torch.zeros(4, device="meta"),
        torch.zeros(1).expand(4),
        torch.zeros(4, dtype=torch.float8_e4m3fnuz),
    ]
    for odd in outs:
        for out in (odd, [odd, odd], {"a": odd}):
            try:
                match_out(out, specs)
            except tensorwire.TensorWireError:
                pass


def test_out_must_have_the_messages_structure_not_just_its_tensors() -> None:
    """Tensors matched by their place alone would let {"k": K, "v": V} land crosswise in
    out={"v": ..., "k": ...}; out= must have the message's containers, keys and tensor places."""
    k, v = np.arange(4.0), np.arange(4.0) + 10
    msg = prepare({"k": k, "v": v})
    tree, specs = decode_header(msg.header, max_message_bytes=1 << 30)
    bk, bv = np.empty(4), np.empty(4)
    landed = match_out({"k": bk, "v": bv}, specs, tree=tree)
    assert landed[0] is bk and landed[1] is bv
    bad = [
        ({"v": bv, "k": bk}, "keys"),
        ({"k": bk, "w": bv}, "keys"),
        ([bk, bv], "a list where the message has a dict"),
        ({"k": bk, "v": [bv]}, r"out=\['v'\] is a list where the message has a tensor"),
        (bk, "a tensor where the message has a dict"),
    ]
    for out, match in bad:
        with pytest.raises(tensorwire.ShapeMismatchError, match=match):
            match_out(out, specs, tree=tree)
    tree1, specs1 = decode_header(prepare([k]).header, max_message_bytes=1 << 30)
    with pytest.raises(tensorwire.ShapeMismatchError, match="a tensor where the message has a list"):
        match_out(np.empty(4), specs1, tree=tree1)
    with pytest.raises(tensorwire.ShapeMismatchError, match="out= holds 2 items where the message's list has 1"):
        match_out([np.empty(4), np.empty(4)], specs1, tree=tree1)
    # a list may stand for a tuple, and the other way round (a method returning (a, b), _out=[x, y])
    tree3, specs3 = decode_header(prepare((k, v)).header, max_message_bytes=1 << 30)
    landed = match_out([bk, bv], specs3, tree=tree3)
    assert landed[0] is bk and landed[1] is bv
    # a scalar of the message faces any scalar of out=; a tensor never faces a scalar
    tree2, specs2 = decode_header(prepare({"x": k, "step": 12}).header, max_message_bytes=1 << 30)
    match_out({"x": bk, "step": None}, specs2, tree=tree2)
    with pytest.raises(tensorwire.ShapeMismatchError, match="a scalar where the message has a tensor"):
        match_out({"x": 0, "step": bk}, specs2, tree=tree2)


@pytest.mark.parametrize("transport", ["inproc", "tcp"])
async def test_a_recv_into_out_returns_out_or_the_messages_scalars_around_outs_tensors(transport: str) -> None:
    from tensorwire.testing import connected_pair

    async with connected_pair(transport) as (a, b):
        buf = np.empty(4)
        out = {"x": buf, "step": 0}
        await a.send({"x": np.arange(4.0), "step": 0}, tag=1)
        assert await b.recv(tag=1, out=out) is out  # nothing of the message's but out's tensors
        await a.send({"x": np.arange(4.0) + 1, "step": 12}, tag=1)
        got = await b.recv(tag=1, out=out)
        assert got == {"x": buf, "step": 12} and got["x"] is buf and np.array_equal(buf, np.arange(4.0) + 1)
        # posted before the message comes, and crosswise keys: refused, the message kept
        bk, bv = np.empty(4), np.empty(4)
        wrong = asyncio.ensure_future(b.recv(tag=2, out={"v": bv, "k": bk}))
        await asyncio.sleep(0.01)
        await a.send({"k": np.arange(4.0), "v": np.arange(4.0) + 10}, tag=2)
        with pytest.raises(tensorwire.ShapeMismatchError, match="keys"):
            await wrong
        right = await b.recv(tag=2, out={"k": bk, "v": bv})
        assert np.array_equal(right["k"], np.arange(4.0)) and np.array_equal(bv, np.arange(4.0) + 10)
        # a one-tensor list does not fit one array (over the express path of small messages too)
        single = asyncio.ensure_future(b.recv(tag=3, out=np.empty(4)))
        await asyncio.sleep(0.01)
        await a.send([np.arange(4.0)], tag=3)
        with pytest.raises(tensorwire.ShapeMismatchError, match="a tensor where the message has a list"):
            await single
        assert np.array_equal((await b.recv(tag=3, out=[bk]))[0], np.arange(4.0))


_UCX = pytest.param(
    "ucx", marks=pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="ucxx is not installed")
)


class _KeyWithoutEquality:
    """A dict key whose ``==`` answers with an array (its truth raises), as numpy's arrays do."""

    def __hash__(self) -> int:
        return 1

    def __eq__(self, other: object) -> bool:
        return np.array([True, False])  # type: ignore[return-value]

    def __repr__(self) -> str:
        return "K()"


@pytest.mark.parametrize("transport", ["inproc", "tcp", _UCX])
async def test_out_keys_match_the_messages_by_type_and_value_and_nan_by_nan(transport: str) -> None:
    """A dict out= keyed by NaN, or by keys of another type than the message's: out={nan: buf}
    was refused for a message keyed by NaN ("has the keys [nan] where the message has [nan]":
    NaN is unequal to itself), while out={1: buf} took a message keyed by 1.0 (and {True: buf} one
    keyed by 1) and the recv returned out='s keys, not the message's; a key whose == answers with
    an array failed as an UnsupportedTensorError. Now keys match by their wire type and value
    (NaN by NaN); any other key is a ShapeMismatchError and the message stays for the next recv."""
    from tensorwire.testing import connected_pair

    nan = float("nan")
    async with connected_pair(transport) as (a, b):
        buf = np.zeros(3)
        await a.send({nan: np.arange(3.0)}, tag=1)
        got = await asyncio.wait_for(b.recv(tag=1, out={float("nan"): buf}), 10)
        assert next(iter(got.values())) is buf and np.array_equal(buf, np.arange(3.0))
        for sent, out in (
            ({1.0: np.arange(3.0)}, {1: buf}),
            ({1: np.arange(3.0)}, {True: buf}),
            ({"a": np.arange(3.0)}, {b"a": buf}),
            ({"a": np.arange(3.0)}, {nan: buf}),
            ({nan: np.arange(3.0)}, {"a": buf}),
            ({"a": np.arange(3.0)}, {_KeyWithoutEquality(): buf}),
        ):
            buf[:] = -1
            await a.send(sent, tag=2)
            with pytest.raises(tensorwire.ShapeMismatchError, match="keys"):
                await asyncio.wait_for(b.recv(tag=2, out=out), 10)
            assert np.array_equal(buf, [-1, -1, -1])  # nothing landed in out=
            kept = await asyncio.wait_for(b.recv(tag=2), 10)  # the message stayed
            assert [type(k) for k in kept] == [type(k) for k in sent]
            assert np.array_equal(next(iter(kept.values())), np.arange(3.0))


@pytest.mark.parametrize("transport", ["inproc", "tcp"])
async def test_an_out_that_raises_fails_its_recv_and_not_the_channel(transport: str) -> None:
    from tensorwire.testing import connected_pair

    class Broken(dict):  # type: ignore[type-arg]
        def __iter__(self):  # type: ignore[no-untyped-def]
            raise RuntimeError("no items today")

        items = values = keys = __iter__

    async with connected_pair(transport) as (a, b):
        posted = asyncio.ensure_future(b.recv(tag=1, out=Broken(x=np.empty(3))))
        await asyncio.sleep(0.01)
        await a.send({"x": np.arange(3.0)}, tag=1)
        with pytest.raises(tensorwire.UnsupportedTensorError, match="no items today"):
            await posted
        with pytest.raises(tensorwire.UnsupportedTensorError, match="no items today"):  # the message waits now
            await b.recv(tag=1, out=Broken(x=np.empty(3)))
        assert np.array_equal((await b.recv(tag=1))["x"], np.arange(3.0))
        await a.send(np.arange(2), tag=2)
        assert np.array_equal(await b.recv(tag=2), np.arange(2))
