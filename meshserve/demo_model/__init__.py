"""The embedded demo checkpoint: a 5.8M-parameter Llama trained on Python's own documentation.

`DEMO_MODEL_DIR` is an ordinary Hugging Face checkpoint folder (config.json,
generation_config.json, model.safetensors in bfloat16, tokenizer.json, tokenizer_config.json),
used when no model is named. It is rebuilt by scripts/train_demo_model.py; docs/demo-model.md
tells how it was trained and what to expect from it.
"""

from pathlib import Path

DEMO_MODEL_DIR: Path = Path(__file__).resolve().parent

__all__ = ["DEMO_MODEL_DIR"]
