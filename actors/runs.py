"""One worker, several runs: one engine holding one base model, each run its own adapters,
queue, watcher and heartbeat (`actors.worker`).

A run's adapter versions are its own numbers (run A's v3 is not run B's v3), while the
engine knows an adapter by one integer. `AdapterSlots` gives each (run, version) an
engine-wide number once and for ever (so a version evicted and wanted again, by an
evaluation pinned to it, gets its old number back), and `RunEngine` is one run's view of
the engine in the run's own numbers: its watcher loads and evicts through it, its groups
are queued through it. The base model, version 0, is every run's.

Claims spread across runs by a weighted fair share (`claim_order`): the run whose
sequences claimed, over its weight, is lowest claims next. What each run claimed decays
with a half-life (`SHARE_HALF_LIFE_S`), so a run that joins late gets its share within
seconds and cannot starve the others while it catches up on what they had before; a
run with no backlog costs one empty non-blocking claim every half second, and none
while the worker has other work. A run's optional cap is the most of this worker's
sequences it may hold at once, even when no other run wants them.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from actors.engine import Engine, GroupRequest, Sample
from protocol import Queue, QueueError, QueueUnavailable
from protocol.util.retry import Backoff

if TYPE_CHECKING:
    from actors.heartbeat import Heartbeat
    from actors.watcher import AdapterWatcher

log = logging.getLogger(__name__)

SHARE_HALF_LIFE_S = 20.0
"""How long a claimed sequence counts fully against its run's share, halving after."""
RUN_RETRY_S = 2.0
"""Serving several runs: how long one call of a run retries an outage (or a full backlog)
before the run backs off on its own (`RunLink.back_at`)."""
EMPTY_PAUSE_S = 0.5
"""After an empty non-blocking claim, the run is not asked again for this long."""


class AdapterSlots:
    """The engine's number of each (run, version), given once and kept (0 is the base),
    counting from `first` (an engine that held versions by their own numbers before)."""

    def __init__(self, first: int = 1) -> None:
        self._slots: dict[tuple[str, int], int] = {}
        self._owner: dict[int, tuple[str, int]] = {}
        self._next = itertools.count(first)
        self._lock = threading.Lock()

    def slot(self, run: str, version: int) -> int:
        if version == 0:
            return 0
        with self._lock:
            if (run, version) not in self._slots:
                number = next(self._next)
                self._slots[(run, version)] = number
                self._owner[number] = (run, version)
            return self._slots[(run, version)]

    def owner(self, slot: int) -> tuple[str, int] | None:
        with self._lock:
            return self._owner.get(slot)


class RunEngine(Engine):
    """One run's view of a shared engine, in the run's own adapter versions. It loads,
    evicts, lists and queues; stepping, decoding and closing are the shared engine's
    (the worker drives it once for every run)."""

    def __init__(self, base: Engine, run: str, slots: AdapterSlots) -> None:
        self.base, self.run, self.slots = base, run, slots
        self.max_num_seqs, self.tokenizer = base.max_num_seqs, base.tokenizer
        self.context, self.stop_ids = base.context, base.stop_ids

    def load_adapter(self, version: int, path: Path) -> None:
        self.base.load_adapter(self.slots.slot(self.run, version), path)

    def evict_adapter(self, version: int, on_released: Callable[[], None] | None = None) -> None:
        self.base.evict_adapter(self.slots.slot(self.run, version), on_released)

    def loaded_versions(self) -> list[int]:
        owners = (self.slots.owner(slot) for slot in self.base.loaded_versions())
        return [owner[1] for owner in owners if owner is not None and owner[0] == self.run]

    def newest_version(self) -> int:
        """The engine's number of the run's newest version (a following group's `follow`)."""
        return self.slots.slot(self.run, max(self.loaded_versions(), default=0))

    def add(self, groups: Sequence[GroupRequest]) -> None:
        self.base.add([replace(g, version=self.slots.slot(self.run, g.version)) for g in groups])

    def own(self, samples: list[Sample]) -> list[Sample]:
        """Samples the shared engine made for this run, their versions in the run's numbers."""
        return [s if s.versions is None else replace(s, versions=self._own(s.versions)) for s in samples]

    def _own(self, slots: list[int]) -> list[int]:
        owners = {slot: self.slots.owner(slot) for slot in set(slots)}
        return [owner[1] if (owner := owners[slot]) is not None else 0 for slot in slots]

    def step(self, timeout_s: float, abort: threading.Event | None = None) -> list[tuple[Hashable, list[Sample]]]:
        return self.base.step(timeout_s, abort)

    @property
    def in_flight(self) -> int:
        return self.base.in_flight

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.base.decode(token_ids)

    @property
    def vocab_size(self) -> int:
        return self.base.vocab_size


@dataclass
class RunLink:
    """What a worker holds of one run: its queue, its adapters and its share of the engine."""

    run: str
    queue: Queue
    watcher: AdapterWatcher
    engine: Engine
    """Where the run's groups are queued: its `RunEngine` (the shared engine itself when
    the worker serves one run)."""
    weight: float = 1.0
    cap: float | None = None
    """The most of the worker's sequences the run may hold at once, a fraction of its
    `max_num_seqs` (None: no cap)."""
    in_flight: int = 0
    """Sequences of the run's leases in flight on this worker."""
    heartbeat: Heartbeat | None = None
    served: float = 0.0
    """Sequences claimed, decayed to `served_at` (`SHARE_HALF_LIFE_S`)."""
    served_at: float = field(default_factory=time.monotonic)
    empty_until: float = 0.0
    """After an empty claim: not asked again before this time."""
    lease_size: int | None = None
    """Sequences in the run's last lease: the room a claim needs (None: unknown, claim one)."""
    over: str | None = None
    """The run's learner finished it (`RunOver`): no more claims."""
    back_at: float = 0.0
    """While the run's queue is unavailable (an outage, or the run's backlog full: 503),
    none of its calls before this time; the other runs' go on."""
    backoff: Backoff = field(default_factory=lambda: Backoff(0.5, 30.0))
    tokens_generated: int = 0
    groups_submitted: int = 0
    rate_mark: tuple[float, int] = field(default_factory=lambda: (time.monotonic(), 0))

    def used(self, now: float) -> float:
        """Sequences claimed, decayed to `now`."""
        return float(self.served * 0.5 ** (max(0.0, now - self.served_at) / SHARE_HALF_LIFE_S))

    def claimed(self, sequences: int, now: float) -> None:
        self.served, self.served_at = self.used(now) + sequences, now


def shares(links: Sequence[RunLink], now: float) -> dict[str, float]:
    """Each run's fraction of the sequences the worker claimed lately (0 before any)."""
    used = {link.run: link.used(now) for link in links}
    total = sum(used.values())
    return {run: (u / total if total > 0 else 0.0) for run, u in used.items()}


def _under_cap(link: RunLink, max_num_seqs: int) -> bool:
    if link.cap is None or not link.in_flight:
        return True
    return link.in_flight + (link.lease_size or 1) <= link.cap * max_num_seqs


def claim_order(links: Sequence[RunLink], now: float, max_num_seqs: int) -> list[RunLink]:
    """The runs that may claim now, the furthest below its weighted share first: not
    over, not paused after an empty claim or an unavailable queue, not at its cap (a run
    holds one lease at least, whatever its cap)."""
    live = [
        link
        for link in links
        if link.over is None and now >= max(link.empty_until, link.back_at) and _under_cap(link, max_num_seqs)
    ]
    return sorted(live, key=lambda link: (link.used(now) / link.weight, link.run))


class RunOpener:
    """Opens the runs a worker serves on one engine: each its queue (the same proxy and
    connections, `HttpQueue.for_run`), its `RunEngine`, and its adapter watcher, synced
    and started, with its adapters in a folder of its own."""

    def __init__(
        self,
        queue: Queue,
        engine: Engine,
        watcher_for: Callable[[Queue, Engine, Path], AdapterWatcher],
        cache_dir: Path,
    ) -> None:
        self.queue, self.engine, self.watcher_for, self.cache_dir = queue, engine, watcher_for, cache_dir
        self.slots = AdapterSlots()
        self.links: list[RunLink] = []

    def open(self, run: str) -> RunLink:
        queue: Any = self.queue if run == self.queue.config.run else self.queue.for_run(run)  # type: ignore[attr-defined]
        # a call refused for a while (the run's backlog full: 503) gives up soon, so that it
        # holds up the other runs' calls no longer than this; the run's own backoff retries
        queue.retry_s = min(queue.retry_s, RUN_RETRY_S)
        view = RunEngine(self.engine, run, self.slots)
        watcher = self.watcher_for(queue, view, self.cache_dir / run)
        try:
            watcher.sync()  # start on the run's newest adapter rather than the base model
        except QueueError as err:
            log.warning("run %s: no adapter announcements yet (%s); its watcher keeps trying", run, err)
        watcher.start()
        link = RunLink(run, queue, watcher, view)
        self.links.append(link)
        return link

    def new_runs(self, serving: set[str]) -> list[RunLink]:
        """Links to the runs the token may touch now that are not in `serving`."""
        try:
            runs = self.queue.whoami().runs  # type: ignore[attr-defined]
        except QueueUnavailable as err:  # a refusal (a token revoked) is the worker's to meet
            log.warning("could not ask the proxy for the token's runs (asking again later): %s", err)
            return []
        return [self.open(run) for run in sorted(set(runs) - serving)]

    def close(self) -> None:
        for link in self.links:
            link.watcher.close()
            if link.queue is not self.queue:
                link.queue.close()


def serving_runs(queue: Any, run: str | None) -> tuple[list[str], list[str]]:
    """The runs a worker serves: `run` when given; else every run its token may touch now
    (the proxy's answer), and the token's run patterns, whose runs are served as their
    learners start them (a proxy that says neither: the queue's run)."""
    if run is not None or not hasattr(queue, "whoami"):
        return [run or queue.config.run], []
    who = queue.whoami()
    return sorted(who.runs) or ([] if who.patterns else [queue.config.run]), list(who.patterns)


def our_fingerprint(model: str) -> str | None:
    """The base model's fingerprint, against which each batch's is checked (None, with a
    warning, where it cannot be computed: batches are then taken on trust)."""
    from protocol import fingerprint_of_model

    try:
        return fingerprint_of_model(model)
    except (OSError, ValueError) as err:
        log.warning("%s: no fingerprint (%s); batches for another base model will not be noticed", model, err)
        return None
