"""Decoder models built from HF configs: per-architecture data in `arch`, the model class per architecture."""

from collections.abc import Callable

from torch import nn

from meshserve.parallel.groups import ParallelContext
from meshserve.workers.models.arch import ARCHITECTURES, ModelArch, RopeScaling, arch_from_hf_config
from meshserve.workers.models.transformer import CausalLM, ForwardContext, LayerAttention

# Architectures that are not the generic transformer -> their model class (same interface).
MODEL_CLASSES: dict[str, str] = {
    "DeepseekV2ForCausalLM": "meshserve.workers.models.deepseek:DeepseekForCausalLM",
    "DeepseekV3ForCausalLM": "meshserve.workers.models.deepseek:DeepseekForCausalLM",
    "DeepseekV32ForCausalLM": "meshserve.workers.models.deepseek:DeepseekForCausalLM",
}


def tensor_parallel_transform(arch: ModelArch) -> Callable[[nn.Module, ParallelContext], None]:
    """The meta-device TP transform for `arch`'s model class (transformer_parallel for CausalLM)."""
    if arch.deepseek is not None:
        from meshserve.workers.models.deepseek_parallel import apply_deepseek_tensor_parallel

        return apply_deepseek_tensor_parallel
    from meshserve.workers.models.transformer_parallel import apply_tensor_parallel

    return apply_tensor_parallel


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
    "tensor_parallel_transform",
]
