"""TLS and mutual TLS for the control plane, from PEM files.

The control plane carries the session secret, so with TLS on nobody on the path learns it; the
data plane then proves that secret on every connection (HMAC over a fresh nonce) and stays
plaintext for speed. Rejected TLS handshakes are logged by gRPC core (GRPC_VERBOSITY=info).
"""

from __future__ import annotations

import ipaddress
import os
import ssl
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from .._checks import check_arguments, check_bool, split_address
from ..errors import ConfigurationError

__all__ = ["TLSConfig", "callback_name"]


def _read(path: str | None, what: str) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigurationError(f"cannot read the {what} {path!r}: {exc.strerror}") from exc


class _Encrypted(Exception):
    """OpenSSL asked for the private key's passphrase."""


def _no_passphrase() -> bytes:
    # (given no callback, OpenSSL prompts on the terminal, blocking the event loop until someone
    # types; with no terminal its prompt failed with a bare OSError)
    raise _Encrypted


def _check_pem(cert_file: str | None, key_file: str | None, ca_file: str | None) -> None:
    """Load the files as TLS would, so that a garbage certificate, a key of another certificate,
    a key that needs a passphrase (gRPC takes none) or a garbage CA bundle is named now, not
    reported by gRPC as a failure to bind."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if cert_file is not None and key_file is not None:
        try:
            ctx.load_cert_chain(cert_file, key_file, password=_no_passphrase)
        except _Encrypted:
            raise ConfigurationError(
                f"the TLS private key {key_file!r} is encrypted (it needs a passphrase), and gRPC takes keys "
                f"without one: decrypt it (openssl pkey -in {key_file} -out plain.key) and give that file, "
                "readable by this node's user alone"
            ) from None
        except ssl.SSLError as exc:
            raise ConfigurationError(
                f"the TLS certificate {cert_file!r} with the private key {key_file!r} does not load "
                f"(not PEM, or the key belongs to another certificate): {exc.reason or exc}"
            ) from exc
    if ca_file is not None:
        try:
            ctx.load_verify_locations(cafile=ca_file)
        except ssl.SSLError as exc:
            raise ConfigurationError(f"the TLS CA bundle {ca_file!r} does not load: {exc.reason or exc}") from exc


@check_arguments
@dataclass(frozen=True, slots=True)
class TLSConfig:
    """Certificates for a node's control plane, used when it serves and when it connects.

    cert_file, key_file: this node's certificate chain and private key (PEM). Required to serve;
        when connecting they are presented as the client certificate (mutual TLS).
    ca_file: the CA bundle that verifies the other side (PEM); None uses the system roots.
    require_client_cert: serving, refuse clients without a certificate signed by ``ca_file``.
    server_name: connecting, the name the server certificate must carry when it differs from the
        host in the address (e.g. a certificate for "node-a" served at 10.0.0.5): one name for every
        node this one connects to. Calls back to a client that proved its certificate (mutual
        TLS) check a name of that certificate instead (``callback_name``).
    """

    cert_file: str | None = None
    key_file: str | None = None
    ca_file: str | None = None
    require_client_cert: bool = False
    server_name: str | None = None

    def __post_init__(self) -> None:
        for field in ("cert_file", "key_file", "ca_file"):
            value = getattr(self, field)
            if value is None:
                continue
            if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
                raise ConfigurationError(f"TLSConfig.{field} is the path of a PEM file, not {value!r}")
            object.__setattr__(self, field, str(os.fspath(value)))
        # a truthy stand-in ("no" from a config file) must not switch mutual TLS on
        require = check_bool("TLSConfig.require_client_cert", self.require_client_cert)
        object.__setattr__(self, "require_client_cert", require)
        if self.server_name is not None and (not isinstance(self.server_name, str) or not _host_like(self.server_name)):
            # (one with a space, a scheme or a path was taken, and every connect failed as if
            # the server's certificate had been refused)
            raise ConfigurationError(
                f"TLSConfig.server_name is the host name the servers' certificates carry (e.g. 'node-a'), not "
                f"{self.server_name!r}"
            )

    def server_credentials(self) -> grpc.ServerCredentials:
        """The credentials a node serves its control plane with (ConfigurationError where the
        files are missing or do not fit together)."""
        cert, key = _read(self.cert_file, "certificate"), _read(self.key_file, "private key")
        if cert is None or key is None:
            raise ConfigurationError("a TLS node needs cert_file and key_file to serve")
        ca = _read(self.ca_file, "CA bundle")
        if self.require_client_cert and ca is None:
            raise ConfigurationError("require_client_cert needs ca_file to verify client certificates")
        _check_pem(self.cert_file, self.key_file, self.ca_file)
        return grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=ca, require_client_auth=self.require_client_cert
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """The credentials a node connects to other nodes' control planes with."""
        creds = grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca_file, "CA bundle"),
            private_key=_read(self.key_file, "private key"),
            certificate_chain=_read(self.cert_file, "certificate"),
        )
        _check_pem(self.cert_file, self.key_file, self.ca_file)
        return creds

    def channel_options(self, server_name: str | None = None) -> list[tuple[str, str]]:
        """gRPC channel options: the host name to check the server's certificate against, if
        set (``server_name``, else ``self.server_name``)."""
        name = server_name or self.server_name
        return [("grpc.ssl_target_name_override", name)] if name else []


def _host_like(name: str) -> bool:
    """A name a host may have (a DNS name, an IPv4 or IPv6 address, in brackets or not), or an
    address with its port (gRPC checks its host)."""
    for candidate in (name, f"{name}:1", f"[{name}]:1"):
        try:
            split_address(candidate)
        except ConfigurationError:
            continue
        return True
    return False


def _same_host(a: str, b: str) -> bool:
    try:
        return ipaddress.ip_address(a) == ipaddress.ip_address(b)
    except ValueError:
        return a.lower() == b.lower()


def callback_name(auth: Mapping[str, Sequence[bytes]], host: str) -> str | None:
    """The name to check a client's control-plane certificate against when this node calls it
    back (its lookups, its goodbye) at ``host``, from the certificate that client proved in a
    mutual-TLS handshake (``auth``: that call's auth context): ``host`` where the certificate
    carries it (the check a call makes anyway), else its first DNS name that is no wildcard,
    else (a certificate without DNS names) its common name. None where it proved none.
    (``TLSConfig.server_name`` is one name for all the nodes this one connects to: per-node
    certificates, each of its own name, failed every call back to a client at its address.)"""
    dns = [name.decode(errors="replace") for name in auth.get("peer_dns", ())]
    ips = [ip.decode(errors="replace") for ip in auth.get("peer_ip", ())]
    common = [name.decode(errors="replace") for name in auth.get("x509_common_name", ())]
    if any(_same_host(host, name) for name in (*dns, *ips)):
        return host
    plain = [name for name in dns if "*" not in name]
    if plain:
        return plain[0]
    return common[0] if common and not dns else None
