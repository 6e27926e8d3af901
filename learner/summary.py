"""The end of a run, the same in every mode (`learner run` embedded or over --queue):
where every issued prompt went, `summary.json`, `curve.png` and one `done:` line."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from rich.console import Console

from learner.config import LearnerConfig
from learner.progress import plot, summarise
from learner.token_use import UNSOLVED, token_accounting, token_line

log = logging.getLogger(__name__)


def accounting(state: Any, cfg: LearnerConfig, stats: Any | None, eval_in_queue: int = 0) -> dict[str, Any]:
    """Where every issued prompt went: trained, dropped (by reason), dead-lettered, or
    still in the queue when the run stopped. The queue also holds the evaluations still
    out (`eval_in_queue` prompts), which are not training prompts."""
    totals = dict(state.totals)
    # a duplicate is a second copy of a consumed prompt's group, not a prompt of its own
    dropped = {k: v for k, v in totals.items() if k.startswith(("dropped_", "rejected_")) and k != "rejected_duplicate"}
    dead = totals.get("dead_lettered_prompts", 0)
    out: dict[str, Any] = {
        "issued": state.ledger.issued,  # a dishonest worker's prompts twice (`learner.judge.Reason.reissued`)
        "trained": totals.get("trained_groups", 0),
        "dropped": dropped,
        "dead_lettered": dead,
        "duplicates_skipped": totals.get("rejected_duplicate", 0),
        # what workers said they generated, checked (`learner.audit`; `reissued` is in `issued`)
        "audited": totals.get("audited_groups", 0),
        "quarantined_workers": sorted(state.quarantined),
        "reissued": state.ledger.reissued,
        "revisited": state.ledger.revisited,  # prompts whose groups taught, issued again (`learner.active`)
        # of `dropped.dropped_flat`: all below the best reward read (too hard so far), not mastered
        "flat_unsolved": totals.get(UNSOLVED, 0),
        # every group the learner read, by verdict, those of a collection a stop cut short too
        # (they stay pending in the queue, so `dropped` leaves them out)
        "read": {k.removeprefix("read/"): v for k, v in sorted(totals.items()) if k.startswith("read/")},
        # where every generated token of a consumed group went (`learner.token_use`)
        "tokens": token_accounting(totals),
    }
    if cfg.scoring_mode == "trusted":
        out["scored"] = totals.get("scored_groups", 0)
        out["rejected_by_scoring"] = totals.get("rejected_scoring", 0)
    if stats is not None:
        in_scoring = stats.unscored.length if stats.unscored is not None else 0
        if cfg.scoring_mode == "trusted":
            out["in_scoring"] = in_scoring
        waiting = stats.prompts_waiting
        if waiting is None:  # batches of prompts_per_batch: a batch partly submitted counts whole
            waiting = stats.prompts.length * cfg.prompts_per_batch
        out["in_queue"] = waiting + stats.rollouts.length + in_scoring - eval_in_queue
        out["eval_in_queue"] = eval_in_queue
        out["leases_at_end"] = dict(stats.leases_by_worker)
        out["balanced"] = out["issued"] == out["trained"] + sum(dropped.values()) + dead + out["in_queue"]
    return out


def finish_run(
    cfg: LearnerConfig,
    state: Any | None,
    stats: Any | None,
    wall_s: float,
    console: Console,
    eval_in_queue: int = 0,
    curve: Path | None = None,
) -> dict[str, Any]:
    """Plot (unless `curve` was drawn already), summarise and say how the run ended;
    returns the summary (`summary.json`)."""
    run_dir = cfg.resolved_run_dir
    curve = curve or plot(run_dir)
    summary = summarise(
        run_dir,
        wall_s,
        {
            "accounting": accounting(state, cfg, stats, eval_in_queue) if state is not None else {},
            "curve": str(curve) if curve else None,
            "metrics": str(run_dir / "metrics.jsonl"),
        },
    )
    console.print(done_line(summary, run_dir / "summary.json"))
    return summary


def done_line(summary: dict[str, Any], path: Any) -> str:
    files = f"\n  metrics {summary['metrics']}\n  summary {path}"
    if not summary["steps"]:
        return (
            f"\n[bold]done[/bold]: no step was taken in {summary['wall_s']}s (stopped before the first step "
            f"had its groups; see the lines above for why), so there is no curve.{files}"
        )
    evals = summary["evaluations"]
    held_out = ""
    if evals:
        first, last = min(evals, key=int), max(evals, key=int)
        p1 = {v: evals[v].get("pass@1") for v in (first, last)}
        shown = {v: "-" if p is None else f"{p:.3f}" for v, p in p1.items()}
        held_out = f"; held-out pass@1 {shown[first]} (v{first}) -> {shown[last]} (v{last})" + (
            " (cut short)" if evals[last].get("cut_short") else ""
        )
    tokens = token_line(summary.get("accounting", {}).get("tokens", {}))
    tokens = f"\n  {tokens}" if tokens else ""
    return (
        f"\n[bold]done[/bold]: {summary['steps']} steps in {summary['wall_s']}s; reward {summary['reward_first_5']} "
        f"(first 5 steps) -> {summary['reward_last_5']} (last 5){held_out}; max staleness {summary['staleness_max']}; "
        f"adapter v{summary['adapter_version']}.{tokens}\n  plot {summary['curve']}{files}"
    )


def final_stats(queue: Any) -> Any | None:
    """The queue's figures for the summary's accounting; the summary can do without them."""
    try:
        return dataclasses.replace(queue.stats(), prompts_waiting=queue.prompts_waiting())
    except Exception as err:
        log.warning("no final queue statistics: %s", err)
        return None
