"""Open a queue from the URL a user types: `redis://`, `rediss://` (Redis direct) or
`https://` (through `proxy serve`, with a token; `SPOTGRPO_CA_CERT` names the CA file
for a self-signed proxy)."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from urllib.parse import urlparse

from protocol.errors import QueueUnavailable
from protocol.queue import Queue, QueueConfig
from protocol.retry import retry

log = logging.getLogger(__name__)


def open_queue(
    url: str, config: QueueConfig | None = None, token: str | None = None, retry_s: float = 30.0,
    stop: threading.Event | None = None,
) -> Queue:
    """`retry_s`: how long one call through the proxy retries an outage on its own; `stop`:
    once set, such calls stop retrying (the process is shutting down)."""
    scheme = urlparse(url).scheme
    if scheme in ("redis", "rediss", "unix"):
        # the trusted side's transport: a spot worker (https://) never imports a Redis client
        from protocol.redis_queue import RedisQueue

        return RedisQueue.from_url(url, config)
    if scheme in ("https", "http"):
        from protocol.http_queue import HttpQueue  # httpx only where it is used

        return HttpQueue(url, token or os.environ.get("SPOTGRPO_TOKEN", ""), config, retry_s=retry_s, stop=stop)
    raise ValueError(f"queue {url!r}: use redis://host:port/db or https://proxy:port")


def connect_queue(
    url: str, config: QueueConfig, token: str | None, timeout_s: float, stop: threading.Event
) -> Queue:
    """Open the queue and make one call through it (the latest adapter: every role may ask),
    retrying an outage for `timeout_s` in all, the client's own retries included, or until
    `stop` is set; the queue keeps `stop` as its own signal to stop retrying. A refusal
    (token, role, certificate) raises at once: it is not an outage. Raises QueueUnavailable
    with one line when the time is up."""
    def connect() -> Queue:
        queue = open_queue(url, config, token, retry_s=min(30.0, timeout_s), stop=stop)
        try:
            queue.latest_adapter()
        except BaseException:
            queue.close()
            raise
        return queue

    try:
        return retry(connect, on=(QueueUnavailable,), deadline_s=timeout_s, first=1.0, stop=stop,
                     before_wait=lambda err, delay: log.warning("queue unreachable, retrying in %.0fs: %s", delay, err))
    except QueueUnavailable as err:
        if stop.is_set():
            raise QueueUnavailable(f"{url} unreachable; stopped while waiting") from None
        raise QueueUnavailable(f"{url} unreachable for {timeout_s:g}s: {err}") from None


def check_model_path(spec: str) -> None:
    """Raise a plain "no such directory" for a `--model` that names a local path that is
    not there, instead of the hub client's complaint about repository ids. A hub id is
    `name` or `org/name`; anything starting with `/`, `.` or `~`, or with more than one
    `/`, is a path."""
    looks_local = spec.startswith(("/", ".", "~")) or spec.count("/") > 1 or (os.sep != "/" and os.sep in spec)
    if looks_local and not Path(spec).expanduser().is_dir():
        raise FileNotFoundError(f"--model {spec}: no such directory")
