"""Suite-wide environment: set before any module that defines Triton kernels is imported."""

import atexit
import os
import shutil
import tempfile

import torch

# Without CUDA, Triton kernels run in the interpreter (see PLATFORM.md); it must be set before
# the first `@triton.jit` is defined, hence here, at the root of the suite.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    from tests.triton_interpreter import skip_repeated_patching

    skip_repeated_patching()  # same interpreted operations, a third less time (see the module)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Nothing from a hub cache the suite did not build: an empty one of its own, whatever the machine
# holds under ~/.cache/huggingface (a test that passes only because a cache was warm fails in CI).
_hub_home = tempfile.mkdtemp(prefix="meshserve-tests-hf-")
atexit.register(shutil.rmtree, _hub_home, ignore_errors=True)
for _name in ("HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
    os.environ.pop(_name, None)
os.environ["HF_HOME"] = _hub_home
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The suite's tensors are tiny and the CI machine has 2 shared cores: a second intra-op thread
# buys nothing, and when the cores are busy its spin-waits made engine tests ~7x slower.
if "OMP_NUM_THREADS" not in os.environ:
    torch.set_num_threads(1)
