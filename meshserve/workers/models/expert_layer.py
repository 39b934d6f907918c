"""`ExpertLayer`: what every MoE layer (DeepSeek's MoE, gpt-oss's SwigluMoE) shares with the worker.

The worker reads each layer's load counters (`expert_load`, `expert_shard`) for the load-balance
metrics; the loader calls `finish_loading` once the weights are in; a model is CUDA-graph safe
when every expert layer runs fused. This module imports no Triton: dense models read it too.
"""

from __future__ import annotations

import abc

import torch
from torch import nn


def runs_fused(device: torch.device | str) -> bool:
    """Whether MoE layers on `device` pack their experts for the fused kernels: on CUDA."""
    return torch.device(device).type == "cuda"


class ExpertLayer(nn.Module, abc.ABC):
    """Base of the MoE layers: load counters, the expert shard under --ep, the fused layout."""

    def __init__(self, num_experts: int) -> None:
        super().__init__()
        self.fused = None  # fused_moe.ExpertWeights, set by pack_experts (CUDA)
        self.expert_shard = None  # expert_parallel.ExpertShard under --ep
        # Whether the fused path may return its output unsummed (fused_ops.DeferredSum), for the
        # next norm to sum: set by a decoder layer whose MoE output goes straight to the next
        # add_and_norm; cleared where anything reads the output first (the TP all-reduce hook).
        self.sum_in_norm = False
        # Rows routed to each local expert since start (load-balance statistics), on the device.
        self.register_buffer("expert_load", torch.zeros(num_experts, dtype=torch.int64), persistent=False)

    @abc.abstractmethod
    def pack_experts(self) -> None:
        """Switch to the fused kernels' layout of the experts."""

    def finish_loading(self, device: torch.device | str) -> None:
        """Zero the load counters (a meta-built model's buffers hold garbage after to_empty) and
        pack the experts for the fused kernels where `device` runs them (CUDA)."""
        self.expert_load = torch.zeros(self.expert_load.numel(), dtype=torch.int64, device=device)
        if runs_fused(device):
            self.pack_experts()


def expert_layers(model: nn.Module) -> list[ExpertLayer]:
    """The MoE layers of `model`, in module order (empty for a dense model)."""
    return [m for m in model.modules() if isinstance(m, ExpertLayer)]


def experts_graph_safe(model: nn.Module) -> bool:
    """Whether every MoE layer of `model` runs fused (no host sync: a CUDA graph can hold it)."""
    return all(m.fused is not None for m in expert_layers(model))
