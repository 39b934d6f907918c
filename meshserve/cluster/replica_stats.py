"""What a replica counts: `ReplicaStats` (a snapshot, per replica and per pool's retired ones)
and `ReplicaCounters` (the running totals a replica keeps between snapshots)."""

from __future__ import annotations

from dataclasses import dataclass, field

from meshserve.cluster.handover_stats import HandoverStats


@dataclass
class ReplicaStats:
    name: str
    role: str
    state: str
    num_waiting: int
    num_running: int
    num_free_kv_blocks: int
    num_total_kv_blocks: int
    kv_usage: float
    prefix_hit_tokens: int
    prompt_tokens: int
    generated_tokens: int
    num_preemptions: int
    num_handoffs: int = 0  # prefill: requests handed over; decode: adopted (imported or recomputed)
    num_kv_imports: int = 0
    num_recomputes: int = 0
    num_migrated: int = 0  # requests that moved on from this replica when it failed
    num_migrations_refused: int = 0  # ... that failed instead, at --max-migrations
    num_hung: int = 0  # 1 once it was declared hung
    hung_detect_s: float = 0.0  # how long its hung step had run when it was declared
    handover: HandoverStats = field(default_factory=HandoverStats)  # the same, in detail (a copy)
    expert_tokens: list[list[int]] = field(default_factory=list)  # [MoE layer][expert] rows since start
    # The driver rank's grammar compiles (workers/grammar.py): written off past their bound and
    # still running (xgrammar cannot stop them), written off since start, grammars refused at once.
    num_grammar_stuck: int = 0
    num_grammar_written_off: int = 0
    num_grammar_refused: int = 0


@dataclass
class ReplicaCounters:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    expert_tokens: list[list[int]] = field(default_factory=list)
    grammar: dict[str, int] = field(default_factory=dict)  # the driver's Worker.grammar_stats() ({}: zeros)
    steps: int = 0
    migrated: int = 0
    migrations_refused: int = 0
    hung_detect_s: float | None = None
