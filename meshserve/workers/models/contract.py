"""`GenerativeModel`: the contract between a model and the worker, runner, loader and decode graphs.

Every model the runner serves (CausalLM, DeepseekForCausalLM, BartForConditionalGeneration)
implements all of it; callers use these names directly and never probe a model for optional
attributes. To add a model, implement this Protocol (docs/architecture.md, "Add a model").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, ClassVar, Protocol

import torch

from meshserve.attention.spec import AttentionSpec

if TYPE_CHECKING:
    from meshserve.workers.models.expert_layer import ExpertLayer
    from meshserve.workers.models.transformer import ForwardContext


class GenerativeModel(Protocol):
    """A model over a packed batch of new tokens (a torch nn.Module)."""

    # Checkpoint module -> (fused model module, index of its part along dim 0): how the loader
    # fills fused parameters (qkv_proj from q/k/v_proj); empty when every tensor loads as is.
    # A class attribute; an instance may set its own where the checkpoint decides (DeepSeek's
    # MLA stacks q_proj or q_a_proj, whichever the checkpoint has, with kv_a_proj_with_mqa).
    STACKED: Mapping[str, tuple[str, int]]
    # Whether the prompt is the encoder's input (the worker then gives the encoder its backend).
    is_encoder_decoder: ClassVar[bool]

    @property
    def cuda_graph_safe(self) -> bool:
        """Whether forward never waits on the host (a CUDA graph can hold a decode step)."""
        ...

    def attention_specs(self) -> list[AttentionSpec]:
        """One spec per cached attention layer, in the order of ForwardContext.layers."""
        ...

    def encoder_spec(self) -> AttentionSpec | None:
        """The encoder's (uncached) self-attention; None for decoder-only models."""
        ...

    def expert_layers(self) -> list[ExpertLayer]:
        """The MoE layers whose routed-row counts the worker reports (empty for dense models)."""
        ...

    def finish_loading(self, device: torch.device | str) -> None:
        """Called once every weight is in: rebuild derived tables, pack experts, zero counters."""
        ...

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_ids, positions [T] int64 -> final hidden states [T, hidden]."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] float32."""
        ...
