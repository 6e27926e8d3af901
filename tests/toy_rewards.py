"""Reward functions with TRL's signature, importable by actor processes in tests
(`--reward toy_rewards:digit_first` with the tests folder on PYTHONPATH)."""

from __future__ import annotations

import time


def _text(completion: object) -> str:
    return completion[0]["content"] if isinstance(completion, list) else str(completion)  # type: ignore[index]


def digit_first(prompts: list, completions: list, **_: object) -> list[float]:
    """1 when the completion starts with a digit."""
    return [1.0 if _text(c)[:1].isdigit() else 0.0 for c in completions]


def length_bonus(prompts: list, completions: list, **_: object) -> list[float]:
    return [min(len(_text(c)), 10) / 10 for c in completions]


def slow_digit_first(prompts: list, completions: list, **kw: object) -> list[float]:
    """digit_first, taking a second: keeps a batch in hand long enough to kill the worker."""
    time.sleep(1.0)
    return digit_first(prompts, completions, **kw)


def broken(prompts: list, completions: list, **_: object) -> list[float]:
    raise ZeroDivisionError("the reward model is down")


def hangs(prompts: list, completions: list, **_: object) -> list[float]:
    time.sleep(30)
    return [0.0] * len(completions)


def abstains_on_odd(prompts: list, completions: list, completion_ids: list, **_: object) -> list[float | None]:
    return [None if len(ids) % 2 else 1.0 for ids in completion_ids]


def uses_columns(prompts: list, completions: list, answer: list, **_: object) -> list[float]:
    """Data set columns arrive as lists aligned with the completions, as in TRL."""
    return [1.0 if _text(c).startswith(str(a)) else 0.0 for c, a in zip(completions, answer, strict=True)]


def hangs_when_asked(prompts: list, completions: list, **_: object) -> list[float]:
    """Hangs (after writing its process id next to the prompt's `pid_file` column) when
    the prompt says "hang"; digit_first otherwise."""
    if "hang" in str(prompts[0]):
        pid_file = _.get("pid_file")
        if isinstance(pid_file, list) and pid_file:
            import os
            from pathlib import Path

            Path(str(pid_file[0])).write_text(str(os.getpid()))
        time.sleep(300)
    return digit_first(prompts, completions)
