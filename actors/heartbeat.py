"""A worker's heartbeat: every lease in flight kept alive with one call per interval, and
the worker's status reported for the fleet view, from a thread of its own (`actors.worker`)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from protocol import Queue, QueueError, WorkerStatus

log = logging.getLogger(__name__)


def heartbeat_period_s(lease_timeout_s: float) -> float:
    """A third of the lease timeout (two beats may be lost), and no faster than twice a second."""
    return max(0.5, lease_timeout_s / 3)


class Heartbeat:
    """Keeps every lease in flight alive with one call per interval, from a thread."""

    def __init__(
        self,
        queue: Queue,
        worker: str,
        interval_s: float,
        status: Callable[[], WorkerStatus] | None = None,
        report_every_s: float = 10.0,
    ) -> None:
        """`status`: this worker's status, reported every `report_every_s` (the fleet view)."""
        self.queue, self.worker, self.interval_s = queue, worker, interval_s
        self.status, self.report_every_s = status, report_every_s
        self._reported_at = 0.0
        self.lease_ids: set[str] = set()
        self.lost: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def hold(self, lease_id: str) -> None:
        with self._lock:
            self.lease_ids.add(lease_id)

    def drop(self, lease_id: str) -> None:
        with self._lock:
            self.lease_ids.discard(lease_id)

    def take_lost(self) -> set[str]:
        with self._lock:
            lost, self.lost = self.lost, set()
            return lost

    def report(self) -> None:
        """Report the worker's status now (errors are logged: the fleet view can wait)."""
        if self.status is None:
            return
        self._reported_at = time.monotonic()
        try:
            self.queue.report_status(self.status())
        except QueueError as err:
            log.warning("status report failed (will retry): %s", err)

    def _run(self) -> None:
        beat_at = time.monotonic()
        tick = min(self.interval_s, self.report_every_s) if self.status is not None else self.interval_s
        while not self._stop.wait(tick):
            if self.status is not None and time.monotonic() - self._reported_at >= self.report_every_s:
                self.report()
            if time.monotonic() - beat_at < self.interval_s - 1e-3:
                continue
            beat_at = time.monotonic()
            with self._lock:
                ids = sorted(self.lease_ids)
            if not ids:
                continue
            try:
                held = set(self.queue.heartbeat(self.worker, ids))
            except QueueError as err:  # the work loop meets the same error and decides
                log.warning("heartbeat failed (will retry): %s", err)
                continue
            with self._lock:
                gone = (set(ids) - held) & self.lease_ids
                self.lost |= gone
                self.lease_ids -= gone
