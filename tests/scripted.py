"""An engine whose model says what a test chooses: for episodes, where a tiny random
model never writes a tool call. It subclasses the real interface; everything around it
(the episode loop, the tools' sandbox, the worker, the queue) is the real machinery."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import Any

from actors.engine import Engine, EngineError, GroupRequest, Sample, stop_token_ids

LOGP = -0.5
"""Every scripted token's log-probability."""


def tool_call(name: str, **arguments: Any) -> str:
    import json

    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


class ScriptedEngine(Engine):
    """`script(text so far, sample index) -> the next turn's text`; each turn ends with
    the end-of-turn token (unless `max_tokens` cuts it: `length`)."""

    def __init__(self, tokenizer: Any, script: Callable[[str, int], str], context: int | None = None) -> None:
        self.tokenizer, self.script, self.context = tokenizer, script, context
        self.stop_ids = stop_token_ids(tokenizer)
        self._queue: list[GroupRequest] = []
        self._versions: list[int] = []
        self.evicted: list[int] = []
        self.requests: list[GroupRequest] = []
        self._lock = threading.Lock()

    def load_adapter(self, version: int, path: Path) -> None:
        with self._lock:
            self._versions.append(version)

    def evict_adapter(self, version: int, on_released: Callable[[], None] | None = None) -> None:
        with self._lock:
            if any(g.version == version for g in self._queue):
                raise AssertionError(f"v{version} evicted while a request names it")
            self._versions.remove(version)
            self.evicted.append(version)
        if on_released is not None:
            on_released()

    def loaded_versions(self) -> list[int]:
        with self._lock:
            return list(self._versions)

    def add(self, groups: Sequence[GroupRequest]) -> None:
        with self._lock:
            for g in groups:
                if g.version and g.version not in self._versions:
                    raise EngineError(f"adapter v{g.version} is not loaded")
            fitted = [self.fit(g) for g in groups]
            self._queue += fitted
            self.requests += fitted

    def step(self, timeout_s: float, abort: threading.Event | None = None) -> list[tuple[Hashable, list[Sample]]]:
        with self._lock:
            if abort is not None and abort.is_set():
                self._queue.clear()
                return []
            todo, self._queue = self._queue, []
        if not todo:
            time.sleep(min(timeout_s, 0.01))
        return [(g.key, [self._sample(g, j) for j in range(g.n)]) for g in todo]

    def _sample(self, g: GroupRequest, j: int) -> Sample:
        text = self.tokenizer.decode(list(g.prompt), skip_special_tokens=False)
        ids = [*self.tokenizer(self.script(text, j), add_special_tokens=False)["input_ids"], self.stop_ids[0]]
        if len(ids) > g.sampling.max_tokens:
            ids = ids[: g.sampling.max_tokens]
            return Sample(ids, [LOGP] * len(ids), "length")
        return Sample(ids, [LOGP] * len(ids), "stop")

    @property
    def in_flight(self) -> int:
        with self._lock:
            return sum(g.n for g in self._queue)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)


class FirstTurnCalls:
    """Mix into a real engine (`class E(FirstTurnCalls, TransformersEngine)`): a group's
    first turn (its prompt holds no tool result yet) is the scripted call `FIRST_CALL`, as
    a tiny random model never writes one; every later turn is the engine's own."""

    FIRST_CALL = tool_call("add", a=2, b=3)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._scripted: list[GroupRequest] = []

    def add(self, groups: Sequence[GroupRequest]) -> None:
        first = [g for g in groups if "<tool_response>" not in self.tokenizer.decode(list(g.prompt))]
        super().add([g for g in groups if g not in first])  # type: ignore[misc]
        self._scripted += first

    def step(self, timeout_s: float, abort: threading.Event | None = None) -> list[tuple[Hashable, list[Sample]]]:
        ids = [*self.tokenizer(self.FIRST_CALL, add_special_tokens=False)["input_ids"], self.stop_ids[0]]
        scripted, self._scripted = self._scripted, []
        return [(g.key, [Sample(ids, [LOGP] * len(ids), "stop")] * g.n) for g in scripted] + super().step(  # type: ignore[misc]
            timeout_s, abort
        )

    @property
    def in_flight(self) -> int:
        return super().in_flight + sum(g.n for g in self._scripted)  # type: ignore[misc]
