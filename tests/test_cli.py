"""The console scripts are installed and answer --help."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.parametrize(("command", "sub"), [("learner", "run"), ("actors", "run"), ("proxy", "serve")])
def test_console_script_help(command: str, sub: str) -> None:
    exe = shutil.which(command, path=str(Path(sys.executable).parent))
    assert exe is not None, f"{command} is not installed next to {sys.executable}"
    top = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60)
    assert top.returncode == 0, top.stderr
    assert sub in top.stdout
    nested = subprocess.run([exe, sub, "--help"], capture_output=True, text=True, timeout=60)
    assert nested.returncode == 0, nested.stderr
    assert "usage:" in nested.stdout


def test_without_a_queue_the_built_in_tasks_settings_apply_only_to_the_built_in_task() -> None:
    from learner.cli import resolve_config
    from learner.config import LearnerConfig

    normal = LearnerConfig()
    built_in, notice = resolve_config(None, {})
    assert notice is None and built_in.max_tokens == 2 and built_in.run == "demo"
    # the user's own data set (or model), no --queue: the normal defaults, and it says so
    own, notice = resolve_config(None, {"dataset": "mine.jsonl", "reward": ["my_rewards:f"]})
    assert (own.max_tokens, own.learning_rate, own.run) == (normal.max_tokens, normal.learning_rate, normal.run)
    assert notice is not None and "--dataset mine.jsonl" in notice and "--queue" in notice
    own, notice = resolve_config(None, {"model": "/models/qwen"})
    assert own.max_tokens == normal.max_tokens and "--model /models/qwen" in notice
    # what the user sets still wins, and a distributed run gets no notice
    assert resolve_config(None, {"dataset": "d.jsonl", "max_tokens": 7})[0].max_tokens == 7
    assert resolve_config(None, {"queue": "redis://h:6379/0", "dataset": "d.jsonl"})[1] is None


def test_learner_run_with_its_own_data_and_no_queue_says_so_first(tmp_path: Path) -> None:
    exe = shutil.which("learner", path=str(Path(sys.executable).parent))
    proc = subprocess.run([exe, "run", "--dataset", str(tmp_path / "missing.jsonl"), "--run-dir", str(tmp_path / "r")],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    first = proc.stderr.strip().splitlines()[0]
    assert first.startswith("learner run: no --queue") and "normal defaults" in first, proc.stderr
    assert proc.returncode == 2  # then the missing reward is named, before anything starts


def test_the_embedded_evaluation_can_be_switched_off(tmp_path: Path) -> None:
    from learner.cli import resolve_config
    from learner.embedded import prepare

    off, _ = prepare(resolve_config(None, {"run_dir": str(tmp_path / "a"), "eval_every": 0})[0])
    assert off.eval_every == 0 and not off.eval_dataset
    on, _ = prepare(resolve_config(None, {"run_dir": str(tmp_path / "b")})[0])
    assert on.eval_every == 10 and on.eval_dataset
