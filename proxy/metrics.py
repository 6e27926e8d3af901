"""Prometheus metrics of the proxy: requests by route and status, latency, and the
queue's state read at scrape time. The request metrics come from a pure ASGI
middleware (no BaseHTTPMiddleware: it would buffer streaming responses)."""

from __future__ import annotations

import threading
import time
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from protocol import AuditTally, Queue, QueueUnavailable, WorkerStatus


class ProxyMetrics:
    def __init__(self) -> None:
        self._rendering = threading.Lock()
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "spotgrpo_proxy_requests", "Requests by route, method and status", ["route", "method", "status"], registry=r
        )
        self.latency = Histogram(
            "spotgrpo_proxy_request_seconds",
            "Request latency by route",
            ["route", "method"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )
        self.rate_limited = Counter(
            "spotgrpo_proxy_rate_limited", "Requests refused with 429, by token name", ["token"], registry=r
        )
        self.backpressure = Counter(
            "spotgrpo_proxy_backpressure", "Submissions refused with 503 (rollout backlog)", registry=r
        )
        self.manifest_reads = Counter(
            "spotgrpo_proxy_adapter_manifest_reads",
            "Adapter manifests read from the store and presigned (once per version, not per worker)",
            registry=r,
        )
        self.depth = Gauge("spotgrpo_queue_entries", "Entries per stream and state", ["stream", "state"], registry=r)
        self.leases = Gauge("spotgrpo_queue_leases", "Outstanding prompt leases", registry=r)
        self.dead_letters = Gauge("spotgrpo_queue_dead_letters", "Entries in the dead-letter stream", registry=r)
        self.latest_version = Gauge("spotgrpo_adapter_latest_version", "Latest announced adapter version", registry=r)
        self.queue_up = Gauge("spotgrpo_queue_up", "1 when Redis answered the last scrape", registry=r)
        self.workers_live = Gauge("spotgrpo_workers_live", "Workers that reported in the last 2 minutes", registry=r)
        self.worker_version = Gauge(
            "spotgrpo_worker_adapter_version", "Adapter version a worker has loaded", ["worker"], registry=r
        )
        self.worker_tokens = Gauge(
            "spotgrpo_worker_tokens_per_second", "Tokens a worker generates per second", ["worker"], registry=r
        )
        self.worker_refused = Gauge(
            "spotgrpo_worker_adapters_refused", "Adapter versions a worker could not load", ["worker"], registry=r
        )
        self.worker_share = Gauge(
            "spotgrpo_worker_run_share",
            "The fraction of a worker's sequences this run got lately, where it serves several runs",
            ["worker"],
            registry=r,
        )
        self.worker_audits = Gauge(
            "spotgrpo_worker_audits",
            "The learner's audits of a live worker's groups, by outcome (passed, failed)",
            ["worker", "outcome"],
            registry=r,
        )
        self.token_audits = Gauge(
            "spotgrpo_token_audits",
            "The learner's audits of the groups of a token's workers, live or gone, by outcome (passed, failed)",
            ["token", "outcome"],
            registry=r,
        )
        self.quarantined = Gauge(
            "spotgrpo_workers_quarantined",
            "Workers the learner quarantined (a failed audit or adapter digest); GET /v1/quarantine names them",
            registry=r,
        )

    def render(self, queue: Queue) -> tuple[bytes, str]:
        """The registry, its gauges set from `queue` (the run the scrape names): one scrape at
        a time, so two runs' scrapes never mix their gauges."""
        with self._rendering:
            return self._render(queue)

    def _render(self, queue: Queue) -> tuple[bytes, str]:
        try:
            stats = queue.stats()
        except QueueUnavailable:
            self.queue_up.set(0)
        else:
            self.queue_up.set(1)
            for name, s in (("prompts", stats.prompts), ("rollouts", stats.rollouts)):
                self.depth.labels(name, "pending").set(s.pending)
                self.depth.labels(name, "waiting").set(s.waiting)
            self.leases.set(sum(stats.leases_by_worker.values()))
            self.dead_letters.set(stats.dead_letters)
            self.latest_version.set(stats.latest_adapter_version)
            self.quarantined.set(sum(1 for why in queue.quarantined().values() if why))
            self._workers(queue)
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    max_worker_series = 100
    """Per-worker series at most (the furthest behind first): a fleet, or one token's
    flood, cannot grow a scrape without bound; `spotgrpo_workers_live` counts them all."""

    def _workers(self, queue: Queue) -> None:
        """The live workers only, read at scrape time: a worker gone is no series left."""
        workers, audits = queue.workers(), queue.audits()
        self.workers_live.set(len(workers))
        for gauge in (
            self.worker_version,
            self.worker_tokens,
            self.worker_refused,
            self.worker_share,
            self.worker_audits,
        ):
            gauge.clear()
        for w in behind_first(workers)[: self.max_worker_series]:
            self.worker_version.labels(w.worker).set(w.adapter_version)
            self.worker_tokens.labels(w.worker).set(w.tokens_per_s)
            self.worker_refused.labels(w.worker).set(w.adapters_refused)
            if w.share is not None:
                self.worker_share.labels(w.worker).set(w.share)
            if w.worker in audits:
                self.worker_audits.labels(w.worker, "passed").set(audits[w.worker].passed)
                self.worker_audits.labels(w.worker, "failed").set(audits[w.worker].failed)
        by_token: dict[str, AuditTally] = {}
        for worker, tally in audits.items():  # a token is a line of the tokens file: a bounded set
            token = worker.split("/", 1)[0] if "/" in worker else ""
            by_token[token] = by_token.get(token, AuditTally()) + tally
        self.token_audits.clear()
        for token, tally in by_token.items():
            self.token_audits.labels(token, "passed").set(tally.passed)
            self.token_audits.labels(token, "failed").set(tally.failed)


def behind_first(workers: list[WorkerStatus]) -> list[WorkerStatus]:
    """The workers a reader most needs to see first: furthest behind, then refusing."""
    return sorted(workers, key=lambda w: (w.adapter_version, -w.adapters_refused, w.worker))


class MetricsMiddleware:
    """Counts and times every HTTP request by its route template (not its raw path, so
    the label set stays bounded whatever clients send)."""

    def __init__(self, app: ASGIApp, metrics: ProxyMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = _route_of(scope)
        started = time.perf_counter()
        status = {"code": 500}

        async def send_status(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                # time to the response head: long streams (events) would swamp the histogram
                self.metrics.latency.labels(route, scope["method"]).observe(time.perf_counter() - started)
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            self.metrics.requests.labels(route, scope["method"], str(status["code"])).inc()


def _route_of(scope: Scope) -> str:
    app: Any = scope.get("app")
    for route in getattr(app, "routes", []):
        match, _ = route.matches(scope)
        if match == Match.FULL:
            return str(route.path)
    return "unmatched"
