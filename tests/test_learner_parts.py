"""The learner's parts as the learner wires them, driven one call at a time: the `Feeder`
issues within the window, the `Collector` routes and judges each delivery and undoes an
abandoned collection, the `EvalSink` keeps eval groups out of training. A table per part,
on an in-memory Redis (the paths through a real one are `test_learner.py`'s runs), and
a failover on a real redis-server."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path

import fakeredis
import msgspec
import pytest
import redis
from factories import NO_AUDITS, completion, group, write_dataset
from servers import RedisServer
from waiting import wait_until

from learner.checkpoint import LearnerState
from learner.config import LearnerConfig
from learner.judge import Reason
from learner.loop import Learner
from learner.watchdog import ProgressWatch
from protocol import Delivery, PromptBatch, QueueConfig, RolloutGroup, pack_i32
from protocol.trusted import RedisQueue, open_store


def parts_config(tmp_path: Path, tiny_model: Path, **changes: object) -> LearnerConfig:
    """The parts' run: scripted groups of 4 for batches of 2 prompts, a window of 8;
    `changes` override any of it."""
    data = write_dataset(tmp_path / "data.jsonl")
    values: dict[str, object] = {
        "run": "parts",
        "queue": "redis://unused",
        "store": (tmp_path / "store").as_uri(),
        "model": str(tiny_model),
        "dataset": str(data),
        "eval_dataset": str(data),
        "eval_every": 2,
        "eval_max_prompts": 2,
        "eval_generations": 4,
        "run_dir": tmp_path / "run",
        "groups_per_step": 4,
        "num_generations": 4,
        "prompts_per_batch": 2,
        "max_inflight": 8,
        "adaptive_inflight": False,
        "max_tokens": 4,
        "max_staleness": 2,
        "lora_rank": 8,
        "tensorboard": False,
        **NO_AUDITS,  # the groups here are scripted, their log-probabilities made up
    }
    return LearnerConfig.model_validate({**values, **changes})


@pytest.fixture
def learner(tmp_path: Path, tiny_model: Path) -> Iterator[Learner]:
    cfg = parts_config(tmp_path, tiny_model)
    queue = RedisQueue(fakeredis.FakeRedis(version=(7, 0)), QueueConfig(run=cfg.run))
    learner = Learner(cfg, queue, open_store(cfg.store))
    yield learner
    learner.publisher.close()


def issued(learner: Learner) -> list[PromptBatch]:
    """The batches the feeder put in the queue, claimed back as a worker would see them."""
    return [lease.batch for lease in learner.queue.claim("w", 100)]


def answer(
    b: PromptBatch, i: int, *, actor: str = "w", version: int = 0, rewards: tuple[float, ...] = (0, 1, 0, 1)
) -> RolloutGroup:
    """A group that answers prompt `i` of `b` with the tokens it was issued (`factories.group`)."""
    return msgspec.structs.replace(
        group(b, i, actor=actor, version=version),
        prompt_token_ids=b.prompts[i].token_ids,
        completions=[completion(2, reward=r) for r in rewards],
    )


def test_the_feeder_fills_the_window_with_whole_batches_and_no_more(learner: Learner) -> None:
    feeder, ledger = learner.feeder, learner.state.ledger
    feeder.feed(kept=0)
    assert (ledger.inflight, ledger.batches_issued) == (8, 4)  # max_inflight, in batches of 2
    feeder.feed(kept=0)
    assert ledger.batches_issued == 4  # full: nothing more
    batches = issued(learner)
    assert [b.batch_id for b in batches] == ["parts-b0", "parts-b1", "parts-b2", "parts-b3"]
    assert feeder.metrics() == {
        "inflight": 8,
        "inflight_limit": 8,
        "epoch": 8 / len(learner.source),
        "sampling/flat_prompt_frac": 0.0,
        "sampling/skip_chance_mean": 0.0,
        "sampling/skipped_prompts": 0,
        "sampling/revisited_prompts": 0,
    }
    g = answer(batches[0], 0)
    assert feeder.issued_tokens(g) == {p.id: p.token_ids for p in batches[0].prompts}
    learner.collector.take(Delivery("1-0", g))
    learner.collector.take(Delivery("1-1", answer(batches[0], 1)))
    feeder.purge_completed()  # a finished batch: its tokens go, its slots free
    assert feeder.issued_tokens(g) is None and ledger.inflight == 6
    feeder.feed(kept=0)
    assert ledger.batches_issued == 5


Case = tuple[str, Callable[[list[PromptBatch]], RolloutGroup], Reason | None]
CASES: list[Case] = [
    ("an honest group", lambda bs: answer(bs[0], 0), None),
    ("every reward equal", lambda bs: answer(bs[0], 0, rewards=(1, 1, 1, 1)), Reason.FLAT),
    (
        "not the tokens issued",
        lambda bs: msgspec.structs.replace(answer(bs[0], 0), prompt_token_ids=pack_i32([9])),
        Reason.BAD_SHAPE,
    ),
    ("from a quarantined worker", lambda bs: answer(bs[0], 0, actor="mallory"), Reason.QUARANTINED),
    ("from the future", lambda bs: answer(bs[0], 0, version=7), Reason.FUTURE_VERSION),
]


@pytest.mark.parametrize(("make", "reason"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_the_collector_consumes_each_group_once_and_counts_its_verdict(
    learner: Learner, make: Callable[[list[PromptBatch]], RolloutGroup], reason: Reason | None
) -> None:
    collector, state = learner.collector, learner.state
    state.quarantined["mallory"] = "caught"
    learner.feeder.feed(kept=0)
    g = make(issued(learner))
    collector.take(Delivery("1-0", g))
    assert state.unacked == {g.group_id: "1-0"} and state.ledger.is_consumed(g.batch_id, g.prompt_id)
    assert collector.step.kept == ([g] if reason is None else [])
    assert collector.step.dropped == ([] if reason is None else [(g, reason)])
    assert state.totals.get(f"read/{reason or 'kept'}") == 1 and state.totals.get(reason or "kept", 1) == 1
    collector.take(Delivery("1-1", g))  # the same prompt's group again: a duplicate, not consumed twice
    assert collector.step.dropped[-1] == (g, Reason.DUPLICATE) and state.totals[Reason.DUPLICATE] == 1
    assert state.ledger.inflight == 7


def test_a_group_handed_out_again_after_its_batch_finished_is_a_duplicate(learner: Learner) -> None:
    """The same delivery twice, the second after its batch was finished and purged (the
    chaos soak: a client's recovery of a lost answer handed out groups the learner had
    read back after a restart, and 4 were trained twice). Taken since the last checkpoint,
    it is a duplicate however its batch stands; a stop keeps its first delivery's record."""
    collector, state = learner.collector, learner.state
    learner.feeder.feed(kept=0)
    b = issued(learner)[0]
    first = [Delivery(f"1-{i}", answer(b, i)) for i in range(2)]
    for d in first:
        collector.take(d)
    collector.end_step()
    learner.feeder.purge_completed()
    assert b.batch_id not in state.ledger.outstanding and state.ledger.consumed_prompts == 2
    collector.take(first[0])
    assert collector.step.dropped == [(first[0].group, Reason.DUPLICATE)] and state.ledger.consumed_prompts == 2
    collector.take(Delivery("9-0", first[0].group))  # again, under another delivery id
    collector.abandon()
    taken = {d.group.group_id: d.delivery_id for d in first}
    assert state.unacked == {**taken, f"{first[0].group.group_id}@9-0": "9-0"}  # both acknowledged


def test_a_group_of_a_finished_batch_is_a_duplicate_after_the_checkpoint_too(tmp_path: Path, tiny_model: Path) -> None:
    """Acknowledged at a checkpoint, then handed out again by a queue that lost the
    acknowledgement (a failover): not in `unacked` any more, its batch finished, it is a
    duplicate. A dead-lettered batch's stored group still comes as a group, once."""
    cfg = parts_config(tmp_path, tiny_model)
    leases_of_one_try = QueueConfig(run=cfg.run, lease_timeout_s=0.2, max_deliveries=1)
    queue = RedisQueue(fakeredis.FakeRedis(version=(7, 0)), leases_of_one_try)
    learner = Learner(cfg, queue, open_store(cfg.store))
    try:
        collector, state, feeder = learner.collector, learner.state, learner.feeder
        feeder.feed(kept=0)
        leases = queue.claim("w", 2)
        b0, b1 = (lease.batch for lease in leases)
        queue.submit("w", leases[0].lease_id, [answer(b0, i) for i in range(2)])
        first = queue.read_rollouts(collector.consumer, 10)
        for d in first:
            collector.take(d)
        collector.end_step()
        feeder.purge_completed()
        collector.acknowledge()  # what a checkpoint does next
        assert state.unacked == {} and feeder.behind(b0.batch_id) and not feeder.behind(b1.batch_id)
        assert not feeder.behind("parts-b99") and not feeder.behind("other-b0")  # ahead; another numbering
        collector.take(Delivery("7-0", first[1].group))
        assert collector.step.dropped == [(first[1].group, Reason.DUPLICATE)] and state.ledger.consumed_prompts == 2
        assert collector.step.kept == [] and state.unacked == {first[1].group.group_id: "7-0"}  # acknowledged again

        # b1's worker stores prompt 0's group and dies; its lease, out of deliveries, is dead-lettered
        queue.submit("w", leases[1].lease_id, [answer(b1, 0)])
        time.sleep(0.3)
        queue.claim("w2", 1)
        feeder.poll_dead_letters()
        assert not feeder.behind(b1.batch_id) and state.ledger.consumed_prompts == 3  # prompt 1 lost
        (late,) = queue.read_rollouts(collector.consumer, 10)
        collector.take(late)
        assert collector.step.kept == [late.group] and state.ledger.consumed_prompts == 4
        feeder.purge_completed()
        assert feeder.behind(b1.batch_id) and b1.batch_id in state.ledger.finished
    finally:
        learner.publisher.close()


@pytest.mark.redis
def test_groups_a_failover_hands_out_again_after_their_checkpoint_are_not_trained_twice(
    tmp_path: Path, tiny_model: Path, make_server: Callable[..., RedisServer]
) -> None:
    """Redis replicates asynchronously, so a replica promoted by a failover (or a host
    restarted under `appendfsync everysec`) can lack the last writes: here the
    acknowledgement of the groups a checkpoint holds. A real redis-server, restarted from
    a snapshot taken before it: the groups are pending again. The learner checkpoints
    again (its checkpoint no longer names them) and is resumed from there: it reads them
    back, and they are duplicates (their batch finished), acknowledged, not trained."""
    server = make_server()  # no append-only file: a restart loads the snapshot
    server.start()
    cfg = parts_config(tmp_path, tiny_model, queue=server.url)
    first = Learner(cfg, RedisQueue.from_url(server.url, QueueConfig(run=cfg.run)), open_store(cfg.store))
    consumer = first.collector.consumer
    try:
        first.start()
        first.feeder.feed(kept=0)
        (lease,) = first.queue.claim("w", 1)
        first.queue.submit("w", lease.lease_id, [answer(lease.batch, i) for i in range(2)])
        assert len(first.collector.collect(2, threading.Event()) or []) == 2
        first.collector.end_step()
        first.state.step = 1
        redis.Redis(port=server.port).save()  # the replica: the groups read, not acknowledged
        first.checkpoint()
        assert first.queue.pending_rollouts(consumer, 10) == []
        server.kill()
        server.start()  # the failover
        assert len(first.queue.pending_rollouts(consumer, 10)) == 2
        first.state.step = 2
        first.checkpoint()
    finally:
        first.publisher.close()  # and it stops (a crash, a new node): resumed from step 2
    queue = RedisQueue.from_url(server.url, QueueConfig(run=cfg.run))
    resumed = Learner(cfg.model_copy(update={"resume": True}), queue, open_store(cfg.store))
    try:
        resumed.start()
        collector = resumed.collector
        for d in collector._replay:  # what its first collection reads first
            collector.take(d)
        assert collector.step.kept == [] and resumed.state.ledger.consumed_prompts == 2
        assert [reason for _, reason in collector.step.dropped] == [Reason.DUPLICATE] * 2
        collector.end_step()
        resumed.checkpoint()
        assert queue.pending_rollouts(consumer, 10) == []  # acknowledged for good
    finally:
        resumed.publisher.close()


@pytest.mark.redis
@pytest.mark.parametrize("seen", [True, False], ids=["outage seen", "outage unseen"])
def test_a_running_learner_acknowledges_again_what_a_failover_gave_back(
    tmp_path: Path, tiny_model: Path, make_server: Callable[..., RedisServer], seen: bool
) -> None:
    """The same lost acknowledgement, met by the learner that gave it: once its read loop
    has met the outage, or else once its fleet check (every 15 s) counts more groups
    pending than it holds, it reads its pending groups again, takes those of its finished
    batch for duplicates, and its next checkpoint acknowledges them."""
    server = make_server()
    server.start()
    cfg = parts_config(tmp_path, tiny_model, queue=server.url, eval_every=0)
    learner = Learner(cfg, RedisQueue.from_url(server.url, QueueConfig(run=cfg.run)), open_store(cfg.store))
    collector, stop = learner.collector, threading.Event()
    try:
        learner.start()
        learner.feeder.feed(kept=0)
        (lease,) = learner.queue.claim("w", 1)
        learner.queue.submit("w", lease.lease_id, [answer(lease.batch, i) for i in range(2)])
        assert len(collector.collect(2, threading.Event()) or []) == 2
        collector.end_step()
        learner.state.step = 1
        redis.Redis(port=server.port).save()  # the replica: the groups read, not acknowledged
        learner.checkpoint()
        server.kill()
        collecting = threading.Thread(target=collector.collect, args=(2, stop), daemon=True)
        if seen:
            collecting.start()  # it meets the outage
            time.sleep(1.5)
        server.start()  # the failover
        if not seen:
            collecting.start()
        wait_until(lambda: len(collector.step.dropped) == 2, timeout_s=30, what="the groups read again")
        assert [reason for _, reason in collector.step.dropped] == [Reason.DUPLICATE] * 2
        stop.set()
        collecting.join(timeout=20)
        assert learner.state.ledger.consumed_prompts == 2 and len(learner.state.unacked) == 2
        learner.checkpoint()
        assert learner.queue.pending_rollouts(collector.consumer, 10) == []
    finally:
        stop.set()
        learner.publisher.close()


@pytest.mark.redis
def test_a_version_a_failover_lost_the_announcement_of_is_not_numbered_again(
    tmp_path: Path, tiny_model: Path, make_server: Callable[..., RedisServer]
) -> None:
    """The adapter's files reached the store, its announcement was lost with the last
    writes: a resumed learner numbers its next version above the store's too, so no worker
    that loaded the lost one takes another adapter for it."""
    server = make_server()
    server.start()
    cfg = parts_config(tmp_path, tiny_model, queue=server.url)
    store = open_store(cfg.store)
    first = Learner(cfg, RedisQueue.from_url(server.url, QueueConfig(run=cfg.run)), store)
    try:
        first.start()
        first.state.step = 1
        first.checkpoint()
        redis.Redis(port=server.port).save()  # the replica, before the announcement
        first.publish()
        first.publisher.flush()
        lost = store.read_manifest(1)
        assert first.queue.latest_adapter() == lost
    finally:
        first.publisher.close()
    server.kill()
    server.start()  # the failover
    queue = RedisQueue.from_url(server.url, QueueConfig(run=cfg.run))
    assert queue.latest_adapter() is None
    resumed = Learner(cfg.model_copy(update={"resume": True}), queue, store)
    try:
        resumed.start()  # publishes the restored policy under a new number
        resumed.publisher.flush()
        assert resumed.state.policy_version == 2 and queue.latest_adapter().version == 2
        assert store.read_manifest(1) == lost
    finally:
        resumed.publisher.close()


@pytest.mark.redis
@pytest.mark.parametrize("seen", [True, False], ids=["outage seen", "outage unseen"])
def test_batches_a_failover_lost_are_issued_again(
    tmp_path: Path, tiny_model: Path, make_server: Callable[..., RedisServer], seen: bool
) -> None:
    """The learner issued its window, and the replica promoted by a failover had not yet
    received those batches: no worker could claim them, and no group would ever come. The
    learner issues its outstanding batches again (a no-op for those the queue kept) once
    its read loop has met the outage, or else at the stall warning."""
    server = make_server()
    server.start()
    cfg = parts_config(tmp_path, tiny_model, queue=server.url, stall_warning_s=60 if seen else 1, eval_every=0)
    learner = Learner(cfg, RedisQueue.from_url(server.url, QueueConfig(run=cfg.run)), open_store(cfg.store))
    worker = RedisQueue.from_url(server.url, QueueConfig(run=cfg.run))
    stop = threading.Event()
    got: list[RolloutGroup] = []
    collecting = threading.Thread(target=lambda: got.extend(learner.collector.collect(2, stop) or []), daemon=True)
    try:
        learner.start()
        redis.Redis(port=server.port).save()  # the replica, before the batches
        learner.feeder.feed(kept=0)
        server.kill()
        if seen:  # the learner reads while the failover takes its time
            collecting.start()
            time.sleep(1.5)
        server.start()  # the failover
        if not seen:  # the learner's next call finds Redis answering again
            collecting.start()
        leases = wait_until(lambda: worker.claim("w", 1), timeout_s=20, what="a batch to claim")
        worker.submit("w", leases[0].lease_id, [answer(leases[0].batch, i) for i in range(2)])
        collecting.join(timeout=20)
        assert [g.batch_id for g in got] == [leases[0].batch.batch_id] * 2
        assert len(worker.claim("w", 10)) == 3  # the rest of the window, issued once
    finally:
        stop.set()
        learner.publisher.close()
        worker.close()


def test_a_stale_group_is_dropped_and_named_against_its_worker(learner: Learner) -> None:
    learner.feeder.feed(kept=0)
    batches = issued(learner)
    learner.state.policy_version = 3  # max_staleness 2: a group of the base model is 3 behind
    learner.collector.take(Delivery("1-0", answer(batches[0], 0, actor="slow")))
    assert learner.collector.step.count(Reason.STALE) == 1 and learner.collector._stale_drops == {"slow": 1}


def test_a_quarantine_drops_the_worker_s_kept_groups_and_a_stop_undoes_the_collection(learner: Learner) -> None:
    collector, state = learner.collector, learner.state
    learner.feeder.feed(kept=0)
    batches = issued(learner)
    collector.take(Delivery("1-0", answer(batches[0], 0, actor="a")))
    collector.take(Delivery("1-1", answer(batches[0], 1, actor="b")))
    collector.take(Delivery("1-2", answer(batches[1], 0, actor="a", rewards=(1, 1, 1, 1))))
    collector.quarantine("a", "failed an audit")
    assert [g.actor_id for g in collector.step.kept] == ["b"]
    assert [r for _, r in collector.step.dropped] == [Reason.FLAT, Reason.QUARANTINED]
    assert state.totals["read/kept"] == 1 and state.totals["read/rejected_quarantined"] == 1
    collector.abandon()  # a stop before the step: nothing of this collection is consumed
    assert state.unacked == {} and state.ledger.inflight == 8 and collector.step.dropped == []
    assert state.totals[Reason.FLAT] == 0 and state.totals[Reason.QUARANTINED] == 0
    assert state.totals["read/kept"] == 1  # what was read stays told (the summary's "read")
    reissued = collector.end_step()
    learner.feeder.reissue(reissued)
    assert state.ledger.to_reissue == []  # abandoned: nothing was dropped for the worker's sake


def test_the_feeder_issues_a_dishonest_worker_s_prompts_again_first(learner: Learner) -> None:
    collector, state = learner.collector, learner.state
    learner.feeder.feed(kept=0)
    batches = issued(learner)
    collector.take(Delivery("1-0", answer(batches[0], 1, actor="a")))
    collector.quarantine("a", "failed an audit")
    learner.feeder.reissue(collector.end_step())
    assert state.ledger.to_reissue == [1] and state.totals["reissued_prompts"] == 1
    learner.feeder.feed(kept=0)
    assert issued(learner) == []  # it waits for a checkpoint to hold it (`Feeder.checkpointed`)
    learner.checkpoint()
    learner.feeder.feed(kept=0)  # one slot free: the prompt goes out alone, before any new batch
    (again,) = issued(learner)
    assert again.batch_id == "parts-a0" and [p.id for p in again.prompts] == ["p1"]
    assert state.ledger.to_reissue == [] and state.ledger.inflight == 8


def test_a_resumed_learner_issues_what_the_crashed_one_did_under_the_same_ids(learner: Learner) -> None:
    """The groups read since the checkpoint come back in another order after a restart
    (those read before the crash first, those of batches ahead of the window later), and
    the window opens in another order too: the batches issued again must be the ones the
    queue kept, id for id, or a prompt goes out under two ids and is trained twice (a new
    batch), or a group is rejected and its prompt's revisit lost (a revisit; the chaos soak
    found one). A dishonest worker's prompt and the revisits go out from what the
    checkpoint held waiting."""
    collector, feeder, ledger = learner.collector, learner.feeder, learner.state.ledger
    learner.cfg.active_sampling_revisit = 1.0  # every group that teaches is revisited
    learner.state.quarantined["mallory"] = "caught"
    feeder.feed(kept=0)
    b = issued(learner)
    flat = (1.0, 1.0, 1.0, 1.0)
    step1 = [answer(b[0], 0), answer(b[0], 1, actor="mallory"), answer(b[1], 0), answer(b[1], 1, rewards=flat)]
    for i, g in enumerate(step1):
        collector.take(Delivery(f"1-{i}", g))
    feeder.reissue(collector.end_step())
    feeder.feed(kept=0)
    b4, _ = issued(learner)
    assert [p.id for p in b4.prompts] == ["p8", "p9"]
    assert (ledger.to_reissue, ledger.to_revisit) == ([1], [0, 2])  # found since the checkpoint: they wait
    learner.checkpoint()
    checkpoint = json.loads(json.dumps(asdict(learner.state)))
    # before the crash: b2, b3 and b4 read, and the window opens wide
    reads = [answer(x, i) for x in (b[2], b[3], b4) for i in (0, 1)]
    for i, g in enumerate(reads):
        collector.take(Delivery(f"2-{i}", g))
    feeder.feed(kept=0)
    before = {x.batch_id: [p.id for p in x.prompts] for x in issued(learner)}
    assert before == {"parts-a0": ["p1"], "parts-t0": ["p0", "p2"], "parts-b6": ["p12", "p13"]}
    assert ledger.to_revisit[:2] == [4, 5]  # read since the checkpoint: not issued till the next
    # resumed from the checkpoint: the groups come back, last first
    learner.state = LearnerState.from_json(checkpoint)
    feeder.reissue_outstanding(lambda f: f())
    for i, g in enumerate(reversed(reads)):
        collector.take(Delivery(f"3-{i}", g))
    feeder.feed(kept=0)
    outstanding = learner.state.ledger.outstanding
    assert {k: outstanding[k].prompt_ids() for k in before} == before
    assert issued(learner) == []  # nothing new: every id issued again names what the queue kept


def test_a_group_of_a_batch_issued_before_the_restart_waits_until_the_resumed_learner_issues_it(
    learner: Learner, caplog: pytest.LogCaptureFixture
) -> None:
    """The crashed learner issued b4 past its checkpoint and a worker answered it; the
    resumed one reads that group back before its window reaches b4. Consumed then, it would
    be checked against nothing and missing from b4's entry, which would never complete."""
    collector, feeder = learner.collector, learner.feeder
    feeder.feed(kept=0)
    b = issued(learner)
    checkpoint = json.loads(json.dumps(asdict(learner.state)))
    collector.take(Delivery("1-0", answer(b[0], 0)))
    collector.take(Delivery("1-1", answer(b[0], 1)))
    feeder.feed(kept=len(collector.step.kept))
    (b4,) = issued(learner)
    collector.end_step()  # the crash: the step in memory is gone
    learner.state = LearnerState.from_json(checkpoint)  # and the resume
    early = Delivery("2-2", answer(b4, 0))
    for d in (Delivery("2-0", answer(b[0], 0)), Delivery("2-1", answer(b[0], 1)), early):
        collector.take(d)
    ledger = learner.state.ledger
    assert early.group.group_id not in learner.state.unacked and ledger.consumed_prompts == 2
    assert [g.prompt_id for g in collector.step.kept] == ["p0", "p1"]
    collector.watch = ProgressWatch(first_s=0.0)
    with caplog.at_level(logging.WARNING, logger="learner.collector"):
        collector.explain_wait(4)  # a stall names what is held
    assert "1 more read, of batches issued before the restart" in caplog.text
    feeder.feed(kept=len(collector.step.kept))  # b4 again, under its id
    collector.take_issued(2)  # a step of 2 is full: the group waits for the next
    assert [g.prompt_id for g in collector.step.kept] == ["p0", "p1"]
    collector.take_issued(4)
    assert [g.prompt_id for g in collector.step.kept] == ["p0", "p1", "p8"]
    collector.take(Delivery("2-3", answer(b4, 1)))
    feeder.purge_completed()
    assert b4.batch_id not in ledger.outstanding and ledger.inflight == 6  # b1..b3 out, b0 and b4 done


def test_the_summary_counts_the_prompts_in_the_queue_one_by_one(learner: Learner) -> None:
    from learner.summary import accounting, final_stats

    learner.feeder.feed(kept=0)
    lease = learner.queue.claim("w", 1)[0]
    learner.queue.submit("w", lease.lease_id, [answer(lease.batch, 0)])  # one of the lease's two groups
    book = accounting(learner.state, learner.cfg, final_stats(learner.queue))
    # 7 prompts still to generate (the lease's entry stays until its last group) and 1 group in
    assert book["in_queue"] == learner.state.ledger.inflight == 8 and book["balanced"], book


def test_the_eval_sink_keeps_eval_groups_out_of_training_and_writes_the_version_s_figures(learner: Learner) -> None:
    from learner.metrics import MetricsLog
    from learner.progress import read_evals

    evals, state = learner.evals, learner.state
    evals.out = MetricsLog(learner.cfg.resolved_run_dir, trackers=[], resume_step=None)
    evals.start_fresh()
    evals.issue()
    (b,) = issued(learner)
    assert evals.is_eval(b.batch_id) and b.pinned_version == 0 and evals.outstanding() == 2
    assert evals.metrics() == {"eval_inflight": 2} and 0 in evals.pinned()
    learner.collector.take(Delivery("1-0", answer(b, 0, rewards=(1, 1, 1, 1))))
    assert learner.collector.step.kept == [] and learner.collector.step.dropped == []
    assert state.ledger.inflight == 0 and "1-0" in state.unacked.values()
    learner.collector.take(Delivery("1-1", answer(b, 1, rewards=(0, 0, 0, 0))))
    evals.out.close()
    (row,) = read_evals(learner.cfg.resolved_run_dir)
    assert (row["eval/version"], row["eval/prompts"], row["eval/pass@1"]) == (0, 2, 0.5)
    assert state.totals["tokens/evaluated"] == 2 * 4 * 2  # generated to be measured, never trained
    assert evals.outstanding() == 0 and evals.metrics() == {"eval_inflight": 0} and 0 not in evals.pinned()
    assert list(state.ledger.finished) == [b.batch_id]  # the queue may forget it with the next checkpoint


def test_every_generated_token_of_a_consumed_group_is_counted_once_where_it_went(learner: Learner) -> None:
    """`learner.token_use`: trained, truncated (masked out of the loss), flat, stale,
    rejected and evaluated tokens add up to what was generated; an abandoned collection
    counts nothing, and an episode's environment tokens are not the model's."""
    from learner.summary import accounting
    from learner.token_use import count_step, model_tokens, sequence_tokens, token_line

    collector, state = learner.collector, learner.state
    learner.cfg.mask_truncated_completions = True
    learner.feeder.feed(kept=0)
    b0, b1, b2, _ = issued(learner)
    cut = completion(3, reward=1.0, finish_reason="length")
    trained = msgspec.structs.replace(answer(b0, 0), completions=[*answer(b0, 0).completions[:3], cut])
    collector.take(Delivery("1-0", trained))  # 3 x 2 tokens trained, 3 truncated
    collector.take(Delivery("1-1", answer(b0, 1, rewards=(1, 1, 1, 1))))  # flat: 4 x 2
    collector.take(Delivery("1-2", answer(b1, 0, version=7)))  # rejected (a future version): 4 x 2
    collector.take(Delivery("1-3", trained))  # the same prompt again: rejected as a duplicate, 9
    collector.abandon()  # a stop: none of it is consumed, so none of it is counted
    count_step(state, collector.end_step(), mask_truncated=True, trained_with=0)
    assert not any(k.startswith("tokens/") for k in state.totals)

    for i, g in enumerate([trained, answer(b0, 1, rewards=(1, 1, 1, 1)), answer(b1, 0, version=7), trained]):
        collector.take(Delivery(f"2-{i}", g))
    state.policy_version = 3  # max_staleness 2: a group of the base model is stale now
    collector.take(Delivery("2-4", answer(b2, 0)))  # stale: 4 x 2
    collector.take(Delivery("2-5", answer(b1, 1, version=1, rewards=(0, 0, 0, 0))))  # flat, below the best: unsolved
    count_step(state, collector.end_step(), mask_truncated=True, trained_with=1)
    summary = accounting(state, learner.cfg, None)
    tokens = summary["tokens"]
    assert tokens == {
        "generated": 6 + 3 + 16 + 8 + 9 + 8,
        "trained": 6,
        "truncated": 3,
        "flat": 16,
        "stale": 8,
        "rejected": 17,
        "evaluated": 0,
        "flat_unsolved": 8,  # of flat: the all-wrong group; the all-right one was mastered
        "trained_share": round(6 / 50, 4),
        "trained_within_one_version": 1.0,  # v0's tokens, trained by the policy of v1
    }
    assert summary["flat_unsolved"] == 1 and summary["dropped"]["dropped_flat"] == 2
    assert token_line(tokens) == (
        "trained 12% of 50 generated tokens (truncated 6%, flat 32% = 16% unsolved + 16% mastered, stale 16%, "
        "rejected 34%); 100% of them within one version of the policy"
    )
    episode = completion(6, reward=1.0, mask=[1, 1, 0, 0, 1, 0])
    assert model_tokens(episode) == 3 and model_tokens(completion(6)) == 6
    # TRL's num_tokens: each sequence's prompt once, with its completion
    prompt = trained.prompt_tokens.size
    assert prompt > 1 and sequence_tokens([trained]) == 4 * prompt + 3 * 2 + 3


@pytest.mark.parametrize(("environment", "said"), [("toy_tools:ScoredGuess", True), ("toy_tools:GuessNumber", False)])
def test_the_learner_says_its_environment_scores_episodes_only_when_it_does(
    learner: Learner, environment: str, said: bool
) -> None:
    """With trusted scoring the learner publishes its rewards for the scorers to check theirs
    against, and its environment when it owns a reward (`get_reward`)."""
    from learner.lifecycle import open_run

    cfg = learner.cfg.model_copy(
        update={"scoring": "trusted", "reward": ["toy_rewards:digit_first"], "environment": environment}
    )
    open_run(learner.queue, cfg, lambda call: call())
    expected = ["toy_rewards:digit_first=1.0", *([f"environment={environment}"] if said else [])]
    assert learner.queue.run_rewards() == expected


def test_the_learner_sets_its_runs_fleet_share_only_when_told(learner: Learner) -> None:
    from learner.lifecycle import open_run
    from protocol import RunShare

    learner.queue.set_run_share(RunShare(weight=4.0))  # the admin's
    open_run(learner.queue, learner.cfg, lambda call: call())
    assert learner.queue.run_share() == RunShare(weight=4.0)  # not said: the admin's stays
    open_run(learner.queue, learner.cfg.model_copy(update={"fleet_weight": 2.0, "fleet_cap": 0.5}), lambda c: c())
    assert learner.queue.run_share() == RunShare(weight=2.0, cap=0.5)
