"""The proxy's endpoints as plain functions: (context, token, decoded body, parameters) ->
the endpoint's response type, run in a worker thread (a coroutine function, `submit`, on
the event loop itself); `HANDLERS` binds each to its
endpoint of `protocol.client.api`. The HTTP machinery around them (auth, limits, bodies,
errors, streams) is `proxy.app`'s."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import msgspec
from starlette.responses import Response

from protocol import RunShare, is_entry_id
from protocol.client import api
from protocol.client.api import Endpoint
from protocol.client.http import (
    CONTENT_TYPE,
    AckRequest,
    AckResponse,
    AdapterDownload,
    AdapterEventsResponse,
    AddPromptsRequest,
    AddPromptsResponse,
    AnnounceRequest,
    AnnounceResponse,
    AuditsResponse,
    CheckedSubmit,
    ClaimRequest,
    ClaimResponse,
    DeadLettersResponse,
    ErrorResponse,
    ExpireRunRequest,
    ExpireRunResponse,
    ForgetLiftedRequest,
    HeartbeatRequest,
    HeartbeatResponse,
    LatestAdapterResponse,
    LeaveRequest,
    LeaveResponse,
    LiftRequest,
    LiftResponse,
    QuarantineRequest,
    QuarantineResponse,
    ReadRolloutsRequest,
    RecordAuditsRequest,
    ReleaseRequest,
    ReleaseResponse,
    ReportStatusRequest,
    ReportStatusResponse,
    RolloutsResponse,
    RunOverRequest,
    RunOverResponse,
    RunRewardsRequest,
    RunRewardsResponse,
    RunShareRequest,
    RunShareResponse,
    StatsResponse,
    SubmitResponse,
    WhoAmIResponse,
    WorkersResponse,
    encode_body,
)
from protocol.trusted import RedisQueue
from protocol.trusted.store import FileStore, Store, open_store
from protocol.wire.codec import DEFAULT_LIMITS, Limits
from protocol.wire.files import StoreMissing, adapter_key
from proxy.auth import Token, TokenError, Tokens
from proxy.downloads import DownloadCache
from proxy.events import AdapterEventHub
from proxy.fairness import BodyBytes, Holds, SharedRateLimit
from proxy.metrics import ProxyMetrics, behind_first
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


# --------------------------------------------------------------------- handlers
# Plain functions run in a worker thread, coroutine functions on the event loop:
# (ctx, token, body, request params) -> response body.


def worker_name(token: Token, worker: str) -> str:
    """The queue's name for a worker: the token's name first, so that a token can only
    ever name (and so touch) leases claimed with it."""
    name = f"{token.name}/{worker}"
    if len(name) > 256 or any(c.isspace() for c in worker):
        raise ApiError(400, "worker: token name + '/' + worker must be 1-256 characters without spaces")
    return name


async def claim(ctx: Context, token: Token, body: ClaimRequest, params: dict[str, str]) -> ClaimResponse:
    """The claim in a worker thread; its wait, where it has one, on the event loop
    (`ctx.waits`): a thread held by each waiting worker starved every other call of a
    fleet at 300 workers (`bench/fleet.py`)."""
    ctx.check_count("count", body.count)
    worker, block = worker_name(token, body.worker), ctx.block(body.block_s)
    if ctx.waits is None:  # fakeredis or a cluster: the whole blocking claim in a thread
        leases = await in_thread(ctx.queue.claim, worker, body.count, block)
        return ClaimResponse(leases=leases, share=await ctx.share())
    leases = await in_thread(ctx.queue.claim, worker, body.count, 0.0)
    if not leases and block:
        leases = await ctx.queue.wait_for_prompts_async(ctx.waits, worker, body.count, block)
    return ClaimResponse(leases=leases, share=await ctx.share())


def heartbeat(ctx: Context, token: Token, body: HeartbeatRequest, params: dict[str, str]) -> HeartbeatResponse:
    ctx.check_count("lease_ids", len(body.lease_ids))
    return HeartbeatResponse(lease_ids=ctx.queue.heartbeat(worker_name(token, body.worker), body.lease_ids))


async def submit(ctx: Context, token: Token, body: CheckedSubmit, params: dict[str, str]) -> SubmitResponse:
    """On the event loop: the door's busiest call, whose hand-off to a worker thread and back
    cost the proxy more CPU than the rest of the request (measured, bench/proxy.py). Its
    transaction goes on `ctx.aredis`; without one (fakeredis, a cluster) in a worker thread."""
    ctx.check_count("groups", len(body.groups))
    worker = worker_name(token, body.worker)
    if await ctx.backlog() > ctx.limits.backlog_limit:
        ctx.metrics.backpressure.inc()
        raise ApiError(503, "the learner is behind: keep the groups and retry later", {"Retry-After": "5"})
    groups = body.groups.named(worker)  # just decoded, named after the token: not validated again
    # a big submission is encoded for Redis in a worker thread: 14.5 MB on the loop held every other request
    # 50-90 ms, for a lease the queue may refuse anyway
    big = sum(len(c.token_ids) + len(c.logprobs) for g in groups for c in g.completions) > OFF_LOOP_BYTES
    if ctx.aredis is None or big:
        result = await in_thread(partial(ctx.queue.submit, worker, body.lease_id, groups))
    else:
        result = await ctx.queue.submit_async(ctx.aredis, worker, body.lease_id, groups)
    return SubmitResponse(result=result)


def release(ctx: Context, token: Token, body: ReleaseRequest, params: dict[str, str]) -> ReleaseResponse:
    return ReleaseResponse(released=ctx.queue.release(worker_name(token, body.worker), body.lease_id))


def report_status(
    ctx: Context, token: Token, body: ReportStatusRequest, params: dict[str, str]
) -> ReportStatusResponse:
    name = worker_name(token, body.status.worker)
    status = msgspec.structs.replace(body.status, worker=name, reported_at=time.time())  # the proxy's clock
    ctx.queue.report_status(status, owner=token.name, max_per_owner=ctx.limits.caps(token.workers).workers)
    return ReportStatusResponse(worker=name)


def leave(ctx: Context, token: Token, body: LeaveRequest, params: dict[str, str]) -> LeaveResponse:
    return LeaveResponse(left=ctx.queue.leave(worker_name(token, body.worker), owner=token.name))


def list_workers(ctx: Context, token: Token, body: None, params: dict[str, str]) -> WorkersResponse:
    max_age_s = _int_param(params, "max_age_s", 120, 1, 86_400)
    limit = _int_param(params, "limit", 500, 1, 1000)
    workers = ctx.queue.workers(max_age_s)
    listed = behind_first(workers)[:limit]
    quarantined = dict(itertools.islice(((w, why) for w, why in ctx.queue.quarantined().items() if why), 1000))
    shown = {w.worker for w in listed} | quarantined.keys()
    audits = {w: tally for w, tally in ctx.queue.audits().items() if w in shown}
    return WorkersResponse(workers=listed, total=len(workers), quarantined=quarantined, audits=audits)


def whoami(ctx: Context, token: Token, body: None, params: dict[str, str]) -> WhoAmIResponse:
    config = ctx.queue.config
    allowed = token.allowed(ctx.default_run, ctx.registry.runs(ctx.queue) if token.patterns else ())
    return WhoAmIResponse(
        name=token.name,
        role=token.role,
        run=config.run if config.run in allowed else "",
        lease_timeout_s=config.lease_timeout_s,
        runs=sorted(allowed),
        patterns=[f"{p}*" for p in token.patterns],
    )


def quarantine(ctx: Context, token: Token, body: QuarantineRequest, params: dict[str, str]) -> QuarantineResponse:
    ctx.queue.quarantine(body.worker, body.reason)
    log.warning("worker %s quarantined by the learner: %s", body.worker, body.reason)
    return QuarantineResponse(workers={body.worker: body.reason})


def quarantined(ctx: Context, token: Token, body: None, params: dict[str, str]) -> QuarantineResponse:
    return QuarantineResponse(workers=ctx.queue.quarantined())


def record_audits(ctx: Context, token: Token, body: RecordAuditsRequest, params: dict[str, str]) -> AuditsResponse:
    ctx.queue.record_audits(body.workers)
    return AuditsResponse(workers=body.workers)


def audits(ctx: Context, token: Token, body: None, params: dict[str, str]) -> AuditsResponse:
    return AuditsResponse(workers=ctx.queue.audits())


def lift_quarantine(ctx: Context, token: Token, body: LiftRequest, params: dict[str, str]) -> LiftResponse:
    lifted = ctx.queue.lift_quarantine(body.worker)
    if lifted:
        log.warning("quarantine of worker %s lifted by %s", body.worker, token.name)
    return LiftResponse(lifted=lifted)


def forget_lifted(ctx: Context, token: Token, body: ForgetLiftedRequest, params: dict[str, str]) -> QuarantineResponse:
    ctx.queue.forget_lifted(body.workers)
    return QuarantineResponse(workers={})


def expire_run(ctx: Context, token: Token, body: ExpireRunRequest, params: dict[str, str]) -> ExpireRunResponse:
    return ExpireRunResponse(keys=ctx.queue.expire_run(body.ttl_s))


def run_over(ctx: Context, token: Token, body: RunOverRequest, params: dict[str, str]) -> RunOverResponse:
    ctx.queue.set_run_over(body.why)
    if body.why:
        log.info("run %s is over: %s", ctx.queue.config.run, body.why)
    return RunOverResponse(over=bool(body.why))


def run_share(ctx: Context, token: Token, body: RunShareRequest, params: dict[str, str]) -> RunShareResponse:
    ctx.queue.set_run_share(body.share)
    ctx.forget_share()
    cap = "no cap" if body.share.cap is None else f"cap {body.share.cap:g}"
    log.info("run %s: weight %g, %s (%s)", ctx.queue.config.run, body.share.weight, cap, token.name)
    return RunShareResponse(share=body.share)


def run_rewards(ctx: Context, token: Token, body: RunRewardsRequest, params: dict[str, str]) -> RunRewardsResponse:
    ctx.queue.set_run_rewards(body.specs)
    return RunRewardsResponse(specs=body.specs)


def add_prompts(ctx: Context, token: Token, body: AddPromptsRequest, params: dict[str, str]) -> AddPromptsResponse:
    ctx.check_count("batches", len(body.batches))
    return AddPromptsResponse(added=ctx.queue.add_prompts(body.batches))


def read_rollouts(ctx: Context, token: Token, body: ReadRolloutsRequest, params: dict[str, str]) -> RolloutsResponse:
    ctx.check_count("count", body.count)
    if body.pending:
        if body.after != "0" and not is_entry_id(body.after):
            raise ApiError(400, "after: not a stream entry id")
        return RolloutsResponse(deliveries=ctx.queue.pending_rollouts(body.consumer, body.count, body.after))
    return RolloutsResponse(deliveries=ctx.queue.read_rollouts(body.consumer, body.count, ctx.block(body.block_s)))


def ack(ctx: Context, token: Token, body: AckRequest, params: dict[str, str]) -> AckResponse:
    ctx.check_count("delivery_ids", len(body.delivery_ids))
    ctx.check_count("finished", len(body.finished))
    return AckResponse(acked=ctx.queue.ack_rollouts(body.delivery_ids, body.finished))


def announce(ctx: Context, token: Token, body: AnnounceRequest, params: dict[str, str]) -> AnnounceResponse:
    return AnnounceResponse(event_id=ctx.queue.announce(body.manifest))


def latest_adapter(ctx: Context, token: Token, body: None, params: dict[str, str]) -> LatestAdapterResponse:
    return LatestAdapterResponse(manifest=ctx.queue.latest_adapter())


def adapter_history(ctx: Context, token: Token, body: None, params: dict[str, str]) -> AdapterEventsResponse:
    after = params.get("after", "0")
    if after != "0" and not is_entry_id(after):
        raise ApiError(400, "after: not an event id")
    count = _int_param(params, "count", 100, 1, ctx.limits.max_messages)
    wait = _int_param(params, "block_ms", 0, 0, 60_000) / 1000
    return AdapterEventsResponse(events=ctx.queue.adapter_events(after=after, count=count, block_s=ctx.block(wait)))


def dead_letters(ctx: Context, token: Token, body: None, params: dict[str, str]) -> DeadLettersResponse:
    after = params.get("after", "0")
    if after != "0" and not is_entry_id(after):
        raise ApiError(400, "after: not a stream entry id")
    count = _int_param(params, "count", 100, 1, ctx.limits.max_messages)
    return DeadLettersResponse(entries=ctx.queue.dead_letters(after=after, count=count))


def stats(ctx: Context, token: Token, body: None, params: dict[str, str]) -> StatsResponse:
    return StatsResponse(stats=ctx.queue.stats())


def adapter_download(ctx: Context, token: Token, body: None, params: dict[str, str]) -> AdapterDownload:
    return ctx.downloads.get(parse_version(params["version"]))


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


def parse_version(text: str) -> int:
    if not text.isdigit() or len(text) > 9 or int(text) < 1:
        raise ApiError(400, f"version: {text[:32]!r} is not an adapter version (1, 2, ...)")
    return int(text)


def _int_param(params: dict[str, str], name: str, default: int, low: int, high: int) -> int:
    text = params.get(name)
    if text is None:
        return default
    if not text.isdigit() or not low <= int(text) <= high:
        raise ApiError(400, f"{name}: must be an integer in [{low}, {high}]")
    return int(text)


# ----------------------------------------------------------------------- routes


HANDLERS: dict[Endpoint[Any, Any], Callable[..., Any]] = {
    api.CLAIM: claim,
    api.HEARTBEAT: heartbeat,
    api.SUBMIT: submit,
    api.RELEASE: release,
    api.REPORT_STATUS: report_status,
    api.LEAVE: leave,
    api.WORKERS: list_workers,
    api.WHOAMI: whoami,
    api.LATEST_ADAPTER: latest_adapter,
    api.ADAPTER_HISTORY: adapter_history,
    api.ADAPTER_DOWNLOAD: adapter_download,
    api.ADD_PROMPTS: add_prompts,
    api.READ_ROLLOUTS: read_rollouts,
    api.ACK: ack,
    api.EXPIRE_RUN: expire_run,
    api.RUN_OVER: run_over,
    api.RUN_REWARDS: run_rewards,
    api.RUN_SHARE: run_share,
    api.QUARANTINE: quarantine,
    api.QUARANTINED: quarantined,
    api.LIFT_QUARANTINE: lift_quarantine,
    api.FORGET_LIFTED: forget_lifted,
    api.RECORD_AUDITS: record_audits,
    api.AUDITS: audits,
    api.ANNOUNCE: announce,
    api.DEAD_LETTERS: dead_letters,
    api.STATS: stats,
}
"""Handlers: (ctx, token, decoded body, params) -> the endpoint's response type, in a worker thread
(a coroutine function on the event loop)."""
