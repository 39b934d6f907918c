"""Train meshserve's embedded demo model: a small Llama on Python's own documentation.

The corpus is `pydoc_data.topics` (the English help text that ships with CPython), so the
model can be rebuilt anywhere Python runs, with nothing downloaded. The result is an ordinary
Hugging Face checkpoint (config.json, generation_config.json, model.safetensors,
tokenizer.json, tokenizer_config.json) that any HF-format loader reads.

Two stages, so that the tokenizer can be built on one machine and the model trained on another:

    # CPU: tokenizer only (deterministic), plus a pinned copy of the corpus text
    python scripts/train_demo_model.py --stage tokenizer --out /tmp/demo
    # GPU (or CPU with --steps 50 for a smoke run): the model, reusing that tokenizer
    python scripts/train_demo_model.py --stage model --out /tmp/demo --tokenizer-dir /tmp/demo \
        --corpus-file /tmp/demo/corpus.txt --device cuda

`--stage all` (the default) does both in one process.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import time
from pathlib import Path

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
# Separates the documentation topics in the pinned corpus file; never occurs in the text.
TOPIC_SEPARATOR = "\n\x1e\n"
# The model continues text, so chat continues the conversation's text: a user message is the
# prompt as written (chat over one user message equals a completion of its text).
DEMO_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] + '\\n\\n' }}"
    "{% elif message['role'] == 'user' %}{{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('the demo model knows the roles system, user and assistant') }}"
    "{% endif %}{% endfor %}")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
SAMPLE_PROMPTS = (
    "The for statement is used to",
    "A function definition",
    "The import statement",
    "An exception is raised when",
)


def load_topics(corpus_file: Path | None) -> list[str]:
    """The documentation topics as a list of strings, in a fixed (sorted-key) order.

    A pinned corpus file (written by the tokenizer stage) makes the model stage independent of
    the Python version it runs under: each CPython release ships slightly different text.
    """
    if corpus_file is not None:
        return corpus_file.read_text(encoding="utf-8").split(TOPIC_SEPARATOR)
    import pydoc_data.topics

    return [pydoc_data.topics.topics[key] for key in sorted(pydoc_data.topics.topics)]


def train_tokenizer(topics: list[str], *, vocab_size: int, out_dir: Path, max_len: int) -> None:
    """Byte-level BPE over the topics; writes tokenizer.json and tokenizer_config.json.

    The post-processor prepends BOS, so the raw `tokenizers` library and HF AutoTokenizer
    encode a prompt identically (ids 0 and 1 are BOS and EOS).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(topics, trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    # Written by hand rather than by transformers so the file does not depend on its version.
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "add_bos_token": True,
        "model_max_length": max_len,
        "clean_up_tokenization_spaces": False,
        "chat_template": DEMO_CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def token_stream(topics: list[str], tokenizer_dir: Path) -> tuple[list[int], list[int]]:
    """Encode every topic as BOS text EOS; the last 5% of each topic is held out for validation.

    Holding out a slice of every topic (rather than whole topics) keeps the validation text
    representative of the whole corpus, whose topics range from 200 to 60,000 characters.
    """
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    eos_id = tokenizer.token_to_id(EOS)
    train, val = [], []
    for text in topics:
        ids = tokenizer.encode(text).ids + [eos_id]  # encode() already starts with BOS
        cut = len(ids) - len(ids) // 20
        train.extend(ids[:cut])
        val.extend(ids[cut:])
    return train, val


def build_model(args: argparse.Namespace, vocab_size: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        max_position_embeddings=args.max_positions,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    return LlamaForCausalLM(config)


def batches(stream, *, seq_len: int, batch_size: int, generator):
    """Random windows of seq_len + 1 tokens: int64 [batch_size, seq_len + 1]."""
    import torch

    starts = torch.randint(0, stream.numel() - seq_len - 1, (batch_size,), generator=generator)
    return torch.stack([stream[s : s + seq_len + 1] for s in starts.tolist()])


def evaluate(model, stream, *, seq_len: int, device) -> float:
    """Mean next-token loss over consecutive windows of the whole stream."""
    import torch

    model.eval()
    windows = stream[: (stream.numel() - 1) // seq_len * seq_len + 1]
    inputs = windows[:-1].view(-1, seq_len)
    labels = windows[1:].view(-1, seq_len)
    losses = []
    with torch.no_grad(), autocast(device):
        for i in range(0, inputs.shape[0], 32):
            logits = model(input_ids=inputs[i : i + 32].to(device)).logits.float()
            losses.append(
                torch.nn.functional.cross_entropy(
                    logits.flatten(0, 1), labels[i : i + 32].to(device).flatten(), reduction="sum"
                )
            )
    model.train()
    return (torch.stack(losses).sum() / labels.numel()).item()


def autocast(device):
    import contextlib

    import torch

    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def learning_rate(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def greedy_samples(model, tokenizer_dir: Path, device, *, new_tokens: int) -> list[str]:
    """Greedy continuations of SAMPLE_PROMPTS with the freshly trained weights."""
    import torch
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    model.eval()
    samples = []
    for prompt in SAMPLE_PROMPTS:
        ids = torch.tensor([tokenizer.encode(prompt).ids], device=device)
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, eos_token_id=1)
        samples.append(tokenizer.decode(out[0].tolist(), skip_special_tokens=True))
    model.train()
    return samples


def train_model(args: argparse.Namespace, topics: list[str], tokenizer_dir: Path, out_dir: Path) -> None:
    import torch
    from tokenizers import Tokenizer
    from transformers import GenerationConfig

    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    train_ids, val_ids = token_stream(topics, tokenizer_dir)
    train_stream = torch.tensor(train_ids, dtype=torch.int64)
    val_stream = torch.tensor(val_ids, dtype=torch.int64)
    vocab_size = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).get_vocab_size()
    model = build_model(args, vocab_size).to(device)
    num_params = sum(p.numel() for p in model.parameters())
    print(
        f"train tokens {train_stream.numel()}, val tokens {val_stream.numel()}, "
        f"vocab {vocab_size}, params {num_params / 1e6:.2f}M, device {device}",
        flush=True,
    )

    optimizer = torch.optim.AdamW(
        model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay
    )
    generator = torch.Generator().manual_seed(args.seed)
    started = time.perf_counter()
    for step in range(args.steps):
        if args.time_limit and time.perf_counter() - started > args.time_limit:
            print(f"time limit of {args.time_limit}s reached at step {step}; stopping early", flush=True)
            break
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args)
        batch = batches(train_stream, seq_len=args.seq_len, batch_size=args.batch, generator=generator)
        batch = batch.to(device, non_blocking=True)
        with autocast(device):
            loss = _next_token_loss(model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % args.log_every == 0 or step == args.steps - 1:
            line = f"step {step:5d}  lr {learning_rate(step, args):.2e}  train loss {loss.item():.3f}"
            if step % (args.log_every * 5) == 0 or step == args.steps - 1:
                line += f"  val loss {evaluate(model, val_stream, seq_len=args.seq_len, device=device):.3f}"
            print(f"{line}  ({time.perf_counter() - started:.0f}s)", flush=True)
        if args.sample_every and step > 0 and step % args.sample_every == 0:
            for sample in greedy_samples(model, tokenizer_dir, device, new_tokens=args.sample_tokens):
                print(f"SAMPLE@{step}:", repr(sample), flush=True)

    train_loss = evaluate(model, train_stream, seq_len=args.seq_len, device=device)
    print(f"final train-set loss {train_loss:.3f}", flush=True)
    # Sample from the weights as shipped (bfloat16), not the float32 training copy.
    model = model.to(dtype=torch.bfloat16)
    for sample in greedy_samples(model, tokenizer_dir, device, new_tokens=args.sample_tokens):
        print("SAMPLE:", repr(sample), flush=True)

    out_dir.mkdir(parents=True, exist_ok=True)
    model = model.to("cpu")
    model.generation_config = GenerationConfig(
        bos_token_id=0, eos_token_id=1, pad_token_id=1, do_sample=False, max_new_tokens=64
    )
    model.save_pretrained(out_dir)
    if tokenizer_dir.resolve() != out_dir.resolve():
        for name in TOKENIZER_FILES:
            shutil.copy(tokenizer_dir / name, out_dir / name)
    for path in sorted(out_dir.iterdir()):
        print(f"wrote {path.name}: {path.stat().st_size} bytes", flush=True)


def _next_token_loss(model, batch):
    """Cross-entropy of token t+1 given tokens <= t; batch is int64 [B, L + 1]."""
    import torch

    logits = model(input_ids=batch[:, :-1]).logits  # [B, L, vocab]
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--stage", choices=("all", "tokenizer", "model"), default="all")
    parser.add_argument("--out", type=Path, required=True, help="folder for the checkpoint files")
    parser.add_argument("--tokenizer-dir", type=Path, help="reuse this tokenizer (model stage)")
    parser.add_argument("--corpus-file", type=Path, help="pinned corpus written by the tokenizer stage")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--max-positions", type=int, default=2048)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3000, help="use ~50 for a CPU smoke run")
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--time-limit", type=float, default=0.0, help="stop training after N seconds")
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--sample-every", type=int, default=0, help="print greedy samples every N steps")
    parser.add_argument("--sample-tokens", type=int, default=40)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    random.seed(args.seed)
    topics = load_topics(args.corpus_file)
    print(f"corpus: {len(topics)} topics, {sum(map(len, topics))} characters", flush=True)
    if args.stage in ("all", "tokenizer"):
        train_tokenizer(topics, vocab_size=args.vocab_size, out_dir=args.out, max_len=args.max_positions)
        # Pin the exact text so that a model trained under another Python version sees the same corpus.
        (args.out / "corpus.txt").write_text(TOPIC_SEPARATOR.join(topics), encoding="utf-8")
        print(f"tokenizer written to {args.out}", flush=True)
    if args.stage in ("all", "model"):
        tokenizer_dir = args.tokenizer_dir or args.out
        train_model(args, topics, tokenizer_dir, args.out)


if __name__ == "__main__":
    main()
