"""spotgrpo against Hugging Face's async GRPO + LoRA recipe, side by side on this machine.

The peer: TRL's `AsyncGRPOTrainer` (`trl.experimental.async_grpo`, the installed trl) training
a LoRA adapter against a `vllm serve` (vLLM's CPU build in `.venv-vllm`) started as the
recipe says (`--enable-lora`, `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`, `VLLM_SERVER_DEV_MODE=1`):
every step it pauses the server, writes the adapter, loads it with `/v1/load_lora_adapter`
and resumes. Its engine core runs in the server's process, as the actor's does on one core
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`: see actors/vllm_engine.py; it makes TRL faster too).
spotgrpo: `learner run` on a private redis-server and a file store, `proxy serve` in front
of it, and one `actors run --engine vllm` worker through the proxy (scoring its own groups,
as TRL's rollout worker does).

The same work for both: the tiny model (`learner.tiny.save_tiny`), the next-digit task asked
as a chat turn, reward `digits` below (the task's own and a dense part), `--groups` prompts x
`--num-generations` (8) completions a step,
up to 16 tokens at temperature 1, LoRA r8 / alpha 16 on every linear layer, the same
learning rate, at most `--max-staleness` versions behind, `--steps` steps. The learner
side (TRL's trainer and its rollout process; spotgrpo's learner and its Redis) runs on
core 0, the generator (`vllm serve`; the actor) on core 1 (taskset).

For each it prints steps/s (between the first and the last step, and over the whole
run), the learner's wait as a fraction of its step time, mean staleness, samples
dropped as stale, and the mean reward of the first and last five steps; then the ratio
of steps/s. `--profile [PY_SPY]` also samples the actor's processes with py-spy
from the first step to the last and prints where their CPU goes per step.

Usage: python bench/vs_trl.py [--pairs 1] [--steps 40] [--only trl|spotgrpo]
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":  # run as a script, this folder would shadow packages; imported, the reward lives here
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import tempfile
import time
import urllib.request
from typing import Any

REPO = Path(__file__).resolve().parents[1]
LEARNER_CORE, GENERATOR_CORE = "0", "1"
REWARD = "bench.vs_trl:digits"


def digits(prompts: list, completions: list, answer: list, **_: Any) -> list[float]:
    """The next-digit task's reward (`protocol.usercode.tasks:next_digit`: 1 for the right digit first)
    plus a dense part, half the share of digits in the completion. With the sparse reward
    alone most groups of an untrained model score all 0: spotgrpo drops such groups (no
    advantage, no gradient) and fills its step with others, where TRL trains on them, so a
    step would not be the same work. Takes TRL's completions too (an empty one parses to
    no message)."""
    from protocol.usercode.tasks import next_digit

    texts = [
        c if isinstance(c, str) else (c[0].get("content", "") if c and isinstance(c[0], dict) else "")
        for c in completions
    ]
    first = next_digit(prompts, texts, answer)
    return [f + 0.5 * sum(ch.isdigit() for ch in t) / max(len(t), 1) for f, t in zip(first, texts, strict=True)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pinned(core: str, argv: list[str]) -> list[str]:
    return ["taskset", "-c", core, *argv] if shutil.which("taskset") and os.cpu_count() and os.cpu_count() > 1 else argv


def wait_until(ready: Any, what: str, timeout_s: float, procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ready():
            return
        for p in procs:
            if p.poll() is not None:
                raise SystemExit(f"{what}: a process exited ({p.args[:4]}, rc {p.returncode}); see its log")
        time.sleep(0.5)
    raise SystemExit(f"{what}: not ready after {timeout_s:.0f}s")


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def write_data(path: Path, n: int = 2000) -> Path:
    from learner.tasks import next_digit_rows

    rows = [{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]} for r in next_digit_rows(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def vllm_env() -> dict[str, str]:
    return {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(REPO),
    }


# ---------------------------------------------------------------------- the peer
def run_trl(args: argparse.Namespace, work: Path, model: Path, data: Path) -> dict[str, Any]:
    from bench.queue import stop

    port = free_port()
    server_log = (work / "vllm-serve.log").open("wb")
    env = {
        **vllm_env(),
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1",
        # what the actor does by itself on one core (actors/vllm_engine.py), given to the peer too:
        # it takes TRL from 2.8-3.0 to 4.1 steps/s here
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }
    server = subprocess.Popen(
        pinned(
            GENERATOR_CORE,
            [
                str(args.vllm_python),
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                str(model),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--dtype",
                "float32",
                "--enable-lora",
                "--max-lora-rank",
                "8",
                "--max-loras",
                str(args.max_staleness + 2),
                "--max-model-len",
                "256",
                "--max-num-seqs",
                str(4 * args.groups * args.num_generations),
                "--seed",
                "0",
            ],
        ),
        env=env,
        stdout=server_log,
        stderr=subprocess.STDOUT,
        cwd=work,
    )
    procs = [server]
    try:
        wait_until(lambda: http_ok(f"http://127.0.0.1:{port}/health"), "vllm serve", 600, procs)
        spec = {
            "model": str(model),
            "data": str(data),
            "url": f"http://127.0.0.1:{port}",
            "out": str(work / "trl"),
            "steps": args.steps,
            "groups": args.groups,
            "num_generations": args.num_generations,
            "lr": args.lr,
            "max_staleness": args.max_staleness,
        }
        (work / "trl.json").write_text(json.dumps(spec))
        with (work / "trl-trainer.log").open("wb") as log:
            trainer = subprocess.Popen(
                pinned(LEARNER_CORE, [str(args.vllm_python), "-m", "bench.vs_trl_peer", str(work / "trl.json")]),
                env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=work,
            )
            procs.append(trainer)
            started = time.time()
            if trainer.wait() != 0:
                raise SystemExit(f"the TRL trainer failed (rc {trainer.returncode}): see {work / 'trl-trainer.log'}")
        rows = json.loads((work / "trl" / "steps.json").read_text())
        return summary(
            "TRL AsyncGRPOTrainer + vllm serve",
            rows,
            started,
            {
                "wait_s": "perf/rollout_wait_s",
                "staleness": "sample/staleness_mean",
                "dropped": "sample/dropped_stale_total",
                "reward": "reward",
            },
        )
    finally:
        stop(procs)
        server_log.close()


# ---------------------------------------------------------------------- spotgrpo
def run_spotgrpo(args: argparse.Namespace, work: Path, model: Path, data: Path) -> dict[str, Any]:
    from bench.queue import start_proxy, start_redis, stop

    redis, rport = start_redis(pinned(LEARNER_CORE, []))
    procs = [redis]
    queue = f"redis://127.0.0.1:{rport}/0"
    run_dir = work / "spotgrpo"
    try:
        # the worker reaches the run through the proxy, as every worker does (TRL's reaches vllm serve over HTTP)
        proxy, proxy_url, worker_env = start_proxy(
            work, queue, (work / "store").as_uri(), "vs-trl", pinned(LEARNER_CORE, [])
        )
        procs.append(proxy)
        actor_argv = [
            str(args.vllm_python),
            "-m",
            "actors.cli",
            "run",
            "--queue",
            proxy_url,
            "--run",
            "vs-trl",
            "--engine",
            "vllm",
            "--model",
            str(model),
            "--max-lora-rank",
            "8",
            "--max-model-len",
            "256",
            "--dtype",
            "float32",
            "--reward",
            REWARD,
            "--worker-id",
            "actor-0",
        ]
        with (work / "actor.log").open("wb") as log:  # the child keeps its own copy of the file
            actor = subprocess.Popen(
                pinned(GENERATOR_CORE, actor_argv),
                env={**vllm_env(), **worker_env},
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=work,
            )
        procs.append(actor)
        learner_argv = [
            sys.executable,
            "-m",
            "learner.cli",
            "run",
            "--run",
            "vs-trl",
            "--queue",
            queue,
            "--store",
            (work / "store").as_uri(),
            "--run-dir",
            str(run_dir),
            "--model",
            str(model),
            "--device",
            "cpu",
            "--dataset",
            str(data),
            "--reward",
            REWARD,
            "--scoring",
            "actors",
            "--num-generations",
            str(args.num_generations),
            "--groups-per-step",
            str(args.groups),
            "--max-tokens",
            "16",
            "--temperature",
            "1.0",
            "--learning-rate",
            str(args.lr),
            "--lora-rank",
            "8",
            "--lora-alpha",
            "16",
            "--max-staleness",
            str(args.max_staleness),
            "--steps",
            str(args.steps),
            "--max-inflight",
            str(args.max_staleness * args.groups),
            "--eval-every",
            "0",
            "--checkpoint-every",
            str(args.steps),
            "--no-keep-queue",
        ]
        if args.prompts_per_batch:
            learner_argv += ["--prompts-per-batch", str(args.prompts_per_batch)]
        profiler, profiled, profile_ended = None, (0, 0.0), False
        with (work / "learner.log").open("wb") as log:
            learner = subprocess.Popen(
                pinned(LEARNER_CORE, learner_argv),
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
                cwd=work,
            )
            procs.insert(0, learner)
            started = time.time()
            while learner.poll() is None:
                if actor.poll() is not None:
                    raise SystemExit(f"the actor exited (rc {actor.returncode}): see {work / 'actor.log'}")
                if args.profile and profiler is None and (done := steps_done(run_dir)) >= 1:
                    # the steady state only: from the first step on, not the engine's start
                    profiled = (done, time.time())
                    profiler = subprocess.Popen(
                        pinned(
                            LEARNER_CORE,
                            [
                                args.profile,
                                "record",
                                "--pid",
                                str(actor.pid),
                                "--format",
                                "raw",
                                "--rate",
                                str(RATE),
                                "--nonblocking",
                                "--subprocesses",
                                "--output",
                                str(work / "actor.pyspy"),
                            ],
                        ),
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.STDOUT,
                    )
                if profiler is not None and not profile_ended and steps_done(run_dir) >= args.steps:
                    # stopped at the last step: the actor's shutdown after the run is no step's cost
                    profiler.send_signal(signal.SIGINT)
                    profile_ended = True
                time.sleep(0.2)
            if learner.returncode != 0:
                raise SystemExit(f"the learner failed (rc {learner.returncode}): see {work / 'learner.log'}")
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        if profiler is not None:  # what the profile saw: the steps after it started, up to the last
            if not profile_ended:
                profiler.send_signal(signal.SIGINT)
            profiler.wait(timeout=120)
            show_profile(work / "actor.pyspy", len(rows) - profiled[0], rows[-1]["time"] - profiled[1])
        rows = [r for r in rows if "step_s" in r]
        return summary(
            "spotgrpo (learner + 1 vllm actor over Redis)",
            rows,
            started,
            {"wait_s": "wait_s", "staleness": "staleness_mean", "dropped": "dropped_stale", "reward": "reward"},
        )
    finally:
        stop(procs)


def steps_done(run_dir: Path) -> int:
    metrics = run_dir / "metrics.jsonl"
    return sum(1 for _ in metrics.open()) if metrics.exists() else 0


# ---------------------------------------------------------------------- the actor's time
RATE = 250
"""py-spy's samples per second (of each thread that is not idle)."""

WHERE: list[tuple[str, tuple[str, ...]]] = [
    # (what, any of these frames): the first that matches a sample names it
    (
        "vLLM: model forward + sampling",
        ("execute_model", "sample_tokens", "_model_forward", "bgmv_", "sgmv_", "einsum", "onednn_mm", "gemm"),
    ),
    ("vLLM: LoRA load / activate", ("add_lora", "_load_adapter", "set_active_adapters", "activate_adapter")),
    (
        "vLLM: scheduling, engine-core loop and IPC",
        ("Scheduler.", "EngineCoreProc", "run_busy_loop", "EngineCore.step", "InprocClient", "MPClient"),
    ),
    ("vLLM: model process's loop and IPC", ("WorkerProc", "worker_busy_loop", "worker_main")),
    ("vLLM: output processing (log-probs, text)", ("OutputProcessor", "process_outputs_socket", "Detokenizer")),
    (
        "actor: scoring (reward process, its pool's threads)",
        (
            "Scorer",
            "ScoringPool",
            "score_group",
            "_score",
            "message_manager_loop",
            "pool_manager_loop",
            "task_scheduler_loop",
            "worker_process",
        ),
    ),
    ("actor: adapter watch, download, load call", ("AdapterWatcher", "load_adapter", "StoreSource")),
    ("actor: heartbeat and status", ("Heartbeat", "status")),
    ("actor: submit (build, encode, Redis)", ("_submit_ready", "RedisQueue.submit", "submit")),
    ("actor: claim (Redis, decode)", ("_fill", "claim")),
    ("actor: requests in, samples out", ("VLLMEngine", "_advance")),
]


def show_profile(raw: Path, steps: int, seconds: float) -> None:
    """Where the actor's processes (its own, vLLM's engine core and worker, the reward
    process) spent CPU per step, from py-spy's raw samples: busy threads only."""
    import re
    from collections import Counter

    text = raw.read_text(errors="replace") if raw.exists() else ""
    where: Counter[str] = Counter()
    for record in re.split(r"\n(?=process \d+:)", text):
        stack, _, count = record.strip().rpartition(" ")
        if not count.isdigit():
            continue
        frames = [f.split(" (")[0] for f in stack.split(";") if not f.startswith("process ")]
        label = next((what for what, marks in WHERE if any(m in f for f in frames for m in marks)), "other")
        where[label] += int(count)
    total = sum(where.values())
    if not total or not steps:
        print("profile: no samples (is py-spy allowed to read other processes here?)")
        return
    per_step = 1000 / RATE / steps
    print(
        f"the actor's CPU per step ({steps} steps in {seconds:.1f}s, {1000 * seconds / steps:.0f} ms a step; "
        f"py-spy, {total / RATE / seconds:.0%} of a core busy):"
    )
    for what, n in where.most_common():
        print(f"  {what:<48} {n * per_step:>7.1f} ms  {n / total:>5.0%}")


# ---------------------------------------------------------------------- report
def summary(name: str, rows: list[dict[str, Any]], started: float, keys: dict[str, str]) -> dict[str, Any]:
    def col(key: str) -> list[float]:
        return [float(r.get(keys[key], 0.0) or 0.0) for r in rows]

    times = [r["time"] for r in rows]
    rewards = col("reward")
    waits = col("wait_s")
    return {
        "name": name,
        "steps": len(rows),
        "steps_per_s": (len(rows) - 1) / (times[-1] - times[0]) if len(rows) > 1 else float("nan"),
        "wall_s": times[-1] - started,
        # what the learner waited for rollouts between its first step and its last, over that time
        "wait_fraction": sum(waits[1:]) / max(times[-1] - times[0], 1e-9),
        "staleness": statistics.mean(col("staleness")),
        "dropped": sum(col("dropped")),
        "reward_first": statistics.mean(rewards[:5]),
        "reward_last": statistics.mean(rewards[-5:]),
    }


def show(results: list[dict[str, Any]]) -> None:
    print(
        f"{'':<46} {'steps/s':>8} {'wall s':>7} {'wait':>6} {'stale':>6} {'dropped':>8} {'reward first5 -> last5':>24}"
    )
    for r in results:
        print(
            f"{r['name']:<46} {r['steps_per_s']:>8.3f} {r['wall_s']:>7.1f} {r['wait_fraction']:>6.0%} "
            f"{r['staleness']:>6.2f} {r['dropped']:>8.0f} "
            f"{r['reward_first']:>11.3f} -> {r['reward_last']:.3f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=1, help="pairs of runs (peer, then spotgrpo)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--groups", type=int, default=2, help="prompts (groups of --num-generations) per step")
    parser.add_argument("--num-generations", type=int, default=8, help="completions per prompt (both systems)")
    parser.add_argument(
        "--prompts-per-batch", type=int, default=None, help="spotgrpo: prompts per lease (default: the learner's)"
    )
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--max-staleness", type=int, default=4)
    parser.add_argument("--only", choices=["trl", "spotgrpo"], default=None)
    parser.add_argument(
        "--profile",
        nargs="?",
        const="py-spy",
        default=None,
        metavar="PY_SPY",
        help="sample spotgrpo's actor with py-spy (path to it; not a dependency) and show where its time goes per step",
    )
    parser.add_argument("--vllm-python", type=Path, default=REPO / ".venv-vllm" / "bin" / "python")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs, metrics)")
    args = parser.parse_args()
    if not args.vllm_python.exists():
        sys.exit(f"no vLLM environment at {args.vllm_python} (make venvs, or --vllm-python)")
    from learner.tiny import save_tiny

    root = Path(tempfile.mkdtemp(prefix="bench-vs-trl-"))
    model = save_tiny(root / "model")
    data = write_data(root / "next_digit_chat.jsonl")
    print(
        f"work: tiny model, next digit as a chat turn, {args.groups} prompts x {args.num_generations} completions a "
        f"step, 16 tokens, lr {args.lr}, LoRA r8, max staleness {args.max_staleness}, {args.steps} steps; "
        f"learner side on core {LEARNER_CORE}, generator on core {GENERATOR_CORE}; logs in {root}"
    )
    ratios = []
    for pair in range(args.pairs):
        results = []
        for which, fn in (("trl", run_trl), ("spotgrpo", run_spotgrpo)):
            if args.only in (None, which):
                work = root / f"{which}-{pair}"
                work.mkdir()
                results.append(fn(args, work, model, data))
        show(results)
        if len(results) == 2:
            ratios.append(results[1]["steps_per_s"] / results[0]["steps_per_s"])
            print(f"pair {pair}: spotgrpo / TRL steps/s = {ratios[-1]:.2f}x")
    if ratios:
        print("ratios: " + ", ".join(f"{r:.2f}x" for r in ratios))
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
