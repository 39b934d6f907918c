"""What a request forbids or favours among the next tokens, applied to its row of logits.

SamplingParams' logit_bias, allowed_token_ids, bad_words, min_tokens and structured_outputs:
the sampler (workers/sampler.py) calls `apply_constraints` after the penalties, on the device,
for the rows that have any. Requests without them take none of this path (the runner passes
no constraints, and the sampler's result is bit for bit what it was).

Per step, for the constrained rows only:
- logit_bias: one index_put (accumulate) of (row, token, bias) triples;
- tokens forbidden this step (a bad word's last token after its prefix, EOS and stop token ids
  before min_tokens): one index_put of -inf;
- grammar and allowed_token_ids: a host bitmask (int32 words, 32 tokens each: 512 bytes a row
  for a 4096-token vocabulary, 16 KiB for 128k) filled by the matchers and ANDed with the
  allowed ids, copied to the device in one transfer (pinned, asynchronous on CUDA) and
  unpacked there into a boolean mask. The fill runs on the host after the step's forward was
  launched, so on CUDA it overlaps the forward; on CPU it is serial (bench/structured_outputs.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from meshserve.core.sampling_params import SamplingParams
from meshserve.core.tensors import to_device
from meshserve.workers.grammar import CompileStats, GrammarCompiler, GrammarState, bitmask_words, fill_masks


@dataclass
class RequestConstraints:
    """One request's constraints as the sampler applies them.

    output_ids: the runner's list of the request's drawn tokens (read, never written, here)
    end_ids:    tokens that would end the output (EOS, stop_token_ids): forbidden before min_tokens
    bad_words:  token-id sequences; the last id is forbidden when the output ends with the rest
    allowed:    None, or int32 [words] bitmask of allowed_token_ids (host)
    bias:       (token ids, biases) of logit_bias, or None
    """

    params: SamplingParams
    output_ids: list[int]
    grammar: GrammarState | None = None
    end_ids: tuple[int, ...] = ()
    bad_words: list[list[int]] = field(default_factory=list)
    allowed: np.ndarray | None = None
    bias: tuple[list[int], list[float]] | None = None

    @property
    def uses_bitmask(self) -> bool:
        return self.grammar is not None or self.allowed is not None

    def forbidden_now(self) -> list[int]:
        """Token ids forbidden for the next draw (besides the bitmask)."""
        out: list[int] = []
        ids = self.output_ids
        if len(ids) < self.params.min_tokens:
            out += self.end_ids
        for word in self.bad_words:
            k = len(word) - 1
            if k == 0 or (len(ids) >= k and ids[-k:] == word[:-1]):
                out.append(word[-1])
        return out


class ConstraintBuilder:
    """Per driver rank: makes RequestConstraints (tokenizing bad words, compiling grammars)."""

    def __init__(self, model_dir: str | Path | None, *, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.model_dir = None if model_dir is None else Path(model_dir)
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self._tokenizer = None
        self._compiler: GrammarCompiler | None = None

    def _tokenize(self, text: str) -> list[int]:
        if self._tokenizer is None:
            from meshserve.core.checkpoint_files import load_tokenizer

            self._tokenizer = load_tokenizer(self.model_dir) if self.model_dir is not None else None
            if self._tokenizer is None:
                raise ValueError("bad_words and structured_outputs need the checkpoint's tokenizer.json")
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def make(self, params: SamplingParams, output_ids: list[int]) -> RequestConstraints | None:
        if not params.has_constraints:
            return None
        out = RequestConstraints(params, output_ids)
        if params.min_tokens:
            out.end_ids = tuple(dict.fromkeys((() if params.ignore_eos else self.eos_token_ids)
                                              + params.stop_token_ids))
        for word in params.bad_words:  # as it tokenizes alone and after a space (a word inside text)
            for text in (word, " " + word.lstrip()):
                ids = self._tokenize(text)
                if ids and ids not in out.bad_words:
                    out.bad_words.append(ids)
        if params.allowed_token_ids is not None:
            bits = np.zeros(bitmask_words(self.vocab_size) * 32, bool)
            bits[list(params.allowed_token_ids)] = True
            out.allowed = np.packbits(bits.reshape(-1, 32)[:, ::-1], axis=1).view(">i4").astype(np.int32).ravel()
        if params.logit_bias:
            out.bias = ([t for t, _ in params.logit_bias], [float(b) for _, b in params.logit_bias])
        if params.structured_outputs is not None:
            if self._compiler is None:
                if self.model_dir is None:
                    raise ValueError("structured_outputs needs the checkpoint's tokenizer.json")
                self._compiler = GrammarCompiler(self.model_dir, vocab_size=self.vocab_size,
                                                 eos_token_ids=self.eos_token_ids)
            out.grammar = GrammarState(self._compiler, params.structured_outputs, output_ids)
        return out

    def compile_stats(self) -> CompileStats:
        """The grammar compiler's counts; zeros while no grammar came (the compiler is not made for this)."""
        return CompileStats(0, 0, 0, 0) if self._compiler is None else self._compiler.stats()

    def shutdown(self) -> None:
        if self._compiler is not None:
            self._compiler.shutdown()


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [R, words] -> bool [R, vocab_size]: bit t % 32 of word t // 32 (on the bitmask's device)."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [R, words, 32]
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_constraints(logits: torch.Tensor, constraints: Sequence[RequestConstraints | None]) -> torch.Tensor:
    """logits [N, V] float32 (left unchanged) -> a new tensor with every row's constraints applied.
    constraints: one entry per row, None for a row without any."""
    device, vocab = logits.device, logits.shape[1]
    out = logits.clone()
    bias_rows, bias_ids, bias_values, ban_rows, ban_ids, mask_rows = [], [], [], [], [], []
    for i, c in enumerate(constraints):
        if c is None:
            continue
        if c.bias is not None:
            bias_rows += [i] * len(c.bias[0])
            bias_ids += c.bias[0]
            bias_values += c.bias[1]
        banned = c.forbidden_now()
        if banned:
            ban_rows += [i] * len(banned)
            ban_ids += banned
        if c.uses_bitmask:
            mask_rows.append(i)
    if bias_rows:
        out.index_put_((to_device(bias_rows, device), to_device(bias_ids, device)),
                       to_device(torch.tensor(bias_values, dtype=out.dtype), device), accumulate=True)
    if ban_rows:
        out.index_put_((to_device(ban_rows, device), to_device(ban_ids, device)),
                       torch.tensor(float("-inf"), dtype=out.dtype, device=device))
    if mask_rows:
        words = bitmask_words(vocab)
        host = torch.empty((len(mask_rows), words), dtype=torch.int32, pin_memory=device.type == "cuda")
        grammar_rows = [j for j, i in enumerate(mask_rows) if constraints[i].grammar is not None]
        fill_masks([constraints[mask_rows[j]].grammar for j in grammar_rows], host, grammar_rows)
        for j, i in enumerate(mask_rows):
            c = constraints[i]
            if c.grammar is None:
                host[j].fill_(-1)
            if c.allowed is not None:
                host[j] &= torch.from_numpy(c.allowed)
        allowed = unpack_bitmask(host.to(device, non_blocking=True), vocab)
        at = to_device(mask_rows, device)
        out.index_copy_(0, at, out.index_select(0, at).masked_fill_(~allowed, float("-inf")))
    return out
