"""The static decode path (workers/decode_graphs.py) on CPU, without capture: buckets, padding,
static buffers, and tokens equal to the eager path's (the graphs replay exactly this path on CUDA).

Oracle: the eager ModelRunner on the same checkpoint, fed the same step plans (for DeepSeek also
the eager TORCH MLA reference).
"""

from __future__ import annotations

import pytest
import torch

from meshserve.attention.mla.layer import MLAAttention
from meshserve.config import AttentionConfig, CacheConfig, ModelConfig
from meshserve.errors import ConfigError
from meshserve.workers.decode_graphs import NULL_SLOT, DecodeGraphs, capture_sizes, graph_refusal
from meshserve.workers.models.expert_layer import expert_layers
from meshserve.workers.step import ScheduledSeq, StepPlan
from meshserve.workers.worker import Worker
from tests.deepseek_models import write_deepseek
from tests.tiny_models import write_checkpoint
from tests.unit.workers.step_driver import StepDriver

BLOCK = 16
NUM_BLOCKS = 64


def test_capture_sizes_are_the_documented_buckets():
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(256) == [1, 2, 4] + list(range(8, 257, 8))
    with pytest.raises(ConfigError, match="max_batch"):
        capture_sizes(0)


def _worker(path, backend="TRITON") -> Worker:
    w = Worker(ModelConfig(model=str(path), dtype="float32"), CacheConfig(block_size=BLOCK, num_kv_blocks=NUM_BLOCKS),
               AttentionConfig(backend=backend), device="cpu", progress=False)  # fmt: skip
    w.start()
    return w


def _graphs(w: Worker, max_batch: int) -> DecodeGraphs:
    r = w.runner
    return DecodeGraphs(r.model, backends=r.backends, kv_caches=r.kv_caches, layer_groups=r.layer_groups,
                        block_size=BLOCK, max_local_len=w.info.max_model_len, max_batch=max_batch,
                        device=torch.device("cpu"), capture=False)  # fmt: skip


def _run_both(eager, static, graphs: DecodeGraphs, num_groups: int, *,
              others=()) -> tuple[list[tuple[int, int]], set[int]]:  # fmt: skip
    """Drive both runners (and `others`, more eager oracles); return (batch, bucket) of every static
    step and the blocks handed out."""
    drv = StepDriver(num_groups, block_size=BLOCK, num_blocks=NUM_BLOCKS)
    sampled_rows: list[int] = []
    real_draw = static.sampler.draw

    def spy(logits, rows, **kwargs):
        sampled_rows.append(logits.shape[0])
        assert logits.shape[0] == len(rows)
        return real_draw(logits, rows, **kwargs)

    static.sampler.draw = spy
    seen = []
    prompts = {f"r{i}": [drv.rng.randrange(1, 300) for _ in range(5 + 7 * i)] for i in range(5)}

    def both(plan: StepPlan) -> None:
        sampled_rows.clear()
        a, b = eager.execute(plan), static.execute(plan)
        assert sampled_rows == [len(plan.all_seqs())]  # padded rows never reach the sampler
        ta, tb = drv.record(a), {s.request_id: s.token_id for s in b.sampled}
        assert ta == tb, f"step {plan.step_id}: eager {ta} != static {tb}"
        for other in others:
            tc = {s.request_id: s.token_id for s in other.execute(plan).sampled}
            assert tc == tb, f"step {plan.step_id}: oracle {tc} != static {tb}"
        if graphs.serves(plan.all_seqs()):
            seen.append((len(plan.all_seqs()), graphs.bucket(len(plan.all_seqs()))))

    for rid in ("r0", "r1", "r2"):
        both(drv.prefill(rid, prompts[rid]))
    for _ in range(4):
        both(drv.decode(["r0", "r1", "r2"]))  # 3 rows in bucket 4: one padded row
    both(drv.prefill("r3", prompts["r3"]))  # a prefill step runs eagerly
    for _ in range(3):
        both(drv.decode(["r0", "r1", "r2", "r3"]))
    both(drv.decode(["r1", "r3"], finished=["r0", "r2"]))
    both(drv.prefill("r4", prompts["r4"]))
    for _ in range(3):
        both(drv.decode(["r1", "r3", "r4"]))
    for _ in range(2):
        both(drv.decode(["r4"]))
    used = {b for tables in drv.tables.values() for t in tables for b in t}
    return seen, used


def _buffers(graphs: DecodeGraphs) -> list[torch.Tensor]:
    return [graphs.input_ids, graphs.positions, graphs.seq_lens, graphs.context_lens, graphs.num_real_tokens,
            *graphs.block_tables, *graphs.slot_mappings]  # fmt: skip


def _check_contract(eager, static, graphs: DecodeGraphs, seen, used, ptrs) -> None:
    assert {bucket for _, bucket in seen} == {1, 2, 4}  # the batch moved between buckets
    assert (3, 4) in seen  # a padded step ran
    assert [t.data_ptr() for t in _buffers(graphs)] == ptrs  # the addresses a graph holds never change
    # Padded rows wrote only into the null block: every block no request owns is untouched.
    for cache in static.kv_caches:
        untouched = [b for b in range(1, NUM_BLOCKS) if b not in used]
        assert torch.count_nonzero(cache.data[untouched]) == 0
    # The K/V the requests wrote agree with the eager run's (attention partitions differ: rounding only).
    for a, b in zip(eager.kv_caches, static.kv_caches):
        torch.testing.assert_close(a.data[1:], b.data[1:], rtol=1e-5, atol=1e-5)
    # Padded rows' slot mapping points at the null slot.
    assert graphs.slot_mappings[0][3].item() == NULL_SLOT
    # MoE layers: padded rows went to no expert, so every layer counted what the eager run did.
    loads = [m.expert_load.tolist() for m in expert_layers(static.model)]
    assert loads == [m.expert_load.tolist() for m in expert_layers(eager.model)]
    assert graphs.num_real_tokens.item() == 1  # the last step: one row (bucket 1)


@pytest.mark.parametrize("arch", ["llama", "gemma2", "gpt_oss"])
def test_static_decode_equals_eager_and_keeps_its_contract(tmp_path, arch):
    write_checkpoint(tmp_path / arch, arch)
    eager_w, static_w = _worker(tmp_path / arch), _worker(tmp_path / arch)
    static = static_w.runner
    graphs = static.decode_graphs = _graphs(static_w, max_batch=4)
    ptrs = [t.data_ptr() for t in _buffers(graphs)]
    seen, used = _run_both(eager_w.runner, static, graphs, static.num_groups)
    _check_contract(eager_w.runner, static, graphs, seen, used, ptrs)


@pytest.mark.parametrize("arch", ["llama", "gpt_oss"])
def test_static_decode_with_a_phase_split_equals_eager(tmp_path, arch):
    """prefill=TORCH,decode=TRITON: decode steps plan and replay through the decode backend (TRITON)
    alone; tokens equal the eager split's and the single-backend TRITON run's."""
    write_checkpoint(tmp_path / arch, arch)
    split = "prefill=TORCH,decode=TRITON"
    path = tmp_path / arch
    eager_w, static_w, single_w = _worker(path, split), _worker(path, split), _worker(path)
    assert static_w.info.backend == "TORCH prefill + TRITON decode"
    static = static_w.runner
    assert graph_refusal(static.backends[0]) is None
    graphs = static.decode_graphs = _graphs(static_w, max_batch=4)
    ptrs = [t.data_ptr() for t in _buffers(graphs)]
    seen, used = _run_both(eager_w.runner, static, graphs, static.num_groups, others=(single_w.runner,))
    _check_contract(eager_w.runner, static, graphs, seen, used, ptrs)
    refused = _worker(tmp_path / arch, "prefill=TRITON,decode=TORCH").runner.backends[0]
    assert graph_refusal(refused) == "attention backend TRITON prefill + TORCH decode declares no CUDA-graph support"


def test_deepseek_static_decode_equals_eager_and_the_torch_mla_reference(tmp_path):
    """DeepSeek-V3 (MLA + MoE): the static path through TRITON MLA decode (interpreter) gives the
    eager TRITON run's and the TORCH MLA reference's greedy tokens, and keeps the contract."""
    path = tmp_path / "deepseek_v3"
    write_deepseek(path, "deepseek_v3")
    eager_w, static_w, ref_w = _worker(path), _worker(path), _worker(path, backend="TORCH")
    static = static_w.runner
    mla = static.backends[0]
    assert isinstance(mla, MLAAttention) and mla.decode.name == "TRITON" and graph_refusal(mla) is None
    graphs = static.decode_graphs = _graphs(static_w, max_batch=4)
    ptrs = [t.data_ptr() for t in _buffers(graphs)]
    seen, used = _run_both(eager_w.runner, static, graphs, static.num_groups, others=[ref_w.runner])
    _check_contract(eager_w.runner, static, graphs, seen, used, ptrs)
    # The graph plans read the lengths from the static buffer and cut each row by its own length
    # over splits fixed for max_model_len (more than one here, so empty splits and the merge ran).
    (_, _, plan), = graphs._plans[4]
    assert plan.decode_plan.kv_lens.data_ptr() == graphs.seq_lens.data_ptr()
    assert plan.decode_plan.partition == 0 and plan.decode_plan.num_splits > 1


@pytest.mark.parametrize("name", ["deepseek_v3", "gpt_oss"])
def test_moe_static_decode_on_the_fused_kernels_drops_padding_rows(tmp_path, monkeypatch, name):
    """The CUDA wiring in the interpreter: the routing kernel, fused_moe and the MoE sum deferred
    into the next norm kernel. A padded bucket's rows come out of the routing with no expert and
    out of fused_moe as zeros (not the output buffer's garbage: that sum is in the real rows'
    norm kernel launch); tokens and every layer's load equal the eager fused run's."""
    import meshserve.workers.models.expert_layer as expert_layer
    import meshserve.workers.models.fused_ops as fused_ops
    import meshserve.workers.models.moe as moe
    from meshserve.workers.models.routing_kernel import route_triton

    monkeypatch.setattr(fused_ops, "runs_triton", lambda x: True)
    monkeypatch.setattr(expert_layer, "runs_fused", lambda device: True)
    monkeypatch.setattr(moe, "route_torch", route_triton)  # select_experts' CPU branch: the kernel
    fused = moe.fused_moe
    padded = []

    def spy(x, weights, ids, experts, **kw):
        out = fused(x, weights, ids, experts, **kw)
        real = kw.get("num_real_tokens")
        if real is not None and int(real) < x.shape[0]:
            padded.append(bool((ids[int(real) :] == -1).all() and (out[int(real) :] == 0).all()))
        return out

    monkeypatch.setattr(moe, "fused_moe", spy)
    path = tmp_path / name
    write_deepseek(path, name) if name.startswith("deepseek") else write_checkpoint(path, name)
    eager_w, static_w = _worker(path), _worker(path)
    static = static_w.runner
    assert all(m.fused is not None for m in expert_layers(static.model))  # packed: the fused path
    graphs = static.decode_graphs = _graphs(static_w, max_batch=4)
    ptrs = [t.data_ptr() for t in _buffers(graphs)]
    seen, used = _run_both(eager_w.runner, static, graphs, static.num_groups)
    _check_contract(eager_w.runner, static, graphs, seen, used, ptrs)
    assert padded and all(padded)


def test_mla_graph_refusals_name_the_backend(tmp_path):
    from meshserve.attention.mla.sparse_layer import SparseMLAAttention
    from tests.unit.attention.mla_cases import MLA_BY_NAME
    from tests.unit.attention.sparse_cases import sparse_problem

    path = tmp_path / "deepseek_v3"
    write_deepseek(path, "deepseek_v3")
    ref, tri = _worker(path, backend="TORCH"), _worker(path)
    assert graph_refusal(ref.runner.backends[0]) == "MLA decode backend TORCH declares no CUDA-graph support"
    why = " ".join(tri._graph_refusals(tri.runner.backends, tri.runner.model))
    assert "MLA" not in why and "MoE routing" in why  # on CPU the experts sync; TRITON MLA would capture
    with pytest.raises(ConfigError, match="cuda_graphs"):
        _graphs(ref, max_batch=2)
    sparse = SparseMLAAttention(sparse_problem(MLA_BY_NAME["small_decode"]), backend="TORCH")
    assert "sparse MLA" in graph_refusal(sparse)



def test_static_decode_refuses_what_it_cannot_serve(tmp_path):
    write_checkpoint(tmp_path / "llama", "llama")
    w = _worker(tmp_path / "llama")
    graphs = _graphs(w, max_batch=2)
    decode = ScheduledSeq("a", [5], 3, [[1]])
    assert graphs.serves([decode, decode])
    assert not graphs.serves([decode] * 3)  # larger than the largest bucket: eager
    assert not graphs.serves([ScheduledSeq("a", [5, 6], 3, [[1]])])  # a prompt chunk: eager
    assert not graphs.serves([ScheduledSeq("a", [5], 3, [[1]], sample=False)])
    assert not graphs.serves([])
    with pytest.raises(ConfigError, match="seqs"):
        graphs.run([decode] * 3)
    ref = _worker(tmp_path / "llama", backend="TORCH")
    with pytest.raises(ConfigError, match="cuda_graphs"):
        _graphs(ref, max_batch=2)


def test_graphs_off_on_cpu_and_with_enforce_eager(tmp_path, caplog):
    write_checkpoint(tmp_path / "llama", "llama")
    w = _worker(tmp_path / "llama")
    assert w.runner.decode_graphs is None  # CPU: nothing to capture
    assert "device is cpu" in w._graph_refusals(w.runner.backends, w.runner.model)
    eager = Worker(ModelConfig(model=str(tmp_path / "llama"), dtype="float32", enforce_eager=True),
                   CacheConfig(block_size=BLOCK, num_kv_blocks=NUM_BLOCKS), device="cpu", progress=False)
    assert "enforce_eager is set" in eager._graph_refusals(w.runner.backends, w.runner.model)
    with pytest.raises(ConfigError, match="cuda_graph_max_batch"):
        ModelConfig(model=str(tmp_path / "llama"), cuda_graph_max_batch=0)
