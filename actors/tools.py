"""Tools an episode may call (`--tools module:function`, TRL's `tools=[...]`), run in a
bounded sandbox beside the engine.

A tool is a typed, documented Python function (sync or `async def`): transformers builds
its JSON schema from its signature and docstring, the learner offers the schemas to the
model in the prompt, and the actor runs the calls the model makes. Calls run in pebble's
`ProcessPool` (spawned processes, like the reward pool), each under `timeout_s`, each
process under an address-space limit of `memory_mb` (`RLIMIT_AS`); a call past its time
is killed with its process, and a process that runs out of memory fails its call: both
are answered to the model as a tool error, and the episode goes on. The processes see
what the call passes them, the model's arguments, and nothing of the data set.

What the model sees of a call: the tool's return value as text (`str`, as TRL does),
cut to `max_result_chars`; or `{"error": "..."}` for an unknown tool, bad arguments, an
exception, a time-out or a killed process.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import multiprocessing
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

from protocol.chat import load_tool, load_tools
from protocol.text import printable


@dataclass(frozen=True)
class ToolResult:
    name: str
    content: str
    """What the model is shown."""
    error: bool
    seconds: float


class Toolbox:
    """The tools of `specs`, called in sandboxed processes; see the module docstring."""

    def __init__(self, specs: list[str], *, timeout_s: float = 10.0, memory_mb: int = 2048, workers: int = 2,
                 max_result_chars: int = 8192) -> None:
        import pebble

        self.tools = load_tools(specs)  # fail here, in one line, not in a child
        self.names = [fn.__name__ for fn in self.tools]
        self.timeout_s, self.max_result_chars = timeout_s, max_result_chars
        self.pool = pebble.ProcessPool(
            max_workers=workers, initializer=_init_child, initargs=(list(specs), memory_mb),
            context=multiprocessing.get_context("spawn"),
        )

    def call(self, name: str, arguments: dict[str, Any]) -> Future[ToolResult]:
        """Run one call; the future always ends with a `ToolResult` (errors included)."""
        outer: Future[ToolResult] = Future()
        if name not in self.names:
            outer.set_result(self._error(name, f"unknown tool {name!r}; the tools are {', '.join(self.names)}", 0.0))
            return outer
        started = _now()
        inner = self.pool.schedule(_call_in_child, args=(name, json.dumps(arguments)), timeout=self.timeout_s)

        def settle(done: Future[tuple[bool, str]]) -> None:
            took = _now() - started
            try:
                ok, text = done.result()
            except FutureTimeout:
                outer.set_result(self._error(name, f"the tool ran past its time limit of {self.timeout_s:g}s "
                                                   "and was stopped", took))
                return
            except Exception as err:  # its process died (out of memory, a crash)
                outer.set_result(self._error(name, f"the tool's process died: {type(err).__name__}: {err}", took))
                return
            if ok:
                outer.set_result(ToolResult(name, self._cut(text), False, took))
            else:
                outer.set_result(self._error(name, text, took))

        inner.add_done_callback(settle)
        return outer

    def _cut(self, text: str) -> str:
        return text if len(text) <= self.max_result_chars else text[: self.max_result_chars] + " [cut]"

    def _error(self, name: str, message: str, seconds: float) -> ToolResult:
        return ToolResult(name, self._cut(str({"error": printable(message, 1000)})), True, seconds)

    def close(self) -> None:
        self.pool.stop()
        self.pool.join(timeout=5)


def _now() -> float:
    import time

    return time.monotonic()


_CHILD_TOOLS: dict[str, Callable[..., Any]] = {}


def _init_child(specs: list[str], memory_mb: int) -> None:
    import resource

    limit = memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    _CHILD_TOOLS.update({fn.__name__: fn for fn in (load_tool(spec) for spec in specs)})


def _call_in_child(name: str, arguments: str) -> tuple[bool, str]:
    """(True, the result as text) or (False, why it failed): a tool's own failure is an
    answer to the model, not an error of the pool."""
    fn = _CHILD_TOOLS[name]
    try:
        args = json.loads(arguments)
        inspect.signature(fn).bind(**args)
    except TypeError as err:
        return False, f"bad arguments for {name}: {err}"
    try:
        value = fn(**args)
        if inspect.isawaitable(value):
            value = asyncio.run(_awaited(value))
    except MemoryError:
        return False, f"{name} ran out of memory"
    except Exception as err:  # a user's tool: any failure is told to the model
        return False, f"{name} raised {type(err).__name__}: {err}"
    return True, str(value)


async def _awaited(value: Any) -> Any:
    return await value
