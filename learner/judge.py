"""The filter between the queue and the step: which groups are trained on, and why not.

`judge` is a pure function of a group and what the learner knows (`Bounds`, its version,
the prompt tokens it issued): a `Reason` (`rejected_*` for groups that break a rule,
`dropped_stale` and `dropped_flat` for good groups that carry no usable signal; its value
is its counter's name) or None to train on it. Rejections are checked first, in the order
below, so a group breaking several rules is counted once under the first. `StepGroups` collects one step's verdicts.
"""

from __future__ import annotations

import collections
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

from protocol import RolloutGroup

if TYPE_CHECKING:
    from learner.config import LearnerConfig


class Reason(StrEnum):
    """Why a group read from the queue is not trained on; the value names its counter."""

    UNSCORED = "rejected_unscored"
    MASK = "rejected_mask"
    SCORING = "rejected_scoring"
    REWARD_ERROR = "rejected_reward_error"
    BAD_REWARD = "rejected_bad_reward"
    EMPTY_PROMPT = "rejected_empty_prompt"
    BAD_VOCAB = "rejected_bad_vocab"
    TOO_LONG = "rejected_too_long"
    BAD_SHAPE = "rejected_bad_shape"
    FUTURE_VERSION = "rejected_future_version"
    ADAPTER_DIGEST = "rejected_adapter_digest"
    QUARANTINED = "rejected_quarantined"
    """From a worker quarantined (`learner.audit`), before or after it was read."""
    AUDIT = "rejected_audit"
    """Failed its audit: its worker is quarantined."""
    DUPLICATE = "rejected_duplicate"
    """A consumed prompt's group again (a queue that lost its dedup record); never counted as consumed."""
    STALE = "dropped_stale"
    FLAT = "dropped_flat"

    @property
    def rejected(self) -> bool:
        """The group broke a rule (its worker's doing)."""
        return self.value.startswith("rejected_")

    @property
    def dropped(self) -> bool:
        """A good group with no usable signal (its rewards still measure the policy)."""
        return self.value.startswith("dropped_")

    @property
    def reissued(self) -> bool:
        """A dishonest worker's group: the rejection says nothing of the prompt, only of the
        worker, so the prompt goes out again (`PromptLedger.to_reissue`)."""
        return self in (Reason.AUDIT, Reason.ADAPTER_DIGEST, Reason.QUARANTINED)


@dataclass(frozen=True)
class Bounds:
    """What every group must fit, from the run's configuration and its model."""

    scoring_mode: str
    """`trusted`: only the scoring tier may write a group (it stamps `scored_by`)."""
    max_abs_reward: float
    vocab_size: int
    context: int
    """Prompt plus completion tokens the model can take."""
    num_generations: int
    max_tokens: int
    max_staleness: int
    episodes: bool = False
    """The run offers tools (`--tools`, `--environment`): a completion may carry a mask."""

    @classmethod
    def for_run(cls, cfg: LearnerConfig, vocab_size: int, context: int) -> Bounds:
        """The run's bounds, for a model of `vocab_size` words and `context` tokens."""
        return cls(
            scoring_mode=cfg.scoring_mode,
            max_abs_reward=cfg.max_abs_reward,
            vocab_size=vocab_size,
            context=context,
            num_generations=cfg.num_generations,
            max_tokens=cfg.max_tokens,
            max_staleness=cfg.max_staleness,
            episodes=bool(cfg.tools or cfg.environment),
        )


def judge(
    group: RolloutGroup,
    bounds: Bounds,
    policy_version: int,
    issued: dict[str, bytes | None] | None,
    digest_of: Callable[[int], str | None] | None = None,
) -> Reason | None:
    """Why `group` is not trained on, or None to train on it. `issued`:
    prompt id -> the prompt tokens issued, for the group's batch if this learner has it
    outstanding (None: one it does not hold, which the queue checked; `Feeder.issued_tokens`).
    `digest_of`: the published digest of an adapter version (None: one whose manifest
    cannot be read now, or one not checked); every version the group's tokens name is
    checked, its oldest (`adapter_digest`) and the newer ones (`later_digests`)."""
    prompt = group.prompt_tokens
    lengths = [c.tokens.size for c in group.completions]
    rewards = group.rewards
    if bounds.scoring_mode == "trusted" and group.scored_by is None:
        return Reason.UNSCORED  # only the scoring tier writes trusted groups to the rollouts stream
    if not bounds.episodes and any(c.mask is not None for c in group.completions):
        return Reason.MASK  # the learner trains mask-1 tokens, rewards score all: no tools, every token counts
    if group.error is not None and group.scored_by is not None:
        return Reason.SCORING  # the tier gave up on it (a reward that hung or kept raising)
    if group.error is not None or any(r is None for r in rewards):
        return Reason.REWARD_ERROR
    if any(not (math.isfinite(r) and abs(r) <= bounds.max_abs_reward) for r in rewards if r is not None):
        return Reason.BAD_REWARD  # 1e39 is finite in float64 and inf in float32
    if prompt.size == 0:
        return Reason.EMPTY_PROMPT
    if any(
        ids.size and (ids.min() < 0 or ids.max() >= bounds.vocab_size)
        for ids in (prompt, *(c.tokens for c in group.completions))
    ):
        return Reason.BAD_VOCAB
    if prompt.size + max(lengths) > bounds.context:
        return Reason.TOO_LONG
    if len(lengths) != bounds.num_generations or max(lengths) > bounds.max_tokens:
        return Reason.BAD_SHAPE
    if issued is not None and (
        group.prompt_id not in issued or issued[group.prompt_id] not in (None, group.prompt_token_ids)
    ):
        return Reason.BAD_SHAPE  # not the prompt, or not the tokens, this learner issued
    if group.newest_version > policy_version:
        return Reason.FUTURE_VERSION
    if digest_of is not None:
        named = ((group.adapter_version, group.adapter_digest), *group.later_digests.items())
        for version, claimed in named:
            published = digest_of(version) if version else None
            if published is not None and claimed != published:
                return Reason.ADAPTER_DIGEST  # generated with other files than the version it names, or none
    if policy_version - group.adapter_version > bounds.max_staleness:
        return Reason.STALE
    if len(set(rewards)) == 1:
        return Reason.FLAT
    return None


@dataclass
class StepGroups:
    """One step's groups as they were judged: those to train on, and those consumed and
    not trained (with the reason), in the order they came."""

    kept: list[RolloutGroup] = field(default_factory=list)
    dropped: list[tuple[RolloutGroup, Reason]] = field(default_factory=list)

    def add(self, group: RolloutGroup, reason: Reason | None) -> None:
        if reason is None:
            self.kept.append(group)
        else:
            self.dropped.append((group, reason))

    def dropped_rewards(self) -> list[float]:
        """Rewards of the good groups not trained on (stale, flat): still a measure of the policy."""
        return [float(r) for g, reason in self.dropped if reason.dropped for r in g.rewards if r is not None]

    def count(self, reason: Reason) -> int:
        return sum(1 for _, r in self.dropped if r == reason)

    def flat_unsolved(self, best: float | None) -> list[RolloutGroup]:
        """The flat groups whose completions all fell below `best`, the best reward the run
        has read (`learner.active.PromptOutcomes.best`): too hard for the policy so far,
        where the other flat groups are mastered."""
        return [
            g for g, r in self.dropped if r == Reason.FLAT and best is not None and float(g.rewards[0] or 0.0) < best
        ]

    def reasons(self) -> list[tuple[str, str]]:
        """(group id, reason) of the dropped groups."""
        return [(g.group_id, reason) for g, reason in self.dropped]


class RepeatedWarnings:
    """A warning that repeats (the same rejection, group after group) is logged at its
    first occurrence, then at most once per `every_s` with how many happened since."""

    def __init__(
        self, logger: logging.Logger, every_s: float = 60.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.logger, self.every_s, self.clock = logger, every_s, clock
        self._last: dict[str, float] = {}
        self._since: collections.Counter[str] = collections.Counter()

    def warn(self, key: str, message: str) -> None:
        now = self.clock()
        last = self._last.get(key)
        if last is not None and now - last < self.every_s:
            self._since[key] += 1
            return
        more = self._since.pop(key, 0)
        self._last[key] = now
        if more and last is not None:
            message += f" (and {more} more like it in the last {now - last:.0f}s)"
        self.logger.warning("%s", message)
