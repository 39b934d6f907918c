"""User-facing settings: each bad value names the field, the value and what is allowed."""

import pytest

from meshserve.config import (
    AttentionConfig,
    CacheConfig,
    DcpComm,
    ModelConfig,
    ParallelConfig,
    PoolConfig,
    PoolMode,
    SchedulerConfig,
    ServerConfig,
)
from meshserve.errors import ConfigError


@pytest.mark.parametrize(
    ("build", "field", "allowed"),
    [
        (lambda: ModelConfig(dtype="fp64"), "dtype", "one of ['auto', 'float32', 'float16', 'bfloat16']"),
        (lambda: ModelConfig(model="/nonexistent/dir"), "model", "an existing checkpoint directory"),
        (lambda: ModelConfig(max_model_len=0), "max_model_len", "an integer in [1, 4194304]"),
        (lambda: ModelConfig(seed=-1), "seed", "an integer >= 0"),
        (lambda: CacheConfig(block_size=24), "block_size", "a power of two"),
        (lambda: CacheConfig(kv_cache_dtype="int4"), "kv_cache_dtype", "one of ['auto', 'fp8_e4m3', 'fp8_e5m2']"),
        (lambda: CacheConfig(num_kv_blocks=0), "num_kv_blocks", "an integer >= 1"),
        (lambda: CacheConfig(kv_cache_memory_bytes=-5), "kv_cache_memory_bytes", "an integer >= 1"),
        (lambda: AttentionConfig(backend="cudnn"), "attention_backend",
         "one of ['CPU_SDPA', 'FLASHINFER', 'TORCH', 'TRITON']"),
        (lambda: AttentionConfig(backend="prefill=TRITON"), "attention_backend",
         "prefill=NAME,decode=NAME: both phases named"),
        (lambda: AttentionConfig(backend="prefill=FLASHINFER,decode=cudnn"), "attention_backend",
         "prefill=NAME,decode=NAME with names from that list"),
        (lambda: AttentionConfig(backend="prefill=TRITON;decode=TORCH"), "attention_backend",
         "one of ['CPU_SDPA', 'FLASHINFER', 'TORCH', 'TRITON'], prefill=NAME,decode=NAME"),
        (lambda: AttentionConfig(backend="prefill=TRITON,decode=TORCH,decode=TRITON"), "attention_backend",
         "prefill=NAME,decode=NAME"),
        (lambda: ParallelConfig(tp=0), "tp", "an integer in [1, 1024]"),
        (lambda: ParallelConfig(tp=6, dcp=4), "dcp", "a divisor of tp=6: one of [1, 2, 3, 6]"),
        (lambda: ParallelConfig(dcp_comm="ring"), "dcp_comm", "one of ['ag_rs', 'a2a']"),
        (lambda: ParallelConfig(tp=4, ep=3), "ep", "a divisor of tp=4 (experts spread over the replica's ranks)"),
        (lambda: ParallelConfig(tp=2, ep=0), "ep", "an integer in [1, 1024]"),
        (lambda: ParallelConfig(gpus_per_rank=0), "gpus_per_rank", "a fraction of a GPU in (0, 1]"),
        (lambda: ParallelConfig(gpus_per_rank=1.5), "gpus_per_rank", "a fraction of a GPU in (0, 1]"),
        (lambda: ParallelConfig(gpus_per_rank=float("nan")), "gpus_per_rank", "a fraction of a GPU in (0, 1]"),
        (lambda: ParallelConfig(gpus_per_rank=True), "gpus_per_rank", "a fraction of a GPU in (0, 1]"),
        (lambda: ParallelConfig(gpus_per_rank="0.5"), "gpus_per_rank", "a fraction of a GPU in (0, 1]"),
        (lambda: ParallelConfig(tp=2, gpus_per_rank=0.5), "gpus_per_rank",
         "1 with tp=2 (each rank of a tensor-parallel group needs a GPU of its own"),
        (lambda: ParallelConfig(tp=8, ep=8).check_experts(4), "ep", "a divisor of num_experts=4 and of tp=8: "
                                                                   "one of [1, 2, 4]"),
        (lambda: ParallelConfig(tp=2, ep=2).check_experts(None), "ep", "1 for a model without routed experts"),
        (lambda: SchedulerConfig(max_num_seqs=0), "max_num_seqs", "an integer in [1, 65536]"),
        (lambda: SchedulerConfig(max_num_batched_tokens=True), "max_num_batched_tokens", "an integer in"),
        (lambda: PoolConfig(mode="split"), "pools", "one of ['unified', 'disaggregated']"),
        (lambda: PoolConfig(decode_replicas=0), "decode_replicas", "an integer in [1, 4096]"),
        (lambda: ServerConfig(port=70000), "port", "an integer in [0, 65535]"),
        (lambda: ServerConfig(tls_cert="/x"), "tls_key", "set together with tls_cert"),
        (lambda: ServerConfig(auth_token_file="/nonexistent"), "auth_token_file", "an existing readable file"),
    ],
)
def test_bad_values_name_field_value_and_allowed(build, field, allowed):
    with pytest.raises(ConfigError) as err:
        build()
    assert err.value.field == field
    assert allowed in str(err.value) and repr(err.value.value) in str(err.value)


def test_strings_become_enums_once():
    assert ParallelConfig(tp=4, dcp=2, dcp_comm="A2A").dcp_comm is DcpComm.A2A
    assert ParallelConfig(gpus_per_rank=1).gpus_per_rank == 1.0 and ParallelConfig().gpus_per_rank == 1.0
    assert ParallelConfig(gpus_per_rank=0.25).gpus_per_rank == 0.25
    assert PoolConfig(mode="disaggregated").mode is PoolMode.DISAGGREGATED
    assert AttentionConfig(backend="triton").backend == "TRITON"
    assert AttentionConfig(backend=" decode=triton, Prefill=flashinfer").backend == "prefill=FLASHINFER,decode=TRITON"
    assert AttentionConfig(backend="prefill=TRITON,decode=triton").backend == "TRITON"  # one backend: no split


def test_head_split_check_says_what_works():
    ParallelConfig(tp=4).check_heads(num_heads=8, num_kv_heads=2)  # kv heads replicated x2
    with pytest.raises(ConfigError, match=r"one of \[1, 2, 4, 8\]"):
        ParallelConfig(tp=3).check_heads(num_heads=8, num_kv_heads=2)
