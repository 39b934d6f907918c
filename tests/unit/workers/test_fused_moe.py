"""The fused MoE (Triton interpreter on CPU) against a float64 oracle and against each model's
own torch MoE code (the CPU path).

Routings: random, some experts with no tokens, every token to one expert, slots dropped (an
expert held by another rank). fp32 and fp16 only: bf16 arithmetic is wrong in the
interpreter (tests/gpu covers bf16, T up to 8192).
"""

import pytest
import torch

from meshserve.workers.models.arch import SwigluExperts
from meshserve.workers.models.deepseek_arch import MoEConfig
from meshserve.workers.models.fused_moe import (
    ACT_SILU,
    ACT_SWIGLU_CLAMP,
    ExpertActivation,
    ExpertWeights,
    GemmTiles,
    TileConfig,
    align_rows,
    fused_moe,
    tile_config,
)
from meshserve.workers.models.gptoss_moe import SwigluMoE
from meshserve.workers.models.moe import MoE

E, H, INTER, TOP_K = 6, 40, 24, 2
SMALL = TileConfig(16, GemmTiles(16, 16, 4, 1), GemmTiles(32, 16, 4, 1))  # several tiles in every dimension
ORACLE_TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=4e-3, rtol=4e-3)}


def _routing(kind: str, T: int, gen: torch.Generator) -> torch.Tensor:
    """ids [T, TOP_K] with distinct experts per token."""
    if kind == "one_expert":  # every token's first slot to expert 3, second to expert 0
        return torch.tensor([[3, 0]] * T)
    scores = torch.rand(T, E, generator=gen)
    if kind == "sparse":  # experts 1, 2 and 4 get nothing
        scores[:, [1, 2, 4]] = -1.0
    ids = scores.topk(TOP_K, dim=-1).indices
    if kind == "dropped":  # slots of another rank's experts: ids past the local ones, or -1
        ids = torch.where(torch.rand(T, TOP_K, generator=gen) < 0.3, torch.tensor([E + 2, -1])[ids % 2], ids)
    return ids


def _experts(act: int, dtype: torch.dtype, gen: torch.Generator, *, bias: bool) -> ExpertWeights:
    def rnd(*shape):
        return (torch.randn(*shape, generator=gen) * 0.3).to(dtype)

    return ExpertWeights(w13=rnd(E, 2 * INTER, H), w2=rnd(E, H, INTER), b13=rnd(E, 2 * INTER) if bias else None,
                         b2=rnd(E, H) if bias else None, activation=ExpertActivation(act, 1.702, 1.5))


def _oracle(x, weights, ids, ew: ExpertWeights) -> torch.Tensor:
    """float64, one (token, slot) at a time."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if not 0 <= e < E:
                continue
            gu = ew.w13[e].double() @ x[t].double()
            if ew.b13 is not None:
                gu = gu + ew.b13[e].double()
            g, u = gu[:INTER], gu[INTER:]
            if ew.activation.kind == ACT_SILU:
                h = torch.nn.functional.silu(g) * u
            else:
                lim, alpha = ew.activation.limit, ew.activation.alpha
                g, u = g.clamp(max=lim), u.clamp(-lim, lim)
                h = (u + 1) * g * torch.sigmoid(alpha * g)
            y = ew.w2[e].double() @ h.to(x.dtype).double()  # the kernel stores h in x's dtype
            if ew.b2 is not None:
                y = y + ew.b2[e].double()
            out[t] += float(weights[t, j]) * y.to(x.dtype).double()
    return out


@pytest.mark.parametrize("use_triton", [False, True])
@pytest.mark.parametrize("kind", ["random", "sparse", "one_expert", "dropped"])
@pytest.mark.parametrize("T", [1, 7, 40, 700])
def test_align_rows_sorts_pads_and_counts(kind, T, use_triton):
    ids = _routing(kind, T, torch.Generator().manual_seed(T))
    block = 8
    load = torch.arange(E, dtype=torch.int64)  # counters so far: the kernel adds this step's in place
    a = align_rows(ids, E, block, use_triton=use_triton, expert_load=load)
    flat = ids.reshape(-1)
    n = flat.numel()
    rows = a.sorted_rows.view(-1, block)
    assert rows.shape[0] == a.block_expert.numel()
    seen = []
    for tile, expert in zip(rows.tolist(), a.block_expert.tolist()):
        real = [r for r in tile if r < n]
        if expert < 0:
            assert real == []
            continue
        assert real and all(int(flat[r]) == expert for r in real)  # one expert per tile, no empty tile
        assert tile[: len(real)] == real and all(r == n for r in tile[len(real) :])  # padding at the end
        seen += real
    local = [i for i in range(n) if 0 <= int(flat[i]) < E]
    assert sorted(seen) == local  # every kept row exactly once, dropped rows nowhere
    used = [e for e in a.block_expert.tolist() if e >= 0]
    assert used == sorted(used)  # tiles in expert order, the unused ones last
    assert a.block_expert.tolist()[len(used) :] == [-1] * (len(a.block_expert) - len(used))
    want = torch.bincount(flat[(flat >= 0) & (flat < E)], minlength=E)
    assert torch.equal(a.tokens_per_expert, want)
    assert torch.equal(load, torch.arange(E) + want)
    if use_triton:  # the one-program kernel and the torch ops agree exactly
        b = align_rows(ids, E, block, use_triton=False)
        assert torch.equal(a.sorted_rows, b.sorted_rows) and torch.equal(a.block_expert, b.block_expert)


@pytest.mark.parametrize("num_experts", [1, 64, 160])  # one expert; E a power of two; E not one
def test_align_kernel_matches_torch_at_other_expert_counts(num_experts):
    gen = torch.Generator().manual_seed(num_experts)
    ids = torch.randint(-1, num_experts, (37, 3), generator=gen)
    for block in (16, 64):
        a = align_rows(ids, num_experts, block, use_triton=True)
        b = align_rows(ids, num_experts, block, use_triton=False)
        for name in ("sorted_rows", "block_expert", "tokens_per_expert"):
            assert torch.equal(getattr(a, name), getattr(b, name)), (name, block)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("act", [ACT_SILU, ACT_SWIGLU_CLAMP])
@pytest.mark.parametrize("kind", ["random", "sparse", "one_expert", "dropped"])
@pytest.mark.parametrize("T", [1, 5, 33])
def test_fused_moe_matches_float64(dtype, act, kind, T):
    gen = torch.Generator().manual_seed(11 * T + act)
    ew = _experts(act, dtype, gen, bias=act == ACT_SWIGLU_CLAMP)
    x = torch.randn(T, H, generator=gen).to(dtype)
    ids = _routing(kind, T, gen)
    weights = torch.rand(T, TOP_K, generator=gen)
    load = torch.zeros(E, dtype=torch.int64)
    got = fused_moe(x, weights, ids, ew, config=SMALL, may_drop=kind == "dropped", expert_load=load)
    assert got.dtype == dtype and got.shape == (T, H)
    torch.testing.assert_close(got.double(), _oracle(x, weights, ids, ew), **ORACLE_TOL[dtype])
    flat = ids.reshape(-1)
    assert torch.equal(load, torch.bincount(flat[(flat >= 0) & (flat < E)], minlength=E))  # load statistics


@pytest.mark.parametrize("T", [1, 4, 70, 300])  # each of tile_config's three choices (T <= 4: the smallest tiles)
def test_fused_moe_default_tiles_and_no_tokens(T):
    """The default dispatch, the sorted path at every T, counts the expert load (none for no tokens)."""
    gen = torch.Generator().manual_seed(3)
    ew = _experts(ACT_SILU, torch.float32, gen, bias=False)
    x = torch.randn(T, H, generator=gen)
    ids, weights = _routing("random", T, gen), torch.rand(T, TOP_K, generator=gen)
    assert tile_config(ids.numel(), E).block_m == {1: 16, 4: 16, 70: 32, 300: 64}[T]
    load = torch.zeros(E, dtype=torch.int64)
    torch.testing.assert_close(fused_moe(x, weights, ids, ew, expert_load=load).double(),
                               _oracle(x, weights, ids, ew), **ORACLE_TOL[torch.float32])  # fmt: skip
    assert torch.equal(load, torch.bincount(ids.reshape(-1), minlength=E))
    empty = fused_moe(x[:0], weights[:0], ids[:0], ew, expert_load=load)
    assert empty.shape == (0, H) and load.sum() == T * TOP_K


class _GarbageEmpty:
    """fused_moe's `torch` with torch.empty returning NaN-filled float tensors: what uninitialised
    memory may hold on CUDA (a CPU allocation mostly comes back zeroed)."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*shape, **kw):
        out = torch.empty(*shape, **kw)
        return out.fill_(float("nan")) if out.is_floating_point() else out


@pytest.mark.parametrize("sum_rows", [True, False])
@pytest.mark.parametrize(("T", "real"), [(4, 3), (33, 20), (16, 0)])
def test_padding_rows_past_the_real_count_come_out_zero(monkeypatch, T, real, sum_rows):
    """Rows of a CUDA-graph bucket's padding tokens (the router gave them DROPPED ids) run on no
    expert, are not counted, and come out 0 (the down kernel's extra programs write them), not
    whatever the output buffer held; the real rows are exact (the float64 oracle)."""
    import meshserve.workers.models.fused_moe as fm
    from meshserve.workers.models.moe_routing import DROPPED

    monkeypatch.setattr(fm, "torch", _GarbageEmpty())
    gen = torch.Generator().manual_seed(5 * T + real)
    ew = _experts(ACT_SWIGLU_CLAMP, torch.float32, gen, bias=True)
    x = torch.randn(T, H, generator=gen)
    ids, weights = _routing("random", T, gen), torch.rand(T, TOP_K, generator=gen)
    ids[real:], weights[real:] = DROPPED, 0.0
    count = torch.tensor([real], dtype=torch.int32)
    load = torch.zeros(E, dtype=torch.int64)
    got = fused_moe(x, weights, ids, ew, config=SMALL, expert_load=load, sum_rows=sum_rows, num_real_tokens=count)
    got = got if sum_rows else got.sum(dim=1)
    assert torch.equal(got[real:], torch.zeros_like(got[real:]))
    torch.testing.assert_close(got[:real].double(), _oracle(x[:real], weights[:real], ids[:real], ew),
                               **ORACLE_TOL[torch.float32])  # fmt: skip
    assert torch.equal(load, torch.bincount(ids[:real].reshape(-1), minlength=E))
    if real < T:  # without the count those rows would hold the buffer's garbage
        assert fused_moe(x, weights, ids, ew, config=SMALL)[real:].isnan().all()


def test_fused_moe_refuses_mismatched_inputs():
    gen = torch.Generator().manual_seed(4)
    ew = _experts(ACT_SILU, torch.float32, gen, bias=False)
    x, ids = torch.randn(3, H, generator=gen), _routing("random", 3, gen)
    with pytest.raises(ValueError, match="weights"):
        fused_moe(x, torch.rand(3, TOP_K + 1), ids, ew)
    with pytest.raises(ValueError, match="dtype"):
        fused_moe(x.half(), torch.rand(3, TOP_K), ids, ew)
    with pytest.raises(ValueError, match="w2"):
        ExpertWeights(w13=ew.w13, w2=ew.w2[:, :, :-1], b13=None, b2=None, activation=ew.activation)


def _fill(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)


@pytest.mark.parametrize("T", [1, 9, 37])
def test_gpt_oss_moe_packed_matches_its_torch_code(T):
    moe = SwigluMoE(H, INTER, SwigluExperts(num_experts=E, top_k=3, swiglu_alpha=1.702, swiglu_limit=1.0))
    _fill(moe, T)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(100 + T))
    want = moe(x)
    assert moe.expert_load.sum() == 3 * T
    moe.pack_experts()
    assert moe.experts is None
    with torch.no_grad():
        got = moe(x)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    assert moe.expert_load.sum() == 6 * T  # counted on both paths


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_deepseek_moe_packed_matches_its_torch_code(scoring):
    cfg = MoEConfig(num_experts=8, top_k=2, moe_intermediate_size=INTER, num_shared_experts=1, num_groups=4,
                    topk_groups=2, routed_scaling_factor=2.5, scoring=scoring,
                    group_by="max" if scoring == "softmax" else "top2_sum", norm_topk_prob=scoring == "sigmoid",
                    correction_bias=scoring == "sigmoid", first_k_dense_replace=0)  # fmt: skip
    moe = MoE(H, cfg)
    _fill(moe, 5)
    x = torch.randn(29, H, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = moe(x)
        moe.pack_experts()
        got = moe(x)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_router_held_in_float32_once_packed_routes_alike():
    """Packing keeps the router's weight and correction bias in float32 (no cast per step): the
    exact values of the model-dtype ones, so weights and ids do not change."""
    cfg = MoEConfig(num_experts=8, top_k=2, moe_intermediate_size=INTER, num_shared_experts=1, num_groups=4,
                    topk_groups=2, routed_scaling_factor=2.5, scoring="sigmoid", group_by="top2_sum",
                    norm_topk_prob=True, correction_bias=True, first_k_dense_replace=0)  # fmt: skip
    moe = MoE(H, cfg)
    _fill(moe, 7)
    moe = moe.to(torch.float16)
    x = torch.randn(13, H, generator=torch.Generator().manual_seed(8)).to(torch.float16)
    with torch.no_grad():
        weights, ids = moe.gate(x)
        moe.pack_experts()
        assert moe.gate.weight.dtype == moe.gate.e_score_correction_bias.dtype == torch.float32
        again, again_ids = moe.gate(x)
    assert torch.equal(weights, again) and torch.equal(ids, again_ids)


def test_gpt_oss_sinks_held_in_float32_after_loading(tmp_path):
    """The sink logits every backend reads in float32 are kept so (the loaded values, exactly)."""
    from safetensors.torch import load_file

    from meshserve.workers.loader import load_model
    from tests.tiny_models import write_checkpoint

    write_checkpoint(tmp_path, "gpt_oss")
    model = load_model(tmp_path, dtype="float16", progress=False)
    sinks = [layer.self_attn.sinks for layer in model.model.layers]
    assert all(s.dtype == torch.float32 for s in sinks)
    state = {k: v for f in tmp_path.glob("*.safetensors") for k, v in load_file(f).items()}
    for i, s in enumerate(sinks):
        assert torch.equal(s, state[f"model.layers.{i}.self_attn.sinks"].to(torch.float16).float())


@pytest.mark.parametrize(("name", "dtype"), [("deepseek_v3", "float32"), ("deepseek_v3", "float16"),
                                           ("gpt_oss", "float32")])  # fmt: skip
def test_moe_output_summed_in_the_next_norm_gives_the_same_logits(tmp_path, monkeypatch, name, dtype):
    """The CUDA wiring in the interpreter (fused norms, experts packed): each MoE layer hands its
    k weighted rows (+ shared experts) to the next layer's norm, and the last to the final norm
    (DeepSeek's norm before the router writes its float32 copy too: float16); the logits equal,
    bit for bit, those of the layers summing first, as the MoE did before."""
    from meshserve.workers.models import expert_layer, fused_ops, moe
    from tests.deepseek_models import write_deepseek
    from tests.tiny_models import write_checkpoint
    from tests.unit.workers.test_fused_ops import step_logits

    if name == "gpt_oss":
        write_checkpoint(tmp_path, name)
    else:
        write_deepseek(tmp_path, name)
    monkeypatch.setattr(fused_ops, "runs_triton", lambda x: True)
    monkeypatch.setattr(expert_layer, "runs_fused", lambda device: True)
    deferred = []
    norm = fused_ops.add_rms_norm
    monkeypatch.setattr(fused_ops, "add_rms_norm", lambda x, *a, **kw: deferred.append(
        isinstance(x, fused_ops.DeferredSum)) or norm(x, *a, **kw))
    got = step_logits(tmp_path, backend="TORCH", dtype=dtype)
    assert any(deferred)  # MoE outputs arrived unsummed
    # As before: each MoE layer sums its rows (torch.sum over k, + shared) and the norm kernel
    # adds that (use_triton: where the compiled CPU ops would take the sum otherwise).
    monkeypatch.setattr(fused_ops, "add_rms_norm", lambda x, *a, **kw: norm(
        x.total(), *a, **kw, use_triton=True) if isinstance(x, fused_ops.DeferredSum) else norm(x, *a, **kw))
    # and the router casts the norm's output itself
    monkeypatch.setattr(fused_ops, "add_rms_norm_float", lambda x, r, w, eps: (*norm(x, r, w, eps), None))
    router = moe.Router.forward
    monkeypatch.setattr(moe.Router, "forward", lambda self, x, x_float=None, **kw: router(self, x, **kw))
    want = step_logits(tmp_path, backend="TORCH", dtype=dtype)
    assert len(got) == len(want) == 2
    for g, w in zip(got, want):
        assert torch.equal(g, w)
