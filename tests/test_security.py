"""TLS, mutual TLS, bearer tokens and reflection, against real servers on loopback with the tiny models.

The session makes a throwaway PKI with ``cryptography``: a CA, a server certificate for 127.0.0.1 and
localhost, a client certificate from the same CA, and a second CA with a client certificate of its own
(the one the mTLS server must refuse). The servers serve the session's two tiny models
(``tests/conftest.py``): ``tiny-bahdanau`` (the default model: first by name) and ``tiny-transformer``.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from clients.client import TranslatorClient
from clients.messages import TranslationError
from common.errors import NmtError
from nmt.cli import main as nmt_main
from server.config import ServerConfig
from server.frontend.auth import Authenticator
from server.protos import SERVICE_NAME, pb2, pb2_grpc
from tests.harness import ServerHarness

UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED
PERMISSION_DENIED = grpc.StatusCode.PERMISSION_DENIED
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
ADMIN_TOKEN = "admin-0123456789abcdef"  # every model
PARTNER_TOKEN = "partner.token_for-the+transformer/only="  # tiny-transformer only
WRONG_TOKEN = "wrong-0123456789abcdef"
ONE_ATTEMPT = {"max_attempts": 1, "timeout": 10}


# ---- a throwaway PKI -----------------------------------------------------------------------------------


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _certificate(subject: str, key: Any, issuer: tuple[x509.Certificate, Any] | None, *, ca: bool = False,
                 hosts: tuple[str, ...] = (), client: bool = False) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    issuer_name, issuer_key = (issuer[0].subject, issuer[1]) if issuer else (_name(subject), key)
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer_name)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ca:
        builder = builder.add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
            key_encipherment=False, data_encipherment=False, key_agreement=False, encipher_only=False,
            decipher_only=False), critical=True)
    if hosts:
        names = [x509.IPAddress(ipaddress.ip_address(h)) if h[0].isdigit() else x509.DNSName(h) for h in hosts]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    usage = [x509.ExtendedKeyUsageOID.CLIENT_AUTH] if client else [x509.ExtendedKeyUsageOID.SERVER_AUTH] * bool(hosts)
    if usage:
        builder = builder.add_extension(x509.ExtendedKeyUsage(usage), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write(directory: Path, name: str, certificate: x509.Certificate, key: Any) -> tuple[Path, Path]:
    cert_path, key_path = directory / f"{name}.pem", directory / f"{name}.key"
    cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """PEM files: ``ca``, ``server``/``server_key``, ``client``/``client_key``, ``other_ca``, ``stranger``/
    ``stranger_key`` (a client certificate from the other CA)."""
    directory = tmp_path_factory.mktemp("pki")
    files: dict[str, Path] = {}
    for ca_name, leaf in (("ca", "client"), ("other_ca", "stranger")):
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_cert = _certificate(f"nmt test {ca_name}", ca_key, None, ca=True)
        files[ca_name], _ = _write(directory, ca_name, ca_cert, ca_key)
        leaf_key = ec.generate_private_key(ec.SECP256R1())
        files[leaf], files[f"{leaf}_key"] = _write(
            directory, leaf, _certificate(f"nmt test {leaf}", leaf_key, (ca_cert, ca_key), client=True), leaf_key)
        if ca_name == "ca":
            server_key = ec.generate_private_key(ec.SECP256R1())
            server_cert = _certificate("localhost", server_key, (ca_cert, ca_key), hosts=("127.0.0.1", "localhost"))
            files["server"], files["server_key"] = _write(directory, "server", server_cert, server_key)
    return files


# ---- servers -------------------------------------------------------------------------------------------


def config_for(repository: Path, **changes: Any) -> ServerConfig:
    base = ServerConfig(listen="127.0.0.1:0", metrics_listen="", http_listen="", model_repository=str(repository),
                        provider="cpu", intra_op_threads=1, grace_seconds=1)
    return base.with_(**changes)


@pytest.fixture(scope="module")
def repository(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's two tiny models, one version each, in a repository of this module's own (other
    modules add versions to the session's repository)."""
    import shutil

    root = tmp_path_factory.mktemp("security-models")
    for arch, version_dir in tiny_models.items():
        shutil.copytree(version_dir, root / f"tiny-{arch}" / "1")
    return root


@pytest.fixture(scope="module")
def tokens_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("auth") / "tokens"
    path.write_text(f"# operators\n{ADMIN_TOKEN}\n\n  # the partner\n{PARTNER_TOKEN}  tiny-transformer  # renewed\n")
    return path


@pytest.fixture(scope="module")
def tls_auth(repository: Path, pki: dict[str, Path],
             tokens_file: Path) -> Iterator[ServerHarness]:
    """TLS (no client certificates) with bearer tokens."""
    h = ServerHarness(config_for(repository, tls_cert=str(pki["server"]), tls_key=str(pki["server_key"]),
                                 auth_tokens_file=str(tokens_file)))
    yield h
    h.close()


@pytest.fixture(scope="module")
def mtls(repository: Path, pki: dict[str, Path]) -> Iterator[ServerHarness]:
    """Mutual TLS: client certificates signed by ``ca`` required; no tokens."""
    h = ServerHarness(config_for(repository, tls_cert=str(pki["server"]), tls_key=str(pki["server_key"]),
                                 tls_client_ca=str(pki["ca"])))
    yield h
    h.close()


def tls_client(h: ServerHarness, pki: dict[str, Path], **kwargs: Any) -> TranslatorClient:
    return TranslatorClient(h.address, root_certificates=str(pki["ca"]), **ONE_ATTEMPT, **kwargs)


def wait_for(condition: Any, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


def failure(call: Any) -> TranslationError:
    with pytest.raises(TranslationError) as info:
        call()
    return info.value


# ---- TLS and mutual TLS --------------------------------------------------------------------------------


def test_tls_client_with_the_right_ca_translates(tls_auth: ServerHarness, pki: dict[str, Path]) -> None:
    with tls_client(tls_auth, pki, token=ADMIN_TOKEN) as client:
        [result] = client.translate("one two", model="tiny-transformer")
        assert result.best.text and result.model == "tiny-transformer"
    address = f"localhost:{tls_auth.port}"  # the certificate names both 127.0.0.1 and localhost
    with TranslatorClient(address, root_certificates=pki["ca"].read_bytes(), token=ADMIN_TOKEN) as client:
        assert client.health() == "SERVING"


def test_plaintext_and_untrusting_clients_fail_on_a_tls_port(tls_auth: ServerHarness, pki: dict[str, Path]) -> None:
    with TranslatorClient(tls_auth.address, token=ADMIN_TOKEN, **ONE_ATTEMPT) as plaintext:
        assert failure(lambda: plaintext.translate("one")).code == UNAVAILABLE
        assert failure(lambda: plaintext.health()).code == UNAVAILABLE
    with TranslatorClient(tls_auth.address, root_certificates=str(pki["other_ca"]), token=ADMIN_TOKEN,
                          **ONE_ATTEMPT) as untrusting:  # the server's certificate is not from this CA
        assert failure(lambda: untrusting.translate("one")).code == UNAVAILABLE


def test_mtls_accepts_a_client_certificate_from_the_ca(mtls: ServerHarness, pki: dict[str, Path]) -> None:
    with tls_client(mtls, pki, client_cert=pki["client"], client_key=pki["client_key"]) as client:
        assert client.translate("three four")[0].best.text
        assert {m.name for m in client.list_models()} == {"tiny-bahdanau", "tiny-transformer"}


@pytest.mark.parametrize("certificate", [None, "stranger"], ids=["no client certificate", "another CA's"])
def test_mtls_refuses_other_clients(mtls: ServerHarness, pki: dict[str, Path], certificate: str | None) -> None:
    extra = {} if certificate is None else {"client_cert": pki[certificate], "client_key": pki[f"{certificate}_key"]}
    started = {"grpc_type": "UNARY", "grpc_service": SERVICE_NAME, "grpc_method": "Translate"}
    before = mtls.metric("grpc_server_started_total", started)
    with tls_client(mtls, pki, **extra) as client:
        assert failure(lambda: client.translate("one")).code == UNAVAILABLE
        assert failure(lambda: client.health()).code == UNAVAILABLE  # refused at the handshake: health too
    assert mtls.metric("grpc_server_started_total", started) == before  # no call ever started


def test_tls_configuration_errors(repository: Path, pki: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(NmtError, match="tls_cert is set but tls_key is not"):
        config_for(repository, tls_cert=str(pki["server"]))
    with pytest.raises(NmtError, match="tls_key is set but tls_cert is not"):
        config_for(repository, tls_key=str(pki["server_key"]))
    with pytest.raises(NmtError, match="tls_client_ca .* needs TLS"):
        config_for(repository, tls_client_ca=str(pki["ca"]))
    from server.frontend.app import TranslationServer

    missing = str(tmp_path / "missing.pem")
    with pytest.raises(NmtError, match=f"tls_cert: cannot read {missing}"):
        TranslationServer(config_for(repository, tls_cert=missing, tls_key=str(pki["server_key"])))
    with pytest.raises(NmtError, match="tls_key: .* holds no PEM PRIVATE KEY"):  # cert and key swapped
        TranslationServer(config_for(repository, tls_cert=str(pki["server"]), tls_key=str(pki["server"])))


# ---- bearer tokens -------------------------------------------------------------------------------------


def test_the_right_token_translates_and_lists_every_model(tls_auth: ServerHarness, pki: dict[str, Path]) -> None:
    with tls_client(tls_auth, pki, token=ADMIN_TOKEN) as client:
        assert client.translate("one two")[0].model == "tiny-bahdanau"  # the default model
        assert {m.name for m in client.list_models()} == {"tiny-bahdanau", "tiny-transformer"}


@pytest.mark.parametrize("metadata", [(), (("authorization", f"Bearer {WRONG_TOKEN}"),),
                                      (("authorization", f"Basic {ADMIN_TOKEN}"),), (("authorization", "Bearer"),)],
                         ids=["missing", "wrong", "not bearer", "empty"])
def test_missing_or_wrong_token_is_unauthenticated(tls_auth: ServerHarness, pki: dict[str, Path],
                                                   metadata: tuple) -> None:
    channel = grpc.secure_channel(tls_auth.address, grpc.ssl_channel_credentials(pki["ca"].read_bytes()))
    stub = pb2_grpc.TranslatorStub(channel)
    request = pb2.TranslateRequest(texts=["one"], model="tiny-transformer")
    calls = [lambda: stub.Translate(request, metadata=metadata, timeout=10),
             lambda: stub.ListModels(pb2.ListModelsRequest(), metadata=metadata, timeout=10),
             lambda: list(stub.TranslateStream(iter([request]), metadata=metadata, timeout=10)),
             lambda: list(stub.TranslateStreaming(request, metadata=metadata, timeout=10))]
    try:
        for call in calls:
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert info.value.code() == UNAUTHENTICATED
            assert ADMIN_TOKEN not in info.value.details() and WRONG_TOKEN not in info.value.details()
    finally:
        channel.close()


def test_a_token_restricted_to_another_model_is_denied(tls_auth: ServerHarness, pki: dict[str, Path]) -> None:
    with tls_client(tls_auth, pki, token=PARTNER_TOKEN) as client:
        assert client.translate("one two", model="tiny-transformer")[0].model == "tiny-transformer"
        denied = failure(lambda: client.translate("one two", model="tiny-bahdanau"))
        assert denied.code == PERMISSION_DENIED and "tiny-bahdanau" in denied.message
        assert failure(lambda: client.translate("one two")).code == PERMISSION_DENIED  # the default model
        assert failure(lambda: client.translate("one", model="no-such-model")).code == PERMISSION_DENIED  # no probing
        assert [m.name for m in client.list_models()] == ["tiny-transformer"]


def test_health_needs_no_token(tls_auth: ServerHarness, pki: dict[str, Path]) -> None:
    channel = grpc.secure_channel(tls_auth.address, grpc.ssl_channel_credentials(pki["ca"].read_bytes()))
    try:
        for service in ("", SERVICE_NAME, "tiny-transformer"):
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                              timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        channel.close()


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_auth_failures_are_counted_and_logged_without_the_token(tls_auth: ServerHarness,
                                                                 pki: dict[str, Path]) -> None:
    labels = {"model": "", "method": "Translate", "code": "UNAUTHENTICATED"}
    denied = {"model": "", "method": "Translate", "code": "PERMISSION_DENIED"}
    handled = {"grpc_type": "UNARY", "grpc_service": SERVICE_NAME, "grpc_method": "Translate",
               "grpc_code": "UNAUTHENTICATED"}
    before = [tls_auth.metric("nmt_requests_total", labels), tls_auth.metric("nmt_requests_total", denied),
              tls_auth.metric("grpc_server_handled_total", handled)]
    logger = logging.getLogger("nmt.server")
    handler, level = Records(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        with tls_client(tls_auth, pki, token=WRONG_TOKEN) as client:
            assert failure(lambda: client.translate("one", request_id="auth-1")).code == UNAUTHENTICATED
        with tls_client(tls_auth, pki, token=PARTNER_TOKEN) as client:
            assert failure(lambda: client.translate("one", model="tiny-bahdanau")).code == PERMISSION_DENIED
        with tls_client(tls_auth, pki) as client:
            assert failure(lambda: client.list_models()).code == UNAUTHENTICATED
        # the status reaches the client as the handler aborts, a moment before the interceptor's books
        wait_for(lambda: sum(r.getMessage() == "request" for r in handler.records) == 3)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    after = [tls_auth.metric("nmt_requests_total", labels), tls_auth.metric("nmt_requests_total", denied),
             tls_auth.metric("grpc_server_handled_total", handled)]
    assert [a - b for a, b in zip(after, before, strict=True)] == [1, 1, 1]
    assert tls_auth.metric("nmt_requests_total", {"model": "", "method": "ListModels", "code": "UNAUTHENTICATED"})
    lines = [r.fields for r in handler.records if r.getMessage() == "request"]  # type: ignore[attr-defined]
    [first] = [line for line in lines if line["request_id"] == "auth-1"]
    assert first["code"] == "UNAUTHENTICATED" and first["error"] == "invalid bearer token"
    assert [line["code"] for line in lines] == ["UNAUTHENTICATED", "PERMISSION_DENIED", "UNAUTHENTICATED"]
    logged = " ".join(str(r.__dict__) for r in handler.records)
    assert WRONG_TOKEN not in logged and PARTNER_TOKEN not in logged


def test_nmt_translate_with_token_and_certificates(mtls: ServerHarness, tls_auth: ServerHarness,
                                                   pki: dict[str, Path], capsys: pytest.CaptureFixture,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    base = ["translate", "--ca-cert", str(pki["ca"]), "--timeout", "10"]
    monkeypatch.setenv("NMT_TOKEN", PARTNER_TOKEN)
    assert nmt_main([*base, "--server", tls_auth.address, "--model", "tiny-transformer", "one two"]) == 0
    assert capsys.readouterr().out.strip()
    assert nmt_main([*base, "--server", tls_auth.address, "--model", "tiny-bahdanau", "one two"]) == 2
    assert "PERMISSION_DENIED" in capsys.readouterr().err
    assert nmt_main([*base, "--server", tls_auth.address, "--token", ADMIN_TOKEN, "--list-models"]) == 0
    assert "tiny-bahdanau" in capsys.readouterr().out
    monkeypatch.delenv("NMT_TOKEN")
    assert nmt_main([*base, "--server", mtls.address, "--client-cert", str(pki["client"]),
                     "--client-key", str(pki["client_key"]), "three"]) == 0
    assert capsys.readouterr().out.strip()


def test_async_client_with_client_certificate_and_token(tls_auth: ServerHarness, mtls: ServerHarness,
                                                       pki: dict[str, Path]) -> None:
    import asyncio

    from clients.client import AsyncTranslatorClient

    async def main() -> tuple[str, list[str], grpc.StatusCode]:
        async with AsyncTranslatorClient(mtls.address, root_certificates=str(pki["ca"]), client_cert=pki["client"],
                                         client_key=pki["client_key"], **ONE_ATTEMPT) as client:
            text = (await client.translate("one two"))[0].best.text
        async with AsyncTranslatorClient(tls_auth.address, root_certificates=pki["ca"].read_bytes(),
                                         token=PARTNER_TOKEN, **ONE_ATTEMPT) as client:
            names = [m.name for m in await client.list_models()]
            try:
                await client.translate("one", model="tiny-bahdanau")
                code = grpc.StatusCode.OK
            except TranslationError as error:
                code = error.code
        return text, names, code

    text, names, code = asyncio.run(main())
    assert text and names == ["tiny-transformer"] and code == PERMISSION_DENIED
    with pytest.raises(ValueError, match="client_cert and client_key go together"):
        TranslatorClient(mtls.address, client_cert=pki["client"])
    assert PARTNER_TOKEN not in repr(TranslatorClient(tls_auth.address, token=PARTNER_TOKEN))


def test_tokens_file_format_and_errors(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text(f"{ADMIN_TOKEN} # all\n#{WRONG_TOKEN} commented out\n{PARTNER_TOKEN} a b\n")
    auth = Authenticator.from_file(path)
    assert len(auth) == 2 and auth.model_names == {"a", "b"}
    assert auth.authenticate([("authorization", f"bearer {ADMIN_TOKEN}")]).models is None
    assert auth.authenticate([("authorization", f"Bearer {PARTNER_TOKEN}")]).models == {"a", "b"}
    for text, message in [("short-token\n", "line 1: a token must be at least 16 characters"),
                          (f"# x\n{ADMIN_TOKEN}\n{ADMIN_TOKEN} a\n", "line 3: this token is already on an earlier"),
                          ("# nothing\n\n", "holds no token"),
                          ("token,with;odd:chars-0123\n", "line 1: a token must be")]:
        path.write_text(text)
        with pytest.raises(NmtError, match=message) as info:
            Authenticator.from_file(path)
        assert ADMIN_TOKEN not in str(info.value) and "odd" not in str(info.value)
    with pytest.raises(NmtError, match="cannot read the tokens file"):
        Authenticator.from_file(tmp_path / "missing")


def test_serve_help_and_environment_name_the_security_options(tmp_path: Path) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    ServerConfig.add_arguments(parser, environ={})
    text = parser.format_help()
    for flag in ("--tls-cert", "--tls-key", "--tls-client-ca", "--auth-tokens-file", "--no-reflection",
                 "NMT_TLS_CERT", "NMT_AUTH_TOKENS_FILE", "NMT_REFLECTION"):
        assert flag in text, flag
    config = ServerConfig.from_env({"NMT_REFLECTION": "off", "NMT_AUTH_TOKENS_FILE": "/etc/nmt/tokens"})
    assert config.reflection is False and config.auth_tokens_file == "/etc/nmt/tokens"


# ---- reflection ----------------------------------------------------------------------------------------


def reflection_call(channel: grpc.Channel, version: str, request: dict[str, Any],
                    metadata: tuple = ()) -> Any:
    """One request to ``grpc.reflection.<version>.ServerReflection``; its (first) response."""
    if version == "v1":
        from server.frontend.reflection import v1_pb2 as messages
    else:
        from grpc_reflection.v1alpha import reflection_pb2 as messages
    method = channel.stream_stream(f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
                                   request_serializer=messages.ServerReflectionRequest.SerializeToString,
                                   response_deserializer=messages.ServerReflectionResponse.FromString)
    [response] = list(method(iter([messages.ServerReflectionRequest(**request)]), metadata=metadata, timeout=10))
    return response


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
def test_reflection_v1_and_v1alpha_describe_the_translator(tls_auth: ServerHarness, pki: dict[str, Path],
                                                           version: str) -> None:
    from google.protobuf import descriptor_pb2

    channel = grpc.secure_channel(tls_auth.address, grpc.ssl_channel_credentials(pki["ca"].read_bytes()))
    token = (("authorization", f"Bearer {PARTNER_TOKEN}"),)
    try:
        listed = reflection_call(channel, version, {"list_services": ""}, token)
        names = {s.name for s in listed.list_services_response.service}
        assert {SERVICE_NAME, "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
                "grpc.reflection.v1alpha.ServerReflection"} <= names
        described = reflection_call(channel, version, {"file_containing_symbol": SERVICE_NAME}, token)
        files = [descriptor_pb2.FileDescriptorProto.FromString(b)
                 for b in described.file_descriptor_response.file_descriptor_proto]
        [translator] = [s for f in files for s in f.service if s.name == "Translator"]
        assert [m.name for m in translator.method][:3] == ["Translate", "TranslateStream", "ListModels"]
        itself = reflection_call(channel, version, {"file_containing_symbol": f"grpc.reflection.{version}."
                                                                              "ServerReflection"}, token)
        assert itself.file_descriptor_response.file_descriptor_proto
        logger = logging.getLogger("nmt.server")
        handler, level = Records(), logger.level
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        try:
            with pytest.raises(grpc.RpcError) as info:  # reflection asks for a token too
                reflection_call(channel, version, {"list_services": ""})
            wait_for(lambda: handler.records)
        finally:
            logger.removeHandler(handler)
            logger.setLevel(level)
        assert info.value.code() == UNAUTHENTICATED
        [denied] = [r.fields for r in handler.records if r.getMessage() == "request denied"]  # type: ignore
        assert denied["service"] == f"grpc.reflection.{version}.ServerReflection"
        assert denied["code"] == "UNAUTHENTICATED"
    finally:
        channel.close()


@pytest.fixture(scope="module")
def plain_no_reflection(repository: Path) -> Iterator[ServerHarness]:
    h = ServerHarness(config_for(repository, reflection=False))
    yield h
    h.close()


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
def test_reflection_off_is_unimplemented(plain_no_reflection: ServerHarness, version: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        reflection_call(plain_no_reflection.channel, version, {"list_services": ""})
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    reply = plain_no_reflection.stub.ListModels(pb2.ListModelsRequest(), timeout=10)  # no auth, no TLS: open
    assert {m.name for m in reply.models} == {"tiny-bahdanau", "tiny-transformer"}


def test_split_frontends_keep_tls_and_tokens(repository: Path, pki: dict[str, Path], tokens_file: Path,
                                             tmp_path: Path) -> None:
    """``--frontends 1``: the front-end process speaks TLS and checks the tokens as the one-process server."""
    from tests.test_split import SplitServer

    server = SplitServer(repository, tmp_path, 1, "--tls-cert", str(pki["server"]), "--tls-key",
                         str(pki["server_key"]), "--auth-tokens-file", str(tokens_file))
    channel = grpc.secure_channel(server.address, grpc.ssl_channel_credentials(pki["ca"].read_bytes()))
    try:
        stub = pb2_grpc.TranslatorStub(channel)
        partner = (("authorization", f"Bearer {PARTNER_TOKEN}"),)
        request = pb2.TranslateRequest(texts=["one two"], model="tiny-transformer")
        assert stub.Translate(request, metadata=partner, timeout=30).translations[0].hypotheses
        for metadata, model, code in (((), "tiny-transformer", UNAUTHENTICATED),
                                      (partner, "tiny-bahdanau", PERMISSION_DENIED)):
            with pytest.raises(grpc.RpcError) as error:
                stub.Translate(pb2.TranslateRequest(texts=["one"], model=model), metadata=metadata, timeout=30)
            assert error.value.code() == code
        with pytest.raises(grpc.RpcError):  # plaintext is refused on the TLS port
            pb2_grpc.TranslatorStub(grpc.insecure_channel(server.address)).Translate(request, timeout=5)
    finally:
        channel.close()
        server.stop()
