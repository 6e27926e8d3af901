"""The queue over Redis streams (Redis >= 7.0), direct; also runs on a fakeredis client.

Prompt batches live in one stream read by the consumer group `actors`, rollout groups
in another read by the group `learner`. Every step that touches more than one key is a
Lua script (see `protocol.trusted.redis_lua`), or for a submission a MULTI/EXEC around one (its
messages go in plain XADDs: Redis's Lua hashes every byte it is handed), so a crash
between two commands cannot leave a lease acknowledged without its groups stored, or the
other way round.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import redis
import redis.exceptions
from redis.commands.core import Script

from protocol.client.queue import (
    Delivery,
    FinishedBatch,
    Lease,
    Queue,
    QueueConfig,
    SubmitResult,
    check_finished,
)
from protocol.trusted.redis_adapters import RedisAdapters
from protocol.trusted.redis_calls import Entry, aio_transaction
from protocol.trusted.redis_fields import (
    check_ids,
    check_worker,
    decode_as,
    decode_each_as,
    expected_groups,
    fields_of,
    prompt_digest,
    split_private,
    text_of,
)
from protocol.trusted.redis_quarantine import RedisQuarantine, quarantined_error
from protocol.trusted.redis_records import RedisRecords
from protocol.trusted.redis_stats import RedisStats
from protocol.wire.codec import CheckedGroups, encode
from protocol.wire.errors import (
    ProtocolError,
    QueueError,
    QueueUnavailable,
)
from protocol.wire.keys import ACTORS_GROUP, LEARNER_GROUP
from protocol.wire.messages import AdapterManifest, PromptBatch, RolloutGroup, WorkerStatus

log = logging.getLogger(__name__)

T = TypeVar("T")
M = TypeVar("M", PromptBatch, RolloutGroup, AdapterManifest, WorkerStatus)
_ACK_CHUNK = 1000  # ids per command of an acknowledgement


@dataclass(frozen=True)
class Submission:
    """A submit's MULTI/EXEC, built and checked, not yet sent (`RedisQueue.prepare_submit`)."""

    commands: list[tuple[Any, ...]]
    script: Script
    worker: str

    def result(self, replies: list[Any]) -> SubmitResult:
        """The submission's outcome from EXEC's replies; a refusal among them raised."""
        for reply in replies:
            if isinstance(reply, Exception):
                if str(reply).startswith("QUARANTINED "):
                    raise quarantined_error(self.worker, str(reply).split(" ", 1)[1])
                raise reply  # the open's refusal (nothing written), or what Redis refused
        if replies[-1] is None:
            raise QueueError("redis: the submission's gate was not open at its close")
        stored, dups, held, finished, missing = replies[-1]
        return SubmitResult(
            stored=int(stored),
            duplicates=int(dups),
            lease_held=bool(held),
            finished=bool(finished),
            missing=int(missing),
        )


class RedisQueue(RedisAdapters, RedisStats, RedisQuarantine, RedisRecords, Queue):
    """`Queue` on a redis-py client (a `fakeredis.FakeRedis` works too).

    The client must not decode responses (`decode_responses=False`): payloads are bytes.
    """

    def __init__(self, client: redis.Redis, config: QueueConfig | None = None) -> None:
        super().__init__(client, config)
        # Rollout reads whose reply may have been lost leave entries pending that this
        # process never saw; after such an error the next read re-scans the pending list.
        self._handed_out: dict[str, set[str]] = {}
        self._resync: set[str] = set()

    # ------------------------------------------------------------------ prompts

    def add_prompts(self, batches: Sequence[PromptBatch]) -> int:
        args: list[Any] = []
        for b in batches:
            if not isinstance(b, PromptBatch):
                raise ProtocolError(f"add_prompts: expected PromptBatch, got {type(b).__name__}")
            public, private = split_private(b)
            args += [
                b.batch_id,
                encode(public, self.config.limits),
                b.num_generations,
                b.sampling.max_tokens,
                expected_groups(b),
                b.scoring,
                len(private),
            ]
            for group_id, record in private.items():
                args += [group_id, record]
        if not args:
            return 0
        return int(self._script("ADD_PROMPTS", [self.keys.prompts, self.keys.batches_seen, self.keys.private], args))

    def claim(self, worker: str, count: int = 1, block_s: float = 0.0) -> list[Lease]:
        check_worker(worker)
        if count < 1:
            raise ValueError(f"count: must be >= 1, got {count}")
        block_ms = self._block_ms(block_s)
        expired = self._script(
            "CLAIM_EXPIRED",
            [
                self.keys.prompts,
                self.keys.dead_letters,
                self.keys.groups_seen,
                self.keys.private,
                self.keys.quarantined,
                self.keys.over,
            ],
            [
                ACTORS_GROUP,
                worker,
                int(self.config.lease_timeout_s * 1000),
                self.config.max_deliveries,
                count,
                time.time(),
            ],
        )
        if isinstance(expired, bytes | str):  # the learner quarantined it (one call, checked in the script)
            raise quarantined_error(worker, text_of(expired))
        rows = [(text_of(i), int(n), payload) for i, n, payload in expired]
        if len(rows) < count:
            resp = self._call(
                lambda: self._r.xreadgroup(
                    ACTORS_GROUP,
                    worker,
                    {self.keys.prompts: ">"},
                    count=count - len(rows),
                    block=None if rows else block_ms,
                )
            )
            rows += _new_rows(resp)
        return self._leases(rows)

    async def wait_for_prompts_async(self, aclient: Any, worker: str, count: int, block_s: float) -> list[Lease]:
        """The wait of a blocking `claim` from an event loop, after a `claim` that found
        nothing: new prompt batches only, as `claim` waits for them, on `aclient` (a
        `redis.asyncio` client, `connect_async`), so that a thousand workers waiting cost
        the proxy a thousand coroutines and connections, not a thousand threads."""
        check_worker(worker)
        block_ms = self._block_ms(block_s)
        if block_ms is None:
            return []

        async def read() -> Any:
            async with asyncio.timeout(block_s + 10.0):  # the client has no socket timeout of its own
                return await aclient.xreadgroup(
                    ACTORS_GROUP, worker, {self.keys.prompts: ">"}, count=count, block=block_ms
                )

        with self._errors():
            try:
                try:
                    resp = await read()
                except redis.exceptions.ResponseError as err:
                    self._regroup(err)
                    resp = await read()
            except TimeoutError as err:
                raise QueueUnavailable(f"redis did not answer within {block_s + 10.0:g}s") from err
        return self._leases(_new_rows(resp))

    def _leases(self, rows: list[tuple[str, int, Any]]) -> list[Lease]:
        """Leases of claimed prompt entries (lease id, deliveries, payload); an unreadable
        entry is dead-lettered instead."""
        leases = []
        for lease_id, deliveries, payload in rows:
            try:
                batch = decode_as(payload, PromptBatch, self.config.limits)
            except ProtocolError as err:
                log.error("prompt entry %s is unreadable, dead-lettering it: %s", lease_id, err)
                self._script(
                    "DEAD_LETTER",
                    [self.keys.prompts, self.keys.dead_letters],
                    [ACTORS_GROUP, lease_id, "prompts", f"malformed: {err}", time.time()],
                )
                continue
            leases.append(Lease(lease_id=lease_id, batch=batch, deliveries=deliveries))
        return leases

    def heartbeat(self, worker: str, lease_ids: Sequence[str]) -> list[str]:
        check_worker(worker)
        check_ids("lease_ids", lease_ids)
        if not lease_ids:
            return []
        held = self._script("HEARTBEAT", [self.keys.prompts], [ACTORS_GROUP, worker, *lease_ids])
        return [text_of(i) for i in held]

    def submit(self, worker: str, lease_id: str, groups: Sequence[RolloutGroup]) -> SubmitResult:
        """`groups` that are `CheckedGroups` (the proxy's request bodies) within this queue's
        field bounds, and named after `worker` (checked here), are not validated again."""
        sub = self.prepare_submit(worker, lease_id, groups)
        return self._call(lambda: sub.result(self._calls.transaction(sub.commands, sub.script)))

    async def submit_async(
        self,
        aclient: Any,
        worker: str,
        lease_id: str,
        groups: Sequence[RolloutGroup],
    ) -> SubmitResult:
        """`submit` from an event loop: its transaction sent on `aclient`, a `redis.asyncio`
        client of this queue's server (`protocol.trusted.redis_client.connect_async`; the proxy's, so
        that a submission costs it no hand-off to a thread and back). Consumer groups lost
        with the server's data are recreated (a blocking call, once) and the submission sent
        again, as `submit` does."""
        sub = self.prepare_submit(worker, lease_id, groups)
        timeout_s = self.config.max_block_s + 10.0  # the blocking client's socket timeout (from_url)
        with self._errors():
            try:
                return sub.result(await aio_transaction(aclient, sub.commands, sub.script, timeout_s=timeout_s))
            except redis.exceptions.ResponseError as err:
                self._regroup(err)
                return sub.result(await aio_transaction(aclient, sub.commands, sub.script, timeout_s=timeout_s))

    def prepare_submit(self, worker: str, lease_id: str, groups: Sequence[RolloutGroup]) -> Submission:
        """A submit's transaction, its arguments checked and its groups encoded, not yet sent."""
        check_worker(worker)
        check_ids("lease_id", [lease_id])
        if not groups:
            raise ProtocolError("groups: a submit carries at least one rollout group")
        trusted = isinstance(groups, CheckedGroups) and groups.trusted_by(self.config.limits)
        checks: list[Any] = []
        payloads: list[bytes] = []
        for g in groups:
            if not isinstance(g, RolloutGroup):
                raise ProtocolError(f"groups: expected RolloutGroup, got {type(g).__name__}")
            longest = max(len(c.token_ids) // 4 for c in g.completions)
            payload = encode(g, self.config.limits, validate=not (trusted and g.actor_id == worker))
            room = self.config.limits.submit_limit(len(g.completions))
            if len(payload) > room:
                raise ProtocolError(
                    f"group {g.group_id}: {len(payload)} bytes exceed the {room} a group of {len(g.completions)} "
                    f"completions may have (the message limit less the room the scoring tier needs)"
                )
            checks += [g.group_id, len(g.completions), longest, prompt_digest(g.prompt_token_ids)]
            payloads.append(payload)
        batch_ids = {g.batch_id for g in groups}
        if len(batch_ids) != 1:
            raise ProtocolError(f"groups: all groups of a submit belong to one batch, got {sorted(batch_ids)}")
        batch_id = batch_ids.pop()
        # One MULTI/EXEC: the script checks and opens a gate per group, a plain XADD stores
        # each message (never passed to Lua: see SUBMIT in protocol.trusted.redis_lua).
        script = self._scripts["SUBMIT"]
        k = self.keys
        keys = [k.prompts, k.rollouts, k.groups_seen, k.unscored, k.submit_gate, k.submit_alias, k.quarantined]
        gate = ("EVALSHA", script.sha, len(keys), *keys)
        commands: list[tuple[Any, ...]] = [(*gate, "open", ACTORS_GROUP, worker, lease_id, batch_id, *checks)]
        for i, (g, payload) in enumerate(zip(groups, payloads, strict=True)):
            if i:
                commands.append((*gate, "next", g.group_id))
            commands.append(("XADD", k.submit_alias, "NOMKSTREAM", "*", "g", g.group_id, "b", batch_id, "m", payload))
        commands.append((*gate, "close"))
        return Submission(commands, script, worker)

    def release(self, worker: str, lease_id: str) -> bool:
        check_worker(worker)
        check_ids("lease_id", [lease_id])
        idle_ms = int(self.config.lease_timeout_s * 1000) + 1000
        return bool(self._script("RELEASE", [self.keys.prompts], [ACTORS_GROUP, worker, lease_id, idle_ms]))

    # ------------------------------------------------------------------ rollouts

    def _deliveries(self, consumer: str, entries: list[Entry]) -> list[Delivery]:
        out = []
        handed = self._handed_out.setdefault(consumer, set())
        payloads = [flat.get(b"m") if flat else None for _id, flat in entries]  # bytes (see the class)
        for (raw_id, _flat), group in zip(
            entries, decode_each_as(payloads, RolloutGroup, self.config.limits), strict=True
        ):
            entry_id = text_of(raw_id)
            if isinstance(group, ProtocolError):
                log.error("rollout entry %s is unreadable, dead-lettering it: %s", entry_id, group)
                self._script(
                    "DEAD_LETTER",
                    [self.keys.rollouts, self.keys.dead_letters],
                    [LEARNER_GROUP, entry_id, "rollouts", f"malformed: {group}", time.time()],
                )
                continue
            handed.add(entry_id)
            out.append(Delivery(delivery_id=entry_id, group=group))
        return out

    def _read_pending(self, consumer: str, count: int, after: str) -> list[Entry]:
        return self._call(lambda: self._calls.read_group(LEARNER_GROUP, consumer, self.keys.rollouts, after, count))

    def read_rollouts(self, consumer: str, count: int, block_s: float = 0.0) -> list[Delivery]:
        check_worker(consumer)
        if count < 1:
            raise ValueError(f"count: must be >= 1, got {count}")
        block_ms = self._block_ms(block_s)
        if consumer in self._resync:
            handed = self._handed_out.get(consumer, set())
            lost = [e for e in self._read_pending(consumer, 1_000_000, "0") if text_of(e[0]) not in handed]
            self._resync.discard(consumer)
            if lost:
                log.warning("recovered %d rollout entries whose read reply was lost", len(lost))
                return self._deliveries(consumer, lost)
        try:
            entries = self._call(
                lambda: self._calls.read_group(LEARNER_GROUP, consumer, self.keys.rollouts, ">", count, block_ms)
            )
        except QueueUnavailable:
            self._resync.add(consumer)
            raise
        return self._deliveries(consumer, entries)

    def pending_rollouts(self, consumer: str, count: int, after: str = "0") -> list[Delivery]:
        check_worker(consumer)
        if after != "0":
            check_ids("after", [after])
        return self._deliveries(consumer, self._read_pending(consumer, count, after))

    def ack_rollouts(self, delivery_ids: Sequence[str], finished: Sequence[FinishedBatch] = ()) -> int:
        """One MULTI/EXEC of plain commands: `XACK` then `XDEL` of exactly those entries (see
        the trimming note in `protocol.trusted.redis_lua`), and the finished batches' `SREM`s. No
        script: Lua cost Redis a third more than the commands themselves (measured:
        `EVALSHA` 164 us against `XACK` 25 + `XDEL` 87 for 16 groups)."""
        ids = list(delivery_ids)
        check_ids("delivery_ids", ids)
        batches = [check_finished(b) for b in finished]
        if not ids and not batches:
            return 0
        k = self.keys
        commands: list[tuple[Any, ...]] = []
        for i in range(0, len(ids), _ACK_CHUNK):
            chunk = ids[i : i + _ACK_CHUNK]
            commands += [("XACK", k.rollouts, LEARNER_GROUP, *chunk), ("XDEL", k.rollouts, *chunk)]
        group_ids = [g for b in batches for g in b.group_ids]
        for key, members in (
            (k.batches_seen, [b.batch_id for b in batches]),
            (k.groups_seen, group_ids),
            (k.scored_seen, group_ids),
        ):
            for i in range(0, len(members), _ACK_CHUNK):
                commands.append(("SREM", key, *members[i : i + _ACK_CHUNK]))

        def run() -> int:
            replies = self._calls.transaction(commands)
            for reply in replies:
                if isinstance(reply, Exception):
                    raise reply  # NOGROUP (Redis restarted empty): `_call` recreates the groups
            return sum(int(r) for r, c in zip(replies, commands, strict=True) if c[0] == "XACK")

        acked = self._call(run)
        for handed in self._handed_out.values():
            handed.difference_update(ids)
        return acked


def _new_rows(resp: Any) -> list[tuple[str, int, Any]]:
    """(entry id, 1 delivery, payload) of what an XREADGROUP of new prompt entries read."""
    return [(text_of(i), 1, fields_of(f).get("m")) for _stream, entries in resp or () for i, f in entries]
