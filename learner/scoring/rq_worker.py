"""RQ's worker as the scoring tier runs it, and RQ's adjustments, all in one place.

`serve` (`learner.scoring.tier`) installs them (`adjust_rq`), never an import: RQ's
scheduler process ends in one line when Redis goes away, its worker's log says a lost
Redis in one line, and `ScoringWorker` bounds what RQ leaves unbounded (how soon a dead
worker's job counts as abandoned, the wait for its scheduler and its command channel on a
warm shutdown).
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable
from typing import Any

import redis
from rq import Worker
from rq import scheduler as rq_scheduler
from rq.job import Job

log = logging.getLogger(__name__)


class RedisGoneInOneLine(logging.Filter):
    """RQ logs a traceback when Redis goes away under it (the embedded run's Redis ends
    with the run): one line says the same."""

    def filter(self, record: logging.LogRecord) -> bool:
        err = record.exc_info[1] if record.exc_info else None
        if isinstance(err, redis.exceptions.ConnectionError):
            record.msg, record.args = f"{record.getMessage()} (redis unreachable: {err})", ()
            record.exc_info, record.exc_text = None, None
        return True


def _scheduler_run(scheduler: Any) -> None:
    """RQ's scheduler process (`rq.scheduler.run`), ending in one line when Redis goes away
    (RQ's logs the traceback, and the process's death prints it again)."""
    try:
        scheduler.work()
    except redis.exceptions.ConnectionError as err:
        scheduler.log.warning("RQ's scheduler stopped: redis unreachable: %s", err)
    except Exception:
        scheduler.log.exception("RQ's scheduler [PID %s] raised", os.getpid())
        raise


def adjust_rq() -> None:
    """RQ's two adjustments, made by `serve` (never at import: importing this module changes
    nothing of RQ's for anyone else in the process): its scheduler process ends in one line
    when Redis goes away (RQ starts it with `rq.scheduler.run`), and its worker's log says a
    lost Redis in one line. Idempotent."""
    rq_scheduler.run = _scheduler_run
    worker_log = logging.getLogger("rq.worker")
    if not any(isinstance(f, RedisGoneInOneLine) for f in worker_log.filters):
        worker_log.addFilter(RedisGoneInOneLine())


class ScoringWorker(Worker):
    """RQ's forking worker; only how soon a dead worker's job counts as abandoned is ours
    (RQ's is the monitoring interval plus a fixed 60 s)."""

    abandon_after_s = 60
    RQ_GRACE_S = 60
    """What RQ adds to the monitoring interval (2.x and 3.x alike)."""

    stop_requested = False
    """SIGTERM or SIGINT reached this worker (RQ's loop also ends, and says less, when
    Redis goes away)."""

    before_fork: Callable[[], None] | None = None
    """Called before each work horse is forked (the reward host is started again if a horse
    killed it: `learner.scoring.reward_host`)."""

    def fork_work_horse(self, job: Job, queue: Any) -> None:
        if self.before_fork is not None:
            self.before_fork()
        super().fork_work_horse(job, queue)

    def get_heartbeat_ttl(self, job: Job, *args: Any, **kwargs: Any) -> int:
        ttl = super().get_heartbeat_ttl(job, *args, **kwargs)
        return max(1, int(ttl) - self.RQ_GRACE_S + self.abandon_after_s)

    def request_stop(self, signum: int, frame: Any) -> None:
        self.stop_requested = True
        Worker.request_stop(self, signum, frame)

    PUBSUB_POLL_S = 1.0

    def subscribe(self) -> None:
        """RQ's, with its command channel's thread polling every `PUBSUB_POLL_S`, not 60 s.
        From redis-py 8.2 `PubSubWorkerThread.stop` joins that thread, and RQ's teardown
        unsubscribes first: a thread that has read the unsubscription waits out its poll
        for a subscription that never comes, so a warm shutdown took up to 60 s (the
        embedded run's Ctrl-C killed the scorer after 15)."""
        self.pubsub = self.connection.pubsub()
        self.pubsub.subscribe(**{self.pubsub_channel_name: self.handle_payload})
        self.pubsub_thread = self.pubsub.run_in_thread(  # type: ignore[assignment]  # RQ declares it None
            sleep_time=self.PUBSUB_POLL_S, daemon=True, exception_handler=self._pubsub_exception_handler
        )

    SCHEDULER_STOP_S = 5.0

    def stop_scheduler(self) -> None:
        """RQ's, with a limit: SIGTERM, then SIGKILL after `SCHEDULER_STOP_S`. RQ joins its
        scheduler process without one, and a scheduler forked from this process (which holds
        the tokenizer) was seen to ignore SIGTERM now and then, so a warm shutdown never
        ended (a CI run waited 60 s on it)."""
        process = getattr(self.scheduler, "_process", None) if self.scheduler is not None else None
        if process is None or not process.pid:
            return
        try:
            os.kill(process.pid, signal.SIGTERM)
        except OSError:
            return
        process.join(self.SCHEDULER_STOP_S)
        if process.is_alive():
            log.warning("RQ's scheduler process %d ignored SIGTERM for %gs: killed", process.pid, self.SCHEDULER_STOP_S)
            process.kill()
            process.join(5)
