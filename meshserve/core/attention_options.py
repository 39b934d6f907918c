"""The attention choices a user makes by name: the KV cache dtype and the backend.

They live below attention/ so that config.py validates them without importing it. attention/
implements them: attention/spec.py carries the KV cache dtype of each layer, and
attention/registry.py maps every name of ATTENTION_BACKENDS to its backend (a test checks that
the two name lists agree).
"""

from __future__ import annotations

from enum import StrEnum


class KVCacheDtype(StrEnum):
    AUTO = "auto"  # same dtype as the model
    FP8_E4M3 = "fp8_e4m3"
    FP8_E5M2 = "fp8_e5m2"

    @property
    def is_fp8(self) -> bool:
        return self is not KVCacheDtype.AUTO


# `--attention-backend NAME` / AttentionConfig.backend: what config accepts (None = automatic).
ATTENTION_BACKENDS: tuple[str, ...] = ("TORCH", "CPU_SDPA", "TRITON", "FLASHINFER")
