"""Float32 linear weights laid out input-major on a CPU: the same values, a faster GEMM.

`nn.Linear` keeps its weight [out, in] (HF's layout) and computes x @ weight.T. On the CPU
(torch 2.13, MKL) that product is 1.2-1.7x slower than the same product against a weight
stored [in, out] contiguously, for every shape of the demo model at 1, 16 and 64 rows (one
thread, warm caches: e.g. gate_up [1536, 256] at 16 rows 126 against 87 us, the LM head
[4096, 256] at 64 rows 970 against 808 us; docs/performance.md). `input_major_linears` swaps
each such layer for an `InputMajorLinear` holding the weight in [in, out] storage: its
`weight` parameter still reads [out, in] to every other piece of code (loaders, tests), and
the product runs the faster GEMM. The values do not change: the GEMM is called on the same
numbers in a different memory order.

A tied LM head (the embedding's matrix) gets its own input-major copy: vocab x hidden more
floats; the embedding keeps the row layout its lookups want.

From `ONEDNN_MIN_ROWS` rows the product goes through oneDNN (`torch.ops.mkldnn._linear_pointwise`,
the op inductor's CPU linear fusion calls) on a second copy of the weight in oneDNN's own blocked
layout (`torch.ops.mkldnn._reorder_linear_weight`, made once here): on the 2-core AMD EPYC machine
MKL's sgemm runs these shapes at about half of what oneDNN's JIT kernels reach (one thread, us,
MKL mm / oneDNN: gate_up [1536, 256] at 8 rows 124 / 94, 16: 199 / 125, 64: 554 / 282, 4096 rows (a
prefill): 36111 / 15526; the LM head at 64 rows 1558 / 723), and the blocked copy streams from
memory better than the [in, out] view oneDNN read before: the demo model's 25 linears of a decode
step with the weights out of cache (what a step sees: its KV cache reads evict them) took 2.7
against 3.5 ms at 16 rows, 8.1 against 8.9 at 64, and 1.8-2.2 against 2.5-3.3 ms for MKL at 2 to 8
rows (docs/performance.md, "Packed oneDNN weights"). One row stays with MKL (28 against 40 us:
oneDNN's call costs about 13 us: its descriptors are built anew on every call). The blocked copy costs the
weights' bytes once more in memory; the dense [in, out] tensor stays for the one-row GEMV and for
`weight`. So `input_major_linears` packs only while the float32 linears' bytes stay within
`PACKED_MEMORY_SHARE` of the memory available when the model loads (MemAvailable): the demo model
(22 MB) always, an 8B model in float32 (~30 GB of linears) only on a host with ~120 GB free;
without the copy oneDNN reads the [in, out] storage as the [out, in] view, as before. oneDNN sums
in its own order: a float32 result within ~1e-6 relative of MKL's (both against float64), not bit
for bit. Where torch was built without oneDNN the MKL path serves every
size. Measured on that AMD machine only; on Intel CPUs not measured.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshserve.workers.kv_budget import available_host_memory

ONEDNN_MIN_ROWS = 2
# The blocked copies may take at most this share of the memory available at load (see above).
PACKED_MEMORY_SHARE = 0.25


def onednn_available() -> bool:
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def onednn_packed(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] float32, copied into oneDNN's blocked layout for its inner product: an
    opaque (`torch._mkldnn` layout) tensor that only `onednn_linear` reads."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, in] @ weight [out, in].T (+ bias) by oneDNN, float32; `weight` strided or `onednn_packed`."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class InputMajorLinear(nn.Linear):
    """An `nn.Linear` whose weight is stored [in, out]: `weight` is the [out, in] transpose view
    (what every other piece of code reads), `weight_t` the contiguous [in, out] tensor the GEMM
    takes. A 2-D input calls `torch.mm` / `torch.addmm` on it directly, the op `F.linear` ends
    in, without F.linear's transposes and matmul dispatch (five more dispatches per call, 25
    calls per decode step of the demo model); from `ONEDNN_MIN_ROWS` rows oneDNN takes the
    product on `weight_packed`, the same values in its blocked layout (`onednn`: default,
    wherever torch has it); other inputs go through `F.linear`."""

    def __init__(self, linear: nn.Linear, *, onednn: bool | None = None, packed: bool = True) -> None:
        nn.Module.__init__(self)
        self.onednn = onednn_available() if onednn is None else onednn
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            self.weight_t = linear.weight.detach().t().contiguous()  # [in, out]
        self.weight = nn.Parameter(self.weight_t.t(), requires_grad=False)  # [out, in] view
        self.bias = linear.bias
        # Not a parameter or buffer: state dicts and loaders see `weight` only. Without the blocked
        # copy (`packed` False: memory) oneDNN reads the [out, in] view of the dense storage.
        self.weight_packed = onednn_packed(self.weight) if self.onednn and packed else None
        self._onednn_weight = self.weight if self.weight_packed is None else self.weight_packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            return F.linear(x, self.weight, self.bias)
        if self.onednn and x.shape[0] >= ONEDNN_MIN_ROWS:
            return onednn_linear(x, self._onednn_weight, self.bias)
        if self.bias is None:
            return torch.mm(x, self.weight_t)
        return torch.addmm(self.bias, x, self.weight_t)


def input_major_linears(model: nn.Module, *, available: int | None = None) -> int:
    """Swap every float32 CPU `nn.Linear` of `model` for an InputMajorLinear; returns how many.
    They get oneDNN's blocked copies while those fit PACKED_MEMORY_SHARE of `available` bytes
    (default: the host's MemAvailable now, kv_budget.available_host_memory).

    Other dtypes (bfloat16 runs through oneDNN, where this was not measured), other devices
    and other layer classes (tensor-parallel, quantized, already swapped) are left as they are.
    """
    swaps = []
    for parent in model.modules():
        for name, child in parent.named_children():
            weight = getattr(child, "weight", None)
            if type(child) is nn.Linear and weight.dtype == torch.float32 and weight.device.type == "cpu":
                swaps.append((parent, name, child))
    available = available_host_memory() if available is None else available
    total = sum(child.weight.numel() * child.weight.element_size() for _, _, child in swaps)
    packed = total <= PACKED_MEMORY_SHARE * available
    for parent, name, child in swaps:
        setattr(parent, name, InputMajorLinear(child, packed=packed))
    return len(swaps)
