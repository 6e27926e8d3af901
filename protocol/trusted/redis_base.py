"""What every part of `RedisQueue` calls Redis through: the client and the calls it makes
past redis-py (`protocol.trusted.redis_calls.RedisCalls`), the run's keys and Lua scripts,
redis-py's exceptions translated into the queue's, and consumer groups recreated when
Redis lost them. The parts (`redis_queue`, `redis_adapters`, `redis_stats`,
`redis_quarantine`, `redis_records`) each add their calls on this base."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any, Self, TypeVar

import redis
import redis.exceptions

from protocol.client.queue import QueueConfig
from protocol.trusted import redis_lua
from protocol.trusted.redis_calls import RedisCalls
from protocol.trusted.redis_client import cluster_client, connect
from protocol.wire.errors import REFUSALS, QueueError, QueueUnavailable
from protocol.wire.keys import ACTORS_GROUP, LEARNER_GROUP, SCORERS_GROUP, Keys

log = logging.getLogger("protocol.trusted.redis_queue")

T = TypeVar("T")


class RedisBase:
    """A run's queue on a redis-py client (a `fakeredis.FakeRedis` works too), before any
    of its calls. The client must not decode responses (`decode_responses=False`):
    payloads are bytes."""

    def __init__(self, client: redis.Redis, config: QueueConfig | None = None) -> None:
        self.config = config or QueueConfig()
        self.keys = Keys(self.config.run)
        self._r: Any = client  # redis-py's annotations mix in its asyncio types: read as Any
        self._calls = RedisCalls(client)
        self._scripts = {
            name: client.register_script(getattr(redis_lua, name))
            for name in (
                "ADD_PROMPTS",
                "CLAIM_EXPIRED",
                "DEAD_LETTER",
                "DEAD_LETTER_UNSCORED",
                "HEARTBEAT",
                "SUBMIT",
                "STORE_SCORED",
                "RELEASE",
                "ANNOUNCE",
                "COUNT_AFTER",
                "PROMPTS_WAITING",
                "REPORT_STATUS",
                "LEAVE",
                "QUARANTINE",
                "LIFT_QUARANTINE",
                "FORGET_LIFTED",
                "RECORD_AUDITS",
            )
        }
        with self._errors():
            self._ensure_groups()

    @classmethod
    def from_url(cls, url: str, config: QueueConfig | None = None, max_connections: int = 100) -> Self:
        """Connect to `redis://host:port/db` (or `rediss://` for TLS; any node of a Redis
        Cluster works as well, `protocol.trusted.redis_client`). A server that calls the queue
        from many threads at once needs `max_connections` above its thread count, plus the
        one the queue keeps checked out (`protocol.trusted.redis_calls`): one blocking read holds a
        connection for its whole wait."""
        config = config or QueueConfig()
        client = connect(url, socket_timeout=config.max_block_s + 10.0, max_connections=max_connections)
        return cls(client, config)

    @property
    def client(self) -> Any:
        """The client itself: a proxy's queues of other runs on the same server share it."""
        return self._r

    @property
    def on_cluster(self) -> bool:
        """Connected to a Redis Cluster (redis-py's cluster client)."""
        return cluster_client(self._r)

    @contextlib.contextmanager
    def _errors(self) -> Iterator[None]:
        """Translate redis-py's exceptions into the queue's."""
        try:
            yield
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as err:
            raise QueueUnavailable(f"redis unreachable: {err}") from err
        except redis.exceptions.ResponseError as err:
            text = str(err)
            for code, cls in REFUSALS.items():
                marker = f"{code.upper()} "
                if marker in text:
                    raise cls(text.split(marker, 1)[1]) from None
            raise QueueError(f"redis: {text}") from err

    def _ensure_groups(self) -> None:
        for stream, group in (
            (self.keys.prompts, ACTORS_GROUP),
            (self.keys.rollouts, LEARNER_GROUP),
            (self.keys.unscored, SCORERS_GROUP),
        ):
            try:
                self._r.xgroup_create(stream, group, id="0", mkstream=True)
            except redis.exceptions.ResponseError as err:
                if "BUSYGROUP" not in str(err):
                    raise

    def _call(self, fn: Callable[[], T]) -> T:
        """Run `fn`; if Redis lost our consumer groups (restarted without persistence),
        recreate them and try once more."""
        with self._errors():
            try:
                return fn()
            except redis.exceptions.ResponseError as err:
                self._regroup(err)
                return fn()

    def _regroup(self, err: redis.exceptions.ResponseError) -> None:
        """After a refusal: recreate the consumer groups if Redis lost them, else raise it."""
        if "NOGROUP" not in str(err):
            raise err
        log.warning("consumer groups missing (redis restarted empty?); recreating them")
        self._ensure_groups()

    def _script(self, name: str, keys: list[str], args: list[Any]) -> Any:
        return self._call(lambda: self._calls.script(self._scripts[name], keys, args))

    def _block_ms(self, block_s: float) -> int | None:
        if block_s < 0 or block_s > self.config.max_block_s:
            raise ValueError(f"block_s: must be in [0, {self.config.max_block_s}], got {block_s}")
        return int(block_s * 1000) or None  # Redis reads BLOCK 0 as "forever"

    def close(self) -> None:
        self._calls.close()
        self._r.close()
