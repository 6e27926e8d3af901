"""Open a queue on the trusted side: `redis://`, `rediss://` and `unix://` reach Redis
directly (the learner, the scoring tier, the proxy); `https://` goes through the proxy
as a worker's does (`protocol.client.urls`)."""

from __future__ import annotations

import threading
from urllib.parse import urlparse

from protocol.client import urls
from protocol.client.queue import Queue, QueueConfig


def open_queue(
    url: str,
    config: QueueConfig | None = None,
    token: str | None = None,
    retry_s: float = 30.0,
    stop: threading.Event | None = None,
) -> Queue:
    scheme = urlparse(url).scheme
    if scheme in ("redis", "rediss", "unix"):
        from protocol.trusted.redis_queue import RedisQueue

        return RedisQueue.from_url(url, config)
    if scheme not in ("https", "http"):
        raise ValueError(f"queue {url!r}: use redis://host:port/db or https://proxy:port")
    return urls.open_queue(url, config, token, retry_s=retry_s, stop=stop)


def connect_queue(url: str, config: QueueConfig, token: str | None, timeout_s: float, stop: threading.Event) -> Queue:
    """`protocol.client.urls.connect_queue`, opening Redis directly where the URL says so."""
    return urls.connect_queue(url, config, token, timeout_s, stop, opener=open_queue)
