"""TLS and mutual TLS on the control plane, with certificates made for the test."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import os
import shutil
import socket
import struct
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from _polling import eventually
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import dsa, ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health, health_pb2_grpc

import tensorwire
from tensorwire import TLSConfig
from tensorwire.control import PROTOCOL_VERSION
from tensorwire.control._pb.control_pb2 import HandshakeRequest
from tensorwire.control._pb.control_pb2_grpc import ControlStub


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(subject: str, key, issuer: str, issuer_key, *, ca: bool = False) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(_name(issuer))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
    return builder.sign(issuer_key, hashes.SHA256())


def _write(path: Path, cert: x509.Certificate, key) -> tuple[str, str]:
    c, k = path.with_suffix(".crt"), path.with_suffix(".key")
    c.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    k.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return str(c), str(k)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, str]]:
    d = tmp_path_factory.mktemp("pki")
    ca_key, rogue_key = _key(), _key()
    ca = _cert("tensorwire-test-ca", ca_key, "tensorwire-test-ca", ca_key, ca=True)
    rogue = _cert("rogue-ca", rogue_key, "rogue-ca", rogue_key, ca=True)
    out = {"ca": _write(d / "ca", ca, ca_key), "rogue_ca": _write(d / "rogue", rogue, rogue_key)}
    for who, (_issuer, ikey, iname) in {
        "server": (ca, ca_key, "tensorwire-test-ca"),
        "client": (ca, ca_key, "tensorwire-test-ca"),
        "intruder": (rogue, rogue_key, "rogue-ca"),
    }.items():
        k = _key()
        out[who] = _write(d / who, _cert(who, k, iname, ikey), k)
    return out


def _tls(pki, who: str, *, ca: str = "ca", mutual: bool = False) -> TLSConfig:
    cert, key = pki[who]
    return TLSConfig(cert_file=cert, key_file=key, ca_file=pki[ca][0], require_client_cert=mutual)


async def _exchange(client: tensorwire.Node, server: tensorwire.Node) -> None:
    a = await client.connect(server.address)
    b = await server.accept()
    await a.send(np.arange(5))
    assert np.array_equal(await b.recv(), np.arange(5))


async def test_tls(pki) -> None:
    async with (
        tensorwire.start("127.0.0.1:0", tls=_tls(pki, "server")) as server,
        tensorwire.start("127.0.0.1:0", tls=_tls(pki, "client")) as client,
    ):
        await _exchange(client, server)


async def test_mutual_tls_accepts_good_and_rejects_bad_client_certs(pki) -> None:
    async with tensorwire.start("127.0.0.1:0", tls=_tls(pki, "server", mutual=True), transports=("tcp",)) as server:
        async with tensorwire.start("127.0.0.1:0", tls=_tls(pki, "client")) as good:
            await _exchange(good, server)
        # a stock gRPC client that verifies the server but presents no certificate
        creds = grpc.ssl_channel_credentials(root_certificates=await asyncio.to_thread(Path(pki["ca"][0]).read_bytes))
        async with grpc.aio.secure_channel(server.address, creds) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await ControlStub(ch).Handshake(HandshakeRequest(protocol_version=PROTOCOL_VERSION), timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        async with tensorwire.start("127.0.0.1:0", tls=_tls(pki, "intruder")) as intruder:
            with pytest.raises(tensorwire.AuthenticationError):
                await intruder.connect(server.address, connect_timeout=5)
        async with tensorwire.start("127.0.0.1:0") as plaintext:
            with pytest.raises(tensorwire.ControlPlaneError):
                await plaintext.connect(server.address, connect_timeout=5)
        # the server is unharmed
        async with tensorwire.start("127.0.0.1:0", tls=_tls(pki, "client")) as again:
            await _exchange(again, server)


async def test_client_rejects_a_server_it_cannot_verify(pki) -> None:
    async with (
        tensorwire.start("127.0.0.1:0", tls=_tls(pki, "intruder")) as fake_server,
        tensorwire.start("127.0.0.1:0", tls=_tls(pki, "client")) as client,
    ):
        with pytest.raises(tensorwire.AuthenticationError):
            await client.connect(fake_server.address, connect_timeout=5)


def test_bad_tls_configuration_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(tensorwire.ConfigurationError, match="cert_file"):
        TLSConfig().server_credentials()
    with pytest.raises(tensorwire.ConfigurationError, match="cannot read"):
        TLSConfig(cert_file=str(tmp_path / "missing.crt"), key_file="x").server_credentials()


async def test_certificates_that_do_not_load_are_named(pki, tmp_path: Path) -> None:
    """A garbage certificate, a key of another certificate or a garbage CA bundle used to come
    back as 'cannot bind the control plane ... Failed to bind to address'."""
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("-----BEGIN CERTIFICATE-----\nnot base64 at all\n-----END CERTIFICATE-----\n")
    cert, key = pki["server"]
    cases = [
        (TLSConfig(cert_file=str(garbage), key_file=key), "certificate"),
        (TLSConfig(cert_file=cert, key_file=pki["client"][1]), "another certificate"),
        (TLSConfig(cert_file=cert, key_file=key, ca_file=str(garbage)), "CA bundle"),
    ]
    for tls, what in cases:
        with pytest.raises(tensorwire.ConfigurationError, match=what) as info:
            await tensorwire.start("127.0.0.1:0", tls=tls)
        assert "bind" not in str(info.value)


@pytest.mark.parametrize("kind", ["secp256k1", "dsa"])
async def test_a_key_grpc_cannot_serve_with_is_named_not_called_a_bind_failure(kind: str, tmp_path: Path) -> None:
    """Python's OpenSSL loads a secp256k1 or DSA key and its certificate, which gRPC's TLS library
    (BoringSSL) refuses ("Invalid cert chain file"): the node said "cannot bind the control
    plane to 127.0.0.1:0: Failed to bind to address", of a port 0 anyone can bind."""
    key = ec.generate_private_key(ec.SECP256K1()) if kind == "secp256k1" else dsa.generate_private_key(2048)
    cert, key_file = _write(tmp_path / kind, _cert(kind, key, kind, key), key)
    tls = TLSConfig(cert_file=cert, key_file=key_file, ca_file=cert)
    with pytest.raises(tensorwire.ConfigurationError, match="gRPC's TLS") as info:
        await tensorwire.start("127.0.0.1:0", tls=tls, transports=("tcp",))
    assert "bind" not in str(info.value) and cert in str(info.value), info.value


@pytest.fixture
def encrypted_key(pki, tmp_path: Path) -> str:
    """The server's private key, encrypted with a passphrase (PKCS#8, as ``openssl genpkey
    -aes256`` writes one)."""
    key = serialization.load_pem_private_key(Path(pki["server"][1]).read_bytes(), None)
    path = tmp_path / "encrypted.key"
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"a passphrase"),
        )
    )
    return str(path)


async def test_an_encrypted_private_key_is_named_not_prompted_for(pki, encrypted_key: str) -> None:
    """gRPC takes no passphrase, so a key that needs one cannot serve. Loading it to check it,
    OpenSSL asked for the passphrase on the terminal ("Enter PEM pass phrase:"): start() blocked
    the event loop on that prompt for good, and with no terminal to ask on a bare OSError (EINVAL)
    escaped the error tree. It is a ConfigurationError naming the key, serving or connecting."""
    cert = pki["server"][0]
    tls = TLSConfig(cert_file=cert, key_file=encrypted_key, ca_file=pki["ca"][0])
    with pytest.raises(tensorwire.ConfigurationError, match="encrypted") as info:
        await tensorwire.start("127.0.0.1:0", tls=tls)
    assert encrypted_key in str(info.value)
    with pytest.raises(tensorwire.ConfigurationError, match="encrypted"):
        tls.channel_credentials()


async def test_a_server_certificate_for_another_name_is_an_authentication_error(pki) -> None:
    """It used to be 'cannot reach a tensorwire node' (ControlPlaneError)."""
    async with tensorwire.start("127.0.0.1:0", tls=_tls(pki, "server")) as server:
        cert, key = pki["client"]
        other = TLSConfig(cert_file=cert, key_file=key, ca_file=pki["ca"][0], server_name="not-the-server")
        async with tensorwire.start("127.0.0.1:0", tls=other) as client:
            with pytest.raises(tensorwire.AuthenticationError):
                await client.connect(server.address, connect_timeout=5)


def _named(pki, tmp_path: Path, name: str, *, server_name: str | None = None) -> TLSConfig:
    """Mutual TLS with a certificate, signed by the test CA, that carries ``name`` alone (no
    address): a node's own certificate, as a PKI per host issues them."""
    ca_cert = x509.load_pem_x509_certificate(Path(pki["ca"][0]).read_bytes())
    ca_key = serialization.load_pem_private_key(Path(pki["ca"][1]).read_bytes(), password=None)
    key = _key()
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(name))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
        .sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    )
    cert_file, key_file = _write(tmp_path / name, cert, key)
    return TLSConfig(
        cert_file=cert_file, key_file=key_file, ca_file=pki["ca"][0], require_client_cert=True, server_name=server_name
    )


async def test_calls_back_to_clients_verify_each_against_the_name_its_certificate_proved(
    pki, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each node with a certificate of its own name (node-a, node-b, node-c), at addresses
    those carry not. A client reaches the server by server_name="node-b"; the server calls
    each client back (lookups, goodbyes) at the control address it gave, and checked the
    certificate there against its own server_name (one name for every call: it cannot be both
    node-a and node-c) or the address: every lookup failed, "TLS handshake ... failed". Under
    mutual TLS the client proved its certificate in the handshake: the call back checks for
    the name that certificate carries."""
    from tensorwire.control._server import _Servicer

    goodbyes: list[int] = []
    leave = _Servicer.Leave

    async def counted(self: _Servicer, request: Any, context: Any) -> Any:
        goodbyes.append(len(request.sessions))
        return await leave(self, request, context)

    monkeypatch.setattr(_Servicer, "Leave", counted)
    slow = {"goodbye_seconds": 10.0}  # (time enough for a TLS setup, loaded or not)
    async with (
        tensorwire.start("127.0.0.1:0", tls=_named(pki, tmp_path, "node-b"), transports=("tcp",), **slow) as server,
        tensorwire.start("127.0.0.1:0", tls=_named(pki, tmp_path, "node-a", server_name="node-b"), **slow) as a,
        tensorwire.start("127.0.0.1:0", tls=_named(pki, tmp_path, "node-c", server_name="node-b"), **slow) as c,
    ):
        for client, value in ((a, 1), (c, 2)):
            client.expose(np.full(4, value), name="w")
            await client.connect(server.address)
            peer = await server.accept()
            handle = await asyncio.wait_for(peer.lookup("w"), 10)
            assert np.array_equal(await peer.read(handle), np.full(4, value))
        # a peer that looked nothing up says its goodbye over a control connection of its own
        await a.connect(server.address)
        await (await server.accept()).aclose()
        assert goodbyes == [1], "the goodbye did not reach the client"


async def test_a_certificate_without_the_name_checked_says_which_name_and_what_to_set(pki, tmp_path: Path) -> None:
    """A server whose certificate lacks the name the client checks (the address's host, or
    server_name) failed with gRPC's words alone ("... Hostname Verification Check failed"),
    which name neither the name nor the setting that chooses it."""
    async with tensorwire.start("127.0.0.1:0", tls=_named(pki, tmp_path, "node-b"), transports=("tcp",)) as server:
        for server_name, checked in ((None, "127.0.0.1"), ("not-node-b", "not-node-b")):
            tls = _named(pki, tmp_path, "node-a", server_name=server_name)
            async with tensorwire.start("127.0.0.1:0", tls=tls, transports=("tcp",)) as client:
                with pytest.raises(tensorwire.AuthenticationError) as info:
                    await client.connect(server.address, connect_timeout=5)
                message = str(info.value)
                assert f"certificate does not carry the name {checked!r}" in message, message
                assert "TLSConfig.server_name" in message, message


def test_the_name_a_call_back_checks_is_one_the_proved_certificate_carries() -> None:
    from tensorwire.control._tls import callback_name

    cert = {"peer_dns": [b"*.pool", b"node-a", b"node-a.lan"], "peer_ip": [b"10.0.0.7"], "x509_common_name": [b"a"]}
    assert callback_name(cert, "node-a.lan") == "node-a.lan"  # (the host called, where it carries it)
    assert callback_name(cert, "NODE-A") == "NODE-A"
    assert callback_name(cert, "10.0.0.7") == "10.0.0.7"
    assert callback_name(cert, "10.0.0.8") == "node-a"  # (its first name that is no wildcard)
    assert callback_name({"peer_dns": [b"*.pool"], "x509_common_name": [b"a"]}, "10.0.0.8") is None
    assert callback_name({"x509_common_name": [b"a"]}, "10.0.0.8") == "a"  # (no DNS name: its common name)
    assert callback_name({"transport_security_type": [b"ssl"]}, "10.0.0.8") is None  # (none proved)


@pytest.mark.timeout(60)
async def test_a_tls_node_that_dies_during_the_tls_setup_is_not_blamed_on_certificates(pki) -> None:
    """A TLS node SIGKILLed while 20 clients connected, 8 times over: 89 of the 160 connects
    raised AuthenticationError ("TLS handshake ... failed: Handshake read failed
    (recvmsg:Connection reset by peer)"), as if it had refused their certificate. A server that
    cuts the TLS setup and then refuses (or drops) a fresh TLS handshake is gone or closing,
    whatever it thought of the certificate: here one that resets the connection after the
    client's hello and stops listening, as a killed process does. (One that refuses a
    certificate completes a fresh handshake: the AuthenticationError tests above.)"""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    port = listener.getsockname()[1]
    loop = asyncio.get_running_loop()

    async def die() -> None:
        conn, _ = await loop.sock_accept(listener)
        with conn:
            await loop.sock_recv(conn, 4096)  # the client's TLS hello
            listener.close()
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = reset

    dying = asyncio.ensure_future(die())
    try:
        async with tensorwire.start("127.0.0.1:0", tls=_tls(pki, "client"), transports=("tcp",)) as client:
            with pytest.raises(tensorwire.ControlPlaneError) as info:
                await client.connect(f"127.0.0.1:{port}", connect_timeout=10)
        assert dying.done()
        assert not isinstance(info.value, tensorwire.AuthenticationError), info.value
        assert "has closed" in str(info.value), info.value
    finally:
        dying.cancel()
        listener.close()


async def test_a_tls_client_at_a_plaintext_node_is_told_that_node_serves_no_tls(pki) -> None:
    """The other way round has its hint (a plaintext client at a TLS node); this way said only
    OpenSSL's WRONG_VERSION_NUMBER."""
    async with (
        tensorwire.start("127.0.0.1:0", transports=("tcp",)) as plaintext,
        tensorwire.start("127.0.0.1:0", tls=_tls(pki, "client"), transports=("tcp",)) as client,
    ):
        with pytest.raises(tensorwire.AuthenticationError, match="does not seem to serve TLS"):
            await client.connect(plaintext.address, connect_timeout=5)


async def test_a_tls_client_at_something_else_without_tls_is_told_it_is_no_node(pki) -> None:
    """A TLS node dialling the wrong port, where an HTTP server or another plaintext gRPC service
    answers, got an AuthenticationError telling it to start that "node" with tls=. It now asks
    in plaintext what answers there, and names it as no tensorwire node, as a plaintext client
    is told; a plaintext node is still told apart (the test above)."""

    async def http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(100)
        writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        writer.close()

    web = await asyncio.start_server(http, "127.0.0.1", 0)
    other = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), other)
    grpc_port = other.add_insecure_port("127.0.0.1:0")
    await other.start()
    try:
        async with tensorwire.start("127.0.0.1:0", tls=_tls(pki, "client"), transports=("tcp",)) as client:
            for port in (web.sockets[0].getsockname()[1], grpc_port):
                with pytest.raises(tensorwire.ControlPlaneError, match="is not a tensorwire node") as info:
                    await client.connect(f"127.0.0.1:{port}", connect_timeout=5)
                assert not isinstance(info.value, tensorwire.AuthenticationError), info.value
                assert "speaks no TLS" in str(info.value) and "check the address and port" in str(info.value)
    finally:
        web.close()
        await other.stop(None)


@pytest.mark.parametrize("mutual", [False, True])
async def test_a_plaintext_node_at_a_tls_node_is_told_that_node_serves_tls(pki, mutual: bool) -> None:
    """It said 'Socket closed (if that node serves TLS, this one needs tls= too)', which a node
    closing during the connect also got. The client now offers that address a TLS handshake,
    sees it answered, and says so: an AuthenticationError that names tls=."""
    async with (
        tensorwire.start("127.0.0.1:0", tls=_tls(pki, "server", mutual=mutual), transports=("tcp",)) as server,
        tensorwire.start("127.0.0.1:0", transports=("tcp",)) as plaintext,
    ):
        with pytest.raises(
            tensorwire.AuthenticationError, match=r"serves TLS, and it closed this node's plaintext"
        ) as info:
            await plaintext.connect(server.address, connect_timeout=5)
        assert "start this node with tls= too" in str(info.value), info.value
        async with tensorwire.start("127.0.0.1:0", tls=_tls(pki, "client")) as client:
            await _exchange(client, server)


@pytest.mark.parametrize(
    "bad",
    [
        {"require_client_cert": "no"},  # truthy: it would switch mutual TLS on
        {"require_client_cert": None},
        {"server_name": 5},
        {"server_name": ""},
        {"cert_file": 123},
        {"ca_file": ""},
    ],
)
def test_tls_config_refuses_values_that_are_not_what_they_seem(bad: dict[str, object]) -> None:
    with pytest.raises(tensorwire.ConfigurationError, match="TLSConfig"):
        TLSConfig(**bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", [" node-a", "node a", "https://node-a", "node-a/", "node-a\n", "node-a:http"])
def test_a_server_name_no_host_has_is_refused_not_blamed_on_the_certificate(name: str) -> None:
    """A server_name with a space, a scheme or a path was taken, and every connect then failed
    as a refused certificate ("TLS handshake ... failed: ... Hostname Verification Check
    failed", AuthenticationError). Names a host may have (and an address, with or without its
    port, which gRPC checks by its host) are still taken."""
    with pytest.raises(tensorwire.ConfigurationError, match=r"TLSConfig\.server_name"):
        TLSConfig(server_name=name)
    for good in ("node-a", "node-a.lan.", "xn--bcher-kva.example", "10.0.0.5", "::1", "[::1]", "localhost:5000"):
        assert TLSConfig(server_name=good).server_name == good


def test_tls_config_takes_paths(tmp_path: Path) -> None:
    config = TLSConfig(cert_file=tmp_path / "c.pem", key_file=tmp_path / "k.pem")  # type: ignore[arg-type]
    assert config.cert_file == str(tmp_path / "c.pem") and config.require_client_cert is False


@pytest.mark.timeout(60)
async def test_a_tls_node_closes_whole_when_its_certificate_files_are_gone(pki, tmp_path: Path) -> None:
    """A TLS node that accepted a peer says goodbye to that peer's node as it closes, over a
    control connection it opens for that, whose credentials are read from the TLSConfig's files
    then. Where those files had gone (a temporary directory cleaned up, certificates rotated
    away), that ConfigurationError escaped the goodbye ("best effort"), and ``aclose()`` raised
    it half way: the node's peers stayed open, its gRPC server kept serving and its ports stayed
    bound. The goodbye is given up instead, and the node closes."""
    cert, key = (shutil.copy(f, tmp_path) for f in pki["server"])  # (the module's files stay)
    server = await tensorwire.start(
        "127.0.0.1:0", tls=TLSConfig(cert_file=cert, key_file=key, ca_file=pki["ca"][0]), transports=("tcp",)
    )
    try:
        async with tensorwire.start("127.0.0.1:0", tls=_tls(pki, "client"), transports=("tcp",)) as client:
            peer = await client.connect(server.address)
            accepted = await server.accept()
            os.remove(key)
            await server.aclose()
            assert accepted.closed
            await eventually(lambda: peer.closed)
            with socket.socket() as sock:  # the control port is free again
                sock.bind(("127.0.0.1", int(server.address.rpartition(":")[2])))
    finally:
        server.abort()
