"""The scoring tier's dispatcher: a thread beside each RQ worker that turns the unscored
stream into RQ jobs (`learner.scoring.jobs.score_job`) and RQ's failed jobs into rejected
groups. `learner.scoring.tier` describes the tier as a whole."""

from __future__ import annotations

import hashlib
import logging
import threading
import time

import redis
from rq import Queue as RQQueue
from rq import Retry, Worker
from rq.exceptions import NoSuchJobError
from rq.job import Job
from rq.registry import FailedJobRegistry
from rq.serializers import JSONSerializer

from learner.scoring.jobs import Decode, rejected_group, score_job, store_or_dead_letter
from protocol import ProtocolError, QueueUnavailable
from protocol.trusted.scoring import ScoringQueue, UnscoredEntry
from protocol.util.retry import Backoff
from protocol.wire.text import printable

log = logging.getLogger(__name__)


class Dispatcher(threading.Thread):
    """Unscored stream -> RQ jobs; RQ's failed jobs -> rejected groups. See
    `learner.scoring.tier`'s docstring."""

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
