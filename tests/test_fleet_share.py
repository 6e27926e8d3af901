"""One worker, several runs (`actors.runs`): each run's adapters its own on one engine,
claims by weighted share, a run's end or another base model stopping that run alone."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import msgspec
import pytest
from factories import batch, stored_manifest
from scripted import ScriptedEngine

from actors.engine import EngineError, GroupRequest
from actors.runs import EMPTY_PAUSE_S, SHARE_HALF_LIFE_S, AdapterSlots, RunEngine, RunLink, claim_order, shares
from actors.watcher import AdapterWatcher
from actors.worker import SCORING_STEP_S, STEP_S, Worker
from learner.tiny import build_tokenizer
from protocol import PromptBatch, ProtocolError, QueueConfig, RunShare, SamplingParams
from protocol.trusted import RedisQueue
from protocol.trusted.store import StoreSource, open_store
from protocol.usercode.rewards import Scorer, Scores, load_reward

OURS, OTHER = "ab" * 8, "cd" * 8


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_each_run_has_its_own_adapter_versions_on_one_engine(tokenizer, tmp_path: Path) -> None:
    engine = ScriptedEngine(tokenizer, lambda text, j: "5")
    slots = AdapterSlots()
    a, b = RunEngine(engine, "a", slots), RunEngine(engine, "b", slots)
    a.load_adapter(1, tmp_path)
    b.load_adapter(1, tmp_path)
    b.load_adapter(2, tmp_path)
    assert len(set(engine.loaded_versions())) == 3  # a's v1 is not b's v1
    assert a.loaded_versions() == [1] and b.loaded_versions() == [1, 2]
    a.add([GroupRequest("g", [1, 2], 2, SamplingParams(max_tokens=4), 1)])
    assert engine.requests[-1].version == slots.slot("a", 1) != slots.slot("b", 1)
    with pytest.raises(EngineError):  # b's v3 is not loaded, whatever a holds
        b.add([GroupRequest("h", [1, 2], 2, SamplingParams(max_tokens=4), 3)])
    engine.step(0.0)
    a.evict_adapter(1)
    assert a.loaded_versions() == [] and b.loaded_versions() == [1, 2]
    a.load_adapter(1, tmp_path)  # wanted again (an evaluation): its old number back
    assert engine.loaded_versions()[-1] == slots.slot("a", 1)
    assert slots.slot("a", 0) == slots.slot("b", 0) == 0  # the base model is everyone's


def _link(run: str, weight: float = 1.0, cap: float | None = None) -> RunLink:
    return RunLink(run, None, None, None, weight=weight, cap=cap)  # type: ignore[arg-type]


def test_the_run_furthest_below_its_weighted_share_claims_next() -> None:
    now = time.monotonic()
    a, b, c = _link("a"), _link("b", weight=3.0), _link("c", cap=0.25)
    for link in (a, b, c):
        link.served_at = now
    a.claimed(10, now)
    b.claimed(20, now)
    assert [k.run for k in claim_order([a, b, c], now, 64)] == ["c", "b", "a"]  # 0, 20/3, 10
    c.in_flight, c.lease_size = 16, 8  # at its cap of 16 of 64 sequences
    assert [k.run for k in claim_order([a, b, c], now, 64)] == ["b", "a"]
    c.in_flight = 8
    assert "c" in [k.run for k in claim_order([a, b, c], now, 64)]
    c.in_flight, c.lease_size, c.cap = 0, 64, 0.1  # one lease at least, whatever its cap
    assert "c" in [k.run for k in claim_order([a, b, c], now, 64)]
    a.empty_until, b.over = now + EMPTY_PAUSE_S, "finished"
    assert [k.run for k in claim_order([a, b, c], now, 64)] == ["c"]
    assert a.used(now + SHARE_HALF_LIFE_S) == pytest.approx(5.0)  # what a run had halves
    assert shares([a, b], now) == pytest.approx({"a": 1 / 3, "b": 2 / 3})


def test_a_run_share_is_kept_on_redis_and_refused_when_bad(redis_server, run_name: str) -> None:
    queue = RedisQueue.from_url(redis_server.url, QueueConfig(run=run_name))
    assert queue.run_share() == RunShare()  # nobody said: weight 1, no cap
    queue.set_run_share(RunShare(weight=3.0, cap=0.5))
    assert queue.run_share() == RunShare(weight=3.0, cap=0.5)
    for bad in ({"weight": 0.0}, {"weight": float("nan")}, {"cap": 1.5}):
        with pytest.raises((msgspec.ValidationError, ProtocolError)):
            msgspec.convert(bad, RunShare)
    with pytest.raises(ProtocolError):
        queue.set_run_share({"weight": 2.0})  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match="weight"):
        queue.set_run_share(RunShare(weight=-1.0))
    assert queue.run_share() == RunShare(weight=3.0, cap=0.5)  # unchanged
    queue.close()


def _batches(run: str, n: int, model: str | None = OURS) -> list[PromptBatch]:
    return [msgspec.structs.replace(batch(f"{run}-{i}", prompts=1), model=model) for i in range(n)]


class _Fleet:
    """One worker loop serving runs on one scripted engine, each run's queue on the
    session's Redis, as `actors run` without --run builds it (`actors.runs.RunOpener`)."""

    def __init__(self, redis_url: str, runs: list[str], tokenizer, tmp_path: Path) -> None:
        self.engine = ScriptedEngine(tokenizer, lambda text, j: "5")
        self.queues = {r: RedisQueue.from_url(redis_url, QueueConfig(run=r, lease_timeout_s=30)) for r in runs}
        self.redis_url, self.tmp = redis_url, tmp_path
        self.stores: dict[str, Any] = {}
        self.slots = AdapterSlots()
        links = [self.link(run) for run in runs]
        first = links[0]
        self.worker = Worker(
            first.queue,
            self.engine,
            first.watcher,
            Scorer([load_reward("toy_rewards:digit_first")]),
            "w",
            claim_block_s=0.2,
            max_num_seqs=4,
            more_runs=links[1:],
            fingerprint=OURS,
        )

    def link(self, run: str) -> RunLink:
        """The run's queue, store (a prefix of its own), `RunEngine` and watcher."""
        queue = self.queues.get(run) or RedisQueue.from_url(self.redis_url, QueueConfig(run=run, lease_timeout_s=30))
        self.queues[run] = queue
        self.stores[run] = open_store((self.tmp / "store" / run).as_uri())
        view = RunEngine(self.engine, run, self.slots)
        return RunLink(run, queue, AdapterWatcher(queue, StoreSource(self.stores[run]), view, self.tmp / run), view)

    def stored(self, run: str) -> int:
        return self.queues[run].stats().rollouts.length

    def close(self) -> None:
        for queue in self.queues.values():
            queue.close()


def test_claims_follow_the_runs_weights(redis_server, run_name: str, tokenizer, tmp_path: Path) -> None:
    a, b = f"{run_name}-a", f"{run_name}-b"
    fleet = _Fleet(redis_server.url, [a, b], tokenizer, tmp_path)
    fleet.queues[b].set_run_share(RunShare(weight=3.0))
    for run in (a, b):
        fleet.queues[run].add_prompts(_batches(run, 60))
    assert fleet.worker.work(max_batches=60) == 0
    got_a, got_b = fleet.stored(a), fleet.stored(b)
    assert got_a + got_b == 60
    assert abs(got_b / 60 - 0.75) <= 0.1, (got_a, got_b)  # the weights: 1 to 3
    fleet.close()


def test_a_run_that_ends_or_trains_another_model_stops_alone(
    redis_server, run_name: str, tokenizer, tmp_path: Path
) -> None:
    a, b, c = f"{run_name}-a", f"{run_name}-b", f"{run_name}-c"
    fleet = _Fleet(redis_server.url, [a, b, c], tokenizer, tmp_path)
    fleet.queues[a].add_prompts(_batches(a, 8))
    fleet.queues[b].add_prompts(_batches(b, 2, model=OTHER))
    fleet.queues[c].add_prompts(_batches(c, 2))
    fleet.queues[c].set_run_over(f"run {c!r} is over")
    done = threading.Thread(target=fleet.worker.work, kwargs={"max_batches": 8})
    done.start()
    done.join(timeout=60)
    assert not done.is_alive()
    assert fleet.stored(a) == 8  # served whole
    assert fleet.stored(b) == 0
    assert len(fleet.queues[b].claim("another", 2)) == 2  # handed back: a worker with its model takes it
    assert fleet.stored(c) == 0
    over = {k.run: k.over for k in fleet.worker.links}
    assert over[a] is None and "another base model" in (over[b] or "") and "is over" in (over[c] or "")
    fleet.close()


def test_a_worker_serving_one_run_refuses_a_batch_for_another_model(
    redis_server, run_name: str, tokenizer, tmp_path: Path
) -> None:
    from actors.worker import WorkerRefused

    fleet = _Fleet(redis_server.url, [run_name], tokenizer, tmp_path)
    fleet.queues[run_name].add_prompts(_batches(run_name, 1, model=OTHER))
    with pytest.raises(WorkerRefused, match=r"another base model.*learner's --model"):
        fleet.worker.work(max_batches=1)
    assert len(fleet.queues[run_name].claim("another", 1)) == 1  # handed back for a worker that has its model
    fleet.close()


def test_a_run_whose_adapter_is_broken_stops_alone(redis_server, run_name: str, tokenizer, tmp_path: Path) -> None:
    """Run a announces a damaged adapter, run b a sound one: a's watcher refuses a's and a
    generates on with what it had (the base model); b's groups are generated with b's v1
    and carry its digest."""
    from protocol.wire.files import adapter_digest, adapter_key

    a, b = f"{run_name}-a", f"{run_name}-b"
    fleet = _Fleet(redis_server.url, [a, b], tokenizer, tmp_path)
    broken = stored_manifest(fleet.stores[a], 1)
    fleet.stores[a].put(adapter_key(1, "adapter_model.safetensors"), b"not the bytes the manifest names")
    sound = stored_manifest(fleet.stores[b], 1, weights=b"b's own weights")
    fleet.queues[a].announce(broken)
    fleet.queues[b].announce(sound)
    for link in fleet.worker.links:
        link.watcher.sync()
    for run in (a, b):
        fleet.queues[run].add_prompts(_batches(run, 3))
    assert fleet.worker.work(max_batches=6) == 0
    got = {run: [d.group for d in fleet.queues[run].read_rollouts("l", 10)] for run in (a, b)}
    assert [g.adapter_version for g in got[a]] == [0, 0, 0] and 1 in fleet.worker.links[0].watcher.refused
    assert {(g.adapter_version, g.adapter_digest) for g in got[b]} == {(1, adapter_digest(sound.files))}
    fleet.close()


def test_the_learner_sees_the_share_of_the_fleet_its_run_gets() -> None:
    from learner.fleet import FleetWatch
    from protocol import WorkerStatus

    watch = FleetWatch()
    watch.update([], 0, 2)
    assert watch.share is None
    alone = WorkerStatus(worker="t/alone", reported_at=time.time())
    shared = WorkerStatus(worker="t/shared", share=0.2, reported_at=time.time())
    watch.update([alone, shared], 0, 2)
    assert watch.share == pytest.approx(0.6) and watch.live == 2


def test_a_flood_of_one_runs_prompts_starves_no_other(redis_server, run_name: str, tokenizer, tmp_path: Path) -> None:
    a, b = f"{run_name}-a", f"{run_name}-b"
    fleet = _Fleet(redis_server.url, [a, b], tokenizer, tmp_path)
    fleet.queues[a].add_prompts(_batches(a, 100))  # queued first, and many
    fleet.queues[b].add_prompts(_batches(b, 3))
    assert fleet.worker.work(max_batches=8) == 0
    assert fleet.stored(b) == 3 and fleet.stored(a) == 5  # b took its turns from the start
    fleet.close()


def test_a_run_whose_batches_this_worker_cannot_serve_is_left_to_others(
    redis_server, run_name: str, tokenizer, tmp_path: Path
) -> None:
    """Run b runs episodes with tools this worker lacks: b is handed back and no longer
    claimed from; run a is served whole (serving b alone, the worker would stop, refused)."""
    a, b = f"{run_name}-a", f"{run_name}-b"
    fleet = _Fleet(redis_server.url, [a, b], tokenizer, tmp_path)
    fleet.queues[a].add_prompts(_batches(a, 4))
    fleet.queues[b].add_prompts([msgspec.structs.replace(x, tools=["add"]) for x in _batches(b, 2)])
    assert fleet.worker.work(max_batches=4) == 0
    assert fleet.stored(a) == 4 and fleet.stored(b) == 0
    (link_b,) = [k for k in fleet.worker.links if k.run == b]
    assert "runs episodes with the tools add" in (link_b.over or "")
    assert len(fleet.queues[b].claim("another", 2)) == 2  # handed back
    fleet.close()


def test_a_worker_serves_a_run_added_while_it_works(redis_server, run_name: str, tokenizer, tmp_path: Path) -> None:
    a, b = f"{run_name}-a", f"{run_name}-b"
    fleet = _Fleet(redis_server.url, [a], tokenizer, tmp_path)
    asked: list[set[str]] = []

    def find_runs(serving: set[str]) -> list[RunLink]:
        asked.append(serving)
        return [] if b in serving else [fleet.link(b)]

    fleet.worker.find_runs, fleet.worker.find_runs_every_s = find_runs, 0.2
    fleet.queues[a].add_prompts(_batches(a, 2))
    fleet.link(b).queue.add_prompts(_batches(b, 2))
    assert fleet.worker.work(max_batches=4) == 0
    assert fleet.stored(a) == 2 and fleet.stored(b) == 2 and {a} in asked
    fleet.close()


def test_a_worker_of_one_run_asks_again_at_once_after_an_empty_claim(
    redis_server, run_name: str, tokenizer, tmp_path: Path
) -> None:
    """The half-second pause after an empty claim spreads a worker's calls over several
    runs; a worker of one run with work in flight claims again at its next turn (the pause
    had cut `bench/vs_trl.py` from 11.7 to 7.2 steps/s)."""
    fleet = _Fleet(redis_server.url, [run_name], tokenizer, tmp_path)
    [link] = fleet.worker.links
    assert not fleet.worker._claim(link, 1, 0.0)  # nothing queued yet
    assert link.empty_until == 0.0 and claim_order([link], time.monotonic(), 4) == [link]
    two = _Fleet(redis_server.url, [f"{run_name}-a", f"{run_name}-b"], tokenizer, tmp_path / "two")
    a = two.worker.links[0]
    assert not two.worker._claim(a, 1, 0.0)
    assert a.empty_until > time.monotonic() and a not in claim_order(two.worker.links, time.monotonic(), 4)
    fleet.close()
    two.close()


class _Busy(ScriptedEngine):
    """Finishes one group a step (the others keep it busy) and records, for each step,
    the time it was given and whether a score was pending then."""

    worker: Worker

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer, lambda text, j: "5")
        self.turns: list[tuple[float, bool]] = []

    def step(self, timeout_s: float, abort: threading.Event | None = None):
        self.turns.append((timeout_s, bool(self.worker.scoring)))
        with self._lock:
            first, self._queue = self._queue[:1], self._queue[1:]
        return [(g.key, [self._sample(g, j) for j in range(g.n)]) for g in first]


class _LateScorer:
    """The real scorer, its answer 30 ms after it is asked (a reward process's round trip)."""

    def __init__(self) -> None:
        self.inner = Scorer([load_reward("toy_rewards:digit_first")])

    def submit(self, group: Any) -> Future[Scores]:
        late: Future[Scores] = Future()
        scores = self.inner.submit(group).result()
        threading.Timer(0.03, late.set_result, (scores,)).start()
        return late

    def close(self) -> None:
        pass


def test_a_scored_group_is_sent_without_waiting_out_the_engines_turn(
    redis_server, run_name: str, tokenizer, tmp_path: Path
) -> None:
    """While a group is being scored the engine is stepped one iteration a turn, and with
    nothing to generate the worker waits on the score itself: a lease's last group is
    submitted as its score comes in, not up to `STEP_S` later."""
    queue = RedisQueue.from_url(redis_server.url, QueueConfig(run=run_name, lease_timeout_s=30))
    engine = _Busy(tokenizer)
    watcher = AdapterWatcher(queue, StoreSource(open_store((tmp_path / "store").as_uri())), engine, tmp_path / "a")
    engine.worker = Worker(queue, engine, watcher, _LateScorer(), "w", claim_block_s=0.2, max_num_seqs=64)
    queue.add_prompts([*_batches(run_name, 3), msgspec.structs.replace(batch(f"{run_name}-4", prompts=4), model=OURS)])
    assert engine.worker.work(max_batches=4) == 0
    assert queue.stats().rollouts.length == 7
    scoring = [t for t, pending in engine.turns if pending]
    assert scoring, "no step was taken while a score was pending: the test saw nothing"
    assert max(scoring) <= SCORING_STEP_S < STEP_S
    queue.close()
