"""Pooling of packed hidden states into one vector per sequence, configured like sentence-transformers.

A sentence-transformers checkpoint lists its modules in modules.json (Transformer, Pooling,
optionally Normalize) and the pooling modes in <pooling dir>/config.json. Several modes may be
on at once: their vectors are concatenated in sentence-transformers' order (cls, max, mean,
mean_sqrt_len, lasttoken). Without modules.json the default is the CLS vector, unnormalised.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import torch
import torch.nn.functional as F

from meshserve.errors import ConfigError, check


class PoolingMode(StrEnum):
    CLS = "cls"
    MAX = "max"
    MEAN = "mean"
    MEAN_SQRT_LEN = "mean_sqrt_len"
    LAST = "lasttoken"


# sentence-transformers' Pooling config key -> mode, in the order its output concatenates them.
_ST_KEYS = {
    "pooling_mode_cls_token": PoolingMode.CLS,
    "pooling_mode_max_tokens": PoolingMode.MAX,
    "pooling_mode_mean_tokens": PoolingMode.MEAN,
    "pooling_mode_mean_sqrt_len_tokens": PoolingMode.MEAN_SQRT_LEN,
    "pooling_mode_lasttoken": PoolingMode.LAST,
}
_ST_MODULES = ("Transformer", "Pooling", "Normalize")


@dataclass(frozen=True)
class PoolingConfig:
    modes: tuple[PoolingMode, ...] = (PoolingMode.CLS,)
    normalize: bool = False

    def __post_init__(self) -> None:
        check(len(self.modes) >= 1, "pooling modes", self.modes, f"at least one of {[m.value for m in PoolingMode]}")


def read_pooling_config(model_dir: str | Path) -> PoolingConfig:
    """The pooling a sentence-transformers checkpoint declares (CLS, unnormalised, without one)."""
    model_dir = Path(model_dir)
    modules_path = model_dir / "modules.json"
    if not modules_path.is_file():
        return PoolingConfig()
    modules = json.loads(modules_path.read_text())
    modes: tuple[PoolingMode, ...] = (PoolingMode.CLS,)
    normalize = False
    for module in modules:
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        check(kind in _ST_MODULES, "modules.json:type", module.get("type"),
              f"sentence-transformers modules {list(_ST_MODULES)} (others are not supported)")
        if kind == "Pooling":
            cfg = json.loads((model_dir / module.get("path", "") / "config.json").read_text())
            if cfg.get("pooling_mode_weightedmean_tokens"):
                raise ConfigError("pooling_mode_weightedmean_tokens", True, "false (not supported)")
            check(cfg.get("include_prompt", True), "include_prompt", cfg.get("include_prompt"), "true")
            modes = tuple(mode for key, mode in _ST_KEYS.items() if cfg.get(key))
        elif kind == "Normalize":
            normalize = True
    return PoolingConfig(modes=modes, normalize=normalize)


def pool(hidden: torch.Tensor, query_start_loc: list[int], config: PoolingConfig) -> torch.Tensor:
    """hidden [T, H] packed by query_start_loc (S + 1 host ints) -> [S, H * len(modes)] float32."""
    hidden = hidden.float()
    starts = torch.tensor(query_start_loc[:-1], device=hidden.device)
    ends = torch.tensor(query_start_loc[1:], device=hidden.device)
    lengths = (ends - starts).unsqueeze(1).float()  # [S, 1]
    seq = torch.repeat_interleave(torch.arange(len(starts), device=hidden.device), ends - starts)  # [T]
    parts = []
    for mode in config.modes:
        if mode is PoolingMode.CLS:
            parts.append(hidden[starts])
        elif mode is PoolingMode.LAST:
            parts.append(hidden[ends - 1])
        elif mode is PoolingMode.MAX:
            bounds = zip(query_start_loc[:-1], query_start_loc[1:])
            parts.append(torch.stack([hidden[a:b].amax(0) for a, b in bounds]))
        else:
            sums = hidden.new_zeros(len(starts), hidden.shape[1]).index_add_(0, seq, hidden)
            parts.append(sums / (lengths if mode is PoolingMode.MEAN else lengths.sqrt()))
    out = torch.cat(parts, dim=1)
    # sentence-transformers' Normalize: F.normalize (L2, eps 1e-12).
    return F.normalize(out, p=2, dim=1) if config.normalize else out
