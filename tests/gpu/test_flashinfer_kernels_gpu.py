"""FLASHINFER's default kernels on this GPU (FA3 prefill on sm90, FA2 for FP8 K/V, FA2 decode),
at the Llama-3-8B shape (GQA 32/8, head 128, bf16) with pages of 16 and 64, and at the Llama-2-7B
shape (MHA 32/32: the CUDA-core decode kernel, not the tensor-core one), against the TORCH
reference; skipped without CUDA or FlashInfer.

Each case is a mixed batch (a chunk over cached context, a whole prompt, decodes), so both
wrappers run. It also checks that FlashInfer ran the kernel flashinfer_kernels.py names (the
wrapper's resolved backend), so a FlashInfer release that reroutes "fa3" would show. These are
also the modules bench/flashinfer_aot.sh builds and packs (with test_mla_gpu.py's FLASHINFER
cases for the MLA decode kernels).
"""

import dataclasses

import pytest
import torch

from meshserve.attention.backend import KVCache
from meshserve.attention.backends.torch_ref import TorchBackend
from meshserve.attention.registry import load_backend
from meshserve.attention.spec import KVCacheDtype
from tests.unit.attention.scenarios import Scenario, assert_matches, make_case

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

LLAMA3_8B = dict(num_heads=32, num_kv_heads=8, head_size=128)
# Groups below 4 (MHA, GQA 2-3) decode on FlashInfer's CUDA-core kernel, a module of its own (one
# per K/V dtype, any group size): seen JIT-built at a first decode in the nineteenth session.
LLAMA2_7B = dict(num_heads=32, num_kv_heads=32, head_size=128)
CASES = tuple(
    Scenario(f"llama3_8b_{kv}_page{page}", (300, 64, 1, 1, 1), (700, 0, 900, 63, 4000),
             spec=LLAMA3_8B | {"kv_cache_dtype": kv}, block_size=page, max_model_len=8192)
    for kv in (KVCacheDtype.AUTO, KVCacheDtype.FP8_E4M3) for page in (16, 64)
) + tuple(
    Scenario(f"llama2_7b_{kv}_page16", (300, 1, 1, 1), (700, 900, 63, 4000),
             spec=LLAMA2_7B | {"kv_cache_dtype": kv}, block_size=16, max_model_len=8192)
    for kv in (KVCacheDtype.AUTO, KVCacheDtype.FP8_E4M3)
)  # fmt: skip


def _on_cuda(case):
    meta = case.metadata
    moved = {f.name: getattr(meta, f.name).cuda() for f in dataclasses.fields(meta)
             if isinstance(getattr(meta, f.name), torch.Tensor)}  # fmt: skip
    c = case.kv_cache
    return dataclasses.replace(case, query=case.query.cuda(), key=case.key.cuda(), value=case.value.cuda(),
                               kv_cache=KVCache(c.data.cuda(), c.k_scale.cuda(), c.v_scale.cuda()),
                               metadata=dataclasses.replace(meta, **moved))  # fmt: skip


def _run(backend, case):
    c = case.kv_cache
    cache = KVCache(c.data.clone(), c.k_scale, c.v_scale)  # write_kv mutates the cache
    plan = backend.plan(case.metadata)
    backend.write_kv(case.key, case.value, cache, case.metadata.slot_mapping, plan=plan)
    return backend.forward(case.query, case.key, case.value, cache, plan, return_lse=True)


@pytest.mark.parametrize("scenario", CASES, ids=lambda s: s.name)
def test_flashinfer_default_kernels_match_the_reference(scenario):
    try:
        cls = load_backend("FLASHINFER")
    except ImportError as exc:
        pytest.skip(f"FLASHINFER cannot be imported: {exc}")
    problem = scenario.problem("bfloat16", device="cuda", needs_lse=True,
                               compute_capability=torch.cuda.get_device_capability())  # fmt: skip
    reasons = cls.validate_configuration(problem)
    if reasons:
        pytest.skip("; ".join(reasons))
    case = _on_cuda(make_case(scenario, dtype=torch.bfloat16, seed=3))
    backend = cls(problem)
    out, lse = _run(backend, case)
    ref_out, ref_lse = _run(TorchBackend(problem), case)
    assert_matches(out, lse, ref_out.double().cpu(), ref_lse.double().cpu(), torch.bfloat16)
    prefill, decode = backend._by_group[0]
    # FlashInfer's wrappers keep the kernel they were built with (0.5.3 and 0.7.4 alike).
    assert (prefill._backend, decode._backend) == (backend.prefill_kernel, backend.decode_kernel)
