"""Rewards in worker processes beside an actor's engine (`ScoringPool`).

The reward functions themselves, their loading and calling, are `protocol.usercode.rewards` (the
scoring tier and `learner check` use them too). Here they run in pebble's
`ProcessPool`, spawned, not forked from a process holding a model, so the generation
loop never waits for a reward, and a reward past its limit is killed with its process,
which pebble replaces. pebble over the standard library's `ProcessPoolExecutor`: the
latter cannot kill one task's process on a timeout, only abandon it.
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Protocol

import msgspec

from protocol import Prompt
from protocol.usercode.rewards import Group, Scorer, Scores, ToolMask, load_reward


class Scoring(Protocol):
    """`Scorer` (inline) or `ScoringPool` (processes beside the engine)."""

    def submit(self, group: Group) -> Future[Scores]:
        """Score a group (its prompt, the prompt's text, the completions' texts, ids and
        tool mask)."""
        ...

    def close(self) -> None: ...


class ScoringPool:
    """Rewards in `workers` processes; see the module docstring. A group's scoring may take
    `timeout_s` per reward function; past that its process is killed and replaced, and
    the group fails with that reason."""

    def __init__(self, specs: list[str], timeout_s: float, workers: int = 1) -> None:
        import pebble

        functions = [load_reward(spec) for spec in specs]  # fail here, in one line, not in a child
        self.timeout_s = timeout_s * len(functions)
        self.pool = pebble.ProcessPool(
            max_workers=workers,
            initializer=_init_child,
            initargs=(list(specs),),
            context=multiprocessing.get_context("spawn"),
        )

    def submit(self, group: Group) -> Future[Scores]:
        prompt, prompt_text, texts, completion_ids, tool_mask = group
        inner = self.pool.schedule(
            _score_in_child,
            args=(msgspec.msgpack.encode(prompt), prompt_text, texts, completion_ids, tool_mask),
            timeout=self.timeout_s,
        )
        outer: Future[Scores] = Future()
        n = len(texts)

        def settle(done: Future[Scores]) -> None:
            try:
                outer.set_result(done.result())
            except FutureTimeout:
                outer.set_result(
                    Scores.failed(n, f"scoring exceeded its time limit of {self.timeout_s:g}s (its process was killed)")
                )
            except Exception as err:  # the child died or the reward module failed to import there
                outer.set_result(Scores.failed(n, f"scoring failed: {type(err).__name__}: {err}"))

        inner.add_done_callback(settle)
        return outer

    def close(self) -> None:
        self.pool.stop()
        self.pool.join(timeout=5)


_CHILD_SCORER: Scorer | None = None
"""The scorer of a `ScoringPool` process (one per process, built by its initializer)."""


def _init_child(specs: list[str]) -> None:
    global _CHILD_SCORER
    _CHILD_SCORER = Scorer([load_reward(spec) for spec in specs], timeout_s=None)


def _score_in_child(
    prompt: bytes, prompt_text: str, texts: list[str], completion_ids: list[list[int]], tool_mask: ToolMask
) -> Scores:
    assert _CHILD_SCORER is not None
    return _CHILD_SCORER.score(
        msgspec.msgpack.decode(prompt, type=Prompt), prompt_text, texts, completion_ids, tool_mask=tool_mask
    )
