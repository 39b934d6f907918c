"""The public, single-process API: `LLM(model=DIR).generate(prompts, SamplingParams(...))`.

`LLM.stream(prompt, params)` is an async generator of CompletionDelta served by the one serving
stack: a Coordinator whose one in-process replica runs this LLM's engine (the model is loaded
once). `generate` steps the engine directly (offline batch: every prompt admitted at once).
Use either `generate` or `stream` on one LLM at a time.
`generate_main` is the `meshserve generate` command.

An encoder-only checkpoint (BertModel family) is served for embeddings instead:
`LLM(model=DIR).embed(texts)` (workers/embedder.py); each task refuses the other's calls.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import sys
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from meshserve.cluster.coordinator import ClusterConfig, Coordinator, Runtime
from meshserve.cluster.executors.in_process import InProcessExecutor
from meshserve.config import (
    DEFAULT_BLOCK_SIZE,
    QUANTIZATION_HELP,
    QUANTIZE_LM_HEAD_HELP,
    SMALL_M_GEMM_HELP,
    AttentionConfig,
    CacheConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SmallMGemm,
)
from meshserve.core.beam_params import BeamSearchParams
from meshserve.core.checkpoint_files import read_model_task
from meshserve.core.outputs import (
    BeamSearchOutput,
    BeamSequence,
    ChoiceAccumulator,
    CompletionDelta,
    RequestOutput,
)
from meshserve.core.sampling_params import SamplingParams
from meshserve.engine.engine_config import EngineConfig
from meshserve.engine.engine_core import EngineCore
from meshserve.engine.request import Request
from meshserve.errors import ConfigError, MeshserveError, check
from meshserve.workers.embedder import Embedder, EmbeddingOutput, EmbedInput

Prompt = str | Sequence[int]


class LLM:
    """A model served in this process (one rank, in-process executor).

    model: HF checkpoint directory, or a hub model id "org/name" at `revision` (None: the bundled demo model).
    num_kv_blocks / kv_cache_memory_bytes: KV pool size (default: 85% of free GPU memory, or
    256 MiB on CPU). The other settings are those of ModelConfig, CacheConfig, SchedulerConfig.
    warmup: three short greedy requests through the engine at start, so that kernels built or
    compiled at first use are built then (None: on CUDA; engine/warmup.py).
    block_size: default 16 for generative models; for embedding models the naive layout
    (block_size == max_model_len) unless a smaller block size asks for the paged flash path.
    `task` is "generate" or "embed" (read from the checkpoint's architecture).
    """

    def __init__(self, model: str | Path | None = None, *, dtype: str = "auto", attention_backend: str | None = None,
                 block_size: int | None = None, max_model_len: int | None = None, num_kv_blocks: int | None = None,
                 kv_cache_memory_bytes: int | None = None, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 8192, enable_chunked_prefill: bool = True,
                 enable_prefix_caching: bool = True, seed: int = 0, device: str | None = None,
                 enforce_eager: bool = False, async_scheduling: bool | None = None, progress: bool = True,
                 revision: str | None = None, quantization: str = "none", small_m_gemm: str = "auto",
                 quantize_lm_head: bool = False, warmup: bool | None = None,
                 piecewise_graph_tokens: int = 1024) -> None:
        if model is None:
            from meshserve.demo_model import DEMO_MODEL_DIR

            model = DEMO_MODEL_DIR
        else:  # a folder, or a hub model id (downloaded into the hub cache unless HF_HUB_OFFLINE)
            from meshserve.api.hub import resolve_model

            model = resolve_model(model, revision=revision, progress=progress)
        self.model_dir = str(model)
        self.task = read_model_task(model)
        self.core: EngineCore | None = None
        self.embedder: Embedder | None = None
        self._device = device
        self._service: asyncio.Task | None = None  # starts (then holds) the Coordinator of `stream`
        self._service_loop: asyncio.AbstractEventLoop | None = None
        self._stream_ids = itertools.count()
        if self.task == "embed":
            check(not quantize_lm_head, "quantize_lm_head", quantize_lm_head,
                  "false for an embedding model (it has no LM head)")
            self.embedder = Embedder(model, dtype=dtype, attention_backend=attention_backend, block_size=block_size,
                                     max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens,
                                     device=device)
            return
        block_size = DEFAULT_BLOCK_SIZE if block_size is None else block_size
        config = EngineConfig(
            model=ModelConfig(model=str(model), dtype=dtype, max_model_len=max_model_len, seed=seed,
                              enforce_eager=enforce_eager, cuda_graph_max_batch=max(1, min(max_num_seqs, 512)),
                              quantization=quantization, small_m_gemm=small_m_gemm,
                              quantize_lm_head=quantize_lm_head, warmup=warmup,
                              piecewise_graph_tokens=piecewise_graph_tokens),
            cache=CacheConfig(block_size=block_size, num_kv_blocks=num_kv_blocks,
                              kv_cache_memory_bytes=kv_cache_memory_bytes,
                              enable_prefix_caching=enable_prefix_caching),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                      enable_chunked_prefill=enable_chunked_prefill,
                                      async_scheduling=async_scheduling),
            attention=AttentionConfig(backend=attention_backend),
        )
        self.core = EngineCore(config, executor=InProcessExecutor(config, device=device, progress=progress))

    @property
    def tokenizer(self):
        return self.embedder.tokenizer if self.embedder is not None else self.core.tokenizer

    def _require(self, task: str, call: str) -> None:
        """Refuse `call` unless this model's task is `task`, naming the model and its task."""
        if self.task != task:
            other = "LLM.embed" if self.task == "embed" else "LLM.generate / LLM.stream"
            raise ConfigError("model", self.model_dir, f"a {task} model for {call}; this checkpoint's task is "
                              f"'{self.task}' (use {other})")

    def embed(self, inputs: EmbedInput | Sequence[EmbedInput], *, truncate: bool = False) -> list[EmbeddingOutput]:
        """One pooled embedding per input (text or token ids), in order (see workers/embedder.py).

        Inputs longer than max_model_len are refused (ConfigError naming the limit) unless
        `truncate`; every input is validated before any is run.
        """
        self._require("embed", "embed")
        return self.embedder.embed(inputs, truncate=truncate)

    def generate(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None
                 = None) -> list[RequestOutput]:
        """Generate for every prompt (text, or token ids); outputs in the prompts' order.

        All prompts are validated before any is queued: one bad prompt refuses the whole call.
        """
        self._require("generate", "generate")
        prompts = _prompt_list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        check(len(params) == len(prompts), "params", len(params), f"one SamplingParams or {len(prompts)}")
        check(not self.core.has_unfinished(), "generate", "busy", "no requests in flight (one call at a time)")
        requests = []
        for prompt, p in zip(prompts, params):
            requests.append(self.core.make_request(prompt, p))
        ids = [r.request_id for r in requests]
        check(len(set(ids)) == len(ids), "request_id", ids, "distinct ids")
        return [self._output(r, choices) for r, choices in zip(requests, self._run_all(requests))]

    def _run_all(self, requests: Sequence[Request]) -> list[ChoiceAccumulator]:
        """Queue checked requests, step the engine until all are done: each one's completions."""
        for req in requests:
            self.core.add(req)
        choices = {r.request_id: ChoiceAccumulator() for r in requests}
        errors = []
        while self.core.has_unfinished():
            for delta in self.core.step():
                if delta.error is not None:  # refused after admission (a grammar that did not compile)
                    errors.append(delta.error)
                    continue
                choices[delta.request_id].add(delta)
        if errors:  # as a refusal before queueing: the call fails, naming the field (the others ran to the end)
            raise errors[0]
        return [choices[r.request_id] for r in requests]

    def _output(self, req: Request, choices: ChoiceAccumulator) -> RequestOutput:
        outputs = choices.outputs()
        if req.params.num_samples == 1:
            return self.core.output_of(req, outputs[0].text if outputs else "")
        first = outputs[0]
        return RequestOutput(request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_ids,
                             token_ids=first.token_ids, text=first.text, finish_reason=first.finish_reason,
                             stop_reason=first.stop_reason, logprobs=first.logprobs, outputs=outputs,
                             prompt_logprobs=choices.prompt_logprobs)

    def beam_search(self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams) -> list[BeamSearchOutput]:
        """Beam search for every prompt (text, or token ids), as HF transformers' generate(num_beams=
        beam_width, do_sample=False) ranks beams; one output per prompt, its `.sequences` best
        first. The beams of all prompts are batched together; they share their prompt's blocks
        and fork copy-on-write (engine/beam_search.py). Every prompt is validated first."""
        self._require("generate", "beam_search")
        check(isinstance(params, BeamSearchParams), "params", type(params).__name__, "a BeamSearchParams")
        prompts = _prompt_list(prompts)
        check(not self.core.has_unfinished(), "beam_search", "busy", "no requests in flight (one call at a time)")
        requests = [self.core.make_request(prompt, beam=params) for prompt in prompts]
        penalty = params.length_penalty
        return [BeamSearchOutput(r.prompt, r.prompt_ids, [
            BeamSequence(c.token_ids, c.cumulative_logprob, c.cumulative_logprob / len(c.token_ids) ** penalty,
                         c.text, c.finish_reason) for c in choices.outputs()])
            for r, choices in zip(requests, self._run_all(requests))]

    async def stream(self, prompt: Prompt, params: SamplingParams | None = None, *,
                     request_id: str | None = None) -> AsyncIterator[CompletionDelta]:
        """Deltas of one request as they are produced, through the Coordinator (the service
        conventions of cluster/service.py: bad input raises before anything is queued; leaving
        the stream early aborts the request and frees its blocks)."""
        self._require("generate", "stream")
        service = await self._serving()
        rid = request_id if request_id is not None else f"stream-{next(self._stream_ids)}"
        async with contextlib.aclosing(service.generate(prompt, params, request_id=rid)) as deltas:
            async for delta in deltas:
                yield delta

    def _serving(self) -> asyncio.Task:
        """The Coordinator over this LLM's engine, started once per event loop (a loop that
        ended took the previous one's replica task with it)."""
        loop = asyncio.get_running_loop()
        if self._service_loop is not loop:
            self._service_loop = loop
            self._service = loop.create_task(self._start_service())
        return self._service

    async def _start_service(self) -> Coordinator:
        core = self.core
        core.drain()
        for rid in list(core.scheduler.requests):  # left behind by streams of an ended loop
            core.abort(rid)
        config = ClusterConfig(engine=core.config, runtime=Runtime.IN_PROCESS, device=self._device)
        return await Coordinator(config, core=core).start()

    def shutdown(self) -> None:
        if self.core is not None:
            self.core.shutdown()


def _prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt (text, or token ids) or several, as a list of prompts."""
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


# -- `meshserve generate` -------------------------------------------------------------------------


def add_generate_parser(subparsers) -> argparse.ArgumentParser:
    """Register `generate` on the CLI's subparsers; the parsed args go to `generate_main`."""
    p = subparsers.add_parser("generate", help="generate text from a prompt, streamed to stdout")
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--model", default=None,
                   help="HF checkpoint directory, or a hub model id org/name (default: the bundled demo model)")
    p.add_argument("--revision", default=None, help="branch, tag or commit of a hub model id")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--dtype", default="auto", help="auto, float32, float16, bfloat16")
    p.add_argument("--quantization", default="none", help=QUANTIZATION_HELP)
    p.add_argument("--quantize-lm-head", action="store_true", help=QUANTIZE_LM_HEAD_HELP)
    p.add_argument("--small-m-gemm", default="auto", choices=[v.value for v in SmallMGemm], help=SMALL_M_GEMM_HELP)
    p.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default: cuda when present")
    p.add_argument("--attention-backend", default=None,
                   help="CPU_SDPA, TORCH, TRITON, FLASHINFER, or prefill=NAME,decode=NAME (default: automatic)")
    p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (one process each)")
    p.add_argument("--dcp", type=int, default=1, help="decode-context-parallel ranks (a divisor of --tp)")
    p.add_argument("--ep", type=int, default=1,
                   help="expert-parallel ranks for MoE models (divides --tp and the number of experts)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode steps")
    p.add_argument("--no-async-scheduling", action="store_true",
                   help="no overlap of planning and running (default: overlap on CUDA, where it pays)")
    p.add_argument("--dcp-comm", default="ag_rs", choices=["ag_rs", "a2a"], help="how DCP partial outputs merge")
    p.set_defaults(func=generate_main)
    return p


REFUSED_EXIT = 2  # the CLI's exit status for a refused configuration (cli.main)


def generate_main(args: argparse.Namespace) -> int:
    """Stream the continuation of `args.prompt` to stdout; the reason it ended goes to stderr.

    With --tp > 1 one process per rank runs the replica in lock-step (cluster/executors/spmd.py); rank 0 prints.
    """
    if args.model is not None:  # a hub id becomes its snapshot folder once, before any rank starts
        from meshserve.api.hub import resolve_model

        args.model, args.revision = resolve_model(args.model, revision=args.revision,
                                                  progress=sys.stderr.isatty()), None
    if args.tp > 1:
        import torch.multiprocessing as mp

        from meshserve.parallel.groups import local_rendezvous

        # Refuse bad layouts before spawning.
        ParallelConfig(tp=args.tp, dcp=args.dcp, dcp_comm=args.dcp_comm, ep=args.ep)
        import tempfile

        with tempfile.TemporaryDirectory(prefix="meshserve-generate-") as errors:
            try:
                mp.start_processes(_generate_rank, args=(args, local_rendezvous(), errors), nprocs=args.tp,
                                   join=True, start_method="spawn")
            except mp.ProcessExitedException as exc:
                if exc.exit_code != REFUSED_EXIT:
                    raise
                # Every rank that refused wrote why; the same reason from several ranks prints once.
                reasons = [f.read_text() for f in sorted(Path(errors).glob("rank*.txt"))]
                for reason in dict.fromkeys(reasons):
                    print(f"meshserve: error: {reason}", file=sys.stderr)
                return REFUSED_EXIT
        return 0
    llm = LLM(args.model, dtype=args.dtype, attention_backend=args.attention_backend, block_size=args.block_size,
              enforce_eager=args.enforce_eager, async_scheduling=False if args.no_async_scheduling else None,
              max_model_len=args.max_model_len, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
              device=args.device, progress=sys.stderr.isatty(), quantization=args.quantization,
              small_m_gemm=args.small_m_gemm, quantize_lm_head=args.quantize_lm_head,
              warmup=False)  # one request: a warm-up would only run before it what it builds anyway
    try:
        _stream(llm.core, args, echo=True)
    finally:
        llm.shutdown()
    return 0


def _params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                          repetition_penalty=args.repetition_penalty, seed=args.seed, max_tokens=args.max_tokens,
                          stop=tuple(args.stop), ignore_eos=args.ignore_eos)


def _stream(core: EngineCore, args: argparse.Namespace, *, echo: bool) -> None:
    """Run one request to the end; with echo, print the prompt (decoder-only models), the text as it
    comes and the reason."""
    core.add_request(args.prompt, _params(args))
    if echo and not core.info.is_encoder_decoder:  # an encoder-decoder's output does not continue its input
        sys.stdout.write(args.prompt)
    reason = None
    while core.has_unfinished():
        for delta in core.step():
            if echo:
                sys.stdout.write(delta.text)
                sys.stdout.flush()
            if delta.finished:
                reason = delta.finish_reason
    if echo:
        sys.stdout.write("\n")
        print(f"[finished: {reason}]", file=sys.stderr)


def _generate_rank(rank: int, args: argparse.Namespace, init_method: str, errors: str) -> None:
    """One rank of `generate --tp N`; a refused configuration exits REFUSED_EXIT with its reason in
    errors/rank<rank>.txt (the parent prints it once, not a traceback per rank)."""
    from meshserve.cluster.executors.spmd import SpmdExecutor
    from meshserve.workers.worker import Worker

    if args.model is None:
        from meshserve.demo_model import DEMO_MODEL_DIR

        args.model = str(DEMO_MODEL_DIR)
    config = EngineConfig(
        model=ModelConfig(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
                          enforce_eager=args.enforce_eager, quantization=args.quantization,
                          small_m_gemm=args.small_m_gemm, quantize_lm_head=args.quantize_lm_head, warmup=False),
        cache=CacheConfig(block_size=args.block_size, kv_cache_memory_bytes=args.kv_cache_memory_bytes),
        attention=AttentionConfig(backend=args.attention_backend),
        parallel=ParallelConfig(tp=args.tp, dcp=args.dcp, dcp_comm=args.dcp_comm, ep=args.ep),
    )
    try:
        worker = Worker(config.model, config.cache, config.attention, config.parallel, rank=rank,
                        device=args.device, progress=False, init_method=init_method)
        core = EngineCore(config, executor=SpmdExecutor(worker))
    except MeshserveError as exc:
        Path(errors, f"rank{rank:05d}.txt").write_text(str(exc))
        sys.exit(REFUSED_EXIT)
    try:
        _stream(core, args, echo=rank == 0)
    finally:
        core.shutdown()
