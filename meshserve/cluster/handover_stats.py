"""What a replica counts of its KV hand-overs, for the metrics (api/metrics.py) and the tests.

Recomputes are counted by a small fixed set of reasons (`RECOMPUTE_REASONS`), the normalised
form of the `why` cluster/handover.py logs; every reason is listed from the start (zeros
included) so that a dashboard's rate() sees each series before its first increment. The
transfer histogram keeps fixed bucket counts here and is exposed at scrape time, like every
other engine metric (nothing observed in the API process).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

RECOMPUTE_REASONS = (
    "offer_failed",  # the prefill ranks could not offer the KV (kv_offer raised)
    "no_free_blocks",  # the decode replica could not reserve blocks for it
    "layout",  # the two pools' KV layouts cannot exchange it (model, block size, groups, layout offered for)
    "timeout",  # no complete answer within the replica's handover_timeout_s
    "auth",  # an answer failed its MAC (wrong cluster secret or a forged frame)
    "transfer_failed",  # any other refused pull: truncated, checksum, unknown offer, CUDA IPC open, a rank error
)

# From KVTransferError.reason (kvtransfer/wire.py) to the reasons above; the rest are transfer_failed.
_PULL_REASONS = {"timeout": "timeout", "auth": "auth", "layout": "layout"}

# Seconds of one request's pull, 1 ms (a few blocks on one host) to 30 s (past the default timeout).
TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def pull_reason(transfer_reason: str | None) -> str:
    """The recompute reason of a failed kv_pull, from its rank's KVTransferError reason (None:
    the rank call itself failed)."""
    return _PULL_REASONS.get(transfer_reason or "", "transfer_failed")


@dataclass
class HandoverStats:
    """Totals since the replica started. handovers: on a prefill replica the requests it handed
    over, on a decode replica those it adopted (KV imported or recomputed)."""

    handovers: int = 0
    kv_imports: int = 0
    kv_bytes: int = 0  # cache bytes pulled by the replica's ranks, imports that succeeded
    recomputes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(RECOMPUTE_REASONS, 0))
    # Successful pulls: counts per TRANSFER_BUCKETS bucket (not cumulative; the last is +Inf), sum.
    transfer_buckets: list[int] = field(default_factory=lambda: [0] * (len(TRANSFER_BUCKETS) + 1))
    transfer_seconds: float = 0.0
    transports: dict[str, int] = field(default_factory=dict)  # successful imports by the transport used

    @property
    def num_recomputes(self) -> int:
        return sum(self.recomputes.values())

    def recompute(self, reason: str) -> None:
        if reason not in self.recomputes:
            raise ValueError(f"recompute reason {reason!r} is not one of {RECOMPUTE_REASONS}")
        self.handovers += 1
        self.recomputes[reason] += 1

    def imported(self, num_bytes: int, seconds: float, transport: str = "zmq") -> None:
        self.transports[transport] = self.transports.get(transport, 0) + 1
        self.handovers += 1
        self.kv_imports += 1
        self.kv_bytes += num_bytes
        self.transfer_buckets[bisect.bisect_left(TRANSFER_BUCKETS, seconds)] += 1
        self.transfer_seconds += seconds

    def cumulative_buckets(self) -> list[tuple[str, int]]:
        """Prometheus buckets: (upper bound, pulls at most that long), ending with +Inf."""
        out, total = [], 0
        for bound, n in zip([*map(str, TRANSFER_BUCKETS), "+Inf"], self.transfer_buckets):
            total += n
            out.append((bound, total))
        return out

    def add(self, other: HandoverStats) -> None:
        """Fold another replica's totals in (a pool keeps those of the replicas it replaced)."""
        self.handovers += other.handovers
        self.kv_imports += other.kv_imports
        self.kv_bytes += other.kv_bytes
        for reason, n in other.recomputes.items():
            self.recomputes[reason] += n
        self.transfer_buckets = [a + b for a, b in zip(self.transfer_buckets, other.transfer_buckets)]
        self.transfer_seconds += other.transfer_seconds
        for name, n in other.transports.items():
            self.transports[name] = self.transports.get(name, 0) + n

    def copy(self) -> HandoverStats:
        out = HandoverStats()
        out.add(self)
        return out


@dataclass(frozen=True)
class HandoverRow:
    """One replica's hand-over totals as the service reports them (ServiceStats.handovers)."""

    pool: str  # prefill or decode
    replica: str  # its name, or '<pool>-retired' for the replicas that pool replaced
    stats: HandoverStats
