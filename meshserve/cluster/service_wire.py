"""The channel between the API front-ends' process and the engine's process: frames and codecs.

`meshserve serve` runs the coordinator and its replicas in one process and the gRPC and HTTP
front-ends in another (vLLM's API-server / engine-core split): per-token Python of the
front-ends (protobuf, JSON, SSE, socket writes) then no longer shares a GIL with the engine's
step. The engine's end (cluster/service_endpoint.py) binds a zmq ROUTER, each front-end
process (api/engine_client.py) connects a DEALER. Everything is msgpack, never pickle.

Frames: front-end -> engine  [kind, seq, payload, tag]
        engine -> front-end  [route, kind, seq, payload, tag]  (the ROUTER adds/strips the route)
tag = HMAC-SHA256 of the deployment secret (core/secret.py) over (direction, the channel's
random session id, kind, seq, payload); seq: an 8-byte counter per sender, strictly increasing
(a replayed frame is dropped). Secret and session reach the engine process on its stdin, never
on a command line. Frames that do not verify are dropped and counted, never raised.

Kinds, front-end -> engine:
    HELLO     first frame of a front-end: the engine learns its route
    OPEN      [stream, prompt, sampling params | None, beam params | None, request id, caller, priority]
    CANCEL    [stream, ...]: the readers left; abort those requests, free their blocks
    CALL      [call id, method, args]: abort(request_id) (the only method)
    SHUTDOWN  stop the service and exit
engine -> front-end:
    STATE     the state, {"health", "stats", "models", "failed"} packed: every STATE_PERIOD_S, and when
              a stream started or ended (to the front-ends that got no BATCH then)
    BATCH     [[item, ...], state]: every stream's new deltas of one step (one message, not one per
              token), and the state as of them (STATE's payload; None if the snapshot failed)
    RET       [call id, ok, result or error]
    BYE       the service is shut down

An item is a delta, [stream, token_ids, text, finished, finish_reason, stop_reason, index,
num_cached_tokens, cumulative_logprob, logprobs, prompt_logprobs], or an error, [stream, None,
kind, message, fields]: the same exception class, message and fields on the front-end's side.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Sequence
from typing import Any

from meshserve.cluster.fair_queue import CallerLimitError
from meshserve.cluster.handover_stats import HandoverRow, HandoverStats
from meshserve.cluster.service import GrammarCompileRow, ModelCard, ServiceHealth, ServiceStats
from meshserve.core.beam_params import BeamSearchParams
from meshserve.core.outputs import CompletionDelta, FinishReason, TokenLogprobs
from meshserve.core.sampling_params import SamplingParams
from meshserve.core.secret import ClusterSecret
from meshserve.errors import (
    CapacityError,
    ConfigError,
    MeshserveError,
    NotFoundError,
    QueueFullError,
    ReplicaFailedError,
    UnavailableError,
)

HELLO, OPEN, CANCEL, CALL, SHUTDOWN = b"H", b"O", b"C", b"A", b"X"
STATE, BATCH, RET, BYE = b"S", b"B", b"R", b"Y"
TO_ENGINE, TO_FRONTEND = b"api>", b"api<"
STATE_PERIOD_S = 0.1
# Largest frame the engine accepts from a front-end: a request is its prompt's token ids and its
# settings (a 128k-token prompt is ~0.5 MiB); zmq drops a bigger one before buffering it.
MAX_REQUEST_BYTES = 64 << 20


def seq_bytes(n: int) -> bytes:
    return struct.pack("<Q", n)


def seq_of(data: bytes) -> int | None:
    return struct.unpack("<Q", data)[0] if len(data) == 8 else None


@dataclasses.dataclass(frozen=True)
class ChannelKey:
    """The deployment secret and this channel's session id (one per engine process)."""

    secret: ClusterSecret
    session: bytes

    def sign(self, direction: bytes, kind: bytes, seq: bytes, payload: bytes) -> bytes:
        return self.secret.sign(direction, self.session, kind, seq, payload)

    def verify(self, tag: bytes, direction: bytes, kind: bytes, seq: bytes, payload: bytes) -> bool:
        return self.secret.verify(tag, direction, self.session, kind, seq, payload)


# -- requests ------------------------------------------------------------------------------------


def encode_open(stream: int, prompt: str | Sequence[int], params: SamplingParams | None,
                beam: BeamSearchParams | None, request_id: str, caller: str, priority: int) -> list:
    return [stream, prompt if isinstance(prompt, str) else list(prompt),
            None if params is None else params.to_dict(),
            None if beam is None else dataclasses.asdict(beam), request_id, caller, priority]


def decode_open(msg: list) -> tuple[int, str | list[int], SamplingParams | None, BeamSearchParams | None, str, str,
                                    int]:
    stream, prompt, params, beam, request_id, caller, priority = msg
    return (stream, prompt, None if params is None else SamplingParams.from_dict(params),
            None if beam is None else BeamSearchParams(**beam), request_id, caller, priority)


# -- deltas and errors ---------------------------------------------------------------------------


def _logprobs_out(items: Sequence[TokenLogprobs | None]) -> list:
    return [None if x is None else [x.token_id, x.logprob, [[t, v] for t, v in x.top]] for x in items]


def _logprobs_in(items: list) -> list:
    return [None if x is None else TokenLogprobs(x[0], x[1], tuple((t, v) for t, v in x[2])) for x in items]


def encode_delta(stream: int, d: CompletionDelta) -> list:
    return [stream, d.token_ids, d.text, d.finished, d.finish_reason and d.finish_reason.value, d.stop_reason,
            d.index, d.num_cached_tokens, d.cumulative_logprob, _logprobs_out(d.logprobs) if d.logprobs else None,
            None if d.prompt_logprobs is None else _logprobs_out(d.prompt_logprobs)]


def decode_delta(item: list, request_id: str) -> CompletionDelta:
    _, ids, text, finished, reason, stop, index, cached, cumulative, logprobs, prompt_logprobs = item
    return CompletionDelta(request_id, ids, text, finished, reason and FinishReason(reason), stop,
                           _logprobs_in(logprobs) if logprobs else [], index, cumulative, cached,
                           None if prompt_logprobs is None else _logprobs_in(prompt_logprobs))


# The errors a stream or a call may end with, by name; any other is sent as an internal error.
ERRORS: dict[str, type[MeshserveError]] = {c.__name__: c for c in (
    ConfigError, QueueFullError, CallerLimitError, CapacityError, UnavailableError, ReplicaFailedError,
    NotFoundError)}


class EngineInternalError(MeshserveError):
    """An unexpected error in the engine's process (INTERNAL); the message names its type."""


def _plain(value: Any) -> Any:
    """value if msgpack carries it as it is, else its repr (a ConfigError's value may be anything)."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple) and all(v is None or isinstance(v, bool | int | float | str) for v in value):
        return list(value)
    return repr(value)


def encode_error(exc: BaseException) -> list:
    """[kind, message, fields] of an exception."""
    kind = type(exc).__name__
    if kind not in ERRORS:
        return ["EngineInternalError", f"{kind}: {exc}", {}]
    fields = {"field": exc.field, "value": _plain(exc.value), "allowed": exc.allowed} if isinstance(
        exc, ConfigError) else {}
    return [kind, str(exc), fields]


def decode_error(kind: str, message: str, fields: dict) -> MeshserveError:
    """The exception `encode_error` described: its class, message and fields."""
    cls = ERRORS.get(kind, EngineInternalError)
    exc = cls.__new__(cls)
    Exception.__init__(exc, message)
    for name, value in fields.items():
        setattr(exc, name, value)
    return exc


# -- state ---------------------------------------------------------------------------------------


def _fields(obj) -> dict:
    """A dataclass's fields, one level deep (dataclasses.asdict copies recursively: slower)."""
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def encode_state(health: ServiceHealth, stats: ServiceStats, models: list[ModelCard] | None,
                 failed: str | None = None) -> dict:
    stats_fields = _fields(stats)
    stats_fields["handovers"] = [{"pool": r.pool, "replica": r.replica, "stats": _fields(r.stats)}
                                 for r in stats.handovers]
    stats_fields["grammar_compiles"] = [_fields(r) for r in stats.grammar_compiles]
    return {"health": _fields(health), "stats": stats_fields,
            "models": None if models is None else [_fields(c) for c in models], "failed": failed}


def decode_state(d: dict) -> tuple[ServiceHealth, ServiceStats, list[ModelCard] | None, str | None]:
    stats = dict(d["stats"])
    stats["handovers"] = [HandoverRow(r["pool"], r["replica"], HandoverStats(**r["stats"]))
                          for r in stats["handovers"]]
    # (absent from an engine older than these rows: none)
    stats["grammar_compiles"] = [GrammarCompileRow(**r) for r in stats.get("grammar_compiles", ())]
    models = None if d["models"] is None else [ModelCard(**c) for c in d["models"]]
    return ServiceHealth(**d["health"]), ServiceStats(**stats), models, d["failed"]
