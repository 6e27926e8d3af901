"""Counting a run's queue on Redis: each stream's length, its pending and waiting entries
and how long the oldest has waited, the leases each worker holds. `RedisQueue`'s `stats`,
kept apart from the calls that move work."""

from __future__ import annotations

from typing import TypeVar

from protocol.client.queue import QueueStats, StreamStats
from protocol.trusted.redis_base import RedisBase
from protocol.trusted.redis_fields import text_of
from protocol.wire.errors import QueueError
from protocol.wire.keys import ACTORS_GROUP, LEARNER_GROUP, SCORERS_GROUP

T = TypeVar("T")


class RedisStats(RedisBase):
    """The counting calls of `RedisQueue`."""

    def _stream_stats(self, stream: str, group: str) -> StreamStats:
        length = int(self._call(lambda: self._r.xlen(stream)))
        try:
            groups = self._call(lambda: self._r.xinfo_groups(stream))
        except QueueError as err:
            if "no such key" not in str(err):
                raise
            groups = []  # the stream is gone (Redis restarted empty): nothing waits in it
        info = next((g for g in groups if text_of(g["name"]) == group), None)
        if info is None:  # no reader ever came
            waiting, pending, last = length, 0, "0-0"
        else:
            waiting, pending, last = info.get("lag"), int(info["pending"]), text_of(info["last-delivered-id"])
            if waiting is None:  # Redis cannot tell after some deletions; count instead
                waiting = self._script("COUNT_AFTER", [stream], [last])
        oldest = None
        if int(waiting):
            first = self._call(lambda: self._r.xrange(stream, min=f"({last}", count=1))
            if first:  # entry ids are Redis's clock in ms: compare with Redis's clock
                seconds, micros = self._call(self._r.time)
                oldest = max(0.0, seconds + micros / 1e6 - int(text_of(first[0][0]).split("-")[0]) / 1000)
        return StreamStats(length=length, pending=pending, waiting=int(waiting), oldest_waiting_s=oldest)

    def stats(self) -> QueueStats:
        consumers = self._call(lambda: self._r.xinfo_consumers(self.keys.prompts, ACTORS_GROUP))
        version = self._call(lambda: self._r.hget(self.keys.adapter_latest, "version"))
        # upstream first (prompts -> unscored -> rollouts): work moving on while we count
        # is counted twice, never missed
        prompts = self._stream_stats(self.keys.prompts, ACTORS_GROUP)
        unscored = self._stream_stats(self.keys.unscored, SCORERS_GROUP)
        return QueueStats(
            prompts=prompts,
            rollouts=self._stream_stats(self.keys.rollouts, LEARNER_GROUP),
            dead_letters=int(self._call(lambda: self._r.xlen(self.keys.dead_letters))),
            leases_by_worker={text_of(c["name"]): int(c["pending"]) for c in consumers if int(c["pending"])},
            latest_adapter_version=int(version or 0),
            unscored=unscored,
        )

    def prompts_waiting(self) -> int:
        """The prompts issued whose groups are not in the queue yet, counted prompt by prompt
        (every batch entry read: for the end of a run, not for a loop)."""
        return int(self._script("PROMPTS_WAITING", [self.keys.prompts, self.keys.groups_seen], []))
