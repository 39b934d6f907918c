"""Hand-over metrics of a disaggregated coordinator (ranks on threads), scraped from /metrics'
registry: after a hand-over (bytes against the model's own KV shape) and after forced recomputes.
"""

import math

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from meshserve.api.metrics import ServerMetrics
from meshserve.cluster.handover_stats import RECOMPUTE_REASONS
from meshserve.core.sampling_params import SamplingParams
from meshserve.kvtransfer.nixl_transport import nixl_available
from tests.tiny_models import prompts, write_checkpoint
from tests.unit.cluster.cases import collect, serve, threads

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
BLOCK_SIZE = 16  # cases.engine_config


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("handover_metrics") / "llama"
    model = write_checkpoint(path, "llama", seed=4)
    return path, model.config


def scrape(coordinator) -> dict[tuple, float]:
    """{(sample name, its labels as a frozenset of pairs): value} of one scrape."""
    text = generate_latest(ServerMetrics(coordinator).registry).decode()
    return {(m.name, frozenset(m.labels.items())): m.value
            for family in text_string_to_metric_families(text) for m in family.samples}


def sample(s: dict[tuple, float], name: str, **labels: str) -> float:
    return s[(name, frozenset(labels.items()))]


def kv_bytes(config, num_tokens: int) -> int:
    """The oracle: K and V of every layer for the blocks holding `num_tokens` (float32 cache)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_block = config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * BLOCK_SIZE * 4
    return math.ceil(num_tokens / BLOCK_SIZE) * per_block


def test_counters_after_a_hand_over_and_after_forced_recomputes(ckpt):
    path, config = ckpt
    prompt = prompts(1, seed=3, min_len=37, max_len=37)[0]

    async def body(c):
        (prefill,), (decode,) = c.replicas("prefill"), c.replicas("decode")
        await collect(c, "ok", prompt, GREEDY)
        first = scrape(c)
        prefill.inject_fault("checksum")
        await collect(c, "bad-checksum", prompt[:20], GREEDY)
        prefill.inject_fault("withdraw")
        await collect(c, "withdrawn", prompt[:21], GREEDY)
        return dict(pool="prefill", replica=prefill.name), dict(pool="decode", replica=decode.name), first, scrape(c)

    p, d, first, second = serve(threads(path, "disaggregated"), body)
    moved_by = "nixl" if nixl_available() else "zmq"  # kv_transport auto between CPU caches
    assert sample(first, "meshserve_kv_transport_info", transport=moved_by) == 1
    assert sample(first, "meshserve_kv_handovers_total", **p) == 1
    assert sample(first, "meshserve_kv_handovers_total", **d) == 1
    assert sample(first, "meshserve_kv_imported_bytes_total", **d) == kv_bytes(config, len(prompt))
    assert sample(first, "meshserve_kv_transfer_seconds_count", **d) == 1
    assert sample(first, "meshserve_kv_imports_total", transport=moved_by, **d) == 1
    assert 0 < sample(first, "meshserve_kv_transfer_seconds_sum", **d) < 30
    assert sample(first, "meshserve_kv_transfer_seconds_bucket", le="+Inf", **d) == 1
    assert [sample(first, "meshserve_kv_recomputes_total", reason=r, **d) for r in RECOMPUTE_REASONS] == [0] * 6
    assert not any(name == "meshserve_kv_recomputes_total" and ("pool", "prefill") in labels
                   for name, labels in first)  # the importing end counts them
    # A corrupted frame and a withdrawn offer: both pulls refused, both prompts recomputed.
    assert sample(second, "meshserve_kv_handovers_total", **p) == 3
    assert sample(second, "meshserve_kv_handovers_total", **d) == 3
    assert sample(second, "meshserve_kv_recomputes_total", reason="transfer_failed", **d) == 2
    assert sum(v for (name, _), v in second.items() if name == "meshserve_kv_recomputes_total") == 2
    assert (sample(second, "meshserve_kv_imported_bytes_total", **d)
            == sample(first, "meshserve_kv_imported_bytes_total", **d))
    assert sample(second, "meshserve_kv_transfer_seconds_count", **d) == 1  # failed pulls are not observed
    # The pools' retired rows are exported (zero until a replica is replaced).
    assert sample(second, "meshserve_kv_handovers_total", pool="decode", replica="decode-retired") == 0


def test_a_unified_service_exports_no_hand_over_series(ckpt):
    async def body(c):
        await collect(c, "u", [5, 6, 7], GREEDY)
        return scrape(c)

    s = serve(threads(ckpt[0]), body)
    assert not any(name.startswith("meshserve_kv_") and "cache" not in name for name, _ in s), sorted(s)


def test_handover_stats_buckets_reasons_and_retired_totals():
    from meshserve.cluster.handover_stats import HandoverStats, pull_reason

    h = HandoverStats()
    h.recompute("no_free_blocks")
    h.imported(1000, 0.003)
    h.imported(24, 100.0)
    assert (h.handovers, h.kv_imports, h.num_recomputes, h.kv_bytes) == (3, 2, 1, 1024)
    buckets = dict(h.cumulative_buckets())
    assert (buckets["0.0025"], buckets["0.005"], buckets["30.0"], buckets["+Inf"]) == (0, 1, 1, 2)
    assert [pull_reason(r) for r in ("timeout", "auth", "layout", "checksum", "unknown_request", None)] == [
        "timeout", "auth", "layout", "transfer_failed", "transfer_failed", "transfer_failed"]
    with pytest.raises(ValueError, match="not one of"):
        h.recompute("KV layouts differ")
    retired = HandoverStats()
    retired.add(h)
    retired.add(h)
    assert (retired.handovers, retired.recomputes["no_free_blocks"], dict(retired.cumulative_buckets())["+Inf"]) == (
        6, 2, 4)
