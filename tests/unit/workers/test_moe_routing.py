"""The one-launch routing kernel (Triton interpreter on CPU) against the torch routing (the CPU
path and the oracle), for both MoE families: GPT-OSS (top-k of the logits, softmax over them),
DeepSeek-V2 (softmax, best groups by their maximum, scaled), DeepSeek-V3 (sigmoid, correction
bias, best groups by their top-2 sum, renormalised, scaled); expert counts that are not powers
of two; ties (integer-valued logits and biases) broken alike: the lower index first.
"""

import pytest
import torch

from meshserve.errors import ConfigError
from meshserve.workers.models.moe import select_experts
from meshserve.workers.models.moe_routing import DROPPED, RoutingSpec, route_torch

SPECS = {
    "gpt_oss": RoutingSpec(32, 4, scoring="topk_softmax"),
    "v2_lite": RoutingSpec(64, 6, scoring="softmax"),
    "v2_groups": RoutingSpec(12, 3, scoring="softmax", group_by="max", num_groups=4, topk_groups=2,
                             routed_scaling_factor=16.0),
    "v3": RoutingSpec(16, 4, scoring="sigmoid", group_by="top2_sum", num_groups=4, topk_groups=2,
                      norm_topk_prob=True, routed_scaling_factor=2.5),
    "v3_wide": RoutingSpec(256, 8, scoring="sigmoid", group_by="top2_sum", num_groups=8, topk_groups=4,
                           norm_topk_prob=True, routed_scaling_factor=2.5),
}  # fmt: skip
HAS_BIAS = {"v3", "v3_wide"}


def _inputs(name: str, T: int, *, ties: bool, dtype=torch.float32):
    spec = SPECS[name]
    gen = torch.Generator().manual_seed(T * 31 + len(name))
    E = spec.num_experts
    if ties:  # few distinct values: equal scores, equal group scores, equal best-two sums
        logits = torch.randint(0, 3, (T, E), generator=gen).float()
        bias = torch.randint(0, 2, (E,), generator=gen).float() * 0.5 if name in HAS_BIAS else None
    else:
        logits = torch.randn(T, E, generator=gen) * 2
        bias = torch.randn(E, generator=gen) * 0.1 if name in HAS_BIAS else None
    return spec, logits.to(dtype), bias


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("T", [1, 7, 45])
@pytest.mark.parametrize("name", list(SPECS))
def test_kernel_matches_torch_routing(name, T, ties):
    spec, logits, bias = _inputs(name, T, ties=ties)
    want_w, want_ids = route_torch(logits, spec, bias)
    got_w, got_ids = select_experts(logits, spec, bias, use_triton=True)
    assert got_ids.dtype == torch.int64 and got_w.dtype == logits.dtype
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, atol=1e-6, rtol=1e-5)
    assert torch.equal(select_experts(logits, spec, bias)[1], want_ids)  # CPU default: route_torch


@pytest.mark.filterwarnings("ignore:All-NaN slice")  # (the interpreter's numpy on the NaN padding rows)
@pytest.mark.parametrize("count_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize(("T", "real"), [(4, 3), (45, 40), (45, 0), (7, 7)])
@pytest.mark.parametrize("name", ["gpt_oss", "v3_wide"])
def test_rows_past_the_real_count_get_dropped_ids_and_no_weight(name, T, real, count_dtype):
    """A CUDA-graph bucket's padding rows (at and after num_real_tokens, read on the device):
    ids DROPPED (outside [0, E): no expert runs them) and weight 0, in the kernel and in torch;
    the real rows route exactly as without the count."""
    spec, logits, bias = _inputs(name, T, ties=False)
    logits[real:] = float("nan")  # a padding row's logits may be anything: nothing of them comes out
    count = torch.tensor([real], dtype=count_dtype)
    want_w, want_ids = route_torch(logits[:real], spec, bias)
    for use_triton in (False, True):
        w, ids = select_experts(logits, spec, bias, use_triton=use_triton, num_real_tokens=count)
        assert torch.equal(ids[:real], want_ids), use_triton
        torch.testing.assert_close(w[:real], want_w, atol=1e-6, rtol=1e-5)
        assert (ids[real:] == DROPPED).all() and not (0 <= DROPPED < spec.num_experts), use_triton
        assert torch.equal(w[real:], torch.zeros_like(w[real:])), use_triton


def test_ties_go_to_the_lower_index_in_descending_order():
    spec = RoutingSpec(8, 3, scoring="sigmoid", group_by="max", num_groups=4, topk_groups=2)
    logits = torch.tensor([[0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 2.0, 0.0]])  # groups: (0,1) (2,3) (4,5) (6,7)
    for use_triton in (False, True):
        _, ids = select_experts(logits, spec, use_triton=use_triton)
        # group scores 1, 1, 1, 2: group 3 then group 0 (lowest of the tied); then experts by value
        assert ids.tolist() == [[6, 1, 0]], use_triton


def test_bf16_logits_gpt_oss():
    """GPT-OSS routes in the model dtype: bf16 logits in, bf16 weights out (fp32 inside)."""
    spec, logits, _ = _inputs("gpt_oss", 19, ties=False, dtype=torch.bfloat16)
    want_w, want_ids = route_torch(logits, spec)
    got_w, got_ids = select_experts(logits, spec, use_triton=True)
    assert torch.equal(got_ids, want_ids) and got_w.dtype == torch.bfloat16
    torch.testing.assert_close(got_w.float(), want_w.float(), atol=4e-3, rtol=8e-3)


def test_grouped_choice_stays_inside_the_best_groups():
    """An independent check of the semantics: every chosen expert lies in one of the topk_groups
    groups with the largest best score, and within them the k largest scores are chosen."""
    spec, logits, _ = _inputs("v2_groups", 23, ties=False)
    _, ids = select_experts(logits, spec, use_triton=True)
    scores = logits.double().softmax(-1)
    for t in range(logits.shape[0]):
        groups = scores[t].view(4, 3).max(-1).values.argsort(descending=True)[:2].tolist()
        allowed = [e for g in groups for e in range(3 * g, 3 * g + 3)]
        best = sorted(allowed, key=lambda e: -scores[t, e].item())[:3]
        assert ids[t].tolist() == best


def test_empty_batch_and_bad_specs():
    w, ids = select_experts(torch.zeros(0, 32), SPECS["gpt_oss"], use_triton=True)
    assert w.shape == ids.shape == (0, 4)
    with pytest.raises(ConfigError, match="logits"):
        select_experts(torch.zeros(3, 31), SPECS["gpt_oss"])
    with pytest.raises(ConfigError, match="top_k"):
        RoutingSpec(8, 9)
    with pytest.raises(ConfigError, match="scoring"):
        RoutingSpec(8, 2, scoring="relu")
    with pytest.raises(ConfigError, match="num_groups"):
        RoutingSpec(8, 2, group_by="max", num_groups=3)
    with pytest.raises(ConfigError, match="topk_groups"):
        RoutingSpec(8, 5, group_by="max", num_groups=4, topk_groups=2)  # 2 groups of 2 hold only 4 experts
