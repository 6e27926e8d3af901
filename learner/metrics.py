"""Where the learner's figures go: `metrics.jsonl` (one object per step), `evals.jsonl`
(one object per evaluation of a version, `eval/*`, with the step it completed at), a
console line, and the trackers.

Also `consumed.jsonl`: per step, the ids of the rollout groups trained on and of those
dropped (with the reason), the audit trail of exactly-once training. On resume both
files are cut back to the checkpoint's step, because the steps after it are redone. And
`issued.jsonl`: every training batch as it goes to the queue, its id and prompt ids (the
data set positions, `p<position>`) and the step it was issued at. It is not cut back: a
resumed learner issues a batch the crashed one issued after its checkpoint again, under
the same id with the same prompts, and names it again (`bench/chaos.py` checks that both
lines agree).

Names follow TRL's GRPOTrainer where TRL has one (`reward`, `reward_std`,
`rewards/<fn>/mean`, `kl`, `entropy`, `clip_ratio/region_mean`, `completions/mean_length`,
`completions/clipped_ratio`, `frac_reward_zero_std`, `num_tokens`, `tools/call_frequency`,
`sampling/importance_sampling_ratio/mean`, ...), unprefixed in `metrics.jsonl` as in TRL's
`log_history`; spotgrpo's own figures (staleness, drops, queue and timing figures) sit
beside them. The trackers get every figure under `train/` (evaluations under `eval/`),
as TRL's callbacks write them.
"""

from __future__ import annotations

import collections
import json
import logging
import math
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from learner.judge import Reason, StepGroups
from learner.token_use import token_staleness
from learner.trackers import Sample, Tracker
from protocol import RolloutGroup
from protocol.usercode.rewards import reward_name

log = logging.getLogger(__name__)

METRICS = "metrics.jsonl"
CONSUMED = "consumed.jsonl"
ISSUED = "issued.jsonl"
EVALS = "evals.jsonl"


def truncate_after(path: Path, step: int) -> None:
    """Keep only the lines of a per-step JSONL file whose step is <= `step`."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) <= step:
                kept.append(line)
        except json.JSONDecodeError:  # a line cut short by a crash
            continue
    path.write_text("".join(f"{line}\n" for line in kept))


class MetricsLog:
    def __init__(self, run_dir: Path, *, trackers: list[Tracker], resume_step: int | None) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = run_dir / METRICS
        self.consumed_path = run_dir / CONSUMED
        self.evals_path = run_dir / EVALS
        for path in (self.metrics_path, self.consumed_path, self.evals_path):
            if resume_step is None:
                path.unlink(missing_ok=True)
            else:
                truncate_after(path, resume_step)
        self._metrics = self.metrics_path.open("a")
        self._consumed = self.consumed_path.open("a")
        self._evals = self.evals_path.open("a")
        self.issued_path = run_dir / ISSUED
        if resume_step is None:
            self.issued_path.unlink(missing_ok=True)
        self._issued = self.issued_path.open("a")
        self.trackers = trackers

    def issued(self, batch_id: str, prompts: list[str], step: int) -> None:
        """A training batch goes to the queue (written first, and flushed: a batch in the
        queue is in the trail even after a SIGKILL)."""
        self._issued.write(json.dumps({"batch": batch_id, "prompts": prompts, "step": step}) + "\n")
        self._issued.flush()

    def write(self, row: dict[str, Any], trained: list[str], dropped: list[tuple[str, str]]) -> None:
        self._metrics.write(json.dumps(row, allow_nan=False) + "\n")
        self._metrics.flush()
        self._consumed.write(json.dumps({"step": row["step"], "trained": trained, "dropped": dropped}) + "\n")
        self._consumed.flush()
        # `time` is a timestamp, not a figure to plot
        numbers = {
            f"train/{k}": float(v) for k, v in row.items() if k not in ("step", "time") and isinstance(v, int | float)
        }
        for tracker in self.trackers:
            tracker.log(numbers, row["step"])

    def evaluation(self, figures: dict[str, float], step: int) -> None:
        """One version's evaluation (`eval/*`), completed while training stood at `step`."""
        self._evals.write(json.dumps(clean({"step": step, **figures}), allow_nan=False) + "\n")
        self._evals.flush()
        numbers = {k: float(v) for k, v in figures.items() if isinstance(v, int | float) and math.isfinite(v)}
        for tracker in self.trackers:
            tracker.log(numbers, step)

    def samples(self, rows: list[Sample], step: int) -> None:
        for tracker in self.trackers:
            tracker.samples(rows, step)

    def close(self) -> None:
        self._metrics.close()
        self._consumed.close()
        self._evals.close()
        self._issued.close()
        for tracker in self.trackers:
            tracker.close()


def clean(row: dict[str, Any]) -> dict[str, Any]:
    """NaN/inf would make invalid JSON; they become null."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}


def console_line(row: dict[str, Any], total_steps: int) -> str:
    """One line per step, under TRL's names where TRL has one (`reward`, `reward_std`,
    `frac_reward_zero_std`, `loss`, `grad_norm`, `importance_sampling_ratio` for
    `sampling/importance_sampling_ratio/mean`); then what asynchrony adds: the groups'
    staleness (mean/max versions behind), the groups trained and dropped by reason, and the
    step's wait, compute and publish times; on a fleet shared with other runs, the share
    of its workers' sequences the run gets. A figure that is missing (None: it was not
    finite) shows as -."""

    def f(key: str, spec: str) -> str:
        value = row.get(key)
        return "-" if value is None else format(value, spec)

    publish = "-" if row.get("publish_s") is None else f"{row['publish_s'] * 1000:.0f}"
    skipped = f"  SKIPPED {row['skipped_updates']} update(s)" if row.get("skipped_updates") else ""
    share = row.get("fleet_share")
    shared = f"  fleet share {share:.2f} of {row['workers_live']} workers" if share is not None and share < 1 else ""
    return (
        f"step {row['step']:>5}/{total_steps}  v{row['adapter_version']:<4} "
        f"reward {f('reward', '.3f')}  reward_std {f('reward_std', '.3f')}  "
        f"frac_reward_zero_std {f('frac_reward_zero_std', '.2f')}  loss {f('loss', '+.4f')}  "
        f"grad_norm {f('grad_norm', '.3f')}  "
        f"importance_sampling_ratio {f('sampling/importance_sampling_ratio/mean', '.3f')}  "
        f"staleness {f('staleness_mean', '.2f')}/{f('staleness_max', '')}  "
        f"groups {row['groups']} (dropped: {row['dropped_stale']} stale, {row['dropped_flat']} flat, "
        f"{row['rejected']} rejected)  wait {f('wait_s', '.2f')}s step {f('step_s', '.2f')}s "
        f"publish {publish}ms{shared}{skipped}"
    )


class RewardNames:
    """The reward-function names a run reports (`rewards/<name>/mean`, a metric key each): the
    configured functions' (`--reward module:function[=weight]`), or, for a run that does
    not know them (actors scoring with their own), the first `limit` met. Whatever the
    groups carry, no worker can add metric keys step after step. (Also the names of what
    reward functions log with `log_metric`: none fixed, the first met.) A name met first
    is admitted for its source (`source_of`: the token a worker's name is prefixed with
    through the proxy), at most `per_source` from each, so one token cannot take every
    slot with names of its own before honest workers report theirs."""

    def __init__(self, specs: list[str], limit: int = 16, per_source: int = 4) -> None:
        self.fixed = bool(specs)
        self.names = {reward_name(spec) for spec in specs}
        self.limit, self.per_source = limit, per_source
        self._introduced: collections.Counter[str] = collections.Counter()

    def keep(self, name: str, source: str = "") -> bool:
        if (
            not self.fixed
            and name not in self.names
            and len(self.names) < self.limit
            and self._introduced[source] < self.per_source
        ):
            self.names.add(name)
            self._introduced[source] += 1
        return name in self.names


def source_of(actor_id: str) -> str:
    """Who answers for a group's names: the proxy names a worker `<token>/<worker>`."""
    return actor_id.split("/", 1)[0]


TABLE_COLUMNS = ("prompt", "completion", "reward", "advantage")
"""The completions table's own columns: a `log_extra` column of one of these names is left out."""


def samples(
    groups: list[RolloutGroup], advantages_N: list[float], decode: Callable[..., Any], most: int = 4, per_group: int = 2
) -> list[Sample]:
    """TRL's completions table for a few of a step's groups: prompt, completion (both decoded
    from the token ids trained on, never an actor's text), reward, each reward function's
    value and the advantage."""
    rows: list[Sample] = []
    offset = 0
    for g in groups[:most]:
        for i, c in enumerate(g.completions[:per_group]):
            rows.append(
                {
                    "prompt": str(decode(g.prompt_tokens.tolist(), skip_special_tokens=True)),
                    "completion": str(decode(c.tokens.tolist(), skip_special_tokens=True)),
                    "reward": float(c.reward or 0.0),
                    **{name: float(v) for name, v in sorted(c.reward_components.items()) if v is not None},
                    "advantage": float(advantages_N[offset + i]),
                    **{name: value for name, value in sorted(c.extra.items()) if name not in TABLE_COLUMNS},
                }
            )
        offset += len(g.completions)
    return rows


def group_figures(
    groups: list[RolloutGroup],
    step: StepGroups,
    rewards_N: list[float],
    trained_with: int,
    names: RewardNames,
    episodes: bool = False,
    logged: RewardNames | None = None,
) -> dict[str, float]:
    """A step's figures from its groups, under TRL's names where TRL has one (`reward`,
    `reward_std`, `rewards/<fn>/mean`, `completions/*`, `frac_reward_zero_std`): the
    policy's reward, staleness, what was dropped and why, completion lengths, each reward
    function's mean, the scoring tier's cost. `rewards_N`: the trained completions'
    rewards; `trained_with`: the policy's version. `logged`: the names of what reward
    functions logged with `log_metric` (the first met; each averaged over the groups that
    carry it; a name the learner uses itself stays the learner's)."""
    by_name: dict[str, list[float]] = {}
    for g in groups:
        for key, figure in g.metrics.items():
            if logged is not None and logged.keep(key, source_of(g.actor_id)):
                by_name.setdefault(key, []).append(figure)
    staleness = [trained_with - g.adapter_version for g in groups]
    behind = np.concatenate([token_staleness(g, c, trained_with) for g in groups for c in g.completions])
    completions = [c for g in groups for c in g.completions]
    lengths = [c.tokens.size for c in completions]
    ended = [c.tokens.size for c in completions if c.finish_reason != "length"] or [0]
    components: dict[str, list[float]] = {}
    for g in groups:
        source = source_of(g.actor_id)
        for c in g.completions:
            for name, value in c.reward_components.items():
                if value is not None and names.keep(name, source):
                    components.setdefault(name, []).append(value)
    consumed = len(groups) + len(step.dropped)
    # the policy's reward: every scored completion consumed this step, the flat and
    # stale groups included (the trained groups alone overstate it early on)
    scored = rewards_N + step.dropped_rewards()
    return {
        **{name: sum(values) / len(values) for name, values in sorted(by_name.items())},
        "reward": sum(scored) / len(scored),
        "reward_std": _std(scored),
        "reward_trained_mean": sum(rewards_N) / len(rewards_N),
        # flat groups are dropped before the step (they carry no signal), so TRL's share
        # of zero-std groups is the flat share of what this step consumed
        "frac_reward_zero_std": step.count(Reason.FLAT) / consumed,
        "groups": len(groups),
        "staleness_mean": sum(staleness) / len(staleness),
        "staleness_max": max(staleness),
        # by token: an in-flight update moves a generation onto newer adapters as it goes
        "staleness_token_mean": float(behind.mean()) if behind.size else 0.0,
        "staleness_token_p95": float(np.percentile(behind, 95)) if behind.size else 0.0,
        "dropped_stale": step.count(Reason.STALE),
        "dropped_flat": step.count(Reason.FLAT),
        "rejected": sum(1 for _, r in step.dropped if r.rejected),
        "dropped_stale_rate": step.count(Reason.STALE) / consumed,
        "dropped_flat_rate": step.count(Reason.FLAT) / consumed,
        "completions/mean_length": sum(lengths) / len(lengths),
        "completions/min_length": min(lengths),
        "completions/max_length": max(lengths),
        "completions/clipped_ratio": sum(1 for c in completions if c.finish_reason == "length") / len(completions),
        "completions/mean_terminated_length": sum(ended) / len(ended),
        **{
            f"rewards/{name}/{k}": v
            for name, values in sorted(components.items())
            for k, v in (("mean", sum(values) / len(values)), ("std", _std(values)))
        },
        **scoring_figures(groups),
        **episode_figures(groups, episodes),
    }


def _std(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


def episode_figures(groups: list[RolloutGroup], episodes: bool = False) -> dict[str, float]:
    """Episodes' shape, per episode: model turns, tool calls (TRL's `tools/call_frequency`),
    the share of calls that failed (`tools/failure_frequency`), seconds in tools
    (the actor's own figure), the share cut at the turn limit (those cut at the token
    limit are in `completions/clipped_ratio`), and the model's share of the episode's tokens. Every
    step of a run with tools (`episodes`) has them; others, when their groups hold episodes."""
    completions = [c for g in groups for c in g.completions]
    if not episodes and not any(c.mask is not None or c.tool_calls or c.turns > 1 for c in completions):
        return {}
    n = len(completions)
    tokens = sum(c.tokens.size for c in completions)
    calls = sum(c.tool_calls for c in completions)
    return {
        "turns_mean": sum(c.turns for c in completions) / n,
        "tools/call_frequency": calls / n,
        "tools/failure_frequency": sum(c.tool_errors for c in completions) / calls if calls else 0.0,
        "tool_s_mean": sum(g.timings.get("tool_s", 0.0) for g in groups) / n,
        "turn_limit_frac": sum(c.turn_limit for c in completions) / n,
        "model_token_frac": sum(c.model_tokens for c in completions) / max(tokens, 1),
    }


def scoring_figures(groups: list[RolloutGroup]) -> dict[str, float]:
    """Trusted scoring's cost: seconds in the reward functions per group (`score_s_mean`)
    and from the group's arrival in Redis to its score (`scoring_latency_s_mean`). Both
    are the tier's own figures (`submitted_at` is the unscored entry's Redis time), never
    the actor's: a group with no tier timings counts in neither."""
    scored = [g for g in groups if g.scored_by is not None]
    score = [g.timings["score_s"] for g in scored if "score_s" in g.timings]
    latency = [
        g.timings["scored_at"] - g.timings["submitted_at"]
        for g in scored
        if "scored_at" in g.timings and "submitted_at" in g.timings
    ]
    out = {}
    if score:
        out["score_s_mean"] = sum(score) / len(score)
    if latency:
        out["scoring_latency_s_mean"] = sum(latency) / len(latency)
    return out
