"""The embedding path: an encoder-only model, its tokenizer and pooling, one batched call.

Encoder-only models keep no KV cache and generate nothing, so there is no scheduler loop:
`embed` validates every input, tokenizes, packs the sequences without padding into chunks of
at most `max_num_batched_tokens` tokens, runs the encoder once per chunk and pools each
sequence. Attention goes through the registry with AttentionType.ENCODER_ONLY; by default the
problem is posed in the naive layout (block_size == max_model_len), so a paged flash layout is
used only when a block size is asked for and the backend supports it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from meshserve.attention.layer_backends import make_backends
from meshserve.attention.metadata import AttentionMetadata
from meshserve.config import Dtype
from meshserve.core.arith import cdiv
from meshserve.core.checkpoint_files import load_tokenizer, read_json
from meshserve.errors import ConfigError, as_enum, check
from meshserve.workers.loader import TORCH_DTYPES
from meshserve.workers.models.bert import BertArch, bert_arch_from_config, load_bert
from meshserve.workers.pooling import PoolingConfig, pool, read_pooling_config

EmbedInput = str | Sequence[int]


@dataclass(frozen=True)
class EmbeddingOutput:
    """embedding: [dim] float32 on the CPU; num_tokens: tokens the model saw (special tokens included)."""

    embedding: torch.Tensor
    num_tokens: int


class Embedder:
    """An embedding model served in this process.

    model: checkpoint directory (config.json with an encoder architecture, model.safetensors,
    tokenizer.json; sentence-transformers' modules.json and pooling config when present).
    block_size: None = naive layout; a value < max_model_len asks for the paged (flash) layout.
    max_model_len: longest input in tokens (default: the model's position table).
    """

    task = "embed"

    def __init__(self, model: str | Path, *, dtype: str = "auto", attention_backend: str | None = None,
                 block_size: int | None = None, max_model_len: int | None = None,
                 max_num_batched_tokens: int = 8192, device: str | None = None) -> None:
        self.model_dir = Path(model)
        check(self.model_dir.is_dir(), "model", str(model), "an existing checkpoint directory")
        cfg = read_json(self.model_dir / "config.json", "model")
        self.arch: BertArch = bert_arch_from_config(cfg)
        limit = self.arch.max_tokens
        if max_model_len is None:
            max_model_len = limit
        check(isinstance(max_model_len, int) and 1 <= max_model_len <= limit, "max_model_len", max_model_len,
              f"an integer in [1, {limit}] (the model's max positions)")
        self.max_model_len = max_model_len
        check(isinstance(max_num_batched_tokens, int) and max_num_batched_tokens >= 1, "max_num_batched_tokens",
              max_num_batched_tokens, "an integer >= 1")
        self.max_num_batched_tokens = max_num_batched_tokens
        block_size = max_model_len if block_size is None else block_size
        check(isinstance(block_size, int) and 1 <= block_size <= max_model_len, "block_size", block_size,
              f"an integer in [1, {max_model_len}] (== max_model_len: naive layout)")
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = _resolve_dtype(dtype, cfg, self.device)
        self.pooling: PoolingConfig = read_pooling_config(self.model_dir)
        self.model = load_bert(self.model_dir, self.arch, dtype=self.dtype, device=self.device)
        spec = self.model.attention_spec()
        (self.backend,) = make_backends([spec], name=attention_backend, dtype=self.dtype, block_size=block_size,
                                        max_model_len=max_model_len, device=self.device)
        self.block_size = block_size
        self.tokenizer = load_tokenizer(self.model_dir)
        self._truncating = load_tokenizer(self.model_dir)
        if self.tokenizer is not None:
            # tokenizer.json may carry fixed padding/truncation (all-MiniLM's pads to 128): we pack instead.
            self.tokenizer.no_padding()
            self.tokenizer.no_truncation()
            self._truncating.no_padding()
            self._truncating.enable_truncation(max_model_len)

    @property
    def dim(self) -> int:
        return self.arch.hidden_size * len(self.pooling.modes)

    # -------------------------------------------------------------------------------- inputs
    def tokenize(self, inputs: Sequence[EmbedInput], *, truncate: bool = False) -> list[list[int]]:
        """Token ids of every input, validated (range, length) before anything runs."""
        texts = [(i, x) for i, x in enumerate(inputs) if isinstance(x, str)]
        if texts and self.tokenizer is None:
            raise ConfigError("inputs", "text", f"token ids: {self.model_dir} has no tokenizer.json")
        out: list[list[int] | None] = [None] * len(inputs)
        if texts:
            tok = self._truncating if truncate else self.tokenizer
            for (i, _), enc in zip(texts, tok.encode_batch([t for _, t in texts])):
                out[i] = list(enc.ids)
        for i, x in enumerate(inputs):
            if out[i] is not None:
                continue
            check(not isinstance(x, bytes) and isinstance(x, Sequence), f"inputs[{i}]", type(x).__name__,
                  "a string or a sequence of token ids")
            ids = [int(t) for t in x]
            check(len(ids) >= 1, f"inputs[{i}]", [], "at least one token id")
            bad = [t for t in ids if not 0 <= t < self.arch.vocab_size]
            check(not bad, f"inputs[{i}]", bad[:5], f"token ids in [0, {self.arch.vocab_size - 1}]")
            out[i] = ids[: self.max_model_len] if truncate else ids
        for i, ids in enumerate(out):
            check(len(ids) <= self.max_model_len, f"inputs[{i}]", f"{len(ids)} tokens",
                  f"at most max_model_len={self.max_model_len} tokens (ask for truncation to cut longer inputs)")
        return out

    # --------------------------------------------------------------------------------- embed
    def embed(self, inputs: EmbedInput | Sequence[EmbedInput], *, truncate: bool = False) -> list[EmbeddingOutput]:
        """One EmbeddingOutput per input (text or token ids), in order; all validated before any runs."""
        if isinstance(inputs, str) or (len(inputs) > 0 and isinstance(inputs[0], int)):
            inputs = [inputs]
        ids = self.tokenize(list(inputs), truncate=truncate)
        vectors = self.embed_ids(ids)
        return [EmbeddingOutput(vec, len(seq)) for vec, seq in zip(vectors, ids)]

    def embed_ids(self, sequences: list[list[int]]) -> torch.Tensor:
        """Validated token-id lists -> [N, dim] float32 CPU tensor, run in packed chunks."""
        out = torch.empty(len(sequences), self.dim, dtype=torch.float32)
        start = 0
        while start < len(sequences):
            stop, tokens = start, 0
            while stop < len(sequences) and (stop == start or tokens + len(sequences[stop]) <=
                                             self.max_num_batched_tokens):
                tokens += len(sequences[stop])
                stop += 1
            out[start:stop] = self._run(sequences[start:stop]).cpu()
            start = stop
        return out

    @torch.inference_mode()
    def _run(self, chunk: list[list[int]]) -> torch.Tensor:
        lengths = [len(s) for s in chunk]
        dev = self.device
        meta = AttentionMetadata.build(
            query_lens=lengths, seq_lens=lengths, block_tables=[[0] * cdiv(n, self.block_size) for n in lengths],
            block_size=self.block_size, device=dev, write_kv=False,
        )  # fmt: skip
        ids = torch.tensor([t for s in chunk for t in s], dtype=torch.long, device=dev)
        starts = meta.query_start_loc[:-1].long().repeat_interleave(torch.tensor(lengths, device=dev))
        positions = torch.arange(ids.shape[0], device=dev) - starts
        type_ids = torch.zeros_like(ids)  # one segment per input
        hidden = self.model(ids, positions, type_ids, self.backend, self.backend.plan(meta))  # [T, hidden]
        return pool(hidden, meta.query_start_loc.tolist(), self.pooling)

    def describe(self) -> dict:
        return {"model": str(self.model_dir), "architecture": self.arch.architecture, "dim": self.dim,
                "max_model_len": self.max_model_len, "pooling": [m.value for m in self.pooling.modes],
                "normalize": self.pooling.normalize, "backend": self.backend.name, "dtype": str(self.dtype)}

    def __repr__(self) -> str:
        return f"Embedder({json.dumps(self.describe())})"


def _resolve_dtype(dtype: str, cfg: dict, device: torch.device) -> torch.dtype:
    choice = as_enum(Dtype, "dtype", dtype or Dtype.AUTO)
    if choice is not Dtype.AUTO:
        return TORCH_DTYPES[choice.value]
    if device.type == "cpu":
        return torch.float32
    return TORCH_DTYPES.get(str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"), torch.float32)
