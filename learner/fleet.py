"""The learner's view of the fleet: workers to name on its console, and why.

Workers report their status on the queue (`WorkerStatus`: the adapter version loaded,
the adapters they refused, their last error). A worker that runs a version more than
`max_staleness` behind generates only groups that will be dropped as stale, and one that
keeps refusing adapters will soon be there: the user hears of both here, by worker name,
instead of seeing only starvation.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from protocol import QueueStats, WorkerStatus
from protocol.text import printable

log = logging.getLogger("learner.fleet")

STALL_S = 45.0
"""A batch or group waiting this long for its first reader means nobody reads the stream
(a live worker claims within its long-poll, a live dispatcher within a second)."""


def problems(workers: Sequence[WorkerStatus], latest_version: int, max_staleness: int) -> dict[str, str]:
    """worker -> one line saying what is wrong with it, for the workers something is."""
    out = {}
    for w in workers:
        behind = latest_version - w.adapter_version
        why = f"; its last error: {printable(w.last_error, 300)}" if w.last_error else ""
        if behind > max_staleness:
            out[printable(w.worker, 256)] = (f"runs adapter v{w.adapter_version}, {behind} versions behind v{latest_version} "
                             f"(max_staleness {max_staleness}): its groups are dropped as stale{why}")
        elif w.adapters_refused:
            out[printable(w.worker, 256)] = f"refused {w.adapters_refused} adapter version(s){why}"
    return out


def stalls(stats: QueueStats, run: str, live_workers: int, stall_s: float = STALL_S) -> dict[str, str]:
    """stream -> one line saying who is missing, for the streams nobody reads."""
    out = {}
    oldest = stats.prompts.oldest_waiting_s
    if oldest is not None and oldest > stall_s:
        out["prompts"] = (
            f"no rollout worker has claimed a batch for {oldest:.0f}s ({stats.prompts.waiting} waiting, "
            f"{live_workers} worker(s) reporting on run {run!r}): start `actors run --run {run} ...` "
            "(the same --run as this learner), or see why they fail: `actors check` with their flags"
        )
    oldest = stats.unscored.oldest_waiting_s if stats.unscored is not None else None
    if oldest is not None and oldest > stall_s:
        out["unscored"] = (
            f"{stats.unscored.waiting} group(s) have waited {oldest:.0f}s for the trusted scoring tier and no "  # type: ignore[union-attr]
            f"scoring worker has read them: start `actors score --redis <this run's Redis> --run {run} "
            "--reward <the learner's --reward>`, or run the learner with --scoring actors"
        )
    return out


class FleetWatch:
    """Names each worker with a problem once (and again when the problem changes)."""

    def __init__(self) -> None:
        self.named: dict[str, str] = {}
        self.stalled: dict[str, str] = {}
        self.live = 0
        self.lagging = 0

    MAX_NAMED = 5
    """Workers named per check at most; the rest are counted in one line (a flood of
    statuses must not become a flood of log lines)."""

    def update(self, workers: Sequence[WorkerStatus], latest_version: int, max_staleness: int) -> list[str]:
        found = problems(workers, latest_version, max_staleness)
        self.live, self.lagging = len(workers), len(found)
        new = [f"worker {name} {why}" for name, why in sorted(found.items()) if self.named.get(name) != why]
        lines = new[: self.MAX_NAMED]
        if len(new) > self.MAX_NAMED:
            lines.append(f"... and {len(new) - self.MAX_NAMED} more worker(s) with a problem (GET /v1/workers lists them)")
        for line in lines:
            log.warning("%s", line)
        self.named = found
        return lines

    def update_streams(self, stats: QueueStats, run: str) -> list[str]:
        """Name each stream nobody reads, once per stall (the figures in the line change
        as it goes on; the stall is named again only after it has ended)."""
        found = stalls(stats, run, self.live)
        lines = [why for stream, why in sorted(found.items()) if stream not in self.stalled]
        for line in lines:
            log.warning("%s", line)
        self.stalled = found
        return lines
