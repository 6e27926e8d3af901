"""One short run of the whole system on this machine, with the figures a GPU check wants.

A private redis-server, a `file://` store, a small model built locally (4 layers, hidden
256, head size 64: shapes every attention kernel serves), the next-digit task; one
`actors run` (vLLM on the GPU, sharing it with the learner through
`--gpu-memory-utilization`; or transformers) and `learner run` (by default on CUDA in
bfloat16, under `torchrun --nproc-per-node 1`, the launcher a multi-GPU run uses). Then,
from the learner's `metrics.jsonl` and the actor's Prometheus metrics:

- learner tokens/s: completion tokens trained over the time spent in steps;
- peak memory: the learner's (`memory_peak_mb`: CUDA allocated, or RSS on the CPU);
- learner wait fraction: time waiting for rollouts over wait + step + publish;
- announce -> loaded: the actor's mean time from an announcement to the adapter loaded
  (download, sha256, engine load), and the learner's mean publish block;
- mean |Δ log-prob| between the sampler's log-probabilities and the learner's, on the
  steps where every group was on-policy (staleness 0: numerics alone), and over all steps.

Usage: python bench/system_check.py [--device cuda|cpu] [--dtype bfloat16] [--engine vllm|transformers]
       [--steps 60] [--actor-python PATH]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])  # the repository, not bench/

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request

from bench.queue import stop

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int, name: str) -> dict[str, float]:
    """`<name>_sum` and `<name>_count` from a Prometheus endpoint."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for suffix in ("sum", "count"):
        m = re.search(rf"^{name}_{suffix} ([0-9.e+-]+)$", text, re.M)
        out[suffix] = float(m.group(1)) if m else 0.0
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--engine", default="vllm", choices=["vllm", "transformers"])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.3,
        help="the actor's share of the GPU; the learner takes what it needs of the rest",
    )
    parser.add_argument("--actor-python", default=sys.executable, help="the Python the actor runs in")
    parser.add_argument("--keep", type=Path, default=None)
    args = parser.parse_args()

    from learner.tasks import write_next_digit_dataset
    from learner.tiny import save_tiny

    work = args.keep or Path(tempfile.mkdtemp(prefix="spotgrpo-check-"))
    work.mkdir(parents=True, exist_ok=True)
    model = save_tiny(work / "model", hidden_size=256, intermediate_size=512, num_layers=4, num_heads=4)
    data = write_next_digit_dataset(work / "data.jsonl")
    port, metrics_port = free_port(), free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    procs: list[subprocess.Popen[bytes]] = []
    started = time.monotonic()
    try:
        procs.append(
            subprocess.Popen(
                [
                    shutil.which("redis-server") or "redis-server",
                    "--port",
                    str(port),
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--dir",
                    str(work),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        time.sleep(0.5)
        queue, store = f"redis://127.0.0.1:{port}/0", (work / "store").as_uri()
        from bench.queue import start_proxy

        proxy, proxy_url, worker_env = start_proxy(work, queue, store, "check")
        procs.append(proxy)
        engine = ["--engine", args.engine]
        if args.engine == "vllm":
            engine += [
                "--gpu-memory-utilization",
                str(args.gpu_memory_utilization),
                "--max-model-len",
                "256",
                "--max-lora-rank",
                "16",
                "--dtype",
                args.dtype,
            ]
        with (work / "actor.log").open("wb") as log:
            procs.append(
                subprocess.Popen(
                    [
                        args.actor_python,
                        "-m",
                        "actors.cli",
                        "run",
                        "--queue",
                        proxy_url,
                        "--run",
                        "check",
                        "--model",
                        str(model),
                        *engine,
                        "--reward",
                        "protocol.usercode.tasks:next_digit",
                        "--metrics-port",
                        str(metrics_port),
                        "--lease-timeout-s",
                        "30",
                    ],
                    env={**env, **worker_env},
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
        learner = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "1",
            "-m",
            "learner",
            "run",
            "--run-name",
            "check",
            "--queue",
            queue,
            "--store",
            store,
            "--model",
            str(model),
            "--dataset",
            str(data),
            "--reward",
            "protocol.usercode.tasks:next_digit",
            "--scoring",
            "actors",
            "--run-dir",
            str(work / "run"),
            "--device",
            args.device,
            "--dtype",
            args.dtype,
            "--steps",
            str(args.steps),
            "--max-tokens",
            "2",
            "--learning-rate",
            "3e-3",
            "--lora-rank",
            "8",
            "--groups-per-step",
            "16",
            "--prompts-per-batch",
            "4",
            "--num-generations",
            "8",
            "--max-inflight",
            "48",
            "--max-staleness",
            "4",
            "--checkpoint-every",
            "20",
            "--no-tensorboard",
            "--startup-timeout-s",
            "300",
        ]
        with (work / "learner.log").open("wb") as log:
            run = subprocess.run(learner, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=900)
        if run.returncode != 0:
            sys.exit(f"the learner failed (exit {run.returncode}); see {work / 'learner.log'}")
        loads = scrape(metrics_port, "spotgrpo_actor_adapter_load_seconds")
    finally:
        stop(list(reversed(procs)), timeout_s=60)
    rows = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines()]
    steady = rows[5:] or rows  # past the start-up
    step_s = sum(r["step_s"] for r in steady)
    wait, busy = sum(r["wait_s"] for r in steady), step_s + sum(r["publish_s"] or 0.0 for r in steady)
    on_policy = [r["sampling/sampling_logp_difference/mean"] for r in rows if r["staleness_max"] == 0]
    figures = {
        "device": args.device,
        "dtype": args.dtype,
        "engine": args.engine,
        "steps": len(rows),
        "learner_tokens_per_s": sum(r["tokens"] for r in steady) / step_s,
        "peak_memory_mb": max(r["memory_peak_mb"] for r in rows),
        "learner_wait_fraction": wait / (wait + busy),
        "announce_to_loaded_s": loads["sum"] / loads["count"] if loads["count"] else None,
        "adapters_loaded": int(loads["count"]),
        "publish_block_s_mean": sum(r["publish_s"] or 0.0 for r in rows) / len(rows),
        "logp_abs_diff_on_policy": sum(on_policy) / len(on_policy) if on_policy else None,
        "on_policy_steps": len(on_policy),
        "logp_abs_diff_all": sum(r["sampling/sampling_logp_difference/mean"] for r in rows) / len(rows),
        "staleness_mean": sum(r["staleness_mean"] for r in rows) / len(rows),
        "reward_first_last": [rows[0]["reward"], rows[-1]["reward"]],
        "wall_s": round(time.monotonic() - started, 1),
    }
    print(json.dumps(figures, indent=1))
    if args.keep is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
