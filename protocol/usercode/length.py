"""Length shaping as reward functions, in TRL's names: DAPO's soft overlong punishment,
and a penalty on the model's own tokens and turns.

`--reward "protocol.usercode.length:get_soft_overlong_punishment(max_completion_len=256,
soft_punish_cache=64)"` adds, beside the task's reward, DAPO's Eq. 13 (TRL's
`trl.rewards.get_soft_overlong_punishment`, the same arguments and values): 0 up to
`max_completion_len - soft_punish_cache` tokens, then falling linearly to -1 at
`max_completion_len`, and -1 past it. It needs nothing of TRL, so the actors and the
scoring tier run it without TRL installed; where TRL is, its own helper works as well
(`trl.rewards:get_soft_overlong_punishment(...)`).

`--reward "protocol.usercode.length:get_length_penalty_reward(token_penalty=0.001,
turn_penalty=0.1)"` charges what an episode cost to generate, in the shape of TRL's
`get_repetition_penalty_reward`: `-(token_penalty * tokens + turn_penalty * turns)` past
`free_tokens` and `free_turns`, never below `max_penalty`. Tokens are the model's own
(TRL's `tool_mask`: tool results and the chat template's glue between turns are not
counted), turns the runs of them; a single completion is one turn of all its tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from protocol.usercode.chat import model_turns


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


def get_length_penalty_reward(
    token_penalty: float = 0.0,
    turn_penalty: float = 0.0,
    free_tokens: int = 0,
    free_turns: int = 1,
    max_penalty: float = -1.0,
) -> Callable[..., list[float]]:
    """The reward function: 0 within `free_tokens` model tokens and `free_turns` turns,
    then `token_penalty` less per token and `turn_penalty` less per turn past them, down
    to `max_penalty` (negative; TRL's convention for a penalty's floor)."""
    if token_penalty < 0 or turn_penalty < 0:
        raise ValueError(f"token_penalty ({token_penalty}) and turn_penalty ({turn_penalty}) must be >= 0")
    if free_tokens < 0 or free_turns < 0:
        raise ValueError(f"free_tokens ({free_tokens}) and free_turns ({free_turns}) must be >= 0")
    if max_penalty > 0:
        raise ValueError(f"max_penalty ({max_penalty}) must be <= 0")

    def length_penalty(
        completion_ids: list[list[int]], tool_mask: list[list[int]] | None = None, **_: Any
    ) -> list[float]:
        masks: list[list[int] | None] = list(tool_mask) if tool_mask is not None else [None] * len(completion_ids)
        out = []
        for ids, mask in zip(completion_ids, masks, strict=True):
            runs = model_turns(mask, len(ids))
            tokens = sum(end - start for start, end in runs)
            cost = token_penalty * max(0, tokens - free_tokens) + turn_penalty * max(0, len(runs) - free_turns)
            out.append(max(max_penalty, -cost))
        return out

    return length_penalty
