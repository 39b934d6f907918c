"""vLLM's spellings of `meshserve serve`: aliases, the positional model, the API key's sources,
--generation-config, and an unknown flag answered with the closest known one."""

from __future__ import annotations

import json

import pytest

from meshserve.api.generation_defaults import SamplingDefaults, load_sampling_defaults
from meshserve.api.http.protocol import ChatCompletionRequest, CompletionRequest
from meshserve.api.serve import api_keys_of, configs_of, default_model_name
from meshserve.cli import build_parser, main
from meshserve.demo_model import DEMO_MODEL_DIR
from meshserve.errors import ConfigError


def _configs(*flags: str):
    return configs_of(build_parser().parse_args(["serve", *flags]))


def test_vllm_spellings_reach_the_same_configs_as_ours():
    engine, _, server = _configs("--tensor-parallel-size", "2", "--gpu-memory-utilization", "0.5",
                                 "--no-enable-prefix-caching", "--api-key", "k1", "k2")
    assert (engine.parallel.tp, engine.cache.memory_utilization, engine.cache.enable_prefix_caching) == (2, 0.5, False)
    assert server.api_keys == ("k1", "k2")
    ours, _, _ = _configs("--tp", "2", "--no-prefix-caching")
    assert (ours.parallel.tp, ours.cache.enable_prefix_caching) == (2, False)
    assert _configs("-tp", "2")[0].parallel.tp == 2
    assert _configs("--enable-prefix-caching")[0].cache.enable_prefix_caching


def test_port_and_host_are_the_http_apis_and_grpc_has_its_own():
    _, _, server = _configs("--host", "0.0.0.0", "--port", "9000", "--grpc-port", "6000")
    assert (server.http_host, server.http_port, server.host, server.port) == ("0.0.0.0", 9000, "127.0.0.1", 6000)
    assert server.metrics_port is None  # /metrics on the API port
    _, _, grpc_only = _configs("--no-http")
    assert (grpc_only.http_port, grpc_only.metrics_port) == (None, 9400)


def test_the_model_is_positional_or_a_flag_and_both_must_agree():
    args = build_parser().parse_args(["serve", str(DEMO_MODEL_DIR), "--served-model-name", "a", "b"])
    engine, _, _ = configs_of(args)
    assert engine.model.model == str(DEMO_MODEL_DIR) and default_model_name(args) == "a"
    swallowed = build_parser().parse_args(["serve", "--api-key", "k", str(DEMO_MODEL_DIR)])  # nargs="+" took it
    with pytest.raises(ConfigError, match="api_key='<hidden>' is not allowed: values without the model folder"):
        configs_of(swallowed)
    both = build_parser().parse_args(["serve", str(DEMO_MODEL_DIR), "--model", "/elsewhere"])
    with pytest.raises(ConfigError, match="model='/elsewhere' is not allowed: unset or"):
        configs_of(both)


@pytest.mark.parametrize(("env", "want"), [({"VLLM_API_KEY": "v"}, ("v",)), ({"MESHSERVE_API_KEY": "m"}, ("m",)),
                                           ({"VLLM_API_KEY": "v", "MESHSERVE_API_KEY": "m"}, ("v",)), ({}, ())])
def test_the_api_key_comes_from_the_environment_when_not_given(monkeypatch, env, want):
    for name in ("VLLM_API_KEY", "MESHSERVE_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert api_keys_of(build_parser().parse_args(["serve"])) == want
    assert api_keys_of(build_parser().parse_args(["serve", "--api-key", "flag"])) == ("flag",)


def test_an_unknown_flag_is_answered_with_the_closest_one(capsys):
    with pytest.raises(SystemExit) as done:
        main(["serve", "--tensor-paralel-size", "2"])
    assert done.value.code == 2
    assert "unrecognized arguments: --tensor-paralel-size (did you mean --tensor-parallel-size?)" in \
        capsys.readouterr().err


def test_generation_config_fills_only_what_a_request_leaves_unset(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 7, "do_sample": True}))
    defaults = load_sampling_defaults(str(tmp_path), "/unused")
    assert defaults == SamplingDefaults(temperature=0.6, top_p=0.9, top_k=20, max_tokens=7)
    chat = defaults.apply(ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], temperature=0.0))
    assert (chat.temperature, chat.top_p, chat.top_k, chat.requested_max_tokens) == (0.0, 0.9, 20, 7)
    completion = defaults.apply(CompletionRequest(prompt="x"))
    assert (completion.temperature, completion.max_tokens) == (0.6, 16)  # completions keep OpenAI's 16
    beam = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], use_beam_search=True, n=2)
    assert defaults.apply(beam).temperature is None  # beam search takes no sampling settings
    assert load_sampling_defaults("vllm", tmp_path) == SamplingDefaults()
    assert load_sampling_defaults("auto", tmp_path).temperature == 0.6
    assert load_sampling_defaults("auto", DEMO_MODEL_DIR) == SamplingDefaults(max_tokens=64)
    # gRPC: the proto's optional fields say what the request set; max_tokens stays the API's own default
    from meshserve.v1 import inference_pb2 as pb

    sent = pb.SamplingParams(temperature=0.0, max_tokens=3)
    filled = defaults.apply_proto(sent)
    assert (filled.temperature, filled.top_p, filled.top_k, filled.max_tokens) == (0.0, pytest.approx(0.9), 20, 3)
    assert not filled.HasField("min_p") and not sent.HasField("top_p")  # the request's message is not changed
    assert not defaults.apply_proto(pb.SamplingParams()).HasField("max_tokens")
    assert SamplingDefaults().apply_proto(sent) is sent


def test_gpu_memory_utilization_on_cpu_is_a_share_of_the_hosts_available_memory():
    """The KV pool's size on a CPU: that fraction of MemAvailable, in whole blocks (default: a fixed 256 MiB)."""
    import torch

    from meshserve.config import CacheConfig
    from meshserve.workers.kv_budget import CPU_DEFAULT_KV_BYTES, available_host_memory, num_kv_blocks

    per_block, cpu = 1 << 20, torch.device("cpu")
    want = available_host_memory() * 0.25 / per_block
    assert num_kv_blocks(CacheConfig(memory_utilization=0.25), cpu, per_block) == pytest.approx(want, rel=0.05)
    assert num_kv_blocks(CacheConfig(), cpu, per_block) == CPU_DEFAULT_KV_BYTES // per_block
    with pytest.raises(ConfigError, match="gpu_memory_utilization=0.5 is not allowed: unset when"):
        CacheConfig(memory_utilization=0.5, num_kv_blocks=8)


@pytest.mark.parametrize(("flags", "want"), [([], None), (["--async-scheduling"], True),
                                             (["--no-async-scheduling"], False)])
def test_async_scheduling_spellings(flags, want):
    """vLLM's --async-scheduling forces overlap (a CPU too); --no-async-scheduling turns it off; unset:
    where the device runs steps asynchronously (EngineCore)."""
    assert _configs(*flags)[0].scheduler.async_scheduling is want
