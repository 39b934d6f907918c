"""The core layer: vocabulary every other layer may import, importing none of them.

sampling_params.py  SamplingParams: how to pick the next token and when to stop
outputs.py          FinishReason, TokenLogprobs, CompletionDelta, RequestOutput: what callers get back

meshserve/config.py (every user-facing setting) and meshserve/errors.py (the errors) belong to
this layer too; they sit at the top of the package because every layer reads them.
Layers, highest first: api -> cluster -> workers -> {parallel, kvstore, attention} -> core;
tests/unit/test_import_layers.py checks it.
"""
