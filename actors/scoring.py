"""The trusted scoring tier: RQ workers that score the groups actors submitted unscored.

`actors score --redis redis://… --run R --reward module:function` on the trusted side
(it needs Redis itself and the data set's private columns; actors never do). Start as
many as you like; each is one RQ worker plus a dispatcher thread.

- **Dispatcher** (a thread): reads the `unscored` stream (consumer group `scorers`) and
  enqueues one RQ job per lease's groups read together (`--groups-per-job` at most),
  its id derived from the run and the group ids. An entry is pending from its read
  until its job exists; one read by a dispatcher that died before enqueueing is taken
  over by another after `redispatch_s`. It also empties RQ's failed-job registry: a
  failed job of several groups is split into one job per group (so one bad group does
  not sink its lease), and a failed one-group job becomes a rejected group (reward
  None, the error text), which reaches the learner and is counted, never trained on.
- **The RQ worker** (the main thread; a forked work horse per job) runs `score_job`.
  RQ does the job handling: `job_timeout` ends a hung reward (SIGALRM in the horse;
  past the timeout plus `abandon_after_s` the worker kills the horse), `Retry` with
  backoff re-runs a reward that raised, and a job whose worker died is found abandoned
  by RQ's maintenance and retried.
- **Idempotent by group id**: a group scored twice (a job re-run after its worker died
  mid-store, a dispatcher that enqueued it again) is stored once (`STORE_SCORED`).

Why one job per lease's groups, not per group: RQ's cost per job (a fork, a dozen Redis
round trips: about 16 ms on two cores, `bench/scoring.py`) is a tenth of a 20 ms-per-
completion reward on a group of 8, but it is the whole cost of a cheap reward, and an
actor sends a lease's groups together. The unit of idempotency stays the group.

Jobs carry only ids, serialized as JSON (RQ's `JSONSerializer`): no pickle in Redis.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import msgspec
import redis
from rq import Queue as RQQueue
from rq import Retry, Worker
from rq.exceptions import NoSuchJobError, StopRequested
from rq.job import Job
from rq.registry import FailedJobRegistry
from rq.serializers import JSONSerializer

from actors.rewards import Scorer, Scores
from protocol import ProtocolError, QueueUnavailable, RolloutGroup
from protocol.scoring import ScoringQueue, UnscoredEntry, UnscoredGroup

log = logging.getLogger(__name__)

def rq_queue_name(run: str) -> str:
    return f"spotgrpo:{run}:scoring"


@dataclass
class Tier:
    """What a job needs, made once in the worker before it forks its work horses."""

    queue: ScoringQueue
    scorer: Scorer
    name: str


_TIER: Tier | None = None


def scored_group(item: UnscoredGroup, scores: Scores, scored_by: str, score_s: float) -> RolloutGroup:
    """The actor's group with the tier's rewards in place of whatever it sent."""
    group = item.group
    completions = [
        msgspec.structs.replace(c, reward=r, reward_components=comp, error=scores.error)
        for c, r, comp in zip(group.completions, scores.rewards, scores.components, strict=True)
    ]
    return msgspec.structs.replace(
        group, completions=completions, error=scores.error, scored_by=scored_by,
        timings={**group.timings, "score_s": score_s, "scored_at": time.time()},
    )


def rejected_group(item: UnscoredGroup, error: str, scored_by: str) -> RolloutGroup:
    n = len(item.group.completions)
    return scored_group(item, Scores([None] * n, [{} for _ in range(n)], error), scored_by, 0.0)


def score_job(*entry_ids: str) -> list[dict[str, Any]]:
    """One RQ job: score the groups of these unscored entries (a lease's, as they came in)
    and store each. A reward that raises fails the job (RQ retries it; groups stored by an
    earlier attempt are skipped); any other failure of the reward (wrong shape, every
    function abstaining) rejects that group at once: running it again would give the
    same answer."""
    tier = _TIER
    if tier is None:
        raise RuntimeError("score_job runs in an `actors score` worker")
    return [_score_one(tier, entry_id) for entry_id in entry_ids]


def _score_one(tier: Tier, entry_id: str) -> dict[str, Any]:
    try:
        item = tier.queue.fetch_unscored(entry_id)
    except ProtocolError as err:
        tier.queue.dead_letter_unscored(entry_id, f"malformed: {err}")
        return {"entry": entry_id, "stored": False, "dead_lettered": str(err)}
    if item is None or tier.queue.is_scored(item.group.group_id):
        return {"entry": entry_id, "stored": False}
    if item.prompt is None:
        group = rejected_group(item, "scoring: the private prompt record is missing", tier.name)
    else:
        started = time.monotonic()
        texts = [c.text for c in item.group.completions]
        ids = [c.tokens.tolist() for c in item.group.completions]
        scores = tier.scorer.score(item.prompt, "", texts, ids)
        group = scored_group(item, scores, tier.name, time.monotonic() - started)
    stored = tier.queue.store_scored(entry_id, group)
    return {"entry": entry_id, "group": group.group_id, "stored": stored, "error": group.error}


class ScoringWorker(Worker):
    """RQ's forking worker; only how soon a dead worker's job counts as abandoned is ours
    (RQ's is the monitoring interval plus a fixed 60 s)."""

    abandon_after_s = 60
    RQ_GRACE_S = 60
    """What RQ adds to the monitoring interval (2.x and 3.x alike)."""

    stop_requested = False
    """SIGTERM or SIGINT reached this worker (RQ's loop also ends, and says less, when
    Redis goes away)."""

    def get_heartbeat_ttl(self, job: Job, *args: Any, **kwargs: Any) -> int:
        ttl = super().get_heartbeat_ttl(job, *args, **kwargs)
        return max(1, int(ttl) - self.RQ_GRACE_S + self.abandon_after_s)

    def request_stop(self, signum: int, frame: Any) -> None:
        self.stop_requested = True
        super().request_stop(signum, frame)


class Dispatcher(threading.Thread):
    """Unscored stream -> RQ jobs; RQ's failed jobs -> rejected groups. See the module
    docstring."""

    def __init__(self, queue: ScoringQueue, rq: RQQueue, name: str, *, job_timeout_s: float, retries: int,
                 retry_backoff_s: float, groups_per_job: int = 8, redispatch_s: float = 30.0,
                 sweep_s: float = 1.0) -> None:
        super().__init__(name=f"dispatcher-{name}", daemon=True)
        self.queue, self.rq, self.consumer = queue, rq, name
        self.job_timeout_s = job_timeout_s
        self.retries, self.retry_backoff_s = retries, retry_backoff_s
        self.groups_per_job = groups_per_job
        self.redispatch_s = redispatch_s
        self.sweep_s = sweep_s
        self.stopping = threading.Event()

    def job_id(self, group_ids: list[str]) -> str:
        """One job id per set of groups of a run (RQ ids are global to the Redis; letters,
        digits and dashes only)."""
        key = "\0".join([self.queue.config.run, *group_ids]).encode()
        return hashlib.blake2b(key, digest_size=16).hexdigest()

    def run(self) -> None:
        backoff, swept = 0.5, 0.0
        while not self.stopping.is_set():
            try:
                self.dispatch(self.queue.read_unscored(self.consumer, 64, block_s=min(1.0, self.sweep_s)))
                if time.monotonic() - swept >= self.sweep_s:
                    reclaimed = self.queue.reclaim_unscored(self.consumer, self.redispatch_s)
                    if reclaimed:
                        log.warning("%d unscored group(s) read by a dispatcher that never made them jobs; "
                                    "dispatching them now", len(reclaimed))
                        self.dispatch(reclaimed)
                    self.reject_failed()
                    swept = time.monotonic()
                backoff = 0.5
            except QueueUnavailable as err:
                log.warning("redis unavailable, retrying in %.1fs: %s", backoff, err)
                self.stopping.wait(backoff)
                backoff = min(backoff * 2, 30.0)
            except Exception:  # RQ's own errors included: keep dispatching
                log.exception("dispatcher error; retrying in %.1fs", backoff)
                self.stopping.wait(backoff)
                backoff = min(backoff * 2, 30.0)

    def dispatch(self, entries: list[UnscoredEntry]) -> None:
        """One job per lease's groups read together (at most `groups_per_job`), then the
        entries are no longer pending. A crash in between leaves them pending: they are
        dispatched again after `redispatch_s` (a second job for the same groups is
        harmless: storing is idempotent)."""
        by_batch: dict[str, list[UnscoredEntry]] = {}
        for e in entries:
            by_batch.setdefault(e.batch_id, []).append(e)
        for chunk_of_batch in by_batch.values():
            for i in range(0, len(chunk_of_batch), self.groups_per_job):
                self.enqueue(chunk_of_batch[i : i + self.groups_per_job])
        self.queue.dispatched([e.entry_id for e in entries])

    def enqueue(self, entries: list[UnscoredEntry]) -> None:
        retry = (Retry(max=self.retries, interval=[self.retry_backoff_s * 2**i for i in range(self.retries)])
                 if self.retries else None)
        self.rq.enqueue(
            score_job, *[e.entry_id for e in entries], job_id=self.job_id([e.group_id for e in entries]),
            job_timeout=max(1, round(self.job_timeout_s * len(entries))), retry=retry, result_ttl=300,
            failure_ttl=3600, description=f"score {len(entries)} group(s) of batch {entries[0].batch_id}",
            meta={"groups": [e.group_id for e in entries], "batch": entries[0].batch_id},
        )

    def reject_failed(self) -> None:
        """Jobs that failed for good (retries spent) leave RQ's failed-job registry. A job
        of several groups is split into one job per group, with fresh retries, so that one
        bad group does not take its lease's others with it; a one-group job's group
        reaches the learner as rejected, with the error, and is counted there."""
        registry = FailedJobRegistry(queue=self.rq)
        for job_id in registry.get_job_ids(0, 99):
            try:
                job = Job.fetch(job_id, connection=self.rq.connection, serializer=JSONSerializer)
            except NoSuchJobError:
                registry.remove(job_id)
                continue
            entry_ids = [str(a) for a in job.args]
            groups = list(job.meta.get("groups") or [])
            if len(entry_ids) > 1 and len(groups) == len(entry_ids):
                for entry_id, group_id in zip(entry_ids, groups, strict=True):
                    self.enqueue([UnscoredEntry(entry_id, group_id, str(job.meta.get("batch", "")))])
            elif entry_ids:
                self.reject(entry_ids[0], _last_line(job))
            registry.remove(job, delete_job=False)

    def reject(self, entry_id: str, reason: str) -> None:
        try:
            item = self.queue.fetch_unscored(entry_id)
        except ProtocolError as err:
            self.queue.dead_letter_unscored(entry_id, f"malformed: {err}")
            return
        if item is None:
            return  # stored meanwhile (an earlier attempt got through)
        error = f"scoring failed after {self.retries + 1} attempt(s): {reason}"
        if self.queue.store_scored(entry_id, rejected_group(item, error, self.consumer)):
            log.error("group %s rejected: %s", item.group.group_id, error)


def _last_line(job: Job) -> str:
    """The exception line of a failed job's traceback (RQ keeps the whole text)."""
    result = job.latest_result()
    text = (result.exc_string if result is not None and result.exc_string else "") or "the job failed"
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else text


def serve(queue: ScoringQueue, scorer: Scorer, name: str, *, job_timeout_s: float, retries: int = 2,
          retry_backoff_s: float = 1.0, groups_per_job: int = 8, abandon_after_s: int = 60,
          monitoring_interval_s: int = 30, maintenance_interval_s: int = 30, redispatch_s: float = 30.0,
          burst: bool = False, outage_s: float = 300.0) -> bool:
    """Run one scoring worker (and its dispatcher) until SIGTERM (RQ's warm shutdown).
    RQ's worker quits when Redis goes away; this one waits for Redis (up to `outage_s`,
    then QueueUnavailable) and starts another RQ worker under a new name (the old one's
    registration may outlive a restart on its AOF)."""
    global _TIER
    _TIER = Tier(queue=queue, scorer=scorer, name=name)
    rq = RQQueue(rq_queue_name(queue.config.run), connection=queue.client, serializer=JSONSerializer)
    dispatcher = Dispatcher(queue, rq, name, job_timeout_s=job_timeout_s, retries=retries,
                            retry_backoff_s=retry_backoff_s, groups_per_job=groups_per_job, redispatch_s=redispatch_s)
    dispatcher.start()
    try:
        for generation in itertools.count():
            worker = ScoringWorker([rq], name=name if generation == 0 else f"{name}-{generation}",
                                   connection=queue.client, serializer=JSONSerializer,
                                   job_monitoring_interval=monitoring_interval_s, maintenance_interval=maintenance_interval_s,
                                   worker_ttl=max(20, maintenance_interval_s + 15))
            worker.abandon_after_s = abandon_after_s
            try:
                done = worker.work(burst=burst, with_scheduler=True, logging_level="WARNING")
                if worker.stop_requested or burst:
                    return done
                log.warning("RQ's worker %s quit without being asked to (Redis unreachable?)", worker.name)
            except redis.exceptions.RedisError as err:
                log.warning("RQ's worker %s quit: %s", worker.name, err)
            except StopRequested:
                return False
            if worker.stop_requested:
                return False
            try:
                _wait_for_redis(queue, outage_s)
            except StopRequested:  # SIGTERM while waiting (RQ's handler, still installed)
                return False
            log.warning("Redis answers again; scoring goes on")
        raise AssertionError("unreachable")
    finally:
        dispatcher.stopping.set()
        dispatcher.join(timeout=5)


def _wait_for_redis(queue: ScoringQueue, outage_s: float) -> None:
    deadline, backoff = time.monotonic() + outage_s, 0.5
    while True:
        try:
            queue.client.ping()
            return
        except redis.exceptions.RedisError as err:
            if time.monotonic() + backoff > deadline:
                raise QueueUnavailable(f"Redis unreachable for {outage_s:.0f}s: {err}") from None
            time.sleep(backoff)
            backoff = min(backoff * 2, 5.0)

