"""The proxy's state: its limits, the tokens' caps, and a `Context` per run served (its
queue, store, event hub, download cache), shared by every request of that run
(`proxy.handlers` answers them, `proxy.app` carries them over HTTP)."""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import msgspec
from starlette.responses import Response

from protocol import RunShare
from protocol.client.http import (
    CONTENT_TYPE,
    AdapterDownload,
    ErrorResponse,
    encode_body,
)
from protocol.trusted import RedisQueue
from protocol.trusted.store import FileStore, Store, open_store
from protocol.wire.codec import DEFAULT_LIMITS, Limits
from protocol.wire.files import StoreMissing, adapter_key
from proxy.auth import TokenError, Tokens
from proxy.downloads import DownloadCache
from proxy.events import AdapterEventHub
from proxy.fairness import BodyBytes, Holds, SharedRateLimit
from proxy.metrics import ProxyMetrics
from proxy.threads import in_thread

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProxyLimits:
    max_body_bytes: int = 16 * 1024 * 1024
    """413 above this."""
    max_messages: int = 512
    """Most groups, batches or ids in one request."""
    max_long_poll_s: float = 10.0
    """Long-polls (claim, read, events) wait at most this long per request."""
    rate_per_s: float = 500.0
    """Sustained requests per second per token, across every proxy of the run."""
    burst: float = 1000.0
    max_long_polls_per_token: int = 64
    """Claims, reads and history reads with a wait that one token may hold open at once."""
    max_streams_per_token: int = 256
    """Adapter-event streams one token may hold open at once (they share one Redis reader)."""
    backlog_limit: int = 100_000
    """503 for submissions while more rollout groups than this wait for the learner."""
    body_timeout_s: float = 30.0
    """408 when a client takes longer than this to send its body."""
    presign_s: int = 300
    """Lifetime of presigned adapter URLs."""
    max_workers_per_token: int = 256
    """Live worker statuses one token may have in the fleet view; a new worker's report past
    it is refused (409), so one token cannot grow the view, the learner's log or /metrics."""
    max_body_bytes_per_token: int = 64 * 1024 * 1024
    """Request-body bytes one token may have in flight at once (429 past it)."""
    max_body_bytes_in_flight: int = 512 * 1024 * 1024
    """Request-body bytes in flight over every token (503 past it)."""
    rate_per_worker_s: float = 5.0
    """A fleet token's (`workers = N` in the tokens file) rate: N times this."""
    body_bytes_per_worker: int = 1024 * 1024
    """A fleet token's body bytes in flight: N times this (at least one full body)."""

    def caps(self, workers: int | None) -> TokenCaps:
        """What one token may hold: the flags' caps, or a fleet token's sized for its `workers`."""
        if workers is None:
            return TokenCaps(
                self.max_long_polls_per_token,
                self.max_streams_per_token,
                self.max_workers_per_token,
                self.rate_per_s,
                self.max_body_bytes_per_token,
            )
        return TokenCaps(
            workers,
            workers,
            2 * workers,  # a departed worker's status stays live 2 minutes: room for a fleet replaced within them
            workers * self.rate_per_worker_s,
            min(self.max_body_bytes_in_flight, max(self.max_body_bytes, workers * self.body_bytes_per_worker)),
        )


@dataclass(frozen=True)
class TokenCaps:
    """One token's share of the door (`ProxyLimits.caps`)."""

    long_polls: int
    streams: int
    workers: int
    """Live worker statuses in the fleet view."""
    rate_per_s: float
    body_bytes: int


REGISTRY_READ_S = 2.0
"""The runs started on the Redis, which tokens' run patterns match, are read at most this
often: a run a learner starts is served to its fleet within seconds."""


class RunRegistry:
    """The runs started on the proxy's Redis (`RUNS_KEY`), read at most every
    `REGISTRY_READ_S`; one for the proxy, whichever run's context asks."""

    def __init__(self) -> None:
        self._read: tuple[float, frozenset[str]] = (-REGISTRY_READ_S - 1, frozenset())

    def runs(self, queue: RedisQueue) -> frozenset[str]:
        at, runs = self._read
        if time.monotonic() - at > REGISTRY_READ_S:
            runs = frozenset(queue.registered_runs())
            self._read = (time.monotonic(), runs)
        return runs

    async def runs_async(self, queue: RedisQueue) -> frozenset[str]:
        at, runs = self._read
        return runs if time.monotonic() - at <= REGISTRY_READ_S else await in_thread(self.runs, queue)


SHARE_READ_S = 5.0
"""A run's share (weight and cap), carried by every claim's answer, is read from Redis at
most this often: a change reaches the fleet within seconds, at one read per run."""

OFF_LOOP_BYTES = 1 << 20
"""A request body (or a submission's arrays) past this is decoded (or encoded) in a worker
thread, not on the event loop, where it would hold up every other request."""


class ApiError(Exception):
    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}


def error_response(status: int, message: str, headers: dict[str, str] | None = None, code: str = "") -> Response:
    body = encode_body(ErrorResponse(status=status, error=message, code=code))
    return Response(body, status_code=status, media_type=CONTENT_TYPE, headers=headers)


@dataclass
class Context:
    queue: RedisQueue
    """The run's Redis itself (the proxy is trusted; it may pass owners and caps)."""
    store: Store
    tokens: Tokens
    limits: ProxyLimits
    metrics: ProxyMetrics
    rate_storage: str = "async+memory://"
    """Where request rates are counted: the run's Redis (`async+redis://…`) so every proxy
    shares one budget per token, or this process's memory."""
    wire_limits: Limits = DEFAULT_LIMITS
    rate: SharedRateLimit = field(init=False)
    holds: Holds = field(init=False)
    bodies: BodyBytes = field(init=False)
    hub: AdapterEventHub = field(init=False)
    downloads: DownloadCache = field(init=False)
    body_limits: Limits = field(init=False)
    """The wire limits with this proxy's body size: what every request body is decoded with."""
    aredis: Any = None
    """A `redis.asyncio` client of the queue's server where it is a plain Redis (closed with
    the app): submissions go from the event loop (`RedisQueue.submit_async`)."""
    waits: Any = None
    """Another, with a connection for every claim that may wait at once (`claim`)."""
    store_url: str | None = None
    """The store's URL with `{run}` in it: each run its own prefix there. None: this proxy
    serves its queue's run alone (`for_run`)."""
    presign_endpoint: str | None = None
    """The public endpoint the store's presigned URLs name (`--presign-endpoint`)."""
    tokens_file: Path | None = None
    """Where the tokens came from (`--tokens`), read again on SIGHUP; None: SPOTGRPO_TOKENS."""
    runs: dict[str, Context] = field(init=False)
    """Every run served so far, this one included, by name: one dict shared by them all."""
    registry: RunRegistry = field(init=False)
    """The runs started on the Redis, for tokens with run patterns: one, shared by every run's context."""
    _backlog: tuple[float, int] = (0.0, 0)
    _share: tuple[float, RunShare] = (-SHARE_READ_S - 1, RunShare())

    def __post_init__(self) -> None:
        self.rate = SharedRateLimit(
            self.rate_storage,
            self.limits.rate_per_s,
            self.limits.burst,
            prefix=f"spotgrpo:{{{self.queue.config.run}}}:rate",
        )
        self.holds = Holds(
            {"long-poll": self.limits.max_long_polls_per_token, "event stream": self.limits.max_streams_per_token}
        )
        self.hub = AdapterEventHub(self.queue)
        self.downloads = DownloadCache(partial(make_download, self), self.limits.presign_s)
        self.bodies = BodyBytes(self.limits.max_body_bytes_per_token, self.limits.max_body_bytes_in_flight)
        self.runs = {self.queue.config.run: self}
        self.registry = RunRegistry()
        self.use_tokens(self.tokens)
        self.body_limits = msgspec.structs.replace(self.wire_limits, max_message_bytes=self.limits.max_body_bytes)

    def use_tokens(self, tokens: Tokens) -> None:
        """Serve `tokens` from now on, in every run (at start, and when SIGHUP has the tokens
        file read again): a fleet token's caps sized for its workers, the runs they name
        served, a run no token names any more refused. Raises TokenError, changing nothing,
        where tokens name runs besides `--run` and the store has no prefix per run."""
        several = tokens.runs() - {self.default_run}
        if several and self.store_url is None:
            raise TokenError(
                f"tokens name runs {', '.join(sorted(several))} besides --run {self.default_run}: give --store "
                "with {run} in it (s3://bucket/prefix/{run}), so each run's adapters have their own prefix"
            )
        sized = {t.name: self.limits.caps(t.workers) for t in tokens.tokens if t.workers is not None}
        self.rate.size({name: caps.rate_per_s for name, caps in sized.items()})
        self.holds.sized = {name: {"long-poll": c.long_polls, "event stream": c.streams} for name, c in sized.items()}
        self.bodies.sized = {name: caps.body_bytes for name, caps in sized.items()}
        for ctx in self.runs.values():
            ctx.tokens = tokens

    @property
    def run(self) -> str:
        return self.queue.config.run

    @property
    def default_run(self) -> str:
        """The proxy's `--run`: a token that names no runs touches it alone."""
        return next(iter(self.runs))

    def close_soon(self) -> None:
        """End every run's event streams (the server is stopping)."""
        for ctx in list(self.runs.values()):
            ctx.hub.close_soon()

    def for_run(self, run: str) -> Context:
        """The context of `run`, made on its first request (on the event loop, which its event
        hub starts on): its own queue (`{run}`'s keys on the same Redis and connections), store
        prefix, event hub and download cache; the tokens, their rates, caps and bodies in
        flight, and the metrics are the proxy's, whichever runs a token's requests are for."""
        if (ctx := self.runs.get(run)) is not None:
            return ctx
        if self.store_url is None:
            raise ApiError(404, f"this proxy serves run {self.run!r} alone (its --store has no {{run}})")
        ctx = copy.copy(self)
        ctx.queue = RedisQueue(self.queue.client, dataclasses.replace(self.queue.config, run=run))
        ctx.store = open_store(self.store_url.replace("{run}", run), presign_endpoint=self.presign_endpoint)
        ctx.hub = AdapterEventHub(ctx.queue)
        ctx.downloads = DownloadCache(partial(make_download, ctx), self.limits.presign_s)
        ctx._backlog = (0.0, 0)
        ctx._share = (-SHARE_READ_S - 1, RunShare())
        ctx.hub.start()
        self.runs[run] = ctx
        log.info("serving run %s too (%d runs)", run, len(self.runs))
        return ctx

    def reload_tokens(self) -> None:
        """SIGHUP: the tokens file read again, so runs and tokens come and go without a restart.
        A file that does not parse, or names runs the store cannot keep apart, changes
        nothing (logged)."""
        if self.tokens_file is None:
            log.warning("SIGHUP: the tokens came from SPOTGRPO_TOKENS, which cannot change; nothing reloaded")
            return
        try:
            self.use_tokens(Tokens.from_file(self.tokens_file))
        except TokenError as err:
            log.error("SIGHUP: %s; still serving the tokens read before", err)
            return
        log.info(
            "SIGHUP: %d tokens from %s; runs %s",
            len(self.tokens.tokens),
            self.tokens_file,
            ", ".join(sorted(self.tokens.runs() | {self.default_run})),
        )

    def block(self, requested: float) -> float:
        return min(requested, self.limits.max_long_poll_s, self.queue.config.max_block_s)

    async def share(self) -> RunShare:
        """The run's weight and cap, re-read (in a worker thread) at most every few seconds:
        every claim carries them."""
        at, value = self._share
        if time.monotonic() - at > SHARE_READ_S:
            value = await in_thread(self.queue.run_share)
            self._share = (time.monotonic(), value)
        return value

    def forget_share(self) -> None:
        self._share = (-SHARE_READ_S - 1, self._share[1])

    async def backlog(self) -> int:
        """Waiting rollout groups, re-read (in a worker thread) at most once a second."""
        at, value = self._backlog
        if time.monotonic() - at > 1.0:
            value = (await in_thread(self.queue.stats)).rollouts.waiting
            self._backlog = (time.monotonic(), value)
        return value

    def check_count(self, what: str, n: int) -> None:
        if n > self.limits.max_messages:
            raise ApiError(413, f"{what}: {n} entries exceed this proxy's limit of {self.limits.max_messages}")


def make_download(ctx: Context, version: int) -> AdapterDownload:
    """A version's manifest and its files' URLs (`proxy.downloads.DownloadCache` keeps it)."""
    ctx.metrics.manifest_reads.inc()
    try:
        manifest = ctx.store.read_manifest(version)
    except StoreMissing:
        raise ApiError(404, f"adapter v{version} does not exist") from None
    urls: dict[str, str] = {}
    proxied = isinstance(ctx.store, FileStore)
    for f in manifest.files:
        url = None if proxied else ctx.store.presign(adapter_key(version, f.name), ctx.limits.presign_s)
        urls[f.name] = url or f"/v1/adapters/{version}/files/{f.name}"
        proxied = proxied or url is None
    return AdapterDownload(manifest=manifest, urls=urls, proxied=proxied)
