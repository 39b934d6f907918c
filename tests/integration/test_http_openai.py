"""The OpenAI-compatible HTTP API of a live `meshserve serve`, through the official `openai` package.

One server for the module, as a user starts it: the demo model named by a hub id
(`acme/pydoc-llama`, resolved offline from a hub cache built here), a bearer token, gRPC and
HTTP in the same process. The oracles: the gRPC API of the same server (itself tested against
the engine), `meshserve generate` in its own process, and HF transformers' chat template
rendering for chat prompts.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import httpx2
import openai
import pytest
import transformers

from meshserve.api.client import InferenceClient
from meshserve.demo_model import DEMO_MODEL_DIR
from tests.hub_cache import CONFIG_FILES, hub_cache
from tests.integration.api_harness import wait_idle
from tests.serve_process import start_serve

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[2]
MODEL = "acme/pydoc-llama"
TOKEN = "s3cret-token"
PROMPTS = ["The for statement is used to", "An exception is raised when", "Python supports"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub")
    hub_cache(root, MODEL, files=(*CONFIG_FILES, "model.safetensors"))
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(root), "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(ROOT)}


@pytest.fixture(scope="module")
def server(env, tmp_path_factory):
    token_file = tmp_path_factory.mktemp("auth") / "token"
    token_file.write_text(TOKEN + "\n")
    args = ["--model", MODEL, "--grpc-port", "0", "--metrics-port", "0", "--port", str(_free_port()),
            "--dtype", "float32", "--attention-backend", "TORCH", "--max-model-len", "256", "--num-kv-blocks", "64",
            "--auth-token-file", str(token_file), "--max-message-bytes", "65536"]
    proc, grpc_address, url = start_serve(args, env)
    grpc_client = InferenceClient(grpc_address, token=TOKEN)
    http = openai.OpenAI(base_url=f"{url}/v1", api_key=TOKEN, max_retries=0, timeout=120)
    free = grpc_client.server_info().stats.num_free_kv_blocks
    yield {"url": url, "http": http, "grpc": grpc_client, "free": free}
    grpc_client.close()
    proc.terminate()
    assert proc.wait(60) == 0


def test_models_health_and_the_token(server):
    http, url = server["http"], server["url"]
    assert [m.id for m in http.models.list().data] == [MODEL]
    assert json.loads(urllib.request.urlopen(f"{url}/health", timeout=10).read())["status"] == "ok"  # no token
    wrong = openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0)
    for call in (lambda: wrong.models.list(), lambda: wrong.completions.create(model=MODEL, prompt="x")):
        with pytest.raises(openai.AuthenticationError) as info:
            call()
        assert info.value.status_code == 401 and info.value.body["type"] == "authentication_error"
    with pytest.raises(urllib.error.HTTPError) as info:  # no Authorization header at all
        urllib.request.urlopen(f"{url}/v1/models", timeout=10)
    assert info.value.code == 401 and info.value.headers["WWW-Authenticate"] == "Bearer"


def test_greedy_text_equals_grpc_and_meshserve_generate(server, env):
    http, grpc_client = server["http"], server["grpc"]
    prompt = PROMPTS[0]
    got = http.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    want = grpc_client.generate(prompt, max_tokens=24, temperature=0)
    assert got.choices[0].text == want.text and got.choices[0].finish_reason == want.finish_reason
    assert got.usage.prompt_tokens == len(grpc_client.tokenize(prompt)) == want.usage.prompt_tokens
    assert got.usage.completion_tokens == len(want.token_ids) == 24
    assert got.usage.total_tokens == got.usage.prompt_tokens + 24 and got.model == MODEL
    done = subprocess.run([sys.executable, "-m", "meshserve.cli", "generate", "--model", MODEL, "--dtype", "float32",
                           "--attention-backend", "TORCH", "--max-tokens", "24", prompt],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert done.stdout == prompt + want.text + "\n"


def test_streaming_chunks_join_to_the_whole_and_end_with_usage(server):
    http = server["http"]
    whole = http.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=20, temperature=0)
    chunks = list(http.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=20, temperature=0, stream=True,
                                          stream_options={"include_usage": True}))
    *body, last = chunks
    assert "".join(c.choices[0].text for c in body) == whole.choices[0].text
    assert body[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in body[:-1]) and all(c.usage is None for c in body)
    assert last.choices == [] and last.usage == whole.usage
    plain = list(http.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=5, temperature=0, stream=True))
    assert all(c.choices and c.usage is None for c in plain)  # no usage chunk unless asked


def test_several_prompts_and_concurrent_streams(server):
    http, grpc_client = server["http"], server["grpc"]
    batch = http.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=12, temperature=0)
    wants = [grpc_client.generate(p, max_tokens=12, temperature=0) for p in PROMPTS]
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert [c.text for c in batch.choices] == [w.text for w in wants]
    assert batch.usage.completion_tokens == sum(len(w.token_ids) for w in wants)
    streamed = ["", "", ""]
    for chunk in http.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=12, temperature=0, stream=True):
        streamed[chunk.choices[0].index] += chunk.choices[0].text
    assert streamed == [w.text for w in wants]
    wait_idle(grpc_client, server["free"])


def test_stop_strings_and_max_tokens(server):
    http = server["http"]
    full = http.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=30, temperature=0,
                                   extra_body={"ignore_eos": True}).choices[0].text
    stop = full[10:14]
    got = http.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=30, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert got.choices[0].text == full[: full.index(stop)] and got.choices[0].finish_reason == "stop"
    assert got.choices[0].model_extra["stop_reason"] == stop
    streamed = http.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=30, temperature=0, stop=stop,
                                       stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed) == full[: full.index(stop)]
    short = http.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=5, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert short.usage.completion_tokens == 5 and short.choices[0].finish_reason == "length"
    assert full.startswith(short.choices[0].text)


def test_chat_uses_the_models_template(server):
    http, grpc_client = server["http"], server["grpc"]
    hf = transformers.AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    for messages in ([{"role": "user", "content": PROMPTS[2]}],
                     [{"role": "system", "content": "Built-in Types"},
                      {"role": "user", "content": "The following sections describe"}]):
        ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        want = grpc_client.generate(ids, max_tokens=20, temperature=0)
        got = http.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
        assert got.choices[0].message.role == "assistant" and got.choices[0].message.content == want.text
        assert got.usage.prompt_tokens == len(ids) and got.usage.completion_tokens == len(want.token_ids)
        chunks = list(http.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0,
                                                   stream=True, stream_options={"include_usage": True}))
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
        assert chunks[-1].usage == got.usage and chunks[-2].choices[0].finish_reason == got.choices[0].finish_reason
    with pytest.raises(openai.BadRequestError, match="roles system, user and assistant"):
        http.chat.completions.create(model=MODEL, messages=[{"role": "tool", "content": "x"}])


def test_sampling_settings_and_logprobs_equal_grpc(server):
    http, grpc_client = server["http"], server["grpc"]
    settings = dict(temperature=0.9, top_p=0.9, seed=1234, presence_penalty=0.5, frequency_penalty=0.3, max_tokens=16)
    extra = {"top_k": 40, "min_p": 0.02, "repetition_penalty": 1.2, "ignore_eos": True}
    got = http.completions.create(model=MODEL, prompt=PROMPTS[2], **settings, extra_body=extra)
    want = grpc_client.generate(PROMPTS[2], **settings, **extra)
    assert got.choices[0].text == want.text
    other = http.completions.create(model=MODEL, prompt=PROMPTS[2], **{**settings, "seed": 4321}, extra_body=extra)
    assert other.choices[0].text != want.text  # the seed arrived
    want = grpc_client.generate(PROMPTS[1], max_tokens=8, temperature=0, logprobs=3)
    lp = http.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=8, temperature=0,
                                 logprobs=3).choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([w.logprob for w in want.logprobs], abs=1e-4)
    assert "".join(lp.tokens) == want.text and lp.text_offset[0] == 0
    assert [len(t) for t in lp.top_logprobs] == [3] * 8
    chat = http.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[1]}],
                                        max_tokens=8, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx([w.logprob for w in want.logprobs], abs=1e-4)
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob for c in content)


def test_n_choices_streamed_by_index_and_beam_search(server):
    http, grpc_client = server["http"], server["grpc"]
    greedy = [grpc_client.generate(p, max_tokens=10, temperature=0) for p in PROMPTS[:2]]
    batch = http.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=10, temperature=0, n=3)
    assert [c.index for c in sorted(batch.choices, key=lambda c: c.index)] == list(range(6))
    for c in batch.choices:  # prompt i's choices are i * n + 0..2
        assert c.text == greedy[c.index // 3].text
    assert batch.usage.completion_tokens == 3 * sum(len(g.token_ids) for g in greedy)
    seeded = dict(model=MODEL, prompt=PROMPTS[2], max_tokens=12, temperature=1.0, seed=7, n=2)
    whole = http.completions.create(**seeded)
    streamed = {0: "", 1: ""}
    for chunk in http.completions.create(**seeded, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == {c.index: c.text for c in whole.choices} and streamed[0] != streamed[1]
    messages = [{"role": "user", "content": PROMPTS[0]}]
    chat = http.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0.9, seed=1, n=2)
    parts, roles = {0: "", 1: ""}, []
    for chunk in http.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0.9, seed=1,
                                              n=2, stream=True):
        for c in chunk.choices:
            parts[c.index] += c.delta.content or ""
            roles += [c.index] if c.delta.role else []
    assert roles == [0, 1] and parts == {c.index: c.message.content for c in chat.choices}
    beams = http.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=10, n=3,
                                    extra_body={"use_beam_search": True, "length_penalty": 0.5})
    want = grpc_client.generate(PROMPTS[1], beam_search=dict(beam_width=3, max_tokens=10, length_penalty=0.5))
    assert [c.text for c in sorted(beams.choices, key=lambda c: c.index)] == [
        want.choices[i].text for i in range(3)]
    wait_idle(grpc_client, server["free"])


@pytest.mark.parametrize("kwargs,param,message", [
    (dict(temperature=-1), "temperature", "temperature=-1.0 is not allowed: a finite number >= 0"),
    (dict(n=0), "n", "n=0 is not allowed: an integer in [1, 256]"),
    (dict(n=3, best_of=2), "best_of", "best_of=2 is not allowed"),
    (dict(n=2, extra_body={"use_beam_search": True, "top_k": 3}), "top_k", "unset with use_beam_search"),
    (dict(n=11, extra_body={"use_beam_search": True}), "beam_width", "beam_width=11 is not allowed"),
    (dict(max_tokens=0), "max_tokens", "max_tokens=0 is not allowed: an integer >= 1"),
    (dict(extra_body={"top_k": -5}), "top_k", "top_k=-5 is not allowed"),
    (dict(extra_body={"bogus": 1}), "bogus", "Extra inputs are not permitted"),
    (dict(prompt=[5, 99999]), "prompt", "token ids in [0, 4096)"),
    (dict(stop=["x"] * 17), "stop", "at most 16 stop strings"),
])
def test_bad_fields_are_400s_naming_the_field(server, kwargs, param, message):
    http = server["http"]
    with pytest.raises(openai.BadRequestError) as info:
        http.completions.create(**{"model": MODEL, "prompt": "Hello", "max_tokens": 4, **kwargs})
    assert info.value.status_code == 400 and info.value.body["param"] == param
    assert message in info.value.body["message"] and info.value.body["type"] == "invalid_request_error"


def test_other_refusals_and_nothing_left_behind(server):
    http, grpc_client, url = server["http"], server["grpc"], server["url"]
    with pytest.raises(openai.NotFoundError) as info:
        http.completions.create(model="acme/other", prompt="Hello")
    assert info.value.body["type"] == "not_found_error" and MODEL in info.value.body["message"]
    with pytest.raises(openai.BadRequestError, match="max_model_len|256"):  # a prompt that can never fit
        http.completions.create(model=MODEL, prompt=[5] * 300, max_tokens=4)
    with pytest.raises(openai.BadRequestError) as info:  # a generative model has no embeddings
        http.embeddings.create(model=MODEL, input="Hello")
    assert info.value.body["param"] == "model"
    big = json.dumps({"model": MODEL, "prompt": "x" * 70000}).encode()
    response = httpx2.post(f"{url}/v1/completions", content=big, timeout=30,
                           headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
    assert response.status_code == 413 and "65536" in response.json()["error"]["message"]
    def chunks():  # no Content-Length: the limit is counted as the body arrives
        for _ in range(10):
            yield b" " * 8192

    response = httpx2.post(f"{url}/v1/completions", content=chunks(), timeout=30,
                           headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
    assert response.status_code == 413 and "65536" in response.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError) as info:
        http.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                     extra_body={"chat_template_kwargs": {"messages": []}})
    assert info.value.body["param"] == "chat_template_kwargs"
    response = httpx2.post(f"{url}/v1/completions", content=b"{not json", timeout=30,
                           headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "body"
    wait_idle(grpc_client, server["free"])


def _leaves(server, leave) -> None:
    """`leave()` starts a 240-token request and goes away; the server must stop it at once: every
    block back, and far fewer tokens made than asked for (not the request running out)."""
    grpc_client = server["grpc"]
    before = grpc_client.server_info().stats.generated_tokens
    leave()
    stats = wait_idle(grpc_client, server["free"])
    assert stats.kv_usage == 0.0 and stats.num_running == 0
    assert stats.generated_tokens - before < 120


def test_a_client_that_leaves_mid_stream_aborts_its_request(server):
    http, grpc_client = server["http"], server["grpc"]

    def completion() -> None:
        stream = http.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=240, stream=True,
                                         extra_body={"ignore_eos": True})
        assert next(iter(stream)).choices[0].text is not None
        assert grpc_client.server_info().stats.num_free_kv_blocks < server["free"]  # it was running
        stream.close()

    def chat() -> None:
        stream = http.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[1]}],
                                              max_tokens=240, stream=True, extra_body={"ignore_eos": True})
        chunks = iter(stream)
        next(chunks), next(chunks)  # the role, then the first text
        stream.close()

    _leaves(server, completion)
    _leaves(server, chat)


def test_a_client_that_stops_waiting_for_a_whole_response_aborts_it(server):
    def post() -> None:
        with pytest.raises(httpx2.ReadTimeout):
            httpx2.post(f"{server['url']}/v1/completions", timeout=httpx2.Timeout(30, read=0.5),
                        json={"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 240, "ignore_eos": True},
                        headers={"Authorization": f"Bearer {TOKEN}"})

    _leaves(server, post)
