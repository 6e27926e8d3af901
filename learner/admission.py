"""How many prompts may be in flight: admission that keeps generation within the
staleness bound.

A prompt issued now is trained on about `in flight / groups_per_step` steps later, and
generated with an adapter that is already some versions old when its actor starts
(the announcement, the load, the leases queued before it in the actor's engine). Where
the learner is the slower side (a real model on shared cores) every prompt in flight
beyond what covers generation only ages: with 6 in flight and 2 a step the groups
arrived 3-4 versions old and were dropped at 5. AReaL bounds what is issued by
`(version + max_staleness + 1) x batch` from the actors' lag; the lag differs per fleet
and changes, so here it is measured, in the staleness of what arrives:

- the window opens at one step's groups and doubles after every step the learner
  waited for rollouts (more than `WAITING` of its time) while what arrived was two or
  more versions inside the bound (a slow start, as TCP's: what is issued before anything
  is measured is what goes stale first);
- a group dropped as stale halves it (down to one step's groups), and ends the doubling;
- a group at the bound takes one lease off it, and ends the doubling;
- so does a step the learner did not wait for at all (`IDLE`) while what it trained was
  two or more versions old: its groups were ready before it wanted them, and only aged
  (the real model, learner the slower side: 33 % of trained tokens within one version of
  the policy with the window held, see docs/benchmarks.md);
- after that, a step the learner waited with room under the bound widens it by a quarter
  (at least a lease). A lease a step would take 984 steps to open the window from 64 to
  the 4,000 prompts 1,000 workers hold (`bench/fleet.py` measured 160 in flight, the
  learner waiting 62 % of its time, at 1,000 workers); a quarter takes 19;
- never above `max_inflight`.

Where the actors are the slower side (the learner waits) nothing arrives near the bound
and the window reaches `max_inflight` within a few steps: no steps per second are given
up after them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from learner.config import LearnerConfig

WAITING = 0.1
"""The share of a step the learner spent waiting for rollouts above which more may be in flight."""
IDLE = 0.02
"""The share at or below which the learner did not wait: what is in flight beyond need only ages."""


@dataclass
class Admission:
    ceiling: int
    """`max_inflight`: the window never opens wider."""
    floor: int
    """One step's groups (or one lease, if that is more) always in flight."""
    lease: int
    """`prompts_per_batch`: the window moves a lease at a time."""
    max_staleness: int
    adaptive: bool = True
    limit: int = field(init=False)
    slow_start: bool = field(init=False)

    def __post_init__(self) -> None:
        self.limit = self.floor if self.adaptive else self.ceiling
        self.slow_start = self.adaptive

    @classmethod
    def for_run(cls, cfg: LearnerConfig) -> Admission:
        """The run's window. Its floor holds one whole lease too: only whole batches are
        issued, so a window narrower than `prompts_per_batch` would never issue one (the
        config keeps both <= `max_inflight`). A fixed lag (`lag_versions`) is not adaptive."""
        return cls(
            ceiling=cfg.max_inflight,
            floor=max(cfg.groups_per_step, cfg.prompts_per_batch),
            lease=cfg.prompts_per_batch,
            max_staleness=cfg.max_staleness,
            adaptive=cfg.adaptive_inflight and cfg.lag_versions is None,
        )

    def update(self, staleness: Sequence[int], dropped_stale: int, waited_frac: float) -> None:
        """After a step: the staleness of the groups trained on, the groups dropped as
        stale while collecting it, and the share of the step spent waiting."""
        if not self.adaptive:
            return
        oldest = max(staleness, default=0)
        if dropped_stale:
            self.limit, self.slow_start = max(self.floor, self.limit // 2), False
        elif oldest >= self.max_staleness or (waited_frac <= IDLE and oldest >= 2):
            self.limit, self.slow_start = max(self.floor, self.limit - self.lease), False
        elif waited_frac > WAITING and oldest <= self.max_staleness - 2:
            wider = self.limit * 2 if self.slow_start else self.limit + max(self.lease, self.limit // 4)
            self.limit = min(self.ceiling, wider)
