"""Waiting for a state, not for a length of time: a test polls what it waits for (a file's
line, a queue's count, a client blocked in Redis) and fails naming it, instead of sleeping
a guess that is too long on a quiet machine and too short on a busy one."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def wait_until(ready: Callable[[], T], what: str, timeout_s: float = 10.0, poll_s: float = 0.02) -> T:
    """`ready()`'s first truthy value, polled every `poll_s`; an AssertionError naming
    `what` when `timeout_s` passes first."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = ready()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout_s:g}s for {what}")
        time.sleep(poll_s)


def blocked_in(client: Any, command: str) -> int:
    """How many clients of a real redis-server (or of every node of a cluster's) are blocked
    in `command` (CLIENT LIST's flag `b`): a reader that has reached its wait, seen from the
    server."""
    nodes = getattr(client, "ALL_NODES", None)  # a RedisCluster: a list per node
    listed = client.client_list() if nodes is None else client.client_list(target_nodes=nodes)
    per_node = listed.values() if isinstance(listed, dict) else [listed]
    return sum(1 for clients in per_node for c in clients if "b" in c["flags"] and c["cmd"] == command)
