"""The prompt ledger: where every prompt the learner issued is, checkpointed with it.

A training prompt is issued in a batch (`issue`) and then consumed exactly once: its group
read from the queue (trained, or dropped and counted; `consume`), or lost with a dead
letter (its batch dead-lettered, or its group dead-lettered by the scoring tier;
`dead_letter`). `inflight` (issued less consumed) is what `max_inflight` bounds. A batch
whose every prompt is consumed is finished (`purge_completed`): it waits in `finished`
until the queue has been told (`finished_batches`, with a checkpoint's acknowledgement),
which then forgets its deduplication records. A step that never runs gives its prompts
back (`undo`), so the next run consumes them. A prompt whose group taught (a spread of
rewards) may wait in `to_revisit` and go out again (`issue_revisit`; `learner.active`).
A prompt whose group was rejected for its worker's dishonesty (`learner.judge.Reason.reissued`:
a failed audit or digest, a quarantined worker) waits in `to_reissue` and goes out again
alone in a batch (`issue_again`): the data row is issued twice, its first group
dropped and counted, its second trained.

The guarantee (`tests/test_ledger.py`, and the chaos soak's exact count): every issued
prompt is in exactly one of trained, dropped, dead-lettered, or in flight.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from protocol import DeadLetter, FinishedBatch, group_id_for


def prompt_id(position: int) -> str:
    """The id of the prompt at this data set position (`learner.data.PromptSource`)."""
    return f"p{position}"


def position_of(prompt: str) -> int:
    """The data set position of a training prompt's id (`prompt_id`)."""
    return int(prompt.removeprefix("p"))


@dataclass
class Span:
    """Where a batch's prompts are in the data set."""

    start: int
    """The data set position of its first prompt."""
    n: int
    """Its prompts."""
    positions: list[int] | None = None
    """A batch issued again (`PromptLedger.issue_again`): its prompts' positions, in
    order; None: `start` to `start + n`."""

    def all_positions(self) -> list[int]:
        return list(self.positions) if self.positions is not None else list(range(self.start, self.start + self.n))

    def prompt_ids(self) -> list[str]:
        return [prompt_id(p) for p in self.all_positions()]


@dataclass
class Outstanding(Span):
    """A batch issued and not yet consumed to its end."""

    consumed: list[str] = field(default_factory=list)
    """Ids of its prompts consumed so far."""

    @property
    def complete(self) -> bool:
        return len(self.consumed) >= self.n

    def span(self) -> Span:
        return Span(self.start, self.n, self.positions)


@dataclass
class PromptLedger:
    cursor: int = 0
    """Prompts issued so far: the data set position of the next prompt."""
    batches_issued: int = 0
    consumed_prompts: int = 0
    """Prompts whose group was read (trained or dropped) or that a dead letter lost."""
    dead_letter_after: str = "0"
    """The last dead letter accounted for (its entry id)."""
    outstanding: dict[str, Outstanding] = field(default_factory=dict)
    """Batches issued and not fully consumed (at most max_inflight prompts' worth)."""
    finished: dict[str, Span] = field(default_factory=dict)
    """Batches consumed to the end (or dead-lettered), not yet reported to the queue."""
    reissued: int = 0
    """Prompts issued a second time (`issue_again`): `cursor + reissued - skipped` were issued in all."""
    skipped: int = 0
    """Positions the cursor passed over, never issued: their prompts were set aside (`learner.active`)."""
    to_reissue: list[int] = field(default_factory=list)
    """Positions of prompts to issue again (`learner.judge.Reason.reissued`), in the order their groups were dropped."""
    revisited: int = 0
    """Prompts issued again because their group taught (`issue_revisit`)."""
    revisit_batches: int = 0
    to_revisit: list[int] = field(default_factory=list)
    """Positions of the prompts to revisit (`learner.active.revisits`), in the order their groups were read."""

    @property
    def issued(self) -> int:
        return self.cursor + self.reissued + self.revisited - self.skipped

    @property
    def inflight(self) -> int:
        return self.issued - self.consumed_prompts

    def room(self, limit: int) -> int:
        """Prompts that may be issued now without passing `limit` in flight."""
        return limit - self.inflight

    def issue(self, batch_id: str, n: int, positions: list[int] | None = None) -> int:
        """A batch of the next `n` prompts, or of `positions` (ascending, from the cursor
        on: those between them are skipped); returns its first data set position."""
        start = self.cursor if positions is None else positions[0]
        if positions is None or positions == list(range(start, start + n)):
            positions = None
        else:
            assert len(positions) == n and positions == sorted(set(positions)) and start >= self.cursor
        end = start + n if positions is None else positions[-1] + 1
        self.outstanding.setdefault(batch_id, Outstanding(start, n, positions))
        self.skipped += end - self.cursor - n
        self.cursor = end
        self.batches_issued += 1
        return start

    def issue_again(self, batch_id: str) -> int:
        """A batch of the first prompt waiting in `to_reissue` alone; returns its position.
        One prompt a batch, numbered apart from the others (by `reissued`): the batch a
        count names then holds the same prompt however the window opened, so a resumed
        learner that issues it again under that id issues what the queue kept, and the
        others' numbering does not move with it. (Only prompts the last checkpoint held
        waiting go out: `learner.feeder.Feeder.checkpointed`.)"""
        position, self.to_reissue = self.to_reissue[0], self.to_reissue[1:]
        self.outstanding.setdefault(batch_id, Outstanding(position, 1, positions=[position]))
        self.reissued += 1
        return position

    def issue_revisit(self, batch_id: str, n: int) -> list[int]:
        """A batch of the first `n` revisits waiting; returns their positions. Batches are
        whole chunks of `to_revisit`, numbered apart from the others (`revisit_batches`),
        and only of the revisits the last checkpoint held (`learner.feeder.Feeder.checkpointed`):
        a resumed learner reads the groups read since in another order, but starts from the
        same list, and so makes the same batches under the same ids."""
        positions, self.to_revisit = self.to_revisit[:n], self.to_revisit[n:]
        self.outstanding.setdefault(batch_id, Outstanding(positions[0], n, positions=positions))
        self.revisited += n
        self.revisit_batches += 1
        return positions

    def is_consumed(self, batch_id: str, prompt: str) -> bool:
        entry = self.outstanding.get(batch_id)
        return entry is not None and prompt in entry.consumed

    def consume(self, batch_id: str, prompt: str) -> None:
        """A group of this prompt was read. Completed batches leave `outstanding` only at
        `purge_completed`, so an `undo` always finds its entry."""
        self.consumed_prompts += 1
        entry = self.outstanding.get(batch_id)
        if entry is not None:
            entry.consumed.append(prompt)

    def undo(self, batch_id: str, prompt: str) -> None:
        """The group of this prompt is given back (a step that will not run)."""
        self.consumed_prompts -= 1
        entry = self.outstanding.get(batch_id)
        if entry is not None:
            entry.consumed.remove(prompt)

    def dead_letter(self, dl: DeadLetter) -> int:
        """Account for a dead letter of the training stream; returns the prompts it lost.
        A batch's letter that names the groups it lacks consumes their prompts, and the
        batch stays outstanding until its stored groups have come as groups, so that it
        is finished only when every prompt of it is consumed (`Feeder.behind` relies on
        it); one that does not name them finishes the batch. A group's letter (the tier
        could not score or store it) consumes its prompt, so that its batch can finish."""
        if dl.source in ("rollouts", "unscored"):
            if dl.group_id and dl.batch_id:
                self._consume_group(dl.batch_id, dl.group_id)
            lost = 1
        elif dl.batch is not None and dl.missing_groups is not None and dl.batch.batch_id in self.outstanding:
            lost = sum(self._consume_group(dl.batch.batch_id, g) for g in dl.missing_groups)
        else:
            entry = self.outstanding.pop(dl.batch.batch_id, None) if dl.batch else None
            if entry is not None and dl.batch is not None:
                self.finished[dl.batch.batch_id] = entry.span()
            if dl.missing_groups is not None:  # exactly the prompts without a stored group
                lost = len(dl.missing_groups)
            elif entry is not None:
                lost = entry.n - len(entry.consumed)
            else:
                lost = len(dl.batch.prompts) if dl.batch else 0
        self.consumed_prompts += lost
        return lost

    def _consume_group(self, batch_id: str, group_id: str) -> bool:
        """Mark the prompt of `group_id` consumed in its outstanding batch; whether it was not yet."""
        entry = self.outstanding.get(batch_id)
        if entry is None:
            return False
        for prompt in entry.prompt_ids():
            if group_id_for(batch_id, prompt) == group_id and prompt not in entry.consumed:
                entry.consumed.append(prompt)
                return True
        return False

    def purge_completed(self) -> list[str]:
        """Move the batches consumed to their end to `finished`; returns their ids."""
        done = [batch_id for batch_id, entry in self.outstanding.items() if entry.complete]
        for batch_id in done:
            entry = self.outstanding.pop(batch_id)
            self.finished[batch_id] = entry.span()
        return done

    def finish(self, batch_id: str, start: int, n: int) -> None:
        """A batch that ends outside training (an evaluation's)."""
        self.finished[batch_id] = Span(start, n)

    def finished_batches(self) -> list[FinishedBatch]:
        """What the queue may forget, with the acknowledgement of a checkpoint."""
        return [
            FinishedBatch(batch_id, [group_id_for(batch_id, p) for p in s.prompt_ids()])
            for batch_id, s in self.finished.items()
        ]

    def reported(self) -> None:
        """The queue was told of every finished batch."""
        self.finished = {}

    # ------------------------------------------------------------- checkpoints
    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> PromptLedger:
        """From `asdict` (state.json), or from a checkpoint written before the ledger had
        its named types (positional lists)."""

        def outstanding(v: Any) -> Outstanding:
            return Outstanding(**v) if isinstance(v, dict) else Outstanding(int(v[0]), int(v[1]), consumed=list(v[2]))

        def span(v: Any) -> Span:
            return Span(**v) if isinstance(v, dict) else Span(int(v[0]), int(v[1]))

        return cls(
            cursor=int(raw.get("cursor", 0)),
            batches_issued=int(raw.get("batches_issued", 0)),
            consumed_prompts=int(raw.get("consumed_prompts", 0)),
            dead_letter_after=str(raw.get("dead_letter_after", "0")),
            outstanding={k: outstanding(v) for k, v in (raw.get("outstanding") or {}).items()},
            finished={k: span(v) for k, v in (raw.get("finished") or {}).items()},
            reissued=int(raw.get("reissued", 0)),
            skipped=int(raw.get("skipped", 0)),
            to_reissue=[int(p) for p in raw.get("to_reissue") or []],
            revisited=int(raw.get("revisited", 0)),
            revisit_batches=int(raw.get("revisit_batches", 0)),
            to_revisit=[int(p) for p in raw.get("to_revisit") or []],
        )
