"""What becomes of a failed replica's requests: rerun, migrate, or fail (docs/cluster.md, "Faults").

A replica fails when a rank dies (process or actor gone: WorkerDiedError), hangs (a step past
its deadline: WorkerHungError, a subclass) or a step raises (RankError and anything else). Each
request it held is then:

- rerun, if it never ran there (still queued, or waiting untouched): it starts afresh on another
  replica of the pool; nothing was streamed, so nothing is lost and no migration is counted;
- migrated, if the replica died or hung (the infrastructure failed, not the request) and the
  request has moved fewer than `max_migrations` times: it continues on another replica of the
  same pool from its prompt plus the tokens already streamed. That replica recomputes their KV
  (reusing its prefix cache for what it holds), `max_tokens` counts what was streamed, stop
  strings and the detokenizer are replayed over it (the text continues where it stopped), and
  seeded sampling draws token i from (seed, i) as before. Greedy and seeded output are identical
  to an unfaulted run; the client sees a pause;
- failed with ReplicaFailedError (UNAVAILABLE) otherwise (n > 1 and beam-search requests
  included, once their replica's scheduler had them: their several sequences do not continue
  from one stream): a step that raised may have been made
  to raise by one of its requests, so none of them is retried; and a request that has moved
  `max_migrations` times already fails with the cause, so that a request that kills every
  replica it reaches (a host OOM, say) stops after a bounded number of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from meshserve.cluster.executors.executor import WorkerDiedError
from meshserve.engine.request import Request, RequestStatus, Ticket
from meshserve.errors import ReplicaFailedError


@dataclass
class Failover:
    """The outcome for one failed replica's requests."""

    rerun: list[Ticket] = field(default_factory=list)  # reset (migrants keep their streamed output)
    failed: list[tuple[Ticket, ReplicaFailedError]] = field(default_factory=list)
    num_migrated: int = 0
    num_refused: int = 0  # in flight, would have migrated, but at --max-migrations


def plan_failover(replica: str, held: dict[str, Ticket], queued: set[str], error: BaseException, cause: str, *,
                  max_migrations: int) -> Failover:
    """Sort `held` (internal id -> ticket) of the failed `replica`; `queued`: ids not yet given
    to its engine. Tickets to rerun get a fresh Request (see `continued`)."""
    out = Failover()
    movable = isinstance(error, WorkerDiedError)
    for rid, ticket in held.items():
        req = ticket.request
        # n > 1 and beam requests run as several requests in the scheduler: once queued there,
        # their samples may have streamed, and a stream of several sequences does not continue
        never_ran = rid in queued or (req.status is RequestStatus.WAITING and not req.output_ids
                                      and req.num_preemptions == 0 and not req.runs_whole)
        if never_ran:
            ticket.request = continued(ticket)
            out.rerun.append(ticket)
        elif movable and ticket.migrations < max_migrations and not req.runs_whole:
            ticket.migrations += 1
            ticket.request = continued(ticket)
            out.rerun.append(ticket)
            out.num_migrated += 1
        else:
            if movable:
                out.num_refused += 1
                why = f"; the request already moved {ticket.migrations} time(s) (--max-migrations={max_migrations})"
            else:
                why = ""
            out.failed.append((ticket, ReplicaFailedError(f"replica {replica} failed: {cause}{why}")))
    return out


def continued(ticket: Ticket) -> Request:
    """A fresh Request for the ticket's: its prompt and the output its stream already has (none
    for a request that streamed nothing: it starts over)."""
    req, n = ticket.request, ticket.num_streamed
    return Request(req.request_id, req.prompt_ids, req.params, req.arrival, prompt=req.prompt, beam=req.beam,
                   encoder_ids=req.encoder_ids, output_ids=list(req.output_ids[:n]),
                   output_logprobs=list(req.output_logprobs[:n]))
