"""Adapter announcements fanned out to every event stream of this proxy from one reader.

One background task follows the run's adapter-events stream (one blocking read, one
Redis connection, one worker thread at a time) and keeps the most recent events in
memory; each server-sent-events subscriber waits on an asyncio event, so a thousand
open streams cost a thousand coroutines, not a thousand threads and Redis connections.
A subscriber resuming from a Last-Event-ID older than what the hub remembers reads the
gap from Redis once, then follows the hub.

Shutdown: `stop()` cancels the reader and waits for a read in flight, which ends within
`block_s` (half a second: the proxy stops that soon after its streams end).
"""

from __future__ import annotations

import asyncio
import logging

from protocol import AdapterEvent, Queue, QueueError
from proxy.threads import in_thread

log = logging.getLogger(__name__)


def event_key(event_id: str) -> tuple[int, int]:
    """Stream ids in their order (`ms-seq`, both numbers)."""
    ms, _, seq = event_id.partition("-")
    return int(ms), int(seq or 0)


class AdapterEventHub:
    def __init__(self, queue: Queue, *, block_s: float = 0.5, keep: int = 1000) -> None:
        self.queue = queue
        self.block_s = block_s
        self.keep = keep
        self.events: list[AdapterEvent] = []
        """The most recent announcements, oldest first."""
        self.floor = "0"
        """The hub holds every event after this id."""
        self.position = "0"
        """The last event id read."""
        self.ready = asyncio.Event()
        """Set once the hub has caught up with the stream's history."""
        self.error: BaseException | None = None
        self.closing = False
        """Set when the server stops: every stream ends (they never end on their own)."""
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = self._loop.create_task(self._run(), name="adapter-event-hub")

    def close(self) -> None:
        """End every event stream, each with a complete response (on the event loop)."""
        self.closing = True
        self._wake()

    def close_soon(self) -> None:
        """`close`, from a signal handler or another thread."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.close)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        try:
            while True:
                try:
                    block = self.block_s if self.ready.is_set() else 0.0
                    fresh = await in_thread(self.queue.adapter_events, self.position, 1000, block)
                except QueueError as err:  # Redis away: streams stay open and wait
                    log.warning("adapter events: %s; retrying in 1s", err)
                    await asyncio.sleep(1.0)
                    continue
                if fresh:
                    self._add(fresh)
                elif not self.ready.is_set():
                    self.ready.set()
                    self._wake()
        except asyncio.CancelledError:
            raise
        except BaseException as err:  # a bug: every stream ends with it, and it is logged
            self.error = err
            log.exception("adapter event hub died; event streams will close")
            self.ready.set()
            self._wake()
            raise

    def _add(self, fresh: list[AdapterEvent]) -> None:
        self.events.extend(fresh)
        self.position = fresh[-1].event_id
        if len(self.events) > self.keep:
            self.floor = self.events[-self.keep - 1].event_id
            del self.events[: -self.keep]
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def covers(self, after: str) -> bool:
        """Whether every event after `after` is in memory."""
        return event_key(after) >= event_key(self.floor)

    def after(self, after: str) -> list[AdapterEvent]:
        """The remembered events with ids above `after`, oldest first."""
        key = event_key(after)
        return [e for e in self.events if event_key(e.event_id) > key]

    async def wait(self, timeout_s: float) -> bool:
        """Wait for news (or the hub's death); False on timeout."""
        changed = self._changed
        try:
            await asyncio.wait_for(changed.wait(), timeout_s)
        except TimeoutError:
            return False
        return True
