"""Episodes: samples that call tools, turn after turn, over any engine.

`EpisodeEngine` wraps an engine (vLLM, transformers, a test's) and is one itself. A group
queued with `tool_turns` runs its first turn as one group of `n` on the engine; then each
sample goes its own way: when a turn ends on its stop token and calls tools, the calls
run in the `Toolbox` (processes beside the engine), and when their results are in, the
episode's next turn is queued as a request of its own continuing the episode's tokens
(prompt, turns so far, the results as the chat template renders them). Meanwhile the
engine generates every other lease's sequences: a tool call never idles it.

An episode's tokens after the prompt carry a mask: 1 for the model's tokens (with their
log-probabilities), 0 for the environment's (tool results and the template's glue, log-
probability 0), never trained. It ends when a turn calls no tool, when it has called
tools `tool_turns` times (the last turn is still the model's), or when its next turn would
not fit: `sampling.max_tokens` bounds the whole episode (TRL's `max_completion_length`) and
the model's context bounds prompt and episode. An episode cut at a limit ends `length`.

A pinned episode (`GroupRequest.follow` None) runs every turn on the adapter version it
started with: an eviction that arrives while it waits on a tool is held until it ends.
A following one takes the newest version at each turn (and the engine may switch within
a turn); its tokens keep their versions, an environment token its model turn's. A group queued
without `tool_turns` passes straight through to the engine.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

import msgspec

from actors.engine import Engine, GroupRequest, Sample
from actors.tools import Toolbox, ToolResult
from protocol.usercode.chat import model_turn_calls, tool_result_ids

_TURN = "episode-turn"


@dataclass
class _Episode:
    prompt: list[int]
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    """Its environment instance's name in the sandbox."""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turn_version: int = 0
    """The version its running (or last) model turn was queued with."""
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_s: float = 0.0
    pending: list[Future[ToolResult]] | None = None
    """The tool calls of its last turn, while they run."""
    finish: Literal["stop", "length", "abort"] | None = None
    turn_limit: bool = False

    def sample(self, version: int) -> Sample:
        """The episode as one sample of a group queued on `version`."""
        assert self.finish is not None
        return Sample(
            self.tokens,
            self.logprobs,
            self.finish,
            self.mask if 0 in self.mask else None,
            max(self.turns, 1),
            self.tool_calls,
            self.tool_errors,
            self.tool_s,
            self.turn_limit,
            self.versions,
        ).of_group(version)


@dataclass
class _Group:
    request: GroupRequest
    episodes: list[_Episode]

    @property
    def done(self) -> bool:
        return all(e.finish is not None for e in self.episodes)


class EpisodeEngine(Engine):
    """See the module docstring. `template`: the chat template episodes are rendered with
    (`protocol.usercode.chat.tool_template`: None for the tokenizer's own)."""

    def __init__(self, inner: Engine, toolbox: Toolbox, template: str | None) -> None:
        self.inner, self.toolbox, self.template = inner, toolbox, template
        self.tokenizer = inner.tokenizer
        self.context, self.stop_ids, self.max_num_seqs = inner.context, inner.stop_ids, inner.max_num_seqs
        self._groups: dict[Hashable, _Group] = {}
        self._lock = threading.Lock()
        self._held: dict[int, Callable[[], None] | None] = {}
        """Versions evicted while an episode still runs on them: evicted when it ends."""

    # ------------------------------------------------------------------ adapters
    def load_adapter(self, version: int, path: Path) -> None:
        with self._lock:
            if version in self._held:  # wanted again before its episodes ended: it never left
                del self._held[version]
                return
        self.inner.load_adapter(version, path)

    def evict_adapter(self, version: int, on_released: Callable[[], None] | None = None) -> None:
        with self._lock:
            if any(g.request.version == version for g in self._groups.values()):
                self._held[version] = on_released
                return
        self.inner.evict_adapter(version, on_released)

    def loaded_versions(self) -> list[int]:
        with self._lock:
            held = set(self._held)
        return [v for v in self.inner.loaded_versions() if v not in held]

    def _release_held(self) -> None:
        with self._lock:
            free = [v for v in self._held if not any(g.request.version == v for g in self._groups.values())]
            released = [(v, self._held.pop(v)) for v in free]
        for version, callback in released:
            self.inner.evict_adapter(version, callback)

    # ------------------------------------------------------------------ generation
    def decode(self, token_ids: Sequence[int]) -> str:
        return self.inner.decode(token_ids)

    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size

    @property
    def in_flight(self) -> int:
        """The engine's sequences and the episodes waiting on their tools."""
        waiting = sum(e.pending is not None for g in self._groups.values() for e in g.episodes)
        return self.inner.in_flight + waiting

    def add(self, groups: Sequence[GroupRequest]) -> None:
        self.inner.add(groups)  # all or none; an episode's first turn is its group's
        with self._lock:
            for g in groups:
                if g.tool_turns is not None:
                    episodes = [_Episode(list(g.prompt), turn_version=g.version) for _ in range(g.n)]
                    self._groups[g.key] = group = _Group(g, episodes)
                    for episode in group.episodes:  # made while its first turn generates
                        self.toolbox.start(episode.id, dict(g.columns or {}))

    def step(self, timeout_s: float, abort: threading.Event | None = None) -> list[tuple[Hashable, list[Sample]]]:
        finished = self.inner.step(timeout_s, abort)
        if abort is not None and abort.is_set():
            with self._lock:
                dropped, self._groups = list(self._groups.values()), {}
            for lost in dropped:
                for episode in lost.episodes:
                    self.toolbox.end(episode.id)
            self._release_held()
            return []
        out: list[tuple[Hashable, list[Sample]]] = []
        for key, samples in finished:
            if isinstance(key, tuple) and len(key) == 3 and key[0] == _TURN:
                _, group_key, j = key
                group = self._groups.get(group_key)
                if group is not None:
                    self._turn(group, group.episodes[j], samples[0], j)
            elif key in self._groups:
                group = self._groups[key]
                for j, (episode, sample) in enumerate(zip(group.episodes, samples, strict=True)):
                    self._turn(group, episode, sample, j)
            else:
                out.append((key, samples))
        for group_key, group in list(self._groups.items()):
            for j, episode in enumerate(group.episodes):
                if episode.pending is not None and all(f.done() for f in episode.pending):
                    self._results(group, episode, j)
            if group.done:
                with self._lock:
                    del self._groups[group_key]
                out.append((group_key, [e.sample(group.request.version) for e in group.episodes]))
        self._release_held()
        return out

    def _turn(self, group: _Group, episode: _Episode, sample: Sample, j: int) -> None:
        """A model turn is in: keep it, then end the episode or run the tools it calls."""
        start = len(episode.tokens)
        episode.tokens += sample.token_ids
        episode.logprobs += sample.logprobs
        episode.mask += [1] * len(sample.token_ids)
        episode.versions += sample.token_versions(episode.turn_version)
        episode.turns += 1
        if sample.finish_reason != "stop":
            self._end(episode, sample.finish_reason)
            return
        assert group.request.tool_turns is not None
        # read on its own tokens, as the trusted side reads it (`protocol.usercode.transcript`)
        parsed = model_turn_calls(self.tokenizer, episode.tokens[start:], self.template)
        if not parsed.calls and parsed.error is None:
            self._end(episode, "stop")
            return
        if episode.turns > group.request.tool_turns:  # it calls tools past the limit: ended, unanswered
            episode.turn_limit = True
            self._end(episode, "stop")
            return
        if parsed.error is not None:
            failed: Future[ToolResult] = Future()
            failed.set_result(ToolResult("tool", str({"error": parsed.error}), True, 0.0))
            episode.pending = [failed]
        else:
            episode.pending = [self.toolbox.call(c.name, c.arguments, episode.id) for c in parsed.calls]

    def _results(self, group: _Group, episode: _Episode, j: int) -> None:
        """Its tools are done: append their results and queue its next turn, if it fits."""
        results = [f.result() for f in episode.pending or []]
        episode.pending = None
        episode.tool_calls += len(results)
        episode.tool_errors += sum(r.error for r in results)
        episode.tool_s += sum(r.seconds for r in results)
        glue = tool_result_ids(self.tokenizer, self.template, [(r.name, r.content) for r in results], self.stop_ids)
        request = group.request
        room = request.sampling.max_tokens - len(episode.tokens) - len(glue)
        if self.context is not None:
            room = min(room, self.context - len(episode.prompt) - len(episode.tokens) - len(glue))
        if room < 1:
            self._end(episode, "length")  # the results do not fit: the episode ends on its last turn
            return
        episode.tokens += glue
        episode.logprobs += [0.0] * len(glue)
        episode.mask += [0] * len(glue)
        episode.versions += episode.versions[-1:] * len(glue)
        if any(r.done for r in results):  # its environment ended it: the results are the last word
            self._end(episode, "stop")
            return
        seed = None if request.seed is None else request.seed + j + 7919 * episode.turns
        episode.turn_version = request.version if request.follow is None else request.follow()
        self.inner.add(
            [
                GroupRequest(
                    (_TURN, request.key, j),
                    episode.prompt + episode.tokens,
                    1,
                    msgspec.structs.replace(request.sampling, max_tokens=room),
                    episode.turn_version,
                    seed,
                    follow=request.follow,
                )
            ]
        )

    def _end(self, episode: _Episode, reason: Literal["stop", "length", "abort"]) -> None:
        episode.finish = reason
        self.toolbox.end(episode.id)

    def close(self) -> None:
        self.toolbox.close()
        self.inner.close()


def episode_request(group: GroupRequest, max_iterations: int | None) -> GroupRequest:
    """`group` as episodes of up to `max_iterations` tool-calling turns (None: no limit but
    the tokens)."""
    return replace(group, tool_turns=max_iterations if max_iterations is not None else 1 << 30)
