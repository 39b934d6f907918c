"""The compiled paged decode kernel of CPU_SDPA against the TORCH reference backend (the oracle)
over the shared scenario table and decode-heavy batches, its input checks, and its fallback."""

import pytest
import torch

from meshserve.attention.backends import cpu_paged_decode, cpu_sdpa
from meshserve.attention.backends.cpu_sdpa import CpuSdpaBackend
from meshserve.attention.backends.torch_ref import TorchBackend
from tests.unit.attention.scenarios import SCENARIOS, Scenario, make_case, poison_unowned_slots, run_backend
from tests.unit.attention.test_cpu_sdpa import DECODE_HEAVY

LONG = [
    Scenario("demo_shapes_decode", (1,) * 12, tuple(range(60, 180, 10)), spec=dict(num_heads=4, num_kv_heads=2,
                                                                                  head_size=64)),
    Scenario("head_size_80_decode", (1,) * 5, (1, 15, 16, 17, 200), spec=dict(num_heads=6, num_kv_heads=3,
                                                                             head_size=80), block_size=32),
    # head sizes 64 and 128 take the kernel's 16-keys-at-a-time path: odd query heads per KV head,
    # soft cap and sinks, blocks of 8 (a 16-key tile spans blocks), lengths off the tile
    Scenario("head_size_128_softcap_sinks_decode", (1,) * 6, (1, 15, 16, 17, 33, 150),
             spec=dict(num_heads=3, num_kv_heads=1, head_size=128, logits_soft_cap=5.0, has_sinks=True),
             block_size=8, query_gain=6.0),
    Scenario("head_size_64_mqa_decode", (1,) * 4, (2, 31, 64, 95), spec=dict(num_heads=8, num_kv_heads=1,
                                                                             head_size=64), block_size=32),
]


@pytest.fixture(scope="module")
def kernel():
    op = cpu_paged_decode.paged_decode_op()
    if op is None:
        pytest.skip("the paged decode kernel could not be built here (see the logged warning)")
    return op


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-6)).item()


@pytest.mark.parametrize("scenario", [*SCENARIOS, *DECODE_HEAVY, *LONG], ids=lambda s: s.name)
def test_kernel_matches_the_torch_reference(scenario, kernel, monkeypatch):
    """Every scenario CPU_SDPA serves in float32, with the LSE: outputs and LSEs within 1e-5
    relative of TORCH's; the decode groups the kernel can serve must go through it."""
    if CpuSdpaBackend.validate_configuration(scenario.problem(needs_lse=True)):
        pytest.skip("CPU_SDPA does not serve this scenario")
    calls = []
    monkeypatch.setattr(cpu_sdpa, "paged_decode_op", lambda: lambda *a: calls.append(1) or kernel(*a))
    case = make_case(scenario, seed=3)
    if case.kv_cache is not None and case.kv_cache.data.dtype == torch.float32:
        poison_unowned_slots(case)  # a read outside a sequence's blocks shows up as NaN
    out, lse = run_backend(CpuSdpaBackend, case)
    ref = make_case(scenario, seed=3)
    ref_out, ref_lse = run_backend(TorchBackend, ref)
    assert _rel(out, ref_out) <= 1e-5
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    assert _rel(lse[finite], ref_lse[finite]) <= 1e-5
    plan = CpuSdpaBackend(scenario.problem()).plan(case.metadata)
    served = any(g.table is not None for g in plan.groups)
    fp32 = case.kv_cache is not None and case.kv_cache.data.dtype == torch.float32
    assert len(calls) == (1 if served and fp32 else 0), (scenario.name, calls)


def test_a_sequence_without_stored_keys_gives_zeros_and_minus_infinity(kernel):
    """A DCP rank can hold no key of a short sequence: its part is 0 with LSE -inf (the merge drops it)."""
    cache = torch.randn(3, 2, 4, 2, 8)
    q = torch.randn(2, 4, 8)
    table = torch.tensor([[1, 2], [0, 0]], dtype=torch.int32)
    out, lse = kernel(q, cache, table, torch.tensor([5, 0], dtype=torch.int32), 0.3, 0.0, torch.empty(0))
    assert torch.equal(out[1], torch.zeros(4, 8)) and torch.isinf(lse[1]).all() and (lse[1] < 0).all()
    assert torch.isfinite(out[0]).all() and torch.isfinite(lse[0]).all()


@pytest.mark.parametrize("lens, table, match", [
    ([9], [[0, 1]], "outside the block table"),  # 9 keys need 3 blocks of 4
    ([5], [[0, 7]], "block id out of range"),
    ([-1], [[0, 1]], "outside the block table"),
])
def test_kernel_refuses_reads_outside_the_cache(kernel, lens, table, match):
    cache = torch.randn(3, 2, 4, 2, 8)
    with pytest.raises(RuntimeError, match=match):
        kernel(torch.randn(1, 4, 8), cache, torch.tensor(table, dtype=torch.int32),
               torch.tensor(lens, dtype=torch.int32), 0.3, 0.0, torch.empty(0))


def test_a_failed_build_leaves_the_torch_path(monkeypatch):
    """Without the compiled module (tests/unit/attention/test_cpu_extension.py: a failed build warns
    once) CPU_SDPA's decodes run its torch ops, with the same results."""
    monkeypatch.setattr(cpu_sdpa, "paged_decode_op", lambda: None)
    out, _ = run_backend(CpuSdpaBackend, make_case(DECODE_HEAVY[0]))  # the torch ops serve
    ref_out, _ = run_backend(TorchBackend, make_case(DECODE_HEAVY[0]))
    assert _rel(out, ref_out) <= 1e-5


def test_a_float32_backend_builds_the_kernel_when_made(monkeypatch):
    """At engine start (the backend's construction), not in a request's first decode."""
    calls = []
    monkeypatch.setattr(cpu_sdpa, "paged_decode_op", lambda: calls.append(1))
    scenario = DECODE_HEAVY[0]
    CpuSdpaBackend(scenario.problem("float32"))
    assert calls == [1]
    CpuSdpaBackend(scenario.problem("bfloat16"))  # a bf16 cache: the kernel never serves it
    assert calls == [1]


def test_two_threads_give_the_one_thread_result(kernel):
    """Sequences are split across intra-op threads (at::parallel_for); each row is computed the
    same way whichever thread takes it."""
    gen = torch.Generator().manual_seed(9)
    cache = torch.randn(40, 2, 16, 2, 64, generator=gen)
    table = torch.randperm(40, generator=gen)[:36].view(12, 3).to(torch.int32)
    lens = torch.randint(1, 49, (12,), generator=gen, dtype=torch.int32)
    q = torch.randn(12, 4, 64, generator=gen)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel(q, cache, table, lens, 0.125, 0.0, torch.empty(0))
        torch.set_num_threads(2)
        two = kernel(q, cache, table, lens, 0.125, 0.0, torch.empty(0))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])
