"""One config file drives every role: `learner score`, `actors run` and `proxy serve` take
the learner's `--config` and read their part of it (what they share with the learner, and a
table of their own flags); flags on the command line win. A scoring worker whose rewards
differ from those the run's learner said refuses to start, in one line."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from learner.load_config import load_config

REPO = Path(__file__).resolve().parents[1]

GRPO_TOML = """\
# the learner's settings, under TRL's names where it has them
run_name = "gsm8k-1"
model = "Qwen/Qwen2.5-0.5B-Instruct"
queue = "redis://redis:6379/0"
store = "s3://bucket/runs"
reward_funcs = ["my_rewards:correct", "my_rewards.format_ok"]
reward_weights = [1.0, 0.5]
max_completion_length = 256

[score]
reward_timeout_s = 120
groups_per_job = 8

[actors]
queue = "https://proxy.example:8443"
engine = "vllm"
grace_s = 60

[proxy]
tokens = "tokens.toml"
tls_cert = "cert.pem"
tls_key = "key.pem"
host = "0.0.0.0"
"""


def _parse(cli: str, argv: list[str]):
    import importlib

    module = importlib.import_module(cli)
    from protocol.util.config_file import apply_config_file, subcommand

    parser = module.build_parser()
    role = {"learner.cli": "score", "actors.cli": "actors", "proxy.cli": "proxy"}[cli]
    fill = apply_config_file(subcommand(parser, argv[0]), argv[1:], role)
    args = parser.parse_args(argv)
    fill(args)
    return args


def test_each_role_takes_its_part_of_the_learners_file(tmp_path: Path) -> None:
    config = tmp_path / "grpo.toml"
    config.write_text(GRPO_TOML)
    learner = load_config(config, {})  # the role tables are not the learner's
    assert (learner.run, learner.max_tokens, learner.reward_specs) == (
        "gsm8k-1",
        256,
        ["my_rewards:correct=1.0", "my_rewards.format_ok=0.5"],
    )
    score = _parse("learner.cli", ["score", "--config", str(config)])
    assert (score.run, score.redis, score.model) == ("gsm8k-1", "redis://redis:6379/0", "Qwen/Qwen2.5-0.5B-Instruct")
    assert score.reward == ["my_rewards:correct=1.0", "my_rewards.format_ok=0.5"]
    assert (score.reward_timeout_s, score.groups_per_job) == (120, 8)
    actors = _parse("actors.cli", ["run", "--config", str(config)])
    assert (actors.queue, actors.run, actors.engine, actors.grace_s) == (
        "https://proxy.example:8443",
        "gsm8k-1",
        "vllm",
        60,
    )
    assert actors.model == "Qwen/Qwen2.5-0.5B-Instruct" and actors.reward is None  # trusted scoring: no rewards
    assert _parse("actors.cli", ["check", "--config", str(config)]).queue == "https://proxy.example:8443"
    proxy = _parse("proxy.cli", ["serve", "--config", str(config)])
    assert (proxy.redis, proxy.store, proxy.run, proxy.host) == (
        "redis://redis:6379/0",
        "s3://bucket/runs",
        "gsm8k-1",
        "0.0.0.0",
    )
    assert (proxy.tokens, proxy.tls_cert) == (Path("tokens.toml"), Path("cert.pem"))  # typed as the flags are
    # a flag given on the command line wins over the file
    assert _parse("actors.cli", ["run", "--config", str(config), "--engine", "transformers"]).engine == "transformers"
    assert _parse("learner.cli", ["score", "--config", str(config), "--run", "other"]).run == "other"
    # a repeatable flag given on the command line replaces the file's list, as any other flag does
    assert _parse("learner.cli", ["score", "--config", str(config), "--reward", "m:f"]).reward == ["m:f"]


def test_actors_score_when_the_learner_says_so(tmp_path: Path) -> None:
    config = tmp_path / "grpo.toml"
    config.write_text(
        'run = "r"\nmodel = "m"\nscoring = "actors"\nreward = ["a:f=2"]\n[actors]\nqueue = "https://p:1"\n'
    )
    assert _parse("actors.cli", ["run", "--config", str(config)]).reward == ["a:f=2"]


def test_a_bad_role_table_is_refused_with_the_flag_it_meant(tmp_path: Path) -> None:
    config = tmp_path / "grpo.toml"

    def actors_run(text: str) -> subprocess.CompletedProcess[str]:
        config.write_text(text)
        return subprocess.run(
            [sys.executable, "-m", "actors.cli", "run", "--config", str(config)],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )

    proc = actors_run('model = "m"\n[actors]\nqueue = "https://p:1"\nengnie = "vllm"\n')
    assert proc.returncode == 2 and "[actors] has no such flag: engnie (did you mean engine?)" in proc.stderr
    proc = actors_run('model = "m"\n')  # no queue for a worker: still required, said as argparse says it
    assert proc.returncode == 2 and "the following arguments are required: --queue" in proc.stderr


@pytest.mark.redis
def test_a_scorer_with_other_rewards_than_the_learners_refuses_in_one_line(
    redis_server, run_name: str, tiny_model: Path, tiny_chatml_model: Path, tmp_path: Path
) -> None:
    from protocol import QueueConfig
    from protocol.trusted import RedisQueue

    config = tmp_path / "grpo.toml"
    config.write_text(
        f'run = "{run_name}"\nmodel = "{tiny_model}"\nqueue = "{redis_server.url}"\n'
        'reward = ["toy_rewards:digit_first", "toy_rewards.length_bonus"]\nreward_weights = [1, 0.5]\n'
    )
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'tests'}"}

    def score(*flags: str, wait: bool = True):
        cmd = [sys.executable, "-m", "learner", "score", "--config", str(config), *flags]
        if wait:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
        return subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)

    said = RedisQueue.from_url(redis_server.url, QueueConfig(run=run_name))
    # started before the learner, with a weight of its own: it waits for the learner's word
    early = score("--reward", "toy_rewards:digit_first", "--reward", "toy_rewards:length_bonus=2", wait=False)
    time.sleep(3)
    said.set_run_rewards(["toy_rewards:digit_first=1.0", "toy_rewards:length_bonus=0.5"])  # as the learner says them
    _, err = early.communicate(timeout=60)
    assert early.returncode == 2, err[-2000:]
    lines = [line for line in err.splitlines() if line.startswith("learner score:")]
    assert lines == [
        "learner score: its rewards (toy_rewards:digit_first=1.0, toy_rewards:length_bonus=2.0) differ from those "
        f"run {run_name!r}'s learner scores with (toy_rewards:digit_first=1.0, toy_rewards:length_bonus=0.5): start "
        "it with the learner's config (`learner score --config grpo.toml`) or the same --reward flags"
    ], err[-2000:]
    # started after: refused at once
    proc = score("--reward", "toy_rewards:digit_first", "--burst")
    assert proc.returncode == 2 and "differ from those" in proc.stderr and "Traceback" not in proc.stderr
    # the same functions and weights however written (the config's dotted name, weights as numbers): it serves
    proc = score("--burst")  # (--burst: it exits once the queue is empty)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # the learner's environment scores its episodes: a worker without it, or with another, is refused
    said.set_run_rewards(
        ["toy_rewards:digit_first=1.0", "toy_rewards:length_bonus=0.5", "environment=toy_tools:ScoredGuess"]
    )
    proc = score("--burst")
    assert (
        proc.returncode == 2
        and "scores episodes with environment toy_tools:ScoredGuess's get_reward, this worker without one"
        in proc.stderr
    ), proc.stderr[-2000:]
    chatml = ("--model", str(tiny_chatml_model))  # episodes need a template that renders tool calls
    proc = score("--environment", "toy_tools:Hungry", *chatml, "--burst")
    assert proc.returncode == 2 and "this worker with toy_tools:Hungry" in proc.stderr, proc.stderr[-2000:]
    proc = score("--environment", "toy_tools:ScoredGuess", *chatml, "--burst")
    assert proc.returncode == 0, proc.stderr[-2000:]
    said.close()


def test_the_deploy_pages_config_file_drives_every_role(tmp_path: Path) -> None:
    import re

    page = (REPO / "docs" / "deploy.md").read_text()
    section = page.split("### One config file for every role", 1)[1]
    (block,) = re.findall(r"^```toml\n(.*?)^```", section.split("\n### ", 1)[0], re.S | re.M)
    config = tmp_path / "grpo.toml"
    config.write_text(block)
    learner = load_config(config, {})
    assert learner.run == "gsm8k-1" and learner.reward_specs == ["my_rewards:correct=1.0", "my_rewards:format_ok=0.5"]
    assert _parse("learner.cli", ["score", "--config", str(config)]).reward == learner.reward_specs
    assert _parse("actors.cli", ["run", "--config", str(config)]).queue == "https://proxy.example:8443"
    assert _parse("proxy.cli", ["serve", "--config", str(config)]).store == "s3://my-bucket/runs"
