"""The settings of one replica's engine."""

from __future__ import annotations

from dataclasses import dataclass, field

from meshserve.config import AttentionConfig, CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig


@dataclass(frozen=True)
class EngineConfig:
    """The settings one replica reads, each validated by its own dataclass."""

    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
