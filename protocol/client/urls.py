"""Open a queue through `proxy serve`: `https://proxy:port` with a token
(`SPOTGRPO_CA_CERT` names the CA file for a self-signed proxy). This is how a worker
reaches a run. The trusted side also opens `redis://` queues
(`protocol.trusted.connect`), with the same `connect_queue`."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from urllib.parse import urlparse

from protocol.client.queue import Queue, QueueConfig
from protocol.util.retry import retry
from protocol.wire.errors import QueueUnavailable

log = logging.getLogger(__name__)


def open_queue(
    url: str,
    config: QueueConfig | None = None,
    token: str | None = None,
    retry_s: float = 30.0,
    stop: threading.Event | None = None,
) -> Queue:
    """`retry_s`: how long one call through the proxy retries an outage on its own; `stop`:
    once set, such calls stop retrying (the process is shutting down)."""
    scheme = urlparse(url).scheme
    if scheme in ("redis", "rediss", "unix"):
        raise ValueError(
            f"queue {url!r}: a worker reaches a run through `proxy serve` (https://proxy:port with "
            "--token); a redis:// URL holds every key of every run, which only the trusted side gets"
        )
    if scheme in ("https", "http"):
        from protocol.client.http_queue import HttpQueue  # httpx only where it is used

        return HttpQueue(url, token or os.environ.get("SPOTGRPO_TOKEN", ""), config, retry_s=retry_s, stop=stop)
    raise ValueError(f"queue {url!r}: use https://proxy:port")


Opener = Callable[..., Queue]


def connect_queue(
    url: str,
    config: QueueConfig,
    token: str | None,
    timeout_s: float,
    stop: threading.Event,
    opener: Opener = open_queue,
) -> Queue:
    """Open the queue and make one call through it (through a proxy, who the token is; else
    the latest adapter: every role may ask either, whatever runs its token names),
    retrying an outage for `timeout_s` in all, the client's own retries included, or until
    `stop` is set; the queue keeps `stop` as its own signal to stop retrying. A refusal
    (token, role, certificate) raises at once: it is not an outage. Raises QueueUnavailable
    with one line when the time is up."""

    def connect() -> Queue:
        queue = opener(url, config, token, retry_s=min(30.0, timeout_s), stop=stop)
        try:
            probe = getattr(queue, "whoami", None) or queue.latest_adapter
            probe()
        except BaseException:
            queue.close()
            raise
        return queue

    try:
        return retry(
            connect,
            on=(QueueUnavailable,),
            deadline_s=timeout_s,
            first=1.0,
            stop=stop,
            before_wait=lambda err, delay: log.warning("queue unreachable, retrying in %.0fs: %s", delay, err),
        )
    except QueueUnavailable as err:
        if stop.is_set():
            raise QueueUnavailable(f"{url} unreachable; stopped while waiting") from None
        raise QueueUnavailable(f"{url} unreachable for {timeout_s:g}s: {err}") from None
