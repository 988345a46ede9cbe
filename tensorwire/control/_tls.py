"""TLS and mutual TLS for the control plane, from PEM files.

The control plane carries the session secret, so with TLS on nobody on the path learns it; the
data plane then proves that secret on every connection (HMAC over a fresh nonce) and stays
plaintext for speed. Rejected TLS handshakes are logged by gRPC core (GRPC_VERBOSITY=info).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

from ..errors import ConfigurationError

__all__ = ["TLSConfig"]


def _read(path: str | None, what: str) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigurationError(f"cannot read the {what} {path!r}: {exc.strerror}") from exc


@dataclass(frozen=True, slots=True)
class TLSConfig:
    """Certificates for a node's control plane, used when it serves and when it connects.

    cert_file, key_file: this node's certificate chain and private key (PEM). Required to serve;
        when connecting they are presented as the client certificate (mutual TLS).
    ca_file: the CA bundle that verifies the other side (PEM); None uses the system roots.
    require_client_cert: serving, refuse clients without a certificate signed by ``ca_file``.
    server_name: connecting, the name the server certificate must carry when it differs from the
        host in the address (e.g. a certificate for "node-a" served at 10.0.0.5).
    """

    cert_file: str | None = None
    key_file: str | None = None
    ca_file: str | None = None
    require_client_cert: bool = False
    server_name: str | None = None

    def server_credentials(self) -> grpc.ServerCredentials:
        cert, key = _read(self.cert_file, "certificate"), _read(self.key_file, "private key")
        if cert is None or key is None:
            raise ConfigurationError("a TLS node needs cert_file and key_file to serve")
        ca = _read(self.ca_file, "CA bundle")
        if self.require_client_cert and ca is None:
            raise ConfigurationError("require_client_cert needs ca_file to verify client certificates")
        return grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=ca, require_client_auth=self.require_client_cert
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca_file, "CA bundle"),
            private_key=_read(self.key_file, "private key"),
            certificate_chain=_read(self.cert_file, "certificate"),
        )

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []
