"""The queue against a Redis that crashes: SIGKILL, restart, lost replies."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import threading
import time

import pytest
import redis
import redis.exceptions
from factories import batch, groups, manifest
from waiting import blocked_in, wait_until

from protocol import (
    LeaseLost,
    LeaseMismatch,
    ProtocolError,
    QueueConfig,
    QueueUnavailable,
    SubmitResult,
)
from protocol.trusted import RedisQueue
from protocol.trusted.redis_calls import aio_transaction
from protocol.trusted.redis_client import connect_async
from protocol.wire.keys import ACTORS_GROUP, LEARNER_GROUP

pytestmark = pytest.mark.redis


def test_queue_survives_a_redis_crash_with_persistence(make_server, request: pytest.FixtureRequest) -> None:
    server = make_server(persistent=True)
    server.start()
    q = RedisQueue.from_url(server.url, QueueConfig(run="crash", lease_timeout_s=30.0))
    request.addfinalizer(q.close)
    q.add_prompts([batch(i) for i in range(3)])
    (lease,) = q.claim("w", 1)
    q.announce(manifest(1))

    server.kill()
    with pytest.raises(QueueUnavailable):
        q.claim("w", 1)
    with pytest.raises(QueueUnavailable):
        q.submit("w", lease.lease_id, groups(lease.batch))

    server.start()  # same port, same append-only file
    assert q.heartbeat("w", [lease.lease_id]) == [lease.lease_id]
    assert q.submit("w", lease.lease_id, groups(lease.batch)).stored == 2
    assert [x.batch.batch_id for x in q.claim("w", 5)] == ["batch-1", "batch-2"]
    assert q.latest_adapter().version == 1
    assert len(q.read_rollouts("learner", 10)) == 2


def test_lost_read_reply_is_recovered(make_server, request: pytest.FixtureRequest) -> None:
    server = make_server(persistent=True)
    server.start()
    q = RedisQueue.from_url(server.url, QueueConfig(run="lost"))
    request.addfinalizer(q.close)
    q.add_prompts([batch(0)])
    (lease,) = q.claim("w", 1)
    q.submit("w", lease.lease_id, groups(lease.batch))
    # Redis delivers the entries to the learner, but the reply never reaches it:
    raw = redis.Redis(port=server.port)
    raw.xreadgroup(LEARNER_GROUP, "learner", {q.keys.rollouts: ">"}, count=10)
    raw.close()
    server.kill()
    with pytest.raises(QueueUnavailable):
        q.read_rollouts("learner", 10)
    server.start()
    recovered = q.read_rollouts("learner", 10)
    assert sorted(d.group.prompt_id for d in recovered) == ["p0", "p1"]
    assert q.read_rollouts("learner", 10) == []  # handed out once, not again


def test_queue_recreates_its_groups_after_redis_restarts_empty(make_server, request: pytest.FixtureRequest) -> None:
    server = make_server(persistent=False)
    server.start()
    q = RedisQueue.from_url(server.url, QueueConfig(run="amnesia"))
    request.addfinalizer(q.close)
    q.add_prompts([batch(0)])
    server.kill()
    server.start()  # nothing persisted: streams and groups are gone
    assert q.claim("w", 1) == []
    assert q.read_rollouts("learner", 1) == []
    q.add_prompts([batch(1)])
    assert [x.batch.batch_id for x in q.claim("w", 1)] == ["batch-1"]


# The queue keeps one connection of its pool checked out for its reads and transactions
# (`protocol.trusted.redis_calls`); these try to break what the pool did for it.


def _queue_on_own_server(
    make_server, request: pytest.FixtureRequest, run: str, batches: int = 1
) -> tuple[RedisQueue, int]:
    """A queue on a private redis-server (and its port), `batches` prompt batches added."""
    server = make_server()
    server.start()
    q = RedisQueue.from_url(server.url, QueueConfig(run=run, max_block_s=5.0))
    request.addfinalizer(q.close)
    q.add_prompts([batch(i) for i in range(batches)])
    return q, server.port


def test_a_kept_connection_the_server_dropped_is_replaced_before_a_read_or_a_submit(
    make_server, request: pytest.FixtureRequest
) -> None:
    """Dropped between calls (CLIENT KILL here; an idle timeout, a failover elsewhere), it is
    found before the next use, as the pool finds its own: no call fails on it."""
    q, port = _queue_on_own_server(make_server, request, "dropped", batches=2)
    admin = redis.Redis(port=port)
    request.addfinalizer(admin.close)
    first, second = q.claim("w", 2)
    assert q.submit("w", first.lease_id, groups(first.batch)).stored == 2
    assert len(q.read_rollouts("learner", 10)) == 2
    assert admin.client_kill_filter(_type="normal", skipme=True) >= 1
    assert q.submit("w", second.lease_id, groups(second.batch)).stored == 2  # a transaction
    assert admin.client_kill_filter(_type="normal", skipme=True) >= 1
    got = q.read_rollouts("learner", 10)  # a read: never retried, so only the check saves it
    assert sorted(d.group.batch_id for d in got) == ["batch-1", "batch-1"]
    assert q.ack_rollouts([d.delivery_id for d in got]) == 2


def test_a_thread_blocked_in_a_read_leaves_the_others_their_connections(
    make_server, request: pytest.FixtureRequest
) -> None:
    q, port = _queue_on_own_server(make_server, request, "threads")
    admin = redis.Redis(port=port)
    request.addfinalizer(admin.close)
    (lease,) = q.claim("w", 1)
    got: list[object] = []
    reader = threading.Thread(target=lambda: got.extend(q.read_rollouts("learner", 10, block_s=4.0)))
    reader.start()
    wait_until(lambda: blocked_in(admin, "xreadgroup"), "the reader blocked in XREADGROUP, on the kept connection")
    t0 = time.monotonic()
    assert q.submit("w", lease.lease_id, groups(lease.batch)).stored == 2
    reader.join(5.0)
    assert len(got) == 2 and time.monotonic() - t0 < 2.0  # woken by the submission, not timed out


def test_a_forked_child_never_writes_on_its_parents_kept_connection(
    make_server, request: pytest.FixtureRequest
) -> None:
    """The child blocks in a read while the parent submits: on one shared socket one of
    them would read the other's reply."""
    q, port = _queue_on_own_server(make_server, request, "fork")
    admin = redis.Redis(port=port)
    request.addfinalizer(admin.close)
    (lease,) = q.claim("w", 1)
    assert q.read_rollouts("learner", 10) == []  # the parent's kept connection, in use before the fork
    pid = os.fork()
    if pid == 0:  # the child
        code = 2
        try:
            code = 0 if len(q.read_rollouts("learner-2", 10, block_s=4.0)) == 2 else 1
        finally:
            os._exit(code)
    wait_until(lambda: blocked_in(admin, "xreadgroup"), "the child blocked in its read")
    result = q.submit("w", lease.lease_id, groups(lease.batch))
    _pid, status = os.waitpid(pid, 0)
    assert result.stored == 2 and result.finished
    assert os.waitstatus_to_exitcode(status) == 0


def test_each_queue_keeps_its_own_connection_and_gives_it_back_when_dropped(
    make_server, request: pytest.FixtureRequest
) -> None:
    """The kept connection is the queue object's, not the process's: twenty queues made and
    dropped in turn on one client (the runs of one proxy, say) share a pool of two."""
    server = make_server()
    server.start()
    pool = redis.BlockingConnectionPool(port=server.port, max_connections=2, timeout=1)
    client = redis.Redis(connection_pool=pool)
    request.addfinalizer(client.close)
    for i in range(20):
        q = RedisQueue(client, QueueConfig(run=f"dropped-{i}"))
        q.add_prompts([batch(0)])
        (lease,) = q.claim("w", 1)
        assert q.submit("w", lease.lease_id, groups(lease.batch)).stored == 2  # on its kept connection
        assert len(q.read_rollouts("learner", 10)) == 2
        del q
        gc.collect()
    assert pool.get_connection() is not None  # none left checked out


# The proxy sends submissions from its event loop (`RedisQueue.submit_async`, on a
# `redis.asyncio` client): the same faults must end as they do for the blocking call.


def test_a_submission_from_an_event_loop_meets_the_faults_the_blocking_one_does(
    make_server, request: pytest.FixtureRequest
) -> None:
    q, port = _queue_on_own_server(make_server, request, "aio", batches=4)
    admin = redis.Redis(port=port)
    request.addfinalizer(admin.close)
    leases = q.claim("w", 4)

    async def scenario() -> list[SubmitResult]:
        aclient = connect_async(f"redis://127.0.0.1:{port}/0")
        try:
            out = [await q.submit_async(aclient, "w", leases[0].lease_id, groups(leases[0].batch))]
            out.append(await q.submit_async(aclient, "w", leases[0].lease_id, groups(leases[0].batch)))  # again
            with pytest.raises(LeaseMismatch):  # another batch's groups under this lease: refused, nothing stored
                await q.submit_async(aclient, "w", leases[1].lease_id, groups(leases[2].batch))
            with pytest.raises(ProtocolError):  # refused before anything is sent
                await q.submit_async(aclient, "w", leases[1].lease_id, [])
            assert admin.client_kill_filter(_type="normal", skipme=True) >= 1  # its connection dropped
            out.append(await q.submit_async(aclient, "w", leases[1].lease_id, groups(leases[1].batch)))
            admin.script_flush()  # the server forgot the script
            out.append(await q.submit_async(aclient, "w", leases[2].lease_id, groups(leases[2].batch)))
            return out
        finally:
            await aclient.aclose()

    first, again, after_kill, after_flush = asyncio.run(scenario())
    assert (first.stored, first.lease_held, first.finished) == (2, True, True)
    assert (again.stored, again.duplicates, again.lease_held) == (0, 2, False)
    assert after_kill.stored == 2 and after_flush.stored == 2
    got = q.read_rollouts("learner", 20)
    assert sorted(d.group.batch_id for d in got) == ["batch-0"] * 2 + ["batch-1"] * 2 + ["batch-2"] * 2
    assert q.stats().prompts.pending == 1  # the fourth lease, still held


def test_a_submission_from_an_event_loop_to_a_dead_or_emptied_redis(
    make_server, request: pytest.FixtureRequest
) -> None:
    """Redis down: QueueUnavailable (the proxy answers 503). Back without its data: the late
    submission is answered as the blocking call answers it (its lease went with the data);
    a consumer group lost alone is recreated, as the blocking call recreates it."""
    server = make_server(persistent=False)
    server.start()
    q = RedisQueue.from_url(server.url, QueueConfig(run="aio-gone", max_block_s=5.0))
    request.addfinalizer(q.close)
    q.add_prompts([batch(0), batch(1)])
    first, second = q.claim("w", 2)

    async def submit(lease) -> SubmitResult:
        aclient = connect_async(server.url)
        try:
            return await q.submit_async(aclient, "w", lease.lease_id, groups(lease.batch))
        finally:
            await aclient.aclose()

    server.kill()
    with pytest.raises(QueueUnavailable):
        asyncio.run(submit(first))
    server.start()  # empty: no streams, no groups, no leases
    with pytest.raises(LeaseLost):
        asyncio.run(submit(first))
    with pytest.raises(LeaseLost):  # as the blocking call answers
        q.submit("w", second.lease_id, groups(second.batch))
    assert q.read_rollouts("learner", 10) == []
    q.add_prompts([batch(2)])
    (third,) = q.claim("w", 1)
    admin = redis.Redis(port=server.port)
    request.addfinalizer(admin.close)
    admin.xgroup_destroy(q.keys.prompts, ACTORS_GROUP)  # the group alone lost, with its leases
    with pytest.raises(LeaseLost):
        asyncio.run(submit(third))
    assert [g["name"] for g in admin.xinfo_groups(q.keys.prompts)] == [ACTORS_GROUP.encode()]  # recreated


def test_an_event_loop_transaction_that_times_out_leaves_no_reply_for_the_next(
    make_server, request: pytest.FixtureRequest
) -> None:
    """A server that stops answering (SIGSTOP: a stalled host) past the timeout: the call
    fails in bounded time, and its connection is not reused, or the next call would read
    the late reply as its own."""
    server = make_server()
    server.start()

    async def scenario() -> tuple[float, list[object]]:
        aclient = connect_async(server.url)
        try:
            await aclient.set("k", b"before")
            os.kill(server.proc.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            try:
                with pytest.raises(redis.exceptions.TimeoutError):
                    await aio_transaction(aclient, [("SET", "k", b"during"), ("GET", "k")], timeout_s=0.3)
            finally:
                os.kill(server.proc.pid, signal.SIGCONT)
            waited = time.monotonic() - t0
            return waited, await aio_transaction(aclient, [("INCR", "n"), ("GET", "k")], timeout_s=5.0)
        finally:
            await aclient.aclose()

    waited, replies = asyncio.run(scenario())
    assert waited < 2.0
    assert replies[0] == 1 and replies[1] in (b"before", b"during")  # this call's replies, not the stale ones
