"""The built-in task of the embedded default: continue a run of digits.

A prompt is a run of 3 to 6 consecutive digits counting up, wrapping after 9 ("7890");
the answer is the digit that comes next ("1"). An untrained model almost never says it
(about 1 in 60 tokens is that digit), and GRPO with LoRA learns it within a few minutes
on two CPU cores. The reward (`actors.tasks:next_digit`, run by the actors) gives 1 for
the right digit first and 0.2 for any other digit first, so the early groups already
differ in reward and carry a learning signal.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

REWARD = "actors.tasks:next_digit"


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
