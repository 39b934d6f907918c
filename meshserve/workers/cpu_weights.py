"""Float32 linear weights laid out input-major on a CPU: the same values, a faster GEMM.

`nn.Linear` keeps its weight [out, in] (HF's layout) and computes x @ weight.T. On the CPU
(torch 2.13, MKL) that product is 1.2-1.7x slower than the same product against a weight
stored [in, out] contiguously, for every shape of the demo model at 1, 16 and 64 rows (one
thread, warm caches: e.g. gate_up [1536, 256] at 16 rows 126 against 87 us, the LM head
[4096, 256] at 64 rows 970 against 808 us; docs/performance.md). `input_major_linears` copies
each such weight into [in, out] storage and hands the module its transpose, a view: the
parameter still reads [out, in] to every other piece of code (loaders, tests, the LM head's
tie), and `F.linear` sees the transposed view and runs the faster product. The values, and the
results, do not change: the GEMM is called on the same numbers in a different memory order.

A tied LM head (the embedding's matrix) gets its own input-major copy: vocab x hidden more
floats; the embedding keeps the row layout its lookups want.
"""

from __future__ import annotations

import torch
from torch import nn


def input_major_linears(model: nn.Module) -> int:
    """Re-lay every float32 CPU `nn.Linear` weight of `model` input-major; returns how many.

    Other dtypes (bfloat16 runs through oneDNN, where this was not measured), other devices
    and other layer classes (tensor-parallel, quantized) are left as they are.
    """
    count = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if type(module) is not nn.Linear or weight is None:
            continue
        if weight.dtype != torch.float32 or weight.device.type != "cpu" or not weight.is_contiguous():
            continue  # bf16/fp16, accelerators, or already input-major
        with torch.no_grad():
            module.weight = nn.Parameter(weight.detach().t().contiguous().t(), requires_grad=False)
        count += 1
    return count
