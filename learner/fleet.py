"""The learner's view of the fleet: workers to name on its console, and why.

Only what is true is said. A worker is named as lagging when its groups were in fact
dropped as stale since the last check (with the count, and the version its status
reports), not because a status up to ten seconds old shows an older version than the
newest (the groups it then submits are often still within `max_staleness`). A worker
that refuses adapters is named with its refusals. A prompt stream nobody reads is named
only while no worker holds a lease: a worker busy with its leases (a real model's first
batch takes minutes on a CPU) is not a worker that fails.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from protocol import QueueStats, WorkerStatus
from protocol.wire.text import printable

log = logging.getLogger("learner.fleet")

STALL_S = 45.0
"""A batch or group waiting this long for its first reader means nobody reads the stream
(a live worker claims within its long-poll, a live dispatcher within a second)."""


def problems(
    workers: Sequence[WorkerStatus], stale_drops: Mapping[str, int], latest_version: int, max_staleness: int
) -> dict[str, tuple[str, str]]:
    """worker -> (kind, one line saying what is wrong with it), for the workers something
    is: `stale` (groups of it were dropped as stale since the last check: `stale_drops`,
    by actor id) or `refused` (adapters it could not load)."""
    out: dict[str, tuple[str, str]] = {}
    status = {w.worker: w for w in workers}
    for worker, dropped in stale_drops.items():
        if dropped <= 0:
            continue
        w = status.get(worker)
        if w is None:
            where = "; it has not reported its status"
        elif w.adapter_version >= latest_version:  # its groups were old when read; it has loaded the latest since
            where = f"; it has caught up since (it reports v{w.adapter_version}, the latest)"
        else:
            where = f"; it reports adapter v{w.adapter_version} against v{latest_version}"
        why = f"; its last error: {printable(w.last_error, 300)}" if w is not None and w.last_error else ""
        out[printable(worker, 256)] = (
            "stale",
            f"had {dropped} group(s) dropped as stale (more than max_staleness "
            f"{max_staleness} versions old){where}{why}",
        )
    for w in workers:
        name = printable(w.worker, 256)
        if w.adapters_refused and name not in out:
            why = f"; its last error: {printable(w.last_error, 300)}" if w.last_error else ""
            out[name] = ("refused", f"refused {w.adapters_refused} adapter version(s){why}")
    return out


def stalls(
    stats: QueueStats, run: str, live_workers: int, stall_s: float = STALL_S, busy_leases: int = 0
) -> dict[str, str]:
    """stream -> one line saying who is missing, for the streams nobody reads. Batches that
    wait while workers hold `busy_leases` leases wait for busy workers, not missing ones."""
    out = {}
    oldest = stats.prompts.oldest_waiting_s
    if oldest is not None and oldest > stall_s and busy_leases == 0:
        out["prompts"] = (
            f"no rollout worker has claimed a batch for {oldest:.0f}s ({stats.prompts.waiting} waiting, "
            f"{live_workers} worker(s) reporting on run {run!r}): start `actors run --run {run} ...` "
            "(the same --run as this learner), or see why they fail: `actors check` with their flags"
        )
    oldest = stats.unscored.oldest_waiting_s if stats.unscored is not None else None
    if oldest is not None and oldest > stall_s:
        out["unscored"] = (
            f"{stats.unscored.waiting} group(s) have waited {oldest:.0f}s for the trusted scoring tier and no "  # type: ignore[union-attr]
            f"scoring worker has read them: start `learner score --queue <this run's Redis> --run {run} "
            "--model <the learner's --model> --reward <the learner's --reward>` (or `learner score --config "
            "<the learner's config file>`), or run the learner with --scoring actors"
        )
    return out


class FleetWatch:
    """Names each worker with a problem once (and again when the problem changes)."""

    def __init__(self) -> None:
        self.named: dict[str, str] = {}
        self.stalled: dict[str, str] = {}
        self.live = 0
        self.lagging = 0
        self.share: float | None = None
        """The fraction of its reporting workers' sequences this run got lately: 1 where they
        serve it alone, less on a fleet shared with other runs (None: no worker reports)."""

    MAX_NAMED = 5
    """Workers named per check at most; the rest are counted in one line (a flood of
    statuses must not become a flood of log lines)."""

    def update(
        self,
        workers: Sequence[WorkerStatus],
        latest_version: int,
        max_staleness: int,
        stale_drops: Mapping[str, int] | None = None,
    ) -> list[str]:
        """Name the workers with a problem: each once, and again when its kind changes.
        `stale_drops`: groups dropped as stale since the last update, by actor id."""
        found = problems(workers, stale_drops or {}, latest_version, max_staleness)
        self.live, self.lagging = len(workers), sum(1 for kind, _ in found.values() if kind == "stale")
        shares = [1.0 if w.share is None else w.share for w in workers]
        self.share = sum(shares) / len(shares) if shares else None
        kinds = {name: kind for name, (kind, _) in found.items()}
        new = [f"worker {name} {why}" for name, (kind, why) in sorted(found.items()) if self.named.get(name) != kind]
        lines = new[: self.MAX_NAMED]
        if len(new) > self.MAX_NAMED:
            lines.append(
                f"... and {len(new) - self.MAX_NAMED} more worker(s) with a problem (GET /v1/workers lists them)"
            )
        for line in lines:
            log.warning("%s", line)
        self.named = kinds
        return lines

    def update_streams(self, stats: QueueStats, run: str, busy_leases: int = 0) -> list[str]:
        """Name each stream nobody reads, once per stall (the figures in the line change
        as it goes on; the stall is named again only after it has ended)."""
        found = stalls(stats, run, self.live, busy_leases=busy_leases)
        lines = [why for stream, why in sorted(found.items()) if stream not in self.stalled]
        for line in lines:
            log.warning("%s", line)
        self.stalled = found
        return lines
