"""What keeps one token from starving the others: a request rate shared by every proxy
of a run, caps on the connections one token may hold open, and a header timeout.

- Rate: the `limits` library's sliding-window counter, stored in the run's Redis, so N
  proxies behind a balancer allow one budget per token, not N (an in-process store
  for the embedded default's in-process Redis). If the store cannot be reached the
  request goes ahead: the queue call behind it will answer 503 on its own.
- Holds: long-polls (claim, read, history with a wait) and adapter-event streams are
  counted per token, per proxy process, while they are open; the excess is refused
  with 429 and Retry-After, and only the excess.
- Header timeout: uvicorn closes idle keep-alive connections but waits for ever on a
  connection whose request headers never finish; `HeaderTimeoutProtocol` closes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

from limits import RateLimitItemPerSecond
from limits.aio.strategies import SlidingWindowCounterRateLimiter
from limits.errors import StorageError
from limits.storage import storage_from_string
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger(__name__)


class SharedRateLimit:
    """`rate_per_s` sustained and `burst` at once per token name, shared through `storage_url`
    (`async+redis://…`, or `async+memory://` for one process)."""

    def __init__(self, storage_url: str, rate_per_s: float, burst: float, prefix: str) -> None:
        window = max(1, round(burst / rate_per_s))
        self.item = RateLimitItemPerSecond(max(1, int(rate_per_s * window)), window)
        options: dict[str, Any] = {"wrap_exceptions": True, "key_prefix": prefix}
        if storage_url.startswith("async+redis"):
            options |= {"implementation": "redispy", "socket_timeout": 2.0, "socket_connect_timeout": 2.0}
        else:
            options = {}
        self.storage = storage_from_string(storage_url, **options)
        self.limiter = SlidingWindowCounterRateLimiter(self.storage)
        self._warned_at = 0.0

    async def retry_after(self, name: str) -> float:
        """0 if the request may go ahead (and is counted), else seconds to wait."""
        try:
            if await self.limiter.hit(self.item, name):
                return 0.0
            stats = await self.limiter.get_window_stats(self.item, name)
        except StorageError as err:
            if time.monotonic() - self._warned_at > 60:
                self._warned_at = time.monotonic()
                log.warning("rate-limit store unreachable, letting requests through: %s", err)
            return 0.0
        return max(0.05, stats.reset_time - time.time())


class OverCap(Exception):
    """A token already holds as many connections of this kind as it may."""


class Holds:
    """Open long-polls and event streams per (token, kind). The event loop is one thread,
    so the counts need no lock."""

    def __init__(self, caps: dict[str, int]) -> None:
        self.caps = caps
        self.counts: dict[tuple[str, str], int] = {}

    def acquire(self, token: str, kind: str) -> None:
        key = (token, kind)
        if self.counts.get(key, 0) >= self.caps[kind]:
            raise OverCap(f"token {token} already holds {self.caps[kind]} open {kind}s; retry later")
        self.counts[key] = self.counts.get(key, 0) + 1

    def release(self, token: str, kind: str) -> None:
        key = (token, kind)
        self.counts[key] -= 1
        if not self.counts[key]:
            del self.counts[key]

    @contextlib.contextmanager
    def hold(self, token: str, kind: str) -> Iterator[None]:
        self.acquire(token, kind)
        try:
            yield
        finally:
            self.release(token, kind)


class HeaderTimeoutProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol that closes a connection whose request line and
    headers have not all arrived `header_timeout_s` after the connection opened or after
    the request's first byte. Set the class attribute before serving."""

    header_timeout_s: float = 10.0
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._header_timer is None:
            self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.logger.info("closing a connection whose request headers took over %gs", self.header_timeout_s)
            self.transport.close()
