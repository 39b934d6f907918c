"""bench/disagg_ttft.py reads the hand-over counters as /metrics exposes them: the exposition that
api/metrics.py renders from known HandoverStats (two decode replicas, one retired; a prefill
replica whose counts must not be taken for imports), parsed back and differenced between two
scrapes, gives exactly the imports by transport, recomputes, bytes and pulls put in."""

from prometheus_client import generate_latest

from bench.disagg_ttft import HandoverCounters, gpus_per_rank_for, path_flags
from meshserve.api.metrics import ServerMetrics
from meshserve.cluster.handover_stats import HandoverRow, HandoverStats
from meshserve.cluster.service import ModelCard, ServiceHealth, ServiceStats


class _Snapshot:
    """What ServerMetrics' collector asks of a service: its stats, health and model, at each scrape."""

    def __init__(self, rows: list[HandoverRow], transport: str) -> None:
        self.rows, self.transport = rows, transport

    def stats(self) -> ServiceStats:
        return ServiceStats(num_waiting=0, num_running=0, kv_usage=0.0, num_free_kv_blocks=10, prefix_hit_tokens=0,
                            prompt_tokens=0, num_preemptions=0, generated_tokens=0, handovers=self.rows,
                            kv_transport=self.transport)

    def health(self) -> ServiceHealth:
        return ServiceHealth(serving=True, healthy_replicas=2, total_replicas=2)

    def models(self) -> list[ModelCard]:
        return [ModelCard("m", max_model_len=64, vocab_size=100)]


def _scrape(service: _Snapshot) -> HandoverCounters:
    return HandoverCounters.parse(generate_latest(ServerMetrics(service).exposition).decode())


def test_counters_between_two_scrapes_are_what_the_replicas_counted():
    prefill, decode, retired = HandoverStats(), HandoverStats(), HandoverStats()
    service = _Snapshot([HandoverRow("prefill", "prefill-0", prefill), HandoverRow("decode", "decode-0", decode),
                         HandoverRow("decode", "decode-retired", retired)], "nixl")
    retired.imported(1000, 0.2, "zmq")  # before the run: must not count
    before = _scrape(service)
    for _ in range(3):
        prefill.handovers += 1
        decode.imported(4096, 0.003, "nixl")
    retired.imported(512, 0.04, "zmq")
    decode.recompute("timeout")
    moved = _scrape(service).since(before)
    assert dict(+moved.imports) == {"nixl": 3, "zmq": 1}
    assert dict(+moved.recomputes) == {"timeout": 1}
    assert moved.kv_bytes == 3 * 4096 + 512
    assert moved.pulls == 4
    assert abs(moved.pull_seconds - (3 * 0.003 + 0.04)) < 1e-9
    assert moved.pull_ms_p50_bound() == 5.0  # 3 of 4 pulls in the (2.5 ms, 5 ms] bucket
    assert moved.resolved == "nixl"
    assert "nixl: 3 pulls, zmq: 1 pulls" in moved.moved_by() and "1 (timeout)" in moved.moved_by()


def test_a_unified_server_has_no_hand_over():
    moved = _scrape(_Snapshot([], ""))
    assert not +moved.imports and moved.pulls == 0 and moved.resolved == ""
    assert moved.moved_by() == "no hand-over"


def test_the_disaggregated_servers_flags_are_serves():
    """What the bench passes is what `meshserve serve` parses and validates (a one-GPU machine: 0.5)."""
    from meshserve.api.serve import configs_of
    from meshserve.cli import build_parser

    assert path_flags("unified", kv_transport="auto", placement_timeout=120) == []
    flags = path_flags("disaggregated", kv_transport="auto", placement_timeout=120, gpus_per_rank=0.5)
    engine, pools, _ = configs_of(build_parser().parse_args(["serve", *flags]))
    assert (pools.mode.value, pools.placement_timeout_s, engine.parallel.gpus_per_rank) == ("disaggregated", 120, 0.5)
    assert gpus_per_rank_for("auto", "cpu") == 1.0 and gpus_per_rank_for("0.25", "cuda") == 0.25
