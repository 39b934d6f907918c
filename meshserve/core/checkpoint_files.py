"""What an HF checkpoint folder says besides its weights, read without torch: its JSON files,
its tokenizer (tokenizer.json) and its task (generate, or embed for an encoder).

The engine and the front-end processes of `serve` both read these; the front-ends tokenize and
detokenize but never touch a tensor (api/engine_client.py), so these live here, not beside the
weights' reader (workers/checkpoint.py, which needs torch): a front-end process imports no torch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from meshserve.errors import ConfigError

# Encoder-only `architectures[0]` (served by Embed) -> whether positions are offset by
# padding_idx + 1 (RoBERTa style).
ENCODER_ARCHITECTURES: dict[str, bool] = {
    "BertModel": False,
    "RobertaModel": True,
    "XLMRobertaModel": True,
}


def read_json(path: Path, field: str) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(field, str(path), "an existing file (an HF checkpoint directory has one)") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(field, str(path), f"valid JSON ({exc})") from None


def is_encoder_config(cfg: dict[str, Any]) -> bool:
    names = cfg.get("architectures") or []
    return bool(names) and names[0] in ENCODER_ARCHITECTURES


def read_model_task(model_dir: str | Path) -> str:
    """'embed' for an encoder-only checkpoint, 'generate' otherwise (config.json decides)."""
    path = Path(model_dir) / "config.json"
    return "embed" if path.is_file() and is_encoder_config(read_json(path, "model")) else "generate"


def load_tokenizer(model_dir: str | Path):
    """The `tokenizers.Tokenizer` in tokenizer.json, or None when the checkpoint has none."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


def encode_ids(tokenizer, text: str) -> list[int]:
    """The token ids of `text`. encode_batch, unlike encode, releases the GIL while it works, so
    a long text tokenized in a thread does not stop the event loop (measured: a 2 MB text held
    the GIL 1.6 s with encode, at most 43 ms with encode_batch)."""
    return tokenizer.encode_batch([text])[0].ids
