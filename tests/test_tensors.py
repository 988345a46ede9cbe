"""The tensor adapter and message headers."""

import array

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
