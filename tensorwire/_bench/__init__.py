"""``tensorwire bench``: how fast tensorwire moves tensors to a node, against a plain TCP socket
between the same two processes, measured in the same run.

Both sides are here: :func:`serve_bench` answers one peer's requests (``tensorwire serve``
runs it for every peer; only with ``--bench`` does it do more than refuse), :func:`run_bench`
measures against one. The client first calls the RPC method ``tw.bench``, which such a node
offers (:func:`offer_bench`): a node without it (a ``tensorwire stage``, a program of its own)
never reads the requests, and is named at once (MethodNotFound). The rest rides reserved tags
of the peer's data plane:

client -> server on REQUEST_TAG, answered on ANSWER_TAG
    {"op": "open"}                           {"port": P, "secret": HEX}: a plain TCP listener on
                                             the node's host, for the baseline (one connection,
                                             which must first present the secret)
    {"op": "sink", "size": N, "count": C, "device": D}
                                             "ready" once its buffer is allocated (untimed: so
                                             that no send waits on a recv never posted); then
                                             C messages of N bytes (uint8, in memory D: "cpu"
                                             or "cuda:K") follow on DATA_TAG, each lands in that
                                             one buffer (recv out=), and the second answer is
                                             the crc32c of the last one, an int, nothing else
    {"op": "ping", "count": C}               "ready"; then C times: 8 bytes on PING_TAG, echoed
                                             on PONG_TAG
    any request the node refuses or fails    {"error": TYPE, "message": TEXT}, and "refused":
                                             True from a node started without --bench

The plain socket speaks the same two operations: the 16-byte secret once, then per operation a
header ``<IQQ`` (op, size, count); op 1: ``count`` messages of ``size`` bytes, answered by the
crc32c of the last as ``<I``; op 2: ``count`` 8-byte round trips. Blocking ``sendall`` and
``recv_into`` in threads, as ``benchmarks/p2p.py`` does: the event loop never blocks.

A rate is ``count * size / (first send .. answer)``: delivered bytes only. Before the last
message of every batch, its first and last 8 bytes get a fresh stamp, so the crc32c the node
answers with matches the sender's only if that very message landed whole.
"""

from ._client import Report, Route, Row, run_bench
from ._server import offer_bench, serve_bench
from ._wire import bench_device, fmt_size, parse_sizes

__all__ = [
    "Report",
    "Route",
    "Row",
    "bench_device",
    "fmt_size",
    "parse_sizes",
    "offer_bench",
    "run_bench",
    "serve_bench",
]
