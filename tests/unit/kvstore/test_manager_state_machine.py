"""Property test: random scheduler traffic against BlockPool + KVCacheManager, with one layer
group, with two (a windowed one and a full one) and with three (two windows and a full one) over
one pool.

An independent model simulates what the cache *holds*: every allocation "computes" the new
tokens and writes, into the slot the block table names, a key that identifies the token and
its whole prefix (and extra keys). After every operation:
  - every position a request can still attend to reads, through its block table, exactly the key
    of its own prefix (catches wrong prefix hits, sharing without copy-on-write, released
    blocks that were still needed, blocks handed to two requests);
  - the positions that are not needed (brute force from the masking rule) hold the null block;
  - a block is free xor referenced; reference counts equal the table entries and are never
    negative; free + used = total; two requests share a block only if it is hashed or they
    are forks of one request;
  - a failed allocate_slots changed nothing (in any group).
With several groups every group's table is checked against its own retention; block ids are unique
across groups, so one model of the cache contents (tagged by group) serves them all.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
    run_state_machine_as_test,
)

from meshserve.kvstore.block_pool import NULL_BLOCK
from meshserve.kvstore.manager import KVCacheManager
from meshserve.kvstore.retention import RetentionPolicy

OPS = {"count": 0}
PREFIXES = [[7, 7, 7, 7, 7, 7, 7, 7, 1, 2, 3, 4], [7, 7, 7, 7, 5, 5, 5, 5], [1, 2, 3, 4, 5, 6, 7, 8, 9]]


def visible(q: int, k: int, window: int | None, sinks: int) -> bool:
    """The masking rule of AttentionSpec, written out."""
    return k <= q and (window is None or q - k < window or k < sinks)


class ReqModel:
    def __init__(self, tokens: list[int], extra: tuple, family: int) -> None:
        self.tokens = tokens
        self.extra = extra
        self.family = family
        self.keys: list[int] = []
        self.release_base = 0  # first query position of the last allocation
        self._extend_keys()

    def _extend_keys(self) -> None:
        while len(self.keys) < len(self.tokens):
            prev = self.keys[-1] if self.keys else hash(("root", self.extra))
            self.keys.append(hash((prev, self.tokens[len(self.keys)])))

    def append(self, new: list[int]) -> None:
        self.tokens = self.tokens + new
        self._extend_keys()


class KVMachine(RuleBasedStateMachine):
    live = Bundle("live")

    @initialize(
        num_blocks=st.integers(6, 40),
        block_size=st.sampled_from([1, 2, 4]),
        dcp=st.sampled_from([1, 1, 2]),
        retention=st.sampled_from([(None, 0), (None, 0), (6, 0), (9, 3), (4, 1)]),
        caching=st.sampled_from([True, True, False]),
        hybrid=st.sampled_from([0, 0, 0, 0, 1, 1, 2]),
    )
    def setup(self, num_blocks, block_size, dcp, retention, caching, hybrid):
        if hybrid and retention[0] is not None:  # the windowed group and a full-attention one
            self.retentions = [retention, (None, 0)]
            if hybrid == 2:  # and a wider window: two groups release at different times
                self.retentions.append((retention[0] + 5, retention[1]))
        else:
            self.retentions = [retention]
        self.kv = KVCacheManager(
            num_blocks, block_size, dcp_size=dcp, enable_prefix_caching=caching,
            retentions=[RetentionPolicy(sliding_window=w, num_sink_tokens=s) for w, s in self.retentions],
        )
        self.tpb = block_size * dcp
        self.reqs: dict[int, ReqModel] = {}
        self.content: dict[int, list[int | None]] = {}
        self.next_id = 0

    # ---- helpers ------------------------------------------------------------------------
    def _snapshot(self):
        kv = self.kv
        return (
            list(kv.pool.ref_counts),
            kv.num_free_blocks,
            {r: [list(t) for t in kv.block_tables(r)] for r in kv.request_ids()},
            {r: kv.num_tokens(r) for r in kv.request_ids()},
        )

    def _write(self, rid: int, start: int, end: int) -> None:
        """The step computes positions [start, end): copy-on-write first, then write KV."""
        for src, dst in self.kv.take_copies():
            self.content[dst] = list(self.content[src])
        model = self.reqs[rid]
        for group, table in enumerate(self.kv.block_tables(rid)):  # a group's layers hold their own K/V
            for p in range(start, end):
                block = table[p // self.tpb]
                assert block != NULL_BLOCK, f"position {p} of request {rid} maps to the null block"
                self.content.setdefault(block, [None] * self.tpb)[p % self.tpb] = (group, model.keys[p])

    def _allocate(self, rid: int, num_new: int, prefix=None) -> bool:
        OPS["count"] += 1
        kv, model = self.kv, self.reqs[rid]
        start = kv.num_tokens(rid) if rid in kv else (prefix.num_tokens if prefix else 0)
        expected = kv.can_allocate(rid, num_new, prefix=prefix)
        before = self._snapshot()
        ok = kv.allocate_slots(
            rid,
            num_new,
            model.tokens[: start + num_new],
            prefix=prefix,
            extra_keys=() if prefix else model.extra,
        )
        assert ok == expected, "can_allocate disagreed with allocate_slots"
        if not ok:
            assert self._snapshot() == before, "a failed allocate_slots left state behind"
            return False
        model.release_base = start
        self._write(rid, start, start + num_new)
        return True

    # ---- rules --------------------------------------------------------------------------
    @rule(
        target=live,
        prefix=st.sampled_from(PREFIXES),
        cut=st.integers(0, 12),
        suffix=st.lists(st.integers(0, 9), max_size=10),
        extra=st.sampled_from([(), (), ("lora-a",)]),
        chunk=st.integers(1, 24),
    )
    def admit(self, prefix, cut, suffix, extra, chunk):
        tokens = prefix[:cut] + suffix
        if not tokens:
            return multiple()
        rid = self.next_id
        self.next_id += 1
        self.reqs[rid] = ReqModel(tokens, extra, family=rid)
        hit = self.kv.lookup_prefix(tokens, extra_keys=extra)
        assert hit.num_tokens % self.tpb == 0 and hit.num_tokens <= len(tokens) - 1
        num_new = min(chunk, len(tokens) - hit.num_tokens)
        if not self._allocate(rid, num_new, prefix=hit):
            del self.reqs[rid]
            return multiple()
        return rid

    @rule(rid=live, new=st.lists(st.integers(0, 9), min_size=1, max_size=6))
    def append(self, rid, new):
        model = self.reqs[rid]
        have = self.kv.num_tokens(rid)
        if have == len(model.tokens):  # prompt done: decode (or a speculative burst)
            model.append(new)
        self._allocate(rid, min(len(new), len(model.tokens) - have))

    @rule(rids=st.lists(live, unique=True, min_size=1, max_size=6), token=st.integers(0, 9))
    def decode_batch(self, rids, token):
        """One decode step for several requests, as the scheduler runs it: allocate_slots in order,
        stopping at the first that cannot get its slot."""
        OPS["count"] += len(rids)
        kv = self.kv
        starts = [kv.num_tokens(r) for r in rids]
        for rid, start in zip(rids, starts):
            if start == len(self.reqs[rid].tokens):
                self.reqs[rid].append([token])
        before = self._snapshot()
        done = 0
        for rid, start in zip(rids, starts):
            if not kv.allocate_slots(rid, 1, self.reqs[rid].tokens[: start + 1]):
                break
            done += 1
        for rid, start in zip(rids[:done], starts):
            self.reqs[rid].release_base = start
            self._write(rid, start, start + 1)
        if done < len(rids):
            after = self._snapshot()
            for rid in rids[done:]:  # the one that failed, and those after it, are untouched
                assert after[2][rid] == before[2][rid] and after[3][rid] == before[3][rid]
            assert not kv.can_allocate(rids[done], 1)

    @rule(target=live, parent=live)
    def fork(self, parent):
        OPS["count"] += 1
        rid = self.next_id
        self.next_id += 1
        p = self.reqs[parent]
        child = ReqModel(list(p.tokens[: self.kv.num_tokens(parent)]), p.extra, p.family)
        child.release_base = p.release_base
        self.reqs[rid] = child
        self.kv.fork(parent, rid)
        return rid

    @rule(rid=consumes(live))
    def finish(self, rid):
        OPS["count"] += 1
        assert self.kv.free(rid)
        del self.reqs[rid]

    @rule(target=live, rid=consumes(live), chunk=st.integers(1, 32))
    def preempt_and_resume(self, rid, chunk):
        """Preempted requests come back later through the prefix cache."""
        OPS["count"] += 1
        model = self.reqs[rid]
        tokens = model.tokens[: self.kv.num_tokens(rid)]
        self.kv.free(rid)
        del self.reqs[rid]
        new_id = self.next_id
        self.next_id += 1
        self.reqs[new_id] = ReqModel(tokens, model.extra, family=new_id)
        hit = self.kv.lookup_prefix(tokens, extra_keys=model.extra)
        if not self._allocate(new_id, min(chunk, len(tokens) - hit.num_tokens), prefix=hit):
            del self.reqs[new_id]
            return multiple()
        return new_id

    @precondition(lambda self: self.kv.pool.num_cached_blocks > 0)
    @rule(n=st.integers(1, 8))
    def evict(self, n):
        """Pressure from outside: take free blocks (evicting cached prefixes), give them back."""
        OPS["count"] += 1
        n = min(n, self.kv.num_free_blocks)
        blocks = self.kv.pool.allocate(n)
        self.kv.pool.free(blocks)
        for b in blocks:
            self.content.pop(b, None)

    # ---- invariants ---------------------------------------------------------------------
    @invariant()
    def reads_see_their_own_prefix(self):
        for rid, model in self.reqs.items():
            for group, (table, (window, sinks)) in enumerate(
                zip(self.kv.block_tables(rid), self.retentions, strict=True)
            ):
                self._check_table(rid, model, group, table, window, sinks)

    def _check_table(self, rid, model, group, table, window, sinks):
        tpb = self.tpb
        n = self.kv.num_tokens(rid)
        assert len(table) == -(-n // tpb)
        base = model.release_base
        horizon = len(table) * tpb + 1
        for idx, block in enumerate(table):
            needed = any(
                visible(q, k, window, sinks)
                for k in range(idx * tpb, (idx + 1) * tpb)
                for q in range(base, max(base, k) + 1 if k < horizon else base + 1)
            )
            assert (block != NULL_BLOCK) == needed, (rid, idx, block, needed, table, base)
            if block == NULL_BLOCK:
                continue
            stored = self.content.get(block)
            for p in range(idx * tpb, min(n, (idx + 1) * tpb)):
                assert stored is not None and stored[p % tpb] == (group, model.keys[p]), (
                    f"request {rid} position {p} reads block {block} holding another prefix"
                )

    @invariant()
    def accounting(self):
        kv = self.kv
        refs = kv.pool.ref_counts
        assert min(refs) >= 0
        holders: dict[int, list[int]] = {}
        for rid in kv.request_ids():
            for table in kv.block_tables(rid):
                for block in table:
                    if block != NULL_BLOCK:
                        holders.setdefault(block, []).append(rid)
        for block in range(1, kv.pool.num_blocks):
            assert refs[block] == len(holders.get(block, [])), f"block {block}"
        assert kv.num_free_blocks + len(holders) == kv.num_total_blocks  # free + used = total
        for block, rids in holders.items():
            families = {self.reqs[r].family for r in rids}
            assert len(families) == 1 or kv.pool.block_hash(block) is not None, (
                f"block {block} reachable from unrelated requests {rids} without a hash"
            )
        kv.check_invariants()
        assert kv.capacity_tokens == kv.num_total_blocks // len(self.retentions) * self.tpb


def test_random_operations_keep_the_invariants():
    OPS["count"] = 0
    run_state_machine_as_test(
        KVMachine,
        settings=settings(
            max_examples=220,
            stateful_step_count=60,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            derandomize=True,
            database=None,
        ),
    )
    assert OPS["count"] >= 10_000, f"only {OPS['count']} operations ran"
