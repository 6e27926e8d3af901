"""Every command answers bad input and unreachable services with one line naming the
problem and a non-zero exit: no traceback, no retrying for ever, SIGTERM honoured."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
from factories import batch, write_dataset
from servers import TOKENS, free_port, kill_process

from protocol import QueueConfig, pack_i32
from protocol.trusted import RedisQueue

REPO = Path(__file__).resolve().parents[1]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("SPOTGRPO_TOKEN", "SPOTGRPO_CA_CERT")}
    return {**env, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")]), **extra}


def _run(args: list[str], timeout: float = 120, **env: str) -> tuple[int, str, float]:
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, *args], cwd=REPO, env=_env(**env), capture_output=True, text=True, timeout=timeout
    )
    return done.returncode, done.stderr, time.monotonic() - started


def _one_line(stderr: str, prefix: str, *words: str) -> str:
    """The command's own error line: present, naming the problem, with no traceback around."""
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def _actor(queue: str, model: Path | str, *extra: str) -> list[str]:
    return [
        "-m",
        "actors.cli",
        "run",
        "--queue",
        queue,
        "--model",
        str(model),
        "--reward",
        "toy_rewards:digit_first",
        *extra,
    ]


def _learner(tmp_path: Path, queue: str, model: Path | str, *extra: str) -> list[str]:
    return [
        "-m",
        "learner.cli",
        "run",
        "--queue",
        queue,
        "--store",
        (tmp_path / "store").as_uri(),
        "--model",
        str(model),
        "--dataset",
        str(write_dataset(tmp_path / "data.jsonl")),
        "--run-dir",
        str(tmp_path / "run"),
        "--no-tensorboard",
        *extra,
    ]


@pytest.mark.redis
def test_actors_with_a_wrong_token_stop_with_one_line(make_proxy, tiny_model: Path) -> None:
    proxy = make_proxy()
    rc, err, _ = _run(_actor(proxy.url, tiny_model, "--token", "x" * 40), SPOTGRPO_CA_CERT=proxy.ca)
    assert rc == 2
    _one_line(err, "actors run:", "401")
    rc, err, _ = _run(_actor(proxy.url, tiny_model, "--token", TOKENS["admin"]), SPOTGRPO_CA_CERT=proxy.ca)
    assert rc == 2
    _one_line(err, "actors run:", "has role admin", "role actor")


@pytest.mark.redis
def test_a_learner_with_an_actor_token_is_told_before_its_model_loads(
    make_proxy, tiny_model: Path, tmp_path: Path
) -> None:
    """Finding 14 of the fourth red team: `learner run` with an actor's token was refused
    7.4 s in, after its model loaded, by the first learner-only call. It asks who it is
    first, as the actors do."""
    proxy = make_proxy()
    rc, err, _ = _run(_learner(tmp_path, proxy.url, tiny_model, "--token", TOKENS["actor"]), SPOTGRPO_CA_CERT=proxy.ca)
    assert rc == 2
    _one_line(err, "learner run:", "has role actor", "role learner")
    assert "loading" not in err.lower()
    rc, err, _ = _run(
        _learner(tmp_path, proxy.url, tiny_model, "--token", TOKENS["learner"], "--run", "not-its-run"),
        SPOTGRPO_CA_CERT=proxy.ca,
    )
    assert rc == 2
    _one_line(err, "learner run:", "the proxy serves run")


@pytest.mark.redis
def test_a_certificate_that_does_not_verify_is_not_retried(make_proxy, tiny_model: Path) -> None:
    proxy = make_proxy()  # self-signed: the system's CAs do not know it
    rc, err, took = _run(_actor(proxy.url, tiny_model, "--token", TOKENS["actor"]))
    assert rc == 2 and took < 30
    _one_line(err, "actors run:", "certificate")


def test_an_unreachable_queue_is_given_up_after_the_start_up_time(tiny_model: Path, tmp_path: Path) -> None:
    dead = f"https://127.0.0.1:{free_port()}"
    rc, err, took = _run(_actor(dead, tiny_model, "--token", "x" * 40, "--startup-timeout-s", "2"))
    assert rc == 1 and took < 30
    _one_line(err, "actors run:", "unreachable")
    rc, err, took = _run(
        _learner(
            tmp_path, f"https://127.0.0.1:{free_port()}", tiny_model, "--token", "x" * 40, "--startup-timeout-s", "2"
        )
    )
    assert rc == 1 and took < 30
    _one_line(err, "learner run:", "unreachable")


def _wait_for_handler(proc: subprocess.Popen, signum: int, timeout_s: float = 60.0) -> None:
    """Until the process catches `signum` (Linux: its SigCgt mask in /proc)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        status = Path(f"/proc/{proc.pid}/status").read_text()
        caught = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
        if caught >> (signum - 1) & 1:
            return
        time.sleep(0.05)
    raise AssertionError(f"the process never installed a handler for signal {signum}")


def test_sigterm_ends_a_learner_waiting_for_its_queue(tiny_model: Path, tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, *_learner(tmp_path, f"https://127.0.0.1:{free_port()}", tiny_model, "--token", "x" * 40)],
        cwd=REPO,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_for_handler(proc, signal.SIGTERM)  # its start-up done, however slow the machine
        time.sleep(1)
        assert proc.poll() is None  # still waiting (it would for 300 s)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        assert time.monotonic() - sent < 5
    finally:
        kill_process(proc)
    assert proc.returncode == 1
    _one_line(err, "learner run:", "stopped while waiting")


def test_missing_local_models_and_bad_run_dirs_are_named(tiny_model: Path, tmp_path: Path) -> None:
    rc, err, _ = _run(_actor("https://127.0.0.1:1", tmp_path / "no-model"))
    assert rc == 2
    _one_line(err, "actors run:", "no-model", "no such directory")
    # a worker never holds the run's Redis: it is told to go through the proxy, before its model loads
    rc, err, _ = _run(_actor("redis://127.0.0.1:1/0", tiny_model))
    assert rc == 2
    _one_line(err, "actors run:", "redis://127.0.0.1:1/0", "through `proxy serve`")
    rc, err, _ = _run(_learner(tmp_path, "redis://127.0.0.1:1/0", "./models/missing"))
    assert rc == 2
    _one_line(err, "learner run:", "./models/missing", "no such directory")
    # the embedded run (no --queue) says the same, not the hub client's words on repository ids
    rc, err, took = _run(["-m", "learner", "run", "--model", "./models/missing", "--run-dir", str(tmp_path / "e")])
    assert rc == 2 and took < 20 and "Repo id" not in err and "Traceback" not in err
    assert "learner run: --model ./models/missing: no such directory" in err.splitlines()
    a_file = tmp_path / "occupied"
    a_file.write_text("")
    rc, err, took = _run(_learner(tmp_path, "redis://127.0.0.1:1/0", tiny_model, "--run-dir", str(a_file / "run")))
    assert rc == 2 and took < 20  # said before any model is loaded or queue tried
    _one_line(err, "learner run:", "--run-dir", "not a writable directory")


@pytest.mark.redis
def test_a_configuration_that_cannot_fit_the_context_is_refused_before_any_work(
    redis_server, tiny_model: Path, tmp_path: Path
) -> None:
    """The tiny model takes 1024 tokens; prompts of 6 and 1020 new tokens cannot fit: the
    learner says so with both numbers and the fix, and issues nothing."""
    rc, err, _ = _run(_learner(tmp_path, redis_server.url, tiny_model, "--run", "fits", "--max-tokens", "1020"))
    assert rc == 2
    line = _one_line(err, "learner run:", "longest prompt", "--max-tokens is 1020", "context of 1024")
    assert "lower --max-tokens (max_completion_length) to" in line
    queue = RedisQueue.from_url(redis_server.url, QueueConfig(run="fits"))
    assert queue.stats().prompts.length == 0
    queue.close()


def test_proxy_names_a_missing_or_broken_tls_file(tmp_path: Path, tls_pair, tokens_file: Path) -> None:
    base = [
        "-m",
        "proxy.cli",
        "serve",
        "--redis",
        "memory://",
        "--store",
        tmp_path.as_uri(),
        "--tokens",
        str(tokens_file),
    ]
    rc, err, _ = _run([*base, "--tls-cert", str(tmp_path / "nope.pem"), "--tls-key", str(tls_pair[1])])
    assert rc == 2
    _one_line(err, "proxy serve:", "nope.pem", "no such file")
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n")
    rc, err, _ = _run([*base, "--tls-cert", str(garbage), "--tls-key", str(tls_pair[1])])
    assert rc == 2
    _one_line(err, "proxy serve:", "garbage.pem")
    rc, err, _ = _run([*base, "--insecure-http", "--max-messages", "100"])
    assert rc == 2
    _one_line(err, "proxy serve:", "--max-messages must be at least 256")
    # Redis down: it waits, as the learner and the actors do (test_hostile has the wait), then says so
    rc, err, _ = _run(
        [
            "-m",
            "proxy.cli",
            "serve",
            "--redis",
            f"redis://127.0.0.1:{free_port()}/0",
            "--store",
            tmp_path.as_uri(),
            "--tokens",
            str(tokens_file),
            "--insecure-http",
            "--startup-timeout-s",
            "1",
        ]
    )
    assert rc == 1
    _one_line(err, "proxy serve:", "--redis", "unreachable for 1s")
    with socket.socket() as taken:  # a port in use: uvicorn's own startup failure, named
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        rc, err, _ = _run([*base, "--insecure-http", "--port", str(taken.getsockname()[1])])
    assert rc == 3 and "address already in use" in err and "Traceback" not in err, err


@pytest.mark.redis
def test_an_actor_exits_in_seconds_on_sigterm_when_the_proxy_is_gone(
    make_proxy, tiny_model: Path, run_name: str, redis_server
) -> None:
    proxy = make_proxy()
    proc = subprocess.Popen(
        [
            sys.executable,
            *_actor(
                proxy.url,
                tiny_model,
                "--token",
                TOKENS["actor"],
                "--run",
                run_name,
                "--claim-block-s",
                "0.5",
                "--worker-id",
                "spot",
            ),
        ],
        cwd=REPO,
        env=_env(SPOTGRPO_CA_CERT=proxy.ca),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    queue = RedisQueue.from_url(redis_server.url, QueueConfig(run=run_name))
    try:
        b = batch(0, prompts=1)  # with token ids, as the learner sends them
        queue.add_prompts(
            [msgspec.structs.replace(b, prompts=[msgspec.structs.replace(b.prompts[0], token_ids=pack_i32([5, 6, 7]))])]
        )
        deadline = time.monotonic() + 90
        while queue.stats().rollouts.length == 0:  # working: it claimed and submitted through the proxy
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.stdout else ""
            time.sleep(0.2)
        proxy.kill()
        time.sleep(1.0)  # its calls now fail and back off
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        kill_process(proc)
        queue.close()
    assert proc.returncode == 0, out[-3000:]
    assert took < 5, (took, out[-3000:])


@pytest.mark.redis
def test_actors_name_a_tool_they_cannot_load_or_a_model_that_cannot_offer_tools(make_proxy, tiny_model: Path) -> None:
    rc, err, took = _run(_actor("https://127.0.0.1:1", tiny_model, "--tools", "toy_tools:nope"))
    assert rc == 2 and took < 30
    _one_line(err, "actors run:", "--tools", "no function nope")
    proxy = make_proxy()
    rc, err, _ = _run(
        _actor(proxy.url, tiny_model, "--tools", "toy_tools:add", "--token", TOKENS["actor"]), SPOTGRPO_CA_CERT=proxy.ca
    )
    assert rc == 2
    _one_line(err, "actors run:", "--tools", "cannot render tool calls")


@pytest.mark.redis
@pytest.mark.slow
@pytest.mark.long
def test_an_unreachable_hub_is_named_as_such_and_its_retries_print_once(
    redis_server, tiny_model: Path, tmp_path: Path
) -> None:
    """A hub data set with no hub in reach (a closed port here): the hub's retries are
    logged once each, and the failure names the network, HF_TOKEN and HF_HUB_OFFLINE,
    not --dataset-config. A config name given for a single local file is refused."""
    args = [
        "-m",
        "learner.cli",
        "run",
        "--queue",
        redis_server.url,
        "--store",
        (tmp_path / "store").as_uri(),
        "--model",
        str(tiny_model),
        "--run-dir",
        str(tmp_path / "run"),
        "--no-tensorboard",
        "--dataset",
        "openai/gsm8k",
        "--dataset-config",
        "main",
    ]
    rc, err, _ = _run(args, timeout=180, HF_ENDPOINT=f"http://127.0.0.1:{free_port()}", HF_HUB_OFFLINE="0")
    assert rc == 2
    line = _one_line(err, "learner run:", "--dataset openai/gsm8k", "network", "HF_TOKEN", "HF_HUB_OFFLINE")
    assert "--dataset-config" not in line
    retries = [x for x in err.splitlines() if "Retrying in" in x]
    assert retries and len(retries) == len({x.split("Retrying in", 1)[1] for x in retries}), err
    rc, err, _ = _run(_learner(tmp_path, redis_server.url, tiny_model, "--dataset-config", "main"))
    assert rc == 2
    _one_line(err, "learner run:", "single file has no configurations", "--dataset-config main")
