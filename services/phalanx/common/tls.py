"""Mutual TLS between Phalanx services: certificates, the process's credentials, and who a peer is.

Every process reads its certificate, key and CA from one directory in the
layout of a cert-manager secret (``tls.crt``, ``tls.key``, ``ca.crt``),
named by ``PHALANX_TLS_DIR`` (or the three files one by one). With it set,
its gRPC server accepts only peers whose certificate the CA signed, and every
channel it opens to another service presents its own certificate: the
certificate is the service's identity (SAN URI ``spiffe://phalanx/<name>``,
also the CN). Unset, everything runs in plaintext: a development mode that
logs a warning once.

``phalanx certs init`` makes a development CA and a certificate per service
(``init_certs``); production issues the same files from cert-manager.

Servers are reached by the addresses they register (pod IPs, loopback), which
no certificate can list in advance, so a service checks a server's
certificate against one fixed name every Phalanx server certificate carries,
``PHALANX_TLS_SERVER_NAME`` (default ``phalanx.internal``), not against the
address. Client-only certificates (``client``, ``admin``) do not carry it, so
a tenant cannot pose as a service.
"""

from __future__ import annotations

import datetime
import functools
import ipaddress
import logging
import os
import ssl
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

if TYPE_CHECKING:
    from phalanx.client import TlsConfig as ClientTlsConfig

__all__ = [
    "CA_FILE",
    "CERT_FILE",
    "CLIENT_IDENTITIES",
    "ClientTls",
    "DEFAULT_SERVER_NAME",
    "INFRA_IDENTITIES",
    "KEY_FILE",
    "SERVICE_IDENTITIES",
    "SPIFFE_PREFIX",
    "ServiceTls",
    "TlsSettings",
    "identity_of_certificate",
    "init_certs",
    "open_channel",
    "peer_identity",
    "process_tls",
    "resolve_client_tls",
    "sdk_tls",
    "set_process_tls",
]

log = logging.getLogger(__name__)

# The file names of a cert-manager Certificate's secret (kubernetes.io/tls plus ca.crt).
CERT_FILE = "tls.crt"
KEY_FILE = "tls.key"
CA_FILE = "ca.crt"
CA_KEY_FILE = "ca.key"
SPIFFE_PREFIX = "spiffe://phalanx/"
DEFAULT_SERVER_NAME = "phalanx.internal"

# Identities that serve (their certificates are also server certificates).
SERVICE_IDENTITIES = (
    "router", "gateway", "worker", "expert-worker", "health", "migration", "checkpoint-store", "planner", "ert-manager",
    "encoder-pool", "memory-service",
)
# Identities that only call: an operator (admin RPCs) and a tenant's application (the public RPCs).
CLIENT_IDENTITIES = ("admin", "client")
# The servers Phalanx depends on (etcd, NATS): server certificates named after themselves (not ``phalanx.internal``,
# so they cannot pose as a Phalanx service), plus client authentication for etcd's peers and probes.
INFRA_IDENTITIES = ("etcd", "nats")


class TlsSettings(BaseSettings):
    """This process's mTLS files (env prefix ``PHALANX_TLS_``); none set: plaintext (development only)."""

    model_config = SettingsConfigDict(env_prefix="PHALANX_TLS_", extra="forbid", frozen=True)

    dir: str = Field("", description="Directory holding tls.crt, tls.key and ca.crt (a cert-manager secret mounted as is)")
    cert_file: str = Field("", description="PEM certificate chain, instead of <dir>/tls.crt")
    key_file: str = Field("", description="PEM private key, instead of <dir>/tls.key")
    ca_file: str = Field("", description="PEM CA bundle that signs every peer, instead of <dir>/ca.crt")
    server_name: str = Field(
        DEFAULT_SERVER_NAME, description="Name every server certificate carries; checked instead of the address dialled"
    )

    @model_validator(mode="after")
    def _check_complete(self) -> TlsSettings:
        given = [bool(self.cert_file), bool(self.key_file), bool(self.ca_file)]
        if not self.dir and any(given) and not all(given):
            raise ValueError("PHALANX_TLS_CERT_FILE, _KEY_FILE and _CA_FILE go together (or set PHALANX_TLS_DIR)")
        return self

    @property
    def enabled(self) -> bool:
        return bool(self.dir or self.cert_file)

    def files(self) -> tuple[Path, Path, Path]:
        """(certificate, key, CA) paths."""
        base = Path(self.dir)
        return (
            Path(self.cert_file) if self.cert_file else base / CERT_FILE,
            Path(self.key_file) if self.key_file else base / KEY_FILE,
            Path(self.ca_file) if self.ca_file else base / CA_FILE,
        )


@dataclass(frozen=True)
class ServiceTls:
    """One identity's PEM certificate, key and CA, read once: server and channel credentials of a process."""

    certificate: bytes
    private_key: bytes = field(repr=False)  # never in a log line or a traceback's locals
    ca: bytes
    server_name: str = DEFAULT_SERVER_NAME

    @classmethod
    def load(cls, settings: TlsSettings) -> ServiceTls:
        cert, key, ca = settings.files()
        missing = [str(p) for p in (cert, key, ca) if not p.is_file()]
        if missing:
            raise FileNotFoundError(f"TLS is configured but these files are missing: {', '.join(missing)} (run `phalanx certs init`)")
        return cls(cert.read_bytes(), key.read_bytes(), ca.read_bytes(), settings.server_name)

    @classmethod
    def from_dir(cls, directory: str | os.PathLike[str], *, server_name: str = DEFAULT_SERVER_NAME) -> ServiceTls:
        return cls.load(TlsSettings(dir=str(directory), server_name=server_name))

    @property
    def identity(self) -> str | None:
        """The identity this process presents (``router``, ``admin`` …)."""
        return identity_of_certificate(self.certificate)

    def server_credentials(self) -> grpc.ServerCredentials:
        """A server that accepts only clients with a certificate the CA signed."""
        return grpc.ssl_server_credentials([(self.private_key, self.certificate)], root_certificates=self.ca, require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """A client that presents this certificate and trusts only servers the CA signed."""
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.private_key, certificate_chain=self.certificate)

    def client_config(self) -> ClientTlsConfig:
        """The same credentials for the SDK (``Client.connect(..., tls=...)``)."""
        from phalanx.client import TlsConfig as SdkTlsConfig

        return SdkTlsConfig(
            root_certificates=self.ca, private_key=self.private_key, certificate_chain=self.certificate,
            server_name_override=self.server_name or None,
        )

    @functools.cached_property
    def _signing_key(self) -> Any:
        from cryptography.hazmat.primitives import serialization

        return serialization.load_pem_private_key(self.private_key, None)

    def sign(self, payload: bytes) -> bytes:
        """``payload`` signed with this identity's private key (SHA-256; ECDSA, or RSA PKCS#1 v1.5)."""
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa

        key = self._signing_key
        if isinstance(key, ec.EllipticCurvePrivateKey):
            return key.sign(payload, ec.ECDSA(hashes.SHA256()))
        if isinstance(key, rsa.RSAPrivateKey):
            return key.sign(payload, padding.PKCS1v15(), hashes.SHA256())
        raise ValueError(f"cannot sign with a {type(key).__name__}")

    def verify_signed(self, payload: bytes, signature: bytes, certificate_pem: bytes) -> str:
        """The identity of ``certificate_pem`` if the CA issued it, it is valid now and it signed ``payload``; ValueError if not."""
        from cryptography import x509
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa

        try:
            certificate = x509.load_pem_x509_certificate(certificate_pem)
            certificate.verify_directly_issued_by(x509.load_pem_x509_certificate(self.ca))
            now = datetime.datetime.now(datetime.UTC)
            if not certificate.not_valid_before_utc <= now <= certificate.not_valid_after_utc:
                raise ValueError("the certificate is expired or not yet valid")
            key = certificate.public_key()
            if isinstance(key, ec.EllipticCurvePublicKey):
                key.verify(signature, payload, ec.ECDSA(hashes.SHA256()))
            elif isinstance(key, rsa.RSAPublicKey):
                key.verify(signature, payload, padding.PKCS1v15(), hashes.SHA256())
            else:
                raise ValueError(f"cannot verify a {type(key).__name__} signature")
        except (InvalidSignature, TypeError) as error:
            raise ValueError(f"not signed by a certificate of this CA: {type(error).__name__}") from error
        identity = identity_of_certificate(certificate_pem)
        if identity is None:
            raise ValueError("the certificate names no identity")
        return identity

    def channel_options(self) -> list[tuple[str, Any]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


@dataclass(frozen=True)
class ClientTls:
    """TLS of this process's connection to a server that is not a Phalanx service (etcd, NATS).

    ``ca_file``: the CA bundle that signs the server's certificate (None: the system's roots); ``cert_file`` and
    ``key_file``: the client certificate presented to a server that wants one (mTLS; None: none presented);
    ``server_name``: the name the server's certificate is checked against instead of the host dialled ("": the host).
    """

    what: str  # "etcd", "NATS": named in every error
    ca_file: Path | None
    cert_file: Path | None
    key_file: Path | None
    server_name: str = ""

    def _read(self) -> tuple[bytes | None, bytes | None, bytes | None]:
        paths = (self.ca_file, self.cert_file, self.key_file)
        missing = [str(p) for p in paths if p is not None and not p.is_file()]
        if missing:
            raise FileNotFoundError(f"{self.what} TLS is configured but these files are missing: {', '.join(missing)}")
        ca, cert, key = (None if p is None else p.read_bytes() for p in paths)
        return ca, cert, key

    def grpc_credentials(self) -> grpc.ChannelCredentials:
        """gRPC channel credentials: trust the CA (or the system's roots), present the client certificate if any."""
        ca, cert, key = self._read()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)

    def ssl_context(self) -> ssl.SSLContext:
        """A client SSLContext (TLS 1.2 or newer, the server's certificate and name verified) with the client certificate."""
        self._read()  # the same clear error for a missing file
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=None if self.ca_file is None else str(self.ca_file))
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        if self.cert_file is not None and self.key_file is not None:
            context.load_cert_chain(str(self.cert_file), str(self.key_file))
        return context


def resolve_client_tls(
    what: str, *, tls_dir: str = "", ca_file: str = "", cert_file: str = "", key_file: str = "", server_name: str = "",
) -> ClientTls | None:
    """The ClientTls of a connection's settings, None when none is set (plaintext).

    ``tls_dir`` holds ``ca.crt``, ``tls.crt`` and ``tls.key`` (a cert-manager secret), each ``*_file`` given replaces
    its file there; without ``tls_dir``, no ``ca_file`` means the system's roots, no ``cert_file`` no client certificate.
    """
    if not (tls_dir or ca_file or cert_file or key_file):
        return None

    def pick(given: str, name: str) -> Path | None:
        if given:
            return Path(given)
        return Path(tls_dir) / name if tls_dir else None

    cert, key = pick(cert_file, CERT_FILE), pick(key_file, KEY_FILE)
    if (cert is None) != (key is None):
        raise ValueError(f"{what} TLS: a client certificate and its key go together (got only the {'certificate' if key is None else 'key'})")
    return ClientTls(what, pick(ca_file, CA_FILE), cert, key, server_name)


_process_tls: ServiceTls | None = None
_process_tls_set = False


def sdk_tls() -> ClientTlsConfig | None:
    """The process's credentials for the SDK (the gateway's and the CLI's router calls); None when TLS is off."""
    tls = process_tls()
    return None if tls is None else tls.client_config()


def set_process_tls(tls: ServiceTls | None) -> None:
    """The credentials every channel this process opens uses (None: plaintext); overrides the environment."""
    global _process_tls, _process_tls_set
    _process_tls, _process_tls_set = tls, True


def process_tls() -> ServiceTls | None:
    """This process's credentials: what ``set_process_tls`` set, else ``PHALANX_TLS_*`` read once; None when TLS is off."""
    global _process_tls, _process_tls_set
    if not _process_tls_set:
        settings = TlsSettings()
        _process_tls = ServiceTls.load(settings) if settings.enabled else None
        _process_tls_set = True
    return _process_tls


@functools.cache
def warn_plaintext(name: str) -> None:
    """Logs once per process that ``name`` serves without TLS."""
    log.warning(
        "%s serves gRPC in plaintext with no authentication (development only): set PHALANX_TLS_DIR "
        "(see `phalanx certs init` and docs/security.md)", name,
    )


def open_channel(
    address: str, *, options: Sequence[tuple[str, Any]] = (), interceptors: Sequence[Any] | None = None,
    tls: ServiceTls | None | bool = True,
) -> grpc.aio.Channel:
    """A channel to another Phalanx service: mutual TLS with the process's certificate when TLS is on, else plaintext.

    ``tls``: True for the process's credentials, a ServiceTls for those, None or False for plaintext.
    """
    credentials = process_tls() if tls is True else (tls or None)
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=list(options), interceptors=interceptors)
    merged = {**dict(credentials.channel_options()), **dict(options)}
    return grpc.aio.secure_channel(address, credentials.channel_credentials(), options=list(merged.items()), interceptors=interceptors)


# -- identities --------------------------------------------------------------------------------
def identity_of_certificate(pem: bytes) -> str | None:
    """The Phalanx identity of a PEM certificate: its ``spiffe://phalanx/<name>`` SAN URI, else its CN; None without either."""
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    certificate = x509.load_pem_x509_certificate(pem)
    try:
        san = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        san = None
    if san is not None:
        for uri in san.get_values_for_type(x509.UniformResourceIdentifier):
            if uri.startswith(SPIFFE_PREFIX) and len(uri) > len(SPIFFE_PREFIX):
                return uri[len(SPIFFE_PREFIX):]
    names = certificate.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(names[0].value) if names else None


def peer_identity(context: grpc.aio.ServicerContext) -> str | None:
    """Who called: the identity in the peer's verified certificate; None over plaintext or without a certificate."""
    auth = context.auth_context()
    for uri in auth.get("peer_spiffe_id", []) + auth.get("x509_subject_alternative_name", []):
        text = uri.decode(errors="replace")
        if text.startswith(SPIFFE_PREFIX) and len(text) > len(SPIFFE_PREFIX):
            return text[len(SPIFFE_PREFIX):]
    pem = auth.get("x509_pem_cert")
    if pem:
        return identity_of_certificate(pem[0])
    names = auth.get("x509_common_name")
    return names[0].decode(errors="replace") if names else None


# -- certificates ----------------------------------------------------------------------------------
def _write(path: Path, data: bytes, *, secret: bool) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # The key is created 0600 (no window in which another user could read it).
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if secret else 0o644)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    os.chmod(path, 0o600 if secret else 0o644)


def _new_key() -> Any:
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def _load_or_make_ca(directory: Path, days: int) -> tuple[Any, Any]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import NameOID

    cert_path, key_path = directory / CA_FILE, directory / CA_KEY_FILE
    if cert_path.is_file() and key_path.is_file():
        return x509.load_pem_x509_certificate(cert_path.read_bytes()), serialization.load_pem_private_key(key_path.read_bytes(), None)
    key = _new_key()
    name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Phalanx"), x509.NameAttribute(NameOID.COMMON_NAME, "Phalanx development CA")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False, key_encipherment=False,
            data_encipherment=False, key_agreement=False, encipher_only=False, decipher_only=False,
        ), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    _write(key_path, _pem_key(key), secret=True)
    _write(cert_path, certificate.public_bytes(serialization.Encoding.PEM), secret=False)
    return certificate, key


def issue_certificate(
    ca_certificate: Any, ca_key: Any, identity: str, *, server: bool, hosts: Iterable[str] = (), days: int = 365,
    server_name: str = DEFAULT_SERVER_NAME,
) -> tuple[bytes, bytes]:
    """(certificate PEM, key PEM) of ``identity``, signed by the CA; a ``server`` one also names localhost, 127.0.0.1,
    ``server_name`` and ``hosts``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = _new_key()
    names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(SPIFFE_PREFIX + identity)]
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH]
    if server:
        usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
        for host in dict.fromkeys([server_name, "localhost", identity, *hosts, "127.0.0.1"]):
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                names.append(x509.DNSName(host))
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Phalanx"), x509.NameAttribute(NameOID.COMMON_NAME, identity)]))
        .issuer_name(ca_certificate.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return certificate.public_bytes(serialization.Encoding.PEM), _pem_key(key)


def init_certs(
    directory: str | os.PathLike[str], identities: Sequence[str] = (*SERVICE_IDENTITIES, *CLIENT_IDENTITIES, *INFRA_IDENTITIES), *,
    hosts: Sequence[str] = (), days: int = 365, server_name: str = DEFAULT_SERVER_NAME, force: bool = False,
) -> list[Path]:
    """A development CA in ``directory`` (kept if there is one) and ``<directory>/<identity>/{tls.crt,tls.key,ca.crt}``
    for each identity not issued yet (every one with ``force``); returns the identity directories written. ``etcd`` and
    ``nats`` (INFRA_IDENTITIES) get server certificates for those servers' TLS, named after themselves."""
    from cryptography.hazmat.primitives import serialization

    if days < 1:
        raise ValueError("days must be at least 1")
    root = Path(directory)
    ca_certificate, ca_key = _load_or_make_ca(root, days)
    ca_pem = ca_certificate.public_bytes(serialization.Encoding.PEM)
    written = []
    for identity in identities:
        if not identity or "/" in identity or identity.startswith("."):
            raise ValueError(f"not an identity name: {identity!r}")
        target = root / identity
        if not force and (target / CERT_FILE).is_file() and (target / KEY_FILE).is_file():
            continue
        infra = identity in INFRA_IDENTITIES
        certificate, key = issue_certificate(
            ca_certificate, ca_key, identity, server=identity in SERVICE_IDENTITIES or infra, hosts=hosts, days=days,
            server_name=identity if infra else server_name,
        )
        _write(target / KEY_FILE, key, secret=True)
        _write(target / CERT_FILE, certificate, secret=False)
        _write(target / CA_FILE, ca_pem, secret=False)
        written.append(target)
    return written
