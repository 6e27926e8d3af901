"""The built-in tasks: the embedded default's (continue a run of digits) and the
arithmetic example's (`learner run --example arithmetic`: one-step word problems).

Next digit.

A prompt is a run of 3 to 6 consecutive digits counting up, wrapping after 9 ("7890");
the answer is the digit that comes next ("1"). An untrained model almost never says it
(about 1 in 60 tokens is that digit), and GRPO with LoRA learns it within a few minutes
on two CPU cores. The reward (`protocol.usercode.tasks:next_digit`, run by the actors) gives 1 for
the right digit first and 0 otherwise; groups that all score the same carry no
advantage and are dropped (`dropped_flat`), so the learner trains on the others.

Arithmetic. GSM8K-shaped rows (a question, and an answer ending in `#### <number>`) of
one-digit addition, subtraction and multiplication stories, asked as a chat turn; the
built-in math reward (math-verify) scores them on the trusted tier. SmolLM2-135M-Instruct
names the right number about a quarter of the time before training.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

REWARD = "protocol.usercode.tasks:next_digit"


def next_digit_rows(n: int = 2000, seed: int = 0) -> list[dict[str, str]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        start, length = rng.randrange(10), rng.randint(3, 6)
        digits = "".join(str((start + i) % 10) for i in range(length))
        rows.append({"prompt": digits, "answer": str((start + length) % 10)})
    return rows


def write_next_digit_dataset(path: Path, n: int = 2000, seed: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in next_digit_rows(n, seed)))
    return path


# ------------------------------------------------------------------ arithmetic

ARITHMETIC_REWARD = "protocol.usercode.math_reward:accuracy"
"""Scored on the trusted tier: the `answer` column never leaves the trusted side."""

_NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Gus", "Hana", "Ivo", "Jia", "Kofi", "Lena")
_THINGS = ("apples", "books", "coins", "marbles", "pencils", "stickers", "shells", "cards")
ARITHMETIC_SYSTEM = "You solve math word problems. Reply with the calculation and the answer, in one line."
"""Asked this way, SmolLM2-135M-Instruct ends about half its answers within 32 tokens and is
right about a quarter of the time at temperature 0.8 (without it: 6 % and 13 %)."""


def _problem(rng: random.Random) -> tuple[str, str, int]:
    """(question, worked answer, result): one step, one-digit numbers, a whole result."""
    name, other, thing = rng.choice(_NAMES), rng.choice(_NAMES), rng.choice(_THINGS)
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    kind = rng.choice(("add", "add", "sub", "mul"))
    if kind == "add":
        return (
            f"{name} has {a} {thing}. {other} gives {name} {b} more. How many {thing} does {name} have now?",
            f"{a} + {b} = {a + b}",
            a + b,
        )
    if kind == "sub":
        a, b = max(a, b), min(a, b)
        return (
            f"{name} has {a} {thing} and gives {b} of them to {other}. How many {thing} does {name} have left?",
            f"{a} - {b} = {a - b}",
            a - b,
        )
    return (
        f"{name} has {a} bags with {b} {thing} in each bag. How many {thing} does {name} have in all?",
        f"{a} * {b} = {a * b}",
        a * b,
    )


def arithmetic_rows(n: int = 2000, seed: int = 0) -> list[dict[str, object]]:
    """GSM8K-shaped rows: `question`, `answer` (the working, then `#### <number>`) and
    `prompt`, the question as a chat (a system turn, then the question) for the model's
    chat template."""
    rng = random.Random(seed)
    rows: list[dict[str, object]] = []
    for _ in range(n):
        question, working, result = _problem(rng)
        rows.append(
            {
                "prompt": [{"role": "system", "content": ARITHMETIC_SYSTEM}, {"role": "user", "content": question}],
                "question": question,
                "answer": f"{working}\n#### {result}",
            }
        )
    return rows


def write_arithmetic_dataset(path: Path, n: int = 2000, seed: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in arithmetic_rows(n, seed)))
    return path


# ------------------------------------------------------------------ calculator (episodes)

CALCULATOR_TOOL = "learner.tasks:add"
CALCULATOR_REWARD = "learner.tasks:final_answer"
"""Scored on the trusted tier: the `answer` column never leaves the trusted side."""
CALCULATOR_SYSTEM = (
    "You cannot add large numbers in your head. For every sum, call the add tool, then answer with its result."
)
"""With this and two worked exchanges in the prompt, SmolLM2-135M-Instruct calls the tool in
about 3 of 32 samples at temperature 1.0 (with the tool offered alone: 0 of 32); GRPO takes
it from there (README: the calculator example)."""


def add(a: int, b: int) -> int:
    """Add two integers exactly.

    Args:
        a: the first integer
        b: the second integer
    """
    return a + b


def final_answer(prompts: list[Any], completions: list[Any], answer: list[str], **_: Any) -> list[float]:
    """1.0 when the episode's last line is the answer exactly (its last assistant turn)."""
    texts = [c[-1]["content"] if isinstance(c, list) else str(c) for c in completions]
    return [1.0 if t.strip().splitlines()[-1:] == [str(a)] else 0.0 for t, a in zip(texts, answer, strict=True)]


def _worked(a: int, b: int) -> list[dict[str, Any]]:
    """A question, the tool call, its result and the answer, as chat turns."""
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": a, "b": b}}}
    return [
        {"role": "user", "content": f"What is {a} + {b}?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "add", "content": str(a + b)},
        {"role": "assistant", "content": str(a + b)},
    ]


def calculator_rows(n: int = 2000, seed: int = 0) -> list[dict[str, object]]:
    """Sums of two five-digit numbers, too long to add by eye for a small model: `prompt`
    (a system turn, two worked exchanges with the tool, the question) and `answer`."""
    rng = random.Random(seed)
    shots = [*_worked(4821, 9734), *_worked(51234, 77001)]
    rows: list[dict[str, object]] = []
    for _ in range(n):
        a, b = rng.randint(10000, 99999), rng.randint(10000, 99999)
        rows.append(
            {
                "prompt": [
                    {"role": "system", "content": CALCULATOR_SYSTEM},
                    *shots,
                    {"role": "user", "content": f"What is {a} + {b}?"},
                ],
                "answer": str(a + b),
            }
        )
    return rows


def write_calculator_dataset(path: Path, n: int = 2000, seed: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in calculator_rows(n, seed)))
    return path
