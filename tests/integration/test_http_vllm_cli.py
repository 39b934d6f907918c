"""`meshserve serve MODEL --port P --api-key KEY` as a vLLM user starts it, through the `openai` package.

One server for the module: the demo checkpoint given positionally, the OpenAI API on --port,
gRPC on --grpc-port, the key from --api-key (for both faces), two served names. Oracles: the
checkpoint's own tokenizer (the `tokenizers` library) for /tokenize and /detokenize, the
gRPC API of the same server, and raw sockets for what must happen below the ASGI app.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
from tokenizers import Tokenizer

from meshserve.api.client import InferenceClient
from meshserve.demo_model import DEMO_MODEL_DIR
from tests.serve_process import start_serve

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[2]
KEY = "k3y-for-tests"
NAMES = ["demo", "demo-alias"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    port = _free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.pop("VLLM_API_KEY", None)
    env.pop("MESHSERVE_API_KEY", None)
    args = [str(DEMO_MODEL_DIR), "--port", str(port), "--grpc-port", "0", "--api-key", KEY,
            "--served-model-name", *NAMES, "--dtype", "float32", "--max-model-len", "256", "--num-kv-blocks", "64",
            "--tensor-parallel-size", "1", "--no-enable-prefix-caching"]
    proc, grpc_address, url = start_serve(args, env)
    assert url == f"http://127.0.0.1:{port}"  # --port is the HTTP API's, as in vLLM
    yield {"url": url, "port": port, "grpc": grpc_address,
           "http": openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)}
    proc.terminate()
    assert proc.wait(60) == 0


def _post(url: str, body: dict, *, key: str | None = KEY, headers: dict | None = None):
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json", **(headers or {}),
                                              **({"Authorization": f"Bearer {key}"} if key else {})})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read()), response.headers


def _raw(port: int, request: bytes) -> tuple[str, dict]:
    """Status line and JSON body of what the server answers to raw bytes."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(request)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return head.split(b"\r\n")[0].decode(), json.loads(body)


def test_the_api_key_guards_http_and_grpc_and_every_served_name_answers(server):
    http = server["http"]
    assert [m.id for m in http.models.list().data] == NAMES
    for name in NAMES:
        done = http.completions.create(model=name, prompt="Python supports", max_tokens=4, temperature=0)
        assert done.model == name and done.usage.completion_tokens == 4
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server['url']}/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError):
        http.completions.create(model="other", prompt="x", max_tokens=1)
    with InferenceClient(server["grpc"], token=KEY) as client:
        assert [m.name for m in client.list_models()] == NAMES
        assert len(client.generate("Python supports", model=NAMES[1], max_tokens=3).token_ids) == 3
    with InferenceClient(server["grpc"], token="wrong") as client:
        with pytest.raises(Exception, match="UNAUTHENTICATED"):
            client.list_models()


def test_tokenize_and_detokenize_agree_with_the_checkpoints_tokenizer(server):
    tokenizer = Tokenizer.from_file(str(DEMO_MODEL_DIR / "tokenizer.json"))
    text = "The for statement is used to iterate"
    want = tokenizer.encode(text).ids
    got, _ = _post(f"{server['url']}/tokenize", {"model": NAMES[1], "prompt": text})
    assert (got["tokens"], got["count"], got["max_model_len"]) == (want, len(want), 256)
    back, _ = _post(f"{server['url']}/detokenize", {"model": NAMES[0], "tokens": want})
    assert back["prompt"] == tokenizer.decode(want, skip_special_tokens=False)
    with pytest.raises(urllib.error.HTTPError) as info:  # they run the model's tokenizer: the key is needed
        _post(f"{server['url']}/tokenize", {"prompt": text}, key=None)
    assert info.value.code == 401
    with pytest.raises(urllib.error.HTTPError) as info:
        _post(f"{server['url']}/detokenize", {"tokens": [10 ** 9]})
    error = json.loads(info.value.read())["error"]
    assert info.value.code == 400 and error["param"] == "tokens" and "10000000" in error["message"]


def test_version_openapi_and_metrics_with_the_model_name(server):
    url = server["url"]
    version = json.loads(urllib.request.urlopen(f"{url}/version", timeout=10).read())["version"]
    assert re.match(r"\d+\.\d+", version)
    schema = json.loads(urllib.request.urlopen(f"{url}/openapi.json", timeout=10).read())
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/version"} <= set(schema["paths"])
    server["http"].completions.create(model=NAMES[0], prompt="Python", max_tokens=2)
    metrics = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    generated = re.search(r'^meshserve_generation_tokens_total\{model_name="demo"\} (\S+)$', metrics, re.M)
    assert generated and float(generated[1]) >= 2


def test_x_request_id_is_echoed_or_made(server):
    _, headers = _post(f"{server['url']}/tokenize", {"prompt": "hi"}, headers={"x-request-id": "trace-42"})
    assert headers["x-request-id"] == "trace-42"
    made = urllib.request.urlopen(f"{server['url']}/version", timeout=10).headers["x-request-id"]
    other = urllib.request.urlopen(f"{server['url']}/version", timeout=10).headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", made) and made != other


def test_protocol_errors_come_in_openais_json_shape(server):
    status, body = _raw(server["port"], b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: ten\r\n\r\n")
    assert status.startswith("HTTP/1.1 400") and body["error"]["type"] == "invalid_request_error"
    assert "Content-Length" in body["error"]["message"]
    # 20 KB of one header, not yet ended: over the 16 KiB limit for an incomplete head (h11's, and
    # api/http/protocol_httptools.py's) (and all of it read by the server, so that its close is a clean one)
    huge = b"GET /version HTTP/1.1\r\nHost: x\r\nX-Filler: " + b"a" * 20_000
    status, body = _raw(server["port"], huge)
    assert status.startswith("HTTP/1.1 431") and body["error"]["code"] == 431


def test_a_second_ctrl_c_exits_at_once_while_the_first_drains():
    port = _free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "meshserve.cli", "serve", "--port", str(port), "--grpc-port", "0",
                             "--dtype", "float32", "--drain-seconds", "600"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().startswith("meshserve: serving ")
        proc.stdout.readline()
        body = {"prompt": "Python supports", "max_tokens": 1500, "ignore_eos": True, "stream": True}
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"}, method="POST")
        stream = urllib.request.urlopen(request, timeout=60)
        stream.readline()  # the stream runs: the drain will wait for it (up to 600 s)
        proc.send_signal(2)
        assert proc.stdout.readline().startswith("meshserve: draining")
        proc.send_signal(2)
        assert proc.wait(30) == 130
        assert "interrupted again: exiting now" in proc.stderr.read()
        stream.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
