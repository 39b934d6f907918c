"""The head's exec-probe script against a real gRPC server with grpc.health.v1.

Plaintext, TLS with a self-signed certificate (made with the openssl command), and a server
that demands a bearer token; the script must say SERVING only when the server does.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tests.unit.deploy.manifests import CHART

SERVER_NAME = "ms-meshserve.llm.svc"
INFERENCE = "meshserve.v1.Inference"


def load_healthcheck():
    spec = importlib.util.spec_from_file_location("chart_healthcheck", CHART / "files" / "healthcheck.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


healthcheck = load_healthcheck()


class RequireToken(grpc.ServerInterceptor):
    """Refuses calls without `authorization: Bearer <token>`, as the server's --auth-token-file does."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}"

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    def intercept_service(self, continuation, details):
        if dict(details.invocation_metadata).get("authorization") == self._expected:
            return continuation(details)
        return self._deny


def start_server(*, credentials=None, token=None):
    server = grpc.server(futures.ThreadPoolExecutor(2), interceptors=[RequireToken(token)] if token else [])
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    servicer.set(INFERENCE, health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    address = "127.0.0.1:0"
    port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    server.start()
    return server, servicer, port


@pytest.fixture
def plain_server():
    server, servicer, port = start_server()
    yield servicer, port
    server.stop(None)


def test_reports_each_service_status(plain_server, capsys):
    servicer, port = plain_server
    assert healthcheck.main([f"--port={port}", "--service="]) == 0
    assert healthcheck.main([f"--port={port}", f"--service={INFERENCE}"]) == 1
    assert "NOT_SERVING" in capsys.readouterr().out
    servicer.set(INFERENCE, health_pb2.HealthCheckResponse.SERVING)
    assert healthcheck.main([f"--port={port}", f"--service={INFERENCE}"]) == 0
    assert healthcheck.main([f"--port={port}", "--service=no.such.Service"]) == 1
    assert "NOT_FOUND" in capsys.readouterr().err


def test_no_server_is_unhealthy(capsys):
    server, _, port = start_server()
    server.stop(None).wait()  # the port is now closed
    assert healthcheck.main([f"--port={port}", "--timeout=2"]) == 1
    assert "UNAVAILABLE" in capsys.readouterr().err


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    """A self-signed EC certificate for SERVER_NAME, as a kubernetes.io/tls secret folder."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed")
    folder = tmp_path_factory.mktemp("tls")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", str(folder / "tls.key"), "-out", str(folder / "tls.crt"), "-days", "1",
         "-subj", f"/CN={SERVER_NAME}", "-addext", f"subjectAltName=DNS:{SERVER_NAME}"],
        check=True, capture_output=True, timeout=30,
    )
    return folder


def test_tls_with_the_secret_folder(certificate, tmp_path):
    creds = grpc.ssl_server_credentials([((certificate / "tls.key").read_bytes(),
                                          (certificate / "tls.crt").read_bytes())])
    server, _, port = start_server(credentials=creds)
    try:
        tls = [f"--port={port}", f"--tls-dir={certificate}", "--timeout=3"]
        assert healthcheck.main([*tls, f"--server-name={SERVER_NAME}"]) == 0
        # The certificate names the Service, not another host: verification must refuse it.
        assert healthcheck.main([*tls, "--server-name=other.llm.svc"]) == 1
        # A plaintext probe (what the kubelet's native gRPC probe does) cannot talk to it.
        assert healthcheck.main([f"--port={port}", "--timeout=3"]) == 1
        # With a ca.crt in the folder, that is the trust root; a wrong CA fails verification.
        other = tmp_path / "other"
        other.mkdir()
        (other / "ca.crt").write_bytes(b"not a certificate")
        (other / "tls.crt").write_bytes((certificate / "tls.crt").read_bytes())
        assert healthcheck.main([f"--port={port}", f"--tls-dir={other}", f"--server-name={SERVER_NAME}",
                                 "--timeout=3"]) == 1
    finally:
        server.stop(None)


def test_sends_the_bearer_token(tmp_path, capsys):
    server, _, port = start_server(token="s3cret")
    try:
        assert healthcheck.main([f"--port={port}"]) == 1
        assert "UNAUTHENTICATED" in capsys.readouterr().err
        token = tmp_path / "token"
        token.write_text("s3cret\n")  # secrets often end in a newline
        assert healthcheck.main([f"--port={port}", f"--token-file={token}"]) == 0
        token.write_text("# one token per caller\n\ns3cret\nother-caller\n")  # the server's multi-token file
        assert healthcheck.main([f"--port={port}", f"--token-file={token}"]) == 0
    finally:
        server.stop(None)
