"""The queue against a Redis that crashes: SIGKILL, restart, lost replies."""

from __future__ import annotations

import pytest
import redis
from factories import batch, groups, manifest

from protocol import QueueConfig, QueueUnavailable, RedisQueue
from protocol.keys import LEARNER_GROUP

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
