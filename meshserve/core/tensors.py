"""Host values onto the device without waiting for it.

Under overlap scheduling the device is still running step N while the host stages step N+1.
A copy from pageable host memory may make the host wait for the stream; a copy from pinned
memory is stream-ordered and returns at once (the caching host allocator keeps the pinned
block until the copy has run), so every host-to-device copy of a step goes through here.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import torch


def to_device(values: Sequence | torch.Tensor, device: torch.device | str, dtype: torch.dtype | None = None
              ) -> torch.Tensor:
    """`values` (a host list or CPU tensor) as a tensor on `device`; on CUDA by a stream-ordered
    copy from pinned memory that does not wait for the device."""
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if dtype is not None and host.dtype != dtype:
        host = host.to(dtype)
    device = torch.device(device)
    if device.type != "cuda":  # no call when it is there already: a CPU step makes ~10 of these
        return host if host.device == device else host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def copy_into(dst: torch.Tensor, host: torch.Tensor) -> None:
    """Copy a host tensor into `dst` (same shape) in place; on CUDA from pinned memory, stream-
    ordered (a static buffer a CUDA graph reads is filled this way: no temporary on the device)."""
    if dst.is_cuda:
        host = host.pin_memory()
    dst.copy_(host, non_blocking=True)


@lru_cache(maxsize=8)
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device, *, default: int = 8) -> int:
    """The streaming multiprocessors of a CUDA device (what split-KV kernels size their grids
    by); `default` elsewhere (the Triton interpreter on a CPU)."""
    if device.type != "cuda":
        return default
    return _multiprocessors(device.index if device.index is not None else torch.cuda.current_device())
