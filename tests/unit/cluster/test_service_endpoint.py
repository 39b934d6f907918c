"""EngineClient over the front-end channel to a ServiceEndpoint (the split `serve --engine-process`
runs), here both ends in one event loop over a real ipc socket: the same outputs as the
single-process engine, refusals with their own error types, cancellation and abort that free
every block, and a gone engine that fails streams instead of hanging."""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import replace

import pytest

from meshserve.api.engine_client import EngineClient
from meshserve.cluster import service_wire as wire
from meshserve.cluster.coordinator import Coordinator
from meshserve.cluster.service_endpoint import ServiceEndpoint
from meshserve.core.outputs import FinishReason
from meshserve.core.sampling_params import SamplingParams
from meshserve.core.secret import ClusterSecret
from meshserve.errors import ConfigError, QueueFullError, ReplicaFailedError
from tests.unit.cluster.cases import (
    assert_no_held_blocks,
    assert_same,
    collect,
    holds_no_blocks,
    mixed_requests,
    reference,
    run_all,
    threads,
    wait_until,
)

LONG = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def split(config, body, tmp_path, *, key: wire.ChannelKey | None = None):
    """A Coordinator behind a ServiceEndpoint and an EngineClient talking to it: body(client, coord)."""
    address = f"ipc://{tmp_path / 'engine.sock'}"
    key = key or wire.ChannelKey(ClusterSecret.generate(), secrets.token_bytes(16))

    async def main():
        coord = Coordinator(config)
        endpoint = ServiceEndpoint(coord, address, key)
        serving = asyncio.create_task(endpoint.run(start=True))
        client = EngineClient(address, key, model_dir=config.engine.model.model)
        try:
            await asyncio.wait_for(client.start(), 120)
            return await body(client, coord)
        finally:
            async def engine_side():  # as the engine process ends: service down, then BYE
                endpoint.stop()
                await serving
                await coord.shutdown(drain=False)
                await endpoint.close()

            await asyncio.gather(client.shutdown(drain=False), engine_side())
    return asyncio.run(main())


def test_outputs_match_the_single_process_engine(tiny_llama, tmp_path):
    requests = mixed_requests()

    async def body(client, coord):
        assert client.models()[0].max_model_len == coord.models()[0].max_model_len
        assert client.tokenize("Hello world") == coord.tokenize("Hello world")
        got = await run_all(client, requests)
        await wait_until(lambda: client.stats().generated_tokens > 0, "a state report", timeout_s=10)
        assert client.health().serving and client.health().healthy_replicas == 1
        return got

    assert_same(split(threads(tiny_llama), body, tmp_path), reference(tiny_llama, requests))


def test_refusals_cancellation_and_abort_free_every_block(tiny_llama, tmp_path):
    async def body(client, coord):
        with pytest.raises(ConfigError, match="prompt") as bad:
            await collect(client, "bad", [10**9], GREEDY)
        assert bad.value.field == "prompt"
        with pytest.raises(ConfigError, match="max_model_len") as long:
            await collect(client, "huge", list(range(1, 40)), replace(GREEDY, max_tokens=100_000))
        assert (long.value.field, long.value.value) == ("max_tokens", 100_000)
        running = client.generate([1, 2, 3], LONG, request_id="running")
        first = await running.__anext__()
        assert first.request_id == "running"  # the caller's id, not the engine's
        with pytest.raises(ConfigError, match="request_id"):
            await collect(client, "running", [5, 6], GREEDY)  # in use
        waiting = asyncio.ensure_future(collect(client, "waiting", [4, 5, 6], GREEDY))
        await wait_until(lambda: coord.stats().num_waiting == 1, "the second request to wait", timeout_s=10)
        with pytest.raises(QueueFullError, match="max_queue=1"):
            await collect(client, "refused", [7, 8], GREEDY)
        assert await client.abort("running")
        rest = [d async for d in running]
        assert rest[-1].finished and rest[-1].finish_reason is FinishReason.ABORT
        assert len((await waiting).token_ids) == 24
        assert not await client.abort("nobody")
        leaver = client.generate([9, 9, 9], LONG, request_id="leaver")
        await leaver.__anext__()
        await leaver.aclose()  # the reader leaves: the engine aborts the request
        await wait_until(lambda: holds_no_blocks(coord) and not coord._live, "every block freed", timeout_s=10,
                         state=lambda: [r.core.kv.request_ids() for r in coord.replicas()])
        assert_no_held_blocks(coord)
        again = await collect(client, "leaver", [4, 5, 6], GREEDY)  # the id is free again
        assert again.token_ids == (await waiting).token_ids

    split(threads(tiny_llama, scheduler={"max_num_seqs": 1, "max_queue": 1}), body, tmp_path)


def test_a_gone_engine_fails_open_streams_and_health(tiny_llama, tmp_path):
    async def body(client, coord):
        stream = client.generate([1, 2, 3], LONG, request_id="r")
        await stream.__anext__()
        client._end("the engine process exited with code -9")  # what the process watcher does
        with pytest.raises(ReplicaFailedError, match="exited with code -9"):
            async for _ in stream:
                pass
        health = client.health()
        assert not health.serving and "exited" in health.detail
        with pytest.raises(Exception, match="exited"):
            await collect(client, "after", [1, 2], GREEDY)

    split(threads(tiny_llama), body, tmp_path)


def test_frames_of_another_secret_are_dropped(tiny_llama, tmp_path):
    """A peer without the deployment secret gets no answer, and its frames are counted."""
    key = wire.ChannelKey(ClusterSecret.generate(), secrets.token_bytes(16))

    async def body(client, coord):
        forger = EngineClient(client.address, wire.ChannelKey(ClusterSecret.generate(), key.session),
                              model_dir=coord.config.engine.model.model)
        starting = asyncio.ensure_future(forger.start())
        await asyncio.sleep(0.5)
        assert not starting.done()  # no state ever reaches it: nothing of the engine answered
        starting.cancel()
        for task in forger._tasks:
            task.cancel()
        forger._sock.close(linger=0)
        assert (await collect(client, "ok", [1, 2, 3], GREEDY)).finish_reason is FinishReason.LENGTH

    split(threads(tiny_llama), body, tmp_path, key=key)


def test_two_front_ends_share_one_engine_and_one_leaving_does_not_stop_it(tiny_llama, tmp_path):
    """--api-server-count: a second front-end with the same key gets its own streams' deltas; its
    leaving (owns_engine=False) only disconnects, while the first one's stream runs on."""
    requests = mixed_requests()

    async def body(client, coord):
        other = EngineClient(client.address, client.key, model_dir=coord.config.engine.model.model,
                             owns_engine=False)
        await asyncio.wait_for(other.start(), 60)
        half = len(requests) // 2
        mine, theirs = await asyncio.gather(run_all(client, requests[:half]), run_all(other, requests[half:]))
        running = client.generate([7, 8, 9], GREEDY, request_id="runs-on")
        first = await running.__anext__()
        await other.shutdown(drain=False)
        rest = [d async for d in running]
        assert len(first.token_ids) + sum(len(d.token_ids) for d in rest) == GREEDY.max_tokens
        assert client.health().serving
        after = await asyncio.wait_for(collect(client, "after", [1, 2, 3], GREEDY), 30)  # the engine still serves
        assert after.finish_reason is FinishReason.LENGTH
        return {**mine, **theirs}

    assert_same(split(threads(tiny_llama), body, tmp_path), reference(tiny_llama, requests))


def test_the_stats_a_front_end_answers_count_every_token_its_streams_have_seen(tiny_llama, tmp_path):
    """Each step's BATCH carries the engine's state as of its deltas: at every delta a stream
    yields, the client's stats (what /metrics and ServerInfo answer) already count its tokens and
    show it running, here where steps take milliseconds, far below the 0.1 s STATE period."""

    async def body(client, coord):
        await wait_until(lambda: client.stats().num_running == 0, "idle", timeout_s=10)
        base = client.stats().generated_tokens
        seen, rows = 0, []
        async for delta in client.generate([3, 1, 4, 1, 5], LONG, request_id="counted"):
            seen += len(delta.token_ids)
            stats = client.stats()
            rows.append((seen, stats.generated_tokens - base, stats.num_running, delta.finished))
        assert seen == LONG.max_tokens and len(rows) > 20
        assert all(counted >= tokens for tokens, counted, _, _ in rows), rows
        assert all(running == 1 for _, _, running, finished in rows if not finished), rows

    split(threads(tiny_llama), body, tmp_path)


def test_a_first_delta_wakes_its_stream_before_the_running_streams_next_ones(tiny_llama):
    """Within one BATCH the streams getting their first delta are handed it first (each stream's
    reader writes its chunk in wake order, so a new request's first token does not wait for every
    running stream's write); the running streams keep their order among themselves."""
    import msgpack

    from meshserve.core.outputs import CompletionDelta

    async def main():
        client = EngineClient("ipc:///unused", wire.ChannelKey(ClusterSecret.generate(), secrets.token_bytes(16)),
                              model_dir=str(tiny_llama))
        queues = {n: asyncio.Queue() for n in (1, 2, 3, 4)}
        for n, queue in queues.items():
            client._streams[n] = (queue, f"r{n}")
        client._awaiting_first |= {3, 4}  # 1 and 2 have streamed already; 3 and 4 are new
        woken = []

        async def reader(n):
            await queues[n].get()
            woken.append(n)

        readers = [asyncio.create_task(reader(n)) for n in queues]
        await asyncio.sleep(0)  # every reader waits on its queue
        items = [wire.encode_delta(n, CompletionDelta(f"r{n}", [10 + n], "")) for n in (1, 4, 2, 3)]
        client._handle(wire.BATCH, msgpack.packb([items, None]))
        await asyncio.gather(*readers)
        assert woken == [4, 3, 1, 2]
        assert not client._awaiting_first  # a stream's later deltas keep the engine's order

    asyncio.run(main())
