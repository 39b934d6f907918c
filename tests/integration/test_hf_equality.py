"""Greedy generation through `meshserve.LLM` equals HF transformers' own greedy `generate`,
token for token, for every supported architecture and attention backend.

Tiny random checkpoints are written by `save_pretrained`; Mistral's sliding window (7) is
shorter than the prompts. The same outputs must hold with chunked prefill forced small, with
preemption forced by a tiny KV pool, and with prefix-cache hits on a second run.
"""

import pytest

from meshserve import LLM, SamplingParams
from meshserve.attention.backend import AttentionProblem
from meshserve.attention.registry import BACKENDS, judge
from meshserve.workers.checkpoint import read_arch
from tests.tiny_models import ARCHS, hf_greedy, prompts, write_checkpoint

NEW_TOKENS = 24
BLOCK = 16
MAX_LEN = 128
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
# TRITON runs in the Triton interpreter on CPU: a smaller batch keeps it quick.
BATCH = {"TRITON": 2}  # others: all 5 prompts


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """arch -> (checkpoint dir, prompts, HF greedy outputs for each prompt)."""
    root = tmp_path_factory.mktemp("hf_eq")
    out = {}
    for name in ARCHS:
        hf = write_checkpoint(root / name, name)
        batch = prompts(5, seed=len(name), min_len=9, max_len=40)
        out[name] = (root / name, batch, [hf_greedy(hf, p, NEW_TOKENS) for p in batch])
    return out


def _skip_unless_usable(backend, path):
    """Skip only when the backend cannot be used on this branch/machine, naming the reasons."""
    arch = read_arch(path)
    from meshserve.attention.spec import AttentionSpec

    spec = AttentionSpec(num_heads=arch.num_heads, num_kv_heads=arch.num_kv_heads, head_size=arch.head_dim,
                         sliding_window=arch.layer_windows[0])
    verdict = judge(backend, AttentionProblem(spec=spec, block_size=BLOCK, max_model_len=MAX_LEN))
    if not verdict.ok:
        pytest.skip(f"{backend}: " + "; ".join(verdict.reasons))


def _llm(path, backend="TORCH", **kw):
    kw = {"num_kv_blocks": 64, "max_model_len": MAX_LEN, **kw}
    return LLM(path, attention_backend=backend, block_size=BLOCK, progress=False, **kw)


def _check(outputs, want):
    for i, (out, ref) in enumerate(zip(outputs, want)):
        assert out.token_ids == ref, f"prompt {i}: meshserve {out.token_ids} != HF {ref}"
        assert len(ref) == NEW_TOKENS or ref[-1] == 0  # ended by length or by EOS (id 0)


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_matches_hf(cases, arch, backend):
    path, batch, want = cases[arch]
    _skip_unless_usable(backend, path)
    n = BATCH.get(backend, 5)
    llm = _llm(path, backend)
    _check(llm.generate(batch[:n], GREEDY), want[:n])


# Under the interpreter TRITON takes a second per step or so: two architectures (full
# attention with llama3 rope, sliding window) on two or three prompts cover its paths here.
@pytest.mark.parametrize("arch, backend", [(a, b) for a in ARCHS for b in ("TORCH", "CPU_SDPA")]
                         + [("llama", "TRITON"), ("mistral", "TRITON")])
def test_small_chunks_preemption_and_prefix_hits_keep_outputs(cases, arch, backend):
    path, batch, want = cases[arch]
    _skip_unless_usable(backend, path)
    if backend == "TRITON":
        # Fewest prompts that still run out of blocks: Mistral's window frees them as it goes.
        n = 3 if arch == "mistral" else 2
        batch, want = batch[:n], want[:n]
    # Chunked prefill: at most 8 tokens per step, so every prompt is split.
    chunked = _llm(path, backend, max_num_batched_tokens=8)
    _check(chunked.generate(batch, GREEDY), want)
    assert chunked.core.scheduler.stats.num_steps >= sum(len(p) for p in batch) // 8
    # Preemption: 4 usable blocks of 16 cannot hold the sequences of up to 64 tokens (nor
    # Mistral's, although blocks that leave its window go back to the pool).
    tiny = _llm(path, backend, num_kv_blocks=5, max_model_len=64)
    _check(tiny.generate(batch, GREEDY), want)
    assert tiny.core.scheduler.stats.num_preemptions > 0
    # Prefix cache: the second run finds every full prompt block cached and still agrees.
    cached = _llm(path, backend)
    _check(cached.generate(batch, GREEDY), want)
    before = cached.core.scheduler.stats.num_prefix_hit_tokens
    second = cached.generate(batch, GREEDY)
    _check(second, want)
    hits = [o.num_cached_tokens for o in second]
    assert hits == [(len(p) - 1) // BLOCK * BLOCK for p in batch]
    assert cached.core.scheduler.stats.num_prefix_hit_tokens - before == sum(hits) > 0


# A forced phase split (attention/backends/phase_split.py): prefill on one backend, decode on the
# other, over one cache. Chunked prefill (8 tokens a step) puts prefill chunks and decodes in
# the same steps, so both halves run in one step; tokens equal HF's and the single-backend run's.
@pytest.mark.parametrize("arch, split", [("llama", "prefill=CPU_SDPA,decode=TRITON"),
                                         ("mistral", "prefill=TRITON,decode=TORCH"),
                                         ("qwen3", "prefill=TORCH,decode=CPU_SDPA")])
def test_forced_phase_split_keeps_outputs(cases, arch, split, monkeypatch):
    from meshserve.attention.backends.phase_split import PhaseSplitBackend

    plans = []
    real_plan = PhaseSplitBackend.plan
    monkeypatch.setattr(PhaseSplitBackend, "plan", lambda self, meta: plans.append(real_plan(self, meta)) or plans[-1])
    path, batch, want = cases[arch]
    _skip_unless_usable(split, path)
    n = 2 if "TRITON" in split else 5
    batch, want = batch[:n], want[:n]
    prefill, decode = (part.partition("=")[2] for part in split.split(","))
    single = _llm(path, decode).generate(batch, GREEDY)
    llm = _llm(path, split.lower(), max_num_batched_tokens=8)
    assert llm.core.info.backend == f"{prefill} prefill + {decode} decode"
    outputs = llm.generate(batch, GREEDY)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in single]
    _check(outputs, want)
    assert any(p.prefill_plan is not None and p.decode_plan is not None for p in plans)  # mixed steps ran


def test_shared_prefix_prompts_hit_the_cache(cases):
    path, batch, _ = cases["qwen3"]
    hf = write_checkpoint(path.parent / "qwen3_again", "qwen3")
    shared = batch[-1][:32]
    family = [shared + p[:5] for p in batch[:3]]
    want = [hf_greedy(hf, p, NEW_TOKENS) for p in family]
    llm = _llm(path.parent / "qwen3_again")
    first = llm.generate(family[:1], GREEDY)
    rest = llm.generate(family[1:], GREEDY)
    _check(first + rest, want)
    assert [o.num_cached_tokens for o in rest] == [32, 32]


def test_seeded_sampling_is_reproducible(cases):
    """A seeded request draws the same tokens alone, in a mixed batch, and after preemption."""
    path, batch, _ = cases["llama"]
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=NEW_TOKENS, ignore_eos=True)
    others = [SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.7, seed=5, max_tokens=40, ignore_eos=True)]
    llm = _llm(path)
    alone = llm.generate([batch[0]], seeded)[0].token_ids
    mixed = llm.generate([batch[1], batch[0], batch[2]], [others[0], seeded, others[1]])
    assert mixed[1].token_ids == alone
    tiny = _llm(path, num_kv_blocks=5, max_model_len=64)
    crowded = tiny.generate([batch[3], batch[0], batch[4], batch[2]], [others[0], seeded, others[0], others[1]])
    assert tiny.core.scheduler.stats.num_preemptions > 0
    assert crowded[1].token_ids == alone
    assert crowded[3].token_ids == mixed[2].token_ids
    reseeded = SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=NEW_TOKENS, ignore_eos=True)
    assert llm.generate([batch[0]], reseeded)[0].token_ids != alone
