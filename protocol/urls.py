"""Open a queue from the URL a user types: `redis://`, `rediss://` (Redis direct) or
`https://` (through `proxy serve`, with a token; `SPOTGRPO_CA_CERT` names the CA file
for a self-signed proxy)."""

from __future__ import annotations

import os
from urllib.parse import urlparse

from protocol.queue import Queue, QueueConfig
from protocol.redis_queue import RedisQueue


def open_queue(url: str, config: QueueConfig | None = None, token: str | None = None) -> Queue:
    scheme = urlparse(url).scheme
    if scheme in ("redis", "rediss", "unix"):
        return RedisQueue.from_url(url, config)
    if scheme in ("https", "http"):
        from protocol.http_queue import HttpQueue  # httpx only where it is used

        return HttpQueue(url, token or os.environ.get("SPOTGRPO_TOKEN", ""), config)
    raise ValueError(f"queue {url!r}: use redis://host:port/db or https://proxy:port")
