"""How much of the learner's time goes to waiting for rollouts, on the embedded task.

Runs `learner run` (the embedded default: proxy, actors, learner on this machine) with
the given extra flags, then reads its `metrics.jsonl`: the wait fraction is the sum of
`wait_s` over the sum of `wait_s + step_s + publish_s`, with steps/s. Run it from two
checkouts to compare actors before and after a change (`--repo` names the checkout whose
code runs; the same Python environment serves both).

Usage: python bench/learner_wait.py [--repo DIR] [--steps 60] [-- extra learner flags]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--actors", type=int, default=1)
    parser.add_argument("extra", nargs="*", help="more learner flags (after --)")
    args = parser.parse_args()
    run_dir = Path(tempfile.mkdtemp(prefix="bench-wait-"))
    cmd = [
        sys.executable,
        "-m",
        "learner.cli",
        "run",
        "--steps",
        str(args.steps),
        "--actors",
        str(args.actors),
        "--run-dir",
        str(run_dir / "run"),
        "--store",
        (run_dir / "store").as_uri(),
        "--no-tensorboard",
        *args.extra,
    ]
    started = time.perf_counter()
    subprocess.run(
        cmd,
        cwd=args.repo,
        env={**os.environ, "PYTHONPATH": str(args.repo)},
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    took = time.perf_counter() - started
    rows = [json.loads(line) for line in (run_dir / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = rows[5:]  # past the start-up
    wait = sum(r["wait_s"] for r in rows)
    busy = sum(r["step_s"] + (r["publish_s"] or 0.0) for r in rows)
    span = rows[-1]["time"] - rows[0]["time"]
    print(
        f"{args.repo}: {len(rows)} steps measured, wait fraction {wait / (wait + busy):.2f}, "
        f"{len(rows) / span:.2f} steps/s, staleness {sum(r['staleness_mean'] for r in rows) / len(rows):.2f}, "
        f"reward {rows[0]['reward']:.2f} -> {rows[-1]['reward']:.2f} ({took:.0f}s in all)"
    )


if __name__ == "__main__":
    main()
