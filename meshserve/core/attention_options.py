"""The attention choices a user makes by name: the KV cache dtype and the backend.

They live below attention/ so that config.py validates them without importing it. attention/
implements them: attention/spec.py carries the KV cache dtype of each layer, and
attention/registry.py maps every name of ATTENTION_BACKENDS to its backend (a test checks that
the two name lists agree).
"""

from __future__ import annotations

from enum import StrEnum

from meshserve.errors import ConfigError


class KVCacheDtype(StrEnum):
    AUTO = "auto"  # same dtype as the model
    FP8_E4M3 = "fp8_e4m3"
    FP8_E5M2 = "fp8_e5m2"

    @property
    def is_fp8(self) -> bool:
        return self is not KVCacheDtype.AUTO


# `--attention-backend NAME` / AttentionConfig.backend: what config accepts (None = automatic).
ATTENTION_BACKENDS: tuple[str, ...] = ("TORCH", "CPU_SDPA", "TRITON", "FLASHINFER")

# A standard layer may run prefill and decode on two backends over one cache (attention/backends/
# phase_split.py): `--attention-backend prefill=FLASHINFER,decode=TRITON`.
SPLIT_PHASES: tuple[str, ...] = ("prefill", "decode")
SPLIT_SYNTAX = "prefill=NAME,decode=NAME"


def split_spelling(prefill: str, decode: str) -> str:
    """The canonical spelling of a phase split: 'prefill=FLASHINFER,decode=TRITON'."""
    return f"prefill={prefill},decode={decode}"


def parse_attention_backend(
    value: object, field: str = "attention_backend", *, names: tuple[str, ...] = ATTENTION_BACKENDS
) -> str | tuple[str, str] | None:
    """A backend setting as given by a user: None (automatic), one name ('TRITON', any case), or a
    phase split 'prefill=NAME,decode=NAME' (either order, any case) as (prefill, decode), the
    names from `names`. ConfigError names the field and what is allowed."""
    if value is None:
        return None
    allowed = f"one of {sorted(names)}, {SPLIT_SYNTAX} with names from that list, or None"
    text = str(value).strip()
    if "=" not in text and "," not in text:
        name = text.upper()
        if name not in names:
            raise ConfigError(field, value, allowed)
        return name
    parts: dict[str, str] = {}
    for item in text.split(","):
        phase, eq, name = (x.strip() for x in item.partition("="))
        phase, name = phase.lower(), name.upper()
        if not eq or phase not in SPLIT_PHASES or phase in parts or name not in names:
            raise ConfigError(field, value, allowed)
        parts[phase] = name
    if set(parts) != set(SPLIT_PHASES):
        raise ConfigError(field, value, f"{SPLIT_SYNTAX}: both phases named ({allowed})")
    return parts["prefill"], parts["decode"]


def canonical_attention_backend(
    value: object, field: str = "attention_backend", *, names: tuple[str, ...] = ATTENTION_BACKENDS
) -> str | None:
    """The setting normalised: None, 'TRITON', or 'prefill=FLASHINFER,decode=TRITON'; a split whose
    two names are equal is that one name."""
    parsed = parse_attention_backend(value, field, names=names)
    if isinstance(parsed, tuple):
        return parsed[0] if parsed[0] == parsed[1] else split_spelling(*parsed)
    return parsed
