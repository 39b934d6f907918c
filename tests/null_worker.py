"""`NullWorker`: the Worker protocol without a model, to measure and test the cluster machinery.

Same constructor and methods as workers.worker.Worker, so an executor runs it in place of the
real one (`worker_class="tests.null_worker:NullWorker"`). A step costs only the
msgpack decode and encode, so the time an executor adds per step is what is left.

Its "model" is a fixed function of each sequence: the next token is
`next_token(all tokens so far)`. With tp > 1 the ranks join one gloo group at start (the
replica's rendezvous) and every step all-reduces the tokens each rank computed from its own copy
of the plan: rank 0 checks that all ranks agree, so a plan that did not reach every rank, or
ranks started without one rendezvous, fail loudly. A prompt containing POISON_TOKEN makes the
step raise (failure tests).
"""

from __future__ import annotations

from meshserve.config import AttentionConfig, CacheConfig, ModelConfig, ParallelConfig
from meshserve.errors import check
from meshserve.workers.step import SampledToken, StepOutput, StepPlan
from meshserve.workers.worker import WorkerInfo

VOCAB = 320
MAX_MODEL_LEN = 256
POISON_TOKEN = 299


def next_token(tokens: list[int]) -> int:
    """The NullWorker's "model": a deterministic token from the whole sequence."""
    h = 17
    for t in tokens:
        h = (h * 31 + t) % 1_000_003
    return 1 + h % (POISON_TOKEN - 1)  # never EOS (0) nor the poison token


class NullWorker:
    def __init__(self, model: ModelConfig, cache: CacheConfig, attention: AttentionConfig | None = None,
                 parallel: ParallelConfig | None = None, *, rank: int = 0, device: str | None = None,
                 progress: bool = True, init_method: str | None = None) -> None:
        self.cache = cache
        self.parallel = parallel or ParallelConfig()
        self.rank = rank
        self.init_method = init_method
        self.runner = None  # no KV caches: a hand-over from it is refused, and recomputed
        self.info: WorkerInfo | None = None
        self._seqs: dict[str, list[int]] = {}
        self._group = None
        self._done: list[bytes] = []  # outputs of submitted steps, oldest first

    def start(self) -> WorkerInfo:
        if self.parallel.tp > 1:
            import torch.distributed as dist

            check(self.init_method is not None, "init_method", None, "a rendezvous address when tp > 1")
            dist.init_process_group("gloo", init_method=self.init_method, world_size=self.parallel.tp,
                                    rank=self.rank)
            self._group = dist.group.WORLD
        self.info = WorkerInfo(rank=self.rank, num_kv_blocks=self.cache.num_kv_blocks or 64,
                               block_size=self.cache.block_size, max_model_len=MAX_MODEL_LEN, vocab_size=VOCAB,
                               eos_token_ids=(0,), backend="NULL", dtype="float32")
        return self.info

    def submit(self, plan: StepPlan) -> None:
        """The Worker's overlap pair (submit, then collect), each step computed at once as a CPU
        worker computes it: a poisoned step fails here, at its submit."""
        self._done.append(self.execute_step(plan.to_msgpack()))

    def step_ready(self) -> bool:
        return True

    def collect(self) -> StepOutput:
        return StepOutput.from_msgpack(self._done.pop(0))

    def execute_step(self, plan_bytes: bytes) -> bytes:
        plan = StepPlan.from_msgpack(plan_bytes)
        for new in plan.new_requests:
            self._seqs[new.request_id] = list(new.prompt_ids) + list(new.output_ids)
        drawn = []
        for seq in plan.all_seqs():
            if POISON_TOKEN in seq.token_ids:
                raise RuntimeError(f"poisoned request {seq.request_id} on rank {self.rank}")
            known = self._seqs[seq.request_id]
            if seq.sample:
                drawn.append((seq.request_id, next_token(known[:seq.seq_len])))
        if self._group is not None:
            self._agree([t for _, t in drawn])
        sampled = []
        for rid, tok in drawn:
            self._seqs[rid].append(tok)
            sampled.append(SampledToken(rid, tok))
        for rid in plan.finished:
            self._seqs.pop(rid, None)
        return StepOutput.of(plan.step_id, sampled if self.rank == 0 else []).to_msgpack()

    def _agree(self, tokens: list[int]) -> None:
        import torch
        import torch.distributed as dist

        mine = torch.tensor(tokens, dtype=torch.int64)
        total = mine.clone()
        dist.all_reduce(total, group=self._group)
        if not torch.equal(total, mine * self.parallel.tp):
            raise RuntimeError(f"ranks disagree on the step: rank {self.rank} has {tokens}, sum {total.tolist()}")

    def counters(self, reset: bool = False) -> dict[str, object]:
        return {"expert_load": [], "grammar": {}}  # no experts, no grammars (the replica reads zeros)

    def check_health(self) -> dict[str, object]:
        return {"rank": self.rank, "started": self.info is not None, "active_requests": len(self._seqs)}

    def shutdown(self) -> None:
        if self._group is not None:
            import torch.distributed as dist

            dist.destroy_process_group()
            self._group = None
        self.info = None
