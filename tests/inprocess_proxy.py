"""The proxy app in this process, served by uvicorn on a loopback port in a thread, in front
of a real `RedisQueue`, reached through the real HTTPS client (`HttpQueue`, plain HTTP
here): the queue contract through the proxy without a server process (`tests/test_queue.py`
runs every contract test this way too). Server processes and TLS are tested in
`test_proxy.py`."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path

import uvicorn
from servers import TOKENS, free_port

from protocol import (
    AdapterManifest,
    AdapterSubscription,
    DeadLetter,
    Delivery,
    FinishedBatch,
    Lease,
    PromptBatch,
    Queue,
    QueueStats,
    RolloutGroup,
    SubmitResult,
    WorkerStatus,
)
from protocol.client.http_queue import HttpQueue
from protocol.client.queue import AdapterEvent
from protocol.trusted import RedisQueue
from protocol.trusted.store import FileStore
from proxy.app import build_app
from proxy.auth import Tokens
from proxy.context import Context, ProxyLimits
from proxy.metrics import ProxyMetrics
from proxy.server import ProxyServer

ACTOR_TOKEN = "fleet"
"""The actor token's name: the proxy lists a worker `w` as `fleet/w`."""


class ProxiedQueue(Queue):
    """The `Queue` interface through the proxy app: actor calls with an actor token, the
    learner's with a learner token, as the two sides of a run make them. `_r`, `keys` and
    `config` are the Redis queue's behind it, for white-box checks."""

    def __init__(self, direct: RedisQueue, store_dir: Path) -> None:
        self.direct, self.config, self.keys, self._r = direct, direct.config, direct.keys, direct._r
        tokens = Tokens.from_toml(
            f'[[tokens]]\nname = "{ACTOR_TOKEN}"\nrole = "actor"\nsecret = "{TOKENS["actor"]}"\n'
            f'[[tokens]]\nname = "trainer"\nrole = "learner"\nsecret = "{TOKENS["learner"]}"\n',
            "test",
        )
        ctx = Context(
            queue=direct,
            store=FileStore(str(store_dir)),
            tokens=tokens,
            limits=ProxyLimits(rate_per_s=1e6, burst=1e6),
            metrics=ProxyMetrics(),
        )
        self.server = ProxyServer(
            uvicorn.Config(
                build_app(ctx), host="127.0.0.1", port=free_port(), log_level="warning", timeout_graceful_shutdown=1
            ),
            on_exit=ctx.hub.close_soon,
        )
        self.thread = threading.Thread(target=self.server.run, name="proxy", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the in-process proxy did not start")
            time.sleep(0.01)
        url = f"http://127.0.0.1:{self.server.config.port}"
        self.actor = HttpQueue(url, TOKENS["actor"], direct.config, retry_s=2)
        self.learner = HttpQueue(url, TOKENS["learner"], direct.config, retry_s=2)

    @staticmethod
    def listed(worker: str) -> str:
        return f"{ACTOR_TOKEN}/{worker}"

    # the actor's calls
    def claim(self, worker: str, count: int = 1, block_s: float = 0.0) -> list[Lease]:
        return self.actor.claim(worker, count, block_s)

    def heartbeat(self, worker: str, lease_ids: Sequence[str]) -> list[str]:
        return self.actor.heartbeat(worker, lease_ids)

    def submit(self, worker: str, lease_id: str, groups: Sequence[RolloutGroup]) -> SubmitResult:
        return self.actor.submit(worker, lease_id, groups)

    def release(self, worker: str, lease_id: str) -> bool:
        return self.actor.release(worker, lease_id)

    def report_status(self, status: WorkerStatus) -> None:
        self.actor.report_status(status)

    def leave(self, worker: str) -> bool:
        return self.actor.leave(worker)

    def subscribe_adapters(self) -> AdapterSubscription:
        return self.actor.subscribe_adapters()

    # the learner's
    def add_prompts(self, batches: Sequence[PromptBatch]) -> int:
        return self.learner.add_prompts(batches)

    def read_rollouts(self, consumer: str, count: int, block_s: float = 0.0) -> list[Delivery]:
        return self.learner.read_rollouts(consumer, count, block_s)

    def pending_rollouts(self, consumer: str, count: int, after: str = "0") -> list[Delivery]:
        return self.learner.pending_rollouts(consumer, count, after)

    def ack_rollouts(self, delivery_ids: Sequence[str], finished: Sequence[FinishedBatch] = ()) -> int:
        return self.learner.ack_rollouts(delivery_ids, finished)

    def dead_letters(self, after: str = "0", count: int = 100) -> list[DeadLetter]:
        return self.learner.dead_letters(after, count)

    def announce(self, manifest: AdapterManifest) -> str:
        return self.learner.announce(manifest)

    def latest_adapter(self) -> AdapterManifest | None:
        return self.learner.latest_adapter()

    def adapter_events(self, after: str = "0", count: int = 100, block_s: float = 0.0) -> list[AdapterEvent]:
        return self.actor.adapter_events(after, count, block_s)

    def expire_run(self, ttl_s: float) -> int:
        return self.learner.expire_run(ttl_s)

    def set_run_over(self, why: str) -> None:
        self.learner.set_run_over(why)

    def set_run_rewards(self, specs: Sequence[str]) -> None:
        self.learner.set_run_rewards(specs)

    def workers(self, max_age_s: float = 120.0) -> list[WorkerStatus]:
        return self.learner.workers(max_age_s)

    def stats(self) -> QueueStats:
        return self.learner.stats()

    def close(self) -> None:
        self.actor.close()
        self.learner.close()
        self.server.on_exit()  # the event streams end first, as on SIGTERM
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.direct.close()
