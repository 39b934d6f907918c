"""BART (BartForConditionalGeneration): an encoder-decoder model over the paged KV cache.

Plain torch over packed tokens ([T, hidden], no padding), post-layer-norm blocks as HF's BART:
learned positions offset by 2, `layernorm_embedding` after the embeddings, GELU MLPs, the LM
head tied to the shared embedding plus `final_logits_bias`.

Attention goes through the backends it is handed (nothing here knows which):
- encoder self-attention: non-causal, no cache (AttentionType.ENCODER_ONLY), run once per
  request, in the step that computes the request's first decoder token (`ForwardContext.encoder`);
- decoder self-attention: causal over the paged cache (DECODER), like any decoder layer;
- cross-attention: decoder queries over the encoder output's K/V (CROSS). Each decoder layer's
  encoder K/V are projected once, in that same step, and written into the layer's cache through
  the encoder block table (their own KV layer group: kvstore/groups.py); later steps only read them.
Attention layers are numbered as the worker allocates their caches: the decoder's self-attention
layers 0..N-1, then its cross-attention layers N..2N-1 (`attention_specs`).

Parameter names are HF's (q/k/v stay separate matrices), so the loader copies tensors by name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from meshserve.attention.spec import AttentionSpec, AttentionType
from meshserve.core.checkpoint_files import read_json
from meshserve.errors import ConfigError, check
from meshserve.workers.checkpoint import Checkpoint
from meshserve.workers.models.transformer import EncoderStep, ForwardContext, LayerAttention

ENCODER_DECODER_ARCHITECTURES = ("BartForConditionalGeneration",)
POSITION_OFFSET = 2  # HF's BartLearnedPositionalEmbedding: ids 0, 1 of the table are never used
_HF_KEYS = {"encoder_heads": "encoder_attention_heads", "decoder_heads": "decoder_attention_heads"}
_ACT = {"gelu": F.gelu, "relu": F.relu, "gelu_new": lambda x: F.gelu(x, approximate="tanh")}


@dataclass(frozen=True)
class BartArch:
    """One BART checkpoint's shape and generation settings (config.json, generation_config.json)."""

    vocab_size: int
    d_model: int
    encoder_layers: int
    decoder_layers: int
    encoder_heads: int
    decoder_heads: int
    encoder_ffn_dim: int
    decoder_ffn_dim: int
    max_position_embeddings: int
    activation: str
    scale_embedding: bool
    tie_word_embeddings: bool
    decoder_start_token_id: int
    forced_bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str = "float32"  # the checkpoint's (what dtype="auto" takes on GPU)
    architecture: str = "BartForConditionalGeneration"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "encoder_layers", "decoder_layers", "encoder_heads", "decoder_heads",
                     "encoder_ffn_dim", "decoder_ffn_dim", "max_position_embeddings"):
            value = getattr(self, name)
            check(isinstance(value, int) and value >= 1, f"config.json:{_HF_KEYS.get(name, name)}", value,
                  "an integer >= 1")
        for name in ("encoder_heads", "decoder_heads"):
            check(self.d_model % getattr(self, name) == 0, f"config.json:{_HF_KEYS[name]}", getattr(self, name),
                  f"a divisor of d_model={self.d_model}")
        check(self.activation in _ACT, "config.json:activation_function", self.activation, f"one of {sorted(_ACT)}")
        check(0 <= self.decoder_start_token_id < self.vocab_size, "config.json:decoder_start_token_id",
              self.decoder_start_token_id, f"a token id in [0, {self.vocab_size})")

    # What the worker and the admission checks read, named as for decoder-only models.
    @property
    def max_encoder_len(self) -> int:
        return self.max_position_embeddings

    @property
    def decoder_prompt(self) -> list[int]:
        """The decoder's first tokens: the start token, then the forced BOS (as HF's generate forces it)."""
        forced = [] if self.forced_bos_token_id is None else [self.forced_bos_token_id]
        return [self.decoder_start_token_id, *forced]

    @property
    def embed_scale(self) -> float:
        return math.sqrt(self.d_model) if self.scale_embedding else 1.0


def is_encoder_decoder_config(cfg: dict[str, Any]) -> bool:
    names = cfg.get("architectures") or []
    return bool(names) and names[0] in ENCODER_DECODER_ARCHITECTURES


def is_encoder_decoder_dir(model_dir: str | Path) -> bool:
    """Whether the checkpoint in `model_dir` is one this module serves (config.json decides)."""
    path = Path(model_dir) / "config.json"
    return path.is_file() and is_encoder_decoder_config(read_json(path, "model"))


def read_bart_arch(model_dir: str | Path) -> BartArch:
    """Parse config.json (and generation_config.json, which wins for generation settings)."""
    model_dir = Path(model_dir)
    cfg = read_json(model_dir / "config.json", "model")
    check(is_encoder_decoder_config(cfg), "config.json:architectures", cfg.get("architectures"),
          f"one of {list(ENCODER_DECODER_ARCHITECTURES)}")
    gen_path = model_dir / "generation_config.json"
    gen = read_json(gen_path, "model") if gen_path.is_file() else {}
    if cfg.get("normalize_before") or cfg.get("add_final_layer_norm"):  # mBART's pre-norm variant
        raise ConfigError("config.json:normalize_before", True, "False (BART's post-norm blocks; mBART is not served)")

    def need(key: str) -> Any:
        if key not in cfg:
            raise ConfigError(f"config.json:{key}", None, "required for BartForConditionalGeneration")
        return cfg[key]

    def setting(key: str, default: Any) -> Any:
        return gen[key] if key in gen else cfg.get(key, default)

    eos = setting("eos_token_id", 2)
    eos = [] if eos is None else eos if isinstance(eos, list) else [eos]
    start = setting("decoder_start_token_id", None)
    return BartArch(
        vocab_size=need("vocab_size"), d_model=need("d_model"), encoder_layers=need("encoder_layers"),
        decoder_layers=need("decoder_layers"), encoder_heads=need("encoder_attention_heads"),
        decoder_heads=need("decoder_attention_heads"), encoder_ffn_dim=need("encoder_ffn_dim"),
        decoder_ffn_dim=need("decoder_ffn_dim"), max_position_embeddings=need("max_position_embeddings"),
        activation=cfg.get("activation_function", "gelu"), scale_embedding=bool(cfg.get("scale_embedding", False)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        decoder_start_token_id=int(start if start is not None else eos[0] if eos else 2),
        forced_bos_token_id=setting("forced_bos_token_id", None), eos_token_ids=tuple(int(e) for e in eos),
        torch_dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
    )  # fmt: skip


class Attention(nn.Module):
    """HF's BartAttention: separate q/k/v/out projections with biases; scale 1/sqrt(head_dim)."""

    def __init__(self, d_model: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, d_model // num_heads
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model)
        self.v_proj = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)

    def heads(self, x: torch.Tensor, proj: nn.Linear) -> torch.Tensor:
        return proj(x).view(x.shape[0], self.num_heads, self.head_dim)  # [T, H, D]

    def attend(self, x: torch.Tensor, backend, plan, kv_cache=None, slot_mapping=None, *,
               with_kv: bool = True) -> torch.Tensor:
        """Self-attention (with_kv: this x's K/V, written when a cache is given) or cross-attention
        (with_kv False: the K/V are already in kv_cache)."""
        q = self.heads(x, self.q_proj)
        k = v = None
        if with_kv:
            k, v = self.heads(x, self.k_proj), self.heads(x, self.v_proj)
            if kv_cache is not None:
                backend.write_kv(k, v, kv_cache, slot_mapping)
        o = backend.forward(q, k, v, kv_cache, plan)  # [T, H, D]
        return self.out_proj(o.reshape(x.shape[0], -1))

    def write_cross_kv(self, enc: torch.Tensor, backend, kv_cache, slot_mapping: torch.Tensor) -> None:
        """Project the encoder output to this cross-attention layer's K/V and store them."""
        backend.write_kv(self.heads(enc, self.k_proj), self.heads(enc, self.v_proj), kv_cache, slot_mapping)


class Block(nn.Module):
    """One post-norm layer: self-attention, (decoder) cross-attention, MLP; HF's names."""

    def __init__(self, d_model: int, heads: int, ffn: int, act: str, *, cross: bool) -> None:
        super().__init__()
        self.self_attn = Attention(d_model, heads)
        self.self_attn_layer_norm = nn.LayerNorm(d_model)
        if cross:
            self.encoder_attn = Attention(d_model, heads)
            self.encoder_attn_layer_norm = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, ffn)
        self.fc2 = nn.Linear(ffn, d_model)
        self.final_layer_norm = nn.LayerNorm(d_model)
        self.act = _ACT[act]

    def forward(self, x: torch.Tensor, own: LayerAttention, cross: LayerAttention | None = None) -> torch.Tensor:
        """own: this layer's self-attention (an encoder layer's has no cache); cross: a decoder
        layer's cross-attention, over the K/V already in its cache."""
        x = self.self_attn_layer_norm(x + self.self_attn.attend(x, own.backend, own.plan, own.kv_cache,
                                                                own.slot_mapping))
        if cross is not None:
            o = self.encoder_attn.attend(x, cross.backend, cross.plan, cross.kv_cache, with_kv=False)
            x = self.encoder_attn_layer_norm(x + o)
        return self.final_layer_norm(x + self.fc2(self.act(self.fc1(x))))


class Stack(nn.Module):
    """HF's `model.encoder` / `model.decoder`: positions, embedding norm, layers."""

    def __init__(self, arch: BartArch, *, decoder: bool) -> None:
        super().__init__()
        a = arch
        heads, ffn, n = ((a.decoder_heads, a.decoder_ffn_dim, a.decoder_layers) if decoder
                         else (a.encoder_heads, a.encoder_ffn_dim, a.encoder_layers))
        self.embed_positions = nn.Embedding(a.max_position_embeddings + POSITION_OFFSET, a.d_model)
        self.layernorm_embedding = nn.LayerNorm(a.d_model)
        self.layers = nn.ModuleList(Block(a.d_model, heads, ffn, a.activation, cross=decoder) for _ in range(n))

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.layernorm_embedding(tokens + self.embed_positions(positions + POSITION_OFFSET))


class BartBody(nn.Module):
    def __init__(self, arch: BartArch) -> None:
        super().__init__()
        self.shared = nn.Embedding(arch.vocab_size, arch.d_model)
        self.encoder = Stack(arch, decoder=False)
        self.decoder = Stack(arch, decoder=True)


class BartForConditionalGeneration(nn.Module):
    """A contract.GenerativeModel over packed decoder tokens whose `encoder_spec` gives the
    encoder its own backend."""

    STACKED: dict[str, tuple[str, int]] = {}  # load_bart fills every parameter by its HF name
    is_encoder_decoder = True
    cuda_graph_safe = False  # the graph buffers carry no encoder tables yet (docs/engine.md)

    def __init__(self, arch: BartArch) -> None:
        super().__init__()
        self.arch = arch
        self.model = BartBody(arch)
        self.lm_head = nn.Linear(arch.d_model, arch.vocab_size, bias=False)
        self.register_buffer("final_logits_bias", torch.zeros(1, arch.vocab_size))
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.model.shared.weight

    def attention_specs(self) -> list[AttentionSpec]:
        """The cached attention layers: decoder self-attention 0..N-1, then cross-attention N..2N-1."""
        a = self.arch
        spec = dict(num_heads=a.decoder_heads, num_kv_heads=a.decoder_heads, head_size=a.d_model // a.decoder_heads)
        n = a.decoder_layers
        return [AttentionSpec(**spec)] * n + [AttentionSpec(**spec, attn_type=AttentionType.CROSS)] * n

    def encoder_spec(self) -> AttentionSpec:
        a = self.arch
        return AttentionSpec(num_heads=a.encoder_heads, num_kv_heads=a.encoder_heads,
                             head_size=a.d_model // a.encoder_heads, attn_type=AttentionType.ENCODER_ONLY)

    def expert_layers(self) -> list:
        return []  # dense

    def finish_loading(self, device: torch.device | str) -> None:
        pass  # load_bart fills every tensor, derived ones included

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.model.shared(ids)
        return x * self.arch.embed_scale if self.arch.scale_embedding else x

    def encode(self, step: EncoderStep) -> torch.Tensor:
        """Packed encoder inputs -> encoder output [Te, d_model]."""
        enc = self.model.encoder
        x = enc.embed(self._embed(step.input_ids), step.positions)
        own = LayerAttention(step.backend, step.plan, kv_cache=None, slot_mapping=None)  # no cache
        for layer in enc.layers:
            x = layer(x, own)
        return x

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_ids, positions: [T] int64 decoder tokens. When ctx.encoder is set, runs the encoder
        first and writes every layer's cross K/V. Returns the last decoder hidden states [T, d_model]."""
        dec = self.model.decoder
        n = len(dec.layers)
        if ctx.encoder is not None and ctx.encoder.input_ids.numel():
            enc = self.encode(ctx.encoder)
            for i, layer in enumerate(dec.layers):
                cross = ctx.layers[n + i]
                layer.encoder_attn.write_cross_kv(enc, cross.backend, cross.kv_cache, ctx.encoder.slot_mapping)
        x = dec.embed(self._embed(input_ids), positions)
        for i, layer in enumerate(dec.layers):
            x = layer(x, ctx.layers[i], ctx.layers[n + i])
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, d_model] -> logits [N, vocab] float32."""
        return (self.lm_head(hidden) + self.final_logits_bias).float()


def load_bart(model_dir: str | Path, arch: BartArch, *, dtype: torch.dtype,
              device: torch.device) -> BartForConditionalGeneration:
    """Build on the meta device, materialise on `device`, fill every parameter by HF name."""
    from meshserve.workers.loader import WeightError

    with torch.device("meta"):
        model = BartForConditionalGeneration(arch)
    model = model.to(dtype).to_empty(device=device)
    if arch.tie_word_embeddings:
        model.lm_head.weight = model.model.shared.weight  # to_empty unties shared meta parameters
    targets = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    tied = {"model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight"}
    if arch.tie_word_embeddings:
        tied.add("lm_head.weight")
    filled: set[str] = set()
    with torch.no_grad(), Checkpoint(model_dir) as ckpt:
        for name in ckpt.names():
            if name in tied:
                continue  # the same tensor as model.shared.weight
            if name not in targets:
                raise WeightError(f"checkpoint tensor '{name}' has no place in {arch.architecture}")
            tensor, dest = ckpt.read(name), targets[name]
            if tuple(tensor.shape) != tuple(dest.shape):
                raise WeightError(f"checkpoint tensor '{name}' has shape {tuple(tensor.shape)} but the model "
                                  f"expects {tuple(dest.shape)}")
            dest.copy_(tensor)
            filled.add(name)
        if "model.shared.weight" not in filled and "model.encoder.embed_tokens.weight" in ckpt.names():
            targets["model.shared.weight"].copy_(ckpt.read("model.encoder.embed_tokens.weight"))
            filled.add("model.shared.weight")
    missing = sorted(set(targets) - filled - {"final_logits_bias"})
    if "final_logits_bias" not in filled:
        targets["final_logits_bias"].zero_()  # optional in HF checkpoints (a zero buffer)
    if missing:
        raise WeightError(f"checkpoint {model_dir} lacks tensor(s) {missing[:5]} needed by {arch.architecture}")
    return model.eval()
