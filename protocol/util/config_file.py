"""One config file for every role: `learner score`, `actors run` (and `actors check`) and
`proxy serve` take `--config grpo.toml`, the learner's own file, and read their part of it.

What a role shares with the learner comes from the learner's settings (top-level keys or a
`[learner]` table, GRPOConfig's names too): the run, the model, the reward functions with
their weights, the tools and the environment, and the queue and store where the role
reaches them itself. A role's own flags go in a table of its name (`[score]`, `[actors]`,
`[proxy]`), by the flag's name (`tls_cert = "cert.pem"`). Flags on the command line win
over both. The learner ignores the role tables.
"""

from __future__ import annotations

import argparse
import difflib
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from protocol.usercode.rewards import without_weight

ROLE_TABLES = ("score", "actors", "proxy")
"""Tables of a config file that belong to the other roles, not to the learner."""

_ALIASES = {"run_name": "run", "reward_funcs": "reward", "environment_factory": "environment"}
"""GRPOConfig's names (and GRPOTrainer's arguments) for the settings the roles share."""


class ConfigFileError(ValueError):
    """The config file cannot be read, or names a flag the role does not have."""


def read_file(path: Path) -> dict[str, Any]:
    try:
        values = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise ConfigFileError(f"--config {path}: {err}") from err
    return values


def learner_part(values: dict[str, Any]) -> dict[str, Any]:
    """The learner's settings of a config file: its `[learner]` table, or the top-level
    keys less the other roles' tables."""
    if isinstance(values.get("learner"), dict):
        return dict(values["learner"])
    return {k: v for k, v in values.items() if k not in ROLE_TABLES}


def reward_specs(learner: dict[str, Any]) -> list[str] | None:
    """The learner's reward functions as the other roles take them (module:function=weight)."""
    rewards = learner.get("reward", learner.get("reward_funcs"))
    if rewards is None:
        return None
    rewards = [rewards] if isinstance(rewards, str) else list(rewards)
    weights = learner.get("reward_weights")
    if weights is None:
        return [str(r) for r in rewards]
    if not isinstance(weights, list) or len(weights) != len(rewards):
        raise ConfigFileError("reward_weights: one weight per reward function")
    return [f"{without_weight(str(spec))}={float(w)!r}" for spec, w in zip(rewards, weights, strict=True)]


def shared(role: str, learner: dict[str, Any]) -> dict[str, Any]:
    """What `role` takes from the learner's settings, under the role's flag names."""
    named = {_ALIASES.get(k, k): v for k, v in learner.items()}
    out: dict[str, Any] = {k: named[k] for k in ("run", "model", "environment") if named.get(k)}
    if named.get("tools"):
        out["tools"] = list(named["tools"])
    queue = str(named.get("queue") or "")
    specs = reward_specs(learner)
    if role == "score":
        if queue.startswith(("redis://", "rediss://", "unix://")):
            out["redis"] = queue
        if specs:
            out["reward"] = specs
    elif role == "proxy":
        out.pop("model", None)
        out.pop("environment", None)
        out.pop("tools", None)
        if queue.startswith(("redis://", "rediss://", "unix://")):
            out["redis"] = queue
        if named.get("store"):
            out["store"] = named["store"]
    elif role == "actors":
        if queue.startswith("https://"):  # the learner goes through the proxy too: the workers' door
            out["queue"] = queue
        if specs and named.get("scoring") == "actors":  # with trusted scoring, workers run no reward
            out["reward"] = specs
    return out


def _dests(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Every flag's name (dashes as underscores, aliases too) -> its destination."""
    out = {}
    for action in parser._actions:
        for option in action.option_strings:
            if option.startswith("--"):
                out[option[2:].replace("-", "_")] = action.dest
    return out


def role_settings(path: Path, role: str, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """`role`'s settings from the config file at `path`, by `parser`'s destinations."""
    values = read_file(path)
    dests = _dests(parser)
    out = {dests[k]: v for k, v in shared(role, learner_part(values)).items() if k in dests}
    table = values.get(role, {})
    if not isinstance(table, dict):
        raise ConfigFileError(f"--config {path}: [{role}] must be a table of `{role}` flags")
    unknown = [k for k in table if k not in dests or k in ("config", "help")]
    if unknown:
        hints = []
        for key in unknown:
            near = difflib.get_close_matches(key, list(dests), n=1)
            hints.append(f"{key}" + (f" (did you mean {near[0]}?)" if near else ""))
        raise ConfigFileError(f"--config {path}: [{role}] has no such flag: {', '.join(hints)}")
    out.update({dests[k]: v for k, v in table.items()})
    return out


def apply_config_file(
    parser: argparse.ArgumentParser, argv: list[str], role: str
) -> Callable[[argparse.Namespace], None]:
    """Make the config file named by `--config` in `argv` (if any) `parser`'s defaults, so
    that flags given on the command line win; a flag the file sets is no longer required.
    Returns what to call on the parsed arguments: a repeatable flag (`--reward`) given on
    the command line replaces the file's list rather than adding to it."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", type=Path, default=None)
    known, _ = pre.parse_known_args(argv)
    if known.config is None:
        return lambda args: None
    try:
        values = role_settings(known.config, role, parser)
    except ConfigFileError as err:
        parser.error(str(err))
    lists = {}
    for action in parser._actions:
        if action.dest in values:
            action.required = False
            if isinstance(action, argparse._AppendAction):
                lists[action.dest] = values.pop(action.dest)
    parser.set_defaults(**values)

    def fill(args: argparse.Namespace) -> None:
        for dest, value in lists.items():
            if getattr(args, dest, None) is None:
                setattr(args, dest, value)

    return fill


def subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The parser of subcommand `name` of `parser`."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[name]  # type: ignore[no-any-return]
    raise KeyError(name)


def config_flag(parser: argparse.ArgumentParser, role: str) -> None:
    """`--config` for a role other than the learner's."""
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        help=f"the run's TOML file (the learner's --config): this command takes the run, model, rewards, tools and "
        f"queue it shares with the learner, and its own flags from a [{role}] table; flags given here win",
    )
