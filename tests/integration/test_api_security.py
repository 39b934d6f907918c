"""Bearer token and TLS, on and off, over real connections.

One demo-model service behind two servers on one loop: `secure` (TLS + token) and `token_only`
(plaintext + token). The servers of the other API test modules run with both off. Certificates
are made with the openssl command (skipped where it is missing).
"""

from __future__ import annotations

import shutil
import subprocess

import grpc
import pytest

from meshserve.api.client import InferenceClient
from meshserve.cluster.service import ServiceHealth
from tests.integration.api_harness import ServerLoop, demo_service, rpc_error

# A hung server or stream fails the test in minutes, not at the suite's 10-minute limit.
pytestmark = pytest.mark.timeout(180)

TOKEN = "s3cret-token-for-tests"
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED


def make_certificate(folder, name: str) -> tuple[str, str]:
    """A self-signed EC certificate for localhost and 127.0.0.1; returns (cert, key) paths."""
    cert, key = folder / f"{name}.crt", folder / f"{name}.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        check=True, capture_output=True, timeout=30,
    )
    return str(cert), str(key)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed")
    folder = tmp_path_factory.mktemp("security")
    cert, key = make_certificate(folder, "server")
    other_ca, _ = make_certificate(folder, "other")
    token_file = folder / "token"
    token_file.write_text(f"  {TOKEN}\n")
    service = demo_service(max_model_len=256, num_kv_blocks=40)
    loop = ServerLoop()
    secure = loop.serve(service, tls_cert=cert, tls_key=key, auth_token_file=str(token_file))
    token_only = loop.serve(service, auth_token_file=str(token_file))
    roots = open(cert, "rb").read()
    yield {"secure": secure.address, "token_only": token_only.address, "roots": roots,
           "other_roots": open(other_ca, "rb").read()}
    loop.close(service)


def calls(client: InferenceClient):
    """Every Inference method, as zero-argument callables."""
    return {
        "Generate": lambda: client.generate("Hello", max_tokens=2),
        "Tokenize": lambda: client.tokenize("Hello"),
        "ListModels": client.list_models,
        "Abort": lambda: client.abort("some-id"),
        "ServerInfo": client.server_info,
    }


@pytest.mark.parametrize("token", [None, "wrong-token", TOKEN + "x", ""])
def test_every_method_needs_the_right_token(servers, token):
    for address, tls in ((servers["secure"], True), (servers["token_only"], False)):
        roots = servers["roots"] if tls else None
        with InferenceClient(address, token=token, root_certificates=roots) as client:
            for name, call in calls(client).items():
                exc = rpc_error(call)
                assert exc.code() == UNAUTHENTICATED, (name, exc.details())
                assert "authorization: Bearer <token>" in exc.details()


def test_reflection_needs_the_token_too(servers):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with grpc.insecure_channel(servers["token_only"]) as channel:
        exc = rpc_error(ProtoReflectionDescriptorDatabase(channel).get_services)
    assert exc.code() == UNAUTHENTICATED


def test_right_token_over_tls_streams_text(servers):
    with InferenceClient(servers["secure"], token=TOKEN, root_certificates=servers["roots"]) as client:
        out = client.generate("The for statement is used to", max_tokens=12, temperature=0, ignore_eos=True)
        assert len(out.token_ids) == 12 and out.text.strip()
        info = client.server_info()
        assert info.tls and info.auth_required
    with InferenceClient(servers["token_only"], token=TOKEN) as client:
        plain = client.generate("The for statement is used to", max_tokens=12, temperature=0, ignore_eos=True)
        assert plain.token_ids == out.token_ids
        assert not client.server_info().tls


def test_health_answers_without_a_token(servers):
    """The kubelet's probes carry no secret: grpc.health.v1 stays open on both servers."""
    with InferenceClient(servers["secure"], root_certificates=servers["roots"]) as client:
        assert client.health() == "SERVING" and client.health("") == "SERVING"
    with InferenceClient(servers["token_only"]) as client:
        assert client.health() == "SERVING"


def test_tls_refuses_plaintext_and_unknown_certificates(servers):
    with InferenceClient(servers["secure"], token=TOKEN) as plaintext:
        assert rpc_error(plaintext.list_models).code() == grpc.StatusCode.UNAVAILABLE
    with InferenceClient(servers["secure"], token=TOKEN, root_certificates=servers["other_roots"]) as wrong_ca:
        assert rpc_error(wrong_ca.list_models).code() == grpc.StatusCode.UNAVAILABLE
    host_port = servers["secure"].replace("127.0.0.1", "localhost")
    with InferenceClient(host_port, token=TOKEN, root_certificates=servers["roots"]) as by_name:
        assert by_name.list_models()[0].name == "meshserve-demo"  # the certificate names localhost too


def test_the_token_server_speaks_no_tls(servers):
    with InferenceClient(servers["token_only"], token=TOKEN, root_certificates=servers["roots"]) as client:
        assert rpc_error(client.list_models).code() == grpc.StatusCode.UNAVAILABLE


def test_service_health_record_is_what_server_info_reports(servers):
    with InferenceClient(servers["token_only"], token=TOKEN) as client:
        info = client.server_info()
    assert ServiceHealth(info.serving, info.healthy_replicas, info.total_replicas, info.health_detail) == \
        ServiceHealth(True, 1, 1, "")
