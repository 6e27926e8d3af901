"""Where the tokens the fleet generated went: trained on, or not and why.

Every completion token a worker's model generated (an episode's environment tokens are
not: `Completion.mask`) of every group the learner consumed lands in one place:

- `trained`: in the loss of a step;
- `truncated`: a trained group's completion that hit `max_tokens`, left out of the loss
  by `mask_truncated_completions` (DAPO's overlong filtering);
- `flat`, `stale`: a good group with no usable signal (`learner.judge.Reason.dropped`);
  of `flat`, `flat_unsolved` counts the groups whose completions all fell below the best
  reward the run has read (too hard so far: the cold start of an untrained model), the
  rest were mastered (every completion at it);
- `rejected`: a group that broke a rule, a duplicate or a quarantined worker's included;
- `evaluated`: held-out evaluations, generated to be measured, never trained.

Of the trained tokens, those sampled within one version of the policy they trained
(`staleness/tokens_within_one`: an in-flight update moves a long generation onto each new
adapter, so most of its tokens are) give `trained_within_one_version`.

The counts are run-long totals in the checkpointed state (`tokens/<where>`), counted when a
step's verdicts are final (`count_step`), so a collection a stop abandons counts nothing:
its groups stay pending and are judged again by the next run. `summary.json` and the
`done:` line give the trained share.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from learner.judge import StepGroups
from protocol import Completion, RolloutGroup

WHERE = ("trained", "truncated", "flat", "stale", "rejected", "evaluated")
PREFIX = "tokens/"
WITHIN_ONE = "staleness/tokens_within_one"
UNSOLVED = "flat_unsolved_groups"
"""The run-long count of flat groups below the best reward (`summary.json` `accounting.flat_unsolved`)."""


def model_tokens(c: Completion) -> int:
    """The tokens of `c` its model generated."""
    return len(c.token_ids) // 4 if c.mask is None else int(np.count_nonzero(np.frombuffer(c.mask, np.uint8)))


def group_tokens(group: RolloutGroup) -> int:
    return sum(model_tokens(c) for c in group.completions)


def sequence_tokens(groups: list[RolloutGroup]) -> int:
    """TRL's `num_tokens`: the prompt and completion tokens of every sequence trained on."""
    return sum(g.prompt_tokens.size + c.tokens.size for g in groups for c in g.completions)


def token_staleness(g: RolloutGroup, c: Completion, trained_with: int) -> np.ndarray:
    """Versions behind the policy `trained_with` of each of `c`'s model tokens."""
    behind = trained_with - c.token_versions(g.adapter_version)
    return behind if c.mask is None else behind[np.frombuffer(c.mask, np.uint8) == 1]


def count_step(state: Any, step: StepGroups, mask_truncated: bool, trained_with: int) -> None:
    """Count one step's groups, trained and dropped, into `state.totals` (`trained_with`:
    the policy version the step trained; flat groups below `state.outcomes.best` as unsolved)."""
    for g in step.kept:
        for c in g.completions:
            masked = mask_truncated and c.finish_reason == "length"
            state.count(PREFIX + ("truncated" if masked else "trained"), model_tokens(c))
            if not masked:
                state.count(WITHIN_ONE, int(np.count_nonzero(token_staleness(g, c, trained_with) <= 1)))
    for g, reason in step.dropped:
        state.count(PREFIX + (reason.removeprefix("dropped_") if reason.dropped else "rejected"), group_tokens(g))
    for g in step.flat_unsolved(state.outcomes.best):
        state.count(UNSOLVED, 1)
        state.count(PREFIX + "flat_unsolved", group_tokens(g))


def token_accounting(totals: dict[str, int]) -> dict[str, Any]:
    """`summary.json`'s `tokens`: each place's count, the total and the trained share."""
    where = {w: totals.get(PREFIX + w, 0) for w in WHERE}
    generated = sum(where.values())
    share = round(where["trained"] / generated, 4) if generated else None
    within = round(totals.get(WITHIN_ONE, 0) / where["trained"], 4) if where["trained"] else None
    return {
        "generated": generated,
        **where,
        "flat_unsolved": totals.get(PREFIX + "flat_unsolved", 0),  # of `flat`
        "trained_share": share,
        "trained_within_one_version": within,
    }


def token_line(tokens: dict[str, Any]) -> str:
    """`trained 61% of 12,345 generated tokens (flat 30% = 20% unsolved + 10% mastered,
    stale 9%)`, or "" before any."""
    generated = tokens.get("generated") or 0
    if not generated:
        return ""

    def place(w: str) -> str:
        said = f"{w} {tokens[w] / generated:.0%}"
        unsolved = tokens.get("flat_unsolved", 0) if w == "flat" else 0
        if not unsolved:
            return said
        return f"{said} = {unsolved / generated:.0%} unsolved + {(tokens[w] - unsolved) / generated:.0%} mastered"

    rest = ", ".join(place(w) for w in WHERE[1:] if tokens.get(w))
    line = f"trained {tokens['trained'] / generated:.0%} of {generated:,} generated tokens"
    line = f"{line} ({rest})" if rest else line
    within = tokens.get("trained_within_one_version")
    return line if within is None else f"{line}; {within:.0%} of them within one version of the policy"
