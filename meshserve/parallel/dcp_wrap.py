"""The DCP version of each layer's attention: the wrapper that gathers the DCP group's queries
and merges its partial outputs, chosen by the kind of attention the layer has."""

from __future__ import annotations

from collections.abc import Sequence

from meshserve.attention.mla.layer import MLAAttention
from meshserve.attention.mla.sparse_layer import SparseMLAAttention
from meshserve.config import DcpComm
from meshserve.parallel.dcp import DcpAttention
from meshserve.parallel.dcp_mla import DcpMLAAttention, DcpSparseMLAAttention
from meshserve.parallel.groups import ParallelContext


def dcp_wrapper(backend: object) -> type:
    """The DCP class for a layer's attention: sparse MLA, MLA or standard."""
    if isinstance(backend, SparseMLAAttention):
        return DcpSparseMLAAttention
    return DcpMLAAttention if isinstance(backend, MLAAttention) else DcpAttention


def wrap_for_dcp(backends: Sequence[object], ctx: ParallelContext, comm: DcpComm) -> list:
    """Each layer's backend (listed per layer) wrapped for this rank's DCP group."""
    return [dcp_wrapper(b)(b, ctx, comm) for b in backends]
