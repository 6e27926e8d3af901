"""Open a queue from the URL a user types: `redis://`, `rediss://` (Redis direct) or,
once the proxy client lands, `https://` (through the proxy)."""

from __future__ import annotations

from urllib.parse import urlparse

from protocol.queue import Queue, QueueConfig
from protocol.redis_queue import RedisQueue


def open_queue(url: str, config: QueueConfig | None = None, token: str | None = None) -> Queue:
    scheme = urlparse(url).scheme
    if scheme in ("redis", "rediss", "unix"):
        return RedisQueue.from_url(url, config)
    if scheme in ("https", "http"):
        raise ValueError(
            f"queue {url!r}: the HTTPS transport (through `proxy serve`) is not in this "
            "version yet; use redis://host:port/db"
        )
    raise ValueError(f"queue {url!r}: use redis://host:port/db or https://proxy:port")
