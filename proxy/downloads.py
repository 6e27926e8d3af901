"""What the proxy answers for an adapter version's download, made once per version.

A version names one adapter forever, so its manifest never changes; every worker of a
fleet asks for the newest version within a second of its announcement. Without this, a
publish cost one store read of the manifest and one presigning per file for every
worker (1,000 reads of the same object per publish at 1,000 workers, through a store
client pool of 10 connections). Here the first request for a version reads and presigns,
the requests arriving meanwhile wait for it (one store read however many ask at once),
and the answer is served until half its URLs' lifetime has passed, so that every URL
handed out stays valid for at least `presign_s / 2`. A missing version is not kept: it
may be published a moment later.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from protocol.client.http import AdapterDownload

KEEP_VERSIONS = 16
"""Versions whose answer is kept (workers ask for the newest few)."""


class DownloadCache:
    def __init__(self, make: Callable[[int], AdapterDownload], presign_s: float, keep: int = KEEP_VERSIONS) -> None:
        """`make(version)`: read the manifest and presign its files (raises if missing)."""
        self.make, self.fresh_s, self.keep = make, presign_s / 2, keep
        self._answers: OrderedDict[int, tuple[AdapterDownload, float]] = OrderedDict()
        self._locks: dict[int, threading.Lock] = {}
        self._lock = threading.Lock()

    def get(self, version: int) -> AdapterDownload:
        answer = self._fresh(version)
        if answer is not None:
            return answer
        with self._lock:
            lock = self._locks.setdefault(version, threading.Lock())
        with lock:  # one maker per version; the others wait for its answer
            answer = self._fresh(version)
            if answer is not None:
                return answer
            answer = self.make(version)
            with self._lock:
                self._answers[version] = (answer, time.monotonic())
                self._answers.move_to_end(version)
                while len(self._answers) > self.keep:
                    old, _ = self._answers.popitem(last=False)
                    self._locks.pop(old, None)
            return answer

    def _fresh(self, version: int) -> AdapterDownload | None:
        with self._lock:
            kept = self._answers.get(version)
        if kept is not None and time.monotonic() - kept[1] < self.fresh_s:
            return kept[0]
        return None
