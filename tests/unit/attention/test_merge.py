"""LSE merge: split a key set into parts, attend over each in float64, merge, compare with the whole."""

import math

import pytest
import torch

from meshserve.attention import merge
from meshserve.errors import ConfigError


def attend64(q, k, v, visible):
    """Dense float64 attention. q [T,H,D], k [L,H,D], v [L,H,Dv], visible [T,L] -> o [T,H,Dv], lse [T,H]."""
    scores = torch.einsum("thd,lhd->thl", q, k) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.nan_to_num(torch.exp(scores - lse[..., None]), nan=0.0)
    return torch.einsum("thl,lhd->thd", probs, v), lse


def split_case(seed, num_parts, T=6, H=3, D=20, L=40):
    """Per-part and whole-set attention. With 3+ parts, part 0 is empty; row 0 sees no key at all."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, D, generator=gen, dtype=torch.float64) * 2
    k = torch.randn(L, H, D, generator=gen, dtype=torch.float64)
    v = torch.randn(L, H, D, generator=gen, dtype=torch.float64)
    visible = torch.rand(T, L, generator=gen) < 0.7
    visible[0] = False  # a row that sees no key at all
    part = torch.randint(0, num_parts, (L,), generator=gen)
    if num_parts >= 3:
        part[part == 0] = 1  # part 0 stays empty for every row
    outs, lses = [], []
    for i in range(num_parts):
        o_i, lse_i = attend64(q, k, v, visible & (part == i)[None, :])
        outs.append(o_i)
        lses.append(lse_i)
    whole = attend64(q, k, v, visible)
    return torch.stack(outs), torch.stack(lses), whole


IMPLS = {
    "torch": (merge.merge_attn_states_n_torch, merge.merge_attn_states_torch),
    "triton": (lambda os, lses: merge.merge_attn_states_n_triton(os, lses), merge.merge_attn_states_triton),
}


def check_close(o, lse, whole, tol):
    ref_o, ref_lse = whole
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    assert torch.all(o[torch.isneginf(ref_lse)] == 0)
    fin = torch.isfinite(ref_lse)
    assert (lse.double()[fin] - ref_lse[fin]).abs().max() < tol
    assert (o.double() - ref_o).abs().max() < tol


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("num_parts", [1, 2, 3, 7])
def test_n_way_matches_whole(impl, num_parts):
    os, lses, whole = split_case(num_parts, num_parts)
    o, lse = IMPLS[impl][0](os.float(), lses.float())
    assert o.dtype == torch.float32 and lse.dtype == torch.float32 and o.shape == os.shape[1:]
    check_close(o, lse, whole, 2e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_two_way_matches_whole(impl):
    os, lses, whole = split_case(11, 2)
    o, lse = IMPLS[impl][1](os[0].float(), lses[0].float(), os[1].float(), lses[1].float())
    check_close(o, lse, whole, 2e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_all_empty_gives_zero_and_neg_inf(impl):
    os = torch.randn(3, 2, 4, 8)
    lses = torch.full((3, 2, 4), float("-inf"))
    o, lse = IMPLS[impl][0](os, lses)
    assert torch.all(o == 0) and torch.all(torch.isneginf(lse))


@pytest.mark.parametrize("impl", IMPLS)
def test_large_lse_values_do_not_overflow(impl):
    os = torch.randn(2, 3, 2, 16)
    lses = torch.tensor([1000.0, 999.0]).view(2, 1, 1).expand(2, 3, 2).contiguous()
    o, lse = IMPLS[impl][0](os, lses)
    w = torch.softmax(torch.tensor([1000.0, 999.0], dtype=torch.float64), 0)
    assert torch.allclose(o.double(), w[0] * os[0].double() + w[1] * os[1].double(), atol=1e-5)
    assert torch.allclose(lse.double(), torch.tensor(1000 + math.log1p(math.exp(-1.0)), dtype=torch.float64))


def test_triton_never_reads_the_output_of_an_empty_part():
    """A split-KV writer leaves an empty split's output unwritten (the TRITON decode kernels): NaN there must
    not reach the result; the parts that hold keys still merge to the whole."""
    os, lses, whole = split_case(3, 7)
    assert torch.isneginf(lses[0]).all()  # part 0 is empty for every row
    os = os.float()
    os[0] = float("nan")
    os[:, 0] = float("nan")  # row 0 sees no key in any part
    o, lse = merge.merge_attn_states_n_triton(os, lses.float())
    check_close(o, lse, whole, 2e-5)


def test_triton_half_precision_output_and_strided_parts():
    os, lses, whole = split_case(5, 4)
    # A strided view: parts interleaved with other data along H, as split-KV workspaces can be.
    wide = torch.zeros(4, os.shape[1], os.shape[2] * 2, os.shape[3])
    wide[:, :, ::2] = os.float()
    out = torch.empty(os.shape[1:], dtype=torch.float16)
    o, lse = merge.merge_attn_states_n_triton(wide[:, :, ::2], lses.float(), out=out)
    assert o is out
    check_close(o, lse, whole, 5e-3)


def test_bad_shapes_name_the_field():
    with pytest.raises(ConfigError, match="lses"):
        merge.merge_attn_states_n_torch(torch.zeros(2, 3, 4, 8), torch.zeros(2, 3, 5))
    with pytest.raises(ConfigError, match="o_b"):
        merge.merge_attn_states_triton(torch.zeros(3, 4, 8), torch.zeros(3, 4), torch.zeros(3, 5, 8),
                                       torch.zeros(3, 5))
