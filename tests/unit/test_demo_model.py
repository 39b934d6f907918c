"""The shipped demo checkpoint, checked with Hugging Face's own code as the independent reader.

HF transformers' LlamaForCausalLM and AutoTokenizer are the oracle for "this is a genuine HF
checkpoint"; the corpus it was trained on (pydoc_data.topics, shipped with CPython) is the
oracle for "its greedy output reads as English". The meshserve-side loader is tested elsewhere.
"""

import json
import math
import os
import re
import string

import pytest
import torch

from meshserve.demo_model import DEMO_MODEL_DIR

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

MAX_BYTES = 20 * 1024 * 1024
CHECKPOINT_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)
# Prose prompts whose continuations are documentation sentences (others may continue into
# grammar rules, which are real text too but make a weaker English check).
PROSE_PROMPTS = ("The for statement is used to", "An exception is raised when")
NEW_TOKENS = 30
# Stripped from word edges: ASCII punctuation plus the typographic quotes and ellipsis
# that the Python docs use.
EDGE_CHARS = string.punctuation + "\u2018\u2019\u201c\u201d\u2026"


def _topics() -> dict[str, str]:
    """The training corpus as shipped with the running Python: topic name -> text."""
    import pydoc_data.topics

    return dict(sorted(pydoc_data.topics.topics.items()))


def _words(text: str) -> list[str]:
    """Whitespace-separated words, lower-cased, with surrounding punctuation removed."""
    stripped = (word.strip(EDGE_CHARS).lower() for word in text.split())
    return [word for word in stripped if word]


@pytest.fixture(scope="module")
def hf_tokenizer():
    return transformers.AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)


@pytest.fixture(scope="module")
def hf_model():
    # Upcast the bfloat16 weights (exactly) to float32: bfloat16 matmuls on CPU are ~10x slower.
    model = transformers.AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32)
    return model.eval()


def test_checkpoint_files_exist_and_fit_the_size_budget():
    sizes = {name: (DEMO_MODEL_DIR / name).stat().st_size for name in CHECKPOINT_FILES}
    total = sum(path.stat().st_size for path in DEMO_MODEL_DIR.iterdir() if path.is_file())
    assert total <= MAX_BYTES, f"demo model folder is {total} bytes, over {MAX_BYTES}: {sizes}"


def test_config_is_a_small_gqa_llama_matching_its_tokenizer(hf_tokenizer):
    config = json.loads((DEMO_MODEL_DIR / "config.json").read_text())
    generation = json.loads((DEMO_MODEL_DIR / "generation_config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_key_value_heads"] < config["num_attention_heads"]  # exercises GQA
    assert config["vocab_size"] == len(hf_tokenizer)
    assert config["eos_token_id"] == generation["eos_token_id"] == hf_tokenizer.eos_token_id
    assert config["bos_token_id"] == hf_tokenizer.bos_token_id


def test_model_has_a_few_million_bfloat16_parameters():
    from safetensors import safe_open

    with safe_open(DEMO_MODEL_DIR / "model.safetensors", framework="pt") as handle:
        dtypes = {handle.get_slice(name).get_dtype() for name in handle.keys()}
        count = sum(math.prod(handle.get_slice(name).get_shape()) for name in handle.keys())
    assert dtypes == {"BF16"}
    assert 1_000_000 <= count <= 10_000_000, count


def test_raw_and_hf_tokenizers_agree_and_prepend_bos(hf_tokenizer):
    raw = tokenizers.Tokenizer.from_file(str(DEMO_MODEL_DIR / "tokenizer.json"))
    for text in ("The for statement is used to", "x = [i ** 2 for i in range(10)]\n\tpass", "naïve café €5"):
        ids = raw.encode(text).ids
        assert ids == hf_tokenizer(text).input_ids
        assert ids[0] == hf_tokenizer.bos_token_id
        assert ids.count(hf_tokenizer.bos_token_id) == 1


def test_tokenizer_round_trips_the_whole_corpus_and_arbitrary_unicode(hf_tokenizer):
    raw = tokenizers.Tokenizer.from_file(str(DEMO_MODEL_DIR / "tokenizer.json"))
    texts = ["\n\n".join(_topics().values()), "  leading spaces, emoji \U0001f40d, CJK \u6f22\u5b57, tab\tend  "]
    for text in texts:
        assert raw.decode(raw.encode(text).ids, skip_special_tokens=True) == text
    assert hf_tokenizer.decode(hf_tokenizer(texts[1]).input_ids, skip_special_tokens=True) == texts[1]


def test_weights_are_trained_on_the_documentation(hf_model, hf_tokenizer):
    """An untrained model scores ~8.3 nats/token (ln 4096); the shipped one knows the text."""
    passage = _topics()["for"][:1200]
    ids = hf_tokenizer(passage, return_tensors="pt").input_ids
    with torch.no_grad():
        loss = hf_model(input_ids=ids, labels=ids).loss.item()
    assert loss < 2.0, f"mean next-token loss {loss:.2f} on a training passage"


@pytest.mark.parametrize("prompt", PROSE_PROMPTS)
def test_greedy_continuation_reads_as_english(hf_model, hf_tokenizer, prompt):
    vocabulary = set(_words("\n".join(_topics().values())))
    inputs = hf_tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        out = hf_model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
    continuation = hf_tokenizer.decode(out[0, inputs.input_ids.shape[1] :], skip_special_tokens=True)
    words = _words(continuation)
    known = [word for word in words if word in vocabulary]
    alphabetic = [word for word in words if re.fullmatch(r"[a-z]+(?:['\u2019][a-z]+)?", word)]
    assert len(words) >= 10, f"too few words in {continuation!r}"
    assert len(known) >= 0.7 * len(words), f"unknown words in {continuation!r}"
    assert len(alphabetic) >= 0.6 * len(words), f"mostly non-words in {continuation!r}"
    assert len(set(words)) >= 0.5 * len(words), f"degenerate repetition in {continuation!r}"
