"""MLA backend tables: separate decode and prefill selection, refusals with reasons, docs and CLI."""

import pytest

from meshserve.attention import registry
from meshserve.attention.backend import AttentionProblem
from meshserve.attention.docs import feature_table
from meshserve.attention.mla.backends import flashinfer as fi_mla
from meshserve.attention.mla.backends.flashinfer import FlashInferMLADecodeBackend
from meshserve.attention.mla.backends.torch_ref import TorchMLABackend
from meshserve.attention.mla.backends.triton_decode import TritonMLADecodeBackend
from meshserve.attention.mla.backends.triton_prefill import TritonMLAPrefillBackend
from meshserve.attention.mla.layer import MLAAttention
from meshserve.attention.mla.spec import mla_spec
from meshserve.attention.registry import BackendKind, select_backend
from meshserve.attention.spec import AttentionSpec, KVCacheDtype, MLADims
from meshserve.cli import main
from meshserve.errors import ConfigError, NoBackendError

V3 = MLADims(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
SMALL = MLADims(kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32)


def problem(dims=V3, **kwargs) -> AttentionProblem:
    kv = kwargs.pop("kv_cache_dtype", KVCacheDtype.AUTO)
    return AttentionProblem(spec=mla_spec(16, dims, kv_cache_dtype=kv), max_model_len=4096, **kwargs)


def test_cpu_picks_torch_for_both_phases_and_triton_when_asked():
    attn = MLAAttention(problem())
    assert isinstance(attn.decode, TorchMLABackend) and isinstance(attn.prefill, TorchMLABackend)
    attn = MLAAttention(problem(), decode_backend="triton", prefill_backend="TRITON")
    assert isinstance(attn.decode, TritonMLADecodeBackend) and isinstance(attn.prefill, TritonMLAPrefillBackend)


def test_gpu_priorities_take_flashinfer_decode_only_where_it_serves(monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name: object())  # pretend flashinfer is installed
    gpu = dict(device="cuda", compute_capability=(9, 0), dtype="bfloat16")
    assert select_backend(problem(**gpu), kind=BackendKind.MLA_DECODE) is FlashInferMLADecodeBackend
    assert select_backend(problem(**gpu), kind=BackendKind.MLA_PREFILL) is TritonMLAPrefillBackend
    # Shapes or caches FlashInfer's MLA does not take fall through to TRITON, with the reason kept.
    assert select_backend(problem(SMALL, **gpu), kind="mla_decode") is TritonMLADecodeBackend
    # FP8 latent caches: e4m3 on sm90 with FlashInfer >= 0.7 (its FA3/FA2 MLA kernels), nothing else.
    monkeypatch.setattr(fi_mla, "flashinfer_version", lambda: (0, 7))
    fp8 = problem(kv_cache_dtype=KVCacheDtype.FP8_E4M3, **gpu)
    assert select_backend(fp8, kind="mla_decode") is FlashInferMLADecodeBackend
    e5m2 = problem(kv_cache_dtype=KVCacheDtype.FP8_E5M2, **gpu)
    assert select_backend(e5m2, kind="mla_decode") is TritonMLADecodeBackend
    sm100 = problem(kv_cache_dtype=KVCacheDtype.FP8_E4M3, **(gpu | {"compute_capability": (10, 0)}))
    assert select_backend(sm100, kind="mla_decode") is TritonMLADecodeBackend
    monkeypatch.setattr(fi_mla, "flashinfer_version", lambda: (0, 5))
    assert select_backend(fp8, kind="mla_decode") is TritonMLADecodeBackend
    assert "needs FlashInfer >= 0.7 (installed 0.5)" in str(registry.judge("FLASHINFER", fp8, "mla_decode").reasons)
    verdicts = {v.name: v for v in registry.explain(problem(SMALL, **gpu), "mla_decode")}
    assert verdicts["FLASHINFER"].reasons == (
        "kv_lora_rank=64, qk_rope_head_dim=16: FlashInfer's MLA kernels take 512 + 64 (DeepSeek-V2/V3)",
    )


def test_standard_and_mla_backends_refuse_each_others_layers():
    with pytest.raises(NoBackendError) as err:
        select_backend(problem())
    assert "TORCH: multi-head latent attention not supported" in str(err.value)
    plain = AttentionProblem(spec=AttentionSpec(num_heads=4, num_kv_heads=2, head_size=64))
    with pytest.raises(NoBackendError) as err:
        select_backend(plain, kind=BackendKind.MLA_PREFILL)
    assert "no mla_prefill backend can serve" in str(err.value) and "not an MLA layer" in str(err.value)


def test_explicit_mla_names_are_validated_against_their_own_table():
    with pytest.raises(ConfigError) as err:
        select_backend(problem(), "FLASHINFER", kind=BackendKind.MLA_PREFILL)
    assert err.value.field == "mla_prefill_backend" and "['TORCH', 'TRITON']" in str(err.value)
    with pytest.raises(NoBackendError, match="mla_decode backend FLASHINFER cannot serve"):
        select_backend(problem(), "FLASHINFER", kind="mla_decode")
    with pytest.raises(ConfigError, match="backend kind"):
        select_backend(problem(), kind="mla_sideways")


def test_triton_mla_refuses_what_the_interpreter_gets_wrong(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    reasons = TritonMLADecodeBackend.validate_configuration(problem(dtype="bfloat16"))
    assert "on CPU the Triton kernels run only in the interpreter (TRITON_INTERPRET=1)" in reasons
    assert any("bfloat16" in r for r in reasons)
    old_gpu = problem(device="cuda", compute_capability=(8, 0), dtype="float16", kv_cache_dtype="fp8_e5m2")
    assert any("8.9" in r for r in TritonMLAPrefillBackend.validate_configuration(old_gpu))


def test_tables_appear_in_docs_and_cli(capsys):
    table = feature_table()
    assert "### Multi-head latent attention: decode" in table and "### Multi-head latent attention: prefill" in table
    assert main(["backends", "--kv-lora-rank", "64", "--qk-rope-head-dim", "16", "--num-heads", "8"]) == 0
    out = capsys.readouterr().out
    assert "Multi-head latent attention: decode" in out
    assert "Selected for mla_decode: TORCH" in out and "Selected for mla_prefill: TORCH" in out
    assert main(["backends", "--quiet", "--kv-lora-rank", "64", "--mla-decode-backend", "FLASHINFER"]) == 2
    assert "mla_decode backend FLASHINFER cannot serve" in capsys.readouterr().err
