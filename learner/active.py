"""Prompts chosen where they teach: active sampling.

A group whose completions all got the same reward is dropped as flat (it has no
advantage), and its generation was wasted. The learner keeps, per prompt, how often its
recent groups were flat: an exponential average that moves `SMOOTHING` of the way to each
group's outcome (flat: 1, a spread: 0), so two flat groups in a row take a new prompt to
0.75 and one spread halves it. When the feeder meets a prompt again it passes over it with
that chance, never more than `1 - active_sampling_floor`, so a prompt the policy has
mastered is issued rarely and still retried (GRESO's probabilistic skipping, prime-rl's
difficulty pools, DAPO's dynamic sampling without the over-generation).

Flat means mastered: all completions at the best reward the run has read. A prompt flat
below it (all wrong, for now) keeps its place unless `active_sampling_hard`: on the
embedded default, setting prompts aside for 20 versions after two flat versions, the
wrong ones with the mastered ones, left the held-out pass@1 at 0.27-0.31 where the run
without reached 0.88: what the policy has not yet learnt is what it must train on.

Where a group taught (its rewards spread), its prompt is likely to teach again soon: the
policy is neither sure of it nor lost on it. With the chance `active_sampling_revisit` the
prompt goes out again (`revisits`), in a batch of revisits, before new prompts, once a
checkpoint holds it waiting (so that a resumed learner issues the same batches: see
`learner.feeder.Feeder.checkpointed`) (Kimi k1.5's
prioritized sampling, which draws a problem by how often it is failed; here, by whether it
last showed a spread). It matters where a run reads its data once, so that every new
prompt is a first sight no record can pass over: the arithmetic example (where it is on;
80 % of the groups read trained against 56-77 % without). Once: a revisit's group is not
revisited, so about a quarter of the prompts issued are revisits and a run does not
narrow to the few it keeps asking (revisited until flat, one arithmetic run did not
learn). Off by default: on the embedded default, whose 40 prompts come round every few
steps anyway, it did worse (docs/benchmarks.md).

A prompt is known by its row's content (`PromptSource.row_key`: the first row with the
same columns), so a data set that repeats a question shares its history. Outcomes are
recorded when a group is judged (a stale group too: it still shows a spread or none; a
rejected group says nothing of its prompt) and are part of the checkpoint, so a resumed
run keeps them. Whether a position is passed over is drawn from the run's seed and the
position, so a feeder asked again with the same state issues the same prompts.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

SMOOTHING = 0.5
"""How far each group moves its prompt's flat rate towards its own outcome."""
FORGET = 0.01
"""A flat rate below this is dropped from the state (a prompt with a spread costs nothing)."""


def passes_over(flat_rate: float, position: int, seed: int, floor: float) -> bool:
    """Whether the feeder passes over the prompt at run position `position` whose flat rate
    is `flat_rate`: with that chance, at most `1 - floor`, drawn from `seed` and the position."""
    chance = min(flat_rate, 1.0 - floor)
    return chance > 0 and float(np.random.default_rng([seed, position]).random()) < chance


def revisits(rewards: list[float], group_id: str, seed: int, chance: float) -> bool:
    """Whether a group's prompt goes out again: its rewards spread, and a draw from `seed`
    and the group's id (so a resumed learner that reads the group again decides the same)
    fell under `chance`."""
    if chance <= 0 or len(set(rewards)) == 1:
        return False
    draw = np.random.default_rng([seed, int.from_bytes(hashlib.blake2b(group_id.encode(), digest_size=8).digest())])
    return float(draw.random()) < chance


@dataclass
class PromptOutcomes:
    flat_rate: dict[int, float] = field(default_factory=dict)
    """row key -> how often its recent groups were flat (mastered), 0 to 1."""
    best: float | None = None
    """The best reward of any completion read: a group flat at it is mastered."""

    def record(self, key: int, rewards: list[float], hard: bool = False) -> None:
        """A group of prompt `key` was judged, with these rewards."""
        best = self.best = max(rewards if self.best is None else [self.best, *rewards])
        flat = len(set(rewards)) == 1 and (hard or rewards[0] >= best)
        rate = (1 - SMOOTHING) * self.flat_rate.get(key, 0.0) + SMOOTHING * flat
        if rate < FORGET:
            self.flat_rate.pop(key, None)
        else:
            self.flat_rate[key] = rate

    def metrics(self, prompts: int) -> dict[str, float]:
        """`prompts`: the data set's distinct prompts. `sampling/flat_prompt_frac`: those
        more often flat than not; `sampling/skip_chance_mean`: the chance a prompt met now
        is passed over (before the floor), on average over the data set."""
        return {
            "sampling/flat_prompt_frac": sum(1 for r in self.flat_rate.values() if r >= 0.5) / max(prompts, 1),
            "sampling/skip_chance_mean": sum(self.flat_rate.values()) / max(prompts, 1),
        }

    @classmethod
    def from_json(cls, raw: dict[str, Any] | None) -> PromptOutcomes:
        """From `asdict` (state.json, whose keys are strings); none in a checkpoint written before."""
        raw = raw or {}
        return cls(
            flat_rate={int(k): float(v) for k, v in (raw.get("flat_rate") or {}).items()},
            best=None if raw.get("best") is None else float(raw["best"]),
        )
