"""Deltas that queued up for one stream, joined into as few as say the same thing.

A replica puts one delta per step into each stream's queue. When the stream's reader (an HTTP
response, a gRPC call) keeps up, it finds one delta at a time and nothing changes. When it falls
behind — the front-ends share one event loop, and a fast accelerator makes a step of 256 streams
in ~11 ms — the deltas waiting for it are joined, so that it sends one message for all of them
instead of one per token: the work per step of a stream that lags stops growing with its lag
(vLLM v1's output collector does the same for the same reason).

Only neighbours of the same completion (`index`) join, and never past a delta that ends its
completion (a finish_reason) or the request: what the reader sees at each end is unchanged.
Errors (exceptions put on the queue) stay where they are, in order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from meshserve.core.outputs import CompletionDelta


def joinable(first: CompletionDelta, then: CompletionDelta) -> bool:
    """`then` can be appended to `first`: same completion, and `first` ends nothing."""
    return (first.index == then.index and first.finish_reason is None and not first.finished
            and first.request_id == then.request_id)


# How each field of CompletionDelta joins (a field missing here fails tests/unit/core: decide it).
APPENDED = ("token_ids", "text", "logprobs")  # what the two deltas add, in order
FROM_FIRST = ("prompt_logprobs",)  # carried by a request's first delta only
FROM_LAST = ("request_id", "index", "finished", "finish_reason", "stop_reason", "num_cached_tokens", "error")
LAST_SET = ("cumulative_logprob",)  # the later one's when it has one


def join(first: CompletionDelta, then: CompletionDelta) -> CompletionDelta:
    """One delta saying what `first` followed by `then` says (a new object: deltas may be shared)."""
    changes = {name: getattr(first, name) + getattr(then, name) for name in APPENDED}
    changes.update({name: getattr(first, name) if getattr(first, name) is not None else getattr(then, name)
                    for name in FROM_FIRST})
    changes.update({name: getattr(then, name) if getattr(then, name) is not None else getattr(first, name)
                    for name in LAST_SET})
    return dataclasses.replace(then, **changes)


def coalesce(items: Iterable[CompletionDelta | BaseException]) -> list[CompletionDelta | BaseException]:
    """`items` in order, each run of joinable deltas joined into one."""
    out: list[CompletionDelta | BaseException] = []
    for item in items:
        last = out[-1] if out else None
        if (isinstance(item, CompletionDelta) and isinstance(last, CompletionDelta) and joinable(last, item)):
            out[-1] = join(last, item)
        else:
            out.append(item)
    return out
