"""Proofs of a session secret for control-plane calls made on behalf of a session."""

from __future__ import annotations

import hashlib
import hmac

__all__ = ["heartbeat_proof", "leave_proof", "lookup_proof"]


def lookup_proof(secret: bytes, name: str) -> bytes:
    """HMAC-SHA256(secret, "lookup|" + name): the caller holds the session without sending it."""
    return hmac.new(secret, b"lookup|" + name.encode(), hashlib.sha256).digest()


def heartbeat_proof(secret: bytes, session_id: str) -> bytes:
    """HMAC-SHA256(secret, "heartbeat|" + session_id): a lease is renewed only by the session's
    peer, not by anyone who saw its id (it travels in the clear in the data plane's hello)."""
    return hmac.new(secret, b"heartbeat|" + session_id.encode(), hashlib.sha256).digest()


def leave_proof(secret: bytes, session_id: str) -> bytes:
    """HMAC-SHA256(secret, "leave|" + session_id): only the session's peer ends it by saying
    goodbye (a heartbeat's proof, seen on the wire, is not one)."""
    return hmac.new(secret, b"leave|" + session_id.encode(), hashlib.sha256).digest()
