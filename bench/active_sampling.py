"""Active sampling against none, on the embedded default (`learner run`): the share of scored
groups that train, the share of generated tokens that train, the reward and the held-out
pass@1, in pairs run one after the other (off, then on) so both see the same minutes of the
machine.

The share is given for the whole run and for its second half (the cold start, when the
untrained model gets every prompt wrong, drops the same groups either way), and the flat
groups split into unsolved (all below the best reward: the cold start) and mastered (all
at it), as shares of the scored groups.

`--baseline no-revisit` compares active sampling with its revisits (`--active-sampling-revisit`)
against active sampling without them, rather than against none.

Usage: python bench/active_sampling.py [--pairs 3] [--steps 150] [--floor 0.05] [--revisit 0.5]
       [--baseline none|no-revisit] [-- extra learner flags]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any


def run(learner: str, run_dir: Path, steps: int, flags: list[str]) -> dict[str, Any]:
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [learner, "run", "--run-dir", str(run_dir), "--steps", str(steps), *flags]
    subprocess.run(cmd, check=True, capture_output=True, cwd=run_dir.parent, timeout=1800)
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    acc = summary["accounting"]

    def share(rs: list[dict[str, Any]]) -> float:
        trained = sum(r["groups"] for r in rs)
        return trained / (trained + sum(r["dropped_flat"] + r["dropped_stale"] for r in rs))

    scored = sum(r["groups"] + r["dropped_flat"] + r["dropped_stale"] for r in rows)
    unsolved = sum(r["dropped_flat_unsolved"] for r in rows)

    evals = summary["evaluations"]
    last = max(evals, key=int) if evals else None
    return {
        "groups_trained": share(rows),
        "second_half": share(rows[len(rows) // 2 :]),
        # of the scored groups: flat below the best reward (the cold start), flat at it (mastery)
        "flat_unsolved": unsolved / scored,
        "flat_mastered": sum(r["dropped_flat"] for r in rows) / scored - unsolved / scored,
        "tokens_trained": acc["tokens"]["trained_share"],
        "reward_last_5": summary["reward_last_5"],
        "pass@1": evals[last]["pass@1"] if last else float("nan"),
        "skipped": rows[-1].get("sampling/skipped_prompts", 0),
        "wall_s": summary["wall_s"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--floor", type=float, default=0.05)
    parser.add_argument("--revisit", type=float, default=0.5, help="--active-sampling-revisit of the active arm")
    parser.add_argument("--baseline", choices=["none", "no-revisit"], default="none")
    parser.add_argument("extra", nargs="*", help="more `learner run` flags (after --)")
    args = parser.parse_args()
    learner = str(Path(sys.executable).with_name("learner"))
    active = ["--active-sampling", "--active-sampling-floor", str(args.floor)]
    arms = {
        args.baseline: ["--no-active-sampling"]
        if args.baseline == "none"
        else [*active, "--active-sampling-revisit", "0"],
        "active": [*active, "--active-sampling-revisit", str(args.revisit)],
    }
    results: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
    with tempfile.TemporaryDirectory(prefix="active-sampling-") as tmp:
        for pair in range(args.pairs):
            for arm, flags in arms.items():
                results[arm].append(run(learner, Path(tmp) / f"{arm}-{pair}", args.steps, [*flags, *args.extra]))
                r = results[arm][-1]
                print(
                    f"pair {pair + 1} {arm:9s}  groups trained {r['groups_trained']:.3f} "
                    f"(second half {r['second_half']:.3f}; flat unsolved {r['flat_unsolved']:.3f}, "
                    f"mastered {r['flat_mastered']:.3f})  tokens trained {r['tokens_trained']:.3f}  "
                    f"reward {r['reward_last_5']:.3f}  pass@1 {r['pass@1']:.3f}  skipped {r['skipped']}  "
                    f"{r['wall_s']:.1f}s",
                    flush=True,
                )
    for key in (
        "groups_trained",
        "second_half",
        "flat_unsolved",
        "flat_mastered",
        "tokens_trained",
        "reward_last_5",
        "pass@1",
    ):
        base, active = (statistics.mean(r[key] for r in results[arm]) for arm in arms)
        print(f"{key:15s} {args.baseline} {base:.3f}  active {active:.3f}  ratio {active / base:.3f}x")


if __name__ == "__main__":
    main()
