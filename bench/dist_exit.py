"""How often a torchrun rank aborts on its way out, by how it exits.

Each run is `torchrun --nproc-per-node 2` (gloo, CPU) over the learner's own pieces: a
tiny model sharded with FSDP2, three training steps, a checkpoint snapshot, the adapter
gathered, STOP to the follower; then every rank either

- `finalize`: destroys the process group and returns, so the interpreter finalizes
  (the baseline: what the learner did before `Dist.exit`), or
- `exit`: `Dist.exit(0)` (destroy, flush, `os._exit`), what every rank does now.

A run fails when torchrun exits non-zero; the usual failure is a rank killed by SIGABRT
("terminate called without an active exception": a gloo worker thread still releasing
the last collective's tensors takes the GIL from the finalizing interpreter).

Usage: python bench/dist_exit.py [--runs 40]
"""

from __future__ import annotations

import sys
from pathlib import Path

# run as a script, this folder would come first on the path (bench/queue.py shadows `queue`)
sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import os
import re
import subprocess
import tempfile
import time

MODES = ("finalize", "exit")


def rank_main(model: str, mode: str) -> int:
    import torch

    from bench.learner import synthetic_batch
    from learner.config import LearnerConfig
    from learner.dist import Dist
    from learner.trainer import Trainer

    dist = Dist.from_env("cpu")
    cfg = LearnerConfig(
        model=model, lora_rank=4, max_tokens=6, learning_rate=1e-2, micro_batch_size=2, max_tokens_per_microbatch=24
    )
    torch.manual_seed(0)
    trainer = Trainer(cfg, dist)
    if dist.main:
        batch = synthetic_batch(trainer.policy, groups=2, group_size=4, prompt_len=4, completion_len=5)
        for _ in range(3):
            trainer.step(batch)
        trainer.snapshot()
        trainer.adapter()
        trainer.stop()
    else:
        trainer.follow()
    if mode == "exit":
        dist.exit(0)
    dist.close()
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=40, help="torchrun runs per mode")
    parser.add_argument("--rank", nargs=2, metavar=("MODEL", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        sys.exit(rank_main(*args.rank))
    from learner.tiny import save_tiny

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        model = str(save_tiny(Path(tmp) / "model"))
        results = {}
        for mode in MODES:
            failed, signals, started = 0, set(), time.perf_counter()
            for _ in range(args.runs):
                proc = subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "torch.distributed.run",
                        "--nproc-per-node",
                        "2",
                        __file__,
                        "--rank",
                        model,
                        mode,
                    ],
                    env=env,
                    capture_output=True,
                    text=True,
                )
                if proc.returncode != 0:
                    failed += 1
                    signals |= set(re.findall(r"exitcode\s*:\s*(-?\d+ \(pid: \d+\)\s*(?:\(\w+\))?)", proc.stderr))
            results[mode] = failed
            print(
                (
                    f"{mode:9s} {failed:3d} of {args.runs} runs failed  "
                    f"({(time.perf_counter() - started) / args.runs:.1f} s a run)"
                )
                + (f"  exit codes: {'; '.join(sorted(signals))}" if signals else ""),
                flush=True,
            )
    print(f"failure rate: finalize {results['finalize'] / args.runs:.3f}, exit {results['exit'] / args.runs:.3f}")


if __name__ == "__main__":
    main()
