"""GPU tests: each file skips cleanly without CUDA (bench/device_benches.sh runs them on the device)."""

# Tiny checkpoints that may run on FLASHINFER take this head size: the one the prebuilt FlashInfer
# modules serve (bench/flashinfer_aot.sh: the Llama-3-8B shape's 128). Any other size JIT-builds its
# modules inside the test, 1-2 minutes each, past a device call's per-file limit (2026-12-06: the
# decode- and piecewise-graph files at head_dim 64 timed out at 120 s with FlashInfer installed).
FLASHINFER_HEAD_DIM = 128
