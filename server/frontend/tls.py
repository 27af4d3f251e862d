"""TLS and mutual TLS for the gRPC port, from ``ServerConfig``'s ``tls_cert``, ``tls_key`` and ``tls_client_ca``.

* neither ``tls_cert`` nor ``tls_key``: plaintext (the default, for a loopback development server or
  behind a TLS-terminating proxy);
* ``tls_cert`` and ``tls_key`` (PEM: the certificate chain, leaf first, and its private key): TLS;
* and ``tls_client_ca`` (PEM CA certificates): mutual TLS, every client must present a certificate
  signed by one of these CAs, or the handshake fails (the client sees UNAVAILABLE).

The files are read once at start-up; replacing them needs a restart. Unreadable files and files that
hold no PEM block of the right kind fail start-up with an :class:`NmtError` naming the flag and file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc

from common.errors import NmtError


def tls_mode(config: Any) -> str:
    """``"off"``, ``"tls"`` or ``"mtls"``."""
    if not config.tls_cert:
        return "off"
    return "mtls" if config.tls_client_ca else "tls"


def server_credentials(config: Any) -> grpc.ServerCredentials | None:
    """The gRPC port's credentials (``None``: plaintext)."""
    if tls_mode(config) == "off":
        return None
    key = read_pem("tls_key", config.tls_key, "PRIVATE KEY")
    chain = read_pem("tls_cert", config.tls_cert, "CERTIFICATE")
    client_ca = read_pem("tls_client_ca", config.tls_client_ca, "CERTIFICATE") if config.tls_client_ca else None
    return grpc.ssl_server_credentials([(key, chain)], root_certificates=client_ca,
                                       require_client_auth=client_ca is not None)


def read_pem(name: str, path: str, kind: str) -> bytes:
    """The bytes of a PEM file that holds at least one ``-----BEGIN ...{kind}-----`` block."""
    try:
        data = Path(path).read_bytes()
    except OSError as error:
        raise NmtError(f"{name}: cannot read {path}: {error.strerror or error}") from error
    if b"-----BEGIN " not in data or f"{kind}-----".encode() not in data:
        raise NmtError(f"{name}: {path} holds no PEM {kind} (-----BEGIN ...{kind}-----)")
    return data
