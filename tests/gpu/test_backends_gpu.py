"""Every GPU backend against the TORCH reference on CUDA; skipped without CUDA.

Runs the shared scenario table (at head size 128 where the scenario does not set one, so that
FlashInfer's kernels apply) plus longer GPU-sized scenarios, in bf16 and fp16. Which backend
runs which scenario is decided by the backend's own validate_configuration, never restated.
Also: CUDA-graph capture and replay of decode with static metadata, the LSE merge kernels and
the FP8 write_kv kernel on the GPU. The forced phase splits (FLASHINFER prefill + TRITON decode
and the reverse) run the same scenario table (ids split-FLASHINFER-TRITON, split-TRITON-FLASHINFER): `-k split`.
"""

import dataclasses

import pytest
import torch

from meshserve.attention import merge
from meshserve.attention.backend import AttentionProblem, KVCache
from meshserve.attention.backends.torch_ref import TorchBackend, quantize_fp8
from meshserve.attention.metadata import AttentionMetadata
from meshserve.attention.registry import load_backend
from meshserve.attention.spec import AttentionSpec, KVCacheDtype
from tests.unit.attention.scenarios import SCENARIOS, Case, Scenario, assert_matches, make_case, run_backend

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# The phase splits (attention/backends/phase_split.py): each phase on its backend over one cache.
GPU_BACKENDS = ("TRITON", "FLASHINFER", "prefill=FLASHINFER,decode=TRITON", "prefill=TRITON,decode=FLASHINFER")
E4M3 = KVCacheDtype.FP8_E4M3


def _at_head_128(s: Scenario) -> Scenario:
    return s if "head_size" in s.spec else dataclasses.replace(s, spec=s.spec | {"head_size": 128})


def _gqa(q: int, kv: int, d: int = 128, **more) -> dict:
    return dict(num_heads=q, num_kv_heads=kv, head_size=d) | more


GPU_SCENARIOS = tuple(_at_head_128(s) for s in SCENARIOS) + (
    Scenario("gpu_mixed_long", (700, 300, 1, 1, 1), (0, 1200, 5000, 2500, 17), spec=_gqa(32, 8), max_model_len=8192),
    Scenario("gpu_many_decodes", (1,) * 48, tuple(range(17, 48 * 41, 41)), spec=_gqa(16, 4), max_model_len=4096),
    Scenario(
        "gpu_window_sinks",
        (500, 1, 1),
        (900, 3000, 100),
        spec=_gqa(8, 2, sliding_window=256, num_sink_tokens=4, has_sinks=True),
        max_model_len=4096,
    ),
    Scenario("gpu_fp8_long", (400, 1, 1), (600, 4000, 1000), spec=_gqa(16, 4, kv_cache_dtype=E4M3), max_model_len=8192),
    Scenario(
        "gpu_softcap_long",
        (300, 1),
        (500, 2000),
        spec=_gqa(8, 8, logits_soft_cap=20.0),
        query_gain=8.0,
        max_model_len=4096,
    ),
    Scenario("gpu_head_64", (130, 1), (70, 900), spec=_gqa(8, 2, 64), max_model_len=2048),
    Scenario("gpu_head_256", (130, 1), (70, 900), spec=_gqa(4, 2, 256), max_model_len=2048),
    Scenario("gpu_head_80_block_128", (150, 1), (300, 1500), spec=_gqa(8, 4, 80), block_size=128, max_model_len=4096),
    Scenario(
        "gpu_alibi_block_256", (200, 1), (300, 700), spec=_gqa(4, 2, use_alibi=True), block_size=256, max_model_len=2048
    ),
    # A prefill long enough for TRITON's long-prefill tiles (kernels/config.py), beside a decode.
    Scenario("gpu_long_prefill", (8200, 1), (0, 300), spec=_gqa(8, 2), max_model_len=16384),
)


def _to_cuda(case: Case) -> Case:
    """Build on the CPU (fast element writes), then move every tensor to the GPU."""
    dev = "cuda"
    meta = case.metadata
    moved = {
        f.name: getattr(meta, f.name).to(dev)
        for f in dataclasses.fields(meta)
        if isinstance(getattr(meta, f.name), torch.Tensor)
    }
    cache = case.kv_cache
    if cache is not None:
        cache = KVCache(cache.data.to(dev), cache.k_scale.to(dev), cache.v_scale.to(dev))
    layer = dataclasses.replace(
        case.layer,
        sinks=None if case.layer.sinks is None else case.layer.sinks.to(dev),
        alibi_slopes=None if case.layer.alibi_slopes is None else case.layer.alibi_slopes.to(dev),
    )
    return dataclasses.replace(
        case,
        query=case.query.to(dev),
        key=None if case.key is None else case.key.to(dev),
        value=None if case.value is None else case.value.to(dev),
        kv_cache=cache,
        metadata=dataclasses.replace(meta, **moved),
        layer=layer,
    )


def _fresh(case: Case) -> Case:
    """The same case with its own copy of the cache (write_kv mutates it)."""
    if case.kv_cache is None:
        return case
    c = case.kv_cache
    return dataclasses.replace(case, kv_cache=KVCache(c.data.clone(), c.k_scale, c.v_scale))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("scenario", GPU_SCENARIOS, ids=lambda s: s.name)
@pytest.mark.parametrize("name", GPU_BACKENDS, ids=lambda n: n.replace("prefill=", "split-").replace(",decode=", "-"))
def test_backend_matches_torch_reference(name, scenario, dtype):
    dtype_name = str(dtype).removeprefix("torch.")
    cc = torch.cuda.get_device_capability()
    try:
        backend_cls = load_backend(name)
    except ImportError as exc:
        pytest.skip(f"{name} cannot be imported: {exc}")
    if "FLASHINFER" in name and dtype is torch.float16:
        pytest.skip("FlashInfer JIT-builds every dtype variant; fp16 runs through TRITON here, bf16 through both")
    reasons = backend_cls.validate_configuration(scenario.problem(dtype_name, device="cuda", compute_capability=cc))
    if reasons:
        pytest.skip("; ".join(reasons))
    case = _to_cuda(make_case(scenario, dtype=dtype, seed=7))
    ref_out, ref_lse = run_backend(TorchBackend, _fresh(case), dtype=dtype_name, device="cuda")
    out, lse = run_backend(backend_cls, _fresh(case), dtype=dtype_name, device="cuda")
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_matches(out, lse, ref_out.double().cpu(), ref_lse.double().cpu(), dtype)


@pytest.mark.parametrize("name", [n for n in GPU_BACKENDS if n == "TRITON"])
def test_decode_cuda_graph_replay_with_static_metadata(name):
    """Capture decode once at the longest lengths; replay after rewriting lengths and tables."""
    backend_cls = load_backend(name)
    assert backend_cls.capabilities.cuda_graphs
    gen = torch.Generator().manual_seed(0)
    batch, page, max_len, dev = 12, 16, 3000, "cuda"
    spec = AttentionSpec(num_heads=16, num_kv_heads=4, head_size=128, sliding_window=700, num_sink_tokens=4)
    problem = AttentionProblem(spec, dtype="bfloat16", block_size=page, max_model_len=4096, device=dev,
                               compute_capability=torch.cuda.get_device_capability(), needs_lse=True)  # fmt: skip
    per_seq = -(-max_len // page)
    num_blocks = batch * per_seq + 7
    cache = KVCache(torch.randn(num_blocks, 2, page, 4, 128, generator=gen).to(dev, torch.bfloat16))

    def tables():
        perm = torch.randperm(num_blocks, generator=gen).tolist()
        return [perm[i * per_seq : (i + 1) * per_seq] for i in range(batch)]

    def metadata(lens, rows):
        return AttentionMetadata.build(query_lens=[1] * batch, seq_lens=lens, block_tables=rows,
                                       block_size=page, device=dev, write_kv=False)  # fmt: skip

    static = metadata([max_len] * batch, tables())
    backend = backend_cls(problem)
    plan = backend.plan(static)
    q = torch.randn(batch, 16, 128, generator=gen).to(dev, torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        backend.forward(q, None, None, cache, plan, return_lse=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = backend.forward(q, None, None, cache, plan, return_lse=True)
    reference = TorchBackend(problem)
    for _ in range(3):
        lens = torch.randint(2, max_len + 1, (batch,), generator=gen).tolist()
        fresh = metadata(lens, tables())
        for field in ("seq_lens", "context_lens", "block_table"):
            getattr(static, field).copy_(getattr(fresh, field))
        q.copy_(torch.randn(batch, 16, 128, generator=gen).to(dev, torch.bfloat16))
        out.fill_(float("nan"))
        graph.replay()
        ref_out, ref_lse = reference.forward(q, None, None, cache, fresh, return_lse=True)
        assert_matches(out, lse, ref_out.double().cpu(), ref_lse.double().cpu(), torch.bfloat16)


def test_merge_kernels_match_torch_reference_on_gpu():
    gen = torch.Generator().manual_seed(1)
    os = torch.randn(5, 300, 8, 128, generator=gen).cuda()
    lses = (torch.randn(5, 300, 8, generator=gen) * 5).cuda()
    lses[1] = float("-inf")
    lses[:, :7] = float("-inf")
    want_o, want_lse = merge.merge_attn_states_n_torch(os, lses)
    got_o, got_lse = merge.merge_attn_states_n(os, lses)
    torch.testing.assert_close(got_o, want_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_lse, want_lse, rtol=1e-5, atol=1e-5)
    two_o, two_lse = merge.merge_attn_states(os[0].bfloat16(), lses[0], os[2].bfloat16(), lses[2])
    ref_o, ref_lse = merge.merge_attn_states_torch(os[0].bfloat16(), lses[0], os[2].bfloat16(), lses[2])
    torch.testing.assert_close(two_o, ref_o, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(two_lse, ref_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_fp8_write_kv_bit_exact_on_gpu(fp8):
    from meshserve.attention.kernels.write_kv import write_kv

    spec = AttentionSpec(num_heads=8, num_kv_heads=4, head_size=128, kv_cache_dtype=E4M3)
    key = (torch.randn(500, 4, 128) * 30).cuda().bfloat16()
    value = (torch.randn(500, 4, 128) * 1e-3).cuda().bfloat16()
    cache = KVCache(torch.zeros(40, 2, 16, 4, 128, dtype=fp8, device="cuda"),
                    torch.tensor(0.05, device="cuda"), torch.tensor(0.02, device="cuda"))  # fmt: skip
    slots = torch.randperm(640, device="cuda")[:500]
    write_kv(spec, key, value, cache, slots)
    flat = cache.data.permute(1, 0, 2, 3, 4).reshape(2, 640, 4, 128)
    want_k = quantize_fp8(key, cache.k_scale, fp8)
    want_v = quantize_fp8(value, cache.v_scale, fp8)
    assert torch.equal(flat[0, slots].view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(flat[1, slots].view(torch.uint8), want_v.view(torch.uint8))
