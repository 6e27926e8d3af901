"""The proxy's endpoints as plain functions: (context, token, decoded body, parameters) ->
the endpoint's response type, run in a worker thread (a coroutine function, `submit`, on
the event loop itself); `HANDLERS` binds each to its
endpoint of `protocol.client.api`. The HTTP machinery around them (auth, limits, bodies,
errors, streams) is `proxy.app`'s."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import msgspec

from protocol import is_entry_id
from protocol.client import api
from protocol.client.api import Endpoint
from protocol.client.http import (
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
)
from proxy.auth import Token
from proxy.context import (
    OFF_LOOP_BYTES,
    ApiError,
    Context,
)
from proxy.metrics import behind_first
from proxy.threads import in_thread

log = logging.getLogger(__name__)

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
