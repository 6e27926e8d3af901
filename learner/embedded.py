"""The embedded default: `learner run` with no arguments runs the whole system here.

The same code paths as a distributed run, as processes started with the commands a user
would type: a private `redis-server` on a loopback port where one is installed (Linux;
else an in-process Redis, `--redis memory://`, fakeredis, which the proxy serves on a
loopback port for the scorer, `--memory-redis-port`: see `--embedded-redis`); `proxy
selfsigned` and `proxy serve` on loopback over TLS, with role tokens made for the run;
`actors run` workers with the `transformers` engine talking HTTPS to the proxy; an
`learner score` worker of the trusted scoring tier (RQ) on the run's Redis; and this
learner, also through the proxy, publishing to a `file://` store under the run directory. Model
and data are built locally (`learner/tiny.py`, `learner/tasks.py`); nothing is downloaded.

Shutdown order: the learner stops (at its step budget or on Ctrl-C, with a checkpoint);
the actors get SIGTERM (they hand their leases back) and the scoring worker too (RQ's
warm shutdown: the job in hand finishes); the queue's outstanding work is counted for
the summary; then the proxy gets SIGTERM, and redis-server last. `learner run --resume`
continues from the checkpoint: the run's Redis (which keeps nothing on disk) starts empty and the learner re-issues what it
had issued after its checkpoint.
"""

from __future__ import annotations

import ctypes
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from learner.config import LearnerConfig
from learner.tasks import REWARD, write_next_digit_dataset
from protocol.chat import load_environment, owns_reward
from protocol.lifeline import Lifeline
from protocol.machine import usable_cores

log = logging.getLogger(__name__)

EMBEDDED_DEFAULTS: dict[str, Any] = {
    "run": "demo",
    "steps": 150,
    "lora_rank": 8,
    "lora_alpha": 16.0,
    "learning_rate": 3e-3,
    "num_generations": 8,
    "prompts_per_batch": 4,
    "groups_per_step": 16,
    "max_inflight": 48,
    "max_staleness": 4,
    "max_tokens": 2,
    "temperature": 1.0,
    "checkpoint_every": 20,
    "micro_batch_size": 64,
}
"""What `learner run` with no arguments trains: the next-digit task on a small model.
Any flag the user gives overrides these."""

_REAL_MODEL: dict[str, Any] = {
    "lora_rank": 16,
    "lora_alpha": 32.0,
    "learning_rate": 3e-4,
    "num_generations": 8,
    "prompts_per_batch": 2,
    "groups_per_step": 2,
    "max_inflight": 6,
    "max_staleness": 4,
    "checkpoint_every": 8,
    "eval_generations": 1,
    "eval_temperature": 0.0,
    "samples_every": 4,
}
"""What the examples share: SmolLM2-135M on 2 CPU cores, LoRA r16, two prompts of 8 a step,
held-out pass@1 by greedy answers."""

EXAMPLES: dict[str, dict[str, Any]] = {
    "arithmetic": {**_REAL_MODEL, "run": "arithmetic", "steps": 30, "max_tokens": 32, "temperature": 0.8,
                   "eval_max_prompts": 48},
    "calculator": {**_REAL_MODEL, "run": "calculator", "steps": 12, "max_tokens": 96, "temperature": 1.0,
                   "max_tool_calling_iterations": 1, "eval_max_prompts": 32},
}
"""`learner run --example NAME`: a real model on a real task, sized for 2 CPU cores
(arithmetic 8 to 12 minutes, calculator about 26); flags override any of it."""

LEASE_TIMEOUT_S = 10.0
ROLES = ("actor", "learner", "admin")


def prepare(cfg: LearnerConfig) -> tuple[LearnerConfig, Path]:
    """Fill in what the user left out (a small model, the built-in data set and reward, a
    file store) and make the run's certificate and tokens; all of it stays in the run
    directory, so `--resume` finds it again. Returns the config and the tokens file."""
    from learner.tiny import save_tiny

    run_dir = cfg.resolved_run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    updates: dict[str, Any] = {}
    if cfg.example:
        cfg = cfg.model_copy(update=_example(cfg, run_dir))
    if not cfg.model:
        model = run_dir / "model"
        if not (model / "config.json").exists():
            save_tiny(model, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2)
        updates["model"] = str(model.resolve())
    if not cfg.dataset:
        data = run_dir / "next_digit.jsonl"
        if not data.exists():
            write_next_digit_dataset(data)
        updates["dataset"] = str(data.resolve())
        if not cfg.reward:
            updates["reward"] = [REWARD]
        # held-out prompts of the same task, another sample of it, unless the user gave
        # their own or said --eval-every 0
        if not cfg.eval_dataset and (cfg.eval_every or "eval_every" not in cfg.model_fields_set):
            held_out = run_dir / "next_digit_eval.jsonl"
            if not held_out.exists():
                write_next_digit_dataset(held_out, n=200, seed=1)
            updates |= {"eval_dataset": str(held_out.resolve()), "eval_every": cfg.eval_every or 10,
                        "eval_max_prompts": 16}
    elif not cfg.reward:
        raise ValueError("--dataset without --reward: the scorers need a reward function for your data")
    if not cfg.store:
        updates["store"] = (run_dir / "store").resolve().as_uri()
    tls = run_dir / "tls"
    if not (tls / "cert.pem").exists():
        subprocess.run(
            [sys.executable, "-m", "proxy.cli", "selfsigned", "--cert", str(tls / "cert.pem"),
             "--key", str(tls / "key.pem"), "--host", "127.0.0.1", "--host", "localhost"],
            check=True, stdout=subprocess.DEVNULL,
        )
    tokens = run_dir / "tokens.toml"
    if not tokens.exists():
        tokens.touch(mode=0o600)
        tokens.write_text("".join(
            f'[[tokens]]\nname = "local-{role}"\nrole = "{role}"\nsecret = "{secrets.token_urlsafe(32)}"\n'
            for role in ROLES
        ))
    return cfg.model_copy(update=updates), tokens


def _example(cfg: LearnerConfig, run_dir: Path) -> dict[str, Any]:
    """An example's model (made once, `learner make-model`), data, held-out set, reward
    and tools, where the user did not give their own."""
    from learner.models import default_model_dir, is_model_dir, make_model
    from learner.tasks import (
        ARITHMETIC_REWARD,
        CALCULATOR_REWARD,
        CALCULATOR_TOOL,
        write_arithmetic_dataset,
        write_calculator_dataset,
    )

    write, reward, tools = {
        "arithmetic": (write_arithmetic_dataset, ARITHMETIC_REWARD, []),
        "calculator": (write_calculator_dataset, CALCULATOR_REWARD, [CALCULATOR_TOOL]),
    }[cfg.example]
    updates: dict[str, Any] = {}
    if not cfg.model:
        if not is_model_dir(default_model_dir()):
            log.warning("making %s once (learner make-model; about a minute)", default_model_dir())
        updates["model"] = str(make_model())
    if not cfg.dataset:
        data, held_out = run_dir / f"{cfg.example}.jsonl", run_dir / f"{cfg.example}_eval.jsonl"
        if not data.exists():
            write(data)
            write(held_out, n=200, seed=1)
        updates["dataset"] = str(data.resolve())
        if not cfg.eval_dataset and (cfg.eval_every or "eval_every" not in cfg.model_fields_set):
            updates |= {"eval_dataset": str(held_out.resolve()), "eval_every": cfg.eval_every or 10}
        if not cfg.reward:
            updates["reward"] = [reward]
        if not cfg.tools and not cfg.environment:
            updates["tools"] = tools
    return updates


def import_user_code(cfg: LearnerConfig) -> None:
    """Every `--reward`, `--tools` and `--environment` imported here, before any process
    starts, with `learner check`'s messages (the children import them again)."""
    from protocol.chat import load_episode_tools
    from protocol.rewards import load_reward

    for spec in cfg.reward_specs:
        load_reward(spec)
    if cfg.tools or cfg.environment:
        load_episode_tools(list(cfg.tools), cfg.environment)


def read_secrets(tokens: Path) -> dict[str, str]:
    import tomllib

    return {t["role"]: t["secret"] for t in tomllib.loads(tokens.read_text())["tokens"]}


class LocalSystem:
    """The proxy and actor processes of one embedded run."""

    def __init__(self, cfg: LearnerConfig, tokens: Path, actors: int, redis_server: str | None) -> None:
        self.cfg = cfg
        self.run_dir = cfg.resolved_run_dir
        self.logs = self.run_dir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.tokens_file = tokens
        self.secrets = read_secrets(tokens)
        self.n_actors = actors
        self.cert, self.key = self.run_dir / "tls" / "cert.pem", self.run_dir / "tls" / "key.pem"
        self.port = _free_port()
        self.url = f"https://127.0.0.1:{self.port}"
        self.trusted = cfg.scoring_mode == "trusted"
        self.redis_server = redis_server
        """The redis-server binary to start for the run (`redis_server_binary`), or None: fakeredis."""
        self.redis_port = _free_port() if self.trusted or self.redis_server else None
        """The run's redis-server's port, or where the proxy serves its in-process Redis to
        the scoring worker (trusted scoring)."""
        self.redis: subprocess.Popen[bytes] | None = None
        self.proxy: subprocess.Popen[bytes] | None = None
        self.workers: list[subprocess.Popen[bytes]] = []
        self.scorers: list[subprocess.Popen[bytes]] = []
        self.lifeline = Lifeline()
        """Held open while this process lives: the children stop when it dies, even by SIGKILL."""
        self.stopping = False
        """The system is being stopped: children that exit now were told to."""
        self._restarts = [0] * actors
        self._actor_env: dict[str, str] = {}

    def start(self) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if self.redis_server:
            data = self.run_dir / "redis"
            data.mkdir(exist_ok=True)
            with (self.logs / "redis.log").open("ab") as out:  # nothing on disk: --resume starts it empty
                self.redis = subprocess.Popen(
                    [self.redis_server, "--port", str(self.redis_port), "--bind", "127.0.0.1", "--save", "",
                     "--appendonly", "no", "--dir", str(data)],
                    stdout=out, stderr=subprocess.STDOUT, preexec_fn=_own_group_stopping_with_parent)
        redis = "memory://" if self.redis is None else f"redis://127.0.0.1:{self.redis_port}/0"
        self.proxy = _spawn(
            [sys.executable, "-m", "proxy.cli", "serve", "--redis", redis, "--store", self.cfg.store,
             "--run", self.cfg.run, "--tokens", str(self.tokens_file), "--port", str(self.port),
             "--tls-cert", str(self.cert), "--tls-key", str(self.key), "--lease-timeout-s", str(LEASE_TIMEOUT_S),
             "--log-level", "warning",
             *(["--memory-redis-port", str(self.redis_port)] if self.redis is None and self.redis_port else [])],
            env, self.logs / "proxy.log", self.lifeline,
        )
        self._wait_healthy()
        if self.trusted:  # the trusted tier: a scoring worker on the run's Redis, as in a deployment
            cmd = [sys.executable, "-m", "learner.cli", "score", "--queue", f"redis://127.0.0.1:{self.redis_port}/0",
                   "--run", self.cfg.run, "--model", self.cfg.model, "--name", "local-scorer", "--maintenance-interval-s", "5",
                   "--abandon-after-s", "5", "--monitoring-interval-s", "2"]
            for spec in self.cfg.reward_specs:
                cmd += ["--reward", spec]
            for spec in self.cfg.tools:  # not run by the tier: its episodes' masks are checked with the tokenizer
                cmd += ["--tools", spec]
            if self.cfg.environment and owns_reward(load_environment(self.cfg.environment)):
                cmd += ["--environment", self.cfg.environment]  # it owns a reward: the tier replays it
            self.scorers.append(_spawn(cmd, {**env, "OMP_NUM_THREADS": "1"}, self.logs / "scorer-0.log", self.lifeline))
        self._actor_env = {**env, "SPOTGRPO_TOKEN": self.secrets["actor"], "SPOTGRPO_CA_CERT": str(self.cert),
                           "OMP_NUM_THREADS": "1"}  # several processes share the cores
        for i in range(self.n_actors):
            self.workers.append(self._start_actor(i, f"local-{i}"))

    def _start_actor(self, i: int, worker_id: str) -> subprocess.Popen[bytes]:
        cmd = [sys.executable, "-m", "actors.cli", "run", "--queue", self.url, "--run", self.cfg.run,
               "--engine", self.cfg.actor_engine, "--model", self.cfg.model, "--worker-id", worker_id,
               "--lease-timeout-s", str(LEASE_TIMEOUT_S), "--claim-block-s", "2"]
        for spec in ([] if self.trusted else self.cfg.reward_specs):
            cmd += ["--reward", spec]
        for spec in self.cfg.tools:
            cmd += ["--tools", spec]
        if self.cfg.environment:
            cmd += ["--environment", self.cfg.environment]
        return _spawn(cmd, self._actor_env, self.logs / f"actor-{i}.log", self.lifeline)

    # ------------------------------------------------------------------ watching the children
    RESTARTS = 3
    """An actor that exits is started again (under a new worker id) this many times."""

    def check_children(self) -> str | None:
        """Called every half second while the learner runs (`watch`): an actor that exited is
        started again, up to `RESTARTS` times each (a lost worker loses nothing: its lease
        goes to another); a scorer, the proxy or redis-server that exited ends the run, and
        this says why, with the last lines of its log."""
        if self.stopping:
            return None
        for name, proc, log_name in self._essential():
            if proc.poll() is not None:
                return f"{name} exited (status {proc.returncode}); the last lines of {self.logs / log_name}:\n" \
                       + _tail(self.logs / log_name)
        for i, proc in enumerate(self.workers):
            if proc.poll() is None:
                continue
            if self._restarts[i] >= self.RESTARTS:
                continue
            self._restarts[i] += 1
            log.warning("actor %d exited (status %s): starting it again (%d of %d); its log: %s\n%s", i,
                        proc.returncode, self._restarts[i], self.RESTARTS, self.logs / f"actor-{i}.log",
                        _tail(self.logs / f"actor-{i}.log", 3))
            self.workers[i] = self._start_actor(i, f"local-{i}-r{self._restarts[i]}")
        if self.workers and all(p.poll() is not None for p in self.workers):
            return (f"every actor exited, each started again {self.RESTARTS} times; the last lines of "
                    f"{self.logs / 'actor-0.log'}:\n" + _tail(self.logs / "actor-0.log"))
        return None

    def _essential(self) -> list[tuple[str, subprocess.Popen[bytes], str]]:
        out = [("the proxy", self.proxy, "proxy.log")] if self.proxy is not None else []
        out += [("the scoring worker", p, "scorer-0.log") for p in self.scorers]
        out += [("redis-server", self.redis, "redis.log")] if self.redis is not None else []
        return out

    def watch(self, on_failure: Callable[[str], None]) -> threading.Thread:
        """A thread that runs `check_children` until the system stops; the first failure goes
        to `on_failure` (once)."""
        def loop() -> None:
            while not self.stopping:
                why = self.check_children()
                if why is not None:
                    on_failure(why)
                    return
                time.sleep(0.5)

        thread = threading.Thread(target=loop, name="watch-children", daemon=True)
        thread.start()
        return thread

    def _wait_healthy(self) -> None:
        from protocol import QueueUnavailable
        from protocol.http_queue import wait_for_proxy

        try:
            wait_for_proxy(self.url, str(self.cert), self.proxy)
        except QueueUnavailable as err:
            raise RuntimeError(f"{err}; see {self.logs / 'proxy.log'}") from None

    def alive(self) -> int:
        return sum(1 for w in self.workers if w.poll() is None)

    def stop_workers(self) -> None:
        """Actors and scorers, so the queue holds still for the final count."""
        self.stopping = True
        for proc in self.workers:  # SIGTERM: they hand their leases back and exit 0
            if proc.poll() is None:
                proc.terminate()
        for proc in self.workers:
            _wait_or_kill(proc, 30)
        for proc in self.scorers:  # SIGTERM: RQ's warm shutdown, the group in hand finishes
            if proc.poll() is None:
                proc.terminate()
        for proc in self.scorers:
            _wait_or_kill(proc, 15)

    def stop(self) -> None:
        self.stopping = True
        self.stop_workers()
        if self.proxy is not None and self.proxy.poll() is None:
            self.proxy.terminate()
            _wait_or_kill(self.proxy, 15)
        if self.redis is not None and self.redis.poll() is None:
            self.redis.terminate()
            _wait_or_kill(self.redis, 15)
        self.lifeline.close()


def learner_threads(actors: int) -> int:
    """Torch threads for the embedded learner: the cores its actors (a thread each) leave
    it, at least one. Torch's default, every core, on cores shared with the actors, the
    proxy, the scorer and Redis makes each op wait for a thread another process holds: on
    2 cores the default run's training steps took 12-14 s with 2 threads, 6.5 s with 1
    (the real model's the same either way). OMP_NUM_THREADS, where set, decides instead."""
    return max(1, usable_cores() - actors)


def redis_server_binary(choice: str) -> str | None:
    """The redis-server the embedded run starts (`--embedded-redis`), or None for fakeredis.
    Linux only: redis-server cannot follow a lifeline, so it is told to stop when the
    learner does by the kernel (`PR_SET_PDEATHSIG`)."""
    if choice == "memory":
        return None
    binary = shutil.which("redis-server") if sys.platform == "linux" else None
    if binary is None and choice == "server":
        raise ValueError("--embedded-redis server: needs redis-server on PATH, on Linux "
                           "(or --embedded-redis memory: fakeredis, nothing to install)")
    return binary


def _own_group_stopping_with_parent() -> None:
    """In the child, before exec: a process group of its own (Ctrl-C at the terminal reaches
    the learner alone, which stops the children in order after its checkpoint), and SIGTERM
    when the process that started it ends, however it ends (prctl PR_SET_PDEATHSIG, Linux)."""
    os.setpgid(0, 0)
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawn(cmd: list[str], env: dict[str, str], log_path: Path, lifeline: Lifeline) -> subprocess.Popen[bytes]:
    """A child in a process group of its own (Ctrl-C at the terminal reaches the learner
    alone, which stops the children in order after its checkpoint) that stops (SIGTERM)
    when this process ends, however it ends."""
    with log_path.open("ab") as out:
        return subprocess.Popen(cmd, env={**env, **lifeline.env()}, stdout=out, stderr=subprocess.STDOUT,
                                pass_fds=lifeline.pass_fds, process_group=0)


def _tail(path: Path, lines: int = 8) -> str:
    """The last lines of a child's log, indented."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 8192))
            text = f.read().decode(errors="replace")
    except OSError as err:
        return f"    (unreadable: {err})"
    return "\n".join("    " + line for line in text.strip().splitlines()[-lines:])


def _wait_or_kill(proc: subprocess.Popen[bytes], timeout: float) -> None:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def accounting(state: Any, cfg: LearnerConfig, stats: Any | None, eval_in_queue: int = 0) -> dict[str, Any]:
    """Where every issued prompt went: trained, dropped (by reason), dead-lettered, or
    still in the queue when the run stopped. The queue also holds the evaluations still
    out (`eval_in_queue` prompts), which are not training prompts."""
    totals = dict(state.totals)
    # a duplicate is a second copy of a consumed prompt's group, not a prompt of its own
    dropped = {k: v for k, v in totals.items() if k.startswith(("dropped_", "rejected_")) and k != "rejected_duplicate"}
    dead = totals.get("dead_lettered_prompts", 0)
    out: dict[str, Any] = {
        "issued": state.ledger.cursor,
        "trained": totals.get("trained_groups", 0),
        "dropped": dropped,
        "dead_lettered": dead,
        "duplicates_skipped": totals.get("rejected_duplicate", 0),
        # every group the learner read, by verdict, those of a collection a stop cut short too
        # (they stay pending in the queue, so `dropped` leaves them out)
        "read": {k.removeprefix("read/"): v for k, v in sorted(totals.items()) if k.startswith("read/")},
    }
    if cfg.scoring_mode == "trusted":
        out["scored"] = totals.get("scored_groups", 0)
        out["rejected_by_scoring"] = totals.get("rejected_scoring", 0)
    if stats is not None:
        in_scoring = stats.unscored.length if stats.unscored is not None else 0
        if cfg.scoring_mode == "trusted":
            out["in_scoring"] = in_scoring
        out["in_queue"] = (stats.prompts.length * cfg.prompts_per_batch) + stats.rollouts.length + in_scoring \
            - eval_in_queue
        out["eval_in_queue"] = eval_in_queue
        out["leases_at_end"] = dict(stats.leases_by_worker)
        out["balanced"] = out["issued"] == out["trained"] + sum(dropped.values()) + dead + out["in_queue"]
    return out


def run_embedded(cfg: LearnerConfig, on_learner: Any) -> int:
    """Prepare, start the proxy and actors, train with a live display, then stop
    everything, plot and summarise. `on_learner(learner)` installs the signal handlers."""
    from rich.console import Console

    from learner.data import open_sources_for
    from learner.loop import Learner, LearnerError
    from learner.progress import LiveProgress, plot, summarise
    from protocol import QueueConfig, open_store
    from protocol.http_queue import HttpQueue

    console = Console(stderr=True, soft_wrap=True)  # a long line stays one line in a log file
    started = time.monotonic()
    try:
        cfg, tokens = prepare(cfg)
        import_user_code(cfg)  # a typo in --reward is said now, not in a child's log while the run waits
        sources = open_sources_for(cfg)  # a data set that cannot be used is said before anything starts
        redis_binary = redis_server_binary(cfg.embedded_redis)
    except (ValueError, OSError, subprocess.CalledProcessError) as err:
        print(f"learner run: {err}", file=sys.stderr)
        return 2
    console.print(
        f"[bold]spotgrpo embedded run[/bold] '{cfg.run}' in {cfg.resolved_run_dir}: proxy (TLS), "
        f"{'redis-server' if redis_binary else 'in-process Redis'}, "
        f"{cfg.actors} {cfg.actor_engine} actor(s), learner; model {cfg.model}, reward {', '.join(cfg.reward)}; "
        f"{cfg.steps} steps. Ctrl-C stops with a checkpoint; `learner run --resume` continues."
    )
    system = LocalSystem(cfg, tokens, cfg.actors, redis_binary)
    queue = None
    stats = None
    state = None
    eval_in_queue = 0
    failure: list[str] = []
    try:
        system.start()
        if "OMP_NUM_THREADS" not in os.environ:  # the user's own choice stands
            import torch

            torch.set_num_threads(learner_threads(cfg.actors))
        queue = HttpQueue(system.url, system.secrets["learner"], QueueConfig(run=cfg.run), verify=str(system.cert))
        cfg = cfg.model_copy(update={"queue": system.url, "token": system.secrets["learner"]})
        learner = Learner(cfg, queue, open_store(cfg.store), sources=sources)
        on_learner(learner)

        def child_failed(why: str, queue: Any = queue, stop: Any = learner.stop_requested) -> None:
            failure.append(why)
            log.error("stopping the run: %s", why.splitlines()[0])
            stop.set()
            queue.stop_retrying()  # a call waiting on a dead proxy fails now, not after its retries

        system.watch(child_failed)
        logging.getLogger("matplotlib").setLevel(logging.WARNING)
        if console.is_terminal:  # a live table; without a terminal (nohup, CI, docker logs) a line per step
            for chatty in ("learner.loop", "learner.publish"):
                logging.getLogger(chatty).setLevel(logging.WARNING)
            with LiveProgress(cfg.steps, system.alive, queue.stats, console) as progress:
                learner.on_step = progress.update
                state = learner.run()
        else:
            state = learner.run()
        system.stop_workers()  # what they hold goes back to the queue, which then holds still
        eval_in_queue = learner.evaluator.outstanding() if learner.evaluator is not None else 0
        try:
            stats = queue.stats()
        except Exception as err:  # the summary can do without it
            log.warning("no final queue statistics: %s", err)
    except (LearnerError, RuntimeError, OSError, ValueError) as err:
        if not failure:
            print(f"learner run: {err}", file=sys.stderr)
            return 2
    finally:
        system.stop()
        if queue is not None:
            queue.close()
    if failure:
        print(f"learner run: {failure[0]}", file=sys.stderr)
        return 1
    curve = plot(cfg.resolved_run_dir)
    summary = summarise(cfg.resolved_run_dir, time.monotonic() - started, {
        "accounting": accounting(state, cfg, stats, eval_in_queue) if state is not None else {},
        "curve": str(curve) if curve else None,
        "metrics": str(cfg.resolved_run_dir / "metrics.jsonl"),
    })
    evals = summary["evaluations"]
    held_out = ""
    if evals:
        first, last = min(evals, key=int), max(evals, key=int)
        p1 = {v: evals[v].get("pass@1") for v in (first, last)}
        shown = {v: "-" if p is None else f"{p:.3f}" for v, p in p1.items()}
        held_out = (f"; held-out pass@1 {shown[first]} (v{first}) -> {shown[last]} (v{last})"
                    + (" (cut short)" if evals[last].get("cut_short") else ""))
    console.print(
        f"\n[bold]done[/bold]: {summary['steps']} steps in {summary['wall_s']}s; reward {summary['reward_first_5']} "
        f"(first 5 steps) -> {summary['reward_last_5']} (last 5){held_out}; max staleness {summary['staleness_max']}; "
        f"adapter v{summary['adapter_version']}.\n  plot {summary['curve']}\n  metrics {summary['metrics']}\n"
        f"  summary {cfg.resolved_run_dir / 'summary.json'}"
    )
    return 0
