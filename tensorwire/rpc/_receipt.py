"""``CallReceipt``: how one tensor RPC call moved its bytes, message by message."""

from __future__ import annotations

from dataclasses import dataclass

from ..transports import Receipt

__all__ = ["CallReceipt"]


@dataclass(frozen=True, slots=True)
class CallReceipt:
    """How one call (``peer.call_with_receipt``) went: one transport Receipt per message.

    request: the request as it was sent: the call's envelope (one int64 tensor of 40 bytes) and,
        when the arguments' tensors came to at most ``INLINE_BYTES`` (64 KiB), the arguments
        with it (then ``args`` is None). Its ``packed`` says an inline argument went from a copy
        tensorwire made (packed into C order, or a torch conj/neg view resolved).
    args: the arguments' own message, sent after the server admitted the call, when they were
        too large to ride in the request; None when they rode inline.
    result: how the reply came: its protocol, ``direct`` (landed in ``_out=`` with no copy of
        tensorwire's), ``staged`` (through a buffer of tensorwire's, having come before its
        recv) or neither (the transport copied it on its way: "inline", a small tcp reply),
        its memory.
    seconds: the whole call, wall time, from the call to its return (any wait for room among
        the calls outstanding to that peer, and the method's own time, included).
    """

    request: Receipt
    args: Receipt | None
    result: Receipt
    seconds: float

    @property
    def transport(self) -> str:
        """The transport that carried the call (the peer's ``path.transport``)."""
        return self.request.transport

    @property
    def args_inline(self) -> bool:
        """The arguments rode in the request itself (no separate ``args`` message)."""
        return self.args is None

    @property
    def nbytes(self) -> int:
        """Payload bytes of the call's messages together: request (envelope included), arguments
        sent apart, and result."""
        return self.request.nbytes + (0 if self.args is None else self.args.nbytes) + self.result.nbytes
