"""`learner run` with no arguments, as a user runs it, and the compose file."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from servers import kill_process

from learner.local_system import LEASE_TIMEOUT_S
from learner.progress import read_evals

REPO = Path(__file__).resolve().parents[1]


def _learner_exe() -> str:
    exe = shutil.which("learner", path=str(Path(sys.executable).parent))
    assert exe is not None, "the learner console script is not installed"
    return exe


def _cmdline(proc) -> list[str]:
    """Its command line; none for a process that is gone or a zombie (RQ's work horses and
    other short-lived children come and go while a test looks)."""
    import psutil

    try:
        return proc.cmdline()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return []


def _running(proc) -> bool:
    """Alive and not a zombie (an orphan's exit status waits for whoever reaps it here)."""
    import psutil

    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("redis", ["server", "memory"])
def test_learner_run_with_no_arguments_learns_the_built_in_task(tmp_path: Path, redis: str) -> None:
    """The embedded default, trimmed to 40 steps: reward clearly up, staleness within its
    bound, a plot and metrics, every issued prompt accounted for; on a private redis-server
    (what it picks where one is installed) and on fakeredis in the proxy's process."""
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [_learner_exe(), "run", "--run-dir", str(run_dir), "--steps", "40", "--embedded-redis", redis],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (run_dir / "logs" / "redis.log").exists() == (redis == "server")
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 41))
    # no terminal (a pipe here; nohup, CI, docker logs): a plain line per step, not a live table
    assert len(re.findall(r"step +\d+/40 ", proc.stderr)) == 40, proc.stderr[-3000:]
    assert "\ndone: 40 steps" in proc.stderr and "held-out pass@1" in proc.stderr
    first = sum(r["reward"] for r in rows[:5]) / 5
    last = sum(r["reward"] for r in rows[-5:]) / 5
    assert last > first + 0.2, (first, last)
    assert max(r["staleness_max"] for r in rows) <= 4  # the embedded max_staleness
    # each reward function's own mean is logged, beside the weighted total
    assert all(r["rewards/next_digit/mean"] == pytest.approx(r["reward_trained_mean"]) for r in rows)
    assert (run_dir / "curve.png").stat().st_size > 10_000
    # held-out evaluation: the base model first, then every 10th version; it learns there too
    evals = read_evals(run_dir)
    assert sorted(r["eval/version"] for r in evals) == [0, 10, 20, 30, 40], evals  # the last before the run ended
    assert evals[-1]["eval/pass@1"] > evals[0]["eval/pass@1"] + 0.2, evals
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["evaluations"]["0"]["prompts"] == 16
    accounting = summary["accounting"]
    assert accounting["balanced"] and accounting["dead_lettered"] == 0
    # its honest actors' groups audited (each one's first 4, then 5 %), none quarantined
    assert accounting["audited"] >= 4 and accounting["quarantined_workers"] == [] and accounting["reissued"] == 0
    # scored by the trusted tier (its own worker beside the actors), nothing rejected there
    assert accounting["scored"] >= accounting["trained"] > 0 and accounting["rejected_by_scoring"] == 0
    assert "in_scoring" in accounting and (run_dir / "logs" / "scorer-0.log").exists()
    # where every generated token went: the trained ones are the steps' completions (8 a group)
    tokens = accounting["tokens"]
    assert tokens["trained"] == pytest.approx(sum(r["completions/mean_length"] * r["groups"] * 8 for r in rows))
    assert tokens["generated"] == sum(
        v
        for k, v in tokens.items()
        if k not in ("generated", "flat_unsolved", "trained_share", "trained_within_one_version")
    )
    # of the flat groups, those all below the best reward (the untrained model's cold start)
    assert 0 < tokens["flat_unsolved"] <= tokens["flat"]
    assert 0 < accounting["flat_unsolved"] == sum(r["dropped_flat_unsolved"] for r in rows)
    assert accounting["flat_unsolved"] <= accounting["dropped"]["dropped_flat"]
    assert tokens["evaluated"] > 0
    assert f"trained {tokens['trained_share']:.0%} of {tokens['generated']:,} generated tokens" in proc.stderr
    assert all(r["score_s_mean"] >= 0 and r["scoring_latency_s_mean"] > 0 for r in rows)
    assert "reward" in proc.stderr and "done" in proc.stderr
    # warnings say only what is true: a worker is named as lagging only if its groups were dropped
    if sum(r["dropped_stale"] for r in rows) == 0:
        assert "dropped as stale" not in proc.stderr and all(r["workers_lagging"] == 0 for r in rows), proc.stderr[
            -3000:
        ]
    # a clean stop is clean in every part's log: no error, no cancelled connection (the proxy's
    # idle TLS clients held uvicorn's graceful shutdown past its limit at every stop)
    for log in (run_dir / "logs").iterdir():
        text = log.read_text()
        assert "ERROR" not in text and "Traceback" not in text, (log.name, text[-2000:])


@pytest.mark.slow
def test_a_learner_killed_outright_takes_its_proxy_actors_and_scorer_with_it(tmp_path: Path) -> None:
    """SIGKILL gives the learner no chance to stop what it started: the children follow
    its lifeline (`protocol.util.lifeline`) and stop by themselves, the actors handing back;
    the run's redis-server is told by the kernel (PR_SET_PDEATHSIG)."""
    import psutil

    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [_learner_exe(), "run", "--run-dir", str(run_dir), "--steps", "1000"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=tmp_path,
    )
    children: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 240
        path = run_dir / "metrics.jsonl"
        while not (path.exists() and len(path.read_text().splitlines()) >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, "the run stalled"
            time.sleep(0.1)
        children = psutil.Process(proc.pid).children(recursive=True)
        names = " ".join(" ".join(_cmdline(c)) for c in children)
        assert "proxy.cli" in names and "actors.cli run" in names and "learner.cli score" in names, names
        assert "redis-server" in names, names  # --embedded-redis auto, redis-server installed: it follows too
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        stopped = time.monotonic()
        alive = children
        while alive and time.monotonic() - stopped < 60:
            time.sleep(0.2)
            alive = [c for c in alive if _running(c)]
        took = time.monotonic() - stopped
    finally:
        kill_process(proc)
        for child in children:
            if _running(child):
                child.kill()
    assert not alive, [" ".join(_cmdline(c)) for c in alive]
    assert took < 60
    for log in ("proxy.log", "actor-0.log", "scorer-0.log"):  # each was told, and stopped its own way
        assert "Traceback" not in (run_dir / "logs" / log).read_text(), log
    assert "is gone: stopping" in (run_dir / "logs" / "actor-0.log").read_text()


@pytest.mark.slow
@pytest.mark.long
def test_killed_actor_then_ctrl_c_then_resume_loses_no_prompt_and_trains_once(tmp_path: Path) -> None:
    """SIGKILL one of the two actor processes early: the other carries on and takes the
    dead one's lease over. Ctrl-C stops the run with a checkpoint; `--resume` finishes
    it. Every step once, every rollout group trained at most once, and every issued
    prompt trained, dropped with a counted reason, dead-lettered or still queued."""
    import psutil

    run_dir = tmp_path / "run"
    # prompts that taught go out again (`learner.active`): their batches too, through the kill and the resume
    cmd = [_learner_exe(), "run", "--run-dir", str(run_dir), "--active-sampling-revisit", "0.5"]
    proc = subprocess.Popen(
        [*cmd, "--steps", "1000"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path
    )
    try:
        deadline = time.monotonic() + 240
        victim, steps, killed_at = None, 0, float("inf")
        # stop once 40 steps are done and the dead worker's lease has had time to expire
        while steps < 40 or time.monotonic() - killed_at < LEASE_TIMEOUT_S + 5:
            assert proc.poll() is None and time.monotonic() < deadline, "the run stalled"
            path = run_dir / "metrics.jsonl"
            steps = len(path.read_text().splitlines()) if path.exists() else 0
            if victim is None and steps >= 3:
                for child in psutil.Process(proc.pid).children(recursive=True):
                    if "actors.cli" in " ".join(_cmdline(child)) and "local-0" in _cmdline(child):
                        victim = child
                        victim.send_signal(signal.SIGKILL)
                        killed_at = time.monotonic()
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        out, _ = proc.communicate(timeout=120)
    finally:
        kill_process(proc)
    assert victim is not None
    assert proc.returncode == 0, out[-4000:]
    first = json.loads((run_dir / "summary.json").read_text())["accounting"]
    assert first["balanced"], first
    assert "local-0" not in first["leases_at_end"], "the dead worker's lease was never taken over"
    stopped_at = json.loads((run_dir / "store" / "checkpoints" / "latest.json").read_text())["step"]
    assert stopped_at >= 40
    total = stopped_at + 10  # the step budget is a total: the resumed run does 10 more

    resumed = subprocess.run(
        [*cmd, "--resume", "--steps", str(total)], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert [r["step"] for r in _rows(run_dir)] == list(range(1, total + 1))
    consumed = [json.loads(x) for x in (run_dir / "consumed.jsonl").read_text().splitlines()]
    trained = [g for c in consumed for g in c["trained"]]
    assert len(trained) == len(set(trained)) == total * 16
    second = json.loads((run_dir / "summary.json").read_text())["accounting"]
    assert second["balanced"] and second["dead_lettered"] == 0 and second["revisited"] > 0, second
    assert "Traceback" not in (run_dir / "logs" / "proxy.log").read_text()


def test_the_embedded_learner_takes_the_cores_its_actors_leave(monkeypatch) -> None:
    from learner.embedded import learner_threads

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert learner_threads(2) == 1 and learner_threads(0) == 2 and learner_threads(8) == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert learner_threads(2) == 14


def test_embedded_redis_server_without_one_is_a_clear_error(tmp_path: Path) -> None:
    """--embedded-redis server where no redis-server can be found: said in one line, exit 2,
    nothing started."""
    env = {**os.environ, "PATH": str(Path(sys.executable).parent)}  # python, learner; no redis-server
    proc = subprocess.run(
        [_learner_exe(), "run", "--run-dir", str(tmp_path / "run"), "--embedded-redis", "server"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--embedded-redis server: needs redis-server" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "logs" / "proxy.log").exists()


def test_config_file_values_are_checked_in_the_embedded_default_too(tmp_path: Path) -> None:
    from learner.cli import main

    (tmp_path / "c.toml").write_text("steps = 0\n")
    assert main(["run", "--config", str(tmp_path / "c.toml")]) == 2  # bounds are checked first


# ------------------------------------------------------------------------ compose


def _substitute(value: str, env: dict[str, str]) -> str:
    def one(m: re.Match[str]) -> str:
        name, default = m.group(1), m.group(3)
        return env.get(name) or (default or "")

    return re.sub(r"\$\{(\w+)(:?-([^}]*))?\}", one, value)


def test_compose_file_is_valid_and_every_command_is_a_real_invocation() -> None:
    compose = yaml.safe_load((REPO / "compose" / "docker-compose.yml").read_text())
    env = dict(
        line.split("=", 1)
        for line in (REPO / "compose" / ".env.example").read_text().splitlines()
        if line and not line.startswith("#")
    )
    services = compose["services"]
    assert {"redis", "minio", "proxy", "learner", "actors", "scorers"} <= set(services)
    assert "--appendonly" in services["redis"]["command"]
    ours = {}
    for name, service in services.items():
        command = service.get("command")
        if isinstance(command, str):
            command = shlex.split(command)
        if command and command[0] in ("learner", "actors", "proxy"):
            ours[name] = [_substitute(part, env) for part in command]
        for dep in service.get("depends_on", []):
            assert dep in services, f"{name} depends on a missing service {dep}"
    assert set(ours) == {"proxy", "learner", "actors", "scorers"}
    from actors.cli import build_parser as actors_parser
    from learner.cli import build_parser as learner_parser
    from proxy.cli import build_parser as proxy_parser

    parsers = {"learner": learner_parser(), "actors": actors_parser(), "proxy": proxy_parser()}
    for command in ours.values():
        exe = shutil.which(command[0], path=str(Path(sys.executable).parent))
        assert exe is not None
        helped = subprocess.run([exe, command[1], "--help"], capture_output=True, text=True, timeout=60)
        assert helped.returncode == 0, helped.stderr
        parsers[command[0]].parse_args(command[1:])  # every flag exists and parses (SystemExit otherwise)
    assert "--insecure-http" not in ours["proxy"] and "--tls-cert" in ours["proxy"]
    assert "AWS_ACCESS_KEY_ID" not in services["actors"].get("environment", {})  # least privilege
    assert "--reward" not in ours["actors"] and "--reward" in ours["scorers"]  # scored on the trusted side
    # the proxy's tokens come from .env (nothing to write by hand, nothing typed twice)
    from proxy.auth import Tokens

    tokens = Tokens.from_toml(_substitute(services["proxy"]["environment"]["SPOTGRPO_TOKENS"], env))
    assert {t.role for t in tokens.tokens} == {"actor", "learner", "admin"}
    actor = tokens.check(_substitute(services["actors"]["environment"]["SPOTGRPO_TOKEN"], env))
    assert actor is not None and actor.role == "actor"
    # GPUs: the learner's own, and the actors' listed ones (one worker each): never the same
    learner_gpu = services["learner"]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
    actor_gpus = ours["actors"][ours["actors"].index("--gpus") + 1].split(",")
    assert [_substitute(g, env) for g in learner_gpu] == [env["LEARNER_GPU"]] and env["LEARNER_GPU"] not in actor_gpus
    # a finished run is not restarted; everything is pinned; waits are real (healthy, bucket made)
    assert services["learner"]["restart"] == "on-failure"
    for name, service in services.items():
        image = _substitute(service.get("image", ""), env)
        assert not image or (":" in image and not image.endswith(":latest")), (name, image)
        for dep, condition in (
            (service.get("depends_on") or {}).items() if isinstance(service.get("depends_on"), dict) else ()
        ):
            assert condition["condition"] in ("service_healthy", "service_completed_successfully"), (name, dep)
            if condition["condition"] == "service_healthy":
                assert "healthcheck" in services[dep], dep
    assert "latest" not in (REPO / "compose" / "Dockerfile").read_text()
    assert env["PRESIGN_ENDPOINT"].startswith("http://")  # MinIO serves plain HTTP
    # one place for the certificate: the repository's certs/, which deploy/'s recipes read
    assert (
        "../certs:/certs:ro" in services["proxy"]["volumes"] and "../certs:/certs:ro" in services["actors"]["volumes"]
    )
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {".venv*", ".git", "runs", "certs", "compose/.env"} <= set(ignored)
    worker = (REPO / "compose" / "spot-worker.sh").read_text()
    assert "actors run --queue" in worker and os.access(REPO / "compose" / "spot-worker.sh", os.X_OK)


def test_the_reference_documents_every_learner_flag() -> None:
    from learner.config import LearnerConfig

    reference = (REPO / "docs" / "reference.md").read_text()
    missing = [n for n in LearnerConfig.model_fields if f"`--{n.replace('_', '-')}`" not in reference]
    assert not missing, f"docs/reference.md's configuration reference lacks {missing}"


def _wait_for_steps(proc: subprocess.Popen, run_dir: Path, n: int, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    path = run_dir / "metrics.jsonl"
    while not (path.exists() and len(path.read_text().splitlines()) >= n):
        assert proc.poll() is None and time.monotonic() < deadline, "the run stalled"
        time.sleep(0.1)


def _child(proc: subprocess.Popen, *words: str, wait_s: float = 0.0):
    """The child whose command line holds `words`, waiting up to `wait_s` for it to appear."""
    import psutil

    deadline = time.monotonic() + wait_s
    while True:
        for child in psutil.Process(proc.pid).children(recursive=True):
            line = " ".join(_cmdline(child))
            if all(w in line for w in words):
                return child
        if time.monotonic() >= deadline:
            raise AssertionError(f"no child running {words}")
        time.sleep(0.1)


def test_a_reward_that_cannot_be_imported_is_said_before_anything_starts(tmp_path: Path, tiny_model: Path) -> None:
    """No silent waits (issue 37): `--reward my_rewardz:correct` (a typo) showed the header
    and waited for ever; the import error was in the scorer's log alone. And the working
    folder is on the module path for every subcommand, as `python -m` has it."""
    (tmp_path / "my_rewards.py").write_text(
        "def correct(prompts, completions, **kw):\n    return [1.0] * len(prompts)\n"
    )
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}", "answer": "1"}) + "\n" for i in range(8)))
    started = time.monotonic()
    done = subprocess.run(
        [
            _learner_exe(),
            "run",
            "--run-dir",
            str(tmp_path / "run"),
            "--dataset",
            str(data),
            "--reward",
            "my_rewardz:correct",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 2 and "cannot import my_rewardz" in done.stderr, done.stderr[-2000:]
    assert time.monotonic() - started < 60 and not (tmp_path / "run" / "logs" / "proxy.log").exists()
    # the same module, spelled right, imports from the working folder under `learner score` too
    score = subprocess.run(
        [
            _learner_exe(),
            "score",
            "--queue",
            "redis://127.0.0.1:1/0",
            "--model",
            str(tiny_model),
            "--reward",
            "my_rewards:correct",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert "unreachable" in score.stderr and "cannot import" not in score.stderr, score.stderr[-2000:]  # got past it


@pytest.mark.slow
def test_a_scorer_that_dies_ends_the_run_with_its_last_lines(tmp_path: Path) -> None:
    """A child the run cannot do without (here the scoring worker, SIGKILLed) ends the run
    at once with the last lines of its log; an actor that dies is started again."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [_learner_exe(), "run", "--run-dir", str(run_dir), "--steps", "1000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=tmp_path,
    )
    try:
        _wait_for_steps(proc, run_dir, 2)
        _child(proc, "actors.cli", "local-1").kill()
        _wait_for_steps(proc, run_dir, 4)
        # started again, under a new worker id (the watch looks every 0.5 s: two steps can be quicker)
        _child(proc, "actors.cli", "local-1-r1", wait_s=30)
        _child(proc, "learner.cli score").kill()
        killed = time.monotonic()
        out, _ = proc.communicate(timeout=120)
        took = time.monotonic() - killed
    finally:
        kill_process(proc)
    assert proc.returncode == 1, out[-3000:]
    assert "the scoring worker exited (status -9); the last lines of" in out and "scorer-0.log" in out, out[-3000:]
    assert "actor 1 exited" in out and "starting it again" in out, out[-3000:]
    assert took < 60, took


@pytest.mark.slow
def test_ctrl_c_at_the_terminal_stops_the_run_in_seconds_with_a_checkpoint(tmp_path: Path) -> None:
    """Ctrl-C reaches a terminal's whole foreground process group. The children used to
    share the learner's, so the proxy, redis-server and the scorer died with the keypress
    and the learner waited 57 s for its dead proxy. Now they have groups of their own: the
    learner checkpoints, stops them in order and ends."""
    import psutil

    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [_learner_exe(), "run", "--run-dir", str(run_dir), "--steps", "1000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=tmp_path,
        process_group=0,
    )
    children: list[psutil.Process] = []
    try:
        _wait_for_steps(proc, run_dir, 3)
        children = psutil.Process(proc.pid).children(recursive=True)
        os.killpg(proc.pid, signal.SIGINT)  # what the terminal does
        pressed = time.monotonic()
        out, _ = proc.communicate(timeout=120)
        took = time.monotonic() - pressed
    finally:
        kill_process(proc)
        for child in children:
            if _running(child):
                child.kill()
    assert proc.returncode == 0, out[-3000:]
    assert took < 20, took  # 57 s before
    assert (run_dir / "store" / "checkpoints" / "latest.json").exists() and (run_dir / "summary.json").exists()
    assert not [c for c in children if _running(c)]
    assert "Traceback" not in (run_dir / "logs" / "proxy.log").read_text()
