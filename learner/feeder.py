"""The learner's feeder: prompts out to the queue, within the admission window.

`Feeder` owns everything that leaves the learner as prompts: issuing whole batches while
the window has room (`feed`), re-issuing a dishonest worker's prompts (`reissue`) and the
batches a restart finds outstanding (`reissue_outstanding`), and freeing the slots of
dead-lettered batches (`poll_dead_letters`). It keeps the prompt tokens of each batch it
has outstanding, which the collector's judge compares a group's tokens with
(`issued_tokens`). Where each prompt is lives in the run's `PromptLedger`, checkpointed
with `LearnerState`; the tokens are not checkpointed, since a resume issues its
outstanding batches again (`reissue_outstanding`) and so holds them again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec

from learner.active import passes_over, revisits
from learner.admission import Admission
from learner.checkpoint import LearnerState
from learner.config import LearnerConfig
from learner.data import PromptSource
from learner.evaluate import EvalSink
from learner.judge import StepGroups
from learner.ledger import PromptLedger, position_of
from learner.metrics import MetricsLog
from learner.publish import Publisher
from protocol import Progress, PromptBatch, Queue, RolloutGroup, SamplingParams
from protocol.wire.text import printable

log = logging.getLogger(__name__)


class Feeder:
    def __init__(
        self,
        cfg: LearnerConfig,
        queue: Queue,
        source: PromptSource,
        admission: Admission,
        publisher: Publisher,
        evals: EvalSink,
        sampling: SamplingParams,
    ) -> None:
        self.cfg, self.queue, self.source = cfg, queue, source
        self.admission, self.publisher, self.evals, self.sampling = admission, publisher, evals, sampling
        self.state = LearnerState()
        self._revisit_prefix = f"{cfg.run}-t"
        """The ids of batches of revisits (`learner.active.revisits`): this, then their number."""
        self._new_prefix = f"{cfg.run}-b"
        """The ids of batches of new prompts: this, then their number (`PromptLedger.batches_issued`)."""
        self._reissue_prefix = f"{cfg.run}-a"
        """The ids of a dishonest worker's prompts issued again: this, then the count before it
        (`PromptLedger.issue_again`)."""
        self._issued_tokens: dict[str, dict[str, bytes | None]] = {}
        """batch id -> prompt id -> token ids issued, for the batches outstanding."""
        if (
            cfg.active_sampling
            and cfg.active_sampling_revisit
            and cfg.lag_versions is None
            and cfg.checkpoint_every >= cfg.steps
        ):
            log.warning(
                "--active-sampling-revisit %g: revisits go out once a checkpoint holds them, and with "
                "--checkpoint-every %d and --steps %d none will; lower --checkpoint-every for them",
                cfg.active_sampling_revisit,
                cfg.checkpoint_every,
                cfg.steps,
            )
        self.out: MetricsLog | None = None
        """Where the batches issued are named (`issued.jsonl`), once the run's report is open."""

    @property
    def state(self) -> LearnerState:
        """The run's state, shared with the other parts (`Learner.state` sets it on resume)."""
        return self._state

    @state.setter
    def state(self, state: LearnerState) -> None:
        self._state = state
        self.checkpointed()

    def checkpointed(self) -> None:
        """The state was written to a checkpoint (or restored from one). What is issued
        until the next one is decided from the state as it was then: new prompts from the
        prompts' flat rates (active sampling), revisits and a dishonest worker's prompts from
        those the checkpoint holds waiting. A batch issued after it and issued again by a
        resumed learner (the same id, which the queue keeps the first of) then holds the same
        prompts, whatever order the groups read since come back in (the groups read before
        a crash are read again first, and those of batches ahead of the resumed learner's
        window wait for it: `Feeder.ahead`). Revisits and re-issues found since wait for the
        next checkpoint."""
        self._flat_rate = dict(self._state.outcomes.flat_rate)
        ledger = self._state.ledger
        self._revisits_ready, self._reissues_ready = len(ledger.to_revisit), len(ledger.to_reissue)

    @property
    def ledger(self) -> PromptLedger:
        return self.state.ledger

    def feed(self, kept: int) -> None:
        """Issue prompt batches until the admission window (`max_inflight` at most) is
        outstanding. `kept`: the groups this step already holds (a forced lag issues only the
        rest)."""
        cfg, ledger = self.cfg, self.ledger
        limit, size = self.admission.limit, cfg.prompts_per_batch
        if cfg.lag_versions is not None:
            # a forced lag: only what this step still needs (in a smaller last batch if need
            # be), so that no batch issued now is trained on after the next publish
            limit = cfg.groups_per_step - kept
            size = min(size, ledger.room(limit))
            if size > 0:
                self.publisher.flush()  # the versions the batches are pinned to must be out first
        while self._reissues_ready > 0 and cfg.lag_versions is None and ledger.room(limit) > 0:
            # the prompts of a dishonest worker's dropped groups, first (`Reason.reissued`)
            again = self._batch(f"{self._reissue_prefix}{ledger.reissued}", ledger.to_reissue[:1])
            self._add([again])
            ledger.issue_again(again.batch_id)
            self._reissues_ready -= 1
        while cfg.lag_versions is None and self._revisits_ready >= size > 0 and ledger.room(limit) >= size:
            # prompts whose groups taught, before new ones (`learner.active.revisits`), in whole batches
            again = self._batch(f"{self._revisit_prefix}{ledger.revisit_batches}", ledger.to_revisit[:size])
            self._add([again])
            ledger.issue_revisit(again.batch_id, size)
            self._revisits_ready -= size
        batches: list[tuple[PromptBatch, list[int]]] = []
        room, cursor = ledger.room(limit), ledger.cursor
        while size > 0 and size <= room - size * len(batches):
            positions = self.next_positions(cursor, size)
            cursor = positions[-1] + 1
            batch_id = f"{self._new_prefix}{ledger.batches_issued + len(batches)}"
            batches.append((self._batch(batch_id, positions), positions))
        if batches:
            self._add([b for b, _ in batches])  # batch ids are deterministic: a re-issue is skipped
            for b, positions in batches:
                ledger.issue(b.batch_id, len(positions), positions)

    def _add(self, batches: list[PromptBatch]) -> None:
        """To the queue, each named in `issued.jsonl` first (`MetricsLog.issued`): a batch
        the queue holds is always in the trail, and one a crash kept from the queue is issued
        again by the resumed learner under its id, with the same prompts."""
        if self.out is not None:
            for b in batches:
                self.out.issued(b.batch_id, [p.id for p in b.prompts], self.state.step)
        self.queue.add_prompts(batches)

    def next_positions(self, cursor: int, n: int) -> list[int]:
        """The next `n` data set positions from `cursor` whose prompts active sampling does
        not pass over (`learner.active`). Where a long stretch is all passed over, the next
        ones regardless: a run never waits for its prompts."""
        cfg, rates = self.cfg, self._flat_rate
        if not cfg.active_sampling or not rates:
            return list(range(cursor, cursor + n))
        picked: list[int] = []
        p, end = cursor, cursor + min(len(self.source), 64 * n)
        while len(picked) < n and p < end:
            if not passes_over(rates.get(self.source.row_key(p), 0.0), p, cfg.seed, cfg.active_sampling_floor):
                picked.append(p)
            p += 1
        return picked + list(range(p, p + n - len(picked)))

    def _batch(self, batch_id: str, positions: list[int]) -> PromptBatch:
        cfg, state = self.cfg, self.state
        progress = Progress(global_step=state.step, max_steps=cfg.steps, epoch=self.source.epochs(positions[0]))
        prompts = [msgspec.structs.replace(self.source.prompt(p), progress=progress) for p in positions]
        # kept while the batch is outstanding: what its groups must answer (`judge`)
        self._issued_tokens[batch_id] = {p.id: p.token_ids for p in prompts}
        return PromptBatch(
            batch_id=batch_id,
            prompts=prompts,
            num_generations=cfg.num_generations,
            sampling=self.sampling,
            learner_version=state.policy_version,
            issued_at=time.time(),
            # a forced lag (benchmarks): generated by the adapter exactly lag_versions behind
            pinned_version=None if cfg.lag_versions is None else max(0, state.policy_version - cfg.lag_versions),
            model=self.publisher.fingerprint,
            scoring=cfg.scoring_mode,  # type: ignore[arg-type]
            **self.source.episodes(),
        )

    def outcome(self, group: RolloutGroup) -> None:
        """A group of a training prompt was judged: flat or with a spread (`learner.active`)."""
        rewards = [float(r or 0.0) for r in group.rewards]  # judged: every one is a number
        cfg, position = self.cfg, position_of(group.prompt_id)
        self.state.outcomes.record(self.source.row_key(position), rewards, hard=cfg.active_sampling_hard)
        if (
            cfg.active_sampling
            and cfg.lag_versions is None  # a forced lag issues no revisits
            and not group.batch_id.startswith(self._revisit_prefix)  # once: a revisit's group is not revisited
            and position not in self.ledger.to_revisit
            and revisits(rewards, group.group_id, cfg.seed, cfg.active_sampling_revisit)
        ):
            self.ledger.to_revisit.append(position)

    def ahead(self, batch_id: str) -> bool:
        """Whether `batch_id` names a training batch this learner has not issued yet: one a
        learner issued after its last checkpoint, before a restart. Its number says so (each
        kind is numbered on its own), and this learner issues it again under that id, with
        the same prompts, once its window reaches it (`feed`); its groups wait till then."""
        numbered = self._numbered(batch_id)
        return numbered is not None and numbered[0] >= numbered[1]

    def behind(self, batch_id: str) -> bool:
        """Whether `batch_id` names a training batch this learner issued and finished: every
        prompt of it consumed (its group read, or lost with a dead letter), so a group of it
        was read before. Only a queue that lost its last writes hands one out again: a Redis
        failover to a replica that had not yet received the acknowledgement, a crash of
        Redis's host under `appendfsync everysec`."""
        numbered = self._numbered(batch_id)
        return numbered is not None and numbered[0] < numbered[1] and batch_id not in self.ledger.outstanding

    def _numbered(self, batch_id: str) -> tuple[int, int] | None:
        """(its number, how many batches of its kind this learner issued) for an id of this
        run's training batches (new, a dishonest worker's prompts again, revisits); else None."""
        ledger = self.ledger
        for prefix, issued in (
            (self._new_prefix, ledger.batches_issued),
            (self._reissue_prefix, ledger.reissued),
            (self._revisit_prefix, ledger.revisit_batches),
        ):
            if batch_id.startswith(prefix) and (number := batch_id[len(prefix) :]).isdigit():
                return int(number), issued
        return None

    def issued_tokens(self, group: RolloutGroup) -> dict[str, bytes | None] | None:
        """prompt id -> the prompt tokens issued, for the group's batch if it is outstanding
        here (None: a batch it does not hold and `ahead` cannot place, an id of an older layout
        issued before a restart, which the queue checked)."""
        if group.batch_id not in self.ledger.outstanding:
            return None
        return self._issued_tokens.get(group.batch_id, {})

    def reissue(self, step: StepGroups) -> None:
        """What a dishonest worker's dropped groups asked goes out again (`Reason.reissued`)."""
        for g, reason in step.dropped:
            if reason.reissued:
                self.ledger.to_reissue.append(position_of(g.prompt_id))
                self.state.count("reissued_prompts")

    def reissue_outstanding(self, retry: Callable[[Callable[[], Any]], Any]) -> None:
        """Batches the checkpoint says are not fully consumed go to the queue again: a
        no-op where the queue kept them (ids are deduplicated), and their recovery where
        it did not (a Redis without persistence, the embedded default's in-process one)."""
        batches = [self._batch(batch_id, entry.all_positions()) for batch_id, entry in self.ledger.outstanding.items()]
        if batches and (added := retry(lambda: self.queue.add_prompts(batches))):
            log.warning("the queue had lost %d of %d outstanding batches; issued them again", added, len(batches))

    def purge_completed(self) -> None:
        """Finished batches leave the ledger's outstanding set, and their tokens go."""
        for batch_id in self.ledger.purge_completed():
            self._issued_tokens.pop(batch_id, None)

    def poll_dead_letters(self) -> None:
        """A dead-lettered batch's prompts will never come back: free their slots."""
        for dl in self.queue.dead_letters(after=self.ledger.dead_letter_after, count=100):
            self.ledger.dead_letter_after = dl.entry_id
            if dl.batch is not None and self.evals.is_eval(dl.batch.batch_id):
                self.evals.lost(dl.batch.batch_id, len(dl.batch.prompts), dl.reason)
                continue
            lost = self.ledger.dead_letter(dl)
            if dl.batch is not None and dl.batch.batch_id not in self.ledger.outstanding:
                self._issued_tokens.pop(dl.batch.batch_id, None)  # else its stored groups are still to come
            self.state.count(f"dead_letter_entries_{dl.source}")
            self.state.count("dead_lettered_prompts", lost)
            log.warning(
                "dead letter from %s (%s): %d prompt(s) will not be trained on", dl.source, printable(dl.reason), lost
            )

    def metrics(self) -> dict[str, float]:
        """The step row's figures of what is out: prompts in flight, the window, the epoch."""
        return {
            "inflight": self.ledger.inflight,
            "inflight_limit": self.admission.limit,
            "epoch": self.source.epochs(self.ledger.cursor),
            **self.state.outcomes.metrics(self.source.distinct),
            "sampling/skipped_prompts": self.ledger.skipped,
            "sampling/revisited_prompts": self.ledger.revisited,
        }
