"""DeepSeek-V3 at tp=2, dcp=2 over gloo equals HF transformers' greedy generate, token for token.

Two processes each load the tiny checkpoint, shard its attention (deepseek_parallel: each rank
projects 2 of the 4 query heads; the two ranks of the DCP group each cache every other token of
the latent and merge their partial attention by LSE), and step through the same batch: one
prompt prefilled whole, one in two chunks (its second chunk beside the first prompt's first
decode), then decodes. Both the TORCH and the TRITON MLA backends, with both merge collectives.
"""

import pytest
import torch

from meshserve.attention.backend import AttentionProblem
from meshserve.attention.metadata import AttentionMetadata
from meshserve.attention.mla.layer import MLAAttention
from meshserve.config import DcpComm, ParallelConfig
from meshserve.kvstore.cache_tensors import allocate_caches
from meshserve.parallel.groups import init_parallel, shutdown_parallel
from meshserve.workers.loader import load_model
from meshserve.workers.models.deepseek_parallel import parallelize_deepseek
from meshserve.workers.models.transformer import ForwardContext, LayerAttention
from tests.deepseek_models import write_deepseek
from tests.integration.distributed import run_ranks
from tests.tiny_models import hf_greedy, prompts

NEW_TOKENS = 10
BLOCK = 4


def greedy(model, attn: MLAAttention, caches, batch, chunks, *, dcp: int, rank: int) -> list[list[int]]:
    """Greedy decoding of `batch` with prompt chunk sizes `chunks` (one list per prompt)."""
    tokens = [list(p) for p in batch]
    computed = [0] * len(batch)
    plans = [list(c) for c in chunks]
    local = -(-(max(map(len, batch)) + NEW_TOKENS) // dcp)  # tokens a rank caches per sequence
    per_seq = -(-local // BLOCK)
    tables = [list(range((s + 1) * per_seq, s * per_seq, -1)) for s in range(len(batch))]  # reversed ids
    while any(len(t) - len(p) < NEW_TOKENS for t, p in zip(tokens, batch)):
        step = []
        for s, (t, p) in enumerate(zip(tokens, batch)):
            n = plans[s].pop(0) if computed[s] < len(p) else 1
            step.append((s, t[computed[s] : computed[s] + n]))
        step.sort(key=lambda item: computed[item[0]] >= len(batch[item[0]]))  # prefills first
        meta = AttentionMetadata.build(
            query_lens=[len(new) for _, new in step], seq_lens=[computed[s] + len(new) for s, new in step],
            block_tables=[tables[s] for s, _ in step], block_size=BLOCK, dcp_size=dcp, dcp_rank=rank,
        )  # fmt: skip
        ids = torch.tensor([tok for _, new in step for tok in new])
        pos = torch.cat([torch.arange(computed[s], computed[s] + len(new)) for s, new in step])
        plan = attn.plan(meta)
        ctx = ForwardContext(meta.slot_mapping, [LayerAttention(attn, plan, cache) for cache in caches])
        hidden = model(ids, pos, ctx)
        logits = model.compute_logits(hidden[meta.query_start_loc[1:].long() - 1])
        for (s, new), row in zip(step, logits):
            computed[s] += len(new)
            if computed[s] == len(tokens[s]):
                tokens[s].append(int(row.argmax()))
    return [t[len(p) :][:NEW_TOKENS] for t, p in zip(tokens, batch)]


def worker(rank: int, world: int, init_method: str, path: str, batch, chunks, want) -> None:
    torch.set_num_threads(1)
    ctx = init_parallel(ParallelConfig(tp=world, dcp=2), rank=rank, init_method=init_method)
    try:
        for backend, comm in (("TORCH", DcpComm.AG_RS), ("TRITON", DcpComm.A2A)):
            model = load_model(path, dtype=torch.float32, progress=False)
            parallelize_deepseek(model, ctx, comm=comm)
            specs = model.attention_specs()
            assert specs[0].num_heads == 4  # a rank attends for both ranks' heads of its DCP group
            problem = AttentionProblem(spec=specs[0], block_size=BLOCK, max_model_len=128, dcp_size=ctx.dcp)
            attn = MLAAttention(problem, decode_backend=backend, prefill_backend=backend)
            caches = allocate_caches(specs, num_blocks=64, block_size=BLOCK, dtype=torch.float32)
            got = greedy(model, attn, caches, batch, chunks, dcp=ctx.dcp, rank=ctx.dcp_rank)
            assert got == want, f"rank {rank} {backend}: {got} != HF {want}"
    finally:
        shutdown_parallel(ctx)


def test_tp2_dcp2_matches_hf(tmp_path):
    path = tmp_path / "deepseek_v3"
    hf = write_deepseek(path, "deepseek_v3")
    batch = prompts(2, seed=11, min_len=13, max_len=22)
    chunks = [[len(batch[0])], [9, len(batch[1]) - 9]]
    want = [hf_greedy(hf, p, NEW_TOKENS) for p in batch]
    assert all(len(w) == NEW_TOKENS for w in want)
    run_ranks(worker, 2, str(path), batch, chunks, want)


@pytest.mark.parametrize("tp", [1])
def test_harness_matches_hf_without_parallelism(tmp_path, tp):
    """The same stepping on one rank (no transform): the harness itself agrees with HF."""
    path = tmp_path / "deepseek_v2"
    hf = write_deepseek(path, "deepseek_v2")
    batch = prompts(2, seed=12, min_len=11, max_len=19)
    model = load_model(path, dtype=torch.float32, progress=False)
    specs = model.attention_specs()
    attn = MLAAttention(AttentionProblem(spec=specs[0], block_size=BLOCK, max_model_len=128))
    caches = allocate_caches(specs, num_blocks=64, block_size=BLOCK, dtype=torch.float32)
    got = greedy(model, attn, caches, batch, [[len(batch[0])], [5, len(batch[1]) - 5]], dcp=tp, rank=0)
    assert got == [hf_greedy(hf, p, NEW_TOKENS) for p in batch]
