"""What this process may use of the machine it runs on."""

from __future__ import annotations

import os


def usable_cores() -> int:
    """CPU cores this process may run on: its affinity where the OS has one (Linux), else
    every core (macOS)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
