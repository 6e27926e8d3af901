"""The run's records beside its work, on Redis: the workers' statuses (with the proxy's cap
of workers per token), the dead letters, and the run's expiry once it is over.
`RedisQueue`'s part of the `Queue` interface for them."""

from __future__ import annotations

import contextlib
import time

from protocol.client.queue import DeadLetter
from protocol.trusted.redis_base import RedisBase
from protocol.trusted.redis_fields import check_ids, check_worker, decode_as, fields_of, text_of
from protocol.wire.codec import encode
from protocol.wire.errors import ProtocolError, TooManyWorkers
from protocol.wire.messages import PromptBatch, WorkerStatus


class RedisRecords(RedisBase):
    """The records' calls of `RedisQueue`."""

    def dead_letters(self, after: str = "0", count: int = 100) -> list[DeadLetter]:
        if after != "0":
            check_ids("after", [after])
        start = "-" if after == "0" else f"({after}"
        entries = self._call(lambda: self._r.xrange(self.keys.dead_letters, min=start, count=count))
        out = []
        for raw_id, flat in entries:
            f = fields_of(flat)
            batch = None
            missing = text_of(f["missing"]).split() if "missing" in f else None
            if f.get("source") == b"prompts" and f.get("m"):
                with contextlib.suppress(ProtocolError):  # unreadable ones are why some are here
                    batch = decode_as(f["m"], PromptBatch, self.config.limits)
            out.append(
                DeadLetter(
                    entry_id=text_of(raw_id),
                    source=text_of(f.get("source")),
                    lease_id=text_of(f.get("lease")),
                    reason=text_of(f.get("reason")),
                    deliveries=int(f.get("deliveries") or 0),
                    last_worker=text_of(f.get("worker")),
                    batch=batch,
                    missing_groups=missing,
                    group_id=text_of(f["g"]) if f.get("g") else None,
                    batch_id=text_of(f["b"]) if f.get("b") else None,
                )
            )
        return out

    def expire_run(self, ttl_s: float) -> int:
        if not ttl_s > 0:
            raise ValueError(f"ttl_s: must be > 0, got {ttl_s}")

        def expire() -> int:
            owners = [text_of(k) for k in self._r.smembers(self.keys.worker_owners)]
            with self._r.pipeline(transaction=False) as pipe:
                for key in [*self.keys.all(), *owners]:
                    pipe.expire(key, max(1, round(ttl_s)))
                return sum(1 for done in pipe.execute() if done)

        return self._call(expire)

    def report_status(
        self, status: WorkerStatus, owner: str = "", max_per_owner: int = 0, max_age_s: float = 120.0
    ) -> None:
        """`owner` (the proxy: the token's name) with `max_per_owner` > 0: a worker new to
        its owner is refused (`TooManyWorkers`) while the owner has that many that reported
        within `max_age_s`."""
        if not isinstance(status, WorkerStatus):
            raise ProtocolError(f"report_status: expected WorkerStatus, got {type(status).__name__}")
        check_worker(status.worker)
        payload = encode(status, self.config.limits)
        accepted = self._script(
            "REPORT_STATUS",
            [self.keys.workers, self.keys.prompts, self.keys.workers_of(owner), self.keys.worker_owners],
            [status.worker, payload, time.time(), max_age_s, max_per_owner if owner else 0],
        )
        if not int(accepted):
            raise TooManyWorkers(
                f"worker {status.worker}: token {owner!r} already has {max_per_owner} workers reporting "
                f"(the proxy's --max-workers-per-token); this one's status is not recorded"
            )

    def leave(self, worker: str, owner: str = "") -> bool:
        """`owner` (the proxy: the token's name): the worker no longer counts among its live ones."""
        check_worker(worker)
        return bool(int(self._script("LEAVE", [self.keys.workers, self.keys.workers_of(owner)], [worker])))

    def workers(self, max_age_s: float = 120.0) -> list[WorkerStatus]:
        now = time.time()
        live: list[WorkerStatus] = []
        gone: list[bytes] = []
        for name, payload in sorted(self._call(lambda: self._r.hgetall(self.keys.workers)).items()):
            try:
                status = decode_as(payload, WorkerStatus, self.config.limits)
            except ProtocolError:
                gone.append(name)
                continue
            if now - status.reported_at > max_age_s:
                gone.append(name)
            else:
                live.append(status)
        if gone:  # forgotten: a worker that comes back reports again
            self._call(lambda: self._r.hdel(self.keys.workers, *gone))
        return live
