"""Channels of the Translator clients: targets, credentials, load balancing and keepalive.

**Several replicas** (client-side load balancing, see ``docs/operations.md``). ``address`` may name
several servers (``"10.0.0.1:50051,10.0.0.2:50051"`` or a list; host names are resolved once, here) or a
name that resolves to several (``"dns:///translator.nmt.svc.cluster.local:50051"``, e.g. a Kubernetes
headless Service; gRPC re-resolves it when a connection drops). Every channel uses gRPC's
``round_robin`` policy, so each call (each retry included) goes to the next ready replica rather than all
of them down one HTTP/2 connection. With several replicas the channel also watches each replica's
``grpc.health.v1`` status for the Translator service (gRPC client-side health checking), so a replica
that starts draining (NOT_SERVING) gets no new calls; ``health_check`` overrides that choice. HTTP/2
keepalive pings (``keepalive`` seconds, default 30) find dead connections (a replica that vanished, a
proxy that dropped an idle connection) between calls' deadlines; the server accepts them that often.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from common.errors import NmtError
from server.protos import SERVICE_NAME

MAX_RECEIVE_BYTES = 64 * 1024 * 1024  # n-best attention matrices of 64 long texts exceed gRPC's 4 MiB default
USER_AGENT = "nmt-client/0.1"
DEFAULT_KEEPALIVE = 30.0  # seconds between HTTP/2 keepalive pings (the server permits one every 10 s)
KEEPALIVE_TIMEOUT = 10.0  # seconds a ping may go unanswered before the connection is declared dead
TARGET_SCHEMES = ("dns:", "ipv4:", "ipv6:", "unix:", "unix-abstract:", "xds:")  # gRPC target URIs, passed as is


def read_pem(value: bytes | str | os.PathLike | None) -> bytes | None:
    """PEM bytes as given, or read from a path (None stays None)."""
    if value is None or isinstance(value, bytes):
        return value
    try:
        return Path(value).read_bytes()
    except OSError as error:
        raise NmtError(f"cannot read certificates from {value}: {error.strerror or error}") from error


def credentials_for(tls: bool, root_certificates: bytes | str | os.PathLike | None,
                 credentials: grpc.ChannelCredentials | None, client_cert: bytes | str | os.PathLike | None = None,
                 client_key: bytes | str | os.PathLike | None = None) -> grpc.ChannelCredentials | None:
    """The channel credentials: ``credentials`` as given, TLS (mutual with a client certificate and key),
    or None for plaintext."""
    if (client_cert is None) != (client_key is None):
        raise ValueError("client_cert and client_key go together (mutual TLS needs the certificate and its key)")
    if credentials is not None:
        return credentials
    if tls or root_certificates is not None or client_cert is not None:
        return grpc.ssl_channel_credentials(root_certificates=read_pem(root_certificates),
                                            private_key=read_pem(client_key),
                                            certificate_chain=read_pem(client_cert))
    return None


def split_addresses(address: str | Sequence[str]) -> list[str]:
    """``address`` as a list: a target URI alone, or the ``host:port`` items of a list or comma-separated string."""
    if isinstance(address, str):
        address = [address] if address.startswith(TARGET_SCHEMES) else address.split(",")
    addresses = [a.strip() for a in address if a.strip()]
    if not addresses:
        raise ValueError("no server address")
    return addresses


def channel_target(address: str | Sequence[str]) -> str:
    """The gRPC target of ``address``: one ``host:port`` or target URI (``dns:///name:port``...) as is;
    several ``host:port`` (a list or a comma-separated string) as one ``ipv4:``/``ipv6:`` target of their
    addresses (host names resolved here, once), which ``round_robin`` balances call by call."""
    addresses = split_addresses(address)
    if len(addresses) == 1:
        return addresses[0]
    if any(a.startswith(TARGET_SCHEMES) for a in addresses):
        raise ValueError(f"several addresses must each be host:port, got {addresses}")
    hosts: list[tuple[dict[socket.AddressFamily, str], str]] = []
    for item in addresses:
        host, _, port = item.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"{item!r} is not host:port")
        try:
            infos = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
        except OSError as error:
            raise NmtError(f"cannot resolve {host}: {error}") from None
        found: dict[socket.AddressFamily, str] = {}
        for family, _, _, _, sockaddr in infos:
            found.setdefault(family, sockaddr[0])
        hosts.append((found, port))
    for family, scheme, form in ((socket.AF_INET, "ipv4:", "{}:{}"), (socket.AF_INET6, "ipv6:", "[{}]:{}")):
        if all(family in found for found, _ in hosts):
            return scheme + ",".join(form.format(found[family], port) for found, port in hosts)
    raise ValueError("several addresses must all have IPv4 or all IPv6 addresses (gRPC's ipv4:/ipv6: targets)")


def service_config(*, health_check: bool) -> str:
    """The channel's service config: ``round_robin`` over every resolved address and, with ``health_check``,
    only over those whose health for the Translator service is SERVING (gRPC client-side health checking)."""
    config: dict[str, Any] = {"loadBalancingConfig": [{"round_robin": {}}]}
    if health_check:
        config["healthCheckConfig"] = {"serviceName": SERVICE_NAME}
    return json.dumps(config)


def channel_options(extra: Sequence[tuple[str, Any]], *, health_check: bool,
                     keepalive: float | None) -> list[tuple[str, Any]]:
    """gRPC channel arguments: message size, user agent, the service config, keepalive, then ``extra``."""
    options: dict[str, Any] = {"grpc.max_receive_message_length": MAX_RECEIVE_BYTES,
                               "grpc.primary_user_agent": USER_AGENT,
                               "grpc.service_config": service_config(health_check=health_check)}
    if keepalive is not None:
        options.update({"grpc.keepalive_time_ms": int(keepalive * 1000),
                        "grpc.keepalive_timeout_ms": int(KEEPALIVE_TIMEOUT * 1000)})
    options.update(dict(extra))
    return list(options.items())
