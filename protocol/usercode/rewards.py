"""Reward functions with TRL's signature, loaded from `module:function[=weight]`.

`fn(prompts, completions, **columns) -> list[float | None]` (or an `async def`, awaited
in an event loop of its own: a reward that calls an HTTP service), called once per group:
`prompts` has the prompt once per completion (a string, or the list of chat messages
for conversational data), `completions` the completion texts (for conversational data,
`[{"role": "assistant", "content": text}]` each, as TRL passes them), plus
`completion_ids` and the data set's other columns, each as a list aligned with the
completions. So TRL's own reward helpers (`trl.rewards:accuracy_reward`, ...) and a TRL
user's functions work unchanged. A function that takes them (by name, or `**kwargs`) also
gets TRL's `trainer_state` (`global_step`, `max_steps`, `epoch`: where the learner stood
when it issued the prompt, at most `max_staleness` steps before it trains on the group;
`None` where that is unknown), `log_metric(name, value)` (the value, averaged over the
step's groups, is a metric of the step under that name), `log_extra(column, values)`
(a value per completion: it travels with the completion, `Completion.extra`, and is a
column of the learner's completions table; at most 8 columns of 300 characters) and
`tool_mask` (TRL's name for it inside its trainer: per completion, 1 for each of the
model's tokens and 0 for the environment's, tool results and the chat template's glue
between turns; all 1 for a single turn). On the scoring tier the mask is the one it
checked against the episode's model turns (`protocol.usercode.transcript`).

`None` from a function means it abstains for that completion (TRL's convention); the
total is the weighted sum of the others. A function that raises, returns the wrong
shape or a non-finite value, or runs past its time limit fails the whole group with
the error text: such a group is never recorded as reward 0.

Where rewards run: the trusted scoring tier (`learner score`: RQ jobs, whose work horses
ask the worker's long-lived reward host, `learner.scoring.reward_host`), an
actor's `actors.rewards.ScoringPool` (worker processes beside the engine), or
`Scorer.submit` inline (a thread per call; a hung reward's thread is abandoned, not
killed). `learner check` calls them here on a row of the data set. This module needs
nothing beyond the standard library and the protocol, so all three can use it.
"""

from __future__ import annotations

import ast
import asyncio
import functools
import importlib
import inspect
import itertools
import math
import numbers
import os
import re
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from protocol import Prompt
from protocol.util.deadline import PastLimit, within
from protocol.wire.messages import MAX_EXTRA_CHARS, MAX_EXTRA_COLUMNS, MAX_LOGGED_METRICS
from protocol.wire.text import SAFE_NAME, printable

_SPEC = re.compile(
    r"^(?P<module>[A-Za-z_][\w.]*?)[:.](?P<attr>[A-Za-z_]\w*)(?:\((?P<args>[^()]*)\))?(?:=(?P<weight>[-+0-9.eE]+))?$"
)
"""`module:function[=weight]`, or TRL's dotted `module.function`; `module:factory(k=v, ...)`
names the function a factory returns (TRL's `get_soft_overlong_punishment(...)`)."""
_WEIGHT = re.compile(r"=[-+0-9.eE]+$")
_SAFE_NAME = re.compile(SAFE_NAME)
ENVIRONMENT = "environment="
"""A run's published rewards (`Queue.set_run_rewards`) name an environment that scores its
episodes (`get_reward`) as this prefix and its `module:Class`."""


ToolMask = list[list[int]] | None
"""Per completion, 1 for the model's tokens and 0 for the environment's; None: single
turns, every token the model's."""
Group = tuple[Prompt, str, list[str], list[list[int]], ToolMask]
"""A group to score: its prompt, the prompt's text (plain prompts without `text`), the
completions' texts, their token ids and their tool masks."""


class RewardError(ValueError):
    """A reward specification cannot be loaded."""


TRL_EXTRAS = ("trainer_state", "log_extra", "log_metric", "tool_mask")
"""The keyword arguments added to the data set's columns for a reward function: TRL's,
and the episode's mask (`tool_mask`)."""


def group_tool_mask(masks: Sequence[Sequence[int] | None], completion_ids: Sequence[Sequence[int]]) -> ToolMask:
    """A group's tool mask from its completions' masks (None where a completion is a single
    turn: all its tokens are the model's)."""
    if all(m is None for m in masks):
        return None
    return [[1] * len(ids) if m is None else list(m) for m, ids in zip(masks, completion_ids, strict=True)]


class RewardRefused(Exception):
    """A reward that cannot be computed for this group and would fail the same way again
    (an environment's replay past its limits): the group fails at once, never retried."""


@dataclass(frozen=True)
class RewardFn:
    name: str
    fn: Callable[..., Any]
    weight: float = 1.0

    @functools.cached_property
    def extras(self) -> frozenset[str]:
        """Which of TRL's extra keyword arguments the function accepts (by name, or all of
        them through `**kwargs`): read from its signature once, not per group."""
        try:
            params = inspect.signature(self.fn).parameters.values()
        except (TypeError, ValueError):  # a builtin or a C function: nothing extra
            return frozenset()
        return frozenset(
            k
            for k in TRL_EXTRAS
            if any(p.kind is p.VAR_KEYWORD or (p.name == k and p.kind is not p.POSITIONAL_ONLY) for p in params)
        )


@dataclass(frozen=True)
class TrainerState:
    """The part of TRL's `TrainerState` a reward function reads (from `Progress`)."""

    global_step: int
    max_steps: int
    epoch: float


def working_folder_on_path() -> None:
    """The folder a command runs in, first on the module path, as `python -m` puts it:
    `--reward my_rewards:correct`, `--tools` and `--environment` import from there under
    every subcommand (a console script's path starts at its own folder instead)."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)


MOVED = {"actors.tasks": "protocol.usercode.tasks", "actors.math_reward": "protocol.usercode.math_reward"}
"""The built-in rewards' earlier modules: both tiers run them, so they live with the user-code
loading now, and a spec that names the old module still loads (runs and scripts that
started before the move)."""


@dataclass(frozen=True)
class RewardSpec:
    """A parsed `--reward`: `module:function[=weight]`, or `module:factory(k=v, ...)[=weight]`
    whose keyword arguments are Python literals (numbers, strings, lists, ...)."""

    module: str
    attr: str
    kwargs: dict[str, Any] | None
    """The factory's keyword arguments; None: `attr` is the reward function itself."""
    weight: float = 1.0

    @classmethod
    def parse(cls, spec: str) -> RewardSpec:
        match = _SPEC.match(spec.strip())
        if match is None:
            raise RewardError(
                f"--reward {spec!r}: expected module:function (or module.function), or "
                "module:factory(name=value, ...), with =weight if wanted"
            )
        weight = float(match["weight"]) if match["weight"] else 1.0
        if not math.isfinite(weight):
            raise RewardError(f"--reward {spec!r}: weight must be finite")
        kwargs = None if match["args"] is None else _literal_kwargs(spec, match["args"])
        return cls(MOVED.get(match["module"], match["module"]), match["attr"], kwargs, weight)

    def canonical(self) -> str:
        kwargs = sorted((self.kwargs or {}).items())
        args = "" if self.kwargs is None else "(" + ", ".join(f"{k}={v!r}" for k, v in kwargs) + ")"
        return f"{self.module}:{self.attr}{args}={self.weight!r}"


def _literal_kwargs(spec: str, args: str) -> dict[str, Any]:
    try:
        call = ast.parse(f"f({args})", mode="eval").body
        assert isinstance(call, ast.Call)
        if call.args or any(k.arg is None for k in call.keywords):
            raise ValueError("only name=value arguments")
        return {str(k.arg): ast.literal_eval(k.value) for k in call.keywords}
    except (SyntaxError, ValueError) as err:
        raise RewardError(f"--reward {spec!r}: the factory's arguments must be name=literal pairs: {err}") from None


def reward_name(spec: str) -> str:
    """The name a reward's figures go by (`rewards/<name>/mean`): its function's, or its factory's."""
    match = _SPEC.match(spec.strip())
    return match["attr"] if match is not None else spec


def without_weight(spec: str) -> str:
    """`spec` less its `=weight`."""
    return _WEIGHT.sub("", spec.strip())


def canonical_spec(spec: str) -> str:
    """`spec` as `module:function=weight` (or `module:factory(k=v, ...)=weight`, its
    arguments sorted), however it was written (TRL's dotted form, no weight, a built-in's
    earlier module), so that two roles' rewards compare; unchanged if it is not a spec."""
    try:
        return RewardSpec.parse(spec).canonical()
    except RewardError:
        return spec


def load_reward(spec: str) -> RewardFn:
    parsed = RewardSpec.parse(spec)
    try:
        module = importlib.import_module(parsed.module)
    except ImportError as err:
        raise RewardError(f"--reward {spec!r}: cannot import {parsed.module}: {err}") from err
    fn = getattr(module, parsed.attr, None)
    if not callable(fn):
        raise RewardError(f"--reward {spec!r}: {parsed.module} has no function {parsed.attr}")
    if parsed.kwargs is not None:
        try:
            fn = fn(**parsed.kwargs)
        except Exception as err:
            raise RewardError(f"--reward {spec!r}: {parsed.attr}(...) raised {type(err).__name__}: {err}") from err
        if not callable(fn):
            raise RewardError(f"--reward {spec!r}: {parsed.attr}(...) returned {type(fn).__name__}, not a function")
    return RewardFn(name=parsed.attr, fn=fn, weight=parsed.weight)


@dataclass(frozen=True)
class Scores:
    rewards: list[float | None]
    components: list[dict[str, float | None]]
    error: str | None
    """Set when the group failed; then every reward is None. One printable line (it comes
    from a user's exception and is logged and sent on the wire)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """What the functions logged with `log_metric`, averaged per name over this group's calls."""
    extras: list[dict[str, str]] = field(default_factory=list)
    """Per completion, what the functions logged with `log_extra` (empty: nothing)."""

    @classmethod
    def failed(cls, n: int, error: str, components: list[dict[str, float | None]] | None = None) -> Scores:
        return cls([None] * n, components or [{} for _ in range(n)], printable(error, 2000))


class Values(NamedTuple):
    """What the reward functions gave one group."""

    per_fn: dict[str, list[float | None]]
    """Each function's values by name."""
    logged: dict[str, list[float]]
    """What they logged with `log_metric`."""
    extras: dict[str, list[str]]
    """What they logged with `log_extra`, a value per completion (`extra_columns`)."""


Called = Values | Scores
"""What `Scorer.call_batch` gives a group: its `Values`, or its failure."""


def unscored(n: int) -> Future[Scores]:
    """No rewards, no error: a group for the trusted scoring tier to score."""
    future: Future[Scores] = Future()
    future.set_result(Scores([None] * n, [{} for _ in range(n)], None))
    return future


class Scorer:
    def __init__(
        self, functions: list[RewardFn], timeout_s: float | None = 60.0, reraise: bool = False, extra: str | None = None
    ) -> None:
        """`timeout_s`: per reward call, enforced by a thread; None calls rewards directly
        (inside a `ScoringPool` process or an RQ job, whose own timeout kills the process).
        `reraise`: an exception from a reward function propagates (an RQ job, which RQ
        retries) instead of failing the group. `extra`: the name of a reward `score` is
        handed per call (an environment's own, weight 1), which may stand alone."""
        if not functions and extra is None:
            raise RewardError("at least one --reward is needed")
        self.extra = extra
        self.functions = functions
        self.timeout_s = timeout_s
        self.reraise = reraise

    @property
    def wants_tool_mask(self) -> bool:
        """Some reward function takes `tool_mask`: only then is a group's mask built and sent."""
        return any("tool_mask" in rf.extras for rf in self.functions)

    def submit(self, group: Group) -> Future[Scores]:
        """Score now, on this thread; the same shape of answer as `ScoringPool.submit`."""
        prompt, prompt_text, texts, completion_ids, tool_mask = group
        future: Future[Scores] = Future()
        future.set_result(self.score(prompt, prompt_text, texts, completion_ids, tool_mask=tool_mask))
        return future

    def close(self) -> None:
        return None

    def score(
        self,
        prompt: Prompt,
        prompt_text: str,
        texts: list[str],
        completion_ids: list[list[int]],
        extra: Callable[[], list[float]] | None = None,
        *,
        tool_mask: ToolMask = None,
    ) -> Scores:
        """`extra`: the `extra` reward's values, computed when called (an environment's)."""
        (called,) = self.call_batch([(prompt, prompt_text, texts, completion_ids, tool_mask)])
        if isinstance(called, Scores):
            return called
        return self.combine(len(texts), called, extra)

    def call_batch(self, groups: Sequence[Group]) -> list[Called]:
        """Each reward function's values by name, with what they logged (`log_metric`), or
        the group's failure, for several groups with one call of each function (TRL's batch:
        every list aligned over all the groups' completions; `trainer_state` is the first
        group's, and what a function logs counts for each group). A failure fails every
        group, as do groups whose columns differ (they cannot be aligned)."""
        sizes = [len(texts) for _, _, texts, _, _ in groups]
        n = sum(sizes)
        prompts: list[Any] = []
        completions: list[Any] = []
        ids: list[list[int]] = []
        masks: list[list[int]] = []
        wants_mask = self.wants_tool_mask
        columns: dict[str, list[Any]] = {}
        keys = set(groups[0][0].columns)
        for prompt, prompt_text, texts, completion_ids, group_mask in groups:
            if set(prompt.columns) != keys:
                return [Scores.failed(size, "the batch's groups have different columns") for size in sizes]
            if prompt.messages is not None:
                messages = [{"role": t.role, "content": t.content} for t in prompt.messages]
                prompts += [messages] * len(texts)
                completions += [[{"role": "assistant", "content": t}] for t in texts]
            else:
                prompts += [prompt.text if prompt.text is not None else prompt_text] * len(texts)
                completions += list(texts)
            for k, v in prompt.columns.items():
                columns.setdefault(k, []).extend([v] * len(texts))
            ids += completion_ids
            if wants_mask:
                masks += [[1] * len(i) for i in completion_ids] if group_mask is None else group_mask
        progress = groups[0][0].progress
        logged: dict[str, list[float]] = {}
        extra_logged: dict[str, list[Any]] = {}
        trl = {
            "trainer_state": None
            if progress is None
            else TrainerState(progress.global_step, progress.max_steps, progress.epoch),
            "log_metric": lambda name, value: logged.setdefault(str(name), []).append(float(value)),
            "log_extra": lambda column, values: extra_logged.setdefault(str(column), []).extend(list(values)),
            "tool_mask": masks,
        }
        per_fn: dict[str, list[float | None]] = {}
        for rf in self.functions:
            extras = {k: v for k, v in trl.items() if k not in columns and k in rf.extras}
            values, error = self._call(rf, prompts, completions, ids, {**columns, **extras}, n)
            if error is not None or values is None:
                return [Scores.failed(size, error or f"reward {rf.name} returned nothing") for size in sizes]
            per_fn[rf.name] = values
        columns_logged = extra_columns(extra_logged, n)
        out: list[Called] = []
        for start in itertools.accumulate([0, *sizes[:-1]]):
            size = sizes[len(out)]
            part = slice(start, start + size)
            out.append(
                Values(
                    {name: values[part] for name, values in per_fn.items()},
                    logged,
                    {name: values[part] for name, values in columns_logged.items()},
                )
            )
        return out

    def call_batch_within(self, timeout_s: float, groups: Sequence[Group]) -> list[Called]:
        """`call_batch` under one time limit (PastLimit past it; its thread is abandoned)."""
        return within(timeout_s, lambda: self.call_batch(groups), "score-batch")

    def combine(self, n: int, values: Values, extra: Callable[[], list[float]] | None = None) -> Scores:
        """The weighted totals of the functions' values, and of `extra`'s when given."""
        per_fn, logged = dict(values.per_fn), values.logged
        weights = {rf.name: rf.weight for rf in self.functions}
        if extra is not None and self.extra is not None:
            try:
                per_fn[self.extra] = [float(v) for v in extra()]
            except RewardRefused as err:
                return Scores.failed(n, f"reward {self.extra}: {err} (the group is rejected, not retried)")
            except Exception as err:  # the user's environment
                if self.reraise:
                    raise
                return Scores.failed(n, f"reward {self.extra} raised {type(err).__name__}: {err}")
            weights[self.extra] = 1.0
        rewards: list[float | None] = []
        components = []
        for i in range(n):
            parts = {name: values[i] for name, values in per_fn.items()}
            scored = [(w, parts[name]) for name, w in weights.items() if parts[name] is not None]
            rewards.append(sum(w * float(v) for w, v in scored if v is not None) if scored else None)
            components.append(parts)
        if any(r is None for r in rewards):
            return Scores.failed(n, "every reward function abstained for some completion", components)
        rows = [{name: column[i] for name, column in values.extras.items()} for i in range(n)] if values.extras else []
        return Scores(rewards, components, None, _logged_metrics(logged), rows)

    def score_within(
        self,
        timeout_s: float,
        prompt: Prompt,
        prompt_text: str,
        texts: list[str],
        completion_ids: list[list[int]],
        extra: Callable[[], list[float]] | None = None,
        *,
        tool_mask: ToolMask = None,
    ) -> Scores:
        """`score` under one time limit for the whole group, on a thread: past it the
        group fails with that reason, and its thread is abandoned (in an RQ work horse it
        ends with the job's process). An exception `reraise` lets through is raised here."""
        try:
            return within(
                timeout_s,
                lambda: self.score(prompt, prompt_text, texts, completion_ids, extra, tool_mask=tool_mask),
                "score-group",
            )
        except PastLimit:
            return Scores.failed(
                len(texts),
                f"the rewards exceeded the group's time limit of {timeout_s:g}s (the group is rejected, not retried)",
            )

    def _call(
        self,
        rf: RewardFn,
        prompts: list[Any],
        completions: list[Any],
        completion_ids: list[list[int]],
        columns: dict[str, Any],
        n: int,
    ) -> tuple[list[float | None] | None, str | None]:
        def call() -> Any:
            value = rf.fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
            if inspect.isawaitable(value):  # an `async def` reward (an HTTP judge, a sandbox)
                value = asyncio.run(_awaited(value))
            return value

        try:
            values = call() if self.timeout_s is None else within(self.timeout_s, call, f"reward-{rf.name}")
        except PastLimit:
            return None, f"reward {rf.name} exceeded its time limit of {self.timeout_s:g}s"
        except Exception as err:  # a user's function: any failure is reported, not fatal
            if self.reraise:
                raise
            return None, f"reward {rf.name} raised {type(err).__name__}: {err}"
        if not isinstance(values, list | tuple) or len(values) != n:
            return None, f"reward {rf.name} returned {type(values).__name__} of the wrong length (expected {n} values)"
        clean: list[float | None] = []
        for v in values:
            if v is None:
                clean.append(None)
            elif not isinstance(v, numbers.Real) or not math.isfinite(v):
                return None, f"reward {rf.name} returned {v!r}: not a finite number or None"
            else:
                clean.append(float(v))
        return clean, None


def extra_columns(extras: dict[str, list[Any]], n: int) -> dict[str, list[str]]:
    """`log_extra`'s columns as a completion carries them: names that are safe labels, a
    value per completion (a column of another length is left out), each made printable and
    at most MAX_EXTRA_CHARS, the first MAX_EXTRA_COLUMNS columns kept."""
    out: dict[str, list[str]] = {}
    for name, values in extras.items():
        label = printable(name, 64).strip()
        if len(values) == n and label and _SAFE_NAME.match(label) and len(out) < MAX_EXTRA_COLUMNS:
            out[label] = [printable(str(v), MAX_EXTRA_CHARS) for v in values]
    return out


def _logged_metrics(logged: dict[str, list[float]]) -> dict[str, float]:
    """`log_metric`'s values, averaged per name: names made printable and at most 64
    characters, non-finite values left out, the first MAX_LOGGED_METRICS names kept."""
    out: dict[str, float] = {}
    for name, values in logged.items():
        finite = [v for v in values if math.isfinite(v)]
        label = printable(name, 64).strip()
        if finite and label and len(out) < MAX_LOGGED_METRICS:
            out[label] = sum(finite) / len(finite)
    return out


async def _awaited(value: Any) -> Any:
    return await value
