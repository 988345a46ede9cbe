"""``_ucp._route`` reads the protocol and the lanes out of the info string that UCX 1.21's
``ucp_request_query`` writes for a send, get or put: those here are the strings UCX writes for
CUDA memory (cuda_ipc, UCX's own cuda_copy staging, GPUDirect RDMA on an mlx5 NIC), built as its
source builds them, so that a GPU run meets no text the parser has not read. No UCX needed.

How UCX forms the text (v1.21.0 source):
- ``ucp_request_str`` (src/ucp/core/ucp_request.c): ``{flags} `` (``proto`` among them for a
  request of the new protocols), then ``ucp_proto_config_info_str``;
- ``ucp_proto_config_info_str`` (src/ucp/proto/proto_debug.c): the selection
  (``ucp_proto_select_param_str``: ``tag_send from cuda/GPU0``, ``get into cuda memory``), then
  `` length %zu %s %s`` with the protocol query's description and configuration, right-trimmed,
  then `` %.1f MB/s %.2f us`` or `` - not available``;
- the configuration (the lanes): ``ucp_proto_common_lane_priv_str`` (src/ucp/proto/proto_common.c)
  for one lane, ``<transport>/<device>`` and ``/path<n>`` where the device has several paths;
  ``ucp_proto_multi_query_config`` (src/ucp/proto/proto_multi.c) for several, ``50% on A and
  50% on B``, or ``A 50% on path0 and 50% on path1`` where all share one device;
- the description: the protocol's own (``zero-copy``), ``rendezvous `` and the receiver's
  (``ucp_proto_rndv_rts_query``), and where UCX stages device memory itself, the staging
  transport and fragment memory (``ucp_proto_rndv_mtype_query_desc``, src/ucp/rndv/rndv_mtype.inl).
"""

from __future__ import annotations

import pytest

from tensorwire.transports.ucx._ucp import _route

MiB = 1 << 20


def _info(selection: str, length: int, desc: str, config: str, rate: float | None = 123456.7) -> bytes:
    """The string ``ucp_request_query`` gives for a send request of UCX's protocols."""
    text = f"{{proto|cb|init|snd_tag}} {selection} length {length} {desc} {config}".rstrip()
    if rate is None:
        return (text + " - not available").encode()
    return (text + f" {rate:.1f} MB/s {length / rate:.2f} us").encode()


CASES = {
    # two processes on one GPU: the receiver reads the sender's memory through CUDA IPC
    "cuda_ipc send": (
        _info("tag_send from cuda/GPU0", 64 * MiB, "rendezvous zero-copy read from remote", "cuda_ipc/cuda"),
        "rendezvous zero-copy read from remote",
        ("cuda_ipc/cuda",),
    ),
    "cuda_ipc send, device unknown, fast completion": (
        _info(
            "tag_send(fast-completion) from cuda memory",
            8 * MiB,
            "rendezvous zero-copy read from remote",
            "cuda_ipc/cuda",
        ),
        "rendezvous zero-copy read from remote",
        ("cuda_ipc/cuda",),
    ),
    "cuda_ipc get": (
        _info("get into cuda/GPU0", 16 * MiB, "zero-copy", "cuda_ipc/cuda"),
        "zero-copy",
        ("cuda_ipc/cuda",),
    ),
    "cuda_ipc put, no estimate": (
        _info("put from cuda/GPU1", 16 * MiB, "zero-copy", "cuda_ipc/cuda", rate=None),
        "zero-copy",
        ("cuda_ipc/cuda",),
    ),
    # UCX stages the device memory itself through host fragments (cuda_copy), over host lanes
    "cuda_copy staged rendezvous get": (
        _info(
            "tag_send from cuda/GPU0", 64 * MiB, "rendezvous read from remote, cuda_copy, frag host", "rc_mlx5/mlx5_0:1"
        ),
        "rendezvous read from remote, cuda_copy, frag host",
        ("rc_mlx5/mlx5_0:1",),
    ),
    "cuda_copy staged put of the sender": (
        _info(
            "rndv_send from cuda/GPU0",
            64 * MiB,
            "cuda_copy, flushed write to remote, frag host",
            "52% on tcp/lo and 48% on tcp/eth0",
        ),
        "cuda_copy, flushed write to remote, frag host",
        ("tcp/lo", "tcp/eth0"),
    ),
    "host-bounced active messages": (
        _info("tag_send from cuda/GPU0", 64 * MiB, "rendezvous fragmented copy-in copy-out", "tcp/lo"),
        "rendezvous fragmented copy-in copy-out",
        ("tcp/lo",),
    ),
    # GPUDirect RDMA: the NIC reads and writes GPU memory
    "GPUDirect get": (
        _info("get into cuda/GPU0", 16 * MiB, "zero-copy", "rc_mlx5/mlx5_0:1"),
        "zero-copy",
        ("rc_mlx5/mlx5_0:1",),
    ),
    "GPUDirect send over two NICs": (
        _info(
            "tag_send from cuda/GPU0",
            64 * MiB,
            "rendezvous zero-copy read from remote",
            "50% on rc_mlx5/mlx5_0:1 and 50% on rc_mlx5/mlx5_1:1",
        ),
        "rendezvous zero-copy read from remote",
        ("rc_mlx5/mlx5_0:1", "rc_mlx5/mlx5_1:1"),
    ),
    "GPUDirect over three lanes": (
        _info(
            "put from cuda/GPU0",
            16 * MiB,
            "zero-copy",
            "34% on rc_mlx5/mlx5_0:1, 33% on rc_mlx5/mlx5_1:1 and 33% on dc_mlx5/mlx5_2:1",
        ),
        "zero-copy",
        ("rc_mlx5/mlx5_0:1", "rc_mlx5/mlx5_1:1", "dc_mlx5/mlx5_2:1"),
    ),
    # a NIC with several network paths (RoCE LAG): UCX names the path after the device
    "GPUDirect send, one lane of a two-path NIC": (
        _info(
            "tag_send from cuda/GPU0",
            64 * MiB,
            "rendezvous zero-copy flushed write to remote",
            "rc_mlx5/mlx5_bond_0:1/path1",
        ),
        "rendezvous zero-copy flushed write to remote",
        ("rc_mlx5/mlx5_bond_0:1",),
    ),
    "GPUDirect get over both paths of one NIC": (
        _info("get into cuda/GPU0", 16 * MiB, "zero-copy", "rc_mlx5/mlx5_bond_0:1 50% on path0 and 50% on path1"),
        "zero-copy",
        ("rc_mlx5/mlx5_bond_0:1",),
    ),
    "GPUDirect send over two two-path NICs": (
        _info(
            "tag_send from cuda/GPU0",
            64 * MiB,
            "rendezvous zero-copy read from remote",
            "50% on rc_mlx5/mlx5_bond_0:1/path0 and 50% on rc_mlx5/mlx5_bond_1:1/path0",
        ),
        "rendezvous zero-copy read from remote",
        ("rc_mlx5/mlx5_bond_0:1", "rc_mlx5/mlx5_bond_1:1"),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_route_reads_the_cuda_protocols_and_lanes_ucx_writes(case: str) -> None:
    info, protocol, lanes = CASES[case]
    assert _route(info) == (protocol, lanes), info
    assert _route(info) == (protocol, lanes), "read again (from the cache)"


def test_what_names_no_protocol_gives_no_route() -> None:
    """A receive (``ucp_request_str`` without ``proto``: ``recv length <n> <memory> memory``),
    and a protocol whose configuration names no lane (``rendezvous no data fetch``)."""
    assert _route(b"{rcv_tag} recv length 67108864 cuda memory") is None
    assert _route(_info("tag_send from cuda/GPU0", 0, "rendezvous no data fetch", "")) is None
