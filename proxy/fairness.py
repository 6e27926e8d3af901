"""What keeps one token from starving the others: a request rate shared by every proxy
of a run, caps on the connections one token may hold open, and a header timeout.

- Rate: the `limits` library's sliding-window counter, stored in the run's Redis, so N
  proxies behind a balancer allow one budget per token, not N (an in-process store
  for the embedded default's in-process Redis). A proxy takes its token's budget in
  slices of `reserve_s` worth (25 requests at 500/s), one Redis round trip per slice
  rather than per request; a slice it has not spent within a second lapses. So N proxies
  let a token through at most N slices beyond its rate, and exactly at its rate where a
  slice is one request (rates under 1/`reserve_s`, as in the tests). A refusal is kept
  for `reserve_s` too, so a token flooding past its rate costs Redis one call per slice
  of time, not one per request. If the store cannot be reached the request goes ahead:
  the queue call behind it will answer 503 on its own.
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
    (`async+redis://…`, or `async+memory://` for one process), taken `reserve_s` worth
    at a time."""

    def __init__(
        self,
        storage_url: str,
        rate_per_s: float,
        burst: float,
        prefix: str,
        reserve_s: float = 0.05,
        rates: dict[str, float] | None = None,
    ) -> None:
        """`rates`: token name -> its own sustained rate (a fleet's token sized for its
        workers), with a burst of the same proportion."""
        self.item, self.slice = self._budget(rate_per_s, burst, reserve_s)
        self.rate_per_s, self.burst, self.reserve_s = rate_per_s, burst, reserve_s
        self._budgets: dict[str, tuple[Any, int]] = {}
        self.size(rates or {})
        self._reserved: dict[str, tuple[int, float]] = {}
        """Token name -> (requests left of its slice, when the slice was taken)."""
        self._locks: dict[str, asyncio.Lock] = {}
        self._refused: dict[str, tuple[float, float]] = {}
        """Token name -> (when it was refused, the wait it was told)."""
        options: dict[str, Any] = {"wrap_exceptions": True, "key_prefix": prefix}
        if storage_url.startswith("async+redis"):
            options |= {"implementation": "redispy", "socket_timeout": 2.0, "socket_connect_timeout": 2.0}
        else:
            options = {}
        self.storage = storage_from_string(storage_url, **options)
        self.limiter = SlidingWindowCounterRateLimiter(self.storage)
        self._warned_at = 0.0

    def size(self, rates: dict[str, float]) -> None:
        """Token name -> its own sustained rate from now on (the others: the default)."""
        self._budgets = {
            name: self._budget(rate, self.burst * rate / self.rate_per_s, self.reserve_s)
            for name, rate in rates.items()
        }

    @staticmethod
    def _budget(rate_per_s: float, burst: float, reserve_s: float) -> tuple[RateLimitItemPerSecond, int]:
        """The limits item (a window holding the burst) and the slice taken at a time."""
        window = max(1, round(burst / rate_per_s))
        return RateLimitItemPerSecond(max(1, int(rate_per_s * window)), window), max(1, int(rate_per_s * reserve_s))

    async def aclose(self) -> None:
        """Close the store's Redis connections (the `limits` library has no call for it)."""
        bridge = getattr(self.storage, "bridge", None)
        if bridge is not None:
            await bridge.get_connection().aclose()

    def _take(self, name: str) -> bool:
        left, taken_at = self._reserved.get(name, (0, 0.0))
        if left and time.monotonic() - taken_at < 1.0:
            self._reserved[name] = (left - 1, taken_at)
            return True
        return False

    def _still_refused(self, name: str) -> float:
        refused_at, wait = self._refused.get(name, (0.0, 0.0))
        elapsed = time.monotonic() - refused_at
        return max(0.05, wait - elapsed) if elapsed < self.reserve_s else 0.0

    async def retry_after(self, name: str) -> float:
        """0 if the request may go ahead (and is counted), else seconds to wait."""
        if self._take(name):
            return 0.0
        if wait := self._still_refused(name):
            return wait
        lock = self._locks.setdefault(name, asyncio.Lock())
        async with lock:  # one reservation in flight per token: a burst waits for it, not N of them
            if self._take(name):
                return 0.0
            if wait := self._still_refused(name):
                return wait
            wait = await self._reserve(name)
            if wait:
                self._refused[name] = (time.monotonic(), wait)
            return wait

    async def _reserve(self, name: str) -> float:
        now = time.monotonic()
        item, piece = self._budgets.get(name, (self.item, self.slice))
        try:
            if piece > 1 and await self.limiter.hit(item, name, cost=piece):
                self._reserved[name] = (piece - 1, now)
                return 0.0
            if await self.limiter.hit(item, name):  # the rest of the budget, one at a time
                return 0.0
            stats = await self.limiter.get_window_stats(item, name)
        except StorageError as err:
            if time.monotonic() - self._warned_at > 60:
                self._warned_at = time.monotonic()
                log.warning("rate-limit store unreachable, letting requests through: %s", err)
            return 0.0
        return max(0.05, stats.reset_time - time.time())


class OverCap(Exception):
    """A token already holds as many connections (or body bytes) of this kind as it may;
    `everyone`: the cap over all tokens was reached, not this token's."""

    def __init__(self, message: str, everyone: bool = False) -> None:
        super().__init__(message)
        self.everyone = everyone


class Holds:
    """Open long-polls and event streams per (token, kind). The event loop is one thread,
    so the counts need no lock."""

    def __init__(self, caps: dict[str, int], sized: dict[str, dict[str, int]] | None = None) -> None:
        """`caps`: kind -> cap; `sized`: token name -> its own caps (a fleet's token)."""
        self.caps, self.sized = caps, sized or {}
        self.counts: dict[tuple[str, str], int] = {}

    def acquire(self, token: str, kind: str) -> None:
        key = (token, kind)
        cap = self.sized.get(token, self.caps)[kind]
        if self.counts.get(key, 0) >= cap:
            raise OverCap(f"token {token} already holds {cap} open {kind}s; retry later")
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


class BodyBytes:
    """Request-body bytes held in memory at once, per token and in all: a body's bytes are
    counted as they arrive and given back when its request is answered. Past a cap the
    request is refused (`OverCap`, `.everyone` says which cap), so 64 bodies trickled at
    once cannot take the proxy's memory. The event loop is one thread: no lock."""

    def __init__(self, per_token: int, in_all: int, sized: dict[str, int] | None = None) -> None:
        """`sized`: token name -> its own cap (a fleet's token)."""
        self.per_token, self.in_all, self.sized = per_token, in_all, sized or {}
        self.held: dict[str, int] = {}
        self.total = 0

    def take(self, token: str, n: int) -> None:
        cap = self.sized.get(token, self.per_token)
        if self.held.get(token, 0) + n > cap:
            raise OverCap(
                f"token {token} has {cap} bytes of request bodies in flight already; retry when one is answered"
            )
        if self.total + n > self.in_all:
            raise OverCap(f"the proxy holds {self.in_all} bytes of request bodies already; retry later", everyone=True)
        self.held[token] = self.held.get(token, 0) + n
        self.total += n

    def give(self, token: str, n: int) -> None:
        if not n:
            return
        left = self.held.get(token, 0) - n
        if left > 0:
            self.held[token] = left
        else:
            self.held.pop(token, None)
        self.total -= n


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
