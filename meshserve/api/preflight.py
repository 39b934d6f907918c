"""Checks of the parallel layout against the checkpoint's config.json, before Ray starts.

The ranks refuse a layout that does not fit the model too (workers/models/), but only after
Ray has started and placed them (tens of seconds); the same rule read from config.json here
refuses `--tp 3` on a 32-head model at once, naming the flag and the model's numbers.
"""

from __future__ import annotations

import json
from pathlib import Path

from meshserve.config import ParallelConfig
from meshserve.errors import check

# config.json fields a tensor-parallel layout must divide (each rank holds whole heads and whole
# MLP columns); the first spelling present counts.
_SPLIT_FIELDS = (("num_attention_heads", "n_head", "num_heads"), ("intermediate_size", "ffn_dim", "n_inner"))


def _model_config(model_dir: str) -> dict:
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}  # the loader reports a missing or broken config.json with its own words
    text = config.get("text_config")
    return {**config, **text} if isinstance(text, dict) else config


_EXPERT_FIELDS = ("n_routed_experts", "num_local_experts", "num_experts")


def check_layout_fits_model(model_dir: str, parallel: ParallelConfig,
                            per_pool: dict[str, ParallelConfig | None] | None = None) -> None:
    """Refuse a tp that does not divide the model's attention heads or MLP width, and an ep that does
    not divide its routed experts (ConfigError naming the flag and the model's number)."""
    config = _model_config(model_dir)
    if not config:
        return
    if parallel.ep > 1:
        experts = next((config[f] for f in _EXPERT_FIELDS if isinstance(config.get(f), int)), None)
        check(experts is not None, "ep", parallel.ep, "1 for a model without routed experts (a dense model)")
        check(experts % parallel.ep == 0, "ep", parallel.ep, f"a divisor of the model's routed experts ({experts})")
    layouts = [("tp", parallel)] + [(f"{role}_tp", p) for role, p in (per_pool or {}).items() if p is not None]
    for flag, layout in layouts:
        if layout.tp == 1:
            continue
        for spellings in _SPLIT_FIELDS:
            name = next((s for s in spellings if isinstance(config.get(s), int)), None)
            if name is None:
                continue
            size = config[name]
            divisors = [d for d in range(1, min(size, 64) + 1) if size % d == 0]
            check(size % layout.tp == 0, flag, layout.tp,
                  f"a divisor of the model's {name}={size} (each rank holds whole ones): one of {divisors}")
