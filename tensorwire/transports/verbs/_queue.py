"""One RC queue pair with its completion queue, completion channel and rings of registered buffers.

Completions reach asyncio through the completion channel's file descriptor: the loop watches it
(``add_reader``); when it is readable the event is taken (``get_cq_event``), acknowledged in
batches, notification is re-armed (``req_notify``) and only then is the CQ drained, so that no
completion that lands meanwhile is missed. Nothing polls while nothing happens.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from ...errors import BrokenResourceError, ConnectError
from ._memory import ring_buffer
from ._verbs import Port, comp_channel_fd, errno_of, gid_text, memlock_text, pv, unclaim
from ._wire import QpInfo

log = logging.getLogger(__name__)

__all__ = ["QueuePair", "wc_status_name"]

_WC_STATUS = {
    0: "success",
    1: "local length error",
    2: "local QP operation error",
    4: "local protection error",
    5: "work request flushed",
    7: "bad response",
    8: "local access error",
    9: "remote invalid request",
    10: "remote access error (bad rkey or address)",
    11: "remote operation error",
    12: "transport retry counter exceeded (peer unreachable)",
    13: "RNR retry counter exceeded",
    19: "fatal error",
    20: "response timeout",
    21: "general error",
}
WC_FLUSH = 5
WC_RETRY_EXC = 12
WC_RNR_RETRY_EXC = 13
_ACK_BATCH = 64


def wc_status_name(status: int) -> str:
    return _WC_STATUS.get(status, f"status {status}")


class QueuePair:
    """An RC queue pair to one peer, its CQ and completion channel, and its two rings."""

    def __init__(
        self,
        ctx: Any,
        pd: Any,
        port: Port,
        *,
        lid: int,
        mtu: int,
        slots: int,
        slot_bytes: int,
        send_slots: int,
        max_rdma: int,
        rd_atomic: int,
        on_completions: Callable[[list[Any]], None],
    ) -> None:
        v = pv()
        e = v.enums
        self.port = port
        self.lid = lid
        self.mtu = mtu
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.send_slots = send_slots
        self.rd_atomic = rd_atomic
        self.psn = int.from_bytes(os.urandom(3), "big")
        self._on_completions = on_completions
        self._loop: asyncio.AbstractEventLoop | None = None
        self.fd = -1
        self._unacked = 0
        self._closed = False
        self._objs: list[Any] = []
        try:
            self.cc = v.cq.CompChannel(ctx)
            self._objs.append(self.cc)
            self.fd = comp_channel_fd(self.cc)
            os.set_blocking(self.fd, False)
            self.cq = v.cq.CQ(ctx, slots + send_slots + max_rdma + 16, None, self.cc, 0)
            self._objs.append(self.cq)
            cap = v.qp.QPCap(max_send_wr=send_slots + max_rdma + 4, max_recv_wr=slots, max_send_sge=1, max_recv_sge=1)
            init = v.qp.QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap, sq_sig_all=0)
            self.qp = v.qp.QP(pd, init)
            self._objs.append(self.qp)
            self.recv_mr, self.recv_view = ring_buffer(pd, slots * slot_bytes, e.IBV_ACCESS_LOCAL_WRITE)
            self._objs.append(self.recv_mr)
            self.send_mr, self.send_view = ring_buffer(pd, send_slots * slot_bytes, e.IBV_ACCESS_LOCAL_WRITE)
            self._objs.append(self.send_mr)
            self.recv_addr: int = self.recv_mr.buf
            self.send_addr: int = self.send_mr.buf
            attr = v.qp.QPAttr()
            attr.qp_access_flags = e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_LOCAL_WRITE
            attr.pkey_index = 0
            attr.port_num = port.port
            self.qp.to_init(attr)
            for i in range(slots):
                self.post_recv(i)
            self.cq.req_notify()
        except v.pyverbs_error.PyverbsError as exc:
            # creating the CQ or the QP, or posting the ring, can fail (the device's limits,
            # pinned memory for the queues): the connection cannot be opened, and no
            # PyverbsError reaches a user (the ring's registration raises RegistrationError)
            self.close()
            hint = f" (pinned memory: RLIMIT_MEMLOCK {memlock_text()})" if errno_of(exc) == errno.ENOMEM else ""
            raise ConnectError(f"verbs: cannot set up a queue pair on {port.device}:{port.port}: {exc}{hint}") from exc
        except BaseException:
            self.close()
            raise
        self.qpn: int = self.qp.qp_num

    def info(self) -> QpInfo:
        p = self.port
        return QpInfo(self.qpn, self.psn, p.gid_index, self.lid, self.mtu, p.port, self.slots, self.slot_bytes, p.gid)

    def connect(self, remote: QpInfo) -> None:
        """RESET/INIT -> RTR -> RTS towards ``remote``."""
        v = pv()
        e = v.enums
        try:
            attr = v.qp.QPAttr()
            attr.qp_access_flags = e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_LOCAL_WRITE
            attr.pkey_index = 0
            attr.port_num = self.port.port
            attr.path_mtu = min(self.mtu, remote.mtu)
            attr.dest_qp_num = remote.qpn
            attr.rq_psn = remote.psn
            attr.max_dest_rd_atomic = self.rd_atomic
            attr.min_rnr_timer = 12  # 0.64 ms: RNR should never happen (credits), this is a backstop
            if self.port.roce:
                gr = v.addr.GlobalRoute(
                    dgid=v.addr.GID(gid_text(remote.gid)), sgid_index=self.port.gid_index, hop_limit=64
                )
                attr.ah_attr = v.addr.AHAttr(is_global=1, gr=gr, port_num=self.port.port)
            else:
                attr.ah_attr = v.addr.AHAttr(dlid=remote.lid, is_global=0, port_num=self.port.port)
            self.qp.to_rtr(attr)
            attr.sq_psn = self.psn
            attr.timeout = 14  # 4.096 us * 2**14 = 67 ms per try
            attr.retry_cnt = 7
            attr.rnr_retry = 7  # retry forever on RNR: a backstop behind the credits, never a loss
            attr.max_rd_atomic = self.rd_atomic
            self.qp.to_rts(attr)
        except v.pyverbs_error.PyverbsError as exc:
            raise ConnectError(f"verbs: cannot bring the queue pair to RTS towards qpn {remote.qpn}: {exc}") from exc

    # -- posting ---------------------------------------------------------------------------------
    def post_recv(self, slot: int) -> None:
        self._check()
        v = pv()
        sge = v.wr.SGE(self.recv_addr + slot * self.slot_bytes, self.slot_bytes, self.recv_mr.lkey)
        self.qp.post_recv(v.wr.RecvWR(wr_id=slot, num_sge=1, sg=[sge]))

    def post_send(self, wr_id: int, slot: int, nbytes: int) -> None:
        self._check()
        v = pv()
        sge = v.wr.SGE(self.send_addr + slot * self.slot_bytes, nbytes, self.send_mr.lkey)
        wr = v.wr.SendWR(
            wr_id=wr_id, opcode=v.enums.IBV_WR_SEND, num_sge=1, sg=[sge], send_flags=v.enums.IBV_SEND_SIGNALED
        )
        self.qp.post_send(wr)

    def post_rdma(self, wr_id: int, read: bool, laddr: int, lkey: int, n: int, raddr: int, rkey: int) -> None:
        self._check()
        v = pv()
        e = v.enums
        wr = v.wr.SendWR(
            wr_id=wr_id,
            opcode=e.IBV_WR_RDMA_READ if read else e.IBV_WR_RDMA_WRITE,
            num_sge=1,
            sg=[v.wr.SGE(laddr, n, lkey)],
            send_flags=e.IBV_SEND_SIGNALED,
        )
        wr.set_wr_rdma(rkey, raddr)
        self.qp.post_send(wr)

    def _check(self) -> None:
        if self._closed:  # pyverbs would pass a destroyed queue pair to the provider
            raise BrokenResourceError("verbs queue pair is closed")

    def slot_view(self, slot: int, nbytes: int) -> np.ndarray:
        off = slot * self.slot_bytes
        return self.recv_view[off : off + nbytes]

    # -- completions ------------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self.fd, self._readable)

    def _readable(self) -> None:
        if self._closed:
            return
        v = pv()
        try:
            self.cc.get_cq_event(self.cq)
        except v.pyverbs_error.PyverbsError:
            pass  # spurious wake-up (EAGAIN): drain anyway
        else:
            self._unacked += 1
            if self._unacked >= _ACK_BATCH:
                self.cq.ack_events(self._unacked)
                self._unacked = 0
        self.cq.req_notify()
        self.drain()

    def drain(self) -> None:
        """Take every completion there is and hand them over, in order."""
        while not self._closed:
            n, wcs = self.cq.poll(num_entries=32)
            if not n:
                return
            self._on_completions(wcs)

    def close(self) -> None:
        """Destroy the queue pair first (no more DMA into our memory), then the rest; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._loop is not None:
            try:
                self._loop.remove_reader(self.fd)
            except Exception:  # the loop may be closed already
                pass
        qp = getattr(self, "qp", None)
        for obj in sorted(reversed(self._objs), key=lambda o: o is not qp):
            try:
                obj.close()
            except Exception as exc:
                log.debug("closing %s failed: %s", type(obj).__name__, exc)
        self._objs.clear()
        unclaim({self.fd})
