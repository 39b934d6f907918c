"""The engine's stats cross to the front-ends' process (cluster/service_wire.py) unchanged,
through msgpack as the channel sends them; a state from an engine older than a field decodes
with that field's default."""

from __future__ import annotations

import msgpack

from meshserve.cluster.handover_stats import HandoverRow, HandoverStats
from meshserve.cluster.service import GrammarCompileRow, ModelCard, ServiceHealth, ServiceStats
from meshserve.cluster.service_wire import decode_state, encode_state

HEALTH = ServiceHealth(True, 2, 2, "", num_rebuilds=1)
STATS = ServiceStats(num_waiting=1, num_running=2, kv_usage=0.5, num_free_kv_blocks=9, prefix_hit_tokens=3,
                     prompt_tokens=40, num_preemptions=0, generated_tokens=17, expert_tokens=[[1, 2], [3, 4]],
                     handovers=[HandoverRow("decode", "decode-0", HandoverStats(handovers=2, kv_bytes=4096))],
                     kv_transport="zmq", num_migrations=1,
                     grammar_compiles=[GrammarCompileRow("prefill", "prefill-0", num_stuck=1, num_written_off=3,
                                                         num_refused=2),
                                       GrammarCompileRow("prefill", "prefill-retired", num_written_off=5)])


def _through_the_wire(state: dict) -> dict:
    return msgpack.unpackb(msgpack.packb(state))


def test_stats_with_grammar_compiles_survive_the_wire():
    models = [ModelCard("m", max_model_len=256, vocab_size=512)]
    health, stats, got_models, failed = decode_state(_through_the_wire(encode_state(HEALTH, STATS, models)))
    assert (health, stats, failed) == (HEALTH, STATS, None)
    assert got_models == models
    assert stats.grammar_compiles[0] == GrammarCompileRow("prefill", "prefill-0", 1, 3, 2)


def test_a_state_from_an_older_engine_has_no_grammar_rows():
    state = _through_the_wire(encode_state(HEALTH, STATS, None))
    del state["stats"]["grammar_compiles"]
    _, stats, _, _ = decode_state(state)
    assert stats.grammar_compiles == [] and stats.expert_tokens == STATS.expert_tokens
