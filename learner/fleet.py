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

from protocol import WorkerStatus

log = logging.getLogger("learner.fleet")


def problems(workers: Sequence[WorkerStatus], latest_version: int, max_staleness: int) -> dict[str, str]:
    """worker -> one line saying what is wrong with it, for the workers something is."""
    out = {}
    for w in workers:
        behind = latest_version - w.adapter_version
        why = f"; its last error: {w.last_error}" if w.last_error else ""
        if behind > max_staleness:
            out[w.worker] = (f"runs adapter v{w.adapter_version}, {behind} versions behind v{latest_version} "
                             f"(max_staleness {max_staleness}): its groups are dropped as stale{why}")
        elif w.adapters_refused:
            out[w.worker] = f"refused {w.adapters_refused} adapter version(s){why}"
    return out


class FleetWatch:
    """Names each worker with a problem once (and again when the problem changes)."""

    def __init__(self) -> None:
        self.named: dict[str, str] = {}
        self.live = 0
        self.lagging = 0

    def update(self, workers: Sequence[WorkerStatus], latest_version: int, max_staleness: int) -> list[str]:
        found = problems(workers, latest_version, max_staleness)
        self.live, self.lagging = len(workers), len(found)
        lines = [f"worker {name} {why}" for name, why in sorted(found.items()) if self.named.get(name) != why]
        for line in lines:
            log.warning("%s", line)
        self.named = found
        return lines
