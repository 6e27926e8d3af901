"""Shared fixtures: the queue on each Redis backend, the tiny models, the scoring tier's
workers. The servers themselves (Redis, S3, the proxy) are `servers.py`'s, made available
here."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import fakeredis
import pytest
import redis

from protocol import Queue, QueueConfig, RolloutGroup
from protocol.trusted import RedisQueue

if TYPE_CHECKING:
    from servers import RedisClusterNodes, RedisServer

pytest_plugins = ["servers"]  # the servers' fixtures (Redis, S3, the proxy), for every test


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The real model's tests first, then the long ones, the rest in file order: pytest-xdist
    deals tests to its workers one at a time in this order, so the few that take minutes
    start at once on different workers (a slow test dealt last would run alone at the end).
    Dealing the `slow` ones first too was slower (over 9 min against 7 min 42 s for the main
    suite on 3 workers, 2026-12-05): together they only contend for the two cores."""

    def rank(item: pytest.Item) -> int:
        return 0 if item.get_closest_marker("real_model") else 1 if item.get_closest_marker("long") else 2

    items.sort(key=rank)  # stable: the order within a rank is the files'


@pytest.fixture(params=["redis", "fakeredis", "cluster"])
def backend(request: pytest.FixtureRequest) -> Iterator[object]:
    """A client factory on a real redis-server, an in-process fakeredis server or a
    3-master Redis Cluster (redis-py's cluster client, as `RedisQueue.from_url` picks for
    a cluster node). Each call returns a new client (a new connection) to the same server."""
    yield from redis_clients(request, request.param)


def redis_clients(request: pytest.FixtureRequest, kind: str) -> Iterator[object]:
    """`backend`'s body: a factory of clients of a real ("redis") or fake Redis server."""
    if kind == "cluster":
        from redis.cluster import RedisCluster

        request.applymarker(pytest.mark.redis)
        cluster: RedisClusterNodes = request.getfixturevalue("redis_cluster")
        nodes: list[RedisCluster] = []

        def make_node_client() -> RedisCluster:
            nodes.append(RedisCluster(host="127.0.0.1", port=cluster.nodes[0].port))
            return nodes[-1]

        yield make_node_client
        for n in nodes:
            n.close()
        return
    if kind == "redis":
        request.applymarker(pytest.mark.redis)
        server: RedisServer = request.getfixturevalue("redis_server")
        clients: list[redis.Redis] = []

        def make() -> redis.Redis:
            clients.append(redis.Redis(port=server.port))
            return clients[-1]
    else:
        fake_server = fakeredis.FakeServer(version=(7, 0))
        clients = []

        def make() -> redis.Redis:
            clients.append(fakeredis.FakeRedis(server=fake_server, version=(7, 0)))
            return clients[-1]

    yield make
    for c in clients:
        c.close()


@pytest.fixture
def run_name() -> str:
    return f"test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def make_queue(backend, run_name):
    """`make_queue(**config)` -> a RedisQueue on the backend, sharing the test's run."""

    def make(**overrides: object) -> RedisQueue:
        config = QueueConfig(run=run_name, **overrides)
        return RedisQueue(backend(), config)

    return make


# ------------------------------------------------------------------ learner fixtures


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama and its character tokenizer, saved like a hub model (`--model <path>`)."""
    from learner.tiny import save_tiny

    return save_tiny(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tiny_chatml_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with a ChatML tokenizer (`<|im_end|>` ends a turn; no tools section
    in its template, as SmolLM2's): the model of episode tests."""
    from learner.tiny import save_tiny

    # tool schemas take ~800 tokens of a character tokenizer: a longer context than the other's
    return save_tiny(tmp_path_factory.mktemp("tiny-chatml-model"), chatml=True, max_positions=4096)


# ------------------------------------------------------------------ scoring tier


def read_all(q: Queue, n: int, timeout_s: float = 60) -> list[RolloutGroup]:
    """Up to `n` rollout groups, as the learner reads them, waiting up to `timeout_s`."""
    out: list[RolloutGroup] = []
    deadline = time.monotonic() + timeout_s
    while len(out) < n and time.monotonic() < deadline:
        out += [d.group for d in q.read_rollouts("learner-0", n, block_s=1.0)]
    return out


REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def scorers(
    redis_server: RedisServer, run_name: str, tmp_path: Path, tiny_model: Path
) -> Iterator[Callable[..., subprocess.Popen]]:
    """`scorers(*flags, reward=...)` starts one `learner score` worker, as a user would
    (named scorer-<n>-<run>: RQ worker names are global to the Redis)."""
    started: list[subprocess.Popen] = []

    def start(*flags: str, reward: str = "toy_rewards:digit_first", model: Path = tiny_model) -> subprocess.Popen:
        with (tmp_path / f"scorer-{len(started)}.log").open("wb") as log:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "learner.cli",
                    "score",
                    "--queue",
                    redis_server.url,
                    "--run",
                    run_name,
                    "--reward",
                    reward,
                    "--model",
                    str(model),
                    "--name",
                    f"scorer-{len(started)}-{run_name}",
                    "--maintenance-interval-s",
                    "1",
                    "--monitoring-interval-s",
                    "1",
                    "--abandon-after-s",
                    "2",
                    *flags,
                ],
                env={**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'tests'}"},
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        started.append(proc)
        return proc

    yield start
    from servers import kill_process  # after pytest has registered the plugin (it rewrites its asserts)

    for proc in started:
        kill_process(proc)
