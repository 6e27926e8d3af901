"""The trusted side's view of the queue: what the scoring tier reads and writes.

In trusted scoring (`PromptBatch.scoring == "trusted"`), actors submit unscored groups;
`SUBMIT` puts them in the `unscored` stream, which no actor or proxy route reads. The
scoring tier (`learner score`, RQ workers on the same Redis) reads them through the
consumer group `scorers` (an entry is pending from its read until its RQ job exists),
scores them with the prompts' private columns (kept in the `private` hash by
`add_prompts`), and stores each scored group in the rollouts stream with
`store_scored`: once per group id however often it is scored, deleting its unscored
entry in the same script. An entry leaves the stream only with its group stored, so
the stream's length is what is being scored.

Only trusted processes use this class: it needs Redis itself, not the proxy.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Self

import msgspec

from protocol.client.queue import QueueConfig
from protocol.trusted.redis_client import cluster_client, connect
from protocol.trusted.redis_fields import check_ids, check_worker, decode_as, fields_of, text_of
from protocol.trusted.redis_queue import RedisQueue
from protocol.wire.codec import encode
from protocol.wire.errors import ProtocolError
from protocol.wire.keys import SCORERS_GROUP
from protocol.wire.messages import PrivatePrompt, Prompt, RolloutGroup


@dataclass(frozen=True)
class UnscoredEntry:
    entry_id: str
    group_id: str
    batch_id: str


@dataclass(frozen=True)
class UnscoredGroup:
    entry_id: str
    group: RolloutGroup
    """As the actor submitted it; its rewards, if any, are ignored."""
    prompt: Prompt | None
    """The full prompt, dataset columns included; None if the record is gone (the group
    was scored meanwhile, or the run's Redis lost it)."""
    scored: bool = False
    """Its group was stored scored already (by an earlier attempt of its job)."""
    tools: tuple[str, ...] = ()
    """Its batch's tools: empty, its completions may carry no mask (single turns)."""
    max_tool_calling_iterations: int | None = None


class ScoringQueue(RedisQueue):
    """`RedisQueue` plus the scoring tier's reads and its one write."""

    _rq: Any = None

    @classmethod
    def from_url(
        cls, url: str, config: QueueConfig | None = None, max_connections: int = 100, rq_url: str | None = None
    ) -> Self:
        """`rq_url`: a plain Redis for RQ's jobs, needed where `url` is a Redis Cluster
        (RQ's transactions span slots); by default RQ uses the run's Redis."""
        queue = super().from_url(url, config, max_connections)
        if rq_url is not None:
            queue._rq = connect(rq_url, socket_timeout=queue.config.max_block_s + 10.0)
            if cluster_client(queue._rq):
                queue.close()
                raise ValueError(f"--rq-redis {rq_url}: a Redis Cluster node; RQ needs a plain Redis server")
        elif queue.on_cluster:
            queue.close()
            raise ValueError(
                f"{url} is a Redis Cluster: RQ, which runs the scoring tier's jobs, needs a plain "
                "Redis for them (its transactions span hash slots); give it one with --rq-redis "
                "redis://HOST:PORT (the groups stay on the cluster)"
            )
        return queue

    @property
    def client(self) -> Any:
        """The redis-py client for RQ (which needs a connection of its own kind, to a plain
        Redis): the run's Redis, or `--rq-redis`'s."""
        return self._rq if self._rq is not None else self._r

    def rq_worker_registered(self, key: str) -> bool:
        """An RQ worker's registration under `key` exists and records no death (RQ's own
        test before it registers a worker by that name)."""
        rq = self.client
        return bool(self._call(lambda: rq.exists(key) and not rq.hexists(key, "death")))

    def close(self) -> None:
        super().close()
        if self._rq is not None:
            self._rq.close()

    def _entries(self, raw: list[Any]) -> list[UnscoredEntry]:
        return [
            UnscoredEntry(text_of(i), text_of(fields_of(f).get("g")), text_of(fields_of(f).get("b")))
            for i, f in raw
            if f is not None
        ]

    def read_unscored(self, consumer: str, count: int, block_s: float = 0.0) -> list[UnscoredEntry]:
        """New unscored groups for dispatcher `consumer`, pending until it `dispatched` them."""
        check_worker(consumer)
        block_ms = self._block_ms(block_s)
        resp = self._call(
            lambda: self._r.xreadgroup(SCORERS_GROUP, consumer, {self.keys.unscored: ">"}, count=count, block=block_ms)
        )
        return self._entries([e for _stream, entries in resp or () for e in entries])

    def dispatched(self, entry_ids: list[str]) -> int:
        """The entries are RQ jobs now: no longer pending (they stay in the stream, to be
        read by the job and deleted when stored)."""
        check_ids("entry_ids", entry_ids)
        if not entry_ids:
            return 0
        return int(self._call(lambda: self._r.xack(self.keys.unscored, SCORERS_GROUP, *entry_ids)))

    def reclaim_unscored(self, consumer: str, idle_s: float, count: int = 100) -> list[UnscoredEntry]:
        """Entries read by a dispatcher more than `idle_s` ago and never made jobs (it died
        in between), now `consumer`'s to dispatch."""
        check_worker(consumer)
        resp = self._call(
            lambda: self._r.xautoclaim(
                self.keys.unscored, SCORERS_GROUP, consumer, int(idle_s * 1000), "0-0", count=count
            )
        )
        return self._entries(resp[1])

    def fetch_unscored(self, entry_id: str) -> UnscoredGroup | None:
        """The group of an unscored entry and its private prompt; None once it was stored
        (the entry is deleted then). Raises `ProtocolError` for an unreadable entry."""
        (item,) = self.fetch_unscored_many([entry_id])
        if isinstance(item, ProtocolError):
            raise item
        return item

    def fetch_unscored_many(self, entry_ids: Sequence[str]) -> list[UnscoredGroup | ProtocolError | None]:
        """`fetch_unscored` for each entry (an unreadable one's `ProtocolError` in its
        place), and whether its group is scored already, in two round trips for them all."""
        check_ids("entry_ids", list(entry_ids))
        with self._errors(), self._r.pipeline(transaction=False) as pipe:
            for entry_id in entry_ids:
                pipe.xrange(self.keys.unscored, min=entry_id, max=entry_id)
            ranges = pipe.execute()
        groups: list[RolloutGroup | ProtocolError | None] = []
        for entries in ranges:
            try:
                groups.append(
                    decode_as(fields_of(entries[0][1]).get("m"), RolloutGroup, self.config.limits) if entries else None
                )
            except ProtocolError as err:
                groups.append(err)
        found = [g for g in groups if isinstance(g, RolloutGroup)]
        with self._errors(), self._r.pipeline(transaction=False) as pipe:
            for g in found:
                pipe.hget(self.keys.private, g.group_id)
                pipe.sismember(self.keys.scored_seen, g.group_id)
            replies = iter(pipe.execute() if found else ())
        out: list[UnscoredGroup | ProtocolError | None] = []
        for entry_id, group in zip(entry_ids, groups, strict=True):
            if not isinstance(group, RolloutGroup):
                out.append(group)
                continue
            record, scored = next(replies), next(replies)
            try:
                private = None if record is None else _private(record)
            except (msgspec.MsgspecError, ProtocolError) as err:
                out.append(ProtocolError(f"private prompt of group {group.group_id}: {err}"))
                continue
            out.append(
                UnscoredGroup(
                    entry_id=entry_id,
                    group=group,
                    prompt=private.prompt if private else None,
                    scored=bool(scored),
                    tools=tuple(private.tools) if private else (),
                    max_tool_calling_iterations=private.max_tool_calling_iterations if private else None,
                )
            )
        return out

    def store_scored(self, entry_id: str, group: RolloutGroup) -> bool:
        """Put a scored (or, with `error` set, rejected) group in the rollouts stream and
        acknowledge its unscored entry. False if the group was stored before."""
        check_ids("entry_id", [entry_id])
        if not isinstance(group, RolloutGroup):
            raise ProtocolError(f"store_scored: expected RolloutGroup, got {type(group).__name__}")
        return bool(
            self._script(
                "STORE_SCORED",
                [self.keys.rollouts, self.keys.scored_seen, self.keys.unscored, self.keys.private],
                [SCORERS_GROUP, entry_id, group.group_id, encode(group, self.config.limits)],
            )
        )

    def dead_letter_unscored(self, entry_id: str, reason: str) -> bool:
        """An unscored entry the tier cannot read or store goes to the dead letters, with
        its group and batch ids and the reason (the learner counts it there), whether or
        not a dispatcher still holds it. False if it was gone already."""
        check_ids("entry_id", [entry_id])
        return bool(
            self._script(
                "DEAD_LETTER_UNSCORED",
                [self.keys.unscored, self.keys.dead_letters, self.keys.private],
                [SCORERS_GROUP, entry_id, reason, time.time()],
            )
        )


def _private(record: bytes) -> PrivatePrompt:
    """A private record: a `PrivatePrompt`, or a bare `Prompt` as records written before
    batches' episode rules were kept (no tools: no mask is accepted)."""
    try:
        return msgspec.msgpack.decode(record, type=PrivatePrompt)
    except msgspec.ValidationError:
        return PrivatePrompt(prompt=msgspec.msgpack.decode(record, type=Prompt))
