"""Prometheus metrics of one worker, on their own registry (served with `--metrics-port`)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server


class WorkerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.tokens = Counter(
            "spotgrpo_actor_tokens", "Completion tokens generated (rate() gives tokens/s)", registry=r
        )
        self.groups = Counter("spotgrpo_actor_groups_submitted", "Rollout groups stored by this worker", registry=r)
        self.reward_errors = Counter(
            "spotgrpo_actor_reward_errors", "Groups whose reward failed or timed out", registry=r
        )
        self.submissions_refused = Counter(
            "spotgrpo_actor_submissions_refused",
            "Submissions the queue refused (lease lost or not answered)",
            registry=r,
        )
        self.connection_errors = Counter(
            "spotgrpo_actor_connection_errors", "Queue calls that failed and were retried", registry=r
        )
        self.lease_wait = Histogram(
            "spotgrpo_actor_lease_wait_seconds",
            "Time spent waiting for a prompt batch",
            buckets=(0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30),
            registry=r,
        )
        self.adapter_version = Gauge("spotgrpo_actor_adapter_version", "Newest loaded adapter version", registry=r)
        self.adapter_load = Histogram(
            "spotgrpo_actor_adapter_load_seconds",
            "Download, verify and load time of an adapter",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30),
            registry=r,
        )
        self.adapters_refused = Counter(
            "spotgrpo_actor_adapters_refused", "Adapters refused (checksum, missing, load error)", registry=r
        )

    def serve(self, port: int, host: str = "0.0.0.0") -> tuple[Any, Any]:
        """Serve /metrics from a daemon thread; returns (server, thread)."""
        served: tuple[Any, Any] = start_http_server(port, addr=host, registry=self.registry)
        return served
