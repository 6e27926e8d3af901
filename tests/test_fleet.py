"""The learner names lagging and refusing workers (`learner.fleet`)."""

from __future__ import annotations

import logging
import time

import pytest

from learner.fleet import FleetWatch, problems
from protocol import WorkerStatus


def _w(name: str, version: int, refused: int = 0, error: str | None = None) -> WorkerStatus:
    return WorkerStatus(worker=name, adapter_version=version, adapters_refused=refused, last_error=error,
                        reported_at=time.time())


def test_lagging_and_refusing_workers_are_named_with_the_reason() -> None:
    found = problems([_w("ok", 9), _w("lag", 4, refused=2, error="adapter v6 refused: rank 128 above --max-lora-rank 64"),
                      _w("refuses", 9, refused=1, error="adapter v8 refused: sha256 mismatch"), _w("edge", 6)],
                     latest_version=10, max_staleness=4)
    assert set(found) == {"lag", "refuses"}
    assert "v4, 6 versions behind v10" in found["lag"] and "--max-lora-rank 64" in found["lag"]
    assert "sha256 mismatch" in found["refuses"]


def test_each_problem_is_named_once(caplog: pytest.LogCaptureFixture) -> None:
    watch = FleetWatch()
    with caplog.at_level(logging.WARNING, logger="learner.fleet"):
        assert len(watch.update([_w("lag", 1)], 10, 4)) == 1
        assert watch.update([_w("lag", 1)], 10, 4) == []  # the same: not again
        assert len(watch.update([_w("lag", 1)], 12, 4)) == 1  # worse: again
        assert watch.update([_w("lag", 12)], 12, 4) == []  # caught up
    assert (watch.live, watch.lagging) == (1, 0)
    assert sum("worker lag runs adapter v1" in r.message for r in caplog.records) == 2
