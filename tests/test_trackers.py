"""Trackers, each in its offline or local mode, as a user runs them: `learner run
--report-to tensorboard wandb trackio mlflow` against a real Redis, with a synthetic
actor closing the loop; then the files each library wrote are read back."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from factories import write_dataset
from rollouts import SyntheticActor

from learner.config import ConfigError
from learner.load_config import load_config
from learner.trackers import TrackerError, check_trackers
from protocol import QueueConfig
from protocol.trusted import RedisQueue, open_store

REPO = Path(__file__).resolve().parents[1]

TRL_NAMES = {
    "train/reward",
    "train/reward_std",
    "train/kl",
    "train/entropy",
    "train/clip_ratio/region_mean",
    "train/completions/mean_length",
    "train/completions/clipped_ratio",
    "train/frac_reward_zero_std",
    "train/num_tokens",
    "train/loss",
    "train/grad_norm",
    "train/learning_rate",
    "train/sampling/importance_sampling_ratio/mean",
    "train/staleness_mean",
}
"""TRL's GRPOTrainer names that dashboards look for, and one of spotgrpo's beside them."""


def test_report_to_is_read_as_trl_writes_it() -> None:
    assert load_config(None, {"report_to": "wandb,mlflow"}).report_to == ["wandb", "mlflow"]
    assert load_config(None, {"report_to": "none"}).trackers == ["none"]
    assert load_config(None, {"tensorboard": False}).trackers == []
    with pytest.raises(TrackerError, match="unknown tracker 'comet'"):
        check_trackers(["comet"])
    with pytest.raises(ConfigError, match="report_to"):
        load_config(None, {"report_to": 3})


@pytest.mark.slow
@pytest.mark.redis
def test_every_tracker_writes_its_files(tmp_path: Path, tiny_model: Path, redis_server, run_name: str) -> None:
    store = open_store((tmp_path / "store").as_uri())
    actor_queue = RedisQueue.from_url(redis_server.url, QueueConfig(run=run_name))
    actor = SyntheticActor(
        actor_queue, store, tiny_model, lambda _p, _t, text: 1.0 if text[:1].isdigit() else 0.0
    ).start()
    run_dir = tmp_path / "run"
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(tmp_path / "wandb"),
        "WANDB_SILENT": "true",
        "TRACKIO_DIR": str(tmp_path / "trackio"),
        "HF_HUB_OFFLINE": "1",
    }
    (tmp_path / "wandb").mkdir()
    cmd = [
        sys.executable,
        "-m",
        "learner.cli",
        "run",
        "--run",
        run_name,
        "--queue",
        redis_server.url,
        "--store",
        store.url,
        "--model",
        str(tiny_model),
        "--dataset",
        str(write_dataset(tmp_path / "d.jsonl")),
        "--run-dir",
        str(run_dir),
        "--max-steps",
        "4",
        "--groups-per-step",
        "4",
        "--prompts-per-batch",
        "2",
        "--max-inflight",
        "8",
        "--num-generations",
        "4",
        "--max-completion-length",
        "4",
        "--lora-rank",
        "8",
        "--samples-every",
        "2",
        "--report-to",
        "tensorboard",
        "wandb",
        "trackio",
        "mlflow",
    ]
    try:
        done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    finally:
        actor.close()
        actor_queue.close()
    assert done.returncode == 0, done.stderr[-4000:]
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
    # TensorBoard: TRL's names under train/, the completions table as text
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard")).Reload()
    scalars = set(events.Tags()["scalars"])
    assert TRL_NAMES <= scalars, TRL_NAMES - scalars
    assert "train/time" not in scalars and not any(t.startswith("learner/") for t in scalars)
    assert len(events.Scalars("train/reward")) == 4
    assert "completions/text_summary" in events.Tags()["tensors"], events.Tags()
    # W&B offline: a run file with the history in it
    runs = list((tmp_path / "wandb" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1 and runs[0].stat().st_size > 1000, runs
    history = runs[0].read_bytes()  # its records hold the keys as plain strings
    assert all(name.encode() in history for name in TRL_NAMES) and b"train/time" not in history
    # trackio, local: its SQLite database holds every step's figures
    dbs = list((tmp_path / "trackio").rglob("*.db"))
    assert dbs, list((tmp_path / "trackio").rglob("*"))
    with sqlite3.connect(dbs[0]) as db:
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        assert "metrics" in tables, tables
        logged = [json.loads(r[0]) for r in db.execute("SELECT metrics FROM metrics")]
    assert sum(1 for m in logged if TRL_NAMES <= m.keys()) == 4
    assert not any("train/time" in m for m in logged)
    # MLflow file store: a metric file per key, with every step, and the completions tables
    metric_files = list((run_dir / "mlruns").rglob("metrics/train/reward"))
    assert len(metric_files) == 1 and len(metric_files[0].read_text().splitlines()) == 4
    assert list(metric_files[0].parent.rglob("clip_ratio/region_mean"))
    tables = sorted((run_dir / "mlruns").rglob("completions/step-*.json"))
    assert len(tables) == 2
    table = json.loads(tables[0].read_text())
    assert {"prompt", "completion", "reward", "advantage"} <= set(table["columns"]), table["columns"]
