"""Decoder models built from HF configs: one transformer, per-architecture data in `arch`."""

from meshserve.workers.models.arch import ARCHITECTURES, ModelArch, RopeScaling, arch_from_hf_config
from meshserve.workers.models.transformer import CausalLM, ForwardContext, LayerAttention

__all__ = [
    "ARCHITECTURES",
    "CausalLM",
    "ForwardContext",
    "LayerAttention",
    "ModelArch",
    "RopeScaling",
    "arch_from_hf_config",
]
