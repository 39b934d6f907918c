"""Beam search settings: one frozen, validated record per `LLM.beam_search` call.

The search is HF transformers' (`generate(num_beams=..., do_sample=False)`): every step the
2 * beam_width (3 * with two EOS ids, ...) best continuations of the live beams by cumulative
logprob are ranked; the best beam_width of them that do not end become the next beams, and those
among the first beam_width that end (EOS, or max_tokens reached) are scored
cum_logprob / length ** length_penalty (length = generated tokens, the EOS counted) and kept
when they are among the beam_width best finished.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from meshserve.core.sampling_params import MAX_LOGPROBS, _is_int, _is_num
from meshserve.errors import check

# The engine ranks each beam's top-k next tokens (the sampler's logprobs, k <= MAX_LOGPROBS), and
# k = 2 * beam_width with one EOS id: so beam_width <= MAX_LOGPROBS // 2.
MAX_BEAM_WIDTH = MAX_LOGPROBS // 2


@dataclass(frozen=True)
class BeamSearchParams:
    """beam_width      1..10: beams kept, and sequences returned (best first)
    max_tokens      >= 1: generated tokens per sequence at most
    length_penalty  a finite number: finished beams rank by cum_logprob / length ** length_penalty
                    (> 0 favours longer sequences; 0 ranks by cum_logprob)
    early_stopping  True: stop once beam_width sequences finished; False (HF's default): stop when
                    the best live beam, at its current length, cannot beat the worst finished one;
                    "never": the same bound taken at max_tokens when length_penalty > 0
    ignore_eos      EOS does not end a beam (every sequence runs to max_tokens)
    skip_special_tokens  in the returned text
    """

    beam_width: int
    max_tokens: int = 16
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        check(_is_int(self.beam_width) and 1 <= self.beam_width <= MAX_BEAM_WIDTH, "beam_width", self.beam_width,
              f"an integer in [1, {MAX_BEAM_WIDTH}]")
        check(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", self.max_tokens, "an integer >= 1")
        check(_is_num(self.length_penalty), "length_penalty", self.length_penalty, "a finite number")
        check(isinstance(self.early_stopping, bool) or self.early_stopping == "never", "early_stopping",
              self.early_stopping, 'True, False or "never"')
        check(isinstance(self.ignore_eos, bool), "ignore_eos", self.ignore_eos, "True or False")

    def candidates_per_step(self, num_eos_ids: int) -> int:
        """Continuations ranked each step (HF's beams_to_keep)."""
        return max(2, 1 + (0 if self.ignore_eos else num_eos_ids)) * self.beam_width
