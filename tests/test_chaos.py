"""The chaos soak (bench/chaos.py) for two minutes: the distributed system under SIGKILLs
and SIGTERMs of every kind of process keeps its ledger exact."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.redis
@pytest.mark.s3
@pytest.mark.timeout(900)
def test_two_minutes_of_chaos_keep_the_ledger_exact(tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    run = subprocess.run(
        [
            sys.executable,
            "bench/chaos.py",
            "--minutes",
            "2",
            "--mean-interval-s",
            "8",
            "--seed",
            "0",
            "--self-test",
            "--json",
            str(out),
            "--keep",
            str(tmp_path / "work"),
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=840,
    )
    assert out.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures["problems"] == [] and figures["exact"], figures
    assert run.returncode == 0, run.stderr[-3000:]
    # every kind of fault happened, and nothing died that was not killed on purpose
    kinds = (
        "actor_sigkill",
        "actor_sigterm",
        "proxy_sigkill",
        "redis_sigkill",
        "redis_failover",
        "scorer_sigkill",
        "learner_sigkill",
    )
    assert all(figures["faults"].get(kind, 0) >= 1 for kind in kinds), figures["faults"]
    assert figures["unexpected_exits"] == {}, figures["unexpected_exits"]
    assert figures["learner_starts"] >= 2 and figures["actors_started"] > 3
    # training went on after the last fault, and every issued prompt is accounted for
    assert figures["recovered"] and figures["steps"] >= figures["steps_at_last_fault"] + 4
    accounted = (
        figures["trained"]
        + sum(figures["dropped"].values())
        + figures["dead_lettered"]
        + figures["in_queue"]
        + figures["waiting_batches"]
    )
    assert accounted == figures["issued_prompts"] > 0
    # a version a step (a failover loses some announcements, never their numbers)
    assert figures["last_version"] >= figures["steps"] and figures["versions_announced"] > 0
    # with active sampling's revisits (the learner chose what each batch held)
    assert figures["batches_issued"]["t"] >= 1, figures["batches_issued"]
    # and the ledger is not a rubber stamp: breaches planted in a copy are each caught
    assert figures["self_test_caught"] == {
        "trained_twice": True,
        "group_lost": True,
        "step_repeated": True,
        "issued_otherwise": True,
        "issued_unnamed": True,
    }
