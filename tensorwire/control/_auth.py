"""Proofs of a session secret for control-plane calls made on behalf of a session."""

from __future__ import annotations

import hashlib
import hmac

__all__ = ["lookup_proof"]


def lookup_proof(secret: bytes, name: str) -> bytes:
    """HMAC-SHA256(secret, "lookup|" + name): the caller holds the session without sending it."""
    return hmac.new(secret, b"lookup|" + name.encode(), hashlib.sha256).digest()
