"""The attention backends of a model's layers: one class for every standard layer (by name, or the
first by priority that serves them all), MLA and sparse-MLA layers their own two-phase holders.

The worker and the embedder call this with the model's attention specs; the registry
(attention/registry.py) says why each candidate was refused when none fits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from meshserve.attention.backend import AttentionBackend, AttentionProblem
from meshserve.attention.registry import select_backend_for_layers
from meshserve.attention.spec import AttentionSpec

DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def make_backends(specs: Sequence[AttentionSpec], *, name: str | None, dtype: torch.dtype, block_size: int,
                  max_model_len: int, device: torch.device, dcp_size: int = 1) -> list[AttentionBackend]:
    """One backend instance per distinct spec, listed per layer.

    The backend class is chosen once (by name, or the first by priority that serves every
    layer's problem); otherwise the registry's error lists the reasons per layer kind. MLA layers get
    an MLAAttention instead (its decode and prefill backends are chosen from their own tables),
    sparse MLA layers a SparseMLAAttention (one backend from the MLA_SPARSE table).
    """
    cc = torch.cuda.get_device_capability(device) if device.type == "cuda" else None

    def problem(spec: AttentionSpec) -> AttentionProblem:
        return AttentionProblem(spec=spec, dtype=DTYPE_NAMES[dtype], block_size=block_size,
                                max_model_len=max_model_len, device=device.type, compute_capability=cc,
                                dcp_size=dcp_size)

    distinct = list(dict.fromkeys(specs))
    standard = [spec for spec in distinct if spec.mla is None]
    instances: dict[AttentionSpec, object] = {}
    if standard:
        # One class for all layers (windowed and full, with or without sinks), or the reasons why not.
        chosen = select_backend_for_layers([problem(spec) for spec in standard], name)
        instances.update({spec: chosen(problem(spec)) for spec in standard})
    for spec in distinct:
        if spec.mla is not None and spec.mla.indexer is not None:  # sparse MLA: one backend, both phases
            from meshserve.attention.mla.sparse_layer import SparseMLAAttention

            instances[spec] = SparseMLAAttention.named(problem(spec), name)
        elif spec.mla is not None:  # MLA layers: a decode and a prefill backend, each from its own table
            from meshserve.attention.mla.layer import MLAAttention

            instances[spec] = MLAAttention.named(problem(spec), name)
    return [instances[spec] for spec in specs]
