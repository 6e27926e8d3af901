"""Reward functions for the benchmarks: `--reward bench.rewards:busy_20ms` with the
repository root on PYTHONPATH."""

from __future__ import annotations

import time


def busy_20ms(prompts: list, completions: list, **_: object) -> list[float]:
    """CPU-bound, about 20 ms per completion (a verifier, a parser): the kind of reward
    that is worth moving off the GPU box."""
    out = []
    for c in completions:
        deadline = time.process_time() + 0.020
        x = 0
        while time.process_time() < deadline:
            x += 1
        out.append(float(len(str(c)) % 2))
    return out


def free(prompts: list, completions: list, **_: object) -> list[float]:
    """Costs nothing: what remains is the tier's own cost per group."""
    return [float(len(str(c)) % 2) for c in completions]
