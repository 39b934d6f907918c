"""--served-model-name with several names: one model, reachable under each.

The service knows its model by the first name (responses and metrics say it); this wrapper
lists one ModelCard per name, so /v1/models, gRPC ListModels and every request's `model`
accept any of them (vLLM's behaviour). Everything else goes to the wrapped service.
"""

from __future__ import annotations

from dataclasses import replace

from meshserve.cluster.service import InferenceService, ModelCard
from meshserve.errors import check


class ServedNames:
    def __init__(self, service: InferenceService, names: list[str]) -> None:
        check(len(names) == len(set(names)) and all(n.strip() for n in names), "served_model_name", names,
              "distinct non-empty names")
        self._service = service
        self.names = list(names)

    def models(self) -> list[ModelCard]:
        cards = self._service.models()
        first = cards[0]
        return [replace(first, name=name) for name in self.names] + cards[1:]

    def __getattr__(self, name: str):  # start, generate, tokenize, health, stats, shutdown, ...
        return getattr(self._service, name)
