"""Admission: prompts in flight narrowed while what arrives is at or past the staleness
bound, widened again while the learner waits (`learner.admission`)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from rollouts import SyntheticActor
from test_learner import fake_queue_factory, metrics, small_config

from learner.admission import Admission
from learner.loop import Learner
from learner.trainer import Trainer
from protocol.trusted.store import open_store


def test_the_window_moves_with_the_staleness_of_what_arrives() -> None:
    a = Admission(ceiling=32, floor=4, lease=2, max_staleness=4)
    assert a.limit == 4  # one step's groups, before anything is measured
    a.update([0], 0, waited_frac=0.9)
    assert a.limit == 8  # the learner waited, what arrived is fresh: doubled
    a.update([1, 2], 0, waited_frac=0.05)
    assert a.limit == 8  # the learner hardly waited: held
    a.update([1, 2], 0, waited_frac=0.5)
    assert a.limit == 16
    a.update([1, 2, 3], 0, waited_frac=0.9)
    assert a.limit == 16  # waiting, but what arrives is near the bound: held
    a.update([2], 0, waited_frac=0.9)
    assert a.limit == 32
    a.update([1], 0, waited_frac=0.9)
    assert a.limit == 32  # max_inflight at most
    a.update([4, 2], 0, waited_frac=0.0)
    assert a.limit == 30 and not a.slow_start  # a group at the bound: a lease less, and no more doubling
    a.update([2], 3, waited_frac=0.0)
    assert a.limit == 15  # groups dropped as stale: halved
    for _ in range(5):
        a.update([1], 1, waited_frac=0.0)
    assert a.limit == 4  # never below one step's groups
    a.update([2], 0, waited_frac=0.5)
    assert a.limit == 6  # waiting with room under the bound: a quarter more, at least a lease (no doubling)
    a.update([2], 0, waited_frac=0.5)
    assert a.limit == 8
    wide = Admission(ceiling=8192, floor=64, lease=4, max_staleness=4)
    wide.update([4], 0, waited_frac=0.0)  # slow start over
    steps = 0
    while wide.limit < 4000:  # a fleet of 1,000 workers, 4 prompts a lease
        wide.update([1], 0, waited_frac=0.8)
        steps += 1
    assert steps <= 20  # a lease a step would take 984
    for _ in range(40):
        a.update([1, 2], 0, waited_frac=0.5)
    assert a.limit == 32
    a.update([1], 0, waited_frac=0.0)
    assert a.limit == 32  # the learner did not wait, but what it trained was fresh: held
    a.update([1, 2], 0, waited_frac=0.01)
    assert a.limit == 30  # it did not wait and what it trained had aged two versions: a lease less
    fixed = Admission(ceiling=32, floor=4, lease=2, max_staleness=4, adaptive=False)
    assert fixed.limit == 32
    fixed.update([9], 5, waited_frac=0.0)
    assert fixed.limit == 32


def spread(_prompt: list[int], tokens: list[int], _text: str) -> float:
    """A reward that differs between completions: no group is dropped as flat, so every
    prompt in flight is one a step must consume."""
    return sum(tokens) % 11 / 10


@pytest.mark.slow
def test_a_fleet_faster_than_the_learner_stops_generating_what_goes_stale(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An actor that answers every lease at once and a learner that takes its time (a
    real model's step, here a tiny one's and a sleep): with 32 prompts in flight and 4 a
    step, what waits in the queue ages past a bound of 1 versions and is thrown away;
    admission narrows the window until it is not."""
    step = Trainer.step

    def slow_step(self: Trainer, batch: Any) -> Any:
        time.sleep(0.4)
        return step(self, batch)

    monkeypatch.setattr(Trainer, "step", slow_step)
    drops, rows = {}, {}
    for adaptive in (False, True):
        (tmp_path / str(adaptive)).mkdir()
        cfg = small_config(
            tmp_path / str(adaptive),
            tiny_model,
            run=f"adm-{adaptive}",
            steps=24,
            groups_per_step=4,
            prompts_per_batch=2,
            max_inflight=32,
            max_staleness=1,
            adaptive_inflight=adaptive,
            checkpoint_every=100,
        )
        make = fake_queue_factory(f"adm-{adaptive}")
        store = open_store(cfg.store)
        actor = SyntheticActor(make(), store, tiny_model, spread).start()
        state = Learner(cfg, make(), store).run()
        actor.close()
        assert state.step == 24
        drops[adaptive] = state.totals.get("dropped_stale", 0)
        rows[adaptive] = metrics(cfg.resolved_run_dir)
    late = {k: sum(r["dropped_stale"] for r in v[-8:]) for k, v in rows.items()}
    assert drops[False] >= 20 and late[False] >= 5, (drops, late)  # thrown away all along
    # the window opens at one step's groups: what goes stale now is the odd group generated
    # before its actor had the newest adapter (a bound of 1 leaves no room for that)
    assert drops[True] * 4 <= drops[False] and late[True] * 5 <= late[False], (drops, late)
    assert min(r["inflight_limit"] for r in rows[True]) == 4 and {r["inflight_limit"] for r in rows[False]} == {32}


def test_a_lease_larger_than_a_step_is_still_issued(tmp_path: Path, tiny_model: Path) -> None:
    """2 groups a step in leases of 4 prompts (the default lease): the window opens at a
    whole lease, not at one step's 2 prompts, under which no batch could ever be issued
    and learner and actors waited on each other for ever."""
    cfg = small_config(
        tmp_path, tiny_model, run="adm-lease", steps=3, groups_per_step=2, prompts_per_batch=4, max_inflight=8
    )
    make = fake_queue_factory("adm-lease")
    store = open_store(cfg.store)
    actor = SyntheticActor(make(), store, tiny_model, spread).start()
    try:
        state = Learner(cfg, make(), store).run()
    finally:
        actor.close()
    assert state.step == 3
    assert min(r["inflight_limit"] for r in metrics(cfg.resolved_run_dir)) >= 4
