"""The proxy's HTTP API: a Starlette app in front of the queue and the adapter store.

Stateless: every request is served from Redis and the store, so any number of proxies
can run behind a load balancer and a restarted one loses nothing. Leases are taken over
and poison batches dead-lettered inside the queue's claim, so no janitor is needed.

Each endpoint is declared once in `protocol.api` with the roles that may call it and its
request and response bodies, shared with the HTTPS client; `HANDLERS` binds a handler to
each, and the app, the auth checks and `/openapi.json` are generated from that table, so
a route cannot exist without its roles (nor an endpoint without its handler).

One actor token cannot hurt a run (see the README's "What one actor token can do"):
- the worker name a token uses is prefixed with the token's name (`fleet-a/host-1`), so
  a token can claim, heartbeat, release and submit only its own leases, and the groups
  it submits carry that name as their actor id;
- the queue checks every submission against the lease it names (holder, batch, one
  group per prompt, completion count and length, the issued prompt tokens);
- requests per token are rate-limited across every proxy of the run, and the long-polls
  and event streams one token may hold open are capped (`proxy.fairness`); event
  streams share one Redis reader (`proxy.events`), so they cost no Redis connections;
- the Redis pool has a connection for every worker thread, so held requests cannot
  starve the others of Redis.

Errors: 400 malformed body or parameter (the protocol error's text), 401 no or unknown
token, 403 wrong role, 404, 408 body too slow, 409 lease or version conflict (`code`
says which), 413 body too large, 415 wrong content type, 422 a submission that does not
answer its lease, 429 over the token's rate or holds (Retry-After), 503 Redis or the store
down, or the rollout backlog over its limit (Retry-After), 500 a bug (logged). Every error
body is an `ErrorResponse`; none is a traceback.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import re
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import anyio
import msgspec
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from protocol import (
    ProtocolError,
    QueueError,
    QueueRefused,
    QueueUnavailable,
    RedisQueue,
    WorkerStatus,
    api,
    encode,
    is_entry_id,
)
from protocol.api import Endpoint
from protocol.errors import status_of
from protocol.http import (
    ACCEPTED_CONTENT_TYPES,
    CONTENT_TYPE,
    AckRequest,
    AckResponse,
    AdapterDownload,
    AdapterEventsResponse,
    AddPromptsRequest,
    AddPromptsResponse,
    AnnounceRequest,
    AnnounceResponse,
    ClaimRequest,
    ClaimResponse,
    DeadLettersResponse,
    ErrorResponse,
    ExpireRunRequest,
    ExpireRunResponse,
    HeartbeatRequest,
    HeartbeatResponse,
    LatestAdapterResponse,
    ReadRolloutsRequest,
    ReleaseRequest,
    ReleaseResponse,
    ReportStatusRequest,
    ReportStatusResponse,
    RolloutsResponse,
    StatsResponse,
    SubmitRequest,
    SubmitResponse,
    WhoAmIResponse,
    WorkersResponse,
    decode_body,
    encode_body,
    schema_components,
)
from protocol.messages import DEFAULT_LIMITS, Limits
from protocol.store import FileStore, Store, StoreError, StoreMissing, adapter_key
from proxy.auth import Token, Tokens
from proxy.events import AdapterEventHub
from proxy.fairness import Holds, OverCap, SharedRateLimit
from proxy.metrics import MetricsMiddleware, ProxyMetrics

log = logging.getLogger(__name__)

_FILE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
THREADS = 512
"""Worker threads for blocking queue calls (long-polls hold one each; anyio's default
of 40 would starve submissions). The Redis pool gets one connection per thread."""


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
    hub: AdapterEventHub = field(init=False)
    body_limits: Limits = field(init=False)
    """The wire limits with this proxy's body size: what every request body is decoded with."""
    _backlog: tuple[float, int] = (0.0, 0)

    def __post_init__(self) -> None:
        self.rate = SharedRateLimit(self.rate_storage, self.limits.rate_per_s, self.limits.burst,
                                    prefix=f"spotgrpo:{{{self.queue.config.run}}}:rate")
        self.holds = Holds({"long-poll": self.limits.max_long_polls_per_token,
                            "event stream": self.limits.max_streams_per_token})
        self.hub = AdapterEventHub(self.queue)
        self.body_limits = msgspec.structs.replace(self.wire_limits, max_message_bytes=self.limits.max_body_bytes)

    def block(self, requested: float) -> float:
        return min(requested, self.limits.max_long_poll_s, self.queue.config.max_block_s)

    def backlog(self) -> int:
        """Waiting rollout groups, re-read at most once a second."""
        at, value = self._backlog
        if time.monotonic() - at > 1.0:
            value = self.queue.stats().rollouts.waiting
            self._backlog = (time.monotonic(), value)
        return value

    def check_count(self, what: str, n: int) -> None:
        if n > self.limits.max_messages:
            raise ApiError(413, f"{what}: {n} entries exceed this proxy's limit of {self.limits.max_messages}")


# --------------------------------------------------------------------- handlers
# Plain functions run in a worker thread: (ctx, token, body, request params) -> response body.


def worker_name(token: Token, worker: str) -> str:
    """The queue's name for a worker: the token's name first, so that a token can only
    ever name (and so touch) leases claimed with it."""
    name = f"{token.name}/{worker}"
    if len(name) > 256 or any(c.isspace() for c in worker):
        raise ApiError(400, "worker: token name + '/' + worker must be 1-256 characters without spaces")
    return name


def claim(ctx: Context, token: Token, body: ClaimRequest, params: dict[str, str]) -> ClaimResponse:
    ctx.check_count("count", body.count)
    return ClaimResponse(leases=ctx.queue.claim(worker_name(token, body.worker), body.count, ctx.block(body.block_s)))


def heartbeat(ctx: Context, token: Token, body: HeartbeatRequest, params: dict[str, str]) -> HeartbeatResponse:
    ctx.check_count("lease_ids", len(body.lease_ids))
    return HeartbeatResponse(lease_ids=ctx.queue.heartbeat(worker_name(token, body.worker), body.lease_ids))


def submit(ctx: Context, token: Token, body: SubmitRequest, params: dict[str, str]) -> SubmitResponse:
    ctx.check_count("groups", len(body.groups))
    worker = worker_name(token, body.worker)
    if ctx.backlog() > ctx.limits.backlog_limit:
        ctx.metrics.backpressure.inc()
        raise ApiError(503, "the learner is behind: keep the groups and retry later", {"Retry-After": "5"})
    groups = [g if g.actor_id == worker else msgspec.structs.replace(g, actor_id=worker) for g in body.groups]
    return SubmitResponse(result=ctx.queue.submit(worker, body.lease_id, groups))


def release(ctx: Context, token: Token, body: ReleaseRequest, params: dict[str, str]) -> ReleaseResponse:
    return ReleaseResponse(released=ctx.queue.release(worker_name(token, body.worker), body.lease_id))


def report_status(ctx: Context, token: Token, body: ReportStatusRequest, params: dict[str, str]) -> ReportStatusResponse:
    name = worker_name(token, body.status.worker)
    status = msgspec.structs.replace(body.status, worker=name, reported_at=time.time())  # the proxy's clock
    ctx.queue.report_status(status, owner=token.name, max_per_owner=ctx.limits.max_workers_per_token)
    return ReportStatusResponse(worker=name)


def behind_first(workers: list[WorkerStatus]) -> list[WorkerStatus]:
    """The workers a reader most needs to see first: furthest behind, then refusing."""
    return sorted(workers, key=lambda w: (w.adapter_version, -w.adapters_refused, w.worker))


def list_workers(ctx: Context, token: Token, body: None, params: dict[str, str]) -> WorkersResponse:
    max_age_s = _int_param(params, "max_age_s", 120, 1, 86_400)
    limit = _int_param(params, "limit", 500, 1, 1000)
    workers = ctx.queue.workers(max_age_s)
    return WorkersResponse(workers=behind_first(workers)[:limit], total=len(workers))


def whoami(ctx: Context, token: Token, body: None, params: dict[str, str]) -> WhoAmIResponse:
    return WhoAmIResponse(name=token.name, role=token.role, run=ctx.queue.config.run)


def expire_run(ctx: Context, token: Token, body: ExpireRunRequest, params: dict[str, str]) -> ExpireRunResponse:
    return ExpireRunResponse(keys=ctx.queue.expire_run(body.ttl_s))


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
    version = _version(params["version"])
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


def _version(text: str) -> int:
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


HANDLERS: dict[Endpoint, Callable[..., Any]] = {
    api.CLAIM: claim, api.HEARTBEAT: heartbeat, api.SUBMIT: submit, api.RELEASE: release,
    api.REPORT_STATUS: report_status, api.WORKERS: list_workers, api.WHOAMI: whoami,
    api.LATEST_ADAPTER: latest_adapter, api.ADAPTER_HISTORY: adapter_history, api.ADAPTER_DOWNLOAD: adapter_download,
    api.ADD_PROMPTS: add_prompts, api.READ_ROLLOUTS: read_rollouts, api.ACK: ack, api.EXPIRE_RUN: expire_run,
    api.ANNOUNCE: announce, api.DEAD_LETTERS: dead_letters, api.STATS: stats,
}
"""Plain handlers: (ctx, token, decoded body, params) -> the endpoint's response type, in a worker thread."""


def build_app(ctx: Context) -> Starlette:
    special: dict[Endpoint, Callable[..., Any]] = {  # streams, files, text: async, with the request itself
        api.ADAPTER_EVENTS: _events, api.ADAPTER_FILE: _file, api.METRICS: _metrics, api.HEALTHZ: _healthz,
        api.OPENAPI: _openapi,
    }
    missing = [e.path for e in api.ENDPOINTS if e not in HANDLERS and e not in special]
    if missing:
        raise RuntimeError(f"endpoints without a handler: {missing}")
    routes = [Route(e.path, _endpoint(e, HANDLERS.get(e), special.get(e)), methods=[e.method], name=e.path)
              for e in api.ENDPOINTS]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        anyio.to_thread.current_default_thread_limiter().total_tokens = THREADS
        ctx.hub.start()
        yield
        await ctx.hub.stop()

    app = Starlette(routes=routes, lifespan=lifespan, middleware=[Middleware(MetricsMiddleware, metrics=ctx.metrics)])
    app.state.ctx = ctx
    return app


def _endpoint(spec: Endpoint, handler: Callable[..., Any] | None, special: Callable[..., Any] | None,
              ) -> Callable[[Request], Any]:
    async def endpoint(request: Request) -> Response:
        ctx: Context = request.app.state.ctx
        try:
            token = await _authorise(ctx, spec, request)
            if special is not None:
                return await special(ctx, token, request)
            body = await _read_body(ctx, spec, request) if spec.request is not None else None
            params = {**request.query_params, **request.path_params}
            if token is not None and _waits(body, params):
                with _hold(ctx, token, "long-poll"):
                    result = await run_in_threadpool(handler, ctx, token, body, params)  # type: ignore[arg-type]
            else:
                result = await run_in_threadpool(handler, ctx, token, body, params)  # type: ignore[arg-type]
            return Response(encode_body(result), media_type=CONTENT_TYPE)
        except ApiError as err:
            return error_response(err.status, err.message, err.headers)
        except QueueRefused as err:  # the queue refused a lease or version: nothing changed
            return error_response(status_of(err), str(err), code=err.code)
        except (ProtocolError, ValueError) as err:  # the queue refused the arguments
            return error_response(400, str(err))
        except QueueUnavailable as err:
            log.warning("%s %s: redis unavailable: %s", spec.method, spec.path, err)
            return error_response(503, "the queue is unavailable; retry", {"Retry-After": "1"})
        except StoreError as err:
            log.warning("%s %s: store error: %s", spec.method, spec.path, err)
            return error_response(503, "the adapter store is unavailable; retry", {"Retry-After": "2"})
        except QueueError as err:
            log.error("%s %s: %s", spec.method, spec.path, err)
            return error_response(500, f"the queue failed: {str(err)[:200]}")
        except Exception:  # the HTTP boundary: a bug still answers in the API's own shape
            log.exception("%s %s failed", spec.method, spec.path)
            return error_response(500, "internal error (logged by the proxy)")

    endpoint.__name__ = spec.path
    return endpoint




def _waits(body: Any, params: dict[str, str]) -> bool:
    """Whether a request may hold its connection (and a worker thread) open."""
    if isinstance(body, ClaimRequest):
        return body.block_s > 0
    if isinstance(body, ReadRolloutsRequest):
        return body.block_s > 0 and not body.pending
    return params.get("block_ms", "0") not in ("", "0")


@contextlib.contextmanager
def _hold(ctx: Context, token: Token, kind: str) -> Iterator[None]:
    try:
        ctx.holds.acquire(token.name, kind)
    except OverCap as err:
        ctx.metrics.rate_limited.labels(token=token.name).inc()
        raise ApiError(429, str(err), {"Retry-After": "2"}) from None
    try:
        yield
    finally:
        ctx.holds.release(token.name, kind)


async def _authorise(ctx: Context, spec: Endpoint, request: Request) -> Token | None:
    if not spec.roles:
        return None
    header = request.headers.get("authorization", "")
    scheme, _, secret = header.partition(" ")
    token = ctx.tokens.check(secret.strip()) if scheme.lower() == "bearer" and secret else None
    if token is None:
        raise ApiError(401, "a valid bearer token is required", {"WWW-Authenticate": "Bearer"})
    if token.role not in spec.roles:
        raise ApiError(403, f"role {token.role} may not call {spec.method} {spec.path}")
    wait = await ctx.rate.retry_after(token.name)
    if wait > 0:
        ctx.metrics.rate_limited.labels(token=token.name).inc()
        raise ApiError(429, "too many requests for this token", {"Retry-After": str(max(1, round(wait)))})
    request.state.token = token
    return token


async def _read_body(ctx: Context, spec: Endpoint, request: Request) -> Any:
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media not in ACCEPTED_CONTENT_TYPES:
        raise ApiError(415, f"content type must be {CONTENT_TYPE}, got {media or 'none'}")
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > ctx.limits.max_body_bytes):
        raise ApiError(413, f"body over the limit of {ctx.limits.max_body_bytes} bytes")
    chunks, size = [], 0
    try:
        async with asyncio.timeout(ctx.limits.body_timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > ctx.limits.max_body_bytes:
                    raise ApiError(413, f"body over the limit of {ctx.limits.max_body_bytes} bytes")
                chunks.append(chunk)
    except TimeoutError:
        raise ApiError(408, f"the body took longer than {ctx.limits.body_timeout_s:g}s to arrive") from None
    return decode_body(b"".join(chunks), spec.request, ctx.body_limits)  # type: ignore[arg-type]


# ---------------------------------------------------------------- special routes


async def _events(ctx: Context, token: Token | None, request: Request) -> Response:
    last = request.headers.get("last-event-id") or request.query_params.get("after")
    if last is not None and last != "0" and not is_entry_id(last):
        raise ApiError(400, "Last-Event-ID: not an event id")
    assert token is not None
    hub = ctx.hub

    async def stream() -> AsyncIterator[str]:
        await hub.ready.wait()
        after = last
        if after is None:  # a new subscriber: only the newest announcement, then what follows
            after = hub.events[-1].event_id if hub.events else hub.position
            if hub.events:
                yield _sse(hub.events[-1])
        elif not hub.covers(after):  # resuming from before what the hub remembers
            while page := await run_in_threadpool(ctx.queue.adapter_events, after, 1000, 0.0):
                for event in page:
                    after = event.event_id
                    yield _sse(event)
        yield ": connected\n\n"
        while hub.error is None and not hub.closing:
            fresh = hub.after(after)
            for event in fresh:
                after = event.event_id
                yield _sse(event)
            if not fresh and not await hub.wait(15.0):
                yield ": keep-alive\n\n"

    try:
        ctx.holds.acquire(token.name, "event stream")
    except OverCap as err:
        ctx.metrics.rate_limited.labels(token=token.name).inc()
        raise ApiError(429, str(err), {"Retry-After": "5"}) from None
    return HeldStream(stream(), lambda: ctx.holds.release(token.name, "event stream"),
                      media_type="text/event-stream", headers={"Cache-Control": "no-store"})


class HeldStream(StreamingResponse):
    """A streaming response that gives its hold back however it ends (finished, client
    gone, or cancelled before its first byte)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def _sse(event: Any) -> str:
    data = base64.b64encode(encode(event.manifest)).decode()
    return f"id: {event.event_id}\nevent: adapter\ndata: {data}\n\n"


async def _file(ctx: Context, token: Token | None, request: Request) -> Response:
    version = _version(request.path_params["version"])
    name = request.path_params["name"]
    if not _FILE_NAME.match(name):
        raise ApiError(400, "name: not a plain file name")
    if not isinstance(ctx.store, FileStore):
        raise ApiError(404, "this proxy hands out presigned URLs for its store; use them")
    try:
        manifest = await run_in_threadpool(ctx.store.read_manifest, version)
    except StoreMissing:
        raise ApiError(404, f"adapter v{version} does not exist") from None
    if name not in {f.name for f in manifest.files}:
        raise ApiError(404, f"adapter v{version} has no file {name}")
    return FileResponse(ctx.store.local_path(adapter_key(version, name)), media_type="application/octet-stream")


async def _metrics(ctx: Context, token: Token | None, request: Request) -> Response:
    body, content_type = await run_in_threadpool(ctx.metrics.render, ctx.queue)
    return Response(body, media_type=content_type)


async def _healthz(ctx: Context, token: Token | None, request: Request) -> Response:
    try:
        await run_in_threadpool(ctx.queue.latest_adapter)
    except QueueUnavailable:
        return JSONResponse({"status": "redis unavailable"}, status_code=503)
    return JSONResponse({"status": "ok"})


async def _openapi(ctx: Context, token: Token | None, request: Request) -> Response:
    return JSONResponse(openapi_document())


def openapi_document() -> dict[str, Any]:
    refs, components = schema_components()
    paths: dict[str, dict[str, Any]] = {}
    for spec in api.ENDPOINTS:
        op: dict[str, Any] = {
            "summary": spec.summary,
            "x-roles": sorted(spec.roles),
            "security": [{"bearer": []}] if spec.roles else [],
            "responses": {"200": {"description": "OK"}},
        }
        if spec.response is not None:
            op["responses"]["200"]["content"] = {CONTENT_TYPE: {"schema": refs[spec.response.__name__]}}
        if spec.request is not None:
            op["requestBody"] = {"required": True, "content": {CONTENT_TYPE: {"schema": refs[spec.request.__name__]}}}
        parameters = [{"name": p, "in": "path", "required": True, "schema": {"type": "string"}}
                      for p in re.findall(r"{(\w+)}", spec.path)]
        if parameters:
            op["parameters"] = parameters
        if spec.roles:
            for status, what in (("401", "no or unknown token"), ("403", "wrong role"), ("429", "rate limited")):
                op["responses"][status] = {"description": what, "content": {CONTENT_TYPE: {"schema": refs["ErrorResponse"]}}}
        paths.setdefault(spec.path, {})[spec.method.lower()] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": "spotgrpo proxy", "version": "1"},
        "paths": paths,
        "components": {"schemas": components, "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }
