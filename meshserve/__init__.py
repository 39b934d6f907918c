"""meshserve: distributed LLM inference. `from meshserve import LLM, SamplingParams`.

The public names load lazily, so `import meshserve.errors` (the CLI, the config) stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

_PUBLIC = {
    "LLM": "meshserve.api.llm",
    "SamplingParams": "meshserve.core.sampling_params",
    "BeamSearchParams": "meshserve.core.beam_params",
    "BeamSearchOutput": "meshserve.core.outputs",
    "RequestOutput": "meshserve.core.outputs",
    "CompletionDelta": "meshserve.core.outputs",
    "EmbeddingOutput": "meshserve.workers.embedder",
}

if TYPE_CHECKING:
    from meshserve.api.llm import LLM
    from meshserve.core.beam_params import BeamSearchParams
    from meshserve.core.outputs import BeamSearchOutput, CompletionDelta, RequestOutput
    from meshserve.core.sampling_params import SamplingParams
    from meshserve.workers.embedder import EmbeddingOutput


def __getattr__(name: str):
    if name in _PUBLIC:
        import importlib

        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'meshserve' has no attribute {name!r}")


__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "BeamSearchOutput", "RequestOutput", "CompletionDelta",
           "EmbeddingOutput"]
