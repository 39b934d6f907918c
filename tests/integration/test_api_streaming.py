"""Generate and friends over a real gRPC connection, against the engine run in-process.

The oracle is `meshserve.LLM` on the same demo checkpoint and settings: what a client gets over
gRPC (tokens, text, finish and stop reasons, logprobs, seeded samples, usage) must be what the
engine produces, and the streamed text must be the tokenizer's own decoding of the tokens.
Then cancellation (200 streams cut at random points), Abort, deadlines, metrics, reflection.
"""

from __future__ import annotations

import asyncio
import random
import re
import urllib.request

import grpc
import pytest
from tokenizers import Tokenizer

from meshserve import LLM, SamplingParams
from meshserve.api.client import InferenceClient
from meshserve.api.metrics import METRICS
from meshserve.demo_model import DEMO_MODEL_DIR
from meshserve.v1 import inference_pb2 as pb
from meshserve.v1 import inference_pb2_grpc as pb_grpc
from tests.integration.api_harness import ServerLoop, demo_service, rpc_error, wait_idle

# A hung server or stream fails the test in minutes, not at the suite's 10-minute limit.
pytestmark = pytest.mark.timeout(180)

PROMPTS = ["The for statement is used to", "An exception is raised when", "Python supports",
           "A class definition defines"]


@pytest.fixture(scope="module")
def served():
    service = demo_service(max_model_len=512, num_kv_blocks=200, max_num_seqs=64, max_queue=256)
    loop = ServerLoop()
    server = loop.serve(service)
    client = InferenceClient(server.address)
    yield client, server, client.server_info().stats.num_free_kv_blocks
    client.close()
    loop.close(service)


@pytest.fixture(scope="module")
def llm():
    return LLM(None, dtype="float32", attention_backend="TORCH", max_model_len=512, num_kv_blocks=200,
               progress=False)


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_file(str(DEMO_MODEL_DIR / "tokenizer.json"))


def test_greedy_streams_equal_the_engine(served, llm, tokenizer):
    client, _, free_at_start = served
    expected = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24))
    for prompt, want in zip(PROMPTS, expected):
        pieces = list(client.stream(prompt, temperature=0, max_tokens=24))
        got = client.generate(prompt, temperature=0, max_tokens=24)
        assert got.token_ids == want.token_ids and got.text == want.text
        assert got.finish_reason == str(want.finish_reason)
        assert "".join(p.text for p in pieces) == want.text
        assert [t for p in pieces for t in p.token_ids] == want.token_ids
        assert all(p.finish_reason == 0 for p in pieces[:-1]) and pieces[-1].finish_reason != 0
        assert got.text == tokenizer.decode(want.token_ids)  # text is the tokens' own decoding
        assert got.usage.prompt_tokens == len(tokenizer.encode(prompt).ids)
        assert got.usage.completion_tokens == len(want.token_ids)
        assert len({p.request_id for p in pieces}) == 1 and pieces[0].request_id
    wait_idle(client, free_at_start)


def test_sampling_settings_reach_the_engine(served, llm):
    """Seeded sampling with every setting: the same seed gives the same tokens only if each
    setting arrived unchanged."""
    client, _, _ = served
    settings = dict(temperature=0.9, top_k=40, top_p=0.9, min_p=0.02, seed=1234, repetition_penalty=1.2,
                    presence_penalty=0.5, frequency_penalty=0.3, max_tokens=20, ignore_eos=True)
    prompt = [0, 450, 1200, 37, 999, 2048, 7]
    want = llm.generate(prompt, SamplingParams(**settings))[0]
    got = client.generate(prompt, **settings)
    assert got.token_ids == want.token_ids and got.finish_reason == "length"
    unseeded = client.generate(prompt, **{**settings, "seed": 4321})
    assert unseeded.token_ids != want.token_ids  # the seed is not ignored
    top_k_off = client.generate(prompt, **{**settings, "top_k": -1})
    assert top_k_off.token_ids == llm.generate(prompt, SamplingParams(**{**settings, "top_k": None}))[0].token_ids


def test_stop_strings_stop_ids_and_logprobs(served, llm):
    client, _, _ = served
    full = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    stop = full.text[10:14]
    got = client.generate(PROMPTS[0], temperature=0, max_tokens=30, ignore_eos=True, stop=[stop])
    assert got.text == full.text[: full.text.index(stop)]
    assert got.finish_reason == "stop" and got.stop_reason == stop
    kept = client.generate(PROMPTS[0], temperature=0, max_tokens=30, ignore_eos=True, stop=[stop],
                           include_stop_str_in_output=True)
    assert kept.text == full.text[: full.text.index(stop) + len(stop)]
    stop_id = full.token_ids[5]
    got = client.generate(PROMPTS[0], temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop_id])
    assert got.token_ids == full.token_ids[: full.token_ids.index(stop_id) + 1] and got.stop_reason == stop_id
    want = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=8, logprobs=3))[0]
    got = client.generate(PROMPTS[1], temperature=0, max_tokens=8, logprobs=3)
    assert len(got.logprobs) == len(want.logprobs) == len(got.token_ids)
    for g, w in zip(got.logprobs, want.logprobs):
        assert g.token_id == w.token_id and g.logprob == pytest.approx(w.logprob, abs=1e-4)
        assert [t.token_id for t in g.top] == [t for t, _ in w.top]
        assert [t.logprob for t in g.top] == pytest.approx([v for _, v in w.top], abs=1e-4)


def test_tokenize_list_models_and_server_info(served, tokenizer):
    client, server, free_at_start = served
    text = "Lambda expressions (sometimes called lambda forms) are used to create anonymous functions."
    assert client.tokenize(text) == tokenizer.encode(text).ids
    (model,) = client.list_models()
    assert (model.name, model.max_model_len, model.vocab_size, model.task) == ("meshserve-demo", 512, 4096,
                                                                               "generate")
    info = client.server_info()
    assert info.serving and (info.healthy_replicas, info.total_replicas) == (1, 1)
    assert info.limits.max_queue == 256 and info.limits.max_stop_strings == 16 and info.limits.max_logprobs == 20
    assert not info.auth_required and not info.tls and info.version
    assert client.health() == "SERVING" and client.health("") == "SERVING"


def test_abort_ends_the_stream_and_frees_its_blocks(served):
    client, _, free_at_start = served
    stream = client.stream(PROMPTS[2], request_id="abort-me", max_tokens=400, ignore_eos=True)
    first = next(r for r in stream if r.token_ids)
    assert first.request_id == "abort-me"
    assert client.server_info().stats.num_free_kv_blocks < free_at_start
    with InferenceClient(served[1].address) as other:
        other.abort("abort-me")
    rest = list(stream)
    assert rest[-1].finish_reason == pb.FINISH_REASON_ABORT
    assert len(first.token_ids) + sum(len(r.token_ids) for r in rest) < 400
    wait_idle(client, free_at_start)


def test_cancel_aborts_the_request_at_once(served):
    """After a client cancels, its blocks come back long before the request could have finished:
    the generated-token counter shows it stopped, not ran out its 480 tokens."""
    client, _, free_at_start = served
    before = client.server_info().stats.generated_tokens
    stream = client.stream(PROMPTS[0], max_tokens=480, ignore_eos=True)
    next(r for r in stream if r.token_ids)
    stream.close()  # cancels the call
    stats = wait_idle(client, free_at_start)
    assert stats.generated_tokens - before < 240


def test_deadline_is_honoured_and_frees_the_request(served):
    client, _, free_at_start = served
    before = client.server_info().stats.generated_tokens
    exc = rpc_error(client.generate, PROMPTS[3], max_tokens=480, ignore_eos=True, timeout=0.5)
    assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    stats = wait_idle(client, free_at_start)  # the server stopped the work: nothing runs, every block is back
    assert stats.generated_tokens - before < 480
    scrape = urllib.request.urlopen(f"http://127.0.0.1:{served[1].metrics_port}/metrics", timeout=10).read()
    assert re.search(rb'meshserve_requests_total\{code="DEADLINE_EXCEEDED",model_name="[^"]+"\} 1.0', scrape)


async def _cancel_at_random(address: str, rng: random.Random, n: int) -> dict[str, int]:
    """n concurrent streams, each cancelled at a random point: before its first token, after k
    responses, or after a random delay; some are left to finish."""
    outcomes = {"cancelled": 0, "finished": 0}
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.InferenceStub(channel)

        async def one(i: int) -> None:
            prompt = [rng.randrange(2, 4096) for _ in range(rng.randrange(1, 120))]
            mode, k, delay = rng.choice(["now", "after", "after", "delay"]), rng.randrange(0, 18), rng.random() / 10
            call = stub.Generate(InferenceClient.request(prompt, max_tokens=16, ignore_eos=True, temperature=0.7,
                                                         seed=i))
            if mode == "delay":
                await asyncio.sleep(delay)
            elif mode == "after":
                seen = 0
                async for response in call:
                    seen += 1
                    if response.finish_reason:
                        outcomes["finished"] += 1
                        return
                    if seen >= k:
                        break
            call.cancel()
            outcomes["cancelled"] += 1

        await asyncio.gather(*(one(i) for i in range(n)))
    return outcomes


def test_200_streams_cancelled_at_random_points_leak_no_blocks(served):
    client, server, free_at_start = served
    outcomes = asyncio.run(_cancel_at_random(server.address, random.Random(0), 200))
    assert outcomes["cancelled"] >= 150 and sum(outcomes.values()) == 200, outcomes
    stats = wait_idle(client, free_at_start)
    assert stats.kv_usage == 0.0
    scrape = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    assert 'code="CANCELLED"' in scrape and 'code="INTERNAL"' not in scrape  # cancels are not errors
    out = client.generate(PROMPTS[0], max_tokens=4, temperature=0)  # and it still serves
    assert len(out.token_ids) == 4


def test_request_ids_can_be_reused_as_soon_as_a_stream_ends(served):
    """Cancel, then send the same id at once (before the server has even seen the cancel), many
    times: each new request is served or refused as "in use", never both under one id; the
    engine survives and nothing leaks."""
    client, _, free_at_start = served
    served_count = 0
    for i in range(16):
        call = client.stub.Generate(InferenceClient.request(PROMPTS[i % 4], request_id="reused", max_tokens=50,
                                                            ignore_eos=True))
        try:
            if i % 2:  # cancelled after its first token; otherwise right after sending
                next(r for r in call if r.token_ids)
                served_count += 1
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id='reused'" in exc.details()
        call.cancel()
    assert served_count >= 1
    wait_idle(client, free_at_start)
    out = client.generate(PROMPTS[0], request_id="reused", max_tokens=3, temperature=0)
    assert out.request_id == "reused" and len(out.token_ids) == 3
    assert client.health() == "SERVING"


def test_metrics_endpoint_exports_every_documented_metric(served):
    client, server, _ = served
    client.generate(PROMPTS[1], max_tokens=5, temperature=0, ignore_eos=True)
    scrape = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    model = client.list_models()[0].name
    samples = {}
    for line in scrape.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            assert f'model_name="{model}"' in name, name  # every sample names the model, as vLLM's
            samples[re.sub(rf',?model_name="{re.escape(model)}"', "", name).replace("{}", "")] = float(value)
    names = {s.split("{")[0] for s in samples}
    for metric in METRICS:
        kind = METRICS[metric].split(":")[0]
        if METRICS[metric].endswith(("MoE models)", "disaggregated pools)")):  # a dense model, unified pools
            assert metric not in names, metric
            continue
        assert (metric + "_count" if kind == "histogram" else metric) in names, metric
    info = client.server_info().stats
    assert samples["meshserve_generation_tokens_total"] == info.generated_tokens
    assert samples["meshserve_prompt_tokens_total"] == info.prompt_tokens
    assert samples["meshserve_kv_cache_free_blocks"] == info.num_free_kv_blocks
    assert samples['meshserve_requests_total{code="OK"}'] >= 1
    assert samples["meshserve_time_to_first_token_seconds_count"] >= samples['meshserve_requests_total{code="OK"}']
    assert samples["meshserve_replicas_healthy"] == 1


def test_reflection_describes_the_service(served):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with grpc.insecure_channel(served[1].address) as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        services = set(db.get_services())
        assert {"meshserve.v1.Inference", "grpc.health.v1.Health"} <= services
        generate = db.FindFileContainingSymbol("meshserve.v1.Inference")
        assert [m.name for m in generate.service[0].method] == ["Generate", "Tokenize", "ListModels", "Abort",
                                                               "ServerInfo", "Embed"]
