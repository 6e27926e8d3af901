"""What staleness costs, and what the off-policy correction buys back, on the built-in task.

Every training batch is generated with the adapter exactly k versions behind the learner
(`--lag-versions k`: batches pinned to that version, one step's worth at a time; the
mechanism `tests/test_evaluation.py` checks step by step), for k in `--lags`, with each
correction in `--corrections` (`none`, `tis`, `mis`, and `ppo`: decoupled PPO with
`--updates-per-batch 2`), over `--seeds`. Each run is the embedded default (`learner run`
with the built-in next-digit task, its proxy and actors) for `--steps` steps. It prints the
final reward (mean `reward` of the last 10 steps) per cell as mean ± spread over the
seeds, and as a ratio to the on-policy run (k = 0, no correction) of the same seed. A run
whose policy collapses (every group all-equal: nothing left to train on) is stopped after
10 minutes and counted with the reward it had. The actors score their own groups
(`--scoring actors`): what is measured is the correction, not the scoring tier.

Usage: python bench/staleness.py [--lags 0 2 4 8] [--corrections none tis mis ppo] [--seeds 0 1 2]
A full grid is 13 configurations x 3 seeds of about 40 s each on two cores.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CORRECTIONS = {
    "none": ["--correction", "none"],
    "tis": ["--correction", "tis"],
    "mis": ["--correction", "mis"],
    "ppo": ["--correction", "tis", "--updates-per-batch", "2"],
}


STALLED: list[str] = []


def final_reward(lag: int, correction: str, seed: int, steps: int, extra: list[str], timeout_s: float = 600) -> float:
    run_dir = Path(tempfile.mkdtemp(prefix=f"bench-stale-k{lag}-{correction}-s{seed}-"))
    cmd = [
        sys.executable,
        "-m",
        "learner.cli",
        "run",
        "--run-dir",
        str(run_dir),
        "--steps",
        str(steps),
        "--seed",
        str(seed),
        "--lag-versions",
        str(lag),
        "--max-inflight",
        "16",
        "--groups-per-step",
        "16",
        "--max-staleness",
        str(max(lag, 4)),
        "--no-tensorboard",
        "--scoring",
        "actors",
        *CORRECTIONS[correction],
        *extra,
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        if proc.wait(timeout=timeout_s) != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}; see {run_dir / 'logs'}")
    except subprocess.TimeoutExpired:
        # a collapsed policy: every group all-equal, so the learner waits forever for 16
        # it can train on. Its reward is what it had; the run counts as stalled.
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        STALLED.append(f"k={lag} {correction} seed {seed}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return statistics.mean(r["reward"] for r in rows[-10:]) if rows else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lags", type=int, nargs="+", default=[0, 2, 4, 8])
    parser.add_argument("--corrections", nargs="+", default=list(CORRECTIONS), choices=list(CORRECTIONS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("extra", nargs="*", help="more learner flags (after --)")
    args = parser.parse_args()
    on_policy = {s: final_reward(0, "none", s, args.steps, args.extra) for s in args.seeds}
    print(
        f"final reward (last 10 of {args.steps} steps), mean ± spread over seeds {args.seeds}; "
        f"ratio to on-policy (k=0, no correction: {statistics.mean(on_policy.values()):.3f})"
    )
    print(f"{'k':>3} " + " ".join(f"{c:>22}" for c in args.corrections), flush=True)
    print("on-policy per seed: " + ", ".join(f"{s}: {v:.3f}" for s, v in on_policy.items()), flush=True)
    for lag in [k for k in args.lags if k > 0]:
        cells = []
        for correction in args.corrections:
            finals = {s: final_reward(lag, correction, s, args.steps, args.extra) for s in args.seeds}
            values = list(finals.values())
            ratios = [finals[s] / on_policy[s] for s in args.seeds if on_policy[s] > 0]
            spread = (max(values) - min(values)) / 2
            cells.append(f"{statistics.mean(values):.3f}±{spread:.3f} ({min(ratios):.2f}-{max(ratios):.2f}x)")
            print(
                f"  (k={lag} {correction}: " + ", ".join(f"{s}: {v:.3f}" for s, v in finals.items()) + ")",
                file=sys.stderr,
                flush=True,
            )
        print(f"{lag:>3} " + " ".join(f"{c:>22}" for c in cells), flush=True)
    if STALLED:
        print(
            f"stalled (no trainable group for {600}s; their reward is that of their last 10 steps): "
            + "; ".join(STALLED)
        )


if __name__ == "__main__":
    main()
