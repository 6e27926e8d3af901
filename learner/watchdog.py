"""No silent waits: when no step has happened for a while, one line says why, from what
the learner knows.

A GRPO step needs `groups_per_step` groups that teach. A run whose every group is flat
(all completions got the same reward: nothing to learn from) or stale, or whose groups
never come, used to wait without a word. `ProgressWatch` looks at what the learner judged
since its last step and at the queue's depths, and after `first_s` of no step (then at
doubling intervals, up to `max_s`) returns one line naming the likeliest cause:

- groups came and were all dropped: by reason, and for flat groups the rewards they had
  and the reward functions that gave them (TRL prints `reward 0.0` and
  `frac_reward_zero_std 1.0` at such steps; here no step happens, so this line does it);
- no group came: the queue's depths (prompts waiting or leased, groups being scored),
  so that a fleet that does not claim and a tier that does not score can be told apart.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Sequence
from typing import Any

from learner.judge import Reason, StepGroups


class ProgressWatch:
    def __init__(
        self, first_s: float = 60.0, max_s: float = 600.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.first_s, self.max_s, self.clock = first_s, max_s, clock
        self._since = clock()
        self._next = first_s

    def stepped(self) -> None:
        """A step happened: the watch starts again."""
        self._since, self._next = self.clock(), self.first_s

    def due(self) -> bool:
        return self.clock() - self._since >= self._next

    def explain(
        self, step: StepGroups, wanted: int, reward_names: Sequence[str], stats: Any | None, held: int = 0
    ) -> str:
        """The line for a wait that is due (and the next one is due twice as late). `held`:
        groups read that wait for their batch to be issued again after a restart
        (`learner.feeder.Feeder.ahead`)."""
        waited = self.clock() - self._since
        self._next = min(self._next * 2, self.max_s) if self._next < self.max_s else self._next + self.max_s
        head = f"no step for {waited:.0f}s ({len(step.kept)} of {wanted} groups that teach so far"
        if held:
            head += f"; {held} more read, of batches issued before the restart, wait till they are issued again"
        head += ")"
        if step.dropped:
            return f"{head}: {why_dropped(step, reward_names)}"
        return f"{head}: no group has arrived; {queue_picture(stats)}"


def why_dropped(step: StepGroups, reward_names: Sequence[str]) -> str:
    reasons = collections.Counter(reason for _, reason in step.dropped)
    parts = [
        f"{n} {reason.removeprefix('dropped_').removeprefix('rejected_').replace('_', ' ')}"
        for reason, n in reasons.most_common()
    ]
    line = f"the {len(step.dropped)} group(s) read were dropped: {', '.join(parts)}"
    flat = [g for g, reason in step.dropped if reason is Reason.FLAT]
    if flat:
        values = collections.Counter(round(float(g.rewards[0] or 0.0), 4) for g in flat)
        shown = ", ".join(f"{v:g} in {n}" for v, n in values.most_common(4))
        names = ", ".join(reward_names) or "the actors' reward functions"
        line += (
            f". A flat group (every completion the same reward; here {shown} group(s), from {names}) teaches "
            "GRPO nothing: make the task easier or the reward finer (partial credit), or raise num_generations"
        )
    if reasons.get(Reason.STALE):
        line += ". Stale groups come from workers behind the learner: lower max_inflight or raise max_staleness"
    rejected = [reason for reason in reasons if reason.rejected]
    if rejected:
        line += f". Rejections are logged one by one above ({', '.join(sorted(rejected))})"
    return line


def queue_picture(stats: Any | None) -> str:
    if stats is None:
        return "the queue did not answer (see the warnings above)"
    unscored = stats.unscored.length if getattr(stats, "unscored", None) is not None else 0
    parts = [
        f"{stats.prompts.length} prompt batch(es) in the queue, {stats.prompts.pending} of them leased",
        f"{unscored} group(s) waiting to be scored" if unscored else "none waiting to be scored",
        f"{stats.rollouts.length} group(s) stored",
    ]
    if stats.prompts.length and not stats.prompts.pending:
        hint = "no worker has claimed a batch: are actors running for this run (actors run --run ...)?"
    elif unscored:
        hint = "groups wait for the scoring tier: is a `learner score` worker running for this run?"
    elif stats.prompts.pending:
        hint = "workers hold leases and have not submitted yet (generation may be slow; their logs say)"
    else:
        hint = "the learner has issued nothing it is waiting for"
    return f"{'; '.join(parts)}: {hint}"
