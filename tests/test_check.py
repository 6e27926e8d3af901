"""`actors check`, as a worker outside the network runs it: through the proxy over real
TLS, against an adapter the learner really published."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from rollouts import perturbed_policy
from servers import TOKENS, kill_process

from learner.publish import Publisher, PublishJob
from protocol import fingerprint_of_model
from protocol.trusted import open_store

pytestmark = [pytest.mark.redis, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def learner_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    """`learner_check(*flags, env=...)` runs `learner check` in `tmp_path`: a test's first
    call as a user runs it (`python -m learner check`, its own process, `env` its
    environment), the later ones through `learner.cli.main` in the test's process, the same
    code less an interpreter's start and imports (6-8 s a call on 2 cores)."""
    from learner.cli import main

    calls = 0

    def check(*flags: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        nonlocal calls
        calls += 1
        if calls == 1:
            return subprocess.run(
                [sys.executable, "-m", "learner", "check", *flags],
                capture_output=True,
                text=True,
                timeout=180,
                env=env,
                cwd=tmp_path,
            )
        monkeypatch.chdir(tmp_path)
        monkeypatch.setattr(sys, "path", list(sys.path))  # main puts the working folder on it
        capsys.readouterr()
        code = main(["check", *flags])
        out = capsys.readouterr()
        return subprocess.CompletedProcess(list(flags), code, out.out, out.err)

    return check


@pytest.fixture
def published(make_proxy, tiny_model: Path, tmp_path: Path):
    """A proxy whose run has adapter v1 (rank 4) of `tiny_model`, published as the learner does."""
    store_url = (tmp_path / "store").as_uri()
    proxy = make_proxy(store=store_url)
    learner = proxy.queue("learner")
    policy = perturbed_policy(tiny_model, 1)
    publisher = Publisher(
        open_store(store_url),
        learner,
        base_model=str(tiny_model),
        rank=policy.cfg.lora_rank,
        fingerprint=fingerprint_of_model(str(tiny_model)),
    )
    publisher.submit(PublishJob(1, 1, policy.adapter_state(), policy.adapter_config_json()))
    publisher.close()
    learner.close()
    return proxy


def actors_check(
    proxy, *flags: str, token: str = TOKENS["actor"], ca: str | None = None
) -> subprocess.CompletedProcess[str]:
    run = proxy.run
    env = {
        **os.environ,
        "PYTHONPATH": f"{REPO}:{REPO / 'tests'}",
        "SPOTGRPO_TOKEN": token,
        "SPOTGRPO_CA_CERT": ca or proxy.ca,
    }
    return subprocess.run(
        [sys.executable, "-m", "actors.cli", "check", "--queue", proxy.url, "--run", run, *flags],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )


def test_a_worker_that_would_work_passes_every_check(published, tiny_model: Path) -> None:
    proc = actors_check(published, "--model", str(tiny_model), "--reward", "toy_rewards:digit_first")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert [line.split()[1] for line in lines if line.startswith("ok")] == [
        "queue",
        "run",
        "model",
        "rank",
        "rewards",
        "tools",
        "download",
        "engine",
    ]
    assert "matches the learner's base model" in proc.stdout and "adapter v1 downloaded and verified" in proc.stdout
    assert "engine loaded" in proc.stdout and "and adapter v1" in proc.stdout
    assert lines[-1].startswith("all 8 checks passed")
    proc = actors_check(published, "--model", str(tiny_model), "--tools", "toy_tools:add", "--skip-engine")
    assert proc.returncode == 1 and "FAIL  tools" in proc.stdout and "cannot render tool calls" in proc.stdout


def test_the_download_check_takes_the_newest_version_when_it_runs(published, tiny_model: Path, tmp_path: Path) -> None:
    """A fast learner publishes v2 and prunes v1 while the checks before the download run
    (a 7B model's check takes minutes): the check downloads v2, not the v1 it named."""
    import shutil

    run = published.run
    env = {
        **os.environ,
        "PYTHONPATH": f"{REPO}:{REPO / 'tests'}",
        "SPOTGRPO_TOKEN": TOKENS["actor"],
        "SPOTGRPO_CA_CERT": published.ca,
        "PYTHONUNBUFFERED": "1",
    }
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "actors.cli",
            "check",
            "--queue",
            published.url,
            "--run",
            run,
            "--model",
            str(tiny_model),
            "--reward",
            "toy_rewards:slow_check",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        seen = ""
        while "ok    rank" not in seen:  # the rewards check (4 s) runs next
            line = proc.stdout.readline()
            assert line, seen
            seen += line
        assert "adapter v1 announced" in seen
        store_dir = Path(published.cmd[published.cmd.index("--store") + 1].removeprefix("file://"))
        learner = published.queue("learner")
        policy = perturbed_policy(tiny_model, 2)
        publisher = Publisher(
            open_store(store_dir.as_uri()),
            learner,
            base_model=str(tiny_model),
            rank=policy.cfg.lora_rank,
            fingerprint=fingerprint_of_model(str(tiny_model)),
        )
        publisher.submit(PublishJob(2, 2, policy.adapter_state(), policy.adapter_config_json()))
        publisher.close()
        learner.close()
        shutil.rmtree(store_dir / "adapters" / "v1")  # pruned
        out, _ = proc.communicate(timeout=180)
    finally:
        kill_process(proc)
    assert proc.returncode == 0, seen + out
    assert "adapter v2 downloaded and verified" in out and "and adapter v2" in out


def test_another_base_model_is_named_with_the_fix(published, tmp_path: Path, tiny_model: Path) -> None:
    from learner.tiny import save_tiny

    other = save_tiny(tmp_path / "other", hidden_size=48)
    proc = actors_check(published, "--model", str(other))
    assert proc.returncode == 1
    assert "FAIL  model" in proc.stdout and f"fix: start the worker with --model {tiny_model}" in proc.stdout
    assert "engine" not in proc.stdout  # it stops at the first failure


def test_a_rank_above_the_engines_limit_fails_before_any_gpu_work(published, tiny_model: Path) -> None:
    proc = actors_check(published, "--model", str(tiny_model), "--engine", "vllm", "--max-lora-rank", "2")
    assert proc.returncode == 1
    assert "above --max-lora-rank 2" in proc.stdout and "fix: start the worker with --max-lora-rank" in proc.stdout


def test_a_wrong_role_or_certificate_fails_the_first_check(published, tiny_model: Path, tmp_path: Path) -> None:
    proc = actors_check(published, "--model", str(tiny_model), token=TOKENS["learner"])
    assert proc.returncode == 1 and "FAIL  queue" in proc.stdout and "role actor" in proc.stdout
    from proxy.tls import write_self_signed

    other_ca = tmp_path / "other-ca.pem"
    write_self_signed(other_ca, tmp_path / "other-key.pem", ["localhost"], 1)
    proc = actors_check(published, "--model", str(tiny_model), ca=str(other_ca))
    assert proc.returncode == 1 and "SPOTGRPO_CA_CERT" in proc.stdout, proc.stdout


def test_learner_check_names_the_first_thing_missing(
    redis_server, run_name: str, tiny_model: Path, tmp_path: Path, learner_check
) -> None:
    from factories import write_dataset

    data = write_dataset(tmp_path / "data.jsonl")
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'tests'}"}
    good = [
        "--run",
        run_name,
        "--queue",
        redis_server.url,
        "--store",
        (tmp_path / "store").as_uri(),
        "--model",
        str(tiny_model),
        "--dataset",
        str(data),
        "--reward",
        "toy_rewards:digit_first",
    ]
    proc = learner_check(*good, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("ok")] == [
        "queue",
        "store",
        "model",
        "tools",
        "dataset",
        "rewards",
    ]
    assert not list((tmp_path / "store" / "checks").glob("*"))  # the probe is gone
    proc = learner_check(*good[:-1], "no_such_module:f")
    assert proc.returncode == 1 and "FAIL  rewards" in proc.stdout and "install the reward's package" in proc.stdout
    # each reward is called on the data set's first row: a column it wants and the data lacks fails now
    proc = learner_check(*good[:-1], "toy_rewards.uses_columns")  # TRL's dotted spelling
    assert proc.returncode == 1 and "FAIL  rewards" in proc.stdout, proc.stdout
    assert "on the data set's first row" in proc.stdout and "columns are ['idx']" in proc.stdout
    proc = learner_check(*good[:-1], "toy_rewards.digit_first")
    assert proc.returncode == 0 and "score the data set's first row" in proc.stdout, proc.stdout
    proc = learner_check(*good, "--max-tokens", "1020")  # the tiny model's context is 1024
    assert proc.returncode == 1 and "FAIL  dataset" in proc.stdout, proc.stdout
    assert "do not fit in the model's context of 1024" in proc.stdout and "lower --max-tokens" in proc.stdout
    proc = learner_check(*good[:9], str(tmp_path / "missing.jsonl"), *good[10:])
    assert proc.returncode == 1 and "FAIL  dataset" in proc.stdout
    proc = learner_check(*good[:2], "--queue", "redis://127.0.0.1:1/0", *good[4:])
    assert proc.returncode == 1 and "FAIL  queue" in proc.stdout and "reachable" in proc.stdout


def test_learner_check_of_the_embedded_run(tmp_path: Path, learner_check) -> None:
    """Without --queue, `learner check` checks what `learner run` would start here: the
    built-in run's parts, and a user's reward module imported from the working folder."""
    proc = learner_check(env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})  # as a user runs it
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("ok")] == [
        "embedded",
        "store",
        "model",
        "tools",
        "dataset",
        "rewards",
    ]
    assert "`learner run` starts the whole system here in runs/demo" in proc.stdout
    assert (tmp_path / "runs" / "demo" / "model" / "config.json").exists()  # prepared as `learner run` would
    proc = learner_check("--reward", "my_rewardz:correct", "--run", "typo")  # the typo
    assert proc.returncode == 1, proc.stdout
    assert "FAIL  embedded   --reward 'my_rewardz:correct': cannot import my_rewardz" in proc.stdout
    assert "fix: run from the folder that holds your module" in proc.stdout
    length = "protocol.usercode.length:get_soft_overlong_punishment(max_completion_len=2, soft_punish_cache=3)"
    proc = learner_check("--reward", length, "--run", "bad-args")  # a factory's arguments it refuses
    assert proc.returncode == 1 and "raised ValueError: soft_punish_cache (3) must be between" in proc.stdout
    assert "fix: correct the specification as the line says" in proc.stdout
    (tmp_path / "my_rewards.py").write_text(
        "def correct(completions, **kwargs):\n    return [float(c.strip()[:1].isdigit()) for c in completions]\n"
    )
    proc = learner_check("--reward", "my_rewards:correct", "--run", "mine")  # from the working folder
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "my_rewards:correct import and score the data set's first row" in proc.stdout
    proc = learner_check("--model", "./models/missing")
    assert proc.returncode == 1 and "FAIL  embedded   --model ./models/missing: no such directory" in proc.stdout
    assert proc.stdout.count("./models/missing") == 1  # said once, not doubled


def test_learner_check_of_a_run_with_tools(
    redis_server, run_name: str, tiny_model: Path, tiny_chatml_model: Path, tmp_path: Path, learner_check
) -> None:
    from factories import write_dataset
    from test_episodes import write_chat_dataset

    env = {**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'tests'}"}
    where = ["--run", run_name, "--queue", redis_server.url, "--store", (tmp_path / "store").as_uri()]
    chat = [
        *where,
        "--dataset",
        str(write_chat_dataset(tmp_path / "chat.jsonl")),
        "--reward",
        "toy_rewards:last_line_is_answer",
        "--max-tokens",
        "160",
    ]
    proc = learner_check(
        "--model",
        str(tiny_chatml_model),
        *chat,
        "--tools",
        "toy_tools:add",
        "--tools",
        "toy_tools:slow_add",
        "--max-tool-calling-iterations",
        "3",
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ok    tools" in proc.stdout and "add, slow_add: schemas built" in proc.stdout, proc.stdout
    assert "ChatML tool template" in proc.stdout
    proc = learner_check("--model", str(tiny_chatml_model), *chat, "--environment", "toy_tools:GuessNumber")
    assert proc.returncode == 0 and "guess, stall (the environment GuessNumber's methods among them)" in proc.stdout
    proc = learner_check("--model", str(tiny_chatml_model), *chat, "--environment", "toy_tools:add")
    assert proc.returncode == 1 and "FAIL  tools" in proc.stdout and "is not a class" in proc.stdout
    proc = learner_check("--model", str(tiny_chatml_model), *chat, "--tools", "toy_tools:undocumented")
    assert proc.returncode == 1 and "FAIL  tools" in proc.stdout and "undocumented" in proc.stdout, proc.stdout
    proc = learner_check("--model", str(tiny_model), *chat, "--tools", "toy_tools:add")  # its template is no ChatML
    assert proc.returncode == 1 and "FAIL  tools" in proc.stdout and "cannot render tool calls" in proc.stdout
    assert "fix: give --model a model whose chat template offers tools" in proc.stdout  # not the tools' own fix
    assert "docstring" not in proc.stdout
    plain = [
        "--dataset",
        str(write_dataset(tmp_path / "plain.jsonl")),
        "--reward",
        "toy_rewards:digit_first",
        "--max-tokens",
        "160",
    ]
    proc = learner_check("--model", str(tiny_chatml_model), *plain, "--tools", "toy_tools:add")
    assert proc.returncode == 1 and "FAIL  dataset" in proc.stdout and "must hold chat messages" in proc.stdout
