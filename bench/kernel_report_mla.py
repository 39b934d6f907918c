"""Compile the TRITON MLA decode variants (bench/mla_decode_variants.py) for a GPU target, with or
without a GPU, and report registers, stack (spills), shared memory, CTAs per SM and SASS counts.

    python -m bench.kernel_report_mla [--arch 90] [--sass DIR]

The same launch interception as bench/kernel_report.py: the backend's real launch path runs on
CPU tensors at DeepSeek-V3 shapes (128 heads, latent 512 + rope 64, pages of 64, bf16, 64 x 4096
with KV splits) and every launch is compiled for sm_<arch> instead of run. Runs on the device
machine too (its Triton is the one that will run the kernels); here, put Triton 3.6 first on
the path to match it: `pip install --no-deps --target /tmp/t36 triton==3.6.0` and
`PYTHONPATH=/tmp/t36:. python -m bench.kernel_report_mla`.
"""

from __future__ import annotations

import torch

from bench.kernel_report import compile_report, report_parser
from bench.mla_decode_variants import HEADS, variants
from meshserve.attention.backend import AttentionProblem
from meshserve.attention.metadata import AttentionMetadata
from meshserve.attention.mla.backends.triton_decode import TritonMLADecodeBackend
from meshserve.attention.mla.cache import LatentCache
from meshserve.attention.mla.spec import mla_spec
from meshserve.attention.spec import MLADims

V3 = MLADims(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
PAGE, BATCH, SEQ = 64, 64, 4096
SASS_OPS = ("HGMMA", "LDGSTS", "LDL", "STL")


def launch_variants(recorder) -> None:
    problem = AttentionProblem(spec=mla_spec(HEADS, V3, scale=V3.qk_head_dim**-0.5), dtype="bfloat16",
                               block_size=PAGE, max_model_len=1 << 17, device="cuda",
                               compute_capability=(9, 0))  # fmt: skip
    pages = SEQ // PAGE
    meta = AttentionMetadata.build(query_lens=[1] * BATCH, seq_lens=[SEQ] * BATCH,
                                   block_tables=[list(range(b * pages, (b + 1) * pages)) for b in range(BATCH)],
                                   block_size=PAGE)  # fmt: skip
    cache = LatentCache.allocate(BATCH * pages, PAGE, V3, dtype=torch.bfloat16)
    q_lat = torch.empty(BATCH, HEADS, V3.kv_lora_rank, dtype=torch.bfloat16)
    q_pe = torch.empty(BATCH, HEADS, V3.qk_rope_head_dim, dtype=torch.bfloat16)
    print("| variant | kernel | registers | stack | shared KB | warps | CTAs/SM (regs, smem) | "
          + " | ".join(SASS_OPS) + " |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|" + "---:|" * len(SASS_OPS))
    for var in variants():
        backend = TritonMLADecodeBackend(problem, config=var.config, num_sms=132)
        recorder.label = var.label.replace(" ", "_")
        before = len(recorder.rows)
        try:
            backend.attend_latent(q_lat, q_pe, cache, backend.plan(meta))
        except Exception as exc:  # a variant that does not compile is a finding, not the end
            print(f"| {var.label} | FAILED: {type(exc).__name__}: {str(exc)[:300]} |", flush=True)
            continue
        for name, _, _, rep in recorder.rows[before:]:
            if "merge" in name:
                continue
            threads = 32 * rep["warps"]
            by_regs = 65536 // (threads * max(rep["registers"], 1))
            by_smem = (227 * 1024) // max(rep["shared"], 1)
            sass = rep.get("sass", {})
            ops = " | ".join(str(sass.get(op, "-")) for op in SASS_OPS)
            print(f"| {var.label} | {name} | {rep['registers']} | {rep['stack']} | {rep['shared'] / 1024:.0f} | "
                  f"{rep['warps']} | {min(by_regs, by_smem)} ({by_regs}, {by_smem}) | {ops} |", flush=True)  # fmt: skip


def main() -> int:
    args = report_parser(__doc__.splitlines()[0]).parse_args()
    return compile_report(launch_variants, "", args)


if __name__ == "__main__":
    raise SystemExit(main())
