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
continues from the checkpoint: the run's Redis (which keeps nothing on disk) starts empty
and the learner re-issues what it had issued after its checkpoint.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from learner.config import LearnerConfig
from learner.local_system import LocalSystem
from learner.tasks import REWARD, write_next_digit_dataset
from protocol.util.machine import usable_cores

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
    "arithmetic": {
        **_REAL_MODEL,
        "run": "arithmetic",
        "steps": 30,
        "active_sampling_revisit": 0.5,  # a run reads 80 of 2,000 rows: each a first sight (learner/active.py)
        "checkpoint_every": 2,  # revisits go out once a checkpoint holds them; one takes under a second here
        "max_tokens": 32,
        "temperature": 0.8,
        "eval_max_prompts": 48,
    },
    "calculator": {
        **_REAL_MODEL,
        "run": "calculator",
        "steps": 12,
        "max_tokens": 96,
        "temperature": 1.0,
        "max_tool_calling_iterations": 1,
        "eval_max_prompts": 32,
    },
}
"""`learner run --example NAME`: a real model on a real task, sized for 2 CPU cores
(arithmetic 8 to 12 minutes, calculator about 26); flags override any of it."""

ROLES = ("actor", "learner", "admin")


def prepare(cfg: LearnerConfig) -> tuple[LearnerConfig, Path]:
    """Fill in what the user left out (a small model, the built-in data set and reward, a
    file store) and make the run's certificate and tokens; all of it stays in the run
    directory, so `--resume` finds it again. Returns the config and the tokens file."""
    from learner.tiny import save_tiny
    from protocol import check_model_path

    if cfg.model:
        check_model_path(cfg.model)  # "no such directory", not the hub client's words on repository ids
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
            updates |= {
                "eval_dataset": str(held_out.resolve()),
                "eval_every": cfg.eval_every or 10,
                "eval_max_prompts": 16,
            }
    elif not cfg.reward:
        from protocol.usercode.chat import load_environment, owns_reward

        if not (cfg.environment and owns_reward(load_environment(cfg.environment))):
            raise ValueError(
                "--dataset without --reward: the scorers need a reward function for your data (or an "
                "--environment whose class scores its episodes itself, TRL's get_reward)"
            )
        if cfg.scoring is None:  # the environment's own reward, replayed on the trusted tier
            updates["scoring"] = "trusted"
    if not cfg.store:
        updates["store"] = (run_dir / "store").resolve().as_uri()
    tls = run_dir / "tls"
    if not (tls / "cert.pem").exists():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "proxy.cli",
                "selfsigned",
                "--cert",
                str(tls / "cert.pem"),
                "--key",
                str(tls / "key.pem"),
                "--host",
                "127.0.0.1",
                "--host",
                "localhost",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
    tokens = run_dir / "tokens.toml"
    if not tokens.exists():
        tokens.touch(mode=0o600)
        tokens.write_text(
            "".join(
                f'[[tokens]]\nname = "local-{role}"\nrole = "{role}"\nsecret = "{secrets.token_urlsafe(32)}"\n'
                for role in ROLES
            )
        )
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
    from protocol.usercode.chat import load_episode_tools
    from protocol.usercode.rewards import load_reward

    for spec in cfg.reward_specs:
        load_reward(spec)
    if cfg.tools or cfg.environment:
        load_episode_tools(list(cfg.tools), cfg.environment)


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
        raise ValueError(
            "--embedded-redis server: needs redis-server on PATH, on Linux "
            "(or --embedded-redis memory: fakeredis, nothing to install)"
        )
    return binary


def run_embedded(cfg: LearnerConfig, on_learner: Any) -> int:
    """Prepare, start the proxy and actors, train with a live display, then stop
    everything, plot and summarise. `on_learner(learner)` installs the signal handlers."""
    from rich.console import Console

    from learner.data import open_sources_for
    from learner.loop import Learner, LearnerError
    from learner.progress import LiveProgress, plot
    from learner.summary import final_stats, finish_run
    from protocol import QueueConfig
    from protocol.client.http_queue import HttpQueue
    from protocol.trusted import open_store

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
    curve = None
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

        def stop_workers_at_once(stop: threading.Event = learner.stop_requested) -> None:
            # what actors generate after Ctrl-C is not trained in this run: they stop beside the
            # learner's checkpoint, not after it (what they hand back stays in the queue)
            if stop.wait():
                system.signal_workers()

        threading.Thread(target=stop_workers_at_once, name="stop-workers", daemon=True).start()
        logging.getLogger("matplotlib").setLevel(logging.WARNING)
        if console.is_terminal:  # a live table; without a terminal (nohup, CI, docker logs) a line per step
            for chatty in ("learner.loop", "learner.collector", "learner.publish"):
                logging.getLogger(chatty).setLevel(logging.WARNING)
            with LiveProgress(cfg.steps, system.alive, queue.stats, console) as progress:
                learner.report.on_step = progress.update
                state = learner.run()
        else:
            state = learner.run()
        system.signal_workers()  # what they hold goes back to the queue, which then holds still
        curve = plot(cfg.resolved_run_dir)  # drawn while they stop
        system.wait_workers()
        eval_in_queue = learner.evals.outstanding()
        stats = final_stats(queue)
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
    finish_run(cfg, state, stats, time.monotonic() - started, console, eval_in_queue, curve)
    return 0
