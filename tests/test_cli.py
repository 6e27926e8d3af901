"""The console scripts are installed and answer --help."""

from __future__ import annotations

import argparse
import json
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
    proc = subprocess.run(
        [exe, "run", "--dataset", str(tmp_path / "missing.jsonl"), "--run-dir", str(tmp_path / "r")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
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


def _parsers() -> dict[str, argparse.ArgumentParser]:
    from actors.cli import build_parser as actors
    from learner.cli import build_parser as learner
    from proxy.cli import build_parser as proxy

    out = {}
    for name, build in (("learner", learner), ("actors", actors), ("proxy", proxy)):
        for action in build()._actions:
            if isinstance(action, argparse._SubParsersAction):
                out.update({f"{name} {sub}": p for sub, p in action.choices.items()})
    return out


def test_every_command_names_its_flags_the_same_way() -> None:
    """One spelling for one thing: the run's Redis is --queue wherever a queue is meant
    (--redis too where Redis alone will do), logging is -v or --log-level everywhere,
    and every flag says what it is for."""
    parsers = _parsers()
    for name, parser in parsers.items():
        flags = {f: a for a in parser._actions for f in a.option_strings}
        if name not in ("proxy selfsigned", "actors score"):  # the latter only says where the command went
            assert {"-v", "--verbose", "--log-level"} <= flags.keys(), name
            assert flags["--log-level"].dest == "log_level" and "warning" in flags["--log-level"].choices
        for flag, action in flags.items():
            assert action.help, f"{name} {flag} has no help"
    score = ["--model", "m"]
    assert parsers["learner score"].parse_args([*score, "--queue", "redis://h:1/0"]).redis == "redis://h:1/0"
    assert parsers["learner score"].parse_args([*score, "--redis", "redis://h:1/0"]).redis == "redis://h:1/0"
    assert (
        parsers["proxy serve"].parse_args(["--store", "file:///s", "--queue", "redis://h:1/0"]).redis == "redis://h:1/0"
    )
    assert "--queue" in {f for a in parsers["actors run"]._actions for f in a.option_strings}


def test_help_is_grouped_and_says_only_its_own_command() -> None:
    learner_run = _parsers()["learner run"].format_help()
    for section in (
        "where things are:",
        "model and adapter:",
        "the loss:",
        "evaluation:",
        "reporting:",
        "TRL's names (GRPOConfig), for the settings above:",
    ):
        assert section in learner_run, section
    assert len(learner_run.split("options:")[0]) < 300  # a short usage line, not ninety flags
    actors_run = _parsers()["actors run"].format_help()
    assert "actors score" not in actors_run and "rollout worker" in actors_run


def test_selfsigned_says_when_its_certificate_expires(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "proxy.cli",
            "selfsigned",
            "--cert",
            str(tmp_path / "c.pem"),
            "--key",
            str(tmp_path / "k.pem"),
            "--days",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "expires on" in done.stdout and "(3 days)" in done.stdout
    from cryptography import x509

    cert = x509.load_pem_x509_certificate((tmp_path / "c.pem").read_bytes())
    assert 2.9 < (cert.not_valid_after_utc - cert.not_valid_before_utc).total_seconds() / 86400 < 3.1


def test_a_run_that_took_no_step_ends_with_a_line_that_says_so(tmp_path: Path) -> None:
    """Not `done: 0 steps ... reward None ... plot None`, which reads like a crash."""
    from rich.console import Console

    from learner.config import LearnerConfig
    from learner.summary import finish_run

    console = Console(record=True, width=200)
    summary = finish_run(LearnerConfig(run_dir=tmp_path), None, None, 3.2, console)
    said = console.export_text()
    assert "done: no step was taken in 3.2s" in said and "None" not in said, said
    assert summary["steps"] == 0 and summary["curve"] is None
    assert json.loads((tmp_path / "summary.json").read_text())["wall_s"] == 3.2


@pytest.mark.parametrize("total", [150, 20000])
def test_the_live_table_keeps_its_width_and_fits_80_columns(total: int) -> None:
    """A table that widens or wraps as the step count grows is drawn again below itself,
    its header twice: its width is fixed from the start, within 80 columns."""
    import io

    from rich.console import Console

    from learner.progress import LiveProgress

    class Stats:
        class prompts:
            waiting, pending = 120, 30

        class rollouts:
            waiting = 48

    progress = LiveProgress(total, lambda: 2, lambda: Stats, Console(file=io.StringIO(), width=80))
    widths = set()
    for step in (1, 9, 10, 99, 100, total):
        progress.rows.append(
            {
                "step": step,
                "reward": -0.125,
                "staleness_mean": 10.25,
                "staleness_max": 12,
                "groups": 16,
                "dropped_stale": 0,
                "dropped_flat": 3,
                "rejected": 0,
                "adapter_version": step + 3,
            }
        )
        out = Console(file=io.StringIO(), width=200)
        out.print(progress._render())
        widths.add(max(len(line) for line in out.file.getvalue().splitlines()))  # type: ignore[attr-defined]
    assert len(widths) == 1 and widths.pop() <= 80


def test_an_environment_that_owns_its_reward_stands_without_reward(tmp_path: Path, monkeypatch) -> None:
    """As the architecture page says: an environment's `get_reward` scores on the trusted
    tier beside the --reward functions, or alone."""
    from learner.cli import resolve_config
    from learner.embedded import prepare

    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # toy_tools, as the working folder would be
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"prompt": [{"role": "user", "content": "guess"}], "secret": 3}) + "\n")
    alone = {"run_dir": str(tmp_path / "a"), "dataset": str(data), "environment": "toy_tools:ScoredGuess"}
    cfg, _ = prepare(resolve_config(None, alone)[0])
    assert cfg.scoring_mode == "trusted" and cfg.reward == []  # the tier replays it; no --reward needed
    with pytest.raises(ValueError, match=r"--dataset without --reward.*get_reward"):
        prepare(resolve_config(None, {**alone, "environment": "toy_tools:GuessNumber"})[0])  # it scores nothing
