"""Experiment trackers, each through its own library's API: TensorBoard, Weights & Biases,
trackio and MLflow (`--report-to tensorboard wandb trackio mlflow`, or `none`).

Every tracker gets each step's figures (the `metrics.jsonl` row's numbers, under `train/`;
evaluations under `eval/`) and, every `samples_every` steps, TRL's completions table: a few
prompts with their completions, rewards (in all and by function) and advantages. Each
library's own settings apply as usual: `WANDB_MODE=offline`, `WANDB_PROJECT`,
`TRACKIO_DIR`, `MLFLOW_TRACKING_URI` (default here: `file:<run dir>/mlruns`), ... The
libraries other than TensorBoard are optional extras (`pip install 'spotgrpo[trackers]'`);
asking for one that is not installed is an error at start, not a silent no-op.
"""

from __future__ import annotations

import abc
import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

Sample = dict[str, str | float]
"""One completion's row of the completions table: prompt, completion, reward, one column
per reward function, advantage."""

TABLE = "completions"
"""The table's name in every tracker (TRL's)."""


def columns(rows: list[Sample]) -> list[str]:
    """Every row's columns, in the order they first appear (a function that returned None
    for one completion has no value in its row)."""
    return list(dict.fromkeys(k for row in rows for k in row))


def _value(row: Sample, column: str) -> str | float | None:
    return row.get(column)


class TrackerError(ValueError):
    """A tracker was asked for that cannot be used (not installed, unknown name)."""


class Tracker(abc.ABC):
    @abc.abstractmethod
    def log(self, row: dict[str, float], step: int) -> None: ...

    @abc.abstractmethod
    def samples(self, rows: list[Sample], step: int) -> None: ...

    @abc.abstractmethod
    def close(self) -> None: ...


class TensorBoard(Tracker):
    def __init__(self, run_dir: Path, resume_step: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run_dir / "tensorboard"), purge_step=resume_step)

    def log(self, row: dict[str, float], step: int) -> None:
        for key, value in row.items():
            self.writer.add_scalar(key, value, step)

    def samples(self, rows: list[Sample], step: int) -> None:
        names = columns(rows)
        table = (
            "| "
            + " | ".join(names)
            + " |\n|"
            + "---|" * len(names)
            + "\n"
            + "".join("| " + " | ".join(_cell(row.get(n)) for n in names) + " |\n" for row in rows)
        )
        self.writer.add_text(TABLE, table, step)

    def close(self) -> None:
        self.writer.close()


class WandB(Tracker):
    def __init__(self, run_dir: Path, run: str, config: dict[str, Any], resume_step: int | None) -> None:
        import wandb

        self.wandb = wandb
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "spotgrpo"),
            name=run,
            config=config,
            dir=os.environ.get("WANDB_DIR", str(run_dir)),
            resume="allow" if resume_step else None,
        )

    def log(self, row: dict[str, float], step: int) -> None:
        self.run.log(row, step=step)

    def samples(self, rows: list[Sample], step: int) -> None:
        names: list[str | int] = list(columns(rows))
        self.run.log(
            {TABLE: self.wandb.Table(columns=names, data=[[_value(r, str(n)) for n in names] for r in rows])}, step=step
        )

    def close(self) -> None:
        self.run.finish()


class Trackio(Tracker):
    def __init__(self, run: str, config: dict[str, Any]) -> None:
        import trackio

        self.trackio = trackio
        self.run = trackio.init(
            project=os.environ.get("TRACKIO_PROJECT", "spotgrpo"), name=run, config=config, resume="allow", embed=False
        )

    def log(self, row: dict[str, float], step: int) -> None:
        self.trackio.log(row, step=step)

    def samples(self, rows: list[Sample], step: int) -> None:
        import pandas as pd

        table = self.trackio.Table(dataframe=pd.DataFrame(rows, columns=columns(rows)))
        self.trackio.log({TABLE: table}, step=step)

    def close(self) -> None:
        self.trackio.finish()


class MLflow(Tracker):
    def __init__(self, run_dir: Path, run: str, config: dict[str, Any]) -> None:
        import mlflow

        self.mlflow = mlflow
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            # a file store in the run directory: nothing to run beside the learner (MLflow 3
            # keeps file stores in maintenance and wants this opt-in; a server URI needs none)
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            mlflow.set_tracking_uri((run_dir / "mlruns").resolve().as_uri())
        mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", "spotgrpo"))
        self.run = mlflow.start_run(run_name=run)
        mlflow.log_params({k: str(v)[:500] for k, v in config.items()})

    def log(self, row: dict[str, float], step: int) -> None:
        # MLflow keys allow letters, digits and _-./ and spaces: pass@k's @ is not one
        self.mlflow.log_metrics({k.replace("@", "_at_"): v for k, v in row.items()}, step=step)

    def samples(self, rows: list[Sample], step: int) -> None:
        self.mlflow.log_table(
            {n: [_value(r, n) for r in rows] for n in columns(rows)}, artifact_file=f"{TABLE}/step-{step}.json"
        )

    def close(self) -> None:
        self.mlflow.end_run()


NAMES = ("tensorboard", "wandb", "trackio", "mlflow")


_MODULES = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio", "mlflow": "mlflow"}


def check_trackers(names: list[str]) -> None:
    """Fail early (before the model loads) on an unknown tracker or a missing library."""
    import importlib.util

    unknown = sorted(set(names) - set(NAMES) - {"none"})
    if unknown:
        raise TrackerError(f"report_to: unknown tracker {unknown[0]!r}; use {', '.join(NAMES)} or none")
    for name in names:
        if name not in ("none", "tensorboard") and importlib.util.find_spec(_MODULES[name]) is None:
            raise TrackerError(f"report_to: {name} is not installed; pip install 'spotgrpo[trackers]'")


def open_trackers(
    names: list[str], run_dir: Path, run: str, config: dict[str, Any], resume_step: int | None
) -> list[Tracker]:
    """The trackers asked for (`none` alone: none). Raises TrackerError for an unknown name
    or a library that is not installed."""
    check_trackers(names)
    wanted = [n for n in names if n != "none"]
    out: list[Tracker] = []
    for name in dict.fromkeys(wanted):
        try:
            if name == "tensorboard":
                out.append(TensorBoard(run_dir, resume_step))
            elif name == "wandb":
                out.append(WandB(run_dir, run, config, resume_step))
            elif name == "trackio":
                out.append(Trackio(run, config))
            else:
                out.append(MLflow(run_dir, run, config))
        except ImportError as err:
            if name == "tensorboard":  # the default: without the package there are no event files
                log.info("tensorboard is not installed: no event files (pip install tensorboard)")
                continue
            for tracker in out:
                tracker.close()
            raise TrackerError(
                f"report_to: {name} is not installed ({err.name}); pip install 'spotgrpo[trackers]'"
            ) from None
    return out


def _cell(value: str | float | None) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.3f}"
    return value.replace("|", "\\|").replace("\n", " ")[:200]
