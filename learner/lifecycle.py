"""What the learner tells the run's queue when it starts and when the run is complete.

At start (retried through an outage, given up at once on a stop): the run's over mark
is taken back (a finished run continued with more `--steps`: workers may claim again),
and, with trusted scoring, the rewards a scoring worker must match are published. When
the run is complete: workers are told (their claims are refused with the learner's
line), and the run's keys are set to expire unless `--keep-queue`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from learner.config import LearnerConfig
from protocol import Queue, QueueError, QueueUnavailable, RunShare
from protocol.usercode.rewards import ENVIRONMENT, canonical_spec
from protocol.util.retry import retry

if TYPE_CHECKING:  # publish raises LearnerError
    from learner.publish import Publisher

log = logging.getLogger(__name__)

T = TypeVar("T")


def _owns_reward(spec: str) -> bool:
    """Whether `--environment` scores its episodes; False where this machine cannot import
    it (a learner need not: its actors and scorers run it), so nothing is said of it."""
    from protocol.usercode.chat import load_environment, owns_reward

    try:
        return owns_reward(load_environment(spec))
    except ValueError as err:  # ToolError
        log.info("the environment is not checked against the scorers' (%s)", err)
        return False


class LearnerError(RuntimeError):
    """The learner cannot start or continue as configured."""


class StartupRetry:
    """A queue call at start-up, retried through an outage for `startup_timeout_s` in all
    (the client's own retries included), and given up at once when `stop` is set."""

    def __init__(self, cfg: LearnerConfig, stop: threading.Event) -> None:
        self.limit, self.stop = cfg.startup_timeout_s, stop

    def __call__(self, fn: Callable[[], T]) -> T:
        try:
            return retry(
                fn,
                on=(QueueUnavailable,),
                deadline_s=self.limit,
                first=1.0,
                stop=self.stop,
                before_wait=lambda err, delay: log.warning("queue unavailable, retrying in %.0fs: %s", delay, err),
            )
        except QueueUnavailable as err:
            if self.stop.is_set():
                raise LearnerError(f"stopped while waiting for the queue: {err}") from None
            raise LearnerError(f"the queue was unreachable for {self.limit:g}s: {err}") from None


def open_run(queue: Queue, cfg: LearnerConfig, retried: Callable[[Callable[[], Any]], Any]) -> None:
    """The run is (again) in progress: its over mark is taken back, the rewards a scoring
    worker checks its own against are published (trusted scoring): the functions with
    their weights, and the environment when it owns a reward (`ENVIRONMENT`); and its
    share of a shared fleet, where `fleet_weight` or `fleet_cap` says one."""
    try:
        retried(lambda: queue.set_run_over(""))
        if cfg.scoring_mode == "trusted":
            specs = [canonical_spec(s) for s in cfg.reward_specs]
            if cfg.environment and _owns_reward(cfg.environment):
                specs.append(ENVIRONMENT + cfg.environment)
            retried(lambda: queue.set_run_rewards(specs))
        if cfg.fleet_weight is not None or cfg.fleet_cap is not None:
            share = RunShare(weight=cfg.fleet_weight or 1.0, cap=cfg.fleet_cap)
            retried(lambda: queue.set_run_share(share))
    except NotImplementedError:  # a queue with no run records (tests' fakes)
        pass


def close_run(queue: Queue, publisher: Publisher, cfg: LearnerConfig, step: int, version: int) -> None:
    """The run is complete at `step` (adapter `version`): workers are told, so they stop
    rather than wait on a queue nobody fills, and its keys expire after `queue_ttl_s`
    unless `keep_queue` (both best effort)."""
    why = f"run {cfg.run!r} is over: its learner finished at step {step} (adapter v{version})"
    try:
        queue.set_run_over(why)
    except (QueueError, NotImplementedError) as err:
        log.warning("could not tell the workers that the run is over: %s", err)
    if cfg.keep_queue:
        return
    publisher.flush()  # the last announcement first
    try:
        keys = queue.expire_run(cfg.queue_ttl_s)
    except QueueError as err:
        log.warning("could not set the run's keys to expire (--keep-queue to keep them anyway): %s", err)
        return
    log.info("run complete: its %d queue keys expire in %.0fs (--keep-queue keeps them)", keys, cfg.queue_ttl_s)
