"""Named attention batch scenarios and an independent float64 oracle.

Every backend runs through the same table. Block tables are shuffled and the cache is filled
with noise first, so a paging bug or a read past a sequence's end shows up as a wrong number.
The oracle below builds each sequence's mask with explicit position rules in float64; it
shares no code with any backend.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from meshserve.attention.backend import FP8_DTYPES, AttentionBackend, AttentionProblem, KVCache, LayerParams
from meshserve.attention.metadata import AttentionMetadata
from meshserve.attention.spec import AttentionSpec, AttentionType, KVCacheDtype


@dataclass(frozen=True)
class Scenario:
    name: str
    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    spec: dict = field(default_factory=dict)  # AttentionSpec overrides
    block_size: int = 16
    max_model_len: int = 512
    encoder_lens: tuple[int, ...] | None = None  # cross attention only
    query_gain: float = 1.0  # scales q so soft-capping bites

    def attention_spec(self) -> AttentionSpec:
        kwargs = dict(num_heads=4, num_kv_heads=2, head_size=16) | self.spec
        return AttentionSpec(**kwargs)

    def problem(
        self,
        dtype: str = "float32",
        device: str = "cpu",
        needs_lse: bool = False,
        compute_capability: tuple[int, int] | None = None,
        dcp_size: int = 1,
    ) -> AttentionProblem:
        return AttentionProblem(
            spec=self.attention_spec(),
            dtype=dtype,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            device=device,
            compute_capability=compute_capability,
            needs_lse=needs_lse,
            dcp_size=dcp_size,
        )


E4M3, E5M2 = KVCacheDtype.FP8_E4M3, KVCacheDtype.FP8_E5M2
SCENARIOS: tuple[Scenario, ...] = (
    Scenario("small_decode", (1, 1, 1), (4, 16, 33)),
    Scenario("mixed_prefill_decode", (7, 12, 1, 1), (0, 0, 20, 45)),
    Scenario("chunked_prefill", (9, 16, 1), (23, 40, 17)),
    Scenario("long_decode", (1, 1), (300, 257)),
    Scenario("gqa", (5, 1, 1), (11, 30, 64), spec=dict(num_heads=8, num_kv_heads=2)),
    Scenario("mqa", (6, 1), (0, 37), spec=dict(num_heads=4, num_kv_heads=1)),
    Scenario("sliding_window", (20, 9, 1, 1), (0, 30, 40, 5), spec=dict(sliding_window=8)),
    Scenario("sinks", (10, 1, 1), (0, 25, 3), spec=dict(has_sinks=True)),
    Scenario("streaming_sinks", (12, 1, 1), (20, 50, 6), spec=dict(sliding_window=8, num_sink_tokens=4)),
    Scenario("alibi", (8, 1, 1), (10, 33, 2), spec=dict(use_alibi=True)),
    Scenario("softcap", (9, 1), (14, 40), spec=dict(logits_soft_cap=5.0), query_gain=6.0),
    Scenario("encoder", (13, 7), (0, 0), spec=dict(attn_type=AttentionType.ENCODER)),
    Scenario("encoder_only", (13, 7, 1), (0, 0, 0), spec=dict(attn_type=AttentionType.ENCODER_ONLY)),
    Scenario(
        "cross", (5, 1, 3), (0, 0, 0), spec=dict(attn_type=AttentionType.CROSS), encoder_lens=(17, 9, 40)
    ),
    Scenario("fp8_e4m3", (6, 1, 1), (10, 40, 18), spec=dict(kv_cache_dtype=E4M3)),
    Scenario("fp8_e5m2", (6, 1, 1), (10, 40, 18), spec=dict(kv_cache_dtype=E5M2)),
    Scenario("naive_layout", (10, 1, 1), (0, 30, 50), block_size=64, max_model_len=64),
    Scenario("odd_head_size", (7, 1), (9, 21), spec=dict(head_size=24)),
    Scenario("large_block", (5, 1), (70, 130), block_size=64),
)
SCENARIO_BY_NAME = {s.name: s for s in SCENARIOS}


@dataclass
class Case:
    """Concrete tensors for one scenario: inputs for a backend plus the per-sequence truth."""

    scenario: Scenario
    spec: AttentionSpec
    query: torch.Tensor  # [T, H, D] in the model dtype
    key: torch.Tensor | None  # [T, Hkv, D] new tokens (None for cross attention)
    value: torch.Tensor | None
    kv_cache: KVCache | None
    metadata: AttentionMetadata
    layer: LayerParams
    keys64: list[torch.Tensor]  # per sequence, every key it attends over, as stored (float64)
    values64: list[torch.Tensor]


def _stored(x: torch.Tensor, kv_dtype: KVCacheDtype, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """What the cache holds for x, read back as float64 (FP8: stored = x / scale)."""
    if kv_dtype.is_fp8:
        fp8 = FP8_DTYPES[kv_dtype]
        return (x.double() / scale).to(fp8).double() * scale
    return x.to(dtype).double()


def make_case(
    scenario: Scenario, *, dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0
) -> Case:
    gen = torch.Generator().manual_seed(seed)
    spec = scenario.attention_spec()
    H, Hkv, D, Dv = spec.num_heads, spec.num_kv_heads, spec.head_size, spec.v_size
    bs = scenario.block_size
    cross = spec.attn_type is AttentionType.CROSS
    cached = spec.uses_kv_cache
    kv_lens = (
        scenario.encoder_lens
        if cross
        else tuple(c + q for c, q in zip(scenario.context_lens, scenario.query_lens))
    )
    seq_lens = tuple(q if cross else c + q for c, q in zip(scenario.context_lens, scenario.query_lens))

    # Rounded to the model dtype first: the cache only ever sees model-dtype values.
    full_k = [torch.randn(n, Hkv, D, generator=gen).to(dtype).float() for n in kv_lens]
    full_v = [torch.randn(n, Hkv, Dv, generator=gen).to(dtype).float() for n in kv_lens]
    query = (
        torch.cat([torch.randn(q, H, D, generator=gen) for q in scenario.query_lens]) * scenario.query_gain
    )

    # Shuffled physical blocks with spares, so ids are neither contiguous nor in order.
    needed = [-(-n // bs) for n in kv_lens]
    num_blocks = sum(needed) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, at = [], 0
    for n in needed:
        tables.append(perm[at : at + n])
        at += n

    kv_dtype = spec.kv_cache_dtype
    scales = (0.05, 0.04) if kv_dtype.is_fp8 else (1.0, 1.0)
    kv_cache = None
    if cached:
        store_dtype = FP8_DTYPES[kv_dtype] if kv_dtype.is_fp8 else dtype
        noise = torch.randn(num_blocks, 2, bs, Hkv, D, generator=gen) * 100  # garbage outside sequences
        kv_cache = KVCache(
            noise.to(store_dtype).to(device),
            torch.tensor(scales[0], device=device),
            torch.tensor(scales[1], device=device),
        )
        # Earlier context (and, for cross attention, the whole encoder side) is written here by
        # plain indexing; the new tokens go through the backend's write_kv.
        for s, (k, v) in enumerate(zip(full_k, full_v)):
            upto = kv_lens[s] if cross else scenario.context_lens[s]
            for pos in range(upto):
                blk, off = tables[s][pos // bs], pos % bs
                for idx, (x, sc) in enumerate(((k[pos], scales[0]), (v[pos], scales[1]))):
                    val = (x.double() / sc).to(store_dtype) if kv_dtype.is_fp8 else x.to(store_dtype)
                    kv_cache.data[blk, idx, off] = val.to(device)

    if cross:
        key = value = None
        metadata = AttentionMetadata.build(
            query_lens=scenario.query_lens,
            seq_lens=seq_lens,
            block_tables=[[0]] * len(seq_lens),
            block_size=bs,
            device=device,
            write_kv=False,
            encoder_seq_lens=kv_lens,
            encoder_block_tables=tables,
        )
    else:
        key = torch.cat([k[c:] for k, c in zip(full_k, scenario.context_lens)])
        value = torch.cat([v[c:] for v, c in zip(full_v, scenario.context_lens)])
        metadata = AttentionMetadata.build(
            query_lens=scenario.query_lens,
            seq_lens=seq_lens,
            block_tables=tables,
            block_size=bs,
            device=device,
            write_kv=cached,
        )
        key, value = key.to(dtype).to(device), value.to(dtype).to(device)

    layer = LayerParams(
        sinks=(torch.randn(H, generator=gen) * 2).to(device) if spec.has_sinks else None,
        alibi_slopes=torch.tensor([2 ** (-8 * (h + 1) / H) for h in range(H)], device=device)
        if spec.use_alibi
        else None,
    )
    keys64 = [_stored(k, kv_dtype, scales[0], dtype) for k in full_k]
    values64 = [_stored(v, kv_dtype, scales[1], dtype) for v in full_v]
    return Case(
        scenario, spec, query.to(dtype).to(device), key, value, kv_cache, metadata, layer, keys64, values64
    )


def poison_unowned_slots(case: Case) -> None:
    """NaN in every cache slot no sequence owns a token in: a tile that reads past a sequence's
    end then shows up as NaN unless the kernel discards those rows. 16/32-bit caches only (FP8
    caches are left as they are; encoder-only attention has no cache)."""
    if case.kv_cache is None:
        return
    data, bs = case.kv_cache.data, case.scenario.block_size
    if data.element_size() == 1:
        return
    owned = torch.zeros(data.shape[0] * bs, dtype=torch.bool, device=data.device)
    meta = case.metadata
    cross = meta.encoder_block_table is not None  # the cache holds the encoder's tokens
    table = (meta.encoder_block_table if cross else meta.block_table).to(data.device)
    for s, n in enumerate(meta.encoder_seq_lens_host if cross else meta.seq_lens.tolist()):
        pos = torch.arange(n, device=data.device)
        owned[table[s, pos // bs].long() * bs + pos % bs] = True
    flat = data.view(data.shape[0], 2, bs, -1).transpose(1, 2).reshape(data.shape[0] * bs, 2, -1)
    poisoned = flat.clone()
    poisoned[~owned] = float("nan")
    data.copy_(poisoned.reshape(data.shape[0], bs, 2, -1).transpose(1, 2).reshape(data.shape))


def visible(spec: AttentionSpec, qp: int, kp: int) -> bool:
    """The masking rules of AttentionSpec, one (query, key) pair at a time."""
    if not spec.is_causal:
        return True
    if kp > qp:
        return False
    if spec.sliding_window is None or qp - kp < spec.sliding_window:
        return True
    return kp < spec.num_sink_tokens


def oracle(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 attention per sequence with explicit masks. Returns out [T, H, Dv], lse [T, H]."""
    spec, sc = case.spec, case.scenario
    H, group = spec.num_heads, spec.num_queries_per_kv
    q64 = case.query.double().cpu()
    outs, lses = [], []
    start = 0
    for s, qlen in enumerate(sc.query_lens):
        k, v = case.keys64[s], case.values64[s]  # [Lk, Hkv, D]
        context = 0 if spec.attn_type is AttentionType.CROSS else sc.context_lens[s]
        for j in range(qlen):
            qp = context + j
            mask = torch.tensor([visible(spec, qp, kp) for kp in range(k.shape[0])], dtype=torch.bool)
            o_row, lse_row = [], []
            for h in range(H):
                kv_h = h // group
                logits = (k[:, kv_h] @ q64[start + j, h]) * spec.softmax_scale
                if spec.logits_soft_cap is not None:
                    logits = spec.logits_soft_cap * torch.tanh(logits / spec.logits_soft_cap)
                if spec.use_alibi:
                    slope = float(case.layer.alibi_slopes[h])
                    logits = logits + slope * (torch.arange(k.shape[0], dtype=torch.float64) - qp)
                logits = logits[mask]
                vals = v[mask, kv_h]
                extra = [float(case.layer.sinks[h])] if spec.has_sinks else []
                pieces = logits.tolist() + extra
                if not pieces:
                    o_row.append(torch.zeros(v.shape[-1], dtype=torch.float64))
                    lse_row.append(-math.inf)
                    continue
                m = max(pieces)
                denom = sum(math.exp(p - m) for p in pieces)
                weights = torch.exp(logits - m) / denom
                o_row.append(weights @ vals)
                lse_row.append(m + math.log(denom))
            outs.append(torch.stack(o_row))
            lses.append(torch.tensor(lse_row, dtype=torch.float64))
        start += qlen
    return torch.stack(outs), torch.stack(lses)


def run_backend(
    backend_cls: type[AttentionBackend], case: Case, *, dtype: str = "float32", device: str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write the new tokens' K/V through the backend, then run its forward with the LSE."""
    backend = backend_cls(
        case.scenario.problem(dtype, device=device, needs_lse=True, compute_capability=_cc(device))
    )
    plan = backend.plan(case.metadata)
    if case.kv_cache is not None and case.key is not None:  # as the model's layers call it: with the plan
        backend.write_kv(case.key, case.value, case.kv_cache, case.metadata.slot_mapping, plan=plan)
    return backend.forward(
        case.query, case.key, case.value, case.kv_cache, plan, layer=case.layer, return_lse=True
    )


def _cc(device: str) -> tuple[int, int] | None:
    return torch.cuda.get_device_capability() if device == "cuda" else None


TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def assert_matches(
    out: torch.Tensor, lse: torch.Tensor, ref_out: torch.Tensor, ref_lse: torch.Tensor, dtype: torch.dtype
) -> None:
    """Relative error of the output (to its largest magnitude) and of the finite LSEs."""
    tol = TOLERANCE[dtype]
    out, lse = out.double().cpu(), lse.double().cpu()
    scale = max(ref_out.abs().max().item(), 1e-6)
    err = (out - ref_out).abs().max().item() / scale
    assert err <= tol, f"output relative error {err:.3g} > {tol}"
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), "LSE -inf rows differ"
    finite = torch.isfinite(ref_lse)
    if finite.any():
        lse_err = ((lse[finite] - ref_lse[finite]).abs() / ref_lse[finite].abs().clamp(min=1.0)).max().item()
        assert lse_err <= tol, f"LSE relative error {lse_err:.3g} > {tol}"


def strided_view(value: torch.Tensor) -> torch.Tensor:
    """value [T, Hkv, D] as the model hands it over: a view into a wider fused projection
    (row stride 2 * Hkv * D), so the step's K/V rows are read by their strides."""
    wide = torch.cat([torch.zeros_like(value).flatten(1), value.flatten(1)], dim=1)
    return wide[:, value[0].numel():].view(value.shape)


def forward_with_fresh_slots_poisoned(backend, case: Case, fresh_seqs=None):
    """plan, write_kv, NaN over the own cache slots of the sequences that must read the step's
    K/V (fresh_seqs; None: those TRITON's plan gave fresh tiles), then forward with the LSE and
    the values as a strided view: a fresh sequence that read the pages shows up as NaN.
    Returns (out, lse, plan)."""
    meta = case.metadata
    plan = backend.plan(meta)
    backend.write_kv(case.key, case.value, case.kv_cache, meta.slot_mapping, plan=plan)
    if fresh_seqs is None:
        fresh_seqs = set(plan.fresh_tile_seq.tolist() if plan.fresh_tile_seq is not None else [])
    data, bs = case.kv_cache.data, case.scenario.block_size
    qsl = meta.query_start_loc.tolist()
    for s in fresh_seqs:
        slots = meta.slot_mapping[qsl[s]: qsl[s + 1]].long()
        data[slots // bs, :, slots % bs] = float("nan")
    out, lse = backend.forward(case.query, case.key, strided_view(case.value), case.kv_cache, plan,
                               layer=case.layer, return_lse=True)  # fmt: skip
    return out, lse, plan
