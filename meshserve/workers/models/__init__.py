"""Decoder models built from HF configs: per-architecture data in `arch`, the model class per architecture."""

from torch import nn

from meshserve.workers.models.arch import ARCHITECTURES, ModelArch, RopeScaling, arch_from_hf_config
from meshserve.workers.models.transformer import CausalLM, ForwardContext, LayerAttention

# Architectures that are not the generic transformer -> their model class (same interface).
MODEL_CLASSES: dict[str, str] = {
    "DeepseekV2ForCausalLM": "meshserve.workers.models.deepseek:DeepseekForCausalLM",
    "DeepseekV3ForCausalLM": "meshserve.workers.models.deepseek:DeepseekForCausalLM",
}


def model_class(arch: ModelArch) -> type[nn.Module]:
    """The class that builds `arch`: CausalLM unless MODEL_CLASSES names another."""
    target = MODEL_CLASSES.get(arch.architecture)
    if target is None:
        return CausalLM
    import importlib

    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "ARCHITECTURES",
    "CausalLM",
    "ForwardContext",
    "LayerAttention",
    "MODEL_CLASSES",
    "ModelArch",
    "RopeScaling",
    "arch_from_hf_config",
    "model_class",
]
