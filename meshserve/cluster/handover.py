"""The KV hand-over between a prefill and a decode replica (disaggregated serving).

A prefill replica runs a request until its first token; then, in its step thread right after
that step, `offer_start` pins the request's blocks (kvtransfer/pins.py: a fork of its tables in
the KV manager), detaches the request and sends every rank the offer of its KV shard of them
under a fresh unguessable capability (`kv_offer`: each rank's KVExportServer, msgpack header + raw
frames, every message MACed with the cluster secret) without waiting for the answers. The step's
deltas go to the replica's loop, which delivers the first token, while the step thread waits for
the ranks' answers (`offer_finish`); then the request goes to the coordinator, which hands it to
a decode replica as a `Handoff` (the capability travels in it, nowhere else). An abort meanwhile
ends the stream at once and releases the pin once the ranks answered; a rank that failed the
offer makes a Handoff without KV (the decode side recomputes). The first token thus never waits
for the ranks' offer. The decode replica reserves blocks in every KV layer
group, has every rank pull its shard by that capability into them (`kv_pull_start`;
with another (tp, dcp) layout, heads are re-split and tokens re-distributed:
kvtransfer/reshard.py), commits the prefix hashes (the sender's, or its own from the token ids when
the two pools' blocks cover different token counts, i.e. their dcp differs) and continues from
the first token. If anything about the transfer fails the prompt is recomputed instead.
Either way the prefill replica is then told to release its pin (`release_sources`).

The import is asynchronous (`Imports`): `start_import` reserves the blocks and has every rank
start its pull on a background thread (rank.kv_pull_start); the decode replica keeps stepping its
running requests. Each rank tells the driver unasked when a pull of its ends (the step channel's
PULLED message); the replica collects those results between steps (`executor.take_kv_pulls`, no
round trip to the ranks) and, when it has nothing to step, waits for them (`wait_kv_pulls`), so a
finished pull is seen at once, not at the next poll. Then it adopts the request (`finish_import`:
commit, or free and recompute). An abort meanwhile cancels the pulls
and frees the blocks once every rank's pull has ended (never while a rank may still write them);
a replica that stops or fails frees its reservations after its ranks stopped pulling. Each end
counts what happened in its `handover` totals (handover_stats.py: hand-overs, bytes, pull
seconds, recomputes by reason), which the metrics export per pool and replica.

A replica's hand-over state is a `ReplicaHandover` it owns (`replica.handover`): the pins of its
offers, its imports in flight, its totals, the decode layout it offers for, its injected faults.
replica.py imports this module, never the reverse.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Protocol

from meshserve.cluster.executors.executor import RankError
from meshserve.cluster.handover_stats import HandoverStats, pull_reason
from meshserve.cluster.logs import request_event
from meshserve.core import hop_trace
from meshserve.engine.request import Ticket
from meshserve.kvtransfer.export_server import new_capability
from meshserve.kvtransfer.pins import HandoverBlocks, KVPins, Pin
from meshserve.kvtransfer.reshard import receiver_positions

log = logging.getLogger("meshserve.replica")


class Source(Protocol):
    """The replica a hand-over came from, as its Handoff names it (replica.Replica)."""

    name: str

    def release(self, pin_id: tuple) -> None:
        """The decode end is done with the offer pinned as `pin_id` (queued to the source's loop)."""


@dataclass
class KVOffer:
    """A finished prefill's KV, offered by every rank of the source (pinned there until released)."""

    addresses: list[dict]  # per rank: its export endpoint (kvtransfer/transport.py Endpoint.to_wire)
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
    source: Source
    offer: KVOffer | None  # None: no KV to pull (offer failed); the decode side recomputes
    reason: str = ""


@dataclass
class PendingOffer:
    """A request whose first token came: its blocks pinned, detached from the engine, every rank
    asked to offer its shard (`call_id`: the executor's kv_offer call, answers not read yet)."""

    ticket: Ticket
    pin: Pin | None  # None: no KV to offer (`reason` says why); the decode side recomputes
    capability: str = field(default="", repr=False)
    reason: str = ""
    call_id: int | None = None
    aborted: bool = False  # aborted meanwhile: no hand-off; the pin is released once the ranks answered


@dataclass
class PendingImport:
    """A hand-over whose KV is on its way: blocks reserved, every rank pulling in the background."""

    handoff: Handoff
    transfer_id: str
    same_blocks: bool  # the two pools' table entries cover as many tokens (else hashes are recomputed)
    results: dict[int, dict] = field(default_factory=dict)  # per rank, once its pull finished
    aborted: bool = False  # the request was aborted meanwhile: free the blocks when the pulls end


class ReplicaHandover:
    """A replica's side of hand-overs, either end (the prefill replica that offers, the decode
    replica that pulls), owned by the replica (`replica.handover`). It reads the replica's name,
    model id, tp, config, engine and executor when it acts (they change when the replica is
    rebuilt). handoff_tp, handoff_dcp: the decode layout this replica offers for (prefill end);
    timeout_s: how long a pull may take before the prompt is recomputed (decode end)."""

    def __init__(self, replica, *, handoff_tp: int, handoff_dcp: int, timeout_s: float) -> None:
        self.replica = replica  # replica.Replica (not imported: it imports this module)
        self.handoff_tp, self.handoff_dcp, self.timeout_s = handoff_tp, handoff_dcp, timeout_s
        self.faults: list[str] = []  # injected offer faults (tests): "checksum", "withdraw"
        self.pins: KVPins | None = None  # the driver side of hand-overs, over core.kv (attach)
        self.stats = HandoverStats()  # this end's totals
        self.imports = Imports(self)  # KV pulls in flight (started in the step thread)
        self.offers: dict[str, PendingOffer] = {}  # by request id: sent to the ranks, answers not read yet

    def attach(self, kv) -> None:
        """The replica's engine started: pins over its KV manager."""
        self.pins = KVPins(kv)

    def offer_start(self, ticket: Ticket) -> PendingOffer:
        """(Prefill replica, step thread, right after the step that gave the first token) Pin the
        request's blocks, detach the request (it is stepped no more; the pin keeps its KV) and send
        every rank the offer of its shard without waiting (`kv_offer` by `executor.start_call`):
        the ranks prepare it while the loop delivers the first token; `offer_finish` reads their
        answers."""
        r = self.replica
        rid, kv = ticket.request_id, r.core.kv
        if r.core.info.is_encoder_decoder:  # the cross-attention K/V are not in the offered tables
            r.core.detach(rid)
            return PendingOffer(ticket, None, reason="encoder-decoder model: the decode replica re-runs the encoder")
        pin = self.pins.pin(rid)
        r.core.detach(rid)
        capability = new_capability()  # handed to the decode replica with the Handoff, nowhere else
        args = {"blocks": pin.blocks.to_wire(), "capability": capability, "block_size": kv.block_size,
                "dcp_size": kv.dcp_size,
                "model_id": r.model_id, "dst_tp": self.handoff_tp, "dst_dcp": self.handoff_dcp,
                "fault": self.faults.pop(0) if self.faults else None}
        self.stats.handovers += 1
        offer = PendingOffer(ticket, pin, capability)
        self.offers[rid] = offer  # before the send: a rank that is gone raises, and the replica's failure frees it
        hop_trace.mark("handover.offer_sent")
        offer.call_id = r.executor.start_call("kv_offer", [args] * r.world)
        return offer

    def offer_finish(self, p: PendingOffer) -> Handoff | None:
        """(Prefill replica, step thread) The ranks' answers to an offer: the Handoff for the
        coordinator (offer None, the prompt recomputed, when a rank failed it), or None when the
        request was aborted meanwhile (its pin released)."""
        r = self.replica
        rid, offer, reason = p.ticket.request_id, None, p.reason
        if p.pin is not None:
            kv = r.core.kv
            try:
                addresses = r.executor.finish_call(p.call_id)
                offer = KVOffer(addresses, p.pin.blocks, p.pin.pin_id, r.model_id, r.world, r.config.parallel.dcp,
                                self.handoff_tp, kv.block_size, kv.dcp_size, self.handoff_dcp, p.capability)
            except RankError as exc:
                reason = str(exc)
            hop_trace.mark("handover.offered")
        self.offers.pop(rid, None)  # an abort from now on finds the ticket with the loop (Replica._after_step)
        if p.pin is not None and (offer is None or p.aborted):
            self.pins.release(p.pin.pin_id)
        kv_tokens = 0 if p.pin is None else p.pin.blocks.num_tokens
        if p.aborted:
            request_event(rid, "offer_dropped", replica=r.name, kv_tokens=kv_tokens)
            return None
        request_event(rid, "prefilled", replica=r.name, kv_tokens=kv_tokens, offered=offer is not None)
        return Handoff(p.ticket, r, offer, reason)

    def close_offers(self) -> None:
        """(Replica stopped or failed while its step thread waited for the ranks' answers) Forget
        the offers: their requests end or move on with the replica's others (migration.py), their
        pins die with its engine."""
        self.offers.clear()


    def start_import(self, h: Handoff, transfer_id: str) -> PendingImport | None:
        """(Decode replica, step thread) Reserve blocks for the offered KV and start every rank's pull
        in the background (rank.kv_pull_start); None when the prompt must be recomputed (counted)."""
        r = self.replica
        rid, offer, kv = h.ticket.request_id, h.offer, r.core.kv
        why, reason = h.reason or "no KV was offered", "offer_failed"
        if offer is not None:
            dcp = r.config.parallel.dcp
            sent = offer.blocks
            # Any (tp, dcp) pair re-shards; the per-rank block size (a block-table entry covers it on
            # each DCP rank) and what the offer was made for must agree.
            fits = ((offer.model_id, offer.block_size // offer.dcp, offer.dcp_size, len(sent.block_tables),
                     offer.dst_tp, offer.dst_dcp) == (
                r.model_id, kv.block_size // dcp, kv.dcp_size, kv.num_groups, r.world, dcp))
            same_blocks = offer.block_size == kv.block_size  # one table entry covers as many tokens
            positions = sent.block_positions if same_blocks else tuple(
                receiver_positions(sent.num_tokens, p, offer.block_size * offer.dcp_size, kv.tokens_per_block)
                for p in sent.block_positions)
            blocks = self.pins.reserve(rid, sent.num_tokens, positions, extra_keys=sent.extra_keys) if fits else None
            why = "no free blocks" if fits else (
                "KV layouts differ (model, per-rank block size, KV layer groups, or the decode layout offered for)")
            reason = "no_free_blocks" if fits else "layout"
            if blocks is not None:
                args = [{"transfer_id": transfer_id, "capability": offer.capability, "addresses": offer.addresses,
                         "src_tp": offer.tp, "src_dcp": offer.dcp,
                         "src_block_size": offer.block_size, "num_tokens": sent.num_tokens,
                         "src_positions": [list(p) for p in sent.block_positions],
                         "dst_positions": [list(p) for p in positions], "blocks": list(blocks),
                         "block_size": kv.block_size, "dcp_size": kv.dcp_size, "model_id": r.model_id,
                         "timeout_s": self.timeout_s} for _ in range(r.world)]
                # A rank that cannot even start a pull has diverged: this raises and fails the replica
                # (the others may be writing into the reserved blocks, which die with it).
                hop_trace.mark("handover.pull_start_sent")
                r.executor.call("kv_pull_start", args)
                request_event(rid, "kv_import_started", replica=r.name, tokens=sent.num_tokens)
                return PendingImport(h, transfer_id, same_blocks)
        self._recompute(rid, reason, why)
        return None


    def finish_import(self, p: PendingImport) -> int:
        """(Decode replica, step thread) Every rank's pull ended: commit the blocks and return the
        tokens now cached, or free them and return 0 (the prompt is recomputed; aborted: dropped)."""
        r = self.replica
        rid, sent = p.handoff.ticket.request_id, p.handoff.offer.blocks
        results = [p.results[r] for r in sorted(p.results)]
        if p.aborted:
            self.pins.abort(rid)
            request_event(rid, "kv_import_dropped", replica=r.name)
            return 0
        if all(r["ok"] for r in results):
            transport = "+".join(sorted({r.get("transport") or "zmq" for r in results}))
            self.stats.imported(sum(r["bytes"] for r in results), max(r["seconds"] for r in results), transport)
            hashes = sent.block_hashes if p.same_blocks else r.core.kv.hashes_of(
                p.handoff.ticket.request.all_token_ids[: sent.num_tokens], extra_keys=sent.extra_keys)
            self.pins.commit(rid, hashes)
            request_event(rid, "kv_imported", replica=r.name, tokens=sent.num_tokens, transport=transport)
            return sent.num_tokens
        self.pins.abort(rid)
        failed = [r for r in results if not r["ok"]]
        self._recompute(rid, pull_reason(failed[0].get("reason")), "; ".join(r["error"] for r in failed))
        return 0


    def _recompute(self, rid: str, reason: str, why: str) -> None:
        r = self.replica
        self.stats.recompute(reason)
        log.info("replica %s recomputes %s (%s): %s", r.name, rid, reason, why)
        request_event(rid, "recompute", replica=r.name, reason=reason, why=why)


class Imports:
    """A decode replica's hand-overs whose KV is on its way (the replica's step thread, or its
    loop while no step runs). The replica keeps stepping its running requests meanwhile; each
    tick starts the pulls of new hand-overs and collects the ranks' finished ones, adopting their
    requests into the engine. Settled hand-overs wait in `take_settled` for their sources to be
    told (on the loop), and `close` returns them too if the loop never got to it."""

    def __init__(self, end: ReplicaHandover) -> None:
        self.end = end
        self.pending: dict[str, PendingImport] = {}  # by request id
        self._by_transfer: dict[str, PendingImport] = {}
        self._ids = itertools.count()
        self._cancels: list[str] = []
        self._settled: list[Handoff] = []

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.pending

    def __len__(self) -> int:
        return len(self.pending)

    def knows(self, h: Handoff) -> bool:
        """Started or dropped here: in flight, or settled and not yet taken."""
        return h.ticket.request_id in self.pending or any(s is h for s in self._settled)

    def take_settled(self) -> list[Handoff]:
        """The hand-overs settled since the last call: their sources may release their pins."""
        out, self._settled = self._settled, []
        return out

    def drop(self, handoffs: list[Handoff]) -> None:
        """Hand-overs whose requests were aborted before their import started."""
        self._settled += handoffs

    def _settle(self, h: Handoff, computed: int | None) -> None:
        """Adopt the request with `computed` tokens cached (0: recompute its prompt; None: it was
        aborted meanwhile and is not adopted)."""
        if computed is not None:
            self.end.replica.core.adopt(h.ticket.request, num_computed_tokens=computed)
            hop_trace.mark("handover.adopted")
        self._settled.append(h)

    def tick(self, handoffs: list[Handoff]) -> None:
        """Start importing `handoffs`; adopt the requests whose pulls finished (take_settled)."""
        end = self.end
        for h in handoffs:
            p = end.start_import(h, f"{end.replica.name}/{next(self._ids)}")
            if p is None:
                self._settle(h, 0)
            else:
                self.pending[h.ticket.request_id] = p
                self._by_transfer[p.transfer_id] = p
        if not self.pending:
            return
        cancels, self._cancels = self._cancels, []
        for transfer_id in cancels:
            end.replica.executor.call("kv_pull_cancel", [{"transfer_id": transfer_id}] * end.replica.world)
        for rank, done in enumerate(end.replica.executor.take_kv_pulls()):  # pushed by the ranks: no round trip
            for transfer_id, result in done.items():
                p = self._by_transfer.get(transfer_id)
                if p is not None:
                    p.results[rank] = result
        for p in [p for p in self.pending.values() if len(p.results) == end.replica.world]:
            del self.pending[p.handoff.ticket.request_id], self._by_transfer[p.transfer_id]
            computed = end.finish_import(p)
            self._settle(p.handoff, None if p.aborted else computed)

    def abort(self, request_id: str) -> None:
        """The request was aborted: its pulls are cancelled, its blocks freed once they ended."""
        p = self.pending[request_id]
        p.aborted = True
        self._cancels.append(p.transfer_id)

    def close(self) -> list[Handoff]:
        """(Replica stopped or failed; its ranks are stopping) Free every reservation; returns the
        hand-overs whose sources may now release their pins."""
        out = self.take_settled()
        for p in self.pending.values():
            self.end.pins.abort(p.handoff.ticket.request_id)
            out.append(p.handoff)
        self.pending.clear()
        self._by_transfer.clear()
        return out


def release_sources(adoptions: list[Handoff]) -> None:
    """Tell each source replica it may free its pin (pulled, refused or failed alike)."""
    for h in adoptions:
        if h.offer is not None:
            h.source.release(h.offer.pin_id)
