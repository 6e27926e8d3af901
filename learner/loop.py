"""The learner loop: feed prompts, collect scored rollout groups, step, publish,
checkpoint; `Learner.run` is the whole algorithm on one screen. Its parts own their state:
the `Feeder` issues prompts, the `Collector` reads and judges groups, the `EvalSink`
evaluates published versions, the `Trainer` takes the GRPO step, the `Publisher` uploads
adapters and the `StepReport` writes each step's figures. This module ties them: start and
resume, publishing, checkpoints. Exactly-once training: a rollout group is acknowledged in
the queue only after the checkpoint that holds its effect is written (`learner.checkpoint`).
"""

from __future__ import annotations

import collections
import logging
import threading
import time

import torch

from learner.admission import Admission
from learner.audit import open_auditor, record_audits
from learner.batch import StepBatch, build_step_batch
from learner.checkpoint import LearnerState, load_checkpoint, restore_rng, save_checkpoint
from learner.collector import Collector
from learner.config import LearnerConfig
from learner.data import Sources, open_sources
from learner.dist import Dist, peak_memory_mb, resolve_device
from learner.evaluate import EvalSink
from learner.feeder import Feeder
from learner.judge import Bounds, Reason
from learner.lifecycle import LearnerError, StartupRetry, close_run, open_run
from learner.publish import Publisher, PublishJob, finite
from learner.report import StepReport
from learner.token_use import count_step, sequence_tokens
from learner.trainer import Trainer
from protocol import Queue, RolloutGroup
from protocol.trusted.store import Store
from protocol.wire.files import StoreError

log = logging.getLogger(__name__)

CONSUMER = "learner-0"
"""The learner's consumer name in the rollouts group: one learner per run, and a
restarted learner must find its predecessor's pending list under the same name."""

__all__ = ["CONSUMER", "Learner", "LearnerError"]


class Learner:
    def __init__(
        self,
        cfg: LearnerConfig,
        queue: Queue,
        store: Store,
        stop_requested: threading.Event | None = None,
        dist: Dist | None = None,
        sources: Sources | None = None,
    ) -> None:
        """`sources`: the training and held-out prompts, if the caller checked them before
        loading the model (`learner.data.open_sources_for`); else they are opened here."""
        self.cfg, self.queue, self.store = cfg, queue, store
        torch.manual_seed(cfg.seed)
        self.dist = dist or Dist(device=resolve_device(cfg.device))
        self.trainer = Trainer(cfg, self.dist)
        self.policy = self.trainer.policy
        self.source, held_out = sources or open_sources(cfg, self.policy.tokenizer, self.policy.context)
        self._checkpoint_versions: collections.deque[int] = collections.deque(maxlen=cfg.keep_checkpoints)
        """Adapter versions of the checkpoints kept in the store (protected from pruning)."""
        self.publisher = Publisher.for_run(cfg, store, queue, protected=self.pinned_versions)
        self.stop_requested = stop_requested or threading.Event()
        """Set to stop after a checkpoint (SIGTERM, Ctrl-C); the caller may own it."""
        self._retry = StartupRetry(cfg, self.stop_requested)
        self.admission = Admission.for_run(cfg)
        self.evals = EvalSink(cfg, queue, held_out, self.publisher, CONSUMER)
        self.feeder = Feeder(cfg, queue, self.source, self.admission, self.publisher, self.evals, self.trainer.sampling)
        self.auditor = open_auditor(cfg, self.trainer, store)
        bounds = Bounds.for_run(cfg, self.policy.vocab_size, self.policy.context)
        self.collector = Collector(cfg, queue, CONSUMER, bounds, self.feeder, self.evals, self.publisher, self.auditor)
        self.state = LearnerState()
        self.report = StepReport(cfg, self.policy.tokenizer.decode)
        self._checkpointed_step = -1
        self.complete = False
        """Started on a run whose checkpoint is already at `steps`."""

    @property
    def state(self) -> LearnerState:
        """The run's state, checkpointed; the parts share it (a resume replaces it)."""
        return self._state

    @state.setter
    def state(self, state: LearnerState) -> None:
        self._state = self.feeder.state = self.collector.state = self.evals.state = state

    # ------------------------------------------------------------------ the loop
    def run(self) -> LearnerState:
        cfg = self.cfg
        try:
            resume_step = self.start()
            if self.complete:
                return self.state
            self.evals.out = self.feeder.out = self.report.open(resume_step)
            while self.state.step < cfg.steps and not self.stop_requested.is_set():
                waited = time.monotonic()
                groups = self.collector.collect(cfg.groups_per_step, self.stop_requested)  # feeds prompts meanwhile
                if groups is None:
                    break  # asked to stop; the partial collection stays pending in the queue
                wait_s, started = time.monotonic() - waited, time.monotonic()
                batch = build_step_batch(groups, cfg, self.policy.pad_id)
                stats = self.trainer.step(batch)
                if self.auditor is not None:
                    self.auditor.trained()
                trained_with = self.state.policy_version
                self.state.step += 1
                self.state.count("trained_groups", len(groups))
                step_s = time.monotonic() - started
                self.admission.update(
                    [trained_with - g.adapter_version for g in groups],
                    self.collector.step.count(Reason.STALE),
                    wait_s / max(wait_s + step_s, 1e-9),
                )
                publish_s = self.publish() if self.state.step % cfg.sync_every == 0 else 0.0
                times = {"wait_s": wait_s, "step_s": step_s, "publish_s": publish_s}
                self.step_done(groups, batch, trained_with, stats, times)
                if self.state.step % cfg.checkpoint_every == 0:
                    self.checkpoint()
            if self.state.step >= cfg.steps:
                self.evals.final(self.publish, self.feeder.poll_dead_letters, self.stop_requested)
            record_audits(self.queue, self.auditor)
            # groups dropped since the last checkpoint (flat or stale, while collecting for a
            # step that never ran) are consumed too: without a checkpoint they would stay
            # pending in the queue and be counted twice
            if self.state.step != self._checkpointed_step or self.state.unacked:
                self.checkpoint(final=True)
            if self.state.step >= cfg.steps:
                close_run(self.queue, self.publisher, cfg, self.state.step, self.state.policy_version)
        finally:
            self.trainer.stop()  # the other ranks (torchrun) exit with this one
            self.publisher.close()
            self.report.close()
        return self.state

    # ------------------------------------------------------------- start/resume
    def start(self) -> int | None:
        """Restore the latest checkpoint when resuming; returns its step (None: fresh)."""
        ckpt = load_checkpoint(self.store)
        latest = self._retry(self.queue.latest_adapter)
        resumed_at = None
        if ckpt is not None and not self.cfg.resume:
            raise LearnerError(
                f"{self.store.url} already holds a checkpoint of this run at step {ckpt.state.step}: "
                "pass --resume to continue it, or use another --store/--run"
            )
        if ckpt is not None and ckpt.state.step >= self.cfg.steps:
            # a finished run started again (compose's restart, a second `up`): nothing to
            # train, issue, publish or evaluate, and its numbering untouched
            self.state, self.complete = ckpt.state, True
            log.info("the run is complete: its checkpoint is at step %d of --steps %d", ckpt.state.step, self.cfg.steps)
            return ckpt.state.step
        if ckpt is not None:
            self.state = ckpt.state
            self.trainer.restore(ckpt.adapter, ckpt.trainer)
            restore_rng(ckpt)
            resumed_at = self._checkpointed_step = self.state.step
            state = self.state
            log.info(
                "resumed at step %d (cursor %d, version %d)", state.step, state.ledger.cursor, state.policy_version
            )
        elif self.cfg.resume:
            log.warning("--resume: no checkpoint in %s yet, starting the run from step 0", self.store.url)
        open_run(self.queue, self.cfg, self._retry)
        # a version number names one adapter forever: continue above any ever announced, and
        # any the store holds (a Redis failover can lose an announcement; the files outlive it)
        stored = max(self.store.adapter_files(), default=0)
        self.state.policy_version = max(self.state.policy_version, latest.version if latest else 0, stored)
        self.collector.replay_pending(self._retry)
        if ckpt is not None:
            self.feeder.purge_completed()
            self.feeder.reissue_outstanding(self._retry)
            self.publish()  # actors switch to the restored policy under a new number
        else:
            self.evals.start_fresh()
        return resumed_at

    # ------------------------------------------------------- publish/checkpoint
    def publish(self) -> float:
        """Hand the adapter to the publisher as the next version; returns the seconds
        the training thread was blocked (snapshot + hand-over)."""
        started = time.monotonic()
        adapter = finite(self.trainer.adapter(), self.state.step)
        self.state.policy_version += 1
        if self.auditor is not None:
            self.auditor.remember(self.state.policy_version, adapter)
        self.publisher.submit(
            PublishJob(
                version=self.state.policy_version,
                step=self.state.step,
                state=adapter,
                config_json=self.policy.adapter_config_json(),
            )
        )
        self.evals.published(self.state.policy_version)
        return time.monotonic() - started

    def pinned_versions(self) -> set[int]:
        """Versions the store must keep beyond the newest few: evaluations due or running
        (actors load them by number) and the versions of kept checkpoints."""
        return set(self._checkpoint_versions) | self.evals.pinned()

    def checkpoint(self, final: bool = False) -> None:
        """Write a checkpoint, then acknowledge what it holds. A store outage that outlasts
        the retries skips this checkpoint (nothing is acknowledged, so nothing is lost);
        only the final one must succeed."""
        # a completed batch must not be re-issued on resume: its groups would be new to a
        # queue that lost its records, and nothing would be left to recognise them by
        self.feeder.purge_completed()
        adapter, trainer_state = self.trainer.snapshot()
        try:
            save_checkpoint(
                self.store,
                self.state,
                finite(adapter, self.state.step),
                trainer_state,
                keep=self.cfg.keep_checkpoints,
            )
        except StoreError as err:
            if final:
                raise
            self.state.count("checkpoint_failures")
            log.error("checkpoint at step %d failed, training on: %s", self.state.step, err)
            return
        self._checkpointed_step = self.state.step
        self._checkpoint_versions.append(self.state.policy_version)
        self.feeder.checkpointed()
        log.info("checkpoint at step %d", self.state.step)
        self.collector.acknowledge()

    # ----------------------------------------------------------------- report
    def step_done(
        self,
        groups: list[RolloutGroup],
        batch: StepBatch,
        trained_with: int,
        stats: dict[str, float],
        times: dict[str, float],
    ) -> None:
        """The step's verdicts handed to the parts and counted, then the step's row written
        (`stats`: the loss figures; `times`: the wait, step and publish seconds)."""
        step_groups = self.collector.end_step()
        self.feeder.reissue(step_groups)
        count_step(self.state, step_groups, self.cfg.mask_truncated_completions, trained_with)
        self.state.count("num_tokens", sequence_tokens(groups))  # TRL's, run-long
        parts = {**self.feeder.metrics(), **self.collector.metrics(), **self.evals.metrics()}
        parts["dropped_flat_unsolved"] = len(step_groups.flat_unsolved(self.state.outcomes.best))
        tail = {**stats, "num_tokens": self.state.totals["num_tokens"], **times, **parts}
        tail |= {"publish_failures": self.publisher.failures, "memory_peak_mb": peak_memory_mb(self.dist.device)}
        head = {"step": self.state.step, "adapter_version": self.state.policy_version}
        self.report.write(head, groups, step_groups, batch, trained_with, tail)
