"""Learner step time and adapter publishing cost, by LoRA rank.

On a randomly initialised model with Qwen2.5-0.5B's layer shapes (24 layers, hidden
896; the vocabulary is the tiny character tokenizer's, so the figures are the
transformer's, not a 150k-row embedding's), for LoRA ranks 1, 16 and 64:

- step_s: one learner step (forward, backward, optimizer) on a synthetic batch;
- publish_s: how long the step is blocked by publishing (snapshot + hand-over to the
  background uploader), against the baseline of publishing inline (serialise, hash,
  upload, manifest) in the same process;
- the adapter's size, and the fraction of wall time blocked on publishing.

With `--scaling`: training throughput and peak memory of one learner step loop at rank
16 (`--scaling-rank`) in 1 process and in 2 (torchrun, FSDP2: gloo on the CPU, NCCL on
GPUs): sequence tokens (prompt + completion) trained per second, completion tokens per
second, and peak memory per process (CUDA `max_memory_allocated` on a GPU, the process's
peak RSS on the CPU), with the ratios of 2 processes to 1. The batch is the same; in 2
processes each rank trains on half of it (by token count).

Usage: python bench/learner.py [--ranks 1 16 64] [--steps 3]
       python bench/learner.py --scaling [--device cpu|cuda] [--dtype bfloat16] [--steps 3]
"""

from __future__ import annotations

import sys
from pathlib import Path

# run as a script, this folder would come first on the path, and this file and
# bench/queue.py would shadow the `learner` package and the standard `queue` module
sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import statistics
import tempfile
import time

import torch

from learner.config import LearnerConfig
from learner.policy import (
    Policy,
    adapter_files,
)
from learner.publish import Publisher, PublishJob
from learner.tiny import QWEN25_05B_SHAPE, build_tokenizer, save_tiny, synthetic_batch
from learner.train import train_on
from protocol.trusted.store import open_store


class NullAnnounce:
    """The queue's announce is measured by bench/queue.py; here it costs nothing."""

    def announce(self, manifest: object) -> str:
        return "0-1"


def inline_publish(store, version: int, state, config_json: bytes) -> None:
    """Baseline: the training thread serialises and uploads the adapter itself."""
    for name, data in adapter_files(state, config_json).items():
        store.put(f"adapters/v{version}/{name}", data)


def open_bench_store(kind: str, tmp: str):
    if kind == "file":
        return open_store(str(Path(tmp) / "store")), None
    import logging
    import os

    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one access-log line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.update(
        AWS_ENDPOINT_URL=f"http://{host}:{port}",
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
    )
    boto3.client("s3").create_bucket(Bucket="bench-adapters")
    return open_store("s3://bench-adapters/run"), server


class RankBench:
    """One rank's policy, optimizer and batch; `run(mode)` times steps with publishing
    after each: none, background (the learner's way) or inline (the baseline)."""

    def __init__(self, model_dir: Path, rank: int, store, args: argparse.Namespace) -> None:
        self.cfg = LearnerConfig(
            model=str(model_dir),
            lora_rank=rank,
            lora_alpha=2 * rank,
            micro_batch_size=8,
            max_tokens=args.completion_len,
            learning_rate=1e-5,
        )
        self.policy = Policy(self.cfg)
        self.optimizer = torch.optim.AdamW(self.policy.trainable_parameters(), lr=self.cfg.learning_rate)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda _: 1.0)
        self.batch = synthetic_batch(self.policy, args.groups, args.group_size, args.prompt_len, args.completion_len)
        self.store = store
        self.steps = args.steps
        self.version = rank * 10_000
        self.publisher = Publisher(store, NullAnnounce(), base_model="bench", rank=rank)
        self.step()  # warm-up

    def step(self) -> None:
        train_on(self.policy, self.optimizer, self.scheduler, self.batch, self.cfg)

    def run(self, mode: str) -> tuple[float, list[float], list[float]]:
        steps, blocked = [], []
        started = time.perf_counter()
        for _ in range(self.steps):
            t = time.perf_counter()
            self.step()
            steps.append(time.perf_counter() - t)
            self.version += 1
            t = time.perf_counter()
            if mode == "background":
                self.publisher.submit(
                    PublishJob(
                        self.version, self.version, self.policy.adapter_state(), self.policy.adapter_config_json()
                    )
                )
            elif mode == "inline":
                inline_publish(self.store, self.version, self.policy.adapter_state(), self.policy.adapter_config_json())
            blocked.append(time.perf_counter() - t)
        self.publisher.flush()  # the last upload counts against the mode's wall time
        return time.perf_counter() - started, steps, blocked


def scaling_worker(args: argparse.Namespace) -> None:
    """One process of the scaling benchmark (alone, or a rank of torchrun's): warm up,
    time `--steps` steps, write this rank's figures to `<out>.rank<r>.json`."""
    import json
    import resource

    from learner.dist import Dist
    from learner.trainer import Trainer

    dist = Dist.from_env(args.device)
    cfg = LearnerConfig(
        model=str(args.model_dir),
        lora_rank=args.scaling_rank,
        lora_alpha=2 * args.scaling_rank,
        max_tokens=args.completion_len,
        learning_rate=1e-5,
        device=args.device,
        dtype=args.dtype,
        micro_batch_size=64,
        max_tokens_per_microbatch=args.max_tokens_per_microbatch,
        gradient_checkpointing=args.gradient_checkpointing,
    )
    torch.manual_seed(0)
    trainer = Trainer(cfg, dist)
    if not dist.main:
        trainer.follow()
    else:
        batch = synthetic_batch(trainer.policy, args.groups, args.group_size, args.prompt_len, args.completion_len)
        trainer.step(batch)  # warm-up
        if dist.device.type == "cuda":
            torch.cuda.synchronize()
        started, completion_tokens = time.perf_counter(), 0
        for _ in range(args.steps):
            completion_tokens += int(trainer.step(batch)["tokens"])
        if dist.device.type == "cuda":
            torch.cuda.synchronize()
        took = time.perf_counter() - started
        trainer.stop()
        sequence_tokens = sum(batch.lengths()) * args.steps
    peak = (
        torch.cuda.max_memory_allocated(dist.device)
        if dist.device.type == "cuda"
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )
    figures: dict[str, float] = {"peak_bytes": peak}
    if dist.main:
        figures |= {
            "seconds": took,
            "sequence_tokens_per_s": sequence_tokens / took,
            "completion_tokens_per_s": completion_tokens / took,
        }
    Path(f"{args.out}.rank{dist.rank}.json").write_text(json.dumps(figures))
    dist.exit(0)


def scaling(args: argparse.Namespace) -> None:
    import json
    import os
    import subprocess

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_tiny(Path(tmp) / "model", **QWEN25_05B_SHAPE)
        print(
            f"model: Qwen2.5-0.5B shape ({QWEN25_05B_SHAPE['num_layers']} layers, hidden "
            f"{QWEN25_05B_SHAPE['hidden_size']}), LoRA rank {args.scaling_rank}, {args.dtype} base, device "
            f"{args.device}; batch {args.groups}x{args.group_size} sequences of {args.prompt_len}+"
            f"{args.completion_len} tokens, token budget {args.max_tokens_per_microbatch} per micro-batch; "
            f"{args.steps} steps after a warm-up; {os.cpu_count()} CPU cores"
        )
        worker = [
            str(Path(__file__).resolve()),
            "--scaling-worker",
            "--model-dir",
            str(model_dir),
            "--device",
            args.device,
            "--dtype",
            args.dtype,
            "--steps",
            str(args.steps),
            "--scaling-rank",
            str(args.scaling_rank),
            "--groups",
            str(args.groups),
            "--group-size",
            str(args.group_size),
            "--prompt-len",
            str(args.prompt_len),
            "--completion-len",
            str(args.completion_len),
            "--max-tokens-per-microbatch",
            str(args.max_tokens_per_microbatch),
            *(["--gradient-checkpointing"] if args.gradient_checkpointing else []),
        ]
        results = {}
        for world in args.worlds:
            out = Path(tmp) / f"world{world}"
            launch = (
                [sys.executable]
                if world == 1
                else [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world)]
            )
            env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // world))}
            subprocess.run(
                [*launch, *worker, "--out", str(out)],
                check=True,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            ranks = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(world)]
            results[world] = {
                **ranks[0],
                "peak_bytes": max(r["peak_bytes"] for r in ranks),
                "follower_peak_bytes": max((r["peak_bytes"] for r in ranks[1:]), default=0),
            }
        base = results[args.worlds[0]]
        print(
            f"{'processes':>9} {'seq tok/s':>10} {'compl tok/s':>11} {'peak MB/proc':>12} {'tok/s ratio':>11} "
            f"{'peak ratio':>10} {'other ranks MB':>14}"
        )
        for world, r in results.items():
            print(
                f"{world:>9} {r['sequence_tokens_per_s']:>10.0f} {r['completion_tokens_per_s']:>11.0f} "
                f"{r['peak_bytes'] / 2**20:>12.0f} {r['sequence_tokens_per_s'] / base['sequence_tokens_per_s']:>11.2f} "
                f"{r['peak_bytes'] / base['peak_bytes']:>10.2f} "
                + (f"{r['follower_peak_bytes'] / 2**20:>14.0f}" if r["follower_peak_bytes"] else f"{'-':>14}")
            )
        print(
            "ratios against 1 process; peak: the largest over the processes (CUDA max_memory_allocated on a GPU, "
            "peak RSS on the CPU, which includes the Python runtime and torch's libraries): rank 0's, which "
            "reads the whole model; other ranks: the largest of the rest, which build theirs on the meta "
            "device and receive only their shards"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--steps", type=int, default=3, help="steps per mode (none, background, inline)")
    parser.add_argument("--store", choices=["file", "s3"], default="file", help="s3: a moto server over HTTP")
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--completion-len", type=int, default=32)
    parser.add_argument("--scaling", action="store_true", help="throughput and peak memory in 1 and 2 processes")
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--scaling-rank", type=int, default=16)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--max-tokens-per-microbatch", type=int, default=16384)
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--scaling-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.scaling_worker:
        return scaling_worker(args)
    if args.scaling:
        return scaling(args)

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_tiny(Path(tmp) / "model", **QWEN25_05B_SHAPE)
        store, server = open_bench_store(args.store, tmp)
        print(
            f"model: Qwen2.5-0.5B shape ({QWEN25_05B_SHAPE['num_layers']} layers, hidden "
            f"{QWEN25_05B_SHAPE['hidden_size']}), vocab {len(build_tokenizer())}, float32, "
            f"{torch.get_num_threads()} threads; batch {args.groups}x{args.group_size} sequences of "
            f"{args.prompt_len}+{args.completion_len} tokens; store {args.store}; {args.steps} steps per mode"
        )
        print(
            f"{'rank':>5} {'adapter MB':>10} {'step_s':>7} {'step_s bg':>9} {'publish_s':>9} "
            f"{'inline_s':>8} {'ratio':>6} {'upload_s':>8} {'blocked %':>9}"
        )
        for rank in args.ranks:
            bench = RankBench(model_dir, rank, store, args)
            _, steps, _ = bench.run("none")
            wall_bg, steps_bg, blocked = bench.run("background")
            _, _, inline = bench.run("inline")
            bench.publisher.close()
            size_mb = len(adapter_files(bench.policy.adapter_state(), b"{}")["adapter_model.safetensors"]) / 2**20
            publish_s, inline_s = statistics.median(blocked), statistics.median(inline)
            print(
                f"{rank:>5} {size_mb:>10.2f} {statistics.median(steps):>7.2f} {statistics.median(steps_bg):>9.2f} "
                f"{publish_s:>9.4f} {inline_s:>8.3f} {publish_s / inline_s:>6.3f} "
                f"{statistics.median(bench.publisher.upload_s):>8.3f} {100 * sum(blocked) / wall_bg:>8.2f}%"
            )
            del bench
        if server is not None:
            server.stop()
        print(
            "step_s: median step without publishing; step_s bg: with an upload running in the background; "
            "publish_s: median time the training thread is blocked per publish (snapshot + hand-over); "
            "inline_s: the baseline, publishing on the training thread; ratio = publish_s / inline_s; "
            "upload_s: the background thread's upload time; blocked %: blocked time / wall time "
            "with background publishing every step"
        )


if __name__ == "__main__":
    main()
