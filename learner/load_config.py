"""Reading the learner's configuration: the defaults, a TOML file, then the flags the user
gave, each read in TRL's vocabulary too (`learner.grpoconfig`), into one `LearnerConfig`."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from learner.config import LearnerConfig
from learner.grpoconfig import ConfigError, translate_trl, trl_batch, unknown_settings
from protocol.util.config_file import learner_part


def load_config(
    toml_path: Path | None,
    overrides: dict[str, object],
    defaults: dict[str, object] | None = None,
    notes: list[str] | None = None,
) -> LearnerConfig:
    """`defaults`, then the TOML file's values, then `overrides` (flags the user gave);
    GRPOConfig names are read as ours in each (what that took without a change, or
    translated, is added to `notes`)."""
    values: dict[str, Any] = {}
    if toml_path is not None:
        try:
            values = tomllib.loads(toml_path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as err:
            raise ConfigError(f"--config {toml_path}: {err}") from err
        values = learner_part(values)  # a [learner] table, or top-level keys less the other roles' tables
    notes = notes if notes is not None else []
    user = {**translate_trl(values, notes), **translate_trl(dict(overrides), notes)}
    defaults = defaults or {}
    default_generations = defaults.get("num_generations", LearnerConfig.model_fields["num_generations"].default)
    values = {**defaults, **trl_batch(user, user.get("num_generations", default_generations), notes)}
    unknown = [k for k in values if k not in LearnerConfig.model_fields]
    if unknown:
        raise ConfigError(f"invalid configuration: {unknown_settings(unknown, LearnerConfig.model_fields)}")
    try:
        return LearnerConfig.model_validate(values)
    except ValidationError as err:
        lines = [f"{'.'.join(str(p) for p in e['loc']) or 'config'}: {e['msg']}" for e in err.errors()]
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(lines)) from None
