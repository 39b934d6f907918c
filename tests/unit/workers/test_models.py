"""Model forward against HF transformers' own modeling code, through the runner and the TORCH backend.

One packed step holds several prompts of different lengths (Mistral's window is shorter than
most of them); a second step decodes one token for each. Logits must match HF's full forward.
"""

import pytest
import torch

from meshserve.config import AttentionConfig, CacheConfig, ModelConfig
from meshserve.workers.models.arch import RopeScaling
from meshserve.workers.models.rope import inverse_frequencies
from meshserve.workers.step import NewRequest, ScheduledSeq, StepPlan
from meshserve.workers.worker import Worker
from tests.tiny_models import ARCHS, prompts

BLOCK = 4


def _worker(path, backend="TORCH"):
    w = Worker(ModelConfig(model=str(path), max_model_len=128), CacheConfig(block_size=BLOCK, num_kv_blocks=64),
               AttentionConfig(backend=backend), device="cpu", progress=False)
    w.start()
    return w


def _capture_logits(worker):
    """Wrap compute_logits to record every logits tensor the runner computes."""
    seen = []
    model = worker.runner.model
    original = model.compute_logits

    def record(hidden):
        out = original(hidden)
        seen.append(out.clone())
        return out

    model.compute_logits = record
    return seen


@pytest.mark.parametrize("arch", list(ARCHS))
def test_prefill_and_decode_logits_match_hf(checkpoints, arch):
    path, hf = checkpoints[arch]
    worker = _worker(path)
    seen = _capture_logits(worker)
    batch = prompts(3, min_len=5, max_len=19)
    # Shuffled, non-contiguous blocks per sequence catch paging mistakes.
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(0)).tolist()
    tables = [perm[i * 8:(i + 1) * 8] for i in range(len(batch))]
    new = [NewRequest(f"r{i}", p, {"temperature": 0.0}) for i, p in enumerate(batch)]
    seqs = [ScheduledSeq(f"r{i}", p, 0, [tables[i]]) for i, p in enumerate(batch)]
    out1 = StepPlan.from_msgpack(StepPlan.from_seqs(0, seqs, new).to_msgpack())
    first = worker.runner.execute(out1).sampled
    seqs = [ScheduledSeq(f"r{i}", [first[i].token_id], len(p), [tables[i]]) for i, p in enumerate(batch)]
    worker.runner.execute(StepPlan.from_seqs(1, seqs))
    with torch.no_grad():
        for i, p in enumerate(batch):
            ref = hf(torch.tensor([p + [first[i].token_id]])).logits[0]
            torch.testing.assert_close(seen[0][i], ref[len(p) - 1], atol=2e-5, rtol=1e-4)
            torch.testing.assert_close(seen[1][i], ref[len(p)], atol=2e-5, rtol=1e-4)
            assert first[i].token_id == int(ref[len(p) - 1].argmax())


def test_llama3_rope_frequencies_match_hf():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                  original_max_position_embeddings=64, rope_theta=500000.0)
    cfg = LlamaConfig(hidden_size=256, num_attention_heads=2, rope_parameters=params)
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    ours = inverse_frequencies(RopeScaling(theta=500000.0, kind="llama3", factor=8.0, low_freq_factor=1.0,
                                           high_freq_factor=4.0, original_max_position_embeddings=64), 128)
    torch.testing.assert_close(ours, ref.float(), rtol=1e-6, atol=0)
    plain = inverse_frequencies(RopeScaling(theta=500000.0), 128)
    assert not torch.allclose(ours, plain)  # the scaling really changed the low frequencies
