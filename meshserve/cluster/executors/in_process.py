"""The in-process executor of a replica: the engine's LocalExecutor plus the rank host, so that
`call` reaches the same RankHost methods (KV export, pull, digest) that remote ranks answer."""

from __future__ import annotations

import itertools
import select
from collections.abc import Sequence

from meshserve.cluster.executors.rank_host import RankHost
from meshserve.core.doorbell import Doorbell
from meshserve.engine.engine_config import EngineConfig
from meshserve.engine.local_executor import LocalExecutor
from meshserve.errors import check


class InProcessExecutor(LocalExecutor):
    """Runs the single worker of a tp=1 replica in this process, with KV hand-over."""

    def __init__(self, config: EngineConfig, *, device: str | None = None, progress: bool = True) -> None:
        super().__init__(config, device=device, progress=progress)
        self.host = RankHost(None, rank=0)
        self.host.worker = self.worker
        self._call_ids = itertools.count()
        self._finished: dict[int, tuple] = {}  # start_call's outcomes, until finish_call takes them

    def call(self, method: str, args: Sequence[dict]) -> list:
        check(len(args) == 1, "args", len(args), "one argument map (one rank)")
        return [self.host.call(method, args[0])]

    def start_call(self, method: str, args: Sequence[dict]) -> int:
        """`call` at once (the rank is this process); `finish_call` returns its results or raises
        what it raised."""
        try:
            outcome = (self.call(method, args), None)
        except Exception as exc:
            outcome = (None, exc)
        call_id = next(self._call_ids)
        self._finished[call_id] = outcome
        return call_id

    def finish_call(self, call_id: int) -> list:
        results, error = self._finished.pop(call_id)
        if error is not None:
            raise error
        return results

    def take_kv_pulls(self) -> list[dict]:
        """{transfer_id: result} of the KV pulls finished since the last call (one rank)."""
        return [self.host.kv_pull_done() if self.host.pulls_done is not None else {}]

    def wait_kv_pulls(self, timeout_s: float, interrupt: Doorbell | None = None) -> bool:
        """Block until a KV pull finished (True), `interrupt` rings or timeout_s passes (False)."""
        bells = [b for b in (self.host.pulls_done, interrupt) if b is not None]
        ready, _, _ = select.select(bells, [], [], timeout_s)
        return self.host.pulls_done is not None and self.host.pulls_done in ready

    def shutdown(self) -> None:
        self.host.shutdown()
