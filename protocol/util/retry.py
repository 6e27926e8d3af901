"""One retry policy for every loop that waits out an outage: capped exponential backoff,
a wait that a stop event (SIGTERM) ends at once, an optional deadline or attempt count,
and a server's own delay (Retry-After) where it gives one.

`Backoff` is the policy as a value, for loops that are not one call made again: the
worker keeps generating while its queue calls wait, the learner keeps judging while it
waits for groups, the dispatcher reads on while its sweep waits. `retry` is the
call-again form built on it.

Why not tenacity: it retries a call, so the loops above would still keep a backoff of
their own, and every wait here must end when a stop event is set, which would need its
sleep replaced anyway. What is left is these fifty lines.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class Backoff:
    """Delays of `first`, doubling to at most `cap`; `reset` after a success."""

    def __init__(self, first: float = 0.5, cap: float = 30.0) -> None:
        self.first, self.cap = first, cap
        self.next = first

    def failed(self) -> float:
        """A failure: the delay to wait now (the next one doubles)."""
        delay, self.next = self.next, min(self.next * 2, self.cap)
        return delay

    def reset(self) -> None:
        self.next = self.first

    def wait(self, stop: threading.Event | None = None, delay: float | None = None) -> bool:
        """Wait the next delay (or `delay`), or until `stop` is set; True if it was."""
        delay = self.failed() if delay is None else delay
        if stop is None:
            time.sleep(delay)
            return False
        return stop.wait(delay)


def retry(
    fn: Callable[[], T],
    *,
    on: tuple[type[BaseException], ...],
    never: tuple[type[BaseException], ...] = (),
    deadline_s: float | None = None,
    attempts: int | None = None,
    first: float = 0.5,
    cap: float = 30.0,
    stop: threading.Event | None = None,
    delay_of: Callable[[BaseException, float], float] | None = None,
    before_wait: Callable[[BaseException, float], None] | None = None,
) -> T:
    """`fn()` until it returns. An error in `on` (and not in `never`: a subclass that is
    final, such as a missing key among store errors) is retried after the backoff's delay (or
    `delay_of(error, delay)`: a server's Retry-After) while the wait ends before
    `deadline_s` from now and fewer than `attempts` calls were made; then, or when `stop`
    is set, the last error is raised as it was. Any other error propagates at once.
    `before_wait(error, delay)`: a log line, a counter."""
    backoff = Backoff(first, cap)
    deadline = None if deadline_s is None else time.monotonic() + deadline_s
    made = 0
    while True:
        made += 1
        try:
            return fn()
        except on as err:
            if isinstance(err, never):
                raise
            delay = backoff.failed()
            if delay_of is not None:
                delay = delay_of(err, delay)
            out_of_time = deadline is not None and time.monotonic() + delay > deadline
            if out_of_time or (attempts is not None and made >= attempts) or (stop is not None and stop.is_set()):
                raise
            if before_wait is not None:
                before_wait(err, delay)
            if backoff.wait(stop, delay):
                raise
