"""The KV hand-over between a prefill and a decode replica (disaggregated serving).

A prefill replica runs a request until its first token; then, in its step thread, `offer_kv`
pins the request's blocks (kvstore/pins.py: a fork of its tables in the KV manager), asks every
rank to offer its KV shard of them under a fresh unguessable capability (`kv_offer`: each rank's
KVExportServer, msgpack header + raw frames, every message MACed with the cluster secret) and
detaches the request, which the coordinator hands to a decode replica as a `Handoff` (the
capability travels in it, nowhere else). The decode replica's `import_kv` reserves blocks in
every KV layer group, has every rank pull its shard by that capability into them (`kv_pull`;
with another (tp, dcp) layout, heads are re-split and tokens re-distributed:
kvstore/reshard.py), commits the prefix hashes (the sender's, or its own from the token ids when
the two pools' blocks cover different token counts, i.e. their dcp differs) and continues from
the first token. If anything about the transfer fails it returns 0 and the prompt is recomputed.
Either way the prefill replica is then told to release its pin (`release_sources`). Each end
counts what happened in its `handover` totals (handover_stats.py: hand-overs, bytes, pull
seconds, recomputes by reason), which the metrics export per pool and replica.

Functions of either end (`HandoverEnd`: what they use of a replica), kept apart so replica.py
stays the replica's life cycle and loop; replica.py imports this module, never the reverse.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from meshserve.cluster.executor import Executor, RankError
from meshserve.cluster.handover_stats import HandoverStats, pull_reason
from meshserve.cluster.logs import request_event
from meshserve.cluster.request import Ticket
from meshserve.kvstore.pins import HandoverBlocks, KVPins
from meshserve.kvstore.reshard import receiver_positions
from meshserve.kvstore.zmq_transport import new_capability

if TYPE_CHECKING:
    from meshserve.cluster.engine import EngineConfig, EngineCore

log = logging.getLogger("meshserve.replica")


class HandoverEnd(Protocol):
    """One end of a hand-over, the prefill replica that offers or the decode replica that pulls
    (replica.Replica): its engine and ranks, and what both ends must agree on."""

    name: str
    model_id: str
    world: int  # its tp
    handoff_tp: int  # (prefill end) the tp of the decode replicas it offers to
    handoff_dcp: int  # (prefill end) and their dcp
    handover_timeout_s: float
    faults: list[str]  # injected offer faults (tests)
    config: EngineConfig
    core: EngineCore
    pins: KVPins  # the driver side of hand-overs, over core.kv
    executor: Executor
    handover: HandoverStats  # this end's totals

    def release(self, pin_id: tuple) -> None:
        """(Prefill end) the decode end is done with the offer pinned as `pin_id`."""


@dataclass
class KVOffer:
    """A finished prefill's KV, offered by every rank of the source (pinned there until released)."""

    addresses: list[str]  # per rank: its export server
    blocks: HandoverBlocks  # what was pinned: tokens, per KV layer group tables and hashes
    pin_id: tuple
    model_id: str
    tp: int
    dcp: int
    dst_tp: int  # the decode tp the shards were offered for
    block_size: int
    dcp_size: int
    dst_dcp: int = 1  # the decode dcp the shards were offered for
    capability: str = field(default="", repr=False)  # what the decode ranks pull by (never logged)


@dataclass
class Handoff:
    """A request leaving a prefill replica after its first token (already streamed)."""

    ticket: Ticket  # its request is detached from the source's engine
    source: HandoverEnd
    offer: KVOffer | None  # None: no KV to pull (offer failed); the decode side recomputes
    reason: str = ""


def offer_kv(self: HandoverEnd, ticket: Ticket) -> Handoff:
    """(Prefill replica, step thread) Pin the request's blocks, have every rank offer its shard,
    detach the request."""
    rid, kv = ticket.request_id, self.core.kv
    if self.core.info.is_encoder_decoder:  # the cross-attention K/V are not in the offered tables
        request_event(rid, "prefilled", replica=self.name, kv_tokens=0, offered=False)
        self.core.detach(rid)
        return Handoff(ticket, self, None, "encoder-decoder model: the decode replica re-runs the encoder")
    pin = self.pins.pin(rid)
    capability = new_capability()  # handed to the decode replica with the Handoff, nowhere else
    args = {"blocks": pin.blocks.to_wire(), "capability": capability, "block_size": kv.block_size,
            "dcp_size": kv.dcp_size,
            "model_id": self.model_id, "dst_tp": self.handoff_tp, "dst_dcp": self.handoff_dcp,
            "fault": self.faults.pop(0) if self.faults else None}
    offer, reason = None, ""
    self.handover.handovers += 1
    try:
        addresses = self.executor.call("kv_offer", [args] * self.world)
        offer = KVOffer(addresses, pin.blocks, pin.pin_id, self.model_id, self.world, self.config.parallel.dcp,
                        self.handoff_tp, kv.block_size, kv.dcp_size, self.handoff_dcp, capability)
    except RankError as exc:
        self.pins.release(pin.pin_id)
        reason = str(exc)
    request_event(rid, "prefilled", replica=self.name, kv_tokens=pin.blocks.num_tokens, offered=offer is not None)
    self.core.detach(rid)
    return Handoff(ticket, self, offer, reason)


def import_kv(self: HandoverEnd, h: Handoff) -> int:
    """(Decode replica, step thread) Pull the offered KV into fresh blocks; the tokens now cached,
    or 0 when the prompt must be recomputed."""
    rid, offer, kv = h.ticket.request_id, h.offer, self.core.kv
    why, reason = h.reason or "no KV was offered", "offer_failed"
    if offer is not None:
        dcp = self.config.parallel.dcp
        sent = offer.blocks
        # Any (tp, dcp) pair re-shards; the per-rank block size (a block-table entry covers it on
        # each DCP rank) and what the offer was made for must agree.
        fits = ((offer.model_id, offer.block_size // offer.dcp, offer.dcp_size, len(sent.block_tables),
                 offer.dst_tp, offer.dst_dcp) == (
            self.model_id, kv.block_size // dcp, kv.dcp_size, kv.num_groups, self.world, dcp))
        same_blocks = offer.block_size == kv.block_size  # one table entry covers as many tokens
        positions = sent.block_positions if same_blocks else tuple(
            receiver_positions(sent.num_tokens, p, offer.block_size * offer.dcp_size, kv.tokens_per_block)
            for p in sent.block_positions)
        blocks = self.pins.reserve(rid, sent.num_tokens, positions, extra_keys=sent.extra_keys) if fits else None
        why = "no free blocks" if fits else (
            "KV layouts differ (model, per-rank block size, KV layer groups, or the decode layout offered for)")
        reason = "no_free_blocks" if fits else "layout"
        if blocks is not None:
            args = [{"capability": offer.capability, "addresses": offer.addresses, "src_tp": offer.tp,
                     "src_dcp": offer.dcp,
                     "src_block_size": offer.block_size, "num_tokens": sent.num_tokens,
                     "src_positions": [list(p) for p in sent.block_positions],
                     "dst_positions": [list(p) for p in positions], "blocks": list(blocks),
                     "block_size": kv.block_size, "dcp_size": kv.dcp_size, "model_id": self.model_id,
                     "timeout_s": self.handover_timeout_s} for _ in range(self.world)]
            start = time.perf_counter()
            try:
                results = self.executor.call("kv_pull", args)
            except RankError as exc:
                results = [{"ok": False, "error": str(exc)}]
            seconds = time.perf_counter() - start
            if all(r["ok"] for r in results):
                self.handover.imported(sum(r["bytes"] for r in results), seconds)
                hashes = sent.block_hashes if same_blocks else kv.hashes_of(
                    h.ticket.request.all_token_ids[: sent.num_tokens], extra_keys=sent.extra_keys)
                self.pins.commit(rid, hashes)
                request_event(rid, "kv_imported", replica=self.name, tokens=sent.num_tokens)
                return sent.num_tokens
            self.pins.abort(rid)
            why = "; ".join(r["error"] for r in results if not r["ok"])
            reason = pull_reason(next(r.get("reason") for r in results if not r["ok"]))
    self.handover.recompute(reason)
    log.info("replica %s recomputes %s (%s): %s", self.name, rid, reason, why)
    request_event(rid, "recompute", replica=self.name, reason=reason, why=why)
    return 0


def release_sources(adoptions: list[Handoff]) -> None:
    """Tell each source replica it may free its pin (pulled, refused or failed alike)."""
    for h in adoptions:
        if h.offer is not None:
            h.source.release(h.offer.pin_id)
