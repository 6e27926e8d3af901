"""The scoring tier's reward functions in a process that outlives its jobs.

RQ forks a work horse per job, and a reward called in the horse loses with it whatever it
built: a client, a judge model loaded on first use, a cache. So the scoring worker starts
its reward functions once, in a process of their own (the host: `multiprocessing`'s spawn,
a fresh interpreter that imports the `--reward` modules), and each work horse asks it for a
group's values over a pipe (msgpack, no pickle). A reward module's state then lives as
long as the worker.

What stays in the horse: decoding, the environment's replay (`extra`, forked per episode),
combining the values with their weights, storing. What the horse's time limit does: a
group whose values do not come back within `--reward-timeout-s` is rejected with that
reason, and the host, still busy with it, is killed (SIGKILL); the worker starts another
before it forks its next horse (`ensure`). A reward that raises makes the horse raise, so
RQ retries the job, as before. The host ends with the worker: when every copy of the
worker's end of the pipe is closed (the worker and its horses gone, however they ended),
its read sees end-of-file.

Only one horse runs at a time per worker, so the host serves one request at a time. A
reply that arrives for an earlier request (a horse killed while it waited) is told apart by
its id and dropped.

A host says it is ready (an empty reply) once its rewards are imported, and `start` waits
for that: a group's time limit counts the rewards' work, not a fresh interpreter's imports
on a busy machine.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

import msgspec

from protocol import Prompt
from protocol.usercode.rewards import (
    Called,
    Group,
    RewardFn,
    Scorer,
    Scores,
    ToolMask,
    Values,
    load_reward,
)
from protocol.util.deadline import PastLimit

log = logging.getLogger(__name__)


class _Group(msgspec.Struct, frozen=True, array_like=True):
    prompt: Prompt
    prompt_text: str
    texts: list[str]
    completion_ids: list[list[int]]
    tool_mask: list[list[int]] | None = None


class _Request(msgspec.Struct, frozen=True):
    id: str
    groups: list[_Group]
    """Scored together (`Scorer.call_batch`): one group, or a job's with `--reward-batch`."""


class _Result(msgspec.Struct, frozen=True, array_like=True):
    values: dict[str, list[float | None]] | None
    logged: dict[str, list[float]]
    extras: dict[str, list[str]]
    failed: str | None
    """The group fails (a reward returned garbage, abstained everywhere, ...)."""


class _Reply(msgspec.Struct, frozen=True):
    id: str
    results: list[_Result] = []
    raised: str | None = None
    """A reward raised: the job is retried by RQ."""


_READY = ""
"""The id of the reply a host sends once its rewards are loaded."""


class RewardRaised(RuntimeError):
    """A reward function raised in the host (the horse raises it so RQ retries the job)."""


class RewardHost:
    """The worker's side: the host's process and the pipe to it."""

    def __init__(self, specs: list[str]) -> None:
        self.specs = list(specs)
        self.pid: int | None = None
        self._conn: Connection | None = None
        self._process: Any = None

    def start(self) -> None:
        """A new host, returned once it has loaded its rewards (RuntimeError if it ends first)."""
        ctx = multiprocessing.get_context("spawn")
        ours, theirs = ctx.Pipe()
        self._process = ctx.Process(target=serve, args=(theirs, self.specs), name="reward-host", daemon=True)
        self._process.start()
        theirs.close()
        self._conn, self.pid = ours, self._process.pid
        began = time.monotonic()
        try:
            ready = msgspec.msgpack.decode(ours.recv_bytes(), type=_Reply)
        except (EOFError, OSError):
            self._process.join(5)
            raise RuntimeError(
                f"the reward host ended while loading {', '.join(self.specs)} (exit {self._process.exitcode})"
            ) from None
        assert ready.id == _READY, ready
        log.info("reward host %d ready in %.1fs: %s", self.pid, time.monotonic() - began, ", ".join(self.specs))

    def ensure(self) -> None:
        """In the worker, before it forks a horse: a host killed by an earlier horse (a
        reward past its time) is replaced."""
        if self._process is not None and self._process.is_alive():
            return
        if self._process is not None:
            log.warning("reward host %s ended (exit %s); starting another", self.pid, self._process.exitcode)
            self.close()
        self.start()

    def call(self, request: _Request, timeout_s: float | None) -> _Reply:
        """In a horse: the host's reply to `request`, or PastLimit. Past the limit the host
        is killed and the horse starts one of its own for the job's other groups (it ends
        with the horse; the worker replaces its own before the next job)."""
        assert self._conn is not None, "the reward host was not started"
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            self._conn.send_bytes(msgspec.msgpack.encode(request))
            while True:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                if not self._conn.poll(left):
                    self.kill()
                    self._conn.close()
                    self.start()
                    raise PastLimit()
                reply = msgspec.msgpack.decode(self._conn.recv_bytes(), type=_Reply)
                if reply.id == request.id:
                    return reply
        except (EOFError, BrokenPipeError, ConnectionResetError):
            raise RewardRaised("the reward host ended while scoring (killed, or out of memory?)") from None

    def kill(self) -> None:
        """From a horse too: by pid (a forked horse may not use its parent's process object)."""
        if self.pid is not None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._process is not None:
            self._process.kill()
            self._process.join(5)
            self._process = None


class HostedScorer(Scorer):
    """A `Scorer` whose reward functions run in a `RewardHost` (started by the worker with
    `host.start()`); weights, the environment's reward and the totals stay here."""

    def __init__(self, functions: list[RewardFn], specs: list[str], extra: str | None = None) -> None:
        super().__init__(functions, timeout_s=None, reraise=True, extra=extra)
        self.host = RewardHost(specs)
        self._limit: float | None = None

    def call_batch(self, groups: Sequence[Group]) -> list[Called]:
        if not self.functions:  # an environment's reward alone
            return [Values({}, {}, {}) for _ in groups]
        sent = [_Group(p, pt, list(t), [list(i) for i in ids], mask) for p, pt, t, ids, mask in groups]
        request = _Request(os.urandom(8).hex(), sent)
        reply = self.host.call(request, self._limit)
        if reply.raised is not None:
            raise RewardRaised(reply.raised)
        if len(reply.results) != len(groups):
            return [Scores.failed(len(g[2]), "the reward host answered nothing") for g in groups]
        out: list[Called] = []
        for r, (_, _, texts, _, _) in zip(reply.results, groups, strict=True):
            if r.values is None:
                out.append(Scores.failed(len(texts), r.failed or "failed"))
            else:
                out.append(Values(r.values, r.logged, r.extras))
        return out

    def call_batch_within(self, timeout_s: float, groups: Sequence[Group]) -> list[Called]:
        """`call_batch` within `timeout_s` (PastLimit past it: the host is killed)."""
        self._limit = timeout_s
        try:
            return self.call_batch(groups)
        finally:
            self._limit = None

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
        """The functions' values within `timeout_s` (the host is killed past it), then the
        environment's reward and the totals here."""
        self._limit = timeout_s
        try:
            return self.score(prompt, prompt_text, texts, completion_ids, extra, tool_mask=tool_mask)
        except PastLimit:
            return Scores.failed(
                len(texts),
                f"the rewards exceeded the group's time limit of {timeout_s:g}s (the group is rejected, not retried)",
            )
        finally:
            self._limit = None


def serve(conn: Connection, specs: list[str]) -> None:
    """The host's main: load the rewards, then answer requests until the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the worker, which ends us
    scorer = Scorer([load_reward(spec) for spec in specs], timeout_s=None, reraise=True)
    decoder = msgspec.msgpack.Decoder(_Request)
    encoder = msgspec.msgpack.Encoder()
    conn.send_bytes(encoder.encode(_Reply(_READY)))
    while True:
        try:
            request = decoder.decode(conn.recv_bytes())
        except (EOFError, OSError):
            return  # the worker and its horses are gone
        try:
            groups = [(g.prompt, g.prompt_text, g.texts, g.completion_ids, g.tool_mask) for g in request.groups]
            results = [
                _Result(None, {}, {}, c.error or "failed") if isinstance(c, Scores) else _Result(*c, None)
                for c in scorer.call_batch(groups)
            ]
            reply = _Reply(request.id, results)
        except Exception as err:  # the user's reward
            reply = _Reply(request.id, raised=f"{type(err).__name__}: {err}")
        conn.send_bytes(encoder.encode(reply))
