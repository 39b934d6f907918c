"""The static path of steps with prefill tokens (workers/piecewise_graphs.py) on CPU, without
capture: token buckets, padding, the split at every attention call, and tokens and K/V equal to
the eager path's (on CUDA the graphs replay exactly this path, attention eager in between).

Oracle: the eager ModelRunner on the same checkpoint, fed the same step plans.
"""

from __future__ import annotations

import random

import pytest
import torch

from meshserve.config import AttentionConfig, CacheConfig, ModelConfig
from meshserve.errors import ConfigError
from meshserve.workers.models.expert_layer import expert_layers
from meshserve.workers.piecewise_graphs import PiecewiseGraphs, piecewise_refusal, split_refusal, token_buckets
from meshserve.workers.step import StepPlan
from meshserve.workers.worker import Worker
from tests.deepseek_models import write_deepseek, write_deepseek_v32
from tests.tiny_models import write_checkpoint
from tests.unit.workers.step_driver import StepDriver

BLOCK = 16
NUM_BLOCKS = 64


def test_token_buckets_are_the_documented_sizes():
    assert token_buckets(16) == [16]
    assert token_buckets(40) == [16, 32, 40]
    assert token_buckets(512) == [16, 32, 64, 128, 256, 320, 384, 448, 512]
    assert token_buckets(600) == [16, 32, 64, 128, 256, 320, 384, 448, 512, 576, 600]
    with pytest.raises(ConfigError, match="max_tokens"):
        token_buckets(0)


def test_model_config_checks_the_token_limit():
    assert ModelConfig(piecewise_graph_tokens=0).piecewise_graph_tokens == 0
    for bad in (-1, 16385, 2.5, True):
        with pytest.raises(ConfigError, match="piecewise_graph_tokens"):
            ModelConfig(piecewise_graph_tokens=bad)


def _worker(path, backend: str) -> Worker:
    w = Worker(ModelConfig(model=str(path), dtype="float32"), CacheConfig(block_size=BLOCK, num_kv_blocks=NUM_BLOCKS),
               AttentionConfig(backend=backend), device="cpu", progress=False)  # fmt: skip
    w.start()
    return w


def _pieces(w: Worker, max_tokens: int) -> PiecewiseGraphs:
    r = w.runner
    graphs = PiecewiseGraphs(r.model, backends=r.backends, kv_caches=r.kv_caches, layer_groups=r.layer_groups,
                             max_tokens=max_tokens, device=torch.device("cpu"), capture=False)  # fmt: skip
    graphs.capture_all()  # without capture: makes the buffers (a warm-up run of the largest bucket)
    return graphs


def _run_both(eager, static, graphs: PiecewiseGraphs) -> list[tuple[int, int]]:
    """Drive both runners; return (tokens, bucket) of every step the static path served."""
    drv = StepDriver(static.num_groups, block_size=BLOCK, num_blocks=NUM_BLOCKS)
    rng = random.Random(1)
    prompt = {f"r{i}": [rng.randrange(1, 300) for _ in range(n)] for i, n in enumerate((5, 23, 40, 9, 61))}
    seen = []

    def both(plan: StepPlan) -> None:
        before = graphs.num_steps
        a, b = eager.execute(plan), static.execute(plan)
        ta, tb = drv.record(a), {s.request_id: s.token_id for s in b.sampled}
        assert ta == tb, f"step {plan.step_id}: eager {ta} != static {tb}"
        if graphs.num_steps > before:
            n = sum(len(s.token_ids) for s in plan.all_seqs())
            seen.append((n, graphs.bucket(n)))

    both(drv.plan({"r0": prompt["r0"]}))  # 5 tokens in bucket 16
    both(drv.plan({"r1": prompt["r1"], "r2": prompt["r2"][:20]}, decodes=["r0"]))  # 44 tokens: a chunk, a decode
    for _ in range(2):
        both(drv.plan({}, decodes=["r0", "r1"]))  # decode-only (no decode graphs on this runner): here too
    both(drv.plan({"r2": prompt["r2"][20:]}, decodes=["r0", "r1"]))  # the rest of r2 over its cached chunk
    both(drv.plan({"r3": prompt["r3"], "r4": prompt["r4"]}, decodes=["r0", "r1", "r2"]))  # 73 tokens: over the limit
    both(drv.plan({}, decodes=["r1", "r2", "r3", "r4"], finished=["r0"]))
    return seen


def _check_expert_loads(eager, static, graphs: PiecewiseGraphs) -> None:
    """MoE layers: the padded rows went to no expert, so every layer counted what the eager run did."""
    loads = [m.expert_load.tolist() for m in expert_layers(static.model)]
    assert loads == [m.expert_load.tolist() for m in expert_layers(eager.model)]
    assert graphs.num_real_tokens.item() == 4  # the last static step's 4 tokens (bucket 16)


# The phase splits (attention/backends/phase_split.py): attention runs eagerly between the pieces with
# the step's plan, each phase on its backend; TORCH's half makes the model defer write_kv (no fused write).
CASES = [
    ("llama", "TRITON"),
    ("qwen3", "TORCH"),
    ("gemma2", "TORCH"),
    ("gpt_oss", "TORCH"),
    ("llama", "prefill=TORCH,decode=TRITON"),
    ("gemma2", "prefill=TRITON,decode=TORCH"),
]


@pytest.mark.parametrize("arch,backend", CASES)
def test_static_steps_with_prefill_equal_eager_and_keep_their_contract(tmp_path, arch, backend):
    """llama on TRITON: the model stores K/V in its fused rotary kernel (inside a graph on CUDA);
    qwen3 (q/k norms) and gemma2 (sliding window + soft-cap, sandwich norms) on TORCH: the split
    backend defers write_kv to the eager attention beside it; gpt_oss: MoE layers, whose padded
    rows run no expert and are not counted."""
    write_checkpoint(tmp_path / arch, arch)
    eager_w, static_w = _worker(tmp_path / arch, backend), _worker(tmp_path / arch, backend)
    static = static_w.runner
    graphs = static.piecewise_graphs = _pieces(static_w, max_tokens=64)
    ptrs = [t.data_ptr() for t in (graphs.input_ids, graphs.positions, graphs.num_real_tokens,
                                   *graphs.slot_mappings, *graphs._buffers.values())]  # fmt: skip
    seen = _run_both(eager_w.runner, static, graphs)
    assert seen == [(5, 16), (44, 64), (2, 16), (2, 16), (22, 32), (4, 16)]  # the 73-token step ran eager
    assert [t.data_ptr() for t in (graphs.input_ids, graphs.positions, graphs.num_real_tokens, *graphs.slot_mappings,
                                   *graphs._buffers.values())] == ptrs  # the addresses a graph holds  # fmt: skip
    _check_expert_loads(eager_w.runner, static, graphs)
    # Padded rows wrote no K/V: the caches equal the eager run's everywhere, the null block included.
    for a, b in zip(eager_w.runner.kv_caches, static.kv_caches):
        torch.testing.assert_close(a.data, b.data, rtol=1e-5, atol=1e-5)
        assert torch.count_nonzero(b.data[0]) == 0
    # After a 4-token step in bucket 16, rows 4..15 of the slot mapping skip the write.
    assert (graphs.slot_mappings[0][4:16] == -1).all()


@pytest.mark.parametrize("variant", ["deepseek_v2", "deepseek_v3"])
def test_deepseek_static_steps_with_prefill_equal_eager(tmp_path, variant):
    """MLA layers split at their MLAAttention's write_kv + forward: the latent rows, k_pe and q go
    to static buffers, the latent write and the attention run eagerly with the step's plan
    (TRITON MLA under the interpreter; V2: rope pairs interleaved, V3: halves, and MoE)."""
    path = tmp_path / variant
    write_deepseek(path, variant)
    eager_w, static_w = _worker(path, "TRITON"), _worker(path, "TRITON")
    static = static_w.runner
    assert split_refusal(static.model) is None  # (on CUDA its MoE runs fused: graph-safe; not on a CPU)
    assert "MoE routing" in piecewise_refusal(static.model, 1)
    graphs = static.piecewise_graphs = _pieces(static_w, max_tokens=64)
    seen = _run_both(eager_w.runner, static, graphs)
    assert seen == [(5, 16), (44, 64), (2, 16), (2, 16), (22, 32), (4, 16)]
    assert {"latent", "k_pe", "q", "o"} <= graphs._buffers.keys()  # the MLA split, not a standard one
    _check_expert_loads(eager_w.runner, static, graphs)
    for a, b in zip(eager_w.runner.kv_caches, static.kv_caches):  # the latent caches: nothing padded wrote
        torch.testing.assert_close(a.data, b.data, rtol=1e-5, atol=1e-5)


def test_piecewise_refusals_name_the_model_and_the_layout(tmp_path):
    path = tmp_path / "deepseek_v32"
    write_deepseek_v32(path)
    w = _worker(path, "TRITON")
    why = piecewise_refusal(w.runner.model, 1)
    assert why is not None and "sparse MLA" in why
    with pytest.raises(ConfigError, match="model"):
        _pieces(w, max_tokens=32)
    write_checkpoint(tmp_path / "llama", "llama")
    llama = _worker(tmp_path / "llama", "TORCH")
    assert piecewise_refusal(llama.runner.model, 1) is None
    assert "decode context parallel" in piecewise_refusal(llama.runner.model, 2)
    graphs = _pieces(llama, max_tokens=32)
    with pytest.raises(ConfigError, match="num_tokens"):
        graphs.bucket(33)
    assert not graphs.serves(0) and graphs.serves(32) and not graphs.serves(33)
