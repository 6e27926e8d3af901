"""What the embedded default shows: a live table while it runs, a PNG of reward and
staleness against step, and a summary at the end."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table


class LiveProgress:
    """A rich table refreshed at every step: step, reward, staleness, groups/s, adapter
    version, actors alive, queue depths."""

    def __init__(
        self, total_steps: int, actors_alive: Callable[[], int], queue_stats: Callable[[], Any], console: Console
    ) -> None:
        self.total = total_steps
        self.actors_alive = actors_alive
        self.queue_stats = queue_stats
        self.console = console
        self.started = time.monotonic()
        self.rows: list[dict[str, Any]] = []
        self.live = Live(self._render(), console=console, refresh_per_second=4, transient=False)

    def __enter__(self) -> LiveProgress:
        self.live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.live.__exit__(*exc)  # type: ignore[arg-type]

    def update(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        self.live.update(self._render())

    def _render(self) -> Table:
        # short headers, no vertical rules and widths fixed from the start: the table fits an
        # 80-column terminal and keeps its width as figures grow (a table that wraps or widens
        # is drawn again below itself, its header twice)
        table = Table(expand=False, padding=(0, 1), box=None, pad_edge=False)
        widths = {
            "step": 2 * len(str(self.total)) + 1,
            "reward": 6,
            "last5": 6,
            "stale": 5,
            "max": 3,
            "grp/s": 6,
            "ver": len(str(self.total)) + 2,
            "actors": 6,
            "q:prm": 5,
            "q:rol": 5,
        }
        for name, width in widths.items():
            table.add_column(name, justify="right", no_wrap=True, min_width=width)
        if not self.rows:
            table.add_row("0", "-", "-", "-", "-", "-", "v0", str(self.actors_alive()), "-", "-")
            return table
        row = self.rows[-1]
        recent = [r["reward"] for r in self.rows[-5:]]
        elapsed = max(time.monotonic() - self.started, 1e-6)
        groups = sum(r["groups"] + r["dropped_stale"] + r["dropped_flat"] + r["rejected"] for r in self.rows)
        try:
            stats = self.queue_stats()
            queued = (str(stats.prompts.waiting + stats.prompts.pending), str(stats.rollouts.waiting))
        except Exception:  # the display must never take the run down
            queued = ("?", "?")
        table.add_row(
            f"{row['step']}/{self.total}",
            f"{row['reward']:.3f}",
            f"{sum(recent) / len(recent):.3f}",
            f"{row['staleness_mean']:.2f}",
            str(row["staleness_max"]),
            f"{groups / elapsed:.1f}" if groups / elapsed < 1000 else f"{groups / elapsed:.0f}",
            f"v{row['adapter_version']}",
            str(self.actors_alive()),
            *queued,
        )
        return table


def read_metrics(run_dir: Path, name: str = "metrics.jsonl") -> list[dict[str, Any]]:
    """The rows of `metrics.jsonl` (or `evals.jsonl`) in the run directory."""
    path = run_dir / name
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def read_evals(run_dir: Path) -> list[dict[str, Any]]:
    """One row per evaluation, `eval/*` figures and the step it completed at."""
    return read_metrics(run_dir, "evals.jsonl")


def plot(run_dir: Path) -> Path | None:
    """reward and staleness against step, as `curve.png` in the run directory."""
    rows = read_metrics(run_dir)
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    top.plot(steps, [r["reward"] for r in rows], label="reward (all completions)")
    top.plot(
        steps, [r.get("reward_trained_mean", r["reward"]) for r in rows], alpha=0.5, label="reward (trained groups)"
    )
    evals = [r for r in read_evals(run_dir) if r.get("eval/reward") is not None]
    if evals:
        top.plot(
            [r["step"] for r in evals],
            [r["eval/reward"] for r in evals],
            marker="o",
            label="eval reward (held-out, per version)",
        )
        top.plot(
            [r["step"] for r in evals],
            [r["eval/pass@1"] for r in evals],
            marker="x",
            linestyle=":",
            label="eval pass@1",
        )
    top.set_ylabel("reward")
    top.legend(loc="lower right")
    top.grid(alpha=0.3)
    bottom.plot(steps, [r["staleness_mean"] for r in rows], label="mean")
    bottom.plot(steps, [r["staleness_max"] for r in rows], label="max", linestyle="--")
    bottom.set_ylabel("staleness (versions)")
    bottom.set_xlabel("step")
    bottom.legend(loc="upper right")
    bottom.grid(alpha=0.3)
    fig.suptitle(f"spotgrpo run: {run_dir.name}")
    fig.tight_layout()
    out = run_dir / "curve.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def summarise(run_dir: Path, wall_s: float, extra: dict[str, Any]) -> dict[str, Any]:
    rows = read_metrics(run_dir)
    head, tail = rows[:5], rows[-5:]
    summary: dict[str, Any] = {
        "steps": rows[-1]["step"] if rows else 0,
        "wall_s": round(wall_s, 1),
        "reward_first_5": round(sum(r["reward"] for r in head) / len(head), 4) if head else None,
        "reward_last_5": round(sum(r["reward"] for r in tail) / len(tail), 4) if tail else None,
        "staleness_max": max((r["staleness_max"] for r in rows), default=0),
        "adapter_version": rows[-1]["adapter_version"] if rows else 0,
        "evaluations": {
            str(r["eval/version"]): {
                k.removeprefix("eval/"): v for k, v in r.items() if k.startswith("eval/") and k != "eval/version"
            }
            for r in read_evals(run_dir)
        },
        **extra,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
