"""The learner loop: feed prompts, collect scored rollout groups, step, publish,
checkpoint. `Learner.run` is the whole algorithm on one screen. The rest of this module
is what it calls: issuing and re-issuing prompts (`feed`, dead letters), reading and
judging groups (`collect`, `judge`, the wait's explanation), resume, publishing,
checkpoints with their acknowledgements, and the per-step report.

Exactly-once training: a rollout group is acknowledged in the queue only after the
checkpoint that holds its effect is written (see `learner.checkpoint`).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import torch

from learner.admission import Admission
from learner.audit import open_auditor, quarantine_reason, record_audits, sync_quarantine
from learner.batch import StepBatch, build_step_batch
from learner.checkpoint import LearnerState, load_checkpoint, restore_rng, save_checkpoint
from learner.config import LearnerConfig
from learner.data import Sources, open_sources
from learner.dist import Dist, peak_memory_mb, resolve_device
from learner.evaluate import Evaluations, Evaluator
from learner.fleet import FleetWatch
from learner.judge import Bounds, RepeatedWarnings, StepGroups, judge
from learner.ledger import REISSUED, PromptLedger, position_of
from learner.metrics import MetricsLog, RewardNames, clean, console_line, group_figures, samples
from learner.publish import Publisher, PublishJob, nonfinite
from learner.trackers import open_trackers
from learner.trainer import Trainer
from learner.watchdog import ProgressWatch
from protocol import (
    Delivery,
    Progress,
    PromptBatch,
    ProtocolError,
    Queue,
    QueueError,
    QueueUnavailable,
    RolloutGroup,
    SamplingParams,
    fingerprint_of_model,
)
from protocol.trusted.store import Store
from protocol.usercode.rewards import canonical_spec
from protocol.util.retry import Backoff, retry
from protocol.wire.files import StoreError
from protocol.wire.text import printable

log = logging.getLogger(__name__)

CONSUMER = "learner-0"
"""The learner's consumer name in the rollouts group: one learner per run, and a
restarted learner must find its predecessor's pending list under the same name."""


class LearnerError(RuntimeError):
    """The learner cannot start or continue as configured."""


class Learner(Evaluations):
    consumer = CONSUMER

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
        self.cfg = cfg
        self.queue = queue
        self.store = store
        torch.manual_seed(cfg.seed)
        self.dist = dist or Dist(device=resolve_device(cfg.device))
        self.trainer = Trainer(cfg, self.dist)
        self.policy, self.optimizer, self.scheduler = (
            self.trainer.policy,
            self.trainer.optimizer,
            self.trainer.scheduler,
        )
        self.source, held_out = sources or open_sources(cfg, self.policy.tokenizer, self.policy.context)
        self.evaluator = Evaluator(cfg, held_out) if held_out is not None else None
        self._issued_tokens: dict[str, dict[str, bytes | None]] = {}
        """batch id -> prompt id -> token ids issued, for the batches outstanding."""
        self._checkpoint_versions: collections.deque[int] = collections.deque(maxlen=cfg.keep_checkpoints)
        """Adapter versions of the checkpoints kept in the store (protected from pruning)."""
        self.publisher = Publisher(
            store,
            queue,
            base_model=cfg.model,
            rank=cfg.lora_rank,
            keep_adapters=cfg.adapters_kept,
            fingerprint=fingerprint_of_model(cfg.model),
            protected=self.pinned_versions,
            log_every=cfg.log_every,
        )
        self.state = LearnerState()
        self.stop_requested = stop_requested or threading.Event()
        """Set to stop after a checkpoint (SIGTERM, Ctrl-C); the caller may own it."""
        self._replay: list[Delivery] = []
        self._step_groups = StepGroups()
        """The groups judged since the last step: kept for the next, or consumed and dropped."""
        self.bounds = Bounds(
            scoring_mode=cfg.scoring_mode,
            max_abs_reward=cfg.max_abs_reward,
            vocab_size=self.policy.vocab_size,
            context=self.policy.context,
            num_generations=cfg.num_generations,
            max_tokens=cfg.max_tokens,
            max_staleness=cfg.max_staleness,
            episodes=bool(cfg.tools or cfg.environment),
        )
        self.auditor = open_auditor(cfg, self.trainer, store)
        self.on_step: Callable[[dict[str, Any]], None] | None = None
        """Called with each step's metrics row (the embedded default's live display)."""
        self._checkpointed_step = -1
        self.complete = False
        """Started on a run whose checkpoint is already at `steps`."""
        self.metrics: MetricsLog | None = None
        self.fleet = FleetWatch()
        self._fleet_checked_at = 0.0
        self._stale_drops: collections.Counter[str] = collections.Counter()  # since the last fleet check, by actor
        self._reward_names = RewardNames([*cfg.reward, *([cfg.environment] if cfg.environment else [])])
        self._logged_names = RewardNames([])
        self._rejections = RepeatedWarnings(log)
        self.watch = ProgressWatch(cfg.stall_warning_s)
        """Says why, when no step has happened for a while (`learner.watchdog`)."""
        # the floor holds one whole lease too: only whole batches are issued, so a window
        # narrower than prompts_per_batch would never issue one (the config keeps both <= max_inflight)
        self.admission = Admission(
            ceiling=cfg.max_inflight,
            floor=max(cfg.groups_per_step, cfg.prompts_per_batch),
            lease=cfg.prompts_per_batch,
            max_staleness=cfg.max_staleness,
            adaptive=cfg.adaptive_inflight and cfg.lag_versions is None,
        )

    # ------------------------------------------------------------------ the loop
    def run(self) -> LearnerState:
        cfg = self.cfg
        try:
            resume_step = self.start()
            if self.complete:
                return self.state
            trackers = open_trackers(
                cfg.trackers, cfg.resolved_run_dir, cfg.run, cfg.model_dump(mode="json", exclude={"token"}), resume_step
            )
            self.metrics = MetricsLog(cfg.resolved_run_dir, trackers=trackers, resume_step=resume_step)
            while self.state.step < cfg.steps and not self.stop_requested.is_set():
                waited = time.monotonic()
                groups = self.collect(cfg.groups_per_step)  # feeds prompts while it waits
                if groups is None:
                    break  # asked to stop; the partial collection stays pending in the queue
                self.watch.stepped()
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
                    self._step_groups.count("dropped_stale"),
                    wait_s / max(wait_s + step_s, 1e-9),
                )
                publish_s = self.publish() if self.state.step % cfg.sync_every == 0 else 0.0
                self.report(groups, batch, stats, trained_with, wait_s=wait_s, step_s=step_s, publish_s=publish_s)
                if self.state.step % cfg.checkpoint_every == 0:
                    self.checkpoint()
            # groups dropped since the last checkpoint (flat or stale, while collecting for a
            # step that never ran) are consumed too: without a checkpoint they would stay
            # pending in the queue and be counted twice
            if self.state.step >= cfg.steps:
                self.evaluate_last()
            record_audits(self.queue, self.auditor)
            if self.state.step != self._checkpointed_step or self.state.unacked:
                self.checkpoint(final=True)
            if self.state.step >= cfg.steps:
                self.end_run()
                if not cfg.keep_queue:
                    self.expire_queue()
        finally:
            self.trainer.stop()  # the other ranks (torchrun) exit with this one
            self.publisher.close()
            if self.metrics is not None:
                self.metrics.close()
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
            log.info(
                "the run is complete: its checkpoint is at step %d of --steps %d; nothing to do",
                ckpt.state.step,
                self.cfg.steps,
            )
            return ckpt.state.step
        if ckpt is not None:
            self.state = ckpt.state
            self.trainer.restore(ckpt.adapter, ckpt.trainer)
            restore_rng(ckpt)
            resumed_at = self._checkpointed_step = self.state.step
            log.info(
                "resumed at step %d (cursor %d, version %d)",
                self.state.step,
                self.ledger.cursor,
                self.state.policy_version,
            )
        elif self.cfg.resume:
            log.warning("--resume: no checkpoint in %s yet, starting the run from step 0", self.store.url)
        try:  # a run finished before and continued now (more --steps): workers may claim again
            self._retry(lambda: self.queue.set_run_over(""))
            if self.cfg.scoring_mode == "trusted":  # what a scoring worker checks its own rewards against
                specs = [canonical_spec(s) for s in self.cfg.reward_specs]
                self._retry(lambda: self.queue.set_run_rewards(specs))
        except NotImplementedError:
            pass
        # a version number names one adapter forever: continue above any ever announced
        self.state.policy_version = max(self.state.policy_version, latest.version if latest else 0)
        self._replay_pending()
        if ckpt is not None:
            self._purge_completed()
            self._reissue_outstanding()
            self.publish()  # actors switch to the restored policy under a new number
        elif self.evaluator is not None:
            self.evaluator.due.append(0)  # the base model, before any training
        return resumed_at

    def _replay_pending(self) -> None:
        """Groups read before a restart and not acknowledged: those the checkpoint holds
        are acknowledged now; the rest are consumed again, first."""
        pending: list[Delivery] = []
        after = "0"
        while batch := self._retry(lambda after=after: self.queue.pending_rollouts(CONSUMER, 256, after)):
            pending.extend(batch)
            after = batch[-1].delivery_id
        done = [d.delivery_id for d in pending if d.group.group_id in self.state.unacked]
        self._replay = [d for d in pending if d.group.group_id not in self.state.unacked]
        if done or self.ledger.finished:
            self._retry(lambda: self.queue.ack_rollouts(done, self.ledger.finished_batches()))
            acked = set(done)
            self.state.unacked = {g: i for g, i in self.state.unacked.items() if i not in acked}
            self.ledger.reported()
        if pending:
            log.info(
                "pending rollouts after restart: %d already trained, %d to consume again", len(done), len(self._replay)
            )

    # ----------------------------------------------------------------- feeding
    @property
    def ledger(self) -> PromptLedger:
        return self.state.ledger

    def feed(self) -> None:
        """Issue prompt batches until the admission window (`max_inflight` at most) is outstanding."""
        cfg, ledger = self.cfg, self.ledger
        limit, size = self.admission.limit, cfg.prompts_per_batch
        if cfg.lag_versions is not None:
            # a forced lag: only what this step still needs (in a smaller last batch if need
            # be), so that no batch issued now is trained on after the next publish
            limit = cfg.groups_per_step - len(self._step_groups.kept)
            size = min(size, ledger.room(limit))
            if size > 0:
                self.publisher.flush()  # the versions the batches are pinned to must be out first
        if (
            ledger.to_reissue
            and cfg.lag_versions is None
            and (n := min(len(ledger.to_reissue), size, ledger.room(limit))) > 0
        ):
            # the prompts of a dishonest worker's dropped groups, first (`learner.ledger.REISSUED`)
            again = self._batch(f"{cfg.run}-r{ledger.batches_issued}", ledger.to_reissue[:n])
            self.queue.add_prompts([again])
            ledger.issue_again(again.batch_id, n)
        batches: list[PromptBatch] = []
        room = ledger.room(limit)
        while size > 0 and size <= room - size * len(batches):
            start = ledger.cursor + size * len(batches)
            batches.append(
                self._batch(f"{cfg.run}-b{ledger.batches_issued + len(batches)}", list(range(start, start + size)))
            )
        if batches:
            self.queue.add_prompts(batches)  # batch ids are deterministic: a re-issue is skipped
            for b in batches:
                ledger.issue(b.batch_id, len(b.prompts))

    def _batch(self, batch_id: str, positions: list[int]) -> PromptBatch:
        cfg = self.cfg
        progress = Progress(global_step=self.state.step, max_steps=cfg.steps, epoch=self.source.epochs(positions[0]))
        prompts = [msgspec.structs.replace(self.source.prompt(p), progress=progress) for p in positions]
        # kept while the batch is outstanding: what its groups must answer (`judge`)
        self._issued_tokens[batch_id] = {p.id: p.token_ids for p in prompts}
        return PromptBatch(
            batch_id=batch_id,
            prompts=prompts,
            num_generations=cfg.num_generations,
            sampling=self.sampling,
            learner_version=self.state.policy_version,
            issued_at=time.time(),
            # a forced lag (benchmarks): generated by the adapter exactly lag_versions behind
            pinned_version=None if cfg.lag_versions is None else max(0, self.state.policy_version - cfg.lag_versions),
            scoring=cfg.scoring_mode,  # type: ignore[arg-type]
            **self.source.episodes(),
        )

    @property
    def sampling(self) -> SamplingParams:
        """How the run's training groups are sampled (every batch's `sampling`)."""
        return self.trainer.sampling

    def _reissue_outstanding(self) -> None:
        """Batches the checkpoint says are not fully consumed go to the queue again: a
        no-op where the queue kept them (ids are deduplicated), and their recovery where
        it did not (a Redis without persistence, the embedded default's in-process one)."""
        batches = [self._batch(batch_id, entry.all_positions()) for batch_id, entry in self.ledger.outstanding.items()]
        if batches and (added := self._retry(lambda: self.queue.add_prompts(batches))):
            log.warning("the queue had lost %d of %d outstanding batches; issued them again", added, len(batches))

    def poll_dead_letters(self) -> None:
        """A dead-lettered batch's prompts will never come back: free their slots."""
        for dl in self.queue.dead_letters(after=self.ledger.dead_letter_after, count=100):
            self.ledger.dead_letter_after = dl.entry_id
            if dl.batch is not None and self.evaluator is not None and self.evaluator.is_eval(dl.batch.batch_id):
                self.state.count("eval_dead_lettered_prompts", len(dl.batch.prompts))
                log.warning("eval batch %s dead-lettered (%s)", dl.batch.batch_id, dl.reason)
                self._eval_done(self.evaluator.lost(dl.batch.batch_id, len(dl.batch.prompts)))
                continue
            if dl.batch is not None:
                self._issued_tokens.pop(dl.batch.batch_id, None)
            lost = self.ledger.dead_letter(dl)
            self.state.count(f"dead_letter_entries_{dl.source}")
            self.state.count("dead_lettered_prompts", lost)
            log.warning(
                "dead letter from %s (%s): %d prompt(s) will not be trained on", dl.source, printable(dl.reason), lost
            )

    # --------------------------------------------------------------- collecting
    def collect(self, n: int) -> list[RolloutGroup] | None:
        """Block until `n` groups pass the filters; None if a stop was requested."""
        self._purge_completed()
        step, backoff = self._step_groups, Backoff(0.5, 10.0)
        while len(step.kept) < n:
            if self.stop_requested.is_set():
                self._abandon_collection()
                return None
            try:
                self.poll_dead_letters()
                self.check_fleet()
                self.feed()
                self.issue_evals()
                wanted = n - len(step.kept)
                if self._replay:
                    deliveries, self._replay = self._replay[:wanted], self._replay[wanted:]
                else:
                    deliveries = self.queue.read_rollouts(CONSUMER, wanted, block_s=1.0)
                backoff.reset()
            except QueueUnavailable as err:
                log.warning("queue unavailable, retrying in %.1fs: %s", backoff.next, err)
                backoff.wait(self.stop_requested)
                continue
            if self.watch.due():
                self.explain_wait(n)
            for d in deliveries:
                self.state.unacked[d.group.group_id] = d.delivery_id
                if self.evaluator is not None and self.evaluator.is_eval(d.group.batch_id):
                    self._evaluated(d.group)  # never trained on, never counted as a training prompt
                    continue
                if self.ledger.is_consumed(d.group.batch_id, d.group.prompt_id):
                    # only a queue that lost its dedup record (a fresh in-process Redis
                    # after --resume) can hand out a consumed prompt's group again
                    step.add(d.group, "rejected_duplicate")
                    self.state.count("rejected_duplicate")
                    continue
                self.ledger.consume(d.group.batch_id, d.group.prompt_id)
                if d.group.scored_by is not None:
                    self.state.count("scored_groups")
                reason = self.judge(d.group)
                if reason is None:
                    reason = self.audit(d.group)
                elif reason == "rejected_adapter_digest":
                    self.quarantine(
                        d.group.actor_id,
                        f"its group named adapter v{d.group.adapter_version} and carried the digest of other files",
                    )
                step.add(d.group, reason)
                self.state.count(f"read/{reason or 'kept'}")  # every group read, never taken back (summary)
                if reason is not None:
                    self.state.count(reason)
                    if reason == "dropped_stale":
                        self._stale_drops[d.group.actor_id] += 1
        return list(step.kept)

    def explain_wait(self, wanted: int) -> None:
        """No step for a while: one line says why (`learner.watchdog`)."""
        try:
            stats = None if self._step_groups.dropped else self.queue.stats()
        except (QueueError, ProtocolError):
            stats = None
        names = [spec.split(":", 1)[-1].split("=", 1)[0] for spec in self.cfg.reward]
        log.warning("%s", self.watch.explain(self._step_groups, wanted, names, stats))

    def check_fleet(self, every_s: float = 15.0) -> None:
        """Every `every_s`: name the workers that lag or refuse adapters, and the streams
        nobody reads (no worker claims, no scorer scores; `learner.fleet`)."""
        if time.monotonic() - self._fleet_checked_at < every_s:
            return
        self._fleet_checked_at = time.monotonic()
        sync_quarantine(self.queue, self.state.quarantined)
        record_audits(self.queue, self.auditor)
        try:  # the fleet view is advice: training goes on without it
            workers, stats = self.queue.workers(), self.queue.stats()
        except (QueueError, ProtocolError) as err:
            log.debug("no worker statuses: %s", printable(str(err)))
            return
        self.fleet.update(workers, self.publisher.last_published, self.cfg.max_staleness, self._stale_drops)
        self._stale_drops.clear()
        self.fleet.update_streams(stats, self.cfg.run, busy_leases=sum(w.leases for w in workers))

    def _purge_completed(self) -> None:
        for batch_id in self.ledger.purge_completed():
            self._issued_tokens.pop(batch_id, None)

    def _abandon_collection(self) -> None:
        """Groups collected for a step that will not run are not consumed, nor those
        dropped while collecting it (`consumed.jsonl` names them with a step, and this
        step has none): forget them all, so the checkpoint does not claim them and they
        stay pending for the next run, which judges them again."""
        for g in self._step_groups.kept:
            del self.state.unacked[g.group_id]
            self.ledger.undo(g.batch_id, g.prompt_id)
        for g, reason in self._step_groups.dropped:
            self.state.unacked.pop(g.group_id, None)
            if reason != "rejected_duplicate":  # a duplicate was never counted as consumed
                self.ledger.undo(g.batch_id, g.prompt_id)
            self.state.count(reason, -1)
        self._step_groups = StepGroups()

    def judge(self, group: RolloutGroup) -> str | None:
        """`learner.judge.judge` with what this learner knows; a rejection is logged."""
        if group.actor_id in self.state.quarantined:
            return "rejected_quarantined"
        issued = self._issued_tokens.get(group.batch_id, {}) if group.batch_id in self.ledger.outstanding else None
        version, newest = group.adapter_version, self.state.policy_version
        checked = 0 < version <= newest and newest - version <= self.cfg.max_staleness
        digest = self.publisher.digest_of(version) if checked else None
        reason = judge(group, self.bounds, newest, issued, digest)
        if reason is not None and reason.startswith("rejected_"):
            self._rejections.warn(
                reason,
                f"rejected group {group.group_id} from {printable(group.actor_id)}: "
                f"{reason.removeprefix('rejected_')}{f' ({printable(group.error)})' if group.error else ''}",
            )
        return reason

    # ------------------------------------------------------------------ audits
    def audit(self, group: RolloutGroup) -> str | None:
        """Audit `group` if it is picked (`learner.audit`); a failure quarantines its worker.
        Returns `rejected_audit` or None."""
        if self.auditor is None or not self.auditor.picks(group):
            return None
        found = self.auditor.audit(group)
        self.state.count("audited_groups" if found is not None else "audits_skipped")
        check = found.failed(self.auditor.limits) if found is not None else None
        if check is None:
            return None
        assert found is not None
        self.quarantine(group.actor_id, quarantine_reason(check, found, group.adapter_version))
        return "rejected_audit"

    def quarantine(self, worker: str, why: str) -> None:
        """No group of `worker` is trained from now on: those kept for this step are
        dropped (`rejected_quarantined`), later ones rejected."""
        self.state.quarantined[worker] = why
        self.state.count("quarantined_workers")
        log.error("worker %s quarantined: %s; its groups are no longer trained on", printable(worker), why)
        sync_quarantine(self.queue, self.state.quarantined)
        record_audits(self.queue, self.auditor)
        step = self._step_groups
        theirs = [g for g in step.kept if g.actor_id == worker]
        step.kept = [g for g in step.kept if g.actor_id != worker]
        for g in theirs:
            step.add(g, "rejected_quarantined")
            self.state.count("rejected_quarantined")
            self.state.count("read/kept", -1)
            self.state.count("read/rejected_quarantined")

    # ------------------------------------------------------- publish/checkpoint
    def publish(self) -> float:
        """Hand the adapter to the publisher as the next version; returns the seconds
        the training thread was blocked (snapshot + hand-over)."""
        started = time.monotonic()
        adapter = self.finite_adapter()
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
        if self.evaluator is not None and self.state.policy_version % self.cfg.eval_every == 0:
            self.evaluator.due.append(self.state.policy_version)
        return time.monotonic() - started

    def pinned_versions(self) -> set[int]:
        """Versions the store must keep beyond the newest few: evaluations due or running
        (actors load them by number) and the versions of kept checkpoints."""
        pinned = set(self._checkpoint_versions)
        if self.evaluator is not None:
            pinned |= self.evaluator.pinned()
        return pinned

    def finite_adapter(self, adapter: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """A snapshot of the adapter (or `adapter`), or LearnerError if any value is NaN or
        infinite: such an adapter is never published (actors would generate garbage) nor
        checkpointed (the last good checkpoint stays the one to resume from)."""
        adapter = self.trainer.adapter() if adapter is None else adapter
        if bad := nonfinite(adapter):
            raise LearnerError(
                f"step {self.state.step}: the adapter has non-finite values ({bad}); not publishing or "
                "checkpointing it. Resume from the last checkpoint, with a lower --learning-rate or "
                "--max-grad-norm"
            )
        return adapter

    def checkpoint(self, final: bool = False) -> None:
        """Write a checkpoint, then acknowledge what it holds. A store outage that outlasts
        the retries skips this checkpoint (nothing is acknowledged, so nothing is lost);
        only the final one must succeed."""
        # a completed batch must not be re-issued on resume: its groups would be new to a
        # queue that lost its records, and nothing would be left to recognise them by
        self._purge_completed()
        adapter, trainer_state = self.trainer.snapshot()
        try:
            save_checkpoint(
                self.store,
                self.state,
                self.finite_adapter(adapter),
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
        acked = list(self.state.unacked.values())
        try:
            self.queue.ack_rollouts(acked, self.ledger.finished_batches())
        except QueueUnavailable as err:  # they stay in the ledger; the next checkpoint retries
            log.warning("could not acknowledge %d groups yet: %s", len(acked), err)
            return
        self.state.unacked = {}
        self.ledger.reported()
        log.info("checkpoint at step %d", self.state.step)

    def end_run(self) -> None:
        """The run is complete: workers are told (their claims are refused with this line), so
        they stop rather than wait on a queue nobody fills (best effort)."""
        why = (
            f"run {self.cfg.run!r} is over: its learner finished at step {self.state.step} "
            f"(adapter v{self.state.policy_version})"
        )
        try:
            self.queue.set_run_over(why)
        except (QueueError, NotImplementedError) as err:
            log.warning("could not tell the workers that the run is over: %s", err)

    def expire_queue(self) -> None:
        """The run is complete: its Redis keys go after `queue_ttl_s` (best effort)."""
        self.publisher.flush()  # the last announcement first
        try:
            keys = self.queue.expire_run(self.cfg.queue_ttl_s)
        except QueueError as err:
            log.warning("could not set the run's keys to expire (--keep-queue to keep them anyway): %s", err)
            return
        log.info(
            "run complete: its %d queue keys expire in %.0fs (--keep-queue keeps them)", keys, self.cfg.queue_ttl_s
        )

    def _retry(self, fn: Any) -> Any:
        """A queue call at start-up, retried through an outage for `startup_timeout_s` in all
        (the client's own retries included), and given up at once on SIGTERM."""
        limit = self.cfg.startup_timeout_s
        try:
            return retry(
                fn,
                on=(QueueUnavailable,),
                deadline_s=limit,
                first=1.0,
                stop=self.stop_requested,
                before_wait=lambda err, delay: log.warning("queue unavailable, retrying in %.0fs: %s", delay, err),
            )
        except QueueUnavailable as err:
            if self.stop_requested.is_set():
                raise LearnerError(f"stopped while waiting for the queue: {err}") from None
            raise LearnerError(f"the queue was unreachable for {limit:g}s: {err}") from None

    # ----------------------------------------------------------------- metrics
    def report(
        self,
        groups: list[RolloutGroup],
        batch: StepBatch,
        stats: dict[str, float],
        trained_with: int,
        *,
        wait_s: float,
        step_s: float,
        publish_s: float,
    ) -> None:
        step_groups, self._step_groups = self._step_groups, StepGroups()
        # what a dishonest worker's groups asked goes out again (`learner.ledger.REISSUED`)
        for g, reason in step_groups.dropped:
            if reason in REISSUED:
                self.ledger.to_reissue.append(position_of(g.prompt_id))
                self.state.count("reissued_prompts")
        self.state.count(
            "num_tokens",
            sum(g.prompt_tokens.size * len(g.completions) + c.tokens.size for g in groups for c in g.completions),
        )
        row = clean(
            {
                "step": self.state.step,
                "adapter_version": self.state.policy_version,
                **group_figures(
                    groups,
                    step_groups,
                    batch.rewards_N.tolist(),
                    trained_with,
                    self._reward_names,
                    episodes=bool(self.cfg.tools or self.cfg.environment),
                    logged=self._logged_names,
                ),
                **stats,
                "num_tokens": self.state.totals[
                    "num_tokens"
                ],  # TRL's: prompt and completion tokens trained on, run-long
                "wait_s": wait_s,
                "step_s": step_s,
                "publish_s": publish_s,
                "inflight": self.ledger.inflight,
                "inflight_limit": self.admission.limit,
                "epoch": self.source.epochs(self.ledger.cursor),
                "publish_failures": self.publisher.failures,
                "workers_live": self.fleet.live,
                "workers_lagging": self.fleet.lagging,
                "memory_peak_mb": peak_memory_mb(self.dist.device),
                "time": time.time(),
            }
        )
        assert self.metrics is not None
        self.metrics.write(row, [g.group_id for g in groups], step_groups.reasons())
        if self.cfg.samples_every and self.state.step % self.cfg.samples_every == 0:
            self.metrics.samples(
                samples(groups, batch.advantages_N.tolist(), self.policy.tokenizer.decode), self.state.step
            )
        if self.on_step is not None:
            self.on_step(row)
        if self.state.step % self.cfg.log_every == 0:
            log.info(console_line(row, self.cfg.steps))
