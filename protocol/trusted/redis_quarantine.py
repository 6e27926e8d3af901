"""The quarantine calls of `RedisQueue`: which workers may no longer claim, and why; the
tallies of the learner's audits that lead to it; the run's end, after which no worker
claims; and the run's share of a fleet that serves several runs.

The learner is the authority (its checkpointed `LearnerState.quarantined`); this hash is
what the door enforces, written by the learner and lifted by the admin. A lift leaves ""
under the worker's name until the learner has seen it (`forget_lifted`), so that a lift
is never mistaken for an entry Redis lost (which the learner writes again).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import msgspec

from protocol.client.queue import AuditTally
from protocol.trusted.redis_base import RedisBase
from protocol.trusted.redis_fields import check_worker, text_of
from protocol.wire.errors import ProtocolError, WorkerQuarantined
from protocol.wire.keys import RUNS_KEY
from protocol.wire.messages import RunShare
from protocol.wire.text import printable

T = TypeVar("T")
log = logging.getLogger(__name__)


class RedisQuarantine(RedisBase):
    """The quarantine calls of `RedisQueue`."""

    def quarantine(self, worker: str, reason: str) -> None:
        check_worker(worker)
        self._script("QUARANTINE", [self.keys.quarantined, self.keys.prompts], [worker, printable(reason, 500) or "-"])

    def set_run_over(self, why: str) -> None:
        """Also the run's registration (`RUNS_KEY`): a run in progress is registered, one
        over is not."""
        if not isinstance(why, str):
            raise ProtocolError(f"set_run_over: expected a str, got {type(why).__name__}")
        run = self.config.run
        if why:
            self._call(lambda: self._r.set(self.keys.over, printable(why, 500)))
            self._call(lambda: self._r.hdel(RUNS_KEY, run))
        else:
            self._call(lambda: self._r.delete(self.keys.over))
            self._call(lambda: self._r.hset(RUNS_KEY, run, f"{time.time():.3f}"))

    def registered_runs(self) -> set[str]:
        """Every run in progress on this Redis, whichever this queue is for (`RUNS_KEY`)."""
        return {text_of(run) for run in self._call(lambda: self._r.hkeys(RUNS_KEY))}

    def set_run_rewards(self, specs: Sequence[str]) -> None:
        if not isinstance(specs, list | tuple) or not all(isinstance(s, str) for s in specs):
            raise ProtocolError("set_run_rewards: expected a list of str")
        self._call(lambda: self._r.set(self.keys.rewards, json.dumps([printable(s, 300) for s in specs])))

    def run_rewards(self) -> list[str] | None:
        raw = self._call(lambda: self._r.get(self.keys.rewards))
        return None if raw is None else [str(s) for s in json.loads(raw)]

    def set_run_share(self, share: RunShare) -> None:
        if not isinstance(share, RunShare):
            raise ProtocolError(f"set_run_share: expected a RunShare, got {type(share).__name__}")
        try:  # a struct made in Python is not checked against its bounds: do it here
            msgspec.convert(msgspec.to_builtins(share), RunShare)
        except msgspec.ValidationError as err:
            raise ProtocolError(f"set_run_share: {err}") from None
        self._call(lambda: self._r.set(self.keys.share, msgspec.json.encode(share)))

    def run_share(self) -> RunShare:
        raw = self._call(lambda: self._r.get(self.keys.share))
        if raw is None:
            return RunShare()
        try:
            return msgspec.json.decode(raw, type=RunShare)
        except (msgspec.ValidationError, msgspec.DecodeError) as err:  # written by hand: say so, use the default
            log.error("run %s: its share record is unreadable, using weight 1: %s", self.config.run, err)
            return RunShare()

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

    def record_audits(self, tallies: Mapping[str, AuditTally]) -> None:
        args: list[Any] = []
        for worker, tally in tallies.items():
            check_worker(worker)
            if not isinstance(tally, AuditTally):
                raise ProtocolError(f"audits: {worker} has {type(tally).__name__}, not an AuditTally")
            args += [worker, tally.passed, tally.failed]
        if args:
            self._script("RECORD_AUDITS", [self.keys.audits, self.keys.prompts], args)

    def audits(self) -> dict[str, AuditTally]:
        raw = self._call(lambda: self._r.hgetall(self.keys.audits))
        out = {}
        for k, v in raw.items():
            passed, _, failed = text_of(v).partition(" ")
            if passed.isdigit() and failed.isdigit():  # anything else was not written here
                out[text_of(k)] = AuditTally(int(passed), int(failed))
        return out


def quarantined_error(worker: str, reason: str) -> WorkerQuarantined:
    """What a quarantined worker's claim or submission raises (`CLAIM_EXPIRED` and
    `SUBMIT` find the reason)."""
    return WorkerQuarantined(
        f"worker {worker} is quarantined by the learner: {reason}. It claims and submits nothing more in this run: "
        f"fix it, then ask the run's admin to lift the quarantine (proxy quarantine --lift {worker})"
    )
