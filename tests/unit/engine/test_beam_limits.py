"""What BeamSearch refuses before anything is queued: widths whose candidates exceed the sampler's
top-k (per the model's EOS ids) and max_tokens beyond the context."""

import pytest

from meshserve.core.beam_params import BeamSearchParams
from meshserve.core.sampling_params import SamplingParams
from meshserve.engine.beam_search import BeamSearch
from meshserve.engine.request import Request
from meshserve.errors import ConfigError


def _search(beam: BeamSearchParams, *, eos=(1,), prompt_len=8, max_model_len=64):
    owners = {}
    request = Request("r", list(range(2, 2 + prompt_len)), SamplingParams(), arrival=0, beam=beam)
    search = BeamSearch(request, scheduler=None, owners=owners, eos_token_ids=eos, vocab_size=100,
                        max_model_len=max_model_len, tokenizer=None)
    assert not owners  # checks only: nothing registered or queued
    return search


def test_width_limit_depends_on_the_eos_ids():
    assert _search(BeamSearchParams(beam_width=10)).k == 20
    assert _search(BeamSearchParams(beam_width=6), eos=(1, 2)).k == 18
    with pytest.raises(ConfigError, match=r"beam_width=7 .*\[1, 6\].*2 EOS ids") as e:
        _search(BeamSearchParams(beam_width=7), eos=(1, 2))
    assert e.value.field == "beam_width"
    assert _search(BeamSearchParams(beam_width=10, ignore_eos=True), eos=(1, 2, 3)).k == 20  # EOS not ranked


def test_max_tokens_must_fit_the_context():
    with pytest.raises(ConfigError, match=r"max_tokens=57 .*\[1, 56\]"):
        _search(BeamSearchParams(beam_width=2, max_tokens=57))
    assert _search(BeamSearchParams(beam_width=2, max_tokens=56)).root.params.logprobs == 4
