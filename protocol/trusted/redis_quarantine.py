"""The quarantine calls of `RedisQueue`: which workers may no longer claim, and why.

The learner is the authority (its checkpointed `LearnerState.quarantined`); this hash is
what the door enforces, written by the learner and lifted by the admin. A lift leaves ""
under the worker's name until the learner has seen it (`forget_lifted`), so that a lift
is never mistaken for an entry Redis lost (which the learner writes again).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from protocol.trusted.redis_fields import check_worker, text_of
from protocol.wire.errors import WorkerQuarantined
from protocol.wire.keys import Keys
from protocol.wire.text import printable

T = TypeVar("T")


class RedisQuarantine:
    """Mixed into `RedisQueue`, which provides the plumbing below."""

    _r: Any
    keys: Keys

    def _call(self, fn: Callable[[], T]) -> T:
        raise NotImplementedError

    def _script(self, name: str, keys: list[str], args: list[Any]) -> Any: ...

    def quarantine(self, worker: str, reason: str) -> None:
        check_worker(worker)
        self._script("QUARANTINE", [self.keys.quarantined, self.keys.prompts], [worker, printable(reason, 500) or "-"])

    def quarantined(self) -> dict[str, str]:
        raw = self._call(lambda: self._r.hgetall(self.keys.quarantined))
        return {text_of(k): text_of(v) for k, v in raw.items()}

    def lift_quarantine(self, worker: str) -> bool:
        check_worker(worker)
        return bool(self._script("LIFT_QUARANTINE", [self.keys.quarantined], [worker]))

    def forget_lifted(self, workers: Sequence[str]) -> None:
        for worker in workers:
            check_worker(worker)
        if workers:
            self._script("FORGET_LIFTED", [self.keys.quarantined], list(workers))


def quarantined_error(worker: str, reason: str) -> WorkerQuarantined:
    """What a quarantined worker's claim raises (`CLAIM_EXPIRED` finds the reason)."""
    return WorkerQuarantined(
        f"worker {worker} is quarantined by the learner: {reason}. It claims nothing more in this run: fix it, "
        f"then ask the run's admin to lift the quarantine (proxy quarantine --lift {worker})"
    )
