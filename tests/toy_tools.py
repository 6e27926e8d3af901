"""Tools with TRL's requirements (typed, documented), importable by actor processes in
tests (`--tools toy_tools:add` with the tests folder on PYTHONPATH)."""

from __future__ import annotations

import asyncio
import time


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


async def slow_add(a: int, b: int) -> int:
    """Add two integers, taking 0.2 s (an async tool, as a call to a service would be).

    Args:
        a: The first integer.
        b: The second integer.
    """
    await asyncio.sleep(0.2)
    return a + b


def hang(seconds: float) -> str:
    """Sleep far past any time limit.

    Args:
        seconds: How long to sleep.
    """
    time.sleep(seconds)
    return "woke"


def hog(megabytes: int) -> int:
    """Allocate memory and keep it.

    Args:
        megabytes: How much.
    """
    block = bytearray(megabytes * 1024 * 1024)
    return len(block)


def divide(a: int, b: int) -> float:
    """Divide a by b.

    Args:
        a: The dividend.
        b: The divisor.
    """
    return a / b


def undocumented(a: int) -> int:
    return a


class GuessNumber:
    """Guess a secret number from "higher" / "lower" (the environment of episode tests)."""

    def __init__(self) -> None:
        self.secret = 0
        self.done = False

    def reset(self, secret: int = 7, **_: object) -> None:
        self.secret = int(secret)

    def guess(self, number: int) -> str:
        """Guess the secret number.

        Args:
            number: Your guess.
        """
        if number == self.secret:
            self.done = True
            return "correct"
        return "higher" if number < self.secret else "lower"

    def stall(self, seconds: float) -> str:
        """Think for a while.

        Args:
            seconds: How long.
        """
        time.sleep(seconds)
        return "done thinking"


class BrokenReset(GuessNumber):
    def reset(self, secret: int = 7, **_: object) -> None:
        raise RuntimeError("no board today")


class Observing(GuessNumber):
    def reset(self, secret: int = 7, **_: object) -> str:  # type: ignore[override]
        return "a board to show"


class ScoredGuess(GuessNumber):
    """GuessNumber that owns its reward: 1 when the secret was found."""

    def get_reward(self) -> float:
        return 1.0 if self.done else 0.0


class Hungry(ScoredGuess):
    """ScoredGuess with methods that eat memory and spin in C (the replay's sandbox tests)."""

    def eat(self, megabytes: int) -> int:
        """Allocate memory and keep it.

        Args:
            megabytes: How much.
        """
        self.kept = bytearray(megabytes * 1024 * 1024)
        return len(self.kept)

    def spin(self, n: int) -> int:
        """Sum a long range in one C call (no signal handler runs until it ends).

        Args:
            n: How far.
        """
        return sum(range(n))
