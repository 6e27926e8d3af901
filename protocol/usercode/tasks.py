"""Reward functions of the built-in task (see `learner/tasks.py`), with TRL's signature."""

from __future__ import annotations

from typing import Any


def _text(completion: object) -> str:
    return completion[0]["content"] if isinstance(completion, list) else str(completion)


def next_digit(prompts: list[Any], completions: list[Any], answer: list[Any], **_: object) -> list[float]:
    """1.0 when the completion starts with the answer digit, else 0."""
    return [1.0 if _text(c).lstrip()[:1] == str(a) else 0.0 for c, a in zip(completions, answer, strict=True)]
