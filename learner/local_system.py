"""The embedded run's processes: a private redis-server, `proxy serve`, `actors run`
workers and a `learner score` worker, started with the commands a user would type, each
in a process group of its own (Ctrl-C at the terminal reaches the learner alone) and
following this process's lifeline; watched while the learner runs (`LocalSystem.watch`)
and stopped in order (`learner.embedded` says which)."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from learner.config import LearnerConfig
from protocol.usercode.chat import load_environment, owns_reward
from protocol.util.lifeline import Lifeline

log = logging.getLogger(__name__)

LEASE_TIMEOUT_S = 10.0


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
        self._signalled: set[int] = set()
        """The workers told to stop (SIGTERM once each)."""
        self._restarts = [0] * actors
        self._actor_env: dict[str, str] = {}

    def start(self) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if self.redis_server:
            data = self.run_dir / "redis"
            data.mkdir(exist_ok=True)
            with (self.logs / "redis.log").open("ab") as out:  # nothing on disk: --resume starts it empty
                self.redis = subprocess.Popen(
                    [
                        self.redis_server,
                        "--port",
                        str(self.redis_port),
                        "--bind",
                        "127.0.0.1",
                        "--save",
                        "",
                        "--appendonly",
                        "no",
                        "--dir",
                        str(data),
                    ],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    preexec_fn=_own_group_stopping_with_parent,
                )
        redis = "memory://" if self.redis is None else f"redis://127.0.0.1:{self.redis_port}/0"
        self.proxy = _spawn(
            [
                sys.executable,
                "-m",
                "proxy.cli",
                "serve",
                "--redis",
                redis,
                "--store",
                self.cfg.store,
                "--run",
                self.cfg.run,
                "--tokens",
                str(self.tokens_file),
                "--port",
                str(self.port),
                "--tls-cert",
                str(self.cert),
                "--tls-key",
                str(self.key),
                "--lease-timeout-s",
                str(LEASE_TIMEOUT_S),
                "--log-level",
                "warning",
                *(["--memory-redis-port", str(self.redis_port)] if self.redis is None and self.redis_port else []),
            ],
            env,
            self.logs / "proxy.log",
            self.lifeline,
        )
        self._wait_healthy()
        if self.trusted:  # the trusted tier: a scoring worker on the run's Redis, as in a deployment
            cmd = [
                sys.executable,
                "-m",
                "learner.cli",
                "score",
                "--queue",
                f"redis://127.0.0.1:{self.redis_port}/0",
                "--run",
                self.cfg.run,
                "--model",
                self.cfg.model,
                "--name",
                "local-scorer",
                "--maintenance-interval-s",
                "5",
                "--abandon-after-s",
                "5",
                "--monitoring-interval-s",
                "2",
            ]
            for spec in self.cfg.reward_specs:
                cmd += ["--reward", spec]
            for spec in self.cfg.tools:  # not run by the tier: its episodes' masks are checked with the tokenizer
                cmd += ["--tools", spec]
            if self.cfg.environment and owns_reward(load_environment(self.cfg.environment)):
                cmd += ["--environment", self.cfg.environment]  # it owns a reward: the tier replays it
            self.scorers.append(_spawn(cmd, {**env, "OMP_NUM_THREADS": "1"}, self.logs / "scorer-0.log", self.lifeline))
        self._actor_env = {
            **env,
            "SPOTGRPO_TOKEN": self.secrets["actor"],
            "SPOTGRPO_CA_CERT": str(self.cert),
            "OMP_NUM_THREADS": "1",
        }  # several processes share the cores
        for i in range(self.n_actors):
            self.workers.append(self._start_actor(i, f"local-{i}"))

    def _start_actor(self, i: int, worker_id: str) -> subprocess.Popen[bytes]:
        cmd = [
            sys.executable,
            "-m",
            "actors.cli",
            "run",
            "--queue",
            self.url,
            "--run",
            self.cfg.run,
            "--engine",
            self.cfg.actor_engine,
            "--model",
            self.cfg.model,
            "--worker-id",
            worker_id,
            "--lease-timeout-s",
            str(LEASE_TIMEOUT_S),
            "--claim-block-s",
            "2",
        ]
        if not self.cfg.actor_in_flight_updates:
            cmd.append("--no-in-flight-updates")
        for spec in [] if self.trusted else self.cfg.reward_specs:
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
                return f"{name} exited (status {proc.returncode}); the last lines of {self.logs / log_name}:\n" + _tail(
                    self.logs / log_name
                )
        for i, proc in enumerate(self.workers):
            if proc.poll() is None or proc.returncode == 0:  # 0: told the run is over (`RunOver`)
                continue
            if self._restarts[i] >= self.RESTARTS:
                continue
            self._restarts[i] += 1
            log.warning(
                "actor %d exited (status %s): starting it again (%d of %d); its log: %s\n%s",
                i,
                proc.returncode,
                self._restarts[i],
                self.RESTARTS,
                self.logs / f"actor-{i}.log",
                _tail(self.logs / f"actor-{i}.log", 3),
            )
            self.workers[i] = self._start_actor(i, f"local-{i}-r{self._restarts[i]}")
        if self.workers and all(p.poll() not in (None, 0) for p in self.workers):
            return (
                f"every actor exited, each started again {self.RESTARTS} times; the last lines of "
                f"{self.logs / 'actor-0.log'}:\n" + _tail(self.logs / "actor-0.log")
            )
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
        from protocol.client.transport import wait_for_proxy

        try:
            wait_for_proxy(self.url, str(self.cert), self.proxy)
        except QueueUnavailable as err:
            raise RuntimeError(f"{err}; see {self.logs / 'proxy.log'}") from None

    def alive(self) -> int:
        return sum(1 for w in self.workers if w.poll() is None)

    def stop_workers(self) -> None:
        """Actors and scorers, so the queue holds still for the final count."""
        self.signal_workers()
        self.wait_workers()

    def signal_workers(self) -> None:
        """SIGTERM to every actor (they hand their leases back and exit 0) and scorer (RQ's
        warm shutdown: the job in hand finishes), all at once: they stop side by side."""
        self.stopping = True
        for proc in [*self.workers, *self.scorers]:
            if proc.poll() is None and proc.pid not in self._signalled:
                proc.terminate()  # once: a second SIGTERM is RQ's cold shutdown, which kills the job in hand
                self._signalled.add(proc.pid)

    def wait_workers(self) -> None:
        for proc in self.workers:
            _wait_or_kill(proc, 30)
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
        return subprocess.Popen(
            cmd,
            env={**env, **lifeline.env()},
            stdout=out,
            stderr=subprocess.STDOUT,
            pass_fds=lifeline.pass_fds,
            process_group=0,
        )


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
