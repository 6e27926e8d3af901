"""The queue's guarantees, each tried against a real redis-server, against fakeredis, and
through the proxy app (served in this process, over the real HTTPS client: `inprocess_proxy`)
in front of fakeredis. Through the proxy a worker `w` is listed as `<token name>/w` (`listed`)."""

from __future__ import annotations

import threading
import time

import pytest
from conftest import redis_clients
from factories import batch, group, groups, manifest
from inprocess_proxy import ProxiedQueue
from waiting import blocked_in, wait_until

from protocol import (
    FinishedBatch,
    Keys,
    LeaseLost,
    LeaseMismatch,
    QueueConfig,
    VersionConflict,
    WorkerStatus,
    encode,
)
from protocol.trusted import RedisQueue

LEASE_S = 0.3


@pytest.fixture(params=["redis", "fakeredis", "proxy", "cluster"])
def backend(request: pytest.FixtureRequest):
    """conftest's backend (a redis-server, fakeredis, a 3-master Redis Cluster), plus
    "proxy": fakeredis behind the proxy app."""
    clients = redis_clients(request, request.param if request.param in ("redis", "cluster") else "fakeredis")
    make = next(clients)
    make.through_proxy = request.param == "proxy"
    make.server = request.param in ("redis", "cluster")  # a server to ask what its clients do
    yield make
    next(clients, None)  # closes them


@pytest.fixture
def make_queue(backend, run_name, tmp_path):
    """`make_queue(**config)` -> the queue of the test's run on the backend: a RedisQueue,
    or (backend "proxy") a `ProxiedQueue` in front of one."""
    made = []

    def make(**overrides: object):
        direct = RedisQueue(backend(), QueueConfig(run=run_name, **overrides))
        made.append(ProxiedQueue(direct, tmp_path / "store") if backend.through_proxy else direct)
        return made[-1]

    yield make
    for q in made:
        if isinstance(q, ProxiedQueue):
            q.close()


def listed(q, worker: str) -> str:
    """The name the queue lists worker `worker` under."""
    return ProxiedQueue.listed(worker) if isinstance(q, ProxiedQueue) else worker


def test_prompts_flow_to_rollouts_and_back(make_queue) -> None:
    q = make_queue()
    batches = [batch(i) for i in range(3)]
    assert q.add_prompts(batches) == 3
    stats = q.stats()
    assert (stats.prompts.length, stats.prompts.waiting, stats.prompts.pending) == (3, 3, 0)

    leases = q.claim("w1", count=2)
    assert [lease.batch for lease in leases] == batches[:2]
    assert all(lease.deliveries == 1 for lease in leases)
    assert q.stats().leases_by_worker == {listed(q, "w1"): 2}

    result = q.submit("w1", leases[0].lease_id, groups(leases[0].batch, actor="w1"))
    assert (result.stored, result.duplicates, result.lease_held) == (2, 0, True)

    got = q.read_rollouts("learner", count=10)
    assert [d.group for d in got] == groups(batches[0], actor=listed(q, "w1"))
    assert q.stats().rollouts.pending == 2
    assert q.ack_rollouts([d.delivery_id for d in got]) == 2
    stats = q.stats()
    assert stats.rollouts.pending == 0
    assert stats.prompts.pending == 1 and stats.prompts.waiting == 1


def test_prompts_waiting_counts_each_prompt_whose_group_is_not_in(make_queue) -> None:
    q = make_queue()
    q.add_prompts([batch(0), batch(1)])
    if isinstance(q, ProxiedQueue):
        assert q.prompts_waiting() is None  # the learner counts on Redis; a worker's view cannot
        return
    assert q.prompts_waiting() == 4
    (lease,) = q.claim("w1", count=1)
    first, second = groups(lease.batch, actor="w1")
    q.submit("w1", lease.lease_id, [first])  # one group of two: the batch's entry stays
    assert q.stats().prompts.length == 2 and q.prompts_waiting() == 3
    q.submit("w1", lease.lease_id, [second])
    assert q.stats().prompts.length == 1 and q.prompts_waiting() == 2


def test_add_prompts_is_idempotent_by_batch_id(make_queue) -> None:
    q = make_queue()
    assert q.add_prompts([batch(0), batch(1)]) == 2
    assert q.add_prompts([batch(1), batch(2)]) == 1  # a retry or a re-issue after resume
    assert [lease.batch.batch_id for lease in q.claim("w", 10)] == ["batch-0", "batch-1", "batch-2"]


def test_claim_blocks_until_a_batch_arrives(make_queue) -> None:
    q, producer = make_queue(), make_queue()
    assert q.claim("w", 1, block_s=0.1) == []
    timer = threading.Timer(0.2, lambda: producer.add_prompts([batch(0)]))
    timer.start()
    started = time.monotonic()
    leases = q.claim("w", 1, block_s=5.0)
    timer.join()
    assert [lease.batch.batch_id for lease in leases] == ["batch-0"]
    assert time.monotonic() - started < 4.0


def test_dead_worker_batch_is_delivered_again(make_queue) -> None:
    q = make_queue(lease_timeout_s=LEASE_S)
    q.add_prompts([batch(0)])
    (lease,) = q.claim("doomed", 1)
    assert q.claim("survivor", 1) == []  # still leased
    time.sleep(LEASE_S + 0.1)  # the worker died: no heartbeat, no submit
    (again,) = q.claim("survivor", 1)
    assert again.lease_id == lease.lease_id
    assert again.batch == lease.batch
    assert again.deliveries == 2
    assert q.stats().leases_by_worker == {listed(q, "survivor"): 1}


def test_heartbeat_keeps_a_lease_and_only_its_owner_can_extend_it(make_queue) -> None:
    q = make_queue(lease_timeout_s=LEASE_S)
    q.add_prompts([batch(0)])
    (lease,) = q.claim("w1", 1)
    for _ in range(4):
        time.sleep(LEASE_S / 2)
        assert q.heartbeat("w1", [lease.lease_id]) == [lease.lease_id]
        assert q.heartbeat("w2", [lease.lease_id]) == []  # not the owner: no effect
    assert q.claim("w2", 1) == []  # heartbeated for twice the timeout, still w1's
    time.sleep(LEASE_S + 0.1)
    assert [x.lease_id for x in q.claim("w2", 1)] == [lease.lease_id]
    assert q.heartbeat("w1", [lease.lease_id]) == []  # w1 learns it lost the lease


def test_batch_delivered_too_often_goes_to_dead_letters(make_queue) -> None:
    q = make_queue(lease_timeout_s=LEASE_S, max_deliveries=2)
    q.add_prompts([batch("poison"), batch("fine")])
    first = q.claim("w1", 1)
    assert [x.deliveries for x in first] == [1]
    time.sleep(LEASE_S + 0.1)
    second = q.claim("w2", 1)
    assert [(x.batch.batch_id, x.deliveries) for x in second] == [("batch-poison", 2)]
    time.sleep(LEASE_S + 0.1)
    third = q.claim("w3", 1)  # poison is dead-lettered, the next batch comes instead
    assert [x.batch.batch_id for x in third] == ["batch-fine"]
    (dead,) = q.dead_letters()
    assert dead.reason == "max_deliveries"
    assert dead.deliveries == 2
    assert dead.last_worker == listed(q, "w2")
    assert dead.lease_id == first[0].lease_id
    assert dead.batch == first[0].batch
    stats = q.stats()
    assert stats.dead_letters == 1
    assert stats.leases_by_worker == {listed(q, "w3"): 1}
    assert q.dead_letters(after=dead.entry_id) == []


def test_resubmitted_group_is_stored_once(make_queue) -> None:
    q = make_queue()
    q.add_prompts([batch(0)])
    (lease,) = q.claim("w1", 1)
    first = q.submit("w1", lease.lease_id, groups(lease.batch))
    again = q.submit("w1", lease.lease_id, groups(lease.batch))  # e.g. the reply was lost
    assert (first.stored, first.duplicates) == (2, 0)
    assert (again.stored, again.duplicates) == (0, 2)
    assert len(q.read_rollouts("learner", 100)) == 2


def test_a_flushed_script_cache_is_filled_again(make_queue, backend) -> None:
    """Scripts run by their digest; a server that forgot them (SCRIPT FLUSH, or a restart
    that kept the data) gets them again, and each call still happens once."""
    q = make_queue()
    q.add_prompts([batch(0)])
    (lease,) = q.claim("w", 1)
    backend().script_flush()
    result = q.submit("w", lease.lease_id, groups(lease.batch))
    assert (result.stored, result.duplicates, result.finished) == (2, 0, True)
    got = q.read_rollouts("learner", 10)
    backend().script_flush()
    assert q.ack_rollouts([d.delivery_id for d in got]) == 2
    assert q.read_rollouts("learner", 10) == [] and q.pending_rollouts("learner", 10) == []


def _finished(b) -> FinishedBatch:
    return FinishedBatch(b.batch_id, [g.group_id for g in groups(b)])


def test_finished_batches_are_forgotten_and_never_stored_again(make_queue) -> None:
    """The seen-sets hold only batches in flight: the learner's report of a batch it has
    checkpointed to the end removes its records; a late retry is then refused, not stored."""
    q = make_queue()
    q.add_prompts([batch(0), batch(1)])
    (lease, other) = q.claim("w", 2)
    q.submit("w", lease.lease_id, groups(lease.batch))
    assert q.submit("w", lease.lease_id, groups(lease.batch)).duplicates == 2  # a retry: still a duplicate
    got = q.read_rollouts("learner", 10)
    r, keys = q._r, q.keys
    assert (r.scard(keys.batches_seen), r.scard(keys.groups_seen)) == (2, 2)
    assert q.ack_rollouts([d.delivery_id for d in got], [_finished(lease.batch)]) == 2
    assert r.smembers(keys.batches_seen) == {b"batch-1"} and r.scard(keys.groups_seen) == 0
    with pytest.raises(LeaseLost, match="not outstanding"):  # the lease is gone: refused, whole
        q.submit("w", lease.lease_id, groups(lease.batch))
    assert q.read_rollouts("learner", 10) == [] and q.stats().rollouts.length == 0
    # the batch in flight kept its records
    q.submit("w", other.lease_id, groups(other.batch)[:1])
    assert q.submit("w", other.lease_id, groups(other.batch)[:1]).duplicates == 1


def test_keys_a_completed_run_writes_again_expire_too(make_queue) -> None:
    """After `expire_run` the actors still finish the batches in flight: a key deleted
    when it emptied (a seen-set, the workers hash) and written again expires with the run."""
    q = make_queue()
    q.add_prompts([batch(0), batch(1)])
    first, second = q.claim("w", 2)
    q.submit("w", first.lease_id, groups(first.batch))
    q.ack_rollouts([d.delivery_id for d in q.read_rollouts("learner", 10)], [_finished(first.batch)])
    q.report_status(WorkerStatus(worker="w", reported_at=time.time()))
    q._r.delete(q.keys.workers)  # as `workers()` does once every worker has gone quiet
    assert not q._r.exists(q.keys.groups_seen)
    q.expire_run(600)
    q.submit("w", second.lease_id, groups(second.batch))  # the run is over; this worker does not know
    q.report_status(WorkerStatus(worker="w", reported_at=time.time()))
    for key in (q.keys.groups_seen, q.keys.workers):
        assert 0 < q._r.ttl(key) <= 600, key


def test_bad_finished_batches_are_refused_and_change_nothing(make_queue) -> None:
    q = make_queue()
    q.add_prompts([batch(0)])
    (lease,) = q.claim("w", 1)
    q.submit("w", lease.lease_id, groups(lease.batch))
    (d,) = q.read_rollouts("learner", 10)[:1]
    for bad in (
        FinishedBatch("batch-0", ["not-a-group-id"]),
        FinishedBatch("", []),
        FinishedBatch("batch-0", ["a" * 32] * 5000),
    ):
        with pytest.raises(ValueError, match="finished"):
            q.ack_rollouts([d.delivery_id], [bad])
    assert q.stats().rollouts.pending == 2 and q._r.scard(q.keys.groups_seen) == 2


def _lease_taken_over(make_queue):
    """A batch claimed by "slow", expired, and claimed again by "fast"."""
    q = make_queue(lease_timeout_s=LEASE_S)
    q.add_prompts([batch(0)])
    (slow,) = q.claim("slow", 1)
    time.sleep(LEASE_S + 0.1)
    (fast,) = q.claim("fast", 1)
    return q, slow, fast


def test_slow_worker_whose_lease_was_taken_over_stores_nothing_twice(make_queue) -> None:
    q, slow, fast = _lease_taken_over(make_queue)
    done = q.submit("fast", fast.lease_id, groups(fast.batch, actor="fast"))
    late = q.submit("slow", slow.lease_id, groups(slow.batch, actor="slow"))
    assert (done.stored, done.lease_held) == (2, True)
    assert (late.stored, late.duplicates, late.lease_held) == (0, 2, False)
    rollouts = q.read_rollouts("learner", 100)
    assert sorted(d.group.prompt_id for d in rollouts) == ["p0", "p1"]
    assert {d.group.actor_id for d in rollouts} == {listed(q, "fast")}
    assert q.stats().prompts.pending == 0


def test_slow_worker_cannot_submit_a_lease_taken_over(make_queue) -> None:
    """A lease belongs to its holder: the slow worker's groups are refused whole (the
    holder redoes them), so no token can front-run the worker that holds a batch."""
    q, slow, fast = _lease_taken_over(make_queue)
    with pytest.raises(LeaseLost, match="another worker"):
        q.submit("slow", slow.lease_id, groups(slow.batch, actor="slow"))
    assert q.read_rollouts("learner", 100) == []
    assert q.heartbeat("fast", [fast.lease_id]) == [fast.lease_id]
    done = q.submit("fast", fast.lease_id, groups(fast.batch, actor="fast"))
    assert (done.stored, done.duplicates, done.finished) == (2, 0, True)
    assert {d.group.actor_id for d in q.read_rollouts("learner", 100)} == {listed(q, "fast")}


def test_a_blocked_reader_wakes_for_stored_groups_only_and_no_gate_outlives_a_submit(make_queue, backend) -> None:
    """A submission stores its groups through a gate that renames the rollouts stream inside
    one MULTI/EXEC (`protocol.trusted.redis_lua.SUBMIT`): a learner blocked on the stream is not
    disturbed by a refused or a duplicate submission, wakes for a stored group, and nothing
    of the gate is left after any kind of submission."""
    q, learner = make_queue(), make_queue()
    client = backend()
    q.add_prompts([batch(0, prompts=3), batch(1)])
    first, second = q.claim("w", 2)

    def no_gate_left() -> bool:
        return (
            client.exists(q.keys.submit_gate, q.keys.submit_alias) == 0
            and client.type(q.keys.rollouts) == b"stream"
            and client.type(q.keys.unscored) == b"stream"
        )

    got: list = []
    reader = threading.Thread(target=lambda: got.extend(learner.read_rollouts("learner", 10, block_s=8.0)))
    reader.start()
    if backend.server:
        wait_until(lambda: blocked_in(client, "xreadgroup"), "the reader blocked in XREADGROUP")
    else:  # fakeredis has no server to ask: a pause for the reader to reach its wait
        time.sleep(0.3)
    with pytest.raises(LeaseMismatch):
        q.submit("w", first.lease_id, groups(second.batch))
    assert no_gate_left()
    time.sleep(0.3)  # what would wake the reader has had its time
    assert reader.is_alive() and got == []  # still blocked, nothing stored
    if backend.server:
        assert blocked_in(client, "xreadgroup")

    part = q.submit("w", first.lease_id, groups(first.batch)[:1])
    reader.join(5.0)
    assert not reader.is_alive()
    assert (part.stored, part.duplicates, part.finished, part.missing) == (1, 0, False, 2)
    assert [d.group.prompt_id for d in got] == ["p0"]
    assert no_gate_left()

    rest = q.submit("w", first.lease_id, groups(first.batch))  # p0 again, with p1 and p2
    assert (rest.stored, rest.duplicates, rest.finished) == (2, 1, True)
    assert sorted(d.group.prompt_id for d in learner.read_rollouts("learner", 10)) == ["p1", "p2"]
    assert no_gate_left()
    again = q.submit("w", first.lease_id, groups(first.batch))  # a retry after the lease is done
    assert (again.stored, again.duplicates, again.lease_held) == (0, 3, False)
    assert learner.read_rollouts("learner", 10) == [] and no_gate_left()
    assert q.stats().rollouts.pending == 3


def test_a_submission_to_a_stream_that_is_gone_recreates_it(make_queue, backend) -> None:
    """The rollouts stream lost (deleted, expired before the rest of the run): the submission
    stores nothing until the stream and its consumer group exist again, then stores once."""
    q = make_queue()
    q.add_prompts([batch(0)])
    (lease,) = q.claim("w", 1)
    backend().delete(q.keys.rollouts)
    result = q.submit("w", lease.lease_id, groups(lease.batch))
    assert (result.stored, result.finished) == (2, True)
    assert sorted(d.group.prompt_id for d in q.read_rollouts("learner", 10)) == ["p0", "p1"]


def test_submit_for_the_wrong_batch_changes_nothing(make_queue) -> None:
    q = make_queue()
    q.add_prompts([batch(0), batch(1)])
    a, b = q.claim("w", 2)
    with pytest.raises(LeaseMismatch, match="batch-0"):
        q.submit("w", a.lease_id, groups(b.batch))
    assert q.read_rollouts("learner", 100) == []
    assert q.heartbeat("w", [a.lease_id, b.lease_id]) == [a.lease_id, b.lease_id]
    assert q.submit("w", b.lease_id, groups(b.batch)).stored == 2  # the right ones still go in


def test_release_hands_the_batch_on_without_counting_a_failure(make_queue) -> None:
    q = make_queue(lease_timeout_s=30.0, max_deliveries=1)
    q.add_prompts([batch(0)])
    (lease,) = q.claim("leaving", 1)
    assert q.release("someone-else", lease.lease_id) is False
    assert q.release("leaving", lease.lease_id) is True
    (taken,) = q.claim("staying", 1)  # at once, not after the 30 s lease
    assert taken.lease_id == lease.lease_id
    assert taken.deliveries == 1
    assert q.dead_letters() == []


def test_garbage_in_the_prompt_stream_is_dead_lettered(make_queue, backend) -> None:
    q = make_queue()
    raw = backend()
    raw.xadd(q.keys.prompts, {"b": "junk", "m": b"\x93\x01\x02"})
    raw.xadd(q.keys.prompts, {"b": "rollout", "m": encode(group(batch(9)))})
    q.add_prompts([batch(0)])
    leases = q.claim("w", 5)
    assert [x.batch.batch_id for x in leases] == ["batch-0"]
    dead = q.dead_letters()
    assert [d.reason.split(":")[0] for d in dead] == ["malformed", "malformed"]
    assert all(d.batch is None for d in dead)
    assert q.stats().prompts.pending == 1


def test_garbage_in_the_rollout_stream_is_moved_aside(make_queue, backend) -> None:
    q = make_queue()
    backend().xadd(q.keys.rollouts, {"g": "x", "m": b"not msgpack \xc1"})
    q.add_prompts([batch(0)])
    (lease,) = q.claim("w", 1)
    q.submit("w", lease.lease_id, groups(lease.batch))
    got = q.read_rollouts("learner", 10)
    assert len(got) == 2
    (dead,) = q.dead_letters()
    assert dead.source == "rollouts" and dead.reason.startswith("malformed")


def test_unacknowledged_rollouts_survive_a_learner_crash(make_queue) -> None:
    q = make_queue()
    q.add_prompts([batch(i) for i in range(3)])
    for lease in q.claim("w", 3):
        q.submit("w", lease.lease_id, groups(lease.batch))
    first = q.read_rollouts("learner", 4)
    q.ack_rollouts([d.delivery_id for d in first[:2]])  # checkpointed
    # the learner dies here; a new process takes over
    restarted = make_queue()
    pending = restarted.pending_rollouts("learner", 100)
    assert [d.delivery_id for d in pending] == [d.delivery_id for d in first[2:]]
    rest = restarted.read_rollouts("learner", 100)
    assert len(rest) == 2
    restarted.ack_rollouts([d.delivery_id for d in pending + rest])
    assert restarted.pending_rollouts("learner", 100) == []


def test_bad_arguments_change_nothing(make_queue) -> None:
    q = make_queue(max_block_s=2.0)
    q.add_prompts([batch(0)])
    (lease,) = q.claim("w", 1)
    with pytest.raises(ValueError, match="lease_ids"):
        q.heartbeat("w", ["not-an-id"])
    with pytest.raises(ValueError, match="worker"):
        q.claim("two words", 1)
    if not isinstance(q, ProxiedQueue):  # the proxy caps a long-poll at its own limit instead
        with pytest.raises(ValueError, match="block_s"):
            q.claim("w", 1, block_s=3.0)
    with pytest.raises(ValueError, match="count"):
        q.read_rollouts("learner", 0)
    for ids in (["1-1", "$"], ["1-1 2-2"], ["1-1", "2-2 3-3"], ["1-1", 7], ["18446744073709551616-0"]):
        with pytest.raises(ValueError, match="delivery_ids"):  # checked in one match where it can be
            q.ack_rollouts(ids)
    assert q.heartbeat("w", [lease.lease_id]) == [lease.lease_id]


def test_heavy_traffic_with_trimming_never_loses_a_pending_entry(make_queue) -> None:
    """Workers finish most batches and abandon some; the learner acknowledges most
    rollouts and leaves some pending. Streams shrink, yet every unacknowledged entry
    keeps its payload."""
    n_batches, workers = 300, 4
    producer = make_queue(lease_timeout_s=60.0)
    abandoned: dict[str, str] = {}  # lease id -> batch id
    lock = threading.Lock()
    errors: list[BaseException] = []

    def produce() -> None:
        for start in range(0, n_batches, 20):
            producer.add_prompts([batch(i) for i in range(start, start + 20)])

    def work(name: str) -> None:
        q = make_queue(lease_timeout_s=60.0)
        try:
            idle = 0
            while idle < 20:
                leases = q.claim(name, 3, block_s=0.05)
                idle = 0 if leases else idle + 1
                for lease in leases:
                    if int(lease.batch.batch_id.split("-")[1]) % 7 == 0:
                        with lock:
                            abandoned[lease.lease_id] = lease.batch.batch_id
                    else:
                        q.submit(name, lease.lease_id, groups(lease.batch, actor=name))
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=produce)] + [
        threading.Thread(target=work, args=(f"w{i}",)) for i in range(workers)
    ]
    for t in threads:
        t.start()
    learner = make_queue()
    kept_pending = []
    read = 0
    while any(t.is_alive() for t in threads) or learner.stats().rollouts.waiting:
        got = learner.read_rollouts("learner", 16, block_s=0.05)
        read += len(got)
        kept_pending += got[:1]  # one of each read stays unacknowledged
        learner.ack_rollouts([d.delivery_id for d in got[1:]])
    for t in threads:
        t.join()
    assert not errors

    expected_abandoned = {f"batch-{i}" for i in range(0, n_batches, 7)}
    assert set(abandoned.values()) == expected_abandoned
    assert read == 2 * (n_batches - len(expected_abandoned))

    stats = learner.stats()
    assert stats.prompts.pending == len(abandoned)
    assert stats.prompts.length < n_batches // 2  # finished batches were trimmed
    assert stats.rollouts.pending == len(kept_pending)
    assert stats.rollouts.length < read // 2

    # every abandoned lease still has its payload and can be taken over
    rescuer = make_queue(lease_timeout_s=0.05)
    time.sleep(0.1)
    rescued = rescuer.claim("rescuer", len(abandoned) + 5)
    assert {lease.lease_id: lease.batch.batch_id for lease in rescued} == abandoned
    # every unacknowledged rollout is still readable
    again, after = [], "0"  # a page at a time (a call through the proxy takes at most 512)
    while page := learner.pending_rollouts("learner", 500, after):
        again, after = again + page, page[-1].delivery_id
    assert [d.group for d in again] == [d.group for d in kept_pending]
    assert learner.dead_letters() == []


def test_late_subscriber_learns_the_latest_adapter(make_queue) -> None:
    q = make_queue()
    assert q.latest_adapter() is None
    first = q.announce(manifest(1, step=10))
    second = q.announce(manifest(2, step=20))
    late = make_queue()  # a worker that joins now
    assert late.latest_adapter() == q.latest_adapter()
    assert late.latest_adapter().version == 2
    events = late.adapter_events()
    assert [(e.event_id, e.manifest.version) for e in events] == [(first, 1), (second, 2)]
    assert late.adapter_events(after=second) == []
    assert [e.manifest.version for e in late.adapter_events(after=first)] == [2]
    assert late.stats().latest_adapter_version == 2


def test_adapter_events_and_pubsub_wake_followers(make_queue) -> None:
    q, follower = make_queue(), make_queue()
    with follower.subscribe_adapters() as sub:
        assert sub.get(0.05) is None
        timer = threading.Timer(0.2, lambda: q.announce(manifest(1)))
        timer.start()
        events = follower.adapter_events(after="0", block_s=5.0)
        timer.join()
        assert [e.manifest.version for e in events] == [1]
        pushed = sub.get(5.0)
        assert pushed is not None and pushed.version == 1


def test_latest_version_only_moves_forward(make_queue) -> None:
    q = make_queue()
    event = q.announce(manifest(5))
    current = q.latest_adapter()
    assert current.version == 5
    assert q.announce(current) == event  # a retried announcement is a no-op
    with pytest.raises(VersionConflict, match="not above"):
        q.announce(manifest(5, step=99))  # same number, different adapter
    with pytest.raises(VersionConflict):
        q.announce(manifest(3))
    assert q.latest_adapter() == current
    assert [e.manifest.version for e in q.adapter_events()] == [5]


def test_runs_do_not_see_each_other(backend) -> None:
    from protocol import QueueConfig

    a = RedisQueue(backend(), QueueConfig(run="run-a"))
    b = RedisQueue(backend(), QueueConfig(run="run-b"))
    a.add_prompts([batch(0)])
    assert b.claim("w", 1) == []
    assert Keys("run-a").prompts != Keys("run-b").prompts
    assert "{run-a}" in Keys("run-a").prompts  # one cluster slot per run


def test_worker_statuses_replace_each_other_and_old_ones_are_forgotten(make_queue) -> None:
    import time

    from protocol import WorkerStatus

    q = make_queue()
    now = time.time()
    q.report_status(WorkerStatus(worker="a", adapter_version=1, reported_at=now))
    q.report_status(WorkerStatus(worker="a", adapter_version=2, reported_at=now))
    # the proxy stamps reports with its own clock: an old one can only be in Redis already
    old = q.direct if isinstance(q, ProxiedQueue) else q
    old.report_status(WorkerStatus(worker="b", adapter_version=1, reported_at=now - 600))  # long gone
    q._r.hset(q.keys.workers, "c", b"\xc1garbage")
    assert [(w.worker, w.adapter_version) for w in q.workers(max_age_s=120)] == [(listed(q, "a"), 2)]
    assert q._r.hkeys(q.keys.workers) == [listed(q, "a").encode()]  # b and c forgotten
    assert q.leave("a") is True and q.workers(max_age_s=120) == []  # a stopping worker's goodbye
    assert q.leave("a") is False
    with pytest.raises(ValueError):
        q.report_status(WorkerStatus(worker="has space", reported_at=now))
    with pytest.raises(ValueError):
        q.leave("has space")


def test_a_completed_runs_keys_expire(make_queue) -> None:
    from factories import batch

    q = make_queue()
    q.add_prompts([batch(0)])
    existing = [k for k in q.keys.all() if q._r.exists(k)]
    assert q.expire_run(60) == len(existing) >= 2
    assert all(0 < q._r.ttl(k) <= 60 for k in existing)
    assert q.claim("w", 1)  # still a working queue until then
    with pytest.raises(ValueError):
        q.expire_run(0)
