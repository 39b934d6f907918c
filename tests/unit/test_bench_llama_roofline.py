"""bench/e2e.py's Llama decode roofline against HF transformers' own Llama: the bytes of a bs-1
step are exactly the parameters it reads (all but one embedding row), in bf16, and with FP8
projections (and an FP8 LM head) at one byte per weight, as `--quantization fp8
[--quantize-lm-head]` stores them (workers/loader.py: every linear but the head; norms stay)."""

import pytest
import torch

from bench import e2e

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("fp8_head", [None, False, True])  # None: bf16 weights
def test_bs1_roofline_counts_what_a_step_reads(fp8_head):
    shape = e2e.LLAMA3_8B
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape))
    expected = 0
    for name, p in model.named_parameters():
        if name.endswith("embed_tokens.weight"):
            expected += 2 * p.shape[1]  # one row
        elif name == "lm_head.weight":
            expected += p.numel() * (1 if fp8_head else 2)
        elif name.endswith("proj.weight"):
            expected += p.numel() * (2 if fp8_head is None else 1)
        else:  # the norms
            expected += 2 * p.numel()
    sizes = {} if fp8_head is None else {"linear_itemsize": 1, "head_itemsize": 1 if fp8_head else None}
    embedding_row = 2 * shape["hidden_size"]
    assert e2e.llama_step_bytes(shape, 2, 1, 0, **sizes) + embedding_row == expected
