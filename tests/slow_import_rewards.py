"""A reward module that takes 3 s to import (as one that loads a judge model would), for
`--reward slow_import_rewards:digit_first` with the tests folder on PYTHONPATH."""

from __future__ import annotations

import time

from toy_rewards import digit_first

time.sleep(3.0)

__all__ = ["digit_first"]
