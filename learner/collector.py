"""The learner's collector: scored groups in from the queue, judged, until a step is full.

`Collector` owns everything that comes back: reading the rollouts stream (groups pending
from before a restart first, `replay_pending`), routing each delivery (`take`: an eval
group to the `EvalSink`, a consumed prompt's group again as a duplicate, the rest to the
judge), judging (`learner.judge` with what the learner knows, then the audit), the
quarantine of a worker caught, the fleet check with each worker's stale drops, and the
explanation of a long wait. One step's verdicts are in `step` (`learner.judge.StepGroups`);
`end_step` hands them to the report and starts the next.

Exactly-once: every delivery taken is recorded in `LearnerState.unacked` and consumed in
the ledger; a collection abandoned on a stop is undone (`abandon`), so its groups stay
pending in the queue for the next run to judge again.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from learner.audit import Auditor, named_versions, quarantine_reason, record_audits, sync_quarantine
from learner.checkpoint import LearnerState
from learner.config import LearnerConfig
from learner.evaluate import EvalSink
from learner.feeder import Feeder
from learner.fleet import FleetWatch
from learner.judge import Bounds, Reason, RepeatedWarnings, StepGroups, judge
from learner.publish import Publisher
from learner.watchdog import ProgressWatch
from protocol import Delivery, ProtocolError, Queue, QueueError, QueueUnavailable, RolloutGroup
from protocol.usercode.rewards import reward_name
from protocol.util.retry import Backoff
from protocol.wire.text import printable

log = logging.getLogger(__name__)


class Collector:
    def __init__(
        self,
        cfg: LearnerConfig,
        queue: Queue,
        consumer: str,
        bounds: Bounds,
        feeder: Feeder,
        evals: EvalSink,
        publisher: Publisher,
        auditor: Auditor | None,
    ) -> None:
        self.cfg, self.queue, self.consumer, self.bounds = cfg, queue, consumer, bounds
        self.feeder, self.evals, self.publisher, self.auditor = feeder, evals, publisher, auditor
        self.state = LearnerState()
        """The run's state, shared with the other parts (`Learner.state` sets it on resume)."""
        self.step = StepGroups()
        """The groups judged since the last step: kept for the next, or consumed and dropped."""
        self._replay: list[Delivery] = []
        self._ahead: list[Delivery] = []
        """Groups of batches this learner has not issued yet (`Feeder.ahead`), read before it did."""
        self.fleet = FleetWatch()
        self._fleet_checked_at = 0.0
        self._lost_writes = False
        """The last fleet check found groups pending that this learner does not hold (`recover`)."""
        self._stale_drops: collections.Counter[str] = collections.Counter()  # since the last fleet check, by actor
        self._rejections = RepeatedWarnings(log)
        self.watch = ProgressWatch(cfg.stall_warning_s)
        """Says why, when no step has happened for a while (`learner.watchdog`)."""

    def _pending(self, retry: Callable[[Callable[[], Any]], Any]) -> list[Delivery]:
        """Every group read by this learner and not acknowledged, oldest first."""
        pending = list[Delivery]()
        while batch := retry(
            partial(self.queue.pending_rollouts, self.consumer, 256, pending[-1].delivery_id if pending else "0")
        ):
            pending.extend(batch)
        return pending

    def replay_pending(self, retry: Callable[[Callable[[], Any]], Any]) -> None:
        """Groups read before a restart and not acknowledged: those the checkpoint holds
        are acknowledged now; the rest are consumed again, first."""
        ledger, pending = self.state.ledger, self._pending(retry)
        done = [d.delivery_id for d in pending if d.group.group_id in self.state.unacked]
        self._replay = [d for d in pending if d.group.group_id not in self.state.unacked]
        if done or ledger.finished:
            retry(lambda: self.queue.ack_rollouts(done, ledger.finished_batches()))
            acked = set(done)
            self.state.unacked = {g: i for g, i in self.state.unacked.items() if i not in acked}
            ledger.reported()
        if pending:
            log.info(
                "pending rollouts after restart: %d already trained, %d to consume again", len(done), len(self._replay)
            )

    def recover(self) -> None:
        """After an outage of the queue: the batches still out are issued again where it
        lost them, and the groups pending for this learner that it has not taken since its
        last checkpoint are read again (`take`): a Redis that lost its last writes (a
        failover) has them pending again with their acknowledgements lost, and a group of a
        finished batch is then a duplicate, acknowledged at the next checkpoint."""
        self.feeder.reissue_outstanding(_call)
        held = self._held()
        self._replay += [d for d in self._pending(_call) if d.delivery_id not in held]

    def _held(self) -> set[str]:
        """The deliveries this learner holds unacknowledged: taken since its last checkpoint,
        waiting for their batch (`_ahead`) or to be taken (`_replay`)."""
        return {*self.state.unacked.values(), *(d.delivery_id for d in self._ahead + self._replay)}

    def acknowledge(self) -> None:
        """After a checkpoint: the groups it holds are acknowledged in the queue, with the
        batches finished since the last one. On an outage they stay in the state, and the
        next checkpoint tries again."""
        acked = list(self.state.unacked.values())
        try:
            self.queue.ack_rollouts(acked, self.state.ledger.finished_batches())
        except QueueUnavailable as err:
            log.warning("could not acknowledge %d groups yet: %s", len(acked), err)
            return
        self.state.unacked = {}
        self.state.ledger.reported()

    def collect(self, n: int, stop: threading.Event) -> list[RolloutGroup] | None:
        """Block until `n` groups pass the filters, feeding prompts while it waits; None if
        `stop` was set (the collection is abandoned)."""
        self.feeder.purge_completed()
        backoff, outage = Backoff(0.5, 10.0), False
        while len(self.step.kept) < n:
            if stop.is_set():
                self.abandon()
                return None
            try:
                if outage or self._lost_writes:
                    self.recover()
                    outage = self._lost_writes = False
                self.feeder.poll_dead_letters()
                self.check_fleet()
                self.feeder.feed(len(self.step.kept))
                self.evals.issue()
                self.take_issued(n)
                wanted = n - len(self.step.kept)
                if wanted <= 0:
                    continue
                if self._replay:
                    deliveries, self._replay = self._replay[:wanted], self._replay[wanted:]
                else:
                    deliveries = self.queue.read_rollouts(self.consumer, wanted, block_s=1.0)
                    outage = self.queue.retried
                backoff.reset()
            except QueueUnavailable as err:
                log.warning("queue unavailable, retrying in %.1fs: %s", backoff.next, err)
                outage = True
                backoff.wait(stop)
                continue
            if self.watch.due():
                self.explain_wait(n)
                outage = True  # an outage this learner did not see may have lost batches too
            for d in deliveries:
                self.take(d)
        self.watch.stepped()
        return list(self.step.kept)

    def take(self, d: Delivery) -> None:
        """Route one delivery: an eval group to the sink; a training group consumed once,
        judged, audited if picked, and counted by its verdict; a group of a batch this
        learner has not issued yet waits for it (`take_issued`)."""
        group, state, ledger = d.group, self.state, self.state.ledger
        if self.feeder.ahead(group.batch_id):
            # a batch issued past the checkpoint before a restart: consumed now, it would be
            # neither checked against the prompts issued nor counted in its batch's entry
            self._ahead.append(d)
            return
        if (first := state.unacked.get(group.group_id)) is not None:
            # taken since the last checkpoint and handed out again (a client's recovery of a
            # lost answer, or a queue that lost its dedup records, under another delivery id):
            # its first delivery's record stays, and another delivery is acknowledged with it
            if first != d.delivery_id:
                state.unacked[f"{group.group_id}@{d.delivery_id}"] = d.delivery_id
            self.step.add(group, Reason.DUPLICATE)
            state.count(Reason.DUPLICATE)
            return
        state.unacked[group.group_id] = d.delivery_id
        if self.evals.is_eval(group.batch_id):
            self.evals.take(group)  # never trained on, never counted as a training prompt
            return
        if ledger.is_consumed(group.batch_id, group.prompt_id) or self.feeder.behind(group.batch_id):
            # only a queue that lost its records can hand out a consumed prompt's group again:
            # its dedup record (a fresh in-process Redis after --resume), or its last writes,
            # the acknowledgement among them (a failover to a replica behind the primary)
            self.step.add(group, Reason.DUPLICATE)
            state.count(Reason.DUPLICATE)
            return
        ledger.consume(group.batch_id, group.prompt_id)
        if group.scored_by is not None:
            state.count("scored_groups")
        reason = self.judge(group)
        if reason is None:
            reason = self.audit(group)
        elif reason is Reason.ADAPTER_DIGEST:
            self.quarantine(
                group.actor_id,
                f"its group named adapter {named_versions(group)} and carried the digest of other files",
            )
        self.step.add(group, reason)
        if reason in (None, Reason.FLAT, Reason.STALE):  # a rejected group says nothing of its prompt
            self.feeder.outcome(group)
        state.count(f"read/{reason or 'kept'}")  # every group read, never taken back (summary)
        if reason is not None:
            state.count(reason)
            if reason is Reason.STALE:
                self._stale_drops[group.actor_id] += 1

    def take_issued(self, n: int) -> None:
        """The groups that came before their batch was issued here, once it is (`feed`),
        while the step holds fewer than `n`: the rest wait for the next."""
        if not self._ahead:  # after a restart only: every pass of the read loop asks
            return
        waiting, self._ahead = self._ahead, []
        for d in waiting:
            if len(self.step.kept) >= n:
                self._ahead.append(d)
            else:
                self.take(d)  # back in the list if its batch is still ahead

    def judge(self, group: RolloutGroup) -> Reason | None:
        """`learner.judge.judge` with what this learner knows; a rejection is logged."""
        if group.actor_id in self.state.quarantined:
            return Reason.QUARANTINED
        newest = self.state.policy_version

        def digest_of(version: int) -> str | None:  # versions the learner can still vouch for
            checked = 0 < version <= newest and newest - version <= self.cfg.max_staleness
            return self.publisher.digest_of(version) if checked else None

        reason = judge(group, self.bounds, newest, self.feeder.issued_tokens(group), digest_of)
        if reason is not None and reason.rejected:
            self._rejections.warn(
                reason,
                f"rejected group {group.group_id} from {printable(group.actor_id)}: "
                f"{reason.removeprefix('rejected_')}{f' ({printable(group.error)})' if group.error else ''}",
            )
        return reason

    def audit(self, group: RolloutGroup) -> Reason | None:
        """Audit `group` if it is picked (`learner.audit`); a failure quarantines its worker."""
        if self.auditor is None or not self.auditor.picks(group):
            return None
        found = self.auditor.audit(group)
        self.state.count("audited_groups" if found is not None else "audits_skipped")
        check = found.failed(self.auditor.limits) if found is not None else None
        if check is None:
            return None
        assert found is not None
        self.quarantine(group.actor_id, quarantine_reason(check, found, group))
        return Reason.AUDIT

    def quarantine(self, worker: str, why: str) -> None:
        """No group of `worker` is trained from now on: those kept for this step are
        dropped (`rejected_quarantined`), later ones rejected."""
        self.state.quarantined[worker] = why
        self.state.count("quarantined_workers")
        log.error("worker %s quarantined: %s; its groups are no longer trained on", printable(worker), why)
        sync_quarantine(self.queue, self.state.quarantined)
        record_audits(self.queue, self.auditor)
        step = self.step
        theirs = [g for g in step.kept if g.actor_id == worker]
        step.kept = [g for g in step.kept if g.actor_id != worker]
        for g in theirs:
            step.add(g, Reason.QUARANTINED)
            self.state.count(Reason.QUARANTINED)
            self.state.count("read/kept", -1)
            self.state.count(f"read/{Reason.QUARANTINED}")

    def abandon(self) -> None:
        """Groups collected for a step that will not run are not consumed, nor those
        dropped while collecting it (`consumed.jsonl` names them with a step, and this
        step has none): forget them all, so the checkpoint does not claim them and they
        stay pending for the next run, which judges them again."""
        state = self.state
        for g in self.step.kept:
            del state.unacked[g.group_id]
            state.ledger.undo(g.batch_id, g.prompt_id)
        for g, reason in self.step.dropped:
            if reason is not Reason.DUPLICATE:  # a duplicate was never counted as consumed, and
                state.unacked.pop(g.group_id, None)  # the record is its first delivery's
                state.ledger.undo(g.batch_id, g.prompt_id)
            state.count(reason, -1)
        self.step = StepGroups()

    def end_step(self) -> StepGroups:
        """The step ran: its verdicts, for the report; the next step starts empty."""
        step, self.step = self.step, StepGroups()
        return step

    def explain_wait(self, wanted: int) -> None:
        """No step for a while: one line says why (`learner.watchdog`)."""
        try:
            stats = None if self.step.dropped else self.queue.stats()
        except (QueueError, ProtocolError):
            stats = None
        names = [reward_name(spec) for spec in self.cfg.reward]
        log.warning("%s", self.watch.explain(self.step, wanted, names, stats, held=len(self._ahead)))

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
        held = len(self._held())
        if stats.rollouts.pending > held and not self._lost_writes:
            # pending for this learner and not held by it: acknowledgements a Redis lost with
            # its last writes (a failover this learner's calls did not meet)
            log.warning(
                "the queue holds %d groups pending for this learner, which holds %d: reading them again",
                stats.rollouts.pending,
                held,
            )
            self._lost_writes = True

    def metrics(self) -> dict[str, float | None]:
        """The step row's figures of the fleet, as the last check saw it."""
        return {"workers_live": self.fleet.live, "workers_lagging": self.fleet.lagging, "fleet_share": self.fleet.share}


def _call(call: Callable[[], Any]) -> Any:
    """A queue call made once: an outage raises (the read loop's backoff retries it)."""
    return call()
