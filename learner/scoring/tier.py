"""The trusted scoring tier: RQ workers that score the groups actors submitted unscored.

`learner score --queue redis://… --run R --reward module:function` on the trusted side
(it needs Redis itself and the data set's private columns; actors never do). Start as
many as you like; each is one RQ worker plus a dispatcher thread.

- **Dispatcher** (a thread): reads the `unscored` stream (consumer group `scorers`) and
  enqueues one RQ job per `--groups-per-job` groups read together (a lease's, or several
  leases' when they wait: the fewer jobs, the fewer forks),
  its id derived from the run and the group ids. An entry is pending from its read
  until its job exists; one read by a dispatcher that died before enqueueing is taken
  over by another after `redispatch_s`. It also empties RQ's failed-job registry: a
  failed job of several groups is split into one job per group (so one bad group does
  not sink its lease), and a failed one-group job becomes a rejected group (reward
  None, the error text), which reaches the learner and is counted, never trained on.
- **The RQ worker** (the main thread; a forked work horse per job) runs `score_job`.
  Each group is scored within its own time limit (`--reward-timeout-s`, on a thread of
  the horse): a group past it is rejected at once, with that reason, and the job goes on
  with the lease's other groups; a time-out is not retried (the same reward on the same
  text would hang again). The horse ends with the job, taking an abandoned reward's
  thread with it. RQ does the rest: `job_timeout` (the groups' limits plus a margin) is
  the backstop that kills a horse that hangs anyway, `Retry` with backoff re-runs a
  reward that raised, and a job whose worker died is found abandoned by RQ's
  maintenance and retried.
- **Scores follow tokens**: the tier decodes each completion's token ids with the run's
  tokenizer (`--model`, the learner's) and scores that text, the text the learner trains
  on; the actor's `text` is replaced by it. Timings come from the trusted side too: the
  actor's are kept for its own figures (`generate_s`), but `submitted_at` is the
  unscored entry's Redis time, not a number the actor wrote.
- **What cannot be stored is dead-lettered**: a scored (or rejected) copy that breaks a
  wire limit goes to the dead letters with its reason, counted by the learner, never
  retried; one bad job never holds up the dispatcher.
- **Idempotent by group id**: a group scored twice (a job re-run after its worker died
  mid-store, a dispatcher that enqueued it again) is stored once (`STORE_SCORED`).

Why several groups per job, not one: RQ's cost per job (a fork, a dozen Redis round
trips) is small beside a 20 ms-per-completion reward on a group of 8, but it is the
whole cost of a cheap reward. The work horse forks from a process that has not imported
torch where the tokenizer allows (`learner.detokenize`): a fork costs with the size of the
process. The unit of idempotency stays the group.

Jobs carry only ids, serialized as JSON (RQ's `JSONSerializer`): no pickle in Redis.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import redis
from rq import Queue as RQQueue
from rq import Retry, Worker
from rq.exceptions import NoSuchJobError, StopRequested
from rq.job import Job
from rq.registry import FailedJobRegistry
from rq.serializers import JSONSerializer

from learner.scoring import replay
from learner.scoring.episodes import EpisodeReader, read_episodes, recounted, single_turns
from learner.scoring.rq_worker import ScoringWorker, adjust_rq
from protocol import Completion, ProtocolError, QueueUnavailable, RolloutGroup
from protocol.trusted.scoring import ScoringQueue, UnscoredEntry, UnscoredGroup
from protocol.usercode.rewards import RewardRefused, Scorer, Scores
from protocol.usercode.transcript import (
    EnvironmentReward,
    Transcript,
    TranscriptError,
    answered_calls,
)
from protocol.util.retry import Backoff, retry
from protocol.wire.text import printable

log = logging.getLogger(__name__)


def rq_queue_name(run: str) -> str:
    return f"spotgrpo:{run}:scoring"


def rq_worker_name(run: str, name: str) -> str:
    """RQ's worker names are global to a Redis: scoped to the run, two runs on one Redis
    can both have a `scorer-1`."""
    return f"spotgrpo:{run}:{name}"


Decode = Callable[[Sequence[int]], str]


@dataclass
class Tier:
    """What a job needs, made once in the worker before it forks its work horses."""

    queue: ScoringQueue
    scorer: Scorer
    name: str
    decode: Decode
    """The run's tokenizer: token ids -> the text rewards see (special tokens skipped, as
    the actors' engines decode)."""
    timeout_s: float
    """Per group."""
    environment: EnvironmentReward | None = None
    """Episodes' environment, when it owns a reward: replayed per completion."""
    episodes: EpisodeReader | None = None
    """Reads episodes' masks against their model turns (`learner.scoring.episodes`)."""
    replay_limits: replay.ReplayLimits = field(default_factory=replay.ReplayLimits)
    """Per call and memory, for the environment's replay (`learner.scoring.replay`)."""


_TIER: Tier | None = None

ERROR_CHARS = 300
"""A completion's error as the tier writes it (the group's error says it whole)."""


def scored_group(
    item: UnscoredGroup,
    scores: Scores,
    texts: list[str],
    scored_by: str,
    score_s: float,
    completions: Sequence[Completion] | None = None,
) -> RolloutGroup:
    """The actor's group with the tier's rewards in place of whatever it sent, and the
    text the tier scored (decoded from the token ids) in place of the actor's;
    `completions`: the group's with the tier's episode counts (`recounted`)."""
    group = item.group
    error = printable(scores.error, 2000) if scores.error is not None else None
    short = printable(scores.error, ERROR_CHARS) if scores.error is not None else None
    completions = [
        msgspec.structs.replace(c, text=t, reward=r, reward_components=comp, error=short)
        for c, t, r, comp in zip(
            completions or group.completions, texts, scores.rewards, scores.components, strict=True
        )
    ]
    submitted = entry_time(item.entry_id)
    timings = {k: v for k, v in group.timings.items() if k not in ("score_s", "scored_at", "submitted_at")}
    timings.update(score_s=score_s, scored_at=time.time(), **({"submitted_at": submitted} if submitted else {}))
    return msgspec.structs.replace(
        group, completions=completions, error=error, scored_by=scored_by, timings=timings, metrics=scores.metrics
    )


def rejected_group(item: UnscoredGroup, error: str, scored_by: str, decode: Decode) -> RolloutGroup:
    """The group with no rewards and the reason; its text decoded from its tokens too (the
    actor's text never reaches the learner from the tier)."""
    n = len(item.group.completions)
    return scored_group(
        item,
        Scores([None] * n, [{} for _ in range(n)], error),
        [decode(c.tokens.tolist()) for c in item.group.completions],
        scored_by,
        0.0,
    )


def entry_time(entry_id: str) -> float | None:
    """The Redis time (seconds) at which a stream entry was added: its id's first part."""
    head = entry_id.split("-", 1)[0]
    return int(head) / 1000 if head.isdigit() else None


def score_job(*entry_ids: str) -> list[dict[str, Any]]:
    """One RQ job: score the groups of these unscored entries (a lease's, as they came in)
    and store each. A reward that raises fails the job (RQ retries it; groups stored by an
    earlier attempt are skipped); any other failure of the reward (past the group's time
    limit, wrong shape, every function abstaining) rejects that group at once: running it
    again would give the same answer."""
    tier = _TIER
    if tier is None:
        raise RuntimeError("score_job runs in an `learner score` worker")
    return score_entries(tier, entry_ids)


def score_entries(tier: Tier, entry_ids: Sequence[str]) -> list[dict[str, Any]]:
    """`score_job`'s work on `tier`: what each entry became. Every group's episodes are
    read first; the environment's replays of all the job's groups then start at once, each
    in its own process (`learner.scoring.replay`, forked before this process starts a thread); each
    group is scored and stored as soon as its replay is in, so a slow one delays only its own."""
    items = tier.queue.fetch_unscored_many(entry_ids)  # two round trips for the job's groups, not three each
    out: dict[str, dict[str, Any]] = {}
    ready: list[_Ready] = []
    for entry_id, item in zip(entry_ids, items, strict=True):
        done = _read_one(tier, entry_id, item)
        if isinstance(done, dict):
            out[entry_id] = done
        else:
            ready.append(done)
    running = [r.running for r in ready if r.running is not None]
    owner = {id(r.running): r for r in ready if r.running is not None}
    try:
        for r in ready:
            if r.running is None:
                out[r.entry_id] = _score_ready(tier, r)
        waiting = list(running)
        while waiting:
            for finished in replay.wait(waiting, timeout_s=1.0):
                waiting.remove(finished)
                r = owner[id(finished)]
                out[r.entry_id] = _score_ready(tier, r)
    finally:
        replay.close(running)
    return [out[e] for e in entry_ids]


@dataclass
class _Ready:
    """A group read and checked, to be scored (its environment's replay running, if any)."""

    entry_id: str
    item: UnscoredGroup
    transcripts: list[Transcript] | None
    started: float
    running: replay.Replay | None = None
    """The environment's replay of its episodes."""


def _read_one(tier: Tier, entry_id: str, item: UnscoredGroup | ProtocolError | None) -> dict[str, Any] | _Ready:
    """What became of an entry that needs no scoring, or the group ready to score."""
    if isinstance(item, ProtocolError):
        reason = printable(f"malformed: {item}", 2000)
        tier.queue.dead_letter_unscored(entry_id, reason)
        return {"entry": entry_id, "stored": False, "dead_lettered": reason}
    if item is None or item.scored:
        return {"entry": entry_id, "stored": False}
    if item.prompt is None:
        return _stored(
            tier,
            entry_id,
            rejected_group(item, "scoring: the private prompt record is missing", tier.name, tier.decode),
        )
    started = time.monotonic()
    completions = item.group.completions
    try:
        transcripts = read_episodes(tier.episodes, completions, item.tools, item.max_tool_calling_iterations)
    except TranscriptError as err:
        log.warning(
            "group %s of worker %s rejected: %s", item.group.group_id, item.group.actor_id, printable(str(err), 300)
        )
        return _stored(tier, entry_id, rejected_group(item, f"episode refused: {err}", tier.name, tier.decode))
    ready = _Ready(entry_id, item, transcripts, started)
    if tier.environment is not None:
        episodes = [answered_calls(t) for t in (transcripts if transcripts is not None else single_turns(completions))]
        ready.running = replay.start(
            tier.environment.environment, item.prompt.columns, episodes, tier.replay_limits, tier.timeout_s
        )
    return ready


def _score_ready(tier: Tier, r: _Ready) -> dict[str, Any]:
    item, completions = r.item, r.item.group.completions
    assert item.prompt is not None
    extra = None
    if r.running is not None:
        outcome = r.running.result

        def extra() -> list[float]:
            if isinstance(outcome, str) or outcome is None:
                raise RewardRefused(outcome or "the environment's replay gave no answer")
            return outcome

    ids = [c.tokens.tolist() for c in completions]
    texts = [tier.decode(i) for i in ids]
    scores = tier.scorer.score_within(tier.timeout_s, item.prompt, "", texts, ids, extra)
    group = scored_group(
        item, scores, texts, tier.name, time.monotonic() - r.started, recounted(completions, r.transcripts)
    )
    return _stored(tier, r.entry_id, group)


def _stored(tier: Tier, entry_id: str, group: RolloutGroup) -> dict[str, Any]:
    stored = store_or_dead_letter(tier.queue, entry_id, group)
    return {"entry": entry_id, "group": group.group_id, "stored": stored, "error": group.error}


def store_or_dead_letter(queue: ScoringQueue, entry_id: str, group: RolloutGroup) -> bool:
    """Store a scored or rejected group; one the wire's limits refuse (an actor's group
    that left no room for the scores) goes to the dead letters with the reason instead:
    trying again would fail the same way. False if nothing new was stored."""
    try:
        return queue.store_scored(entry_id, group)
    except ProtocolError as err:
        reason = printable(f"unstorable after scoring: {err}", 2000)
        log.error("group %s dead-lettered: %s", group.group_id, reason)
        queue.dead_letter_unscored(entry_id, reason)
        return False


class Dispatcher(threading.Thread):
    """Unscored stream -> RQ jobs; RQ's failed jobs -> rejected groups. See the module
    docstring."""

    def __init__(
        self,
        queue: ScoringQueue,
        rq: RQQueue,
        name: str,
        decode: Decode,
        *,
        job_timeout_s: float,
        retries: int,
        retry_backoff_s: float,
        groups_per_job: int = 8,
        redispatch_s: float = 30.0,
        sweep_s: float = 1.0,
    ) -> None:
        super().__init__(name=f"dispatcher-{name}", daemon=True)
        self.queue, self.rq, self.consumer, self.decode = queue, rq, name, decode
        self.job_timeout_s = job_timeout_s
        self.retries, self.retry_backoff_s = retries, retry_backoff_s
        self.groups_per_job = groups_per_job
        self.redispatch_s = redispatch_s
        self.sweep_s = sweep_s
        self.stopping = threading.Event()
        self.workers = 1
        """RQ workers on the run's scoring queue (every scorer's), counted at each sweep."""

    def job_id(self, group_ids: list[str]) -> str:
        """One job id per set of groups of a run (RQ ids are global to the Redis; letters,
        digits and dashes only)."""
        key = "\0".join([self.queue.config.run, *group_ids]).encode()
        return hashlib.blake2b(key, digest_size=16).hexdigest()

    def run(self) -> None:
        backoff, swept = Backoff(0.5, 30.0), 0.0
        held: list[UnscoredEntry] = []
        held_since = 0.0
        while not self.stopping.is_set():
            try:
                if len(held) < self.groups_per_job * HELD_JOBS:
                    if not held:
                        held_since = time.monotonic()
                    held += self.queue.read_unscored(
                        self.consumer, 64, block_s=HOLD_POLL_S if held else min(1.0, self.sweep_s)
                    )
                else:
                    self.stopping.wait(HOLD_POLL_S)
                # while a job waits for every worker, groups gather here and go out in fuller
                # jobs when one frees (fewer jobs: each costs a fork and RQ's round trips);
                # never held long enough to look abandoned (`redispatch_s`)
                if held and (not self.workers_busy() or time.monotonic() - held_since > self.redispatch_s / 3):
                    self.dispatch(held)
                    held = []
                if time.monotonic() - swept >= self.sweep_s:
                    swept = time.monotonic()  # a sweep that fails waits for its turn, not for new groups
                    self.workers = max(1, Worker.count(queue=self.rq))
                    reclaimed = self.queue.reclaim_unscored(self.consumer, self.redispatch_s)
                    if reclaimed:
                        log.warning(
                            "%d unscored group(s) read by a dispatcher that never made them jobs; dispatching them now",
                            len(reclaimed),
                        )
                        self.dispatch(reclaimed)
                    self.reject_failed()
                backoff.reset()
            except (QueueUnavailable, redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as err:
                # the run's queue says so itself; RQ's calls (enqueue, counts) raise redis-py's own
                log.warning("redis unavailable, retrying in %.1fs: %s", backoff.next, err)
                backoff.wait(self.stopping)
            except Exception:  # RQ's other errors included: keep dispatching
                log.exception("dispatcher error; retrying in %.1fs", backoff.next)
                backoff.wait(self.stopping)

    def workers_busy(self) -> bool:
        """A job already waits in RQ's queue for every worker of the run."""
        return int(self.rq.count) >= self.workers

    def dispatch(self, entries: list[UnscoredEntry]) -> None:
        """Jobs of at most `groups_per_job` of the entries, in the order read, then the
        entries are no longer pending. A crash in between leaves them pending: they are
        dispatched again after `redispatch_s` (a second job for the same groups is
        harmless: storing is idempotent)."""
        for i in range(0, len(entries), self.groups_per_job):
            self.enqueue(entries[i : i + self.groups_per_job])
        self.queue.dispatched([e.entry_id for e in entries])

    def enqueue(self, entries: list[UnscoredEntry]) -> None:
        retry = (
            Retry(max=self.retries, interval=[self.retry_backoff_s * 2**i for i in range(self.retries)])
            if self.retries
            else None
        )
        self.rq.enqueue(
            score_job,
            *[e.entry_id for e in entries],
            job_id=self.job_id([e.group_id for e in entries]),
            # each group has its own limit inside the job (`Tier.timeout_s`); RQ's kills a horse that hangs anyway
            job_timeout=max(1, round(self.job_timeout_s * len(entries) + JOB_MARGIN_S)),
            retry=retry,
            result_ttl=300,
            failure_ttl=3600,
            description=f"score {len(entries)} group(s) of batch(es) {' '.join(sorted({e.batch_id for e in entries}))}",
            meta={"groups": [e.group_id for e in entries], "batches": [e.batch_id for e in entries]},
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
            batches = list(job.meta.get("batches") or [])
            if len(entry_ids) > 1 and len(groups) == len(batches) == len(entry_ids):
                for entry_id, group_id, batch_id in zip(entry_ids, groups, batches, strict=True):
                    self.enqueue([UnscoredEntry(entry_id, group_id, str(batch_id))])
            elif entry_ids:
                self.reject(entry_ids[0], _last_line(job))
            # removed whatever became of its group: a failed job is handled once, never again every sweep
            registry.remove(job, delete_job=False)

    def reject(self, entry_id: str, reason: str) -> None:
        try:
            item = self.queue.fetch_unscored(entry_id)
        except ProtocolError as err:
            self.queue.dead_letter_unscored(entry_id, printable(f"malformed: {err}", 2000))
            return
        if item is None:
            return  # stored meanwhile (an earlier attempt got through)
        error = f"scoring failed after {self.retries + 1} attempt(s): {reason}"
        if store_or_dead_letter(self.queue, entry_id, rejected_group(item, error, self.consumer, self.decode)):
            log.error("group %s rejected: %s", item.group.group_id, printable(error))


HOLD_POLL_S = 0.05
"""While groups are held for a busy tier, how often RQ's queue is looked at again."""

HELD_JOBS = 4
"""Groups held at most: this many jobs' worth (the rest wait in the stream)."""

JOB_MARGIN_S = 30.0
"""RQ's time limit for a job is its groups' limits plus this: room for fetching and storing."""


def _last_line(job: Job) -> str:
    """The exception line of a failed job's traceback (RQ keeps the whole text)."""
    result = job.latest_result()
    text = (result.exc_string if result is not None and result.exc_string else "") or "the job failed"
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else text


class NameTaken(ValueError):
    """`--name` is held by a live scoring worker of this run."""


def free_name(queue: ScoringQueue, name: str, chosen: bool) -> str:
    """A name no live RQ worker of this run holds. A name the user chose is kept or
    refused (`NameTaken`); the default one gets a suffix (a container's pid repeats, and a
    SIGKILLed worker's registration outlives it by up to RQ's worker TTL)."""
    for n in itertools.count(1):
        candidate = name if n == 1 else f"{name}-{n}"
        key = Worker.redis_worker_namespace_prefix + rq_worker_name(queue.config.run, candidate)
        if not queue.rq_worker_registered(key):
            return candidate
        if chosen:
            raise NameTaken(
                f"--name {name}: a scoring worker of run {queue.config.run!r} by that name is registered "
                "(a live one, or one killed less than a minute ago); choose another name or leave --name out"
            )
    raise AssertionError("unreachable")


def serve(
    queue: ScoringQueue,
    scorer: Scorer,
    name: str,
    *,
    decode: Decode,
    job_timeout_s: float,
    retries: int = 2,
    retry_backoff_s: float = 1.0,
    groups_per_job: int = 8,
    abandon_after_s: int = 60,
    monitoring_interval_s: int = 30,
    maintenance_interval_s: int = 30,
    redispatch_s: float = 30.0,
    burst: bool = False,
    outage_s: float = 300.0,
    environment: EnvironmentReward | None = None,
    episodes: EpisodeReader | None = None,
    replay_limits: replay.ReplayLimits | None = None,
) -> bool:
    """Run one scoring worker (and its dispatcher) until SIGTERM (RQ's warm shutdown).
    RQ's worker quits when Redis goes away; this one waits for Redis (up to `outage_s`,
    then QueueUnavailable) and starts another RQ worker under a new name (the old one's
    registration may outlive a restart on its AOF)."""
    global _TIER
    adjust_rq()
    _TIER = Tier(
        queue=queue,
        scorer=scorer,
        name=name,
        decode=decode,
        timeout_s=job_timeout_s,
        environment=environment,
        episodes=episodes,
        replay_limits=replay_limits or replay.ReplayLimits(),
    )
    rq = RQQueue(rq_queue_name(queue.config.run), connection=queue.client, serializer=JSONSerializer)
    dispatcher = Dispatcher(
        queue,
        rq,
        name,
        decode,
        job_timeout_s=job_timeout_s,
        retries=retries,
        retry_backoff_s=retry_backoff_s,
        groups_per_job=groups_per_job,
        redispatch_s=redispatch_s,
    )
    dispatcher.start()
    try:
        for generation in itertools.count():
            rq_name = rq_worker_name(queue.config.run, name if generation == 0 else f"{name}-{generation}")
            worker = ScoringWorker(
                [rq],
                name=rq_name,
                connection=queue.client,
                serializer=JSONSerializer,
                job_monitoring_interval=monitoring_interval_s,
                maintenance_interval=maintenance_interval_s,
                worker_ttl=max(20, maintenance_interval_s + 15),
            )
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
    try:
        retry(queue.client.ping, on=(redis.exceptions.RedisError,), deadline_s=outage_s, cap=5.0)
    except redis.exceptions.RedisError as err:
        raise QueueUnavailable(f"Redis unreachable for {outage_s:.0f}s: {err}") from None
