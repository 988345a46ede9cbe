"""ctypes bindings to the few libucp calls ucxx's Python API does not offer.

One-sided operations (``ucp_put_nbx`` / ``ucp_get_nbx`` with remote keys), memory
registration (``ucp_mem_map`` / ``ucp_rkey_pack``) and endpoint queries (``ucp_ep_query`` for the
transports an endpoint really uses). They operate on the raw ``ucp_context_h``,
``ucp_worker_h`` and ``ucp_ep_h`` handles that ucxx exposes (``.handle``), in the very libucp
that ucxx loaded (found in ``/proc/self/maps``), so handles are shared, never duplicated.

Calls go through ctypes (the GIL is released for each one; one call costs about a microsecond,
far below a network operation). A request is polled with ``ucp_request_check_status`` after a
progress round of the node's worker, then freed; where many are in flight at once, those posted
past the first few tell the worker when they complete instead (see ``Ucp.completing_into``).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import threading
from collections.abc import Iterator
from ctypes import (
    POINTER,
    Structure,
    byref,
    c_char,
    c_char_p,
    c_int,
    c_int8,
    c_size_t,
    c_uint,
    c_uint32,
    c_uint64,
    c_void_p,
)
from dataclasses import dataclass, field
from typing import Any

from ...errors import PeerDisconnected, TransferError, TransportUnavailable

log = logging.getLogger(__name__)

__all__ = [
    "POLLED_AT_MOST",
    "RECVS_POLLED_AT_MOST",
    "CompletingUcp",
    "MemoryRegion",
    "RemoteKey",
    "Ucp",
    "load",
    "loaded_library",
]

UCS_OK = 0
UCS_INPROGRESS = 1
_IO_ERROR = -3
_SHMEM_SEGMENT = -17  # UCS_ERR_SHMEM_SEGMENT
_ERR_LAST = -100
_PTR_MAX = 1 << 64
_PTR_ERRORS = _PTR_MAX + _ERR_LAST  # a status pointer at or above this is an error status

_MEM_MAP_ADDRESS = 1 << 0
_MEM_MAP_LENGTH = 1 << 1
_MEM_MAP_PROT = 1 << 3
_PROT_LOCAL = (1 << 0) | (1 << 1)  # local read and write
_PROT_REMOTE_READ = 1 << 8
_PROT_REMOTE_WRITE = 1 << 9
_EP_ATTR_TRANSPORTS = 1 << 3
_REQUEST_ATTR_INFO = (1 << 0) | (1 << 1)  # UCP_REQUEST_ATTR_FIELD_INFO_STRING and _INFO_STRING_SIZE
_INFO_BYTES = 512  # UCX's own bound for the string (UCP_WORKER_ATTR_FIELD_MAX_INFO_STRING) is 1 KiB
_FIELD_CALLBACK = 1 << 1  # UCP_OP_ATTR_FIELD_CALLBACK
_FIELD_USER_DATA = 1 << 2  # UCP_OP_ATTR_FIELD_USER_DATA
_FIELD_RECV_INFO = 1 << 7  # UCP_OP_ATTR_FIELD_RECV_INFO
_FAST_CMPL = 1 << 17  # UCP_OP_ATTR_FLAG_FAST_CMPL
_FULL_MASK = (1 << 64) - 1  # a tag receive that matches one tag exactly
# A worker's requests polled at once, at most (see Ucp.completing_into): each progress round
# that moved then asks UCX about this many at most (a ctypes call each). Receives (the channels'
# standing control receives, one per channel) have places of their own: counted with the rest,
# a node with 24 peers or more had every place taken by them, and each of its gets and puts,
# however small, was called back (a call from C into Python per completion)
POLLED_AT_MOST = 24
RECVS_POLLED_AT_MOST = 8
# status codes that mean the peer or the link is gone


def _disconnect(status: int) -> bool:
    """NOT_CONNECTED, CONNECTION_RESET, UNREACHABLE, and the link and endpoint failure ranges."""
    return status in (-6, -24, -25) or -89 <= status <= -40


class _RequestParam(Structure):
    _fields_ = [
        ("op_attr_mask", c_uint32),
        ("flags", c_uint32),
        ("request", c_void_p),
        ("cb", c_void_p),
        ("datatype", c_uint64),
        ("user_data", c_void_p),
        ("reply_buffer", c_void_p),
        ("memory_type", c_int),
        ("recv_info", c_void_p),
        ("memh", c_void_p),
    ]


class _MemMapParams(Structure):
    _fields_ = [
        ("field_mask", c_uint64),
        ("address", c_void_p),
        ("length", c_size_t),
        ("flags", c_uint),
        ("prot", c_uint),
        ("memory_type", c_int),
        ("exported_memh_buffer", c_void_p),
    ]


class _TagRecvInfo(Structure):  # ucp_tag_recv_info_t
    _fields_ = [("sender_tag", c_uint64), ("length", c_size_t)]


class _TransportEntry(Structure):
    _fields_ = [("transport_name", c_char_p), ("device_name", c_char_p)]


class _Transports(Structure):
    _fields_ = [("entries", POINTER(_TransportEntry)), ("num_entries", c_uint), ("entry_size", c_size_t)]


class _RequestAttr(Structure):
    _fields_ = [
        ("field_mask", c_uint64),
        ("debug_string", c_void_p),
        ("debug_string_size", c_size_t),
        ("status", c_int),
        ("mem_type", c_int),
    ]


class _SockaddrStorage(Structure):
    _fields_ = [("data", c_uint64 * 16)]  # 128 bytes, 8-aligned like struct sockaddr_storage


class _EpAttr(Structure):
    _fields_ = [
        ("field_mask", c_uint64),
        ("name", c_char * 32),
        ("local_sockaddr", _SockaddrStorage),
        ("remote_sockaddr", _SockaddrStorage),
        ("transports", _Transports),
        ("user_data", c_void_p),
    ]


_ROUTES: dict[bytes, tuple[str, tuple[str, ...]] | None] = {}


def _route(info: bytes) -> tuple[str, tuple[str, ...]] | None:
    """``Ucp.request_route`` of one info string, which UCX 1.21 writes as ``{flags} <operation>
    from <memory> length <n> <protocol> <lanes> <rate> MB/s <time> us`` (``ucp_request_str``,
    then ``ucp_proto_config_info_str`` in src/ucp/proto/proto_debug.c). The memory is ``host
    memory`` or ``cuda/GPU0`` (``ucp_proto_debug_mem_info_str``; a get says ``into``). The
    protocol is its query's description: ``zero-copy``, ``rendezvous zero-copy read from
    remote`` (``ucp_proto_rndv_rts_query`` puts ``rendezvous`` before the receiver's), and,
    where UCX stages device memory itself, ``rendezvous read from remote, cuda_copy, frag
    host`` (``ucp_proto_rndv_mtype_query_desc``). The lanes are ``<transport>/<device>``
    (``ucp_proto_common_lane_priv_str``), one (``cuda_ipc/cuda``) or shares of several
    (``ucp_proto_multi_query_config``: ``52% on tcp/lo and 48% on tcp/eth0``); on a device
    with several network paths (an RDMA NIC's) UCX adds the path, ``rc_mlx5/mlx5_0:1/path0``,
    or names the lane once and the shares by path, ``rc_mlx5/mlx5_0:1 50% on path0 and 50% on
    path1``. A lane is given as ``ucp_ep_query`` names it, without the path. Those of one
    endpoint's protocols are few: each is read once, then found by its text without the length
    and the estimates."""
    flags, _, body = info.partition(b"} ")
    _, sep, rest = body.partition(b" length ")
    if b"proto" not in flags or not sep:
        return None  # (a receive, or a send of UCX's old protocols: no protocol named)
    key = rest.partition(b" ")[2]
    if key.endswith(b" us"):
        key = key.rsplit(b" ", 4)[0]  # (the estimated rate and time)
    elif key.endswith(b" - not available"):
        key = key[: -len(b" - not available")]
    try:
        return _ROUTES[key]
    except KeyError:
        pass
    words: list[str] = []  # the protocol's, up to its first lane or lane's share ("52% on ...")
    lanes: dict[str, None] = {}
    named = False
    for w in key.decode(errors="replace").split():
        lane = w.rstrip(",;")
        t, slash, d = lane.partition("/")
        if slash and d and t[:1].isalpha() and t.replace("_", "").isalnum():
            # (a "/path<n>" after the device is not part of the endpoint's lane name)
            lanes[f"{t}/{d.partition('/')[0]}"] = None
            named = True
        elif w.endswith("%"):
            named = True
        elif not named:
            words.append(w)
    route = (" ".join(words), tuple(lanes)) if lanes and words else None
    if len(_ROUTES) < 256:
        _ROUTES[key] = route
    return route


def loaded_library(name: str = "libucp.so") -> str | None:
    """The path of the ``name`` this process has mapped (after ucxx was imported), if any."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rstrip("\n").split(maxsplit=5)[-1]
                if os.path.basename(path).startswith(name):
                    return path
    except OSError:
        pass
    return None


# Completion callbacks: a request that a worker's bindings (``Ucp.completing_into``) post with
# them, and that does not complete at once, is put, as UCX completes it (inside the worker's
# progress, or a cancel), on that worker's list of completed requests, found by the request's
# user_data. The functions are kept for the life of the process: UCX may call them as long as a
# request exists, a worker destroyed on another thread included.
_SEND_CALLBACK = ctypes.CFUNCTYPE(None, c_void_p, c_int8, c_void_p)  # (request, status, user_data)
_RECV_CALLBACK = ctypes.CFUNCTYPE(None, c_void_p, c_int8, c_void_p, c_void_p)  # (..., tag_info, user_data)
_completions: dict[int, list[int]] = {}  # user_data -> the completed requests of one worker
_next_key = iter(range(1, 1 << 62)).__next__


def _on_send_complete(request: int | None, status: int, user_data: int | None) -> None:
    done = _completions.get(user_data or 0)
    if done is not None and request:
        done.append(request)


def _on_recv_complete(request: int | None, status: int, info: int | None, user_data: int | None) -> None:
    done = _completions.get(user_data or 0)
    if done is not None and request:
        done.append(request)


_send_callback = _SEND_CALLBACK(_on_send_complete)
_recv_callback = _RECV_CALLBACK(_on_recv_complete)


def _callback_param(callback: Any, key: int, flags: int = 0, recv_info: Any = None) -> _RequestParam:
    return _RequestParam(
        op_attr_mask=_FIELD_CALLBACK | _FIELD_USER_DATA | flags | (_FIELD_RECV_INFO if recv_info is not None else 0),
        cb=ctypes.cast(callback, c_void_p).value,
        user_data=key,
        recv_info=None if recv_info is None else ctypes.addressof(recv_info),
    )


def _status_of(ptr: int | None) -> int:
    """UCS_PTR_STATUS: OK for NULL, the error for an error pointer, INPROGRESS for a request."""
    if not ptr:
        return UCS_OK
    if ptr >= _PTR_MAX + _ERR_LAST:
        return ptr - _PTR_MAX
    return UCS_INPROGRESS


class Ucp:
    """The libucp functions tensorwire binds, from the library ucxx loaded.

    ``ucs_status_t`` is a packed enum: one signed byte (the rest of the return register is
    not defined), hence ``c_int8`` for every function that returns one."""

    def __init__(self, ucp: ctypes.CDLL, ucs: ctypes.CDLL, path: str) -> None:
        self.path = path
        self._ucs = ucs
        f = ucp
        self._mem_map = self._fn(f.ucp_mem_map, c_int8, c_void_p, POINTER(_MemMapParams), POINTER(c_void_p))
        self._mem_unmap = self._fn(f.ucp_mem_unmap, c_int8, c_void_p, c_void_p)
        self._rkey_pack = self._fn(f.ucp_rkey_pack, c_int8, c_void_p, c_void_p, POINTER(c_void_p), POINTER(c_size_t))
        self._rkey_buffer_release = self._fn(f.ucp_rkey_buffer_release, None, c_void_p)
        self._rkey_unpack = self._fn(f.ucp_ep_rkey_unpack, c_int8, c_void_p, c_void_p, POINTER(c_void_p))
        self._rkey_destroy = self._fn(f.ucp_rkey_destroy, None, c_void_p)
        self._put = self._fn(f.ucp_put_nbx, c_void_p, c_void_p, c_void_p, c_size_t, c_uint64, c_void_p, c_void_p)
        self._get = self._fn(f.ucp_get_nbx, c_void_p, c_void_p, c_void_p, c_size_t, c_uint64, c_void_p, c_void_p)
        self._flush = self._fn(f.ucp_ep_flush_nbx, c_void_p, c_void_p, c_void_p)
        self._ep_close = self._fn(f.ucp_ep_close_nbx, c_void_p, c_void_p, c_void_p)
        # control frames: a bytes object is passed by pointer (c_char_p), no copy
        self.tag_send_raw = self._fn(f.ucp_tag_send_nbx, c_void_p, c_void_p, c_char_p, c_size_t, c_uint64, c_void_p)
        # payloads: any buffer by its address (f[...] is a function object of its own, with its own argtypes)
        self._tag_send_at = self._fn(f["ucp_tag_send_nbx"], c_void_p, c_void_p, c_void_p, c_size_t, c_uint64, c_void_p)
        # control and payload receives: (worker, buffer, length, tag, tag mask, param)
        self._tag_recv = self._fn(
            f.ucp_tag_recv_nbx, c_void_p, c_void_p, c_void_p, c_size_t, c_uint64, c_uint64, c_void_p
        )
        self._recv_test = self._fn(f.ucp_tag_recv_request_test, c_int8, c_void_p, POINTER(_TagRecvInfo))
        self._cancel = self._fn(f.ucp_request_cancel, None, c_void_p, c_void_p)
        self._check = self._fn(f.ucp_request_check_status, c_int8, c_void_p)
        self.request_status = self._check  # UCS_INPROGRESS until the request completes
        self._free = self._fn(f.ucp_request_free, None, c_void_p)
        self.request_free = self._free  # ``request_release``'s C function itself (a frame's dispatch)
        self.free_unpolled = self._free  # (a request never among ``CompletingUcp.polled``: a payload receive)
        self._ep_query = self._fn(f.ucp_ep_query, c_int8, c_void_p, POINTER(_EpAttr))
        # (UCX 1.11 on; a protocol in its answer from 1.12, where UCX_PROTO_ENABLE is on)
        query = getattr(f, "ucp_request_query", None)
        self._request_query = None if query is None else self._fn(query, c_int8, c_void_p, POINTER(_RequestAttr))
        self._new_info_buffer()
        self._version = self._fn(f.ucp_get_version, None, POINTER(c_uint), POINTER(c_uint), POINTER(c_uint))
        self._strerror = self._fn(ucs.ucs_status_string, c_char_p, c_int)
        self._param = _RequestParam()  # no callback: requests are polled, then freed
        self._param_ref = byref(self._param)
        # control frames ask for fast completion: UCX then sends them eager up to 256 KiB
        # (UCX_RNDV_SEND_NBR_THRESH), done once the frame is copied out. Without it a frame past
        # UCX's eager limit for shared memory (5 KiB here; a message of up to 8 KiB rides inline)
        # went rendezvous, which completes only once the receiver has read it: to a peer that
        # died, never, and UCX warned as the node's worker was destroyed ("mpool.c ... was not
        # returned to mpool ucp_requests", "rcache.c ... destroying inuse region"), per frame
        self._frame_param = _RequestParam(op_attr_mask=_FAST_CMPL)
        self._frame_param_ref = byref(self._frame_param)
        # receives: where UCX completes one within the call, it says how many bytes came here
        # (``received``); one completed later is asked (``recv_length``)
        self._new_recv_info()
        self._ucxx_cancel = _ucxx_cancel()
        self._segment_failures_taken = peer_segment_attach_failures  # see _peer_segment_missing

    def completing_into(self, done: list[int], polled_at_most: int | None = None) -> CompletingUcp:
        """These bindings for one worker, which learns of their requests' completions in one of
        two ways. A request posted while fewer than ``polled_at_most`` of theirs are in flight
        unreported is put in ``polled`` (until it is freed), and the worker asks UCX its status
        after each progress round. One posted while that many are carries a completion callback,
        which appends it to ``done`` as UCX completes it (from inside that worker's progress; or
        a cancel, for a receive that had not matched). An entry of ``done`` is a hint: the
        request may have been freed since, and its memory given to another one, so the worker
        looks an entry up among the requests it holds and asks UCX its status before it acts.
        ``release_completions`` stops the appending (the worker is closing). ``polled_at_most``
        is ``POLLED_AT_MOST`` unless given. Receives have places of their own
        (``RECVS_POLLED_AT_MOST``, in ``recvs`` as well as ``polled``): a channel's control
        receive stands until a frame comes, and with one per peer they took every place on a
        node of 24 peers or more, so that each get, put and send there, however small, was
        called back.

        Either way alone cost dearly. Polled, every request in flight was asked about after
        each progress round: a batch of 4,000 gets took 5.5 s, quadratic in its size (0.40 s
        with callbacks). Called back, each completion that UCX does not report at once costs a
        call from C into Python (the GIL taken again, the arguments converted): a 4 KiB read
        went from 0.32 to 0.21 GB/s, and an 8-byte round trip took 3 us more."""
        return CompletingUcp(
            self, done, POLLED_AT_MOST if polled_at_most is None else polled_at_most, RECVS_POLLED_AT_MOST
        )

    @staticmethod
    def _fn(fn: Any, restype: Any, *argtypes: Any) -> Any:
        fn.restype = restype
        fn.argtypes = list(argtypes)
        return fn

    # -- status ----------------------------------------------------------------------------
    def status_string(self, status: int) -> str:
        s = self._strerror(status)
        return s.decode() if s else f"status {status}"

    def error(self, status: int, what: str) -> Exception:
        text = f"{what} failed: {self.status_string(status)} ({status})"
        if status == _IO_ERROR and peer_gone_since(0):
            return PeerDisconnected(f"{text} (a peer process is gone)")
        if status == _SHMEM_SEGMENT and self._peer_segment_missing():
            return PeerDisconnected(f"{text}: the peer's shared memory is gone (its process has most likely ended)")
        return PeerDisconnected(text) if _disconnect(status) else TransferError(text)

    def _peer_segment_missing(self) -> bool:
        """Did UCX log a peer's segment missing (see ``_on_ucx_log``) that no earlier
        shared-memory error was put down to?

        UCX returns this status both when attaching a peer's segment fails and when creating one
        of our own does; only its log line tells which. Each error takes the lines counted
        before it, so a later failure of our own (whose line is not counted) stays a
        TransferError. A failed attach is retried, and logged, at every call that needs the
        segment: one line for each call that fails."""
        seen, self._segment_failures_taken = self._segment_failures_taken, peer_segment_attach_failures
        return peer_segment_attach_failures > seen

    def _check_status(self, status: int, what: str) -> None:
        if status != UCS_OK:
            raise self.error(status, what)

    def version(self) -> tuple[int, int, int]:
        a, b, c = c_uint(), c_uint(), c_uint()
        self._version(byref(a), byref(b), byref(c))
        return a.value, b.value, c.value

    # -- requests --------------------------------------------------------------------------
    def _submit(self, ptr: int | None, what: str) -> int | None:
        """None if the operation completed at once; else the request to poll. Raises on error."""
        status = _status_of(ptr)
        if status == UCS_OK:
            return None
        if status == UCS_INPROGRESS:
            assert ptr is not None
            return ptr
        raise self.error(status, what)

    def request_done(self, req: int) -> bool:
        return bool(self._check(req) != UCS_INPROGRESS)

    def request_finish(self, req: int) -> int:
        """The request's final status; frees it."""
        status = int(self._check(req))
        self._free(req)
        return status

    def request_release(self, req: int) -> None:
        """Give up a request whether or not it has completed: UCX returns it to its pool once
        it does (a worker destroyed with it still in flight warns about it)."""
        self._free(req)

    def cancel_request(self, req: Any) -> None:
        """Cancel a ucxx request (``ucxx::Request::cancel``, which calls ``ucp_request_cancel``).

        ucxx's Python API cancels a request only when its last reference goes away, which
        would also lose the means to see when UCX is done with the buffer; this calls the same
        C++ method on the live request instead.
        """
        if self._ucxx_cancel is None:
            raise TransferError("ucxx::Request::cancel is not exported by this libucxx")
        self._ucxx_cancel(req.ucxx_ptr)

    # -- one-sided -------------------------------------------------------------------------
    def put(self, ep: int, buf: int, nbytes: int, remote_addr: int, rkey: int) -> int | None:
        return self._submit(self._put(ep, buf, nbytes, remote_addr, rkey, self._param_ref), "ucp_put_nbx")

    def get(self, ep: int, buf: int, nbytes: int, remote_addr: int, rkey: int) -> int | None:
        return self._submit(self._get(ep, buf, nbytes, remote_addr, rkey, self._param_ref), "ucp_get_nbx")

    def flush(self, ep: int) -> int | None:
        return self._submit(self._flush(ep, self._param_ref), "ucp_ep_flush_nbx")

    def ep_close(self, ep: int) -> int | None:
        """``ucp_ep_close_nbx`` in flush mode (the only one UCX allows without peer error
        handling): None when closed at once, else the request to poll."""
        return self._submit(self._ep_close(ep, self._param_ref), "ucp_ep_close_nbx")

    def tag_send(self, ep: int, data: bytes, tag: int) -> int | None:
        """``ucp_tag_send_nbx`` of ``data`` (kept alive by the caller until it completes):
        None when done at once (a small eager message usually is), else the request to poll."""
        ptr = self.tag_send_raw(ep, data, len(data), tag, self._frame_param_ref)
        if ptr is None:  # UCS_OK, sent already (the usual case for a small frame)
            return None
        return self._submit(ptr, "ucp_tag_send_nbx")

    def tag_recv(self, worker: int, address: int, nbytes: int, tag: int) -> int | None:
        """``ucp_tag_recv_nbx`` of exactly ``tag`` into the ``nbytes`` at ``address`` (kept alive
        by the caller until it completes): None if it completed at once (a message that was
        waiting, received now), else the request to poll. Raises on error."""
        ptr: int | None = self._tag_recv(worker, address, nbytes, tag, _FULL_MASK, self._recv_param_ref)
        if ptr is None or ptr < _PTR_ERRORS:  # (``_submit`` written out: one per control frame)
            return ptr
        raise self.error(ptr - _PTR_MAX, "ucp_tag_recv_nbx")

    def payload_recv(self, worker: int, address: int, nbytes: int, tag: int) -> tuple[int | None, int]:
        """``tag_recv`` for a message's payload (``Worker.payload_recv``), posted as ucxx posts
        its tag receives (a contiguous byte datatype, no memory-type hint: UCX finds the memory's
        type itself) and never called back: its owner asks UCX about it. (None, UCS_OK): it
        completed at once, ``received`` bytes; (request, UCS_INPROGRESS): a request to poll (and
        free), ``recv_length`` once it has completed; (None, status): it failed at once."""
        ptr: int | None = self._tag_recv(worker, address, nbytes, tag, _FULL_MASK, self._plain_recv_ref)
        if ptr is None:
            return None, UCS_OK
        if ptr < _PTR_ERRORS:
            return ptr, UCS_INPROGRESS
        return None, ptr - _PTR_MAX

    def cancel_raw(self, worker: int, req: int) -> None:
        """``ucp_request_cancel`` of a raw receive: one that has not matched completes at once
        (canceled); one whose message is arriving runs on to its end. Still to be freed."""
        self._cancel(worker, req)

    def tag_send_at(self, ep: int, address: int, nbytes: int, tag: int) -> int | None:
        """``ucp_tag_send_nbx`` of the ``nbytes`` at ``address``, host or device memory (the
        caller keeps it alive until the request completes): None when done at once, else the
        request to poll. Posted as ucxx posts its tag sends (a contiguous byte datatype, no
        memory-type hint: UCX finds the memory's type itself, asking the driver for device
        memory with the memory-type cache off) and without fast completion: a large payload
        goes rendezvous and moves zero-copy."""
        ptr = self._tag_send_at(ep, address, nbytes, tag, self._param_ref)
        if ptr is None:  # UCS_OK: sent already (a small eager payload)
            return None
        return self._submit(ptr, "ucp_tag_send_nbx")

    def mem_map(self, context: int, address: int, length: int, *, writable: bool = True) -> int:
        """Register memory. Without ``writable`` peers get read access only (where the lane
        enforces it: RDMA registrations do, shared memory through cma does not)."""
        prot = _PROT_LOCAL | _PROT_REMOTE_READ | (_PROT_REMOTE_WRITE if writable else 0)
        params = _MemMapParams(
            field_mask=_MEM_MAP_ADDRESS | _MEM_MAP_LENGTH | _MEM_MAP_PROT, address=address, length=length, prot=prot
        )
        memh = c_void_p()
        self._check_status(self._mem_map(context, byref(params), byref(memh)), "ucp_mem_map")
        assert memh.value is not None
        return memh.value

    def mem_unmap(self, context: int, memh: int) -> None:
        self._check_status(self._mem_unmap(context, memh), "ucp_mem_unmap")

    def rkey_pack(self, context: int, memh: int) -> bytes:
        buf, size = c_void_p(), c_size_t()
        self._check_status(self._rkey_pack(context, memh, byref(buf), byref(size)), "ucp_rkey_pack")
        try:
            return ctypes.string_at(buf, size.value)
        finally:
            self._rkey_buffer_release(buf)

    def rkey_unpack(self, ep: int, packed: bytes) -> int:
        rkey = c_void_p()
        self._check_status(self._rkey_unpack(ep, packed, byref(rkey)), "ucp_ep_rkey_unpack")
        assert rkey.value is not None
        return rkey.value

    def rkey_destroy(self, rkey: int) -> None:
        self._rkey_destroy(rkey)

    def _new_recv_info(self) -> None:
        self._recv_info = _TagRecvInfo()
        self._recv_param = _RequestParam(op_attr_mask=_FIELD_RECV_INFO, recv_info=ctypes.addressof(self._recv_info))
        self._recv_param_ref = byref(self._recv_param)
        self._plain_recv_ref = self._recv_param_ref  # (payload receives: never with a callback)
        self._test_info = _TagRecvInfo()
        self._test_info_ref = byref(self._test_info)

    def received(self) -> int:
        """The bytes that came into the receive ``tag_recv`` or ``payload_recv`` completed within
        the call (no request)."""
        return int(self._recv_info.length)

    def recv_length(self, req: int) -> int:
        """The bytes that came into the completed tag receive ``req`` (not freed yet)."""
        self._recv_test(req, self._test_info_ref)
        return int(self._test_info.length)

    def recv_test(self, req: int) -> int:
        """``ucp_tag_recv_request_test`` of the tag receive ``req`` (not freed yet): UCS_INPROGRESS,
        or the status it completed with, the bytes that came then in ``tested_length``. One
        call where ``request_status`` and ``recv_length`` are two."""
        return int(self._recv_test(req, self._test_info_ref))

    def tested_length(self) -> int:
        """The bytes that came into the receive ``recv_test`` last found completed."""
        return int(self._test_info.length)

    def _new_info_buffer(self) -> None:
        self._info = ctypes.create_string_buffer(_INFO_BYTES)
        self._info_attr = _RequestAttr(_REQUEST_ATTR_INFO, ctypes.addressof(self._info), _INFO_BYTES)
        self._info_ref = byref(self._info_attr)

    def request_route(self, req: int) -> tuple[str, tuple[str, ...]] | None:
        """The protocol UCX selected for a send, get or put it has not released, and the lanes
        that protocol uses (``ucp_request_query``'s info string, e.g. ``"rendezvous zero-copy read
        from remote"`` over ``("cma/memory",)``). None where UCX does not say: a receive (a
        release build keeps no protocol on one), or a string this cannot read."""
        query = self._request_query
        if query is None or query(req, self._info_ref) != UCS_OK:
            return None
        return _route(self._info.value)

    # -- endpoints -------------------------------------------------------------------------
    def ep_transports(self, ep: int) -> list[tuple[str, str]]:
        """(transport, device) for each lane the endpoint uses, e.g. ("posix", "memory")."""
        entries = (_TransportEntry * 32)()
        attr = _EpAttr(field_mask=_EP_ATTR_TRANSPORTS)
        attr.transports.entries = ctypes.cast(entries, POINTER(_TransportEntry))
        attr.transports.num_entries = 32
        attr.transports.entry_size = ctypes.sizeof(_TransportEntry)
        self._check_status(self._ep_query(ep, byref(attr)), "ucp_ep_query")
        out = []
        for i in range(min(attr.transports.num_entries, 32)):
            e = entries[i]
            out.append(((e.transport_name or b"?").decode(), (e.device_name or b"?").decode()))
        return out


class CompletingUcp(Ucp):
    """One worker's bindings (``Ucp.completing_into``): each request they post is either polled
    (in ``polled`` until freed) or reported through ``done`` as it completes."""

    def __init__(self, base: Ucp, done: list[int], polled_at_most: int, recvs_polled_at_most: int) -> None:
        self.__dict__.update(base.__dict__)  # (the functions base bound: the same library)
        self.polled: set[int] = set()  # requests posted without a callback, not freed yet
        self.recvs: set[int] = set()  # the receives among them (places of their own)
        self.polled_at_most = polled_at_most
        self.recvs_polled_at_most = recvs_polled_at_most
        self.polling = True  # the parameters in use for sends, gets, puts, flushes carry no callback
        self.polling_recvs = True  # and those for receives
        self.completion_key = key = _next_key()
        _completions[key] = done
        self._new_recv_info()  # (one per worker, as the info buffer below)
        self._plain = self._param_ref, self._frame_param_ref, self._recv_param_ref
        self._called_recv = _callback_param(_recv_callback, key, recv_info=self._recv_info)
        self._called = (
            byref(_callback_param(_send_callback, key)),
            byref(_callback_param(_send_callback, key, _FAST_CMPL)),
            byref(self._called_recv),
        )
        self.request_free = self.request_release  # (base's is the C function: a freed request leaves polled)
        self._new_info_buffer()  # (one per worker: base's may be in use on another worker's loop)

    def _posted(self, req: int | None) -> int | None:
        if req is not None and self.polling:  # (posted with the parameters in use now)
            polled = self.polled
            polled.add(req)
            if len(polled) - len(self.recvs) >= self.polled_at_most:
                self.polling = False
                self._param_ref, self._frame_param_ref = self._called[:2]
        return req

    def _posted_recv(self, req: int | None) -> int | None:
        if req is not None and self.polling_recvs:
            recvs = self.recvs
            recvs.add(req)
            self.polled.add(req)
            if len(recvs) >= self.recvs_polled_at_most:
                self.polling_recvs = False
                self._recv_param_ref = self._called[2]
        return req

    def request_release(self, req: int) -> None:
        self._free(req)
        polled = self.polled
        polled.discard(req)
        if req in self.recvs:
            self.recvs.discard(req)
            if not self.polling_recvs and len(self.recvs) < self.recvs_polled_at_most:
                self.polling_recvs = True
                self._recv_param_ref = self._plain[2]
        elif not self.polling and len(polled) - len(self.recvs) < self.polled_at_most:
            self.polling = True
            self._param_ref, self._frame_param_ref = self._plain[:2]

    def request_finish(self, req: int) -> int:
        status = int(self._check(req))
        self.request_release(req)
        return status

    def release_completions(self) -> None:
        """Stop appending completed requests to ``done`` (the worker is closing: it frees every
        request it holds, or hands it back to UCX)."""
        _completions.pop(self.completion_key, None)
        self.polled.clear()
        self.recvs.clear()

    # (the posting methods of Ucp, each with _posted: written out, one call less per request)
    def put(self, ep: int, buf: int, nbytes: int, remote_addr: int, rkey: int) -> int | None:
        return self._posted(self._submit(self._put(ep, buf, nbytes, remote_addr, rkey, self._param_ref), "ucp_put_nbx"))

    def get(self, ep: int, buf: int, nbytes: int, remote_addr: int, rkey: int) -> int | None:
        return self._posted(self._submit(self._get(ep, buf, nbytes, remote_addr, rkey, self._param_ref), "ucp_get_nbx"))

    def flush(self, ep: int) -> int | None:
        return self._posted(self._submit(self._flush(ep, self._param_ref), "ucp_ep_flush_nbx"))

    def ep_close(self, ep: int) -> int | None:
        return self._posted(super().ep_close(ep))

    def tag_send(self, ep: int, data: bytes, tag: int) -> int | None:
        ptr = self.tag_send_raw(ep, data, len(data), tag, self._frame_param_ref)
        return None if ptr is None else self._posted(self._submit(ptr, "ucp_tag_send_nbx"))

    def tag_recv(self, worker: int, address: int, nbytes: int, tag: int) -> int | None:
        ptr: int | None = self._tag_recv(worker, address, nbytes, tag, _FULL_MASK, self._recv_param_ref)
        if ptr is None or ptr < _PTR_ERRORS:
            return self._posted_recv(ptr)
        raise self.error(ptr - _PTR_MAX, "ucp_tag_recv_nbx")

    def tag_send_at(self, ep: int, address: int, nbytes: int, tag: int) -> int | None:
        ptr = self._tag_send_at(ep, address, nbytes, tag, self._param_ref)
        return None if ptr is None else self._posted(self._submit(ptr, "ucp_tag_send_nbx"))


def _ucxx_cancel() -> Any:
    path = loaded_library("libucxx.so")
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(path, mode=os.RTLD_NOW | os.RTLD_NOLOAD | os.RTLD_LOCAL)
        fn = lib._ZN4ucxx7Request6cancelEv  # void ucxx::Request::cancel(), `this` as first argument
    except (OSError, AttributeError):
        return None
    fn.restype = None
    fn.argtypes = [c_void_p]
    return fn


# -- peer failures without UCX peer error handling ---------------------------------------------
# Endpoints are created without UCX's peer error handling (it would exclude the shared-memory
# lanes, see docs/ucx.md). Without it, UCX logs a failed transfer to a dead peer (a cma
# process_vm_readv/writev of a SIGKILLed process: "No such process") at FATAL level, and its
# default log handler aborts the whole process. The transfer itself returns an error status,
# which reaches the request. This handler, first in UCX's chain, swallows FATAL lines from the
# transports' peer-failure sites (logged here at warning level instead), so the survivor sees
# the error on the request (and the control-plane lease) instead of dying. Anything else
# fatal still goes to UCX's own handler.
#
# Over shared memory a sender also attaches segments of the receiver's (its receive descriptors,
# the memory of its rkeys) the first time it needs them. Those of a process that has ended are
# gone (a System V segment is removed with its last attachment, a POSIX one's file with its
# owner), and the attach fails at ERROR level, printed on the process's output, and the call
# with UCS_ERR_SHMEM_SEGMENT: the status creating a segment of our own returns as well. So the
# handler takes these lines too (logged at warning level, and counted: Ucp.error tells the two
# apart by them). UCX 1.21: uct_sysv_mem_attach_common ("shmat(shmid=...) failed", attach
# only) and uct_posix_open_check_result, whose opening of an existing segment (a peer's: for an
# attach, or to see whether it can be reached) passes no flags, where creating one passes
# O_CREAT|O_EXCL|O_RDWR ("flags=0xc2"). (Mapping a segment once opened fails at the same site
# for both, and not because its owner ended: left to UCX.)
_LOG_STOP, _LOG_CONTINUE = 0, 1
_LOG_FATAL, _LOG_ERROR = 0, 1
_PEER_FAILURE_SITES = frozenset({b"cma_ep.c", b"scopy_ep.c", b"knem_ep.c", b"xpmem_ep.c", b"tcp_ep.c", b"ucp_ep.c"})
_SEGMENT_ATTACH_SITES = {b"mm_sysv.c": b"uct_sysv_mem_attach_common", b"mm_posix.c": b"uct_posix_open_check_result"}
_LOG_FUNC = ctypes.CFUNCTYPE(c_int, c_char_p, c_uint, c_char_p, c_int, c_void_p, c_char_p, c_void_p)
_log_handler: Any = None  # kept alive as long as UCX may call it
peer_failures_survived = 0  # FATAL peer-failure lines swallowed (tests and doctor read it)
peer_segment_attach_failures = 0  # peers' shared-memory segments found missing (lines taken)
_quiet = threading.local()  # see quiet()


def _vformat(fmt: bytes, ap: int | None) -> str:
    try:
        libc = ctypes.CDLL(None)
        buf = ctypes.create_string_buffer(512)
        libc.vsnprintf.argtypes = [c_void_p, c_size_t, c_char_p, c_void_p]
        libc.vsnprintf(buf, len(buf), fmt, ap)
        return buf.value.decode(errors="replace")
    except Exception:  # never raise into C
        return fmt.decode(errors="replace")


def _peer_segment_attach_failure(file: bytes, function: bytes, fmt: bytes, ap: int) -> str | None:
    """The message of an ERROR line that says a peer's segment could not be attached, else None."""
    if _SEGMENT_ATTACH_SITES.get(os.path.basename(file or b"")) != function:
        return None
    text = _vformat(fmt, ap)  # (every handler gets a fresh va_list: UCX starts one per call)
    if function == b"uct_posix_open_check_result" and " flags=0x0)" not in text:
        return None  # creating a segment of our own
    return text


def _on_ucx_log(file: bytes, line: int, function: bytes, level: int, comp: int, fmt: bytes, ap: int) -> int:
    global peer_failures_survived, peer_segment_attach_failures
    if level == _LOG_ERROR:
        text = _peer_segment_attach_failure(file, function, fmt, ap)
        if text is not None:
            peer_segment_attach_failures += 1
            log.warning("ucx: a peer's shared memory is gone (its process has most likely ended): %s", text)
            return _LOG_STOP
    if level != _LOG_FATAL:
        sites = getattr(_quiet, "sites", None)
        if sites and os.path.basename(file or b"") in sites:
            log.debug("ucx (%s): %s", _quiet.why, _vformat(fmt, ap))
            return _LOG_STOP
        return _LOG_CONTINUE
    if os.path.basename(file or b"") not in _PEER_FAILURE_SITES:
        return _LOG_CONTINUE
    peer_failures_survived += 1
    log.warning("ucx: a transfer to a peer that is gone failed: %s", _vformat(fmt, ap))
    return _LOG_STOP


@contextlib.contextmanager
def quiet(sites: frozenset[bytes], why: str) -> Iterator[None]:
    """UCX's warnings and errors from the source files ``sites`` (``b"flush.c"``) that this
    thread's UCX calls print while inside go to tensorwire's log at debug level, ``why`` with
    them, instead of to the process's output (UCX prints them on stdout).

    For what UCX reports of tensorwire doing the right thing, where UCX offers no quieter way:
    the closing flush of an endpoint whose peer is gone, the requests to such a peer that a
    destroyed worker still held. Only this thread, only inside: other users of UCX in the process
    (and tensorwire at any other moment) keep every line."""
    before = getattr(_quiet, "sites", None), getattr(_quiet, "why", "")
    _quiet.sites, _quiet.why = (before[0] or frozenset()) | sites, why
    try:
        yield
    finally:
        _quiet.sites, _quiet.why = before


def peer_gone_since(count: int) -> bool:
    """Did a transfer to a dead peer fail (an I/O error on its request, see ``_on_ucx_log``)
    after ``peer_failures_survived`` read ``count``?"""
    return peer_failures_survived > count


def _install_log_handler(ucs: ctypes.CDLL) -> None:
    global _log_handler
    if _log_handler is not None:
        return
    try:
        push = ucs.ucs_log_push_handler
    except AttributeError:
        log.debug("ucx: libucs has no ucs_log_push_handler; peer failures over cma stay fatal")
        return
    push.restype = None
    push.argtypes = [_LOG_FUNC]
    _log_handler = _LOG_FUNC(_on_ucx_log)
    push(_log_handler)


@functools.lru_cache(maxsize=1)
def load() -> Ucp:
    """The bindings for the libucp that ucxx loaded (import ucxx first)."""
    from ._worker import import_ucxx

    import_ucxx()
    path = loaded_library("libucp.so")
    ucs_path = loaded_library("libucs.so")
    if path is None or ucs_path is None:
        raise TransportUnavailable("ucx: libucp is not loaded in this process")
    mode = os.RTLD_NOW | os.RTLD_NOLOAD | os.RTLD_LOCAL
    try:
        lib = ctypes.CDLL(path, mode=mode)
        ucs = ctypes.CDLL(ucs_path, mode=mode)
        _install_log_handler(ucs)
        return Ucp(lib, ucs, path)
    except (OSError, AttributeError) as exc:
        raise TransportUnavailable(f"ucx: cannot bind {path}: {exc}") from exc


@dataclass(eq=False)
class MemoryRegion:
    """Memory registered with a node's UCX context: peers may put to and get from it.

    ``rkey`` is the packed remote key a peer unpacks (``UcxChannel.remote_key``) to reach
    ``[address, address + length)``. Close it (or leave the ``with`` block) before freeing the
    memory; the caller keeps the memory alive while it is registered. Registrations of the
    same region share one ``ucp_mem_map`` (the transport's registration cache); the last
    ``close()`` unmaps it.
    """

    address: int
    length: int
    rkey: bytes
    _hold: Any  # transports._remote.Hold

    def close(self) -> None:
        self._hold.release()

    def __enter__(self) -> MemoryRegion:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(eq=False)
class RemoteKey:
    """A peer's packed rkey unpacked on one endpoint; valid until closed or the channel closes."""

    handle: int | None
    _ucp: Ucp
    # the channel's set of its keys, destroyed with it if still open: a key closed before that
    # (a revoked handle's) leaves it, else every generation a long-lived channel ever read kept
    # its key object there until the channel closed
    _held: set[RemoteKey] | None = field(default=None, repr=False)

    def close(self) -> None:
        if self._held is not None:
            self._held.discard(self)
        if self.handle is not None:
            h, self.handle = self.handle, None
            self._ucp.rkey_destroy(h)
