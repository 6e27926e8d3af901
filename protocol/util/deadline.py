"""A call under a time limit, on a thread the caller can stop waiting for."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class PastLimit(Exception):
    """`within`'s function ran past its time limit (and was left to finish alone)."""


def within(timeout_s: float, fn: Callable[[], T], name: str) -> T:
    """`fn()` on a daemon thread we can stop waiting for: its value, or its exception raised
    here, or `PastLimit` after `timeout_s` (the thread is abandoned: a process of its own
    ends it, a `ScoringPool` process or an RQ work horse)."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as err:  # handed to the caller's thread as it is
            box["error"] = err

    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise PastLimit(name)
    if "error" in box:
        raise box["error"]
    value: T = box["value"]
    return value
