"""Metric values from a known timeline and a known service snapshot; the docs list every name."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import generate_latest

from meshserve.api import metrics as metrics_module
from meshserve.api.metrics import METRICS, ServerMetrics
from meshserve.cluster.handover_stats import HandoverRow, HandoverStats
from meshserve.cluster.service import ServiceHealth, ServiceStats


class FakeService:
    def stats(self) -> ServiceStats:
        return ServiceStats(num_waiting=3, num_running=5, kv_usage=0.25, num_free_kv_blocks=77,
                            prefix_hit_tokens=30, prompt_tokens=120, num_preemptions=2, generated_tokens=999,
                            expert_tokens=[[4, 0, 7], [1, 2, 8]], num_migrations=6, num_migrations_refused=1,
                            num_hung_replicas=2, hung_detection_s=3.25)

    def health(self) -> ServiceHealth:
        return ServiceHealth(True, 1, 2, unserving_s=0.0, degraded_s=12.5, num_rebuilds=3, num_rebuild_failures=4)


def samples(m: ServerMetrics) -> dict[str, float]:
    out = {}
    for line in generate_latest(m.registry).decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_timeline_gives_ttft_tpot_e2e(monkeypatch):
    clock = iter([10.0, 10.5, 10.7, 11.3, 12.0])  # start, 1st token, 2 more, 3 more, (unused)
    monkeypatch.setattr(metrics_module.time, "monotonic", lambda: next(clock))
    m = ServerMetrics(FakeService())
    timer = m.timer()
    timer.tokens(0)  # a delta without tokens is not a first token
    timer.tokens(1)
    timer.tokens(2)
    timer.tokens(3)
    timer.finish("OK", completed=True)
    s = samples(m)
    assert s["meshserve_time_to_first_token_seconds_sum"] == 0.5
    assert abs(s["meshserve_time_per_output_token_seconds_sum"] - (11.3 - 10.5) / 5) < 1e-12
    assert abs(s["meshserve_e2e_request_latency_seconds_sum"] - 1.3) < 1e-12
    assert s['meshserve_requests_total{code="OK"}'] == 1


def test_cancelled_requests_count_but_have_no_latency():
    m = ServerMetrics(FakeService())
    m.timer().finish("CANCELLED", completed=False)
    s = samples(m)
    assert s['meshserve_requests_total{code="CANCELLED"}'] == 1
    assert s["meshserve_e2e_request_latency_seconds_count"] == 0


def test_service_snapshot_is_exported():
    s = samples(ServerMetrics(FakeService()))
    assert (s["meshserve_requests_waiting"], s["meshserve_requests_running"]) == (3, 5)
    assert (s["meshserve_kv_cache_usage_ratio"], s["meshserve_kv_cache_free_blocks"]) == (0.25, 77)
    assert s["meshserve_prefix_cache_hit_rate"] == 0.25
    assert (s["meshserve_prefix_cache_hit_tokens_total"], s["meshserve_prompt_tokens_total"]) == (30, 120)
    assert (s["meshserve_preemptions_total"], s["meshserve_generation_tokens_total"]) == (2, 999)
    assert (s["meshserve_replicas_healthy"], s["meshserve_replicas"]) == (1, 2)
    assert (s["meshserve_unserving_seconds"], s["meshserve_degraded_seconds"]) == (0.0, 12.5)
    assert (s["meshserve_replica_rebuilds_total"], s["meshserve_replica_rebuild_failures_total"]) == (3, 4)
    assert s['meshserve_moe_expert_tokens{expert="2",layer="0"}'] == 7
    assert s['meshserve_moe_expert_tokens{expert="0",layer="1"}'] == 1
    assert sum(v for k, v in s.items() if k.startswith("meshserve_moe_expert_tokens")) == 22


class DisaggregatedService(FakeService):
    """Two prefill replicas and one decode replica that imported twice and recomputed once."""

    def stats(self) -> ServiceStats:
        decode = HandoverStats()
        decode.imported(4096, 0.004)  # the 0.005 bucket
        decode.imported(1024, 0.2)  # the 0.25 bucket
        decode.recompute("timeout")
        offered = HandoverStats(handovers=2)
        rows = [HandoverRow("prefill", "prefill-0", offered), HandoverRow("prefill", "prefill-1", HandoverStats()),
                HandoverRow("decode", "decode-0", decode), HandoverRow("decode", "decode-retired", HandoverStats())]
        return ServiceStats(num_waiting=0, num_running=0, kv_usage=0.0, num_free_kv_blocks=1, prefix_hit_tokens=0,
                            prompt_tokens=0, num_preemptions=0, generated_tokens=0, handovers=rows,
                            kv_transport="zmq")


def test_hand_overs_are_exported_per_pool_and_replica():
    s = samples(ServerMetrics(DisaggregatedService()))
    d = 'pool="decode",replica="decode-0"'
    assert s['meshserve_kv_transport_info{transport="zmq"}'] == 1
    assert s['meshserve_kv_handovers_total{pool="prefill",replica="prefill-0"}'] == 2
    assert s['meshserve_kv_handovers_total{pool="prefill",replica="prefill-1"}'] == 0
    assert s[f"meshserve_kv_handovers_total{{{d}}}"] == 3
    assert s['meshserve_kv_handovers_total{pool="decode",replica="decode-retired"}'] == 0
    assert s[f"meshserve_kv_imported_bytes_total{{{d}}}"] == 5120
    assert s[f"meshserve_kv_transfer_seconds_count{{{d}}}"] == 2
    assert abs(s[f"meshserve_kv_transfer_seconds_sum{{{d}}}"] - 0.204) < 1e-12
    buckets = {k.split('le="')[1].split('"')[0]: v for k, v in s.items()
               if k.startswith("meshserve_kv_transfer_seconds_bucket") and "decode-0" in k}
    assert (buckets["0.0025"], buckets["0.005"], buckets["0.1"], buckets["0.25"], buckets["+Inf"]) == (0, 1, 1, 2, 2)
    # (the exposition sorts label names)
    assert s['meshserve_kv_recomputes_total{pool="decode",reason="timeout",replica="decode-0"}'] == 1
    assert s['meshserve_kv_recomputes_total{pool="decode",reason="auth",replica="decode-0"}'] == 0
    assert sum(v for k, v in s.items() if k.startswith("meshserve_kv_recomputes_total")) == 1
    assert not any("prefill" in k for k in s if k.startswith(("meshserve_kv_recomputes", "meshserve_kv_imported",
                                                              "meshserve_kv_transfer")))


def test_a_unified_service_has_no_hand_over_series():
    assert not any(k.startswith(("meshserve_kv_handovers", "meshserve_kv_transport", "meshserve_kv_transfer"))
                   for k in samples(ServerMetrics(FakeService())))


def test_replica_expert_load_sums_its_ranks():
    from meshserve.cluster.executors.executor import sum_expert_load

    ranks = [[[3, 0, 0, 0], [1, 1, 0, 0]], [[0, 0, 2, 5], [0, 0, 4, 0]], []]  # two ranks' experts, one dense
    assert sum_expert_load(ranks) == [[3, 0, 2, 5], [1, 1, 4, 0]]
    assert sum_expert_load([[], []]) == []


def test_docs_list_every_metric():
    doc = (Path(__file__).resolve().parents[3] / "docs" / "api.md").read_text()
    for name in METRICS:
        assert f"`{name}" in doc, name


def test_fault_counters_are_exported():
    s = samples(ServerMetrics(FakeService()))
    assert (s["meshserve_migrations_total"], s["meshserve_migrations_refused_total"]) == (6, 1)
    assert (s["meshserve_hung_replicas_total"], s["meshserve_hung_detection_seconds_total"]) == (2, 3.25)
