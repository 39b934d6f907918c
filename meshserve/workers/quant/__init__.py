"""Quantized weights: FP8 block-scaled and MXFP4 checkpoints as published, and online FP8.

formats.py   what a checkpoint's quantization_config means (and the --quantization values)
fp8.py       FP8 numerics in torch: (de)quantization and the exact reference linear
fp8_triton.py  the sm89+ Triton kernels: per-token-group activation quantization, block GEMM
gemv.py      the one-launch split-K GEMV for decode rows (<= 16): FP8 weights (W8A16) and bf16/fp16
small_m.py   its predecessor, the weight-streaming kernel
gemm_table.py  which formulation a linear runs, by rows and weight format (data)
layers.py    Fp8Linear, Fp8ParallelLMHead (quantize_lm_head at tp > 1), StreamedLinear (bf16/fp16 at
             decode rows, small_m_gemm "on") and the transforms that swap them in
mxfp4.py     MXFP4 (GPT-OSS experts) (de)quantization
loading.py   reading quantized tensors (with their scales) for one tensor-parallel rank
support.py   which devices serve which weight format, as data (docs and `meshserve backends`)
"""
