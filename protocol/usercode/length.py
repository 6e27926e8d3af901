"""Length shaping as reward functions, in TRL's names: DAPO's soft overlong punishment.

`--reward "protocol.usercode.length:get_soft_overlong_punishment(max_completion_len=256,
soft_punish_cache=64)"` adds, beside the task's reward, DAPO's Eq. 13 (TRL's
`trl.rewards.get_soft_overlong_punishment`, the same arguments and values): 0 up to
`max_completion_len - soft_punish_cache` tokens, then falling linearly to -1 at
`max_completion_len`, and -1 past it. It needs nothing of TRL, so the actors and the
scoring tier run it without TRL installed; where TRL is, its own helper works as well
(`trl.rewards:get_soft_overlong_punishment(...)`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def get_soft_overlong_punishment(max_completion_len: int, soft_punish_cache: int) -> Callable[..., list[float]]:
    """The reward function; `max_completion_len` is usually the run's `--max-tokens`."""
    if not 0 <= soft_punish_cache <= max_completion_len:
        raise ValueError(
            f"soft_punish_cache ({soft_punish_cache}) must be between 0 and max_completion_len ({max_completion_len})"
        )
    free = max_completion_len - soft_punish_cache

    def soft_overlong_punishment(completion_ids: list[list[int]], **_: Any) -> list[float]:
        def one(n: int) -> float:
            if n <= free:
                return 0.0
            if n <= max_completion_len:
                return (free - n) / soft_punish_cache
            return -1.0

        return [one(len(ids)) for ids in completion_ids]

    return soft_overlong_punishment
