"""The preflight runner shared by `actors check` and `learner check`: named checks in
order, one line each, stopping at the first failure with what to do about it."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any


class CheckFailed(Exception):
    def __init__(self, reason: str, fix: str) -> None:
        super().__init__(reason)
        self.reason, self.fix = reason, fix


class Checks:
    def __init__(self, out: Any = None) -> None:
        self.out = sys.stdout if out is None else out  # the stream of now, not of the import
        self.passed: list[str] = []

    def run(self, name: str, fn: Callable[[], str]) -> None:
        """Run one check; its detail line on success, CheckFailed on failure."""
        started = time.monotonic()
        try:
            detail = fn()
        except CheckFailed as err:
            print(f"FAIL  {name:<10} {err.reason}\n      fix: {err.fix}", file=self.out, flush=True)
            raise
        print(f"ok    {name:<10} {detail} ({time.monotonic() - started:.1f}s)", file=self.out, flush=True)
        self.passed.append(name)

    def run_all(self, checks: list[tuple[str, Callable[[], str]]], ready: str) -> int:
        """Every check in order; 0 with `ready` said when all pass, 1 at the first failure."""
        started = time.monotonic()
        try:
            for name, fn in checks:
                self.run(name, fn)
        except CheckFailed:
            return 1
        took = time.monotonic() - started
        print(f"all {len(self.passed)} checks passed: {ready} ({took:.0f}s)", file=self.out, flush=True)
        return 0
