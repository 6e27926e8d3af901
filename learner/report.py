"""The learner's per-step report: one row of figures written to `metrics.jsonl`, the
trackers, the live view (`on_step`) and the console line, with the step's ids in
`consumed.jsonl` and, every `samples_every` steps, TRL's completions table."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from learner.batch import StepBatch
from learner.config import LearnerConfig
from learner.judge import StepGroups
from learner.metrics import MetricsLog, RewardNames, clean, console_line, group_figures, samples
from learner.trackers import open_trackers
from protocol import RolloutGroup

log = logging.getLogger("learner.loop")  # the console line keeps the loop's logger name


class StepReport:
    """Opened when the run starts (`open`), written once per step, closed at the end."""

    def __init__(self, cfg: LearnerConfig, decode: Callable[..., Any]) -> None:
        self.cfg, self.decode = cfg, decode
        self.log: MetricsLog | None = None
        self.on_step: Callable[[dict[str, Any]], None] | None = None
        """Called with each step's row (the embedded default's live display)."""
        self._names = RewardNames([*cfg.reward, *([cfg.environment] if cfg.environment else [])])
        self._logged = RewardNames([])

    def open(self, resume_step: int | None) -> MetricsLog:
        cfg = self.cfg
        config = cfg.model_dump(mode="json", exclude={"token"})
        trackers = open_trackers(cfg.trackers, cfg.resolved_run_dir, cfg.run, config, resume_step)
        self.log = MetricsLog(cfg.resolved_run_dir, trackers=trackers, resume_step=resume_step)
        return self.log

    def write(
        self,
        head: dict[str, Any],
        groups: list[RolloutGroup],
        step_groups: StepGroups,
        batch: StepBatch,
        trained_with: int,
        tail: dict[str, Any],
    ) -> None:
        """`head`: step and version; `tail`: the step's other figures (losses, times, the
        parts' metrics). The row keeps TRL's group figures between the two."""
        assert self.log is not None, "open() first"
        step, episodes = head["step"], bool(self.cfg.tools or self.cfg.environment)
        rewards_N = batch.rewards_N.tolist()
        figures = group_figures(groups, step_groups, rewards_N, trained_with, self._names, episodes, self._logged)
        row = clean({**head, **figures, **tail, "time": time.time()})
        self.log.write(row, [g.group_id for g in groups], step_groups.reasons())
        if self.cfg.samples_every and step % self.cfg.samples_every == 0:
            self.log.samples(samples(groups, batch.advantages_N.tolist(), self.decode), step)
        if self.on_step is not None:
            self.on_step(row)
        if step % self.cfg.log_every == 0:
            log.info(console_line(row, self.cfg.steps))

    def close(self) -> None:
        if self.log is not None:
            self.log.close()
