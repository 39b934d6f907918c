"""Every model the runner serves implements the whole GenerativeModel contract, and the parts
that depend on the checkpoint answer as the model is: dense or MoE, decoder-only or not."""

import typing

import pytest
import torch

from meshserve.workers.checkpoint import read_arch
from meshserve.workers.models.bart import BartForConditionalGeneration
from meshserve.workers.models.contract import GenerativeModel
from meshserve.workers.models.deepseek import DeepseekForCausalLM
from meshserve.workers.models.expert_layer import ExpertLayer
from meshserve.workers.models.transformer import CausalLM
from tests.tiny_models import write_checkpoint

MODELS = [CausalLM, DeepseekForCausalLM, BartForConditionalGeneration]
MEMBERS = sorted(
    {n for n in vars(GenerativeModel) if not n.startswith("_")} | set(typing.get_type_hints(GenerativeModel))
)


@pytest.mark.parametrize("cls", MODELS, ids=lambda c: c.__name__)
def test_every_model_class_has_every_member_of_the_contract(cls):
    missing = [n for n in MEMBERS if not hasattr(cls, n)]
    assert not missing, f"{cls.__name__} lacks {missing}"
    assert {"STACKED", "is_encoder_decoder", "cuda_graph_safe", "attention_specs", "compute_logits",
            "finish_loading", "expert_layers", "encoder_spec"} <= set(MEMBERS)


def test_expert_layers_are_the_moe_layers(tmp_path):
    for name in ("llama", "gpt_oss"):
        write_checkpoint(tmp_path / name, name)
    dense = CausalLM(read_arch(tmp_path / "llama"))
    assert dense.expert_layers() == [] and dense.encoder_spec() is None and not dense.is_encoder_decoder
    moe = CausalLM(read_arch(tmp_path / "gpt_oss"))
    layers = moe.expert_layers()
    assert len(layers) == moe.arch.num_layers and all(isinstance(m, ExpertLayer) for m in layers)
    for m in layers:
        m.expert_load.fill_(7)
    moe.finish_loading("cpu")  # counters start at zero; CPU keeps the experts unpacked
    assert all(m.expert_load.sum() == 0 and m.expert_load.dtype == torch.int64 and m.fused is None for m in layers)
