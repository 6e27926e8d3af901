"""The learner's peak memory and step time on the calculator example's shape: SmolLM2-135M
(`learner make-model`, float32, LoRA r16 all-linear), one step of 2 groups x 8 with
prompts of 700 tokens (the tools' schemas) and completions of 96, the micro-batch budget
the learner picks for the model's vocabulary.

Each measurement runs in a fresh process (peak resident memory is a per-process high-water
mark, `ru_maxrss`): load the model, one warm-up step, one timed step. `--code DIR` runs the
same measurement on another checkout of the project (a `git worktree` of an earlier commit),
so before and after are measured by one script in the same minutes.

Usage: python bench/learner_memory.py [--code DIR ...] [--prompt 700] [--completion 96] [--repeat 1]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import json
import os
import subprocess

ONE = r"""
import json, resource, sys, time
import torch
from learner.config import LearnerConfig
from learner.policy import Policy
from learner.tiny import synthetic_batch
from learner.train import train_on
model, prompt, completion = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
cfg = LearnerConfig(model=model, lora_rank=16, lora_alpha=32, max_tokens=completion, learning_rate=1e-5)
torch.manual_seed(0)
policy = Policy(cfg)
optimizer = torch.optim.AdamW(policy.trainable_parameters(), lr=cfg.learning_rate)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
batch = synthetic_batch(policy, 2, 8, prompt, completion)
loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
train_on(policy, optimizer, scheduler, batch, cfg)
started = time.perf_counter()
metrics = train_on(policy, optimizer, scheduler, batch, cfg)
step_s = time.perf_counter() - started
print(json.dumps({"loaded_mb": loaded, "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "step_s": step_s, "loss": metrics.get("loss")}))
"""


def measure(code: Path, model: Path, prompt: int, completion: int) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", ONE, str(model), str(prompt), str(completion)],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "PYTHONPATH": str(code)},
        cwd=code,
    )
    if out.returncode != 0:
        raise SystemExit(f"{code}: {out.stderr[-2000:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--code", type=Path, nargs="*", default=[], help="other checkouts to measure beside this one")
    parser.add_argument("--prompt", type=int, default=700)
    parser.add_argument("--completion", type=int, default=96)
    parser.add_argument("--repeat", type=int, default=1, help="measurements of each checkout, alternated")
    args = parser.parse_args()
    from learner.models import make_model

    model = make_model()
    here = Path(__file__).resolve().parents[1]
    print(
        f"SmolLM2-135M float32, LoRA r16, 2 groups x 8, prompts {args.prompt} + completions {args.completion} "
        f"tokens; one process per row"
    )
    print(f"{'checkout':<40} {'loaded MB':>9} {'peak MB':>8} {'step s':>7} {'loss':>10}")
    for _ in range(args.repeat):
        for code in [*args.code, here]:
            m = measure(code, model, args.prompt, args.completion)
            print(
                f"{code!s:<40} {m['loaded_mb']:>9.0f} {m['peak_mb']:>8.0f} {m['step_s']:>7.1f} {m['loss']:>10.5f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
