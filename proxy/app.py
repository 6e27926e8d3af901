"""The proxy's HTTP API: a Starlette app in front of the queue and the adapter store.

Stateless: every request is served from Redis and the store, so any number of proxies
can run behind a load balancer and a restarted one loses nothing. Leases are taken over
and poison batches dead-lettered inside the queue's claim, so no janitor is needed.

Each endpoint is declared once in `protocol.client.api` with the roles that may call it and its
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
import inspect
import logging
import re
import signal
from collections.abc import AsyncIterator, Callable, Collection, Iterator
from functools import partial
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from protocol import (
    ProtocolError,
    QueueError,
    QueueRefused,
    QueueUnavailable,
    encode,
    is_entry_id,
)
from protocol.client import api
from protocol.client.api import Endpoint
from protocol.client.http import (
    ACCEPTED_CONTENT_TYPES,
    CONTENT_TYPE,
    RUN_HEADER,
    ClaimRequest,
    ReadRolloutsRequest,
    SubmitHead,
    decode_body,
    decode_submit,
    encode_body,
    schema_components,
)
from protocol.trusted.store import FileStore
from protocol.wire.errors import LeaseLost, status_of
from protocol.wire.files import StoreError, StoreMissing, adapter_key
from proxy.auth import RunRefused, Token
from proxy.context import OFF_LOOP_BYTES, ApiError, Context, error_response
from proxy.fairness import OverCap
from proxy.handlers import HANDLERS, parse_version, worker_name
from proxy.metrics import MetricsMiddleware
from proxy.threads import in_thread

log = logging.getLogger(__name__)

_FILE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def build_app(ctx: Context) -> Starlette:
    special: dict[Endpoint[Any, Any], Callable[..., Any]] = {  # streams, files, text: async, with the request itself
        api.ADAPTER_EVENTS: _events,
        api.ADAPTER_FILE: _file,
        api.METRICS: _metrics,
        api.HEALTHZ: _healthz,
        api.OPENAPI: _openapi,
    }
    missing = [e.path for e in api.ENDPOINTS if e not in HANDLERS and e not in special]
    if missing:
        raise RuntimeError(f"endpoints without a handler: {missing}")
    routes = [
        Route(e.path, _endpoint(e, HANDLERS.get(e), special.get(e)), methods=[e.method], name=e.path)
        for e in api.ENDPOINTS
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        ctx.hub.start()
        loop = asyncio.get_running_loop()
        with contextlib.suppress(ValueError, NotImplementedError, RuntimeError):  # not the main thread
            loop.add_signal_handler(signal.SIGHUP, ctx.reload_tokens)
        yield
        for run_ctx in list(ctx.runs.values()):
            await run_ctx.hub.stop()
        await ctx.rate.aclose()
        for client in (ctx.aredis, ctx.waits):
            if client is not None:
                await client.aclose()

    app = Starlette(routes=routes, lifespan=lifespan, middleware=[Middleware(MetricsMiddleware, metrics=ctx.metrics)])
    app.state.ctx = ctx
    return app


def _endpoint(
    spec: Endpoint[Any, Any],
    handler: Callable[..., Any] | None,
    special: Callable[..., Any] | None,
) -> Callable[[Request], Any]:
    on_loop = inspect.iscoroutinefunction(handler)

    async def endpoint(request: Request) -> Response:
        ctx: Context = request.app.state.ctx
        token: Token | None = None
        try:
            token = await _authorise(ctx, spec, request)
            if token is not None:
                registered = await ctx.registry.runs_async(ctx.queue) if token.patterns else ()
                ctx = _run_context(ctx, token, request, spec, registered)
            if special is not None:
                answer: Response = await special(ctx, token, request)
                return answer
            body = await _read_body(ctx, token, spec, request) if spec.request is not None else None
            params = {**request.query_params, **request.path_params}
            if token is not None and _waits(body, params):
                with _hold(ctx, token, "long-poll"):
                    result = (
                        await handler(ctx, token, body, params)  # type: ignore[misc]
                        if on_loop
                        else await in_thread(handler, ctx, token, body, params)  # type: ignore[arg-type]
                    )
            elif on_loop:
                result = await handler(ctx, token, body, params)  # type: ignore[misc]
            else:
                result = await in_thread(handler, ctx, token, body, params)  # type: ignore[arg-type]
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
        except ClientDisconnect:  # the client went away mid-body (it died, or its owner did): nobody to answer
            log.info("%s %s: the client disconnected before its body arrived", spec.method, spec.path)
            return error_response(400, "the client disconnected")
        except QueueError as err:
            log.error("%s %s: %s", spec.method, spec.path, err)
            return error_response(500, f"the queue failed: {str(err)[:200]}")
        except Exception:  # the HTTP boundary: a bug still answers in the API's own shape
            log.exception("%s %s failed", spec.method, spec.path)
            return error_response(500, "internal error (logged by the proxy)")
        finally:  # the body's bytes are the request's until it is answered
            if token is not None:
                ctx.bodies.give(token.name, getattr(request.state, "body_bytes", 0))

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


async def _authorise(ctx: Context, spec: Endpoint[Any, Any], request: Request) -> Token | None:
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


def _run_context(
    ctx: Context, token: Token, request: Request, spec: Endpoint[Any, Any], registered: Collection[str]
) -> Context:
    """The context of the run the request names (`RUN_HEADER`), or of the token's run
    (`registered`: the runs started, which its patterns match). A token of several runs
    may ask who it is without naming one (a worker serving them all)."""
    asked = request.headers.get(RUN_HEADER)
    try:
        run = token.run_of(asked, ctx.run, registered)
    except RunRefused as err:
        if spec is api.WHOAMI and asked is None:
            return ctx
        raise ApiError(403, str(err)) from None
    return ctx.for_run(run)


async def _read_body(ctx: Context, token: Token | None, spec: Endpoint[Any, Any], request: Request) -> Any:
    """The request's body, decoded. Its bytes count against the token's and everyone's
    bodies in flight as they arrive (`request.state.body_bytes`, given back when the
    request is answered); a big one is decoded in a worker thread."""
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media not in ACCEPTED_CONTENT_TYPES:
        raise ApiError(415, f"content type must be {CONTENT_TYPE}, got {media or 'none'}")
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > ctx.limits.max_body_bytes):
        raise ApiError(413, f"body over the limit of {ctx.limits.max_body_bytes} bytes")
    chunks, size = [], 0
    request.state.body_bytes = 0
    try:
        async with asyncio.timeout(ctx.limits.body_timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > ctx.limits.max_body_bytes:
                    raise ApiError(413, f"body over the limit of {ctx.limits.max_body_bytes} bytes")
                if token is not None:
                    ctx.bodies.take(token.name, len(chunk))
                    request.state.body_bytes += len(chunk)
                chunks.append(chunk)
    except TimeoutError:
        raise ApiError(408, f"the body took longer than {ctx.limits.body_timeout_s:g}s to arrive") from None
    except OverCap as err:
        ctx.metrics.rate_limited.labels(token=token.name if token else "").inc()
        raise ApiError(503 if err.everyone else 429, str(err), {"Retry-After": "2"}) from None
    data = b"".join(chunks)
    assert spec.request is not None
    decoder: Any = (
        partial(decode_submit, limits=ctx.body_limits)  # its groups marked as checked
        if spec is api.SUBMIT
        else partial(decode_body, cls=spec.request, limits=ctx.body_limits)
    )
    if len(data) > OFF_LOOP_BYTES:
        if spec is api.SUBMIT and token is not None:
            await _lease_first(ctx, token, data)
        return await in_thread(decoder, data)
    return decoder(data)


async def _lease_first(ctx: Context, token: Token, data: bytes) -> None:
    """A big submission's lease, checked before its groups are decoded: one that this
    token's worker does not hold is refused for the price of reading two fields and one
    Redis call (a heartbeat: for the holder, the submission is a sign of life anyway)."""
    try:
        head = msgspec.msgpack.decode(data, type=SubmitHead)
    except msgspec.DecodeError as err:
        raise ApiError(400, f"malformed body: {err}") from None
    except msgspec.ValidationError:
        return  # the full decode says what is wrong, with the schema's words
    held = await in_thread(ctx.queue.heartbeat, worker_name(token, head.worker), [head.lease_id])
    if head.lease_id not in held:
        raise LeaseLost(f"lease {head.lease_id} is not held by worker {head.worker}: nothing was stored")


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
            while page := await in_thread(ctx.queue.adapter_events, after, 1000, 0.0):
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
    return HeldStream(
        stream(),
        lambda: ctx.holds.release(token.name, "event stream"),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-store"},
    )


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
    version = parse_version(request.path_params["version"])
    name = request.path_params["name"]
    if not _FILE_NAME.match(name):
        raise ApiError(400, "name: not a plain file name")
    if not isinstance(ctx.store, FileStore):
        raise ApiError(404, "this proxy hands out presigned URLs for its store; use them")
    try:
        manifest = await in_thread(ctx.store.read_manifest, version)
    except StoreMissing:
        raise ApiError(404, f"adapter v{version} does not exist") from None
    if name not in {f.name for f in manifest.files}:
        raise ApiError(404, f"adapter v{version} has no file {name}")
    return FileResponse(ctx.store.local_path(adapter_key(version, name)), media_type="application/octet-stream")


async def _metrics(ctx: Context, token: Token | None, request: Request) -> Response:
    body, content_type = await in_thread(ctx.metrics.render, ctx.queue)
    return Response(body, media_type=content_type)


async def _healthz(ctx: Context, token: Token | None, request: Request) -> Response:
    try:
        await in_thread(ctx.queue.latest_adapter)
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
        parameters = [
            {"name": p, "in": "path", "required": True, "schema": {"type": "string"}}
            for p in re.findall(r"{(\w+)}", spec.path)
        ]
        if parameters:
            op["parameters"] = parameters
        if spec.roles:
            for status, what in (("401", "no or unknown token"), ("403", "wrong role"), ("429", "rate limited")):
                op["responses"][status] = {
                    "description": what,
                    "content": {CONTENT_TYPE: {"schema": refs["ErrorResponse"]}},
                }
        paths.setdefault(spec.path, {})[spec.method.lower()] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": "spotgrpo proxy", "version": "1"},
        "paths": paths,
        "components": {"schemas": components, "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }
