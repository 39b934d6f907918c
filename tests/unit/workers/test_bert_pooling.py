"""Pooling against per-sequence loops, its sentence-transformers config, and a tiny random RoBERTa
(positions offset by padding_idx + 1) against HF's own RobertaModel."""

from __future__ import annotations

import json

import pytest
import torch

from meshserve.attention.backend import AttentionProblem
from meshserve.attention.metadata import AttentionMetadata
from meshserve.attention.registry import select_backend
from meshserve.errors import ConfigError
from meshserve.workers.models.bert import bert_arch_from_config, load_bert
from meshserve.workers.pooling import PoolingConfig, PoolingMode, pool, read_pooling_config


def test_pool_modes_match_loops():
    torch.manual_seed(0)
    lengths = [1, 5, 3]
    hidden = torch.randn(sum(lengths), 4)
    qsl = [0, 1, 6, 9]
    seqs = [hidden[a:b] for a, b in zip(qsl, qsl[1:])]
    want = {
        PoolingMode.CLS: torch.stack([s[0] for s in seqs]),
        PoolingMode.LAST: torch.stack([s[-1] for s in seqs]),
        PoolingMode.MAX: torch.stack([s.max(0).values for s in seqs]),
        PoolingMode.MEAN: torch.stack([s.mean(0) for s in seqs]),
        PoolingMode.MEAN_SQRT_LEN: torch.stack([s.sum(0) / len(s) ** 0.5 for s in seqs]),
    }
    for mode, expected in want.items():
        torch.testing.assert_close(pool(hidden, qsl, PoolingConfig(modes=(mode,))), expected)
    both = pool(hidden, qsl, PoolingConfig(modes=(PoolingMode.CLS, PoolingMode.MEAN), normalize=True))
    cat = torch.cat([want[PoolingMode.CLS], want[PoolingMode.MEAN]], 1)
    torch.testing.assert_close(both, cat / cat.norm(dim=1, keepdim=True))


def test_read_pooling_config(tmp_path):
    assert read_pooling_config(tmp_path) == PoolingConfig()  # no sentence-transformers files: CLS
    (tmp_path / "1_Pooling").mkdir()
    modules = [{"type": "sentence_transformers.models.Transformer", "path": ""},
               {"type": "sentence_transformers.models.Pooling", "path": "1_Pooling"}]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling/config.json").write_text(json.dumps({"pooling_mode_lasttoken": True}))
    assert read_pooling_config(tmp_path) == PoolingConfig(modes=(PoolingMode.LAST,), normalize=False)
    modules.append({"type": "sentence_transformers.models.Dense", "path": "2_Dense"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ConfigError, match="Dense"):
        read_pooling_config(tmp_path)


@pytest.mark.parametrize("kind", ["bert", "roberta"])
def test_tiny_encoder_matches_hf(tmp_path, kind):
    import transformers

    cls = {"bert": transformers.BertModel, "roberta": transformers.RobertaModel}[kind]
    cfg_cls = {"bert": transformers.BertConfig, "roberta": transformers.RobertaConfig}[kind]
    torch.manual_seed(0)
    config = cfg_cls(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=40, initializer_range=0.2, pad_token_id=1)
    hf = cls(config).eval()
    hf.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    arch = bert_arch_from_config(cfg)
    assert arch.max_tokens == (40 - 2 if kind == "roberta" else 40)
    model = load_bert(tmp_path, arch, dtype=torch.float32, device=torch.device("cpu"))
    lengths = [arch.max_tokens, 3, 11]
    seqs = [torch.randint(3, 99, (n,)) for n in lengths]
    spec = model.attention_spec()
    problem = AttentionProblem(spec=spec, block_size=arch.max_tokens, max_model_len=arch.max_tokens)
    backend = select_backend(problem, "TORCH")(problem)
    meta = AttentionMetadata.build(query_lens=lengths, seq_lens=lengths, block_tables=[[0]] * 3,
                                   block_size=arch.max_tokens, write_kv=False)
    ids = torch.cat(seqs)
    positions = torch.cat([torch.arange(n) for n in lengths])
    with torch.no_grad():
        got = model(ids, positions, torch.zeros_like(ids), backend, backend.plan(meta))
        for s, (a, b) in zip(seqs, zip(meta.query_start_loc[:-1].tolist(), meta.query_start_loc[1:].tolist())):
            want = hf(input_ids=s[None]).last_hidden_state[0]
            torch.testing.assert_close(got[a:b], want, atol=2e-5, rtol=1e-5)
