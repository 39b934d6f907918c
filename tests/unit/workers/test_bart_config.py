"""BART's config parsing (models/bart.py): what is read from config.json and
generation_config.json, and what is refused with the field named."""

import json

import pytest

from meshserve.errors import ConfigError
from meshserve.workers.models.bart import is_encoder_decoder_dir, read_bart_arch

BASE = {
    "architectures": ["BartForConditionalGeneration"], "vocab_size": 50, "d_model": 16, "encoder_layers": 1,
    "decoder_layers": 2, "encoder_attention_heads": 2, "decoder_attention_heads": 4, "encoder_ffn_dim": 8,
    "decoder_ffn_dim": 8, "max_position_embeddings": 32, "eos_token_id": 2, "decoder_start_token_id": 2,
    "forced_eos_token_id": 2,
}


def _dir(tmp_path, cfg, gen=None):
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    if gen is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(gen))
    return tmp_path


def test_settings_come_from_config_and_generation_config(tmp_path):
    arch = read_bart_arch(_dir(tmp_path, BASE))
    assert arch.decoder_prompt == [2] and arch.eos_token_ids == (2,) and arch.max_encoder_len == 32
    assert arch.embed_scale == 1.0 and arch.tie_word_embeddings
    arch = read_bart_arch(_dir(tmp_path, {**BASE, "scale_embedding": True},
                               {"forced_bos_token_id": 0, "eos_token_id": [2, 3], "decoder_start_token_id": 1}))
    assert arch.decoder_prompt == [1, 0]  # the start token, then the forced BOS
    assert arch.eos_token_ids == (2, 3) and arch.embed_scale == 4.0
    assert is_encoder_decoder_dir(tmp_path) and not is_encoder_decoder_dir(tmp_path / "missing")


@pytest.mark.parametrize("change, field", [
    ({"d_model": None}, "config.json:d_model"),
    ({"decoder_attention_heads": 3}, "config.json:decoder_attention_heads"),
    ({"activation_function": "swish"}, "config.json:activation_function"),
    ({"decoder_start_token_id": 50}, "config.json:decoder_start_token_id"),
    ({"normalize_before": True}, "config.json:normalize_before"),
    ({"architectures": ["MBartForConditionalGeneration"]}, "config.json:architectures"),
])
def test_bad_configs_are_refused_naming_the_field(tmp_path, change, field):
    cfg = {k: v for k, v in {**BASE, **change}.items() if v is not None}
    with pytest.raises(ConfigError, match=field):
        read_bart_arch(_dir(tmp_path, cfg))
