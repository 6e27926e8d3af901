"""Tools an episode may call (`--tools module:function`, TRL's `tools=[...]`) and its
environment (`--environment module:Class`, TRL's `environment_factory`), run in a bounded
sandbox beside the engine.

A tool is a typed, documented Python function (sync or `async def`): transformers builds
its JSON schema from its signature and docstring, the learner offers the schemas to the
model in the prompt, and the actor runs the calls the model makes. An environment is a
class: one instance per episode, built with no arguments and `reset(**columns)` with the
prompt's public columns; its public methods are more tools, with state; setting its
`done` attribute ends the episode after the call.

The sandbox: pebble process pools (spawned processes, like the reward pool). Stateless
tools run in `workers` processes; environments live in `workers` hosts of one process
each, an episode's instance in one host, its calls run there in order. Every call runs
under `timeout_s` and every process under an address-space limit of `memory_mb`
(`RLIMIT_AS`): a call past its time is killed with its process (a host's episodes lose
their environments with it, and say so on their next call), and a process that runs out
of memory fails its call. Each failure is answered to the model as a tool error and the
episode goes on. The processes see the model's arguments and the prompt's public
columns, nothing else of the data set.

What the model sees of a call: the return value as text (`str`, as TRL does), cut to
`max_result_chars`; or `{'error': '...'}`.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import multiprocessing
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

from protocol.usercode.chat import load_environment, load_episode_tools, load_tool
from protocol.wire.text import printable


@dataclass(frozen=True)
class ToolResult:
    name: str
    content: str
    """What the model is shown."""
    error: bool
    seconds: float
    done: bool = False
    """The episode's environment says the episode is over."""


class Toolbox:
    """The tools of `specs` and an environment, called in sandboxed processes; see the
    module docstring."""

    def __init__(
        self,
        specs: list[str],
        *,
        environment: str | None = None,
        timeout_s: float = 10.0,
        memory_mb: int = 2048,
        workers: int = 8,
        max_result_chars: int = 8192,
    ) -> None:
        import pebble

        tools, self.environment = load_episode_tools(specs, environment)  # fail here, in one line
        self.environment_name = self.environment.__name__ if self.environment is not None else None
        self.names = [fn.__name__ for fn in tools]
        self.methods = set(self.names[len(specs) :])  # the environment's, after the plain tools
        self.timeout_s, self.max_result_chars = timeout_s, max_result_chars
        spawn = multiprocessing.get_context("spawn")
        self.pool = pebble.ProcessPool(
            max_workers=workers, initializer=_init_child, initargs=(list(specs), None, memory_mb), context=spawn
        )
        self.hosts = [
            pebble.ProcessPool(
                max_workers=1, initializer=_init_child, initargs=([], environment, memory_mb), context=spawn
            )
            for _ in range(workers if environment else 0)
        ]
        self._host_of: dict[str, int] = {}
        self._next_host = 0

    # ------------------------------------------------------------------ environments
    def start(self, episode: str, columns: dict[str, Any]) -> None:
        """A new instance for `episode`, in the next host; its calls will run there after it.
        A constructor or `reset` that fails is told to the model at the episode's first call."""
        if not self.hosts:
            return
        self._host_of[episode] = host = self._next_host % len(self.hosts)
        self._next_host += 1
        self.hosts[host].schedule(_start_in_child, args=(episode, json.dumps(columns)), timeout=self.timeout_s)

    def end(self, episode: str) -> None:
        """Forget `episode`'s instance (its `close()` runs, if it has one)."""
        host = self._host_of.pop(episode, None)
        if host is not None:
            self.hosts[host].schedule(_end_in_child, args=(episode,), timeout=self.timeout_s)

    # ------------------------------------------------------------------ calls
    def call(self, name: str, arguments: dict[str, Any], episode: str | None = None) -> Future[ToolResult]:
        """Run one call (an environment's method in `episode`'s instance); the future always
        ends with a `ToolResult`, errors included."""
        outer: Future[ToolResult] = Future()
        if name not in self.names:
            outer.set_result(self._error(name, f"unknown tool {name!r}; the tools are {', '.join(self.names)}", 0.0))
            return outer
        started = time.monotonic()
        if name in self.methods:
            host = self._host_of.get(episode) if episode is not None else None
            if host is None:
                outer.set_result(self._error(name, "this episode has no environment", 0.0))
                return outer
            inner = self.hosts[host].schedule(
                _method_in_child, args=(episode, name, json.dumps(arguments)), timeout=self.timeout_s
            )
        else:
            inner = self.pool.schedule(_call_in_child, args=(name, json.dumps(arguments)), timeout=self.timeout_s)

        def settle(done: Future[tuple[bool, str, bool]]) -> None:
            took = time.monotonic() - started
            try:
                ok, text, over = done.result()
            except FutureTimeout:
                outer.set_result(
                    self._error(name, f"the tool ran past its time limit of {self.timeout_s:g}s and was stopped", took)
                )
                return
            except Exception as err:  # its process died (out of memory, a crash)
                outer.set_result(self._error(name, f"the tool's process died: {type(err).__name__}: {err}", took))
                return
            if ok:
                outer.set_result(ToolResult(name, self._cut(text), False, took, over))
            else:
                outer.set_result(self._error(name, text, took, over))

        inner.add_done_callback(settle)
        return outer

    def _cut(self, text: str) -> str:
        return text if len(text) <= self.max_result_chars else text[: self.max_result_chars] + " [cut]"

    def _error(self, name: str, message: str, seconds: float, done: bool = False) -> ToolResult:
        return ToolResult(name, self._cut(str({"error": printable(message, 1000)})), True, seconds, done)

    def close(self) -> None:
        for pool in [self.pool, *self.hosts]:
            pool.stop()
        for pool in [self.pool, *self.hosts]:
            pool.join(timeout=5)


# ---------------------------------------------------------------- in the sandbox

_CHILD_TOOLS: dict[str, Callable[..., Any]] = {}
_CHILD_ENVIRONMENT: list[type] = []
_CHILD_EPISODES: dict[str, Any] = {}
"""A host's environment instances by episode."""
_CHILD_FAILED: dict[str, str] = {}
"""Episodes whose instance could not be made, and why."""


def _init_child(specs: list[str], environment: str | None, memory_mb: int) -> None:
    import resource

    limit = memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    _CHILD_TOOLS.update({fn.__name__: fn for fn in (load_tool(spec) for spec in specs)})
    if environment:
        _CHILD_ENVIRONMENT.append(load_environment(environment))


def _start_in_child(episode: str, columns: str) -> None:
    try:
        instance = _CHILD_ENVIRONMENT[0]()
        if callable(getattr(instance, "reset", None)):
            observation = instance.reset(**json.loads(columns))
            if observation is not None:
                raise ValueError(
                    "reset() returned an observation; spotgrpo's prompts come from the data set "
                    "(put the observation in the prompt column) and reset() must return None"
                )
    except Exception as err:  # the user's environment
        _CHILD_FAILED[episode] = f"the environment could not be made: {type(err).__name__}: {err}"
        return
    _CHILD_EPISODES[episode] = instance


def _end_in_child(episode: str) -> None:
    _CHILD_FAILED.pop(episode, None)
    instance = _CHILD_EPISODES.pop(episode, None)
    if instance is not None and callable(getattr(instance, "close", None)):
        try:
            instance.close()
        except Exception:  # the episode is over either way
            pass


def _method_in_child(episode: str, name: str, arguments: str) -> tuple[bool, str, bool]:
    instance = _CHILD_EPISODES.get(episode)
    if instance is None:
        why = _CHILD_FAILED.get(
            episode,
            "the environment was lost (its process was restarted after a call ran past its time limit or its memory)",
        )
        return False, why, True
    ok, text = _run(name, getattr(instance, name), arguments)
    return ok, text, bool(getattr(instance, "done", False))


def _call_in_child(name: str, arguments: str) -> tuple[bool, str, bool]:
    ok, text = _run(name, _CHILD_TOOLS[name], arguments)
    return ok, text, False


def _run(name: str, fn: Callable[..., Any], arguments: str) -> tuple[bool, str]:
    """(True, the result as text) or (False, why it failed): a tool's own failure is an
    answer to the model, not an error of the pool."""
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
