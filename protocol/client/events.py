"""Adapter announcements from the proxy's event stream (server-sent events), on the same
urllib3 connections as the API's calls."""

from __future__ import annotations

import base64
import contextlib
import logging
import queue as stdqueue
import threading
from collections.abc import Callable, Iterable, Iterator

import urllib3
import urllib3.exceptions

from protocol.client.queue import AdapterSubscription
from protocol.client.transport import tls_failure
from protocol.util.retry import Backoff
from protocol.wire.codec import decode
from protocol.wire.errors import ProtocolError, QueueError
from protocol.wire.messages import AdapterManifest

log = logging.getLogger(__name__)

READ_TIMEOUT_S = 60.0
"""A stream quiet for this long is opened again (the proxy sends keep-alives more often)."""


class SseSubscription(AdapterSubscription):
    """Adapter announcements from the proxy's event stream, read by a background thread
    that reconnects with Last-Event-ID, so a dropped connection loses nothing. `open`: the
    stream's request, given the headers (`HttpQueue` sends it on its pool, with its token)."""

    def __init__(self, open_stream: Callable[[dict[str, str]], urllib3.BaseHTTPResponse]) -> None:
        self.open_stream = open_stream
        self.last_event_id: str | None = None
        self._open = False
        self._items: stdqueue.Queue[AdapterManifest] = stdqueue.Queue(maxsize=1000)
        self._stop = threading.Event()
        self._response: urllib3.BaseHTTPResponse | None = None
        self._thread = threading.Thread(target=self._run, name="adapter-events", daemon=True)
        self._thread.start()

    def get(self, timeout_s: float) -> AdapterManifest | None:
        try:
            return self._items.get(timeout=timeout_s)
        except stdqueue.Empty:
            return None

    @property
    def gapless(self) -> bool:
        """While the stream is open: a reconnection resumes from the last event id (and
        what was announced before the first connection is the watcher's first sync)."""
        return self._open

    def close(self) -> None:
        """Stop reading: a read blocked on a quiet stream is woken (urllib3's `shutdown`),
        and the thread ends."""
        self._stop.set()
        response = self._response
        if response is not None:
            with contextlib.suppress(Exception):
                response.shutdown()
        self._thread.join(timeout=1.0)

    def _run(self) -> None:
        backoff = Backoff(0.25, 5.0)
        while not self._stop.is_set():
            headers = {"Accept": "text/event-stream"}
            if self.last_event_id is not None:
                headers["Last-Event-ID"] = self.last_event_id
            try:
                if not self._read(self.open_stream(headers), backoff):
                    return  # refused for good
            except (urllib3.exceptions.HTTPError, OSError, QueueError, ProtocolError, ValueError) as err:
                self._open = False
                if self._stop.is_set():
                    return
                if tls_failure(err) is not None:
                    log.error("adapter events: the proxy's certificate does not verify; not retrying")
                    return
                log.debug("adapter events: %s; reconnecting in %.2fs", err, backoff.next)
            backoff.wait(self._stop)

    def _read(self, r: urllib3.BaseHTTPResponse, backoff: Backoff) -> bool:
        """Read one connection's events until it ends; False: the token is refused, or a
        stop was asked for (no reconnection)."""
        self._response = r
        try:
            if self._stop.is_set():
                return False
            if r.status in (401, 403):
                log.error("adapter events: the proxy refused the token (HTTP %d); not retrying", r.status)
                return False
            if r.status != 200:
                raise QueueError(f"events: HTTP {r.status}")
            backoff.reset()
            self._open = True
            for event_id, data in sse_events(line.decode("utf-8").rstrip("\r\n") for line in r):
                manifest = decode(base64.b64decode(data))
                if isinstance(manifest, AdapterManifest):
                    self._items.put(manifest)
                self.last_event_id = event_id
            self._open = False
            return True
        finally:  # never reused half read: closed, and its slot given back to the pool
            with contextlib.suppress(Exception):
                r.close()
                r.release_conn()


def sse_events(lines: Iterable[str]) -> Iterator[tuple[str, str]]:
    """(id, data) of each event in a text/event-stream (comments and blank keep-alives skipped)."""
    event_id, data = "", list[str]()
    for line in lines:
        if not line:
            if data:
                yield event_id, "".join(data)
            event_id, data = "", []
        elif line.startswith(":"):
            continue
        elif line.startswith("id:"):
            event_id = line[3:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].strip())
