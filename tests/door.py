"""The proxy's app in this process behind Starlette's `TestClient`: no server process, no
socket, no TLS, so a test of how the door answers a request (a 400 naming the field, a
422, and nothing changed behind it) takes milliseconds. The queue behind it is a real
`RedisQueue` on the session's redis-server. What needs the real server (TLS, sockets,
connection and body limits, several proxies) stays with `servers.ProxyProcess`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
from starlette.testclient import TestClient

from protocol import Lease, QueueConfig, RolloutGroup
from protocol.client.http import CONTENT_TYPE, ClaimRequest, ClaimResponse, SubmitRequest, decode_body, encode_body
from protocol.trusted import RedisQueue
from protocol.trusted.store import FileStore
from proxy.app import build_app
from proxy.auth import Tokens
from proxy.context import Context, ProxyLimits
from proxy.metrics import ProxyMetrics


class Door:
    """`proxy serve`'s app for `run` on `redis_url`, with the tokens of `tokens_toml`;
    `queue` is the run's queue itself (the learner's side). Use it as a context manager:
    the app's start-up and shut-down run as uvicorn runs them."""

    def __init__(self, redis_url: str, run: str, store_dir: Path, tokens_toml: str) -> None:
        self.queue = RedisQueue.from_url(redis_url, QueueConfig(run=run))
        ctx = Context(
            queue=self.queue,
            store=FileStore(str(store_dir)),
            tokens=Tokens.from_toml(tokens_toml, "test"),
            limits=ProxyLimits(),
            metrics=ProxyMetrics(),
        )
        self.client = TestClient(build_app(ctx), base_url="https://door.test")

    def __enter__(self) -> Door:
        self.client.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.client.__exit__(*exc)
        self.queue.close()

    def request(self, secret: str, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """One request as `secret`'s holder sends it (a MessagePack body unless told)."""
        headers = {"Authorization": f"Bearer {secret}", "Content-Type": CONTENT_TYPE, **kwargs.pop("headers", {})}
        return self.client.request(method, path, headers=headers, **kwargs)

    def claim(self, secret: str, worker: str, count: int = 1) -> list[Lease]:
        r = self.request(secret, "POST", "/v1/leases/claim", content=encode_body(ClaimRequest(worker, count)))
        assert r.status_code == 200, r.text
        return decode_body(r.content, ClaimResponse).leases

    def submit(self, secret: str, worker: str, lease_id: str, groups: list[RolloutGroup]) -> httpx.Response:
        body = encode_body(SubmitRequest(worker=worker, lease_id=lease_id, groups=groups))
        return self.request(secret, "POST", "/v1/leases/submit", content=body)
