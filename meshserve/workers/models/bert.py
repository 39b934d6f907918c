"""BERT-family encoders (BertModel, RobertaModel, XLMRobertaModel) for embedding models.

Post-layer-norm blocks over a packed batch: activations are [T, hidden] for the T tokens of
every sequence, with no padding. Self-attention is non-causal and keeps no KV cache
(AttentionType.ENCODER_ONLY): each layer hands the backend its fresh q, k and v, packed like
the queries by `query_start_loc`. Parameter names follow HF's BertModel, except that
query/key/value are fused into one `qkv` matrix (the loader here stacks them).

RoBERTa and XLM-R differ only by data: positions start at padding_idx + 1, so the usable
length is max_position_embeddings - padding_idx - 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from meshserve.attention.backend import AttentionBackend
from meshserve.attention.spec import AttentionSpec, AttentionType
from meshserve.core.checkpoint_files import ENCODER_ARCHITECTURES
from meshserve.errors import ConfigError, check
from meshserve.workers.checkpoint import Checkpoint

# Prefixes of checkpoints saved from a task head around the encoder (e.g. BertForMaskedLM).
_PREFIXES = ("bert.", "roberta.", "model.")
_ACT = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


@dataclass(frozen=True)
class BertArch:
    """One encoder checkpoint's shape, read from config.json."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str
    position_offset: int  # index of the first position embedding used (RoBERTa: padding_idx + 1)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "max_position_embeddings", "type_vocab_size"):
            value = getattr(self, name)
            check(isinstance(value, int) and value >= 1, f"config.json:{name}", value, "an integer >= 1")
        check(self.hidden_size % self.num_heads == 0, "config.json:num_attention_heads", self.num_heads,
              f"a divisor of hidden_size={self.hidden_size}")
        check(self.hidden_act in _ACT, "config.json:hidden_act", self.hidden_act, f"one of {sorted(_ACT)}")
        check(0 <= self.position_offset < self.max_position_embeddings, "config.json:pad_token_id",
              self.position_offset - 1, f"below max_position_embeddings={self.max_position_embeddings}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def max_tokens(self) -> int:
        """The longest input (special tokens included) the position table can encode."""
        return self.max_position_embeddings - self.position_offset


def bert_arch_from_config(cfg: dict[str, Any]) -> BertArch:
    names = cfg.get("architectures") or []
    name = names[0] if names else None
    check(name in ENCODER_ARCHITECTURES, "config.json:architectures", name, f"one of {sorted(ENCODER_ARCHITECTURES)}")

    def need(key: str) -> Any:
        if key not in cfg:
            raise ConfigError(f"config.json:{key}", None, f"required for {name}")
        return cfg[key]

    kind = cfg.get("position_embedding_type", "absolute")
    check(kind == "absolute", "config.json:position_embedding_type", kind, "'absolute'")
    offset = int(cfg.get("pad_token_id", 1)) + 1 if ENCODER_ARCHITECTURES[name] else 0
    return BertArch(
        architecture=name, vocab_size=need("vocab_size"), hidden_size=need("hidden_size"),
        intermediate_size=need("intermediate_size"), num_layers=need("num_hidden_layers"),
        num_heads=need("num_attention_heads"), max_position_embeddings=need("max_position_embeddings"),
        type_vocab_size=cfg.get("type_vocab_size", 2), layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-12)),
        hidden_act=cfg.get("hidden_act", "gelu"), position_offset=offset,
    )  # fmt: skip


class Embeddings(nn.Module):
    def __init__(self, arch: BertArch) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.position_embeddings = nn.Embedding(arch.max_position_embeddings, arch.hidden_size)
        self.token_type_embeddings = nn.Embedding(arch.type_vocab_size, arch.hidden_size)
        self.LayerNorm = nn.LayerNorm(arch.hidden_size, eps=arch.layer_norm_eps)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, type_ids: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(ids) + self.token_type_embeddings(type_ids) + self.position_embeddings(positions)
        return self.LayerNorm(x)


class EncoderLayer(nn.Module):
    """HF's `encoder.layer.N`: attention -> add & norm -> GELU MLP -> add & norm (post-norm)."""

    def __init__(self, arch: BertArch) -> None:
        super().__init__()
        h = arch.hidden_size
        self.num_heads, self.head_dim = arch.num_heads, arch.head_dim
        self.qkv = nn.Linear(h, 3 * h)
        self.attn_out = nn.Linear(h, h)
        self.attn_norm = nn.LayerNorm(h, eps=arch.layer_norm_eps)
        self.intermediate = nn.Linear(h, arch.intermediate_size)
        self.out = nn.Linear(arch.intermediate_size, h)
        self.out_norm = nn.LayerNorm(h, eps=arch.layer_norm_eps)
        self.act = _ACT[arch.hidden_act]

    def forward(self, x: torch.Tensor, backend: AttentionBackend, plan: object) -> torch.Tensor:
        T, H, D = x.shape[0], self.num_heads, self.head_dim
        q, k, v = self.qkv(x).view(T, 3, H, D).unbind(1)  # [T, H, D] each
        o = backend.forward(q, k, v, None, plan)  # [T, H, D]; no cache to write
        x = self.attn_norm(x + self.attn_out(o.reshape(T, H * D)))
        return self.out_norm(x + self.out(self.act(self.intermediate(x))))


# HF name (after the layer prefix) -> (our name, part of the fused qkv or None).
_LAYER_NAMES = {
    "attention.self.query": ("qkv", 0),
    "attention.self.key": ("qkv", 1),
    "attention.self.value": ("qkv", 2),
    "attention.output.dense": ("attn_out", None),
    "attention.output.LayerNorm": ("attn_norm", None),
    "intermediate.dense": ("intermediate", None),
    "output.dense": ("out", None),
    "output.LayerNorm": ("out_norm", None),
}


class BertEncoder(nn.Module):
    """Token ids of a packed batch -> last hidden states [T, hidden] (no pooler: pooling.py pools)."""

    def __init__(self, arch: BertArch) -> None:
        super().__init__()
        self.arch = arch
        self.embeddings = Embeddings(arch)
        self.layers = nn.ModuleList(EncoderLayer(arch) for _ in range(arch.num_layers))

    def attention_spec(self) -> AttentionSpec:
        a = self.arch
        return AttentionSpec(num_heads=a.num_heads, num_kv_heads=a.num_heads, head_size=a.head_dim,
                             attn_type=AttentionType.ENCODER_ONLY)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, type_ids: torch.Tensor,
                backend: AttentionBackend, plan: object) -> torch.Tensor:
        """ids, positions (0-based within each sequence), type_ids: [T] int64 -> [T, hidden]."""
        x = self.embeddings(ids, positions + self.arch.position_offset, type_ids)
        for layer in self.layers:
            x = layer(x, backend, plan)
        return x


def _target(name: str) -> tuple[str, int | None] | None:
    """Checkpoint tensor name -> (parameter name, qkv part), or None for tensors we do not use."""
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix):]
            break
    if name.startswith("embeddings."):
        return (None if name.endswith("position_ids") else (name, None))
    parts = name.split(".")
    if parts[:2] != ["encoder", "layer"] or len(parts) < 5:
        return None  # pooler, task heads: not part of the encoder
    module, kind = ".".join(parts[3:-1]), parts[-1]
    if module not in _LAYER_NAMES:
        return None
    ours, part = _LAYER_NAMES[module]
    return f"layers.{parts[2]}.{ours}.{kind}", part


def load_bert(model_dir: str | Path, arch: BertArch, *, dtype: torch.dtype, device: torch.device) -> BertEncoder:
    """Build the encoder on `device` and fill every parameter from the checkpoint's safetensors."""
    from meshserve.workers.loader import WeightError

    with torch.device("meta"):
        model = BertEncoder(arch)
    model = model.to(dtype).to_empty(device=device)
    params = dict(model.named_parameters())
    filled: set[tuple[str, int | None]] = set()
    with torch.no_grad(), Checkpoint(model_dir) as ckpt:
        for name in ckpt.names():
            target = _target(name)
            if target is None:
                continue
            pname, part = target
            if pname not in params:
                raise WeightError(f"checkpoint tensor '{name}' has no place in the {arch.architecture} encoder")
            dest = params[pname].data
            if part is not None:
                rows = dest.shape[0] // 3
                dest = dest.narrow(0, part * rows, rows)
            tensor = ckpt.read(name)
            if tuple(tensor.shape) != tuple(dest.shape):
                raise WeightError(f"checkpoint tensor '{name}' has shape {tuple(tensor.shape)} but the model "
                                  f"expects {tuple(dest.shape)} for '{pname}'")
            dest.copy_(tensor)
            filled.add(target)
    needed = {(p, i) for p in params for i in ((0, 1, 2) if ".qkv." in p else (None,))}
    missing = sorted(f"{p}[{i}]" if i is not None else p for p, i in needed - filled)
    if missing:
        raise WeightError(f"checkpoint {model_dir} lacks tensor(s) for {missing[:5]} needed by {arch.architecture}")
    return model.eval()

