"""The trusted scoring tier: RQ workers that score the groups actors submitted unscored.

`learner score --queue redis://… --run R --reward module:function` on the trusted side
(it needs Redis itself and the data set's private columns; actors never do). Start as
many as you like; each is one RQ worker plus a dispatcher thread.

- **Dispatcher** (`learner.scoring.dispatcher`, a thread): reads the `unscored` stream (consumer group `scorers`) and
  enqueues one RQ job per `--groups-per-job` groups read together (a lease's, or several
  leases' when they wait: the fewer jobs, the fewer forks),
  its id derived from the run and the group ids. An entry is pending from its read
  until its job exists; one read by a dispatcher that died before enqueueing is taken
  over by another after `redispatch_s`. It also empties RQ's failed-job registry: a
  failed job of several groups is split into one job per group (so one bad group does
  not sink its lease), and a failed one-group job becomes a rejected group (reward
  None, the error text), which reaches the learner and is counted, never trained on.
- **The RQ worker** (the main thread; a forked work horse per job) runs `score_job`
  (`learner.scoring.jobs`). The reward functions run in the worker's reward host
  (`learner.scoring.reward_host`), a process that outlives the horses, so a reward's
  state lasts across jobs; a horse asks it for each group's values.
  Each group is scored within its own time limit (`--reward-timeout-s`, the horse's wait
  for the host's answer): a group past it is rejected at once, with that reason, and the
  job goes on with the lease's other groups; a time-out is not retried (the same reward
  on the same text would hang again). The reward host busy with it is killed, and
  replaced. RQ does the rest: `job_timeout` (the groups' limits plus a margin) is the
  backstop that kills a horse that hangs anyway, `Retry` with backoff re-runs a reward
  that raised, and a job whose worker died is found abandoned by RQ's maintenance and
  retried.
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

import itertools
import logging

import redis
from rq import Queue as RQQueue
from rq import Worker
from rq.exceptions import StopRequested
from rq.serializers import JSONSerializer

from learner.scoring import jobs, replay
from learner.scoring.dispatcher import Dispatcher
from learner.scoring.episodes import EpisodeReader
from learner.scoring.jobs import Decode, Tier
from learner.scoring.reward_host import HostedScorer
from learner.scoring.rq_worker import ScoringWorker, adjust_rq
from protocol import QueueUnavailable
from protocol.trusted.scoring import ScoringQueue
from protocol.usercode.rewards import Scorer
from protocol.usercode.transcript import EnvironmentReward
from protocol.util.retry import retry

log = logging.getLogger(__name__)


def rq_queue_name(run: str) -> str:
    return f"spotgrpo:{run}:scoring"


def rq_worker_name(run: str, name: str) -> str:
    """RQ's worker names are global to a Redis: scoped to the run, two runs on one Redis
    can both have a `scorer-1`."""
    return f"spotgrpo:{run}:{name}"


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
    reward_batch: bool = False,
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
    adjust_rq()
    host = scorer.host if isinstance(scorer, HostedScorer) else None
    if host is not None:
        host.start()  # before the dispatcher's thread: one process, started once
    jobs.install(
        Tier(
            queue=queue,
            scorer=scorer,
            name=name,
            decode=decode,
            timeout_s=job_timeout_s,
            environment=environment,
            episodes=episodes,
            replay_limits=replay_limits or replay.ReplayLimits(),
            batch=reward_batch,
        )
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
            worker.before_fork = host.ensure if host is not None else None
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
        if host is not None:
            host.close()


def _wait_for_redis(queue: ScoringQueue, outage_s: float) -> None:
    try:
        retry(queue.client.ping, on=(redis.exceptions.RedisError,), deadline_s=outage_s, cap=5.0)
    except redis.exceptions.RedisError as err:
        raise QueueUnavailable(f"Redis unreachable for {outage_s:.0f}s: {err}") from None
