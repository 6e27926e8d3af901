"""An episode as the trusted side reads it: the mask an actor sends is checked, never
believed.

An episode is the model's turns (mask 1: sampled, trained) with the environment's tokens
between them (mask 0: tool results and the chat template's glue, never trained). An
actor decides the mask, and the learner trains only the mask-1 tokens while the rewards
read every token; a mask that marks the wrong tokens would make the learner train what
the reward never scored. So the scoring tier derives what it can and refuses an episode
whose mask disagrees (`read_transcript`):

- every model turn is read on its own tokens (`protocol.usercode.chat.model_turn_calls`): calls
  written in the environment's tokens are never the model's;
- environment tokens follow only a model turn that ended on an end-of-turn token and
  called tools (or wrote a call that could not be read), within
  `max_tool_calling_iterations` tool turns;
- those tokens are exactly what the template renders for one result per call, by the
  same function the actor used (`protocol.usercode.chat.tool_result_ids`), token for token.

What stays the actor's word: the text of each tool result (a tool that runs only on
actors cannot be re-run here; an environment that owns its reward is replayed from the
model's calls, not from these results), and which of the model's samples it kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import math
import re
import signal
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from protocol.usercode.chat import (
    ParsedTurn,
    ToolCall,
    ToolError,
    environment_methods,
    load_environment,
    model_turn_calls,
    model_turns,
    owns_reward,
    tool_result_ids,
    tool_template,
)

PARSE_ERROR_TOOL = "tool"
"""The name the actor answers a call it could not read under (`actors.episodes`)."""

ERROR_RESULT = "{'error': "
"""How a failed call's result opens (`actors.tools.Toolbox`)."""


class TranscriptError(ValueError):
    """An episode's mask or environment tokens are not what its model turns imply."""


@dataclass(frozen=True)
class Turn:
    start: int
    end: int
    """The model's tokens: `tokens[start:end]`."""
    parsed: ParsedTurn
    """Its calls, read from its own tokens."""
    results: tuple[tuple[str, str], ...]
    """(tool name, content) of the environment's tokens after it, as rendered; empty: none
    followed (the last turn, or a call left unanswered at the turn limit)."""
    ended: bool = True
    """It ended on an end-of-turn token (not cut at the token limit)."""


@dataclass(frozen=True)
class Transcript:
    turns: tuple[Turn, ...]
    max_turns: int | None

    @property
    def tool_calls(self) -> int:
        return sum(len(t.results) for t in self.turns)

    @property
    def tool_errors(self) -> int:
        return sum(content.startswith(ERROR_RESULT) for t in self.turns for _, content in t.results)

    @property
    def turn_limit(self) -> bool:
        """The last turn called tools past the limit and was left unanswered."""
        last = self.turns[-1] if self.turns else None
        return bool(
            last
            and not last.results
            and last.ended
            and self.max_turns is not None
            and len(self.turns) > self.max_turns
            and (last.parsed.calls or last.parsed.error)
        )


def read_transcript(
    tokenizer: Any,
    template: str | None,
    stop_ids: Sequence[int],
    tokens: Sequence[int],
    mask: Sequence[int] | None,
    max_turns: int | None,
) -> Transcript:
    """The episode's turns, each model turn's calls and the results rendered after it;
    `TranscriptError` (saying what and where) if the environment's tokens are not derived
    from the model's turns as the module docstring says."""
    tokens = list(tokens)
    runs = model_turns(mask, len(tokens))
    turns = []
    for k, (start, end) in enumerate(runs):
        glue_end = runs[k + 1][0] if k + 1 < len(runs) else len(tokens)
        parsed = model_turn_calls(tokenizer, tokens[start:end], template)
        env = tokens[end:glue_end]
        if not env:
            turns.append(Turn(start, end, parsed, (), tokens[end - 1] in stop_ids))
            continue
        where = f"the environment's tokens {end}-{glue_end} after model turn {k + 1}"
        if not parsed.calls and parsed.error is None:
            raise TranscriptError(f"{where}: that turn called no tool")
        if max_turns is not None and k + 1 > max_turns:
            raise TranscriptError(f"{where}: a tool turn past max_tool_calling_iterations={max_turns}")
        if tokens[end - 1] not in stop_ids:
            raise TranscriptError(f"{where}: that turn did not end on an end-of-turn token")
        names = [PARSE_ERROR_TOOL] if parsed.error is not None else [c.name for c in parsed.calls]
        contents = _contents(tokenizer, template, stop_ids, names, env)
        if contents is None:
            raise TranscriptError(
                f"{where}: not the chat template's rendering of {len(names)} tool result(s) for {', '.join(names)}"
            )
        turns.append(Turn(start, end, parsed, tuple(zip(names, contents, strict=True))))
    return Transcript(tuple(turns), max_turns)


SENTINEL = "Qzq{}spotgrpoResult{}qzQ"


def _contents(
    tokenizer: Any, template: str | None, stop_ids: Sequence[int], names: list[str], env: list[int]
) -> list[str] | None:
    """The results' contents if `env` is exactly the rendering of one result per name."""
    marks = [SENTINEL.format(i, i) for i in range(len(names))]
    shape = tokenizer.decode(
        tool_result_ids(tokenizer, template, list(zip(names, marks, strict=True)), stop_ids), skip_special_tokens=False
    )
    if not all(shape.count(m) == 1 for m in marks):
        return None  # the template does not render results as given: nothing to match against
    pattern = "".join(
        re.escape(piece) if i % 2 == 0 else "(.*?)"
        for i, piece in enumerate(re.split("(" + "|".join(map(re.escape, marks)) + ")", shape))
    )
    found = re.fullmatch(pattern, tokenizer.decode(env, skip_special_tokens=False), re.DOTALL)
    if found is None:
        return None
    contents = list(found.groups())
    if tool_result_ids(tokenizer, template, list(zip(names, contents, strict=True)), stop_ids) != env:
        return None  # the same text from other tokens (a special token spelled out, a different split)
    return contents


def answered_calls(transcript: Transcript) -> list[list[ToolCall]]:
    """The calls the episode's environment answered, turn by turn: those of each model turn
    that environment tokens follow (a call past the turn limit, or left unanswered when
    the tokens ran out, was never run)."""
    return [list(t.parsed.calls) for t in transcript.turns if t.results]


class CallPastLimit(BaseException):
    """A replayed call ran past its time limit (`replay_reward`'s `call_timeout_s`): a
    BaseException, so that the replay's own handling of a call that raised lets it through."""


def replay_reward(
    environment: type, columns: dict[str, Any], calls: Sequence[Sequence[ToolCall]], call_timeout_s: float | None = None
) -> float:
    """An environment's own reward (TRL's `get_reward`) for an episode, on the trusted side:
    a fresh instance, `reset` with every column of the prompt (the private ones too), the
    calls the model's turns made (`answered_calls`: read from the model's tokens alone;
    what the actor says the tools returned plays no part) made again in order, until one
    sets `done`; then `get_reward()`. The environment must be deterministic given its
    columns and the calls (seed any randomness from a column). A call that raises is
    skipped, as the model was told of it; `reset` or `get_reward` raising is the caller's
    error. `call_timeout_s` (main thread only, by SIGALRM; `learner.scoring.replay` runs this in a
    process of its own): each of reset, the calls and get_reward past it raises
    `CallPastLimit` naming it."""
    with _limit(call_timeout_s, "the constructor"):
        instance = environment()
    if callable(getattr(instance, "reset", None)):
        with _limit(call_timeout_s, "reset"):
            instance.reset(**columns)
    methods = {fn.__name__ for fn in environment_methods(instance)}
    for turn in calls:
        for call in turn:
            if call.name in methods and not getattr(instance, "done", False):
                with _limit(call_timeout_s, call.name):
                    try:
                        value = getattr(instance, call.name)(**call.arguments)
                        if inspect.isawaitable(value):
                            asyncio.run(_awaited(value))
                    except Exception:  # the episode's model was answered with the error
                        pass
        if getattr(instance, "done", False):
            break
    with _limit(call_timeout_s, "get_reward"):
        value = instance.get_reward()
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{environment.__name__}.get_reward() returned {value!r}: not a finite number")
    return float(value)


@contextlib.contextmanager
def _limit(seconds: float | None, name: str) -> Iterator[None]:
    if seconds is None:
        yield
        return

    def past(signum: int, frame: Any) -> None:
        raise CallPastLimit(f"{name} ran past its time limit of {seconds:g}s")

    previous = signal.signal(signal.SIGALRM, past)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


async def _awaited(value: Any) -> Any:
    return await value


@dataclass(frozen=True)
class EnvironmentReward:
    """An environment's own reward (`get_reward`), replayed on the trusted side for each
    episode of a group (`replay_reward`, in `learner.scoring.replay`'s sandbox); a reward named
    after its class, weight 1."""

    environment: type
    tokenizer: Any
    template: str | None

    @property
    def name(self) -> str:
        return self.environment.__name__


def environment_reward(spec: str, tokenizer: Any) -> EnvironmentReward:
    """`--environment` on the scoring tier: a class with `get_reward`, and the run's template."""
    cls = load_environment(spec)
    if not owns_reward(cls):
        raise ToolError(
            f"--environment {spec!r}: {cls.__name__} has no get_reward(); the tier scores with --reward functions alone"
        )
    return EnvironmentReward(cls, tokenizer, tool_template(tokenizer))
