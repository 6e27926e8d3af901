"""The environment's replay on the scoring tier, sandboxed as the actors' tools are.

An environment that owns its reward (`get_reward`) is replayed on the trusted side from
the calls the model's turns made (`protocol.usercode.transcript.replay_reward`). That runs a
user's code on input an actor chose, so it runs apart from the RQ work horse, under the
same kinds of limits as a tool on an actor:

- **one process per group**, forked from the work horse when its job starts (before the
  horse starts any thread; the environment's class is already imported, so a fork costs
  milliseconds), all of a job's groups at once: one group's replay never waits for
  another's;
- **a time limit per call** (`call_timeout_s`, the actors' `--tool-timeout-s`): a call
  past it is interrupted (SIGALRM) and the replay fails with that reason, as the call's
  environment is lost on an actor too;
- **a time limit per group** (the group's own `--reward-timeout-s`): past it the process
  is killed (SIGKILL), whatever the code does (a C loop the alarm cannot interrupt);
- **a memory limit** (`memory_mb` more address space than the horse holds, RLIMIT_AS).

A replay that fails says why, and its group is rejected with that reason (running it
again would fail the same way); the values of one that succeeds are the group's
environment reward. The child writes its answer as JSON on a pipe: nothing pickled.
"""

from __future__ import annotations

import json
import os
import resource
import select
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from protocol.usercode.chat import ToolCall
from protocol.usercode.transcript import CallPastLimit, replay_reward


@dataclass(frozen=True)
class ReplayLimits:
    call_timeout_s: float = 10.0
    memory_mb: int = 2048


@dataclass
class Replay:
    """One group's replay, running in its own process (see the module docstring)."""

    pid: int
    fd: int
    deadline: float
    buffer: bytes = b""
    result: list[float] | str | None = None
    """The episodes' rewards, or why the replay failed; None while it runs."""


def start(
    environment: type,
    columns: dict[str, Any],
    episodes: Sequence[Sequence[Sequence[ToolCall]]],
    limits: ReplayLimits,
    group_limit_s: float,
) -> Replay:
    """Fork the process that replays one group's episodes (each: its answered calls, turn by
    turn) and return at once."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: replay, answer, and leave without running the parent's cleanup
        os.close(read_fd)
        code = 0
        try:
            answer = _replay_in_child(environment, columns, episodes, limits)
            _write_all(write_fd, json.dumps(answer).encode())
        except BaseException:  # whatever happened, the child must end here
            code = 1
        finally:
            os._exit(code)
    os.close(write_fd)
    return Replay(pid, read_fd, time.monotonic() + group_limit_s)


def wait(replays: Sequence[Replay], timeout_s: float) -> list[Replay]:
    """Wait up to `timeout_s` for replays to finish; those that did (or ran past their
    group's limit, and were killed) get their `result` and are returned."""
    running = [r for r in replays if r.result is None]
    now = time.monotonic()
    done = []
    for r in running:
        if now >= r.deadline:
            _end(r, "the environment's replay ran past the group's time limit and was killed")
            done.append(r)
    running = [r for r in running if r.result is None]
    if not running:
        return done
    limit = max(0.0, min(timeout_s, *(r.deadline - now for r in running)))
    readable, _, _ = select.select([r.fd for r in running], [], [], limit)
    for r in running:
        if r.fd in readable:
            chunk = os.read(r.fd, 1 << 16)
            if chunk:
                r.buffer += chunk
                continue
            _finish(r)
            done.append(r)
    return done


def close(replays: Sequence[Replay]) -> None:
    """Kill whatever still runs (the job is over)."""
    for r in replays:
        if r.result is None:
            _end(r, "the job ended before the environment's replay")


def _finish(r: Replay) -> None:
    os.close(r.fd)
    _, status = os.waitpid(r.pid, 0)
    try:
        answer = json.loads(r.buffer) if r.buffer else None
    except ValueError:
        answer = None
    if isinstance(answer, dict) and isinstance(answer.get("rewards"), list):
        r.result = [float(v) for v in answer["rewards"]]
    elif isinstance(answer, dict) and isinstance(answer.get("error"), str):
        r.result = answer["error"]
    elif os.WIFSIGNALED(status):
        r.result = f"the environment's replay was killed by signal {os.WTERMSIG(status)} (out of memory?)"
    else:
        r.result = "the environment's replay ended without an answer"


def _end(r: Replay, why: str) -> None:
    try:
        os.kill(r.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    os.waitpid(r.pid, 0)
    os.close(r.fd)
    r.result = why


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data) :]


def _replay_in_child(
    environment: type, columns: dict[str, Any], episodes: Sequence[Sequence[Sequence[ToolCall]]], limits: ReplayLimits
) -> dict[str, Any]:
    with open("/proc/self/statm") as statm:
        vm_pages = int(statm.read().split()[0])
    room = vm_pages * os.sysconf("SC_PAGE_SIZE") + limits.memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (room, room))
    try:
        return {"rewards": [replay_reward(environment, columns, calls, limits.call_timeout_s) for calls in episodes]}
    except CallPastLimit as err:
        return {"error": f"the environment's {err} in the replay"}
    except MemoryError:
        return {"error": f"the environment's replay ran out of its {limits.memory_mb} MB"}
    except Exception as err:  # the user's environment: its constructor, reset or get_reward raised
        return {"error": f"the environment's replay raised {type(err).__name__}: {err}"}
