"""`DecoderOnlyLM`: the part of the model contract (contract.py) that every decoder-only language
model answers alike, as a base class beside nn.Module."""

from __future__ import annotations

from typing import ClassVar

import torch

from meshserve.workers.models.expert_layer import ExpertLayer, expert_layers


class DecoderOnlyLM:
    """No encoder, MoE layers found by type, and loading finished by rebuilding the rotary
    tables of `self.model.rotary` and readying the expert layers."""

    is_encoder_decoder: ClassVar[bool] = False

    def encoder_spec(self) -> None:
        return None

    def expert_layers(self) -> list[ExpertLayer]:
        return expert_layers(self)

    def finish_loading(self, device: torch.device | str) -> None:
        self.model.rotary.reset_tables(device)
        for layer in self.expert_layers():
            layer.finish_loading(device)

