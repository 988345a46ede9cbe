"""Tensor RPC: methods whose arguments and results carry tensors.

    @node.method("forward")
    async def forward(x, mask=None): ...

    y = await peer.call("forward", x, mask=m, _deadline=2.0)
    y, receipt = await peer.call_with_receipt("forward", x)   # CallReceipt: how each message moved
    async for chunk in peer.stream("generate", prompt): ...

Between tensorwire peers a call rides the peer's data plane (request, tensors, replies and
cancellation on reserved tags), so it costs a data-plane round trip, not a gRPC one. The
control plane lists a node's methods (``ListMethods``) and lets stock gRPC clients call those
whose arguments are scalars (``Invoke``). Errors come back as ``RemoteError`` and its
subclasses; deadlines travel with the call (``_deadline=`` or ``deadline()``) and cancelling
the caller cancels the method on the server.
"""

from ._deadline import current_deadline, deadline
from ._receipt import CallReceipt
from ._registry import CallLimits, Method, MethodRegistry

__all__ = ["CallLimits", "CallReceipt", "Method", "MethodRegistry", "current_deadline", "deadline"]
