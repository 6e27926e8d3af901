"""The HTTP API of `proxy serve`, declared once: each endpoint's method, path, the roles
that may call it, and its request and response types (`protocol.client.http`). The proxy binds a
handler to every endpoint here (`proxy.app`); the HTTPS client calls them by name
(`protocol.client.http_queue`); `/openapi.json` is generated from this table. What status each
refusal travels as, and which exception it becomes again, is in `protocol.wire.errors`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, TypeVar

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
    SubmitRequest,
    SubmitResponse,
    WhoAmIResponse,
    WorkersResponse,
)

Req = TypeVar("Req")
Resp = TypeVar("Resp")


@dataclass(frozen=True)
class Endpoint(Generic[Req, Resp]):
    """One route: `Endpoint[Req, Resp]` takes a `Req` body and answers 200 with a `Resp`, so a
    client's call of it is typed (`HttpQueue._call`); a route without a MessagePack body
    has `None` there (and the type parameter is left unsolved)."""

    method: str
    path: str
    """With `{name}` for a path parameter."""
    roles: frozenset[str]
    """Who may call it; empty: no token needed."""
    summary: str
    request: type[Req] | None = None
    """The MessagePack body it takes; None: none (or not MessagePack)."""
    response: type[Resp] | None = None
    """The MessagePack body it answers 200 with; None: another kind (a stream, a file, text)."""

    def url(self, **params: object) -> str:
        return self.path.format(**params)


def _e(
    method: str,
    path: str,
    roles: set[str],
    summary: str,
    request: type[Req] | None = None,
    response: type[Resp] | None = None,
) -> Endpoint[Req, Resp]:
    return Endpoint(method, path, frozenset(roles), summary, request, response)


ACTOR, LEARNER, ADMIN = "actor", "learner", "admin"

CLAIM = _e(
    "POST",
    "/v1/leases/claim",
    {ACTOR},
    "Claim prompt batches (long-poll); expired leases are taken over first.",
    ClaimRequest,
    ClaimResponse,
)
HEARTBEAT = _e(
    "POST",
    "/v1/leases/heartbeat",
    {ACTOR},
    "Extend leases; returns those still held.",
    HeartbeatRequest,
    HeartbeatResponse,
)
SUBMIT = _e(
    "POST",
    "/v1/leases/submit",
    {ACTOR},
    "Store a batch's rollout groups and acknowledge its lease (idempotent by group id).",
    SubmitRequest,
    SubmitResponse,
)
RELEASE = _e("POST", "/v1/leases/release", {ACTOR}, "Hand a lease back unfinished.", ReleaseRequest, ReleaseResponse)
REPORT_STATUS = _e(
    "POST",
    "/v1/workers/status",
    {ACTOR},
    "Report this worker's status (adapter loaded, last error, throughput).",
    ReportStatusRequest,
    ReportStatusResponse,
)
LEAVE = _e(
    "POST",
    "/v1/workers/leave",
    {ACTOR},
    "A stopping worker's last call: its status leaves the fleet view (and its token's count of live workers) now.",
    LeaveRequest,
    LeaveResponse,
)
WORKERS: Endpoint[None, WorkersResponse] = _e(
    "GET",
    "/v1/workers",
    {LEARNER, ADMIN},
    (
        "Workers that reported within ?max_age_s= (default 120), with their status: up to ?limit= (default 500, at "
        "most 1000), furthest behind first, and how many in all; with the learner's verdicts: every quarantined "
        "worker and why, and the audits of the listed ones."
    ),
    None,
    WorkersResponse,
)
WHOAMI: Endpoint[None, WhoAmIResponse] = _e(
    "GET",
    "/v1/whoami",
    {ACTOR, LEARNER, ADMIN},
    "The token's name and role, and the run this proxy serves.",
    None,
    WhoAmIResponse,
)
LATEST_ADAPTER: Endpoint[None, LatestAdapterResponse] = _e(
    "GET",
    "/v1/adapters/latest",
    {ACTOR, LEARNER},
    "The newest announced adapter manifest.",
    None,
    LatestAdapterResponse,
)
ADAPTER_EVENTS: Endpoint[None, None] = _e(
    "GET",
    "/v1/adapters/events",
    {ACTOR, LEARNER},
    "Adapter announcements as server-sent events; resumes after Last-Event-ID.",
)
ADAPTER_HISTORY: Endpoint[None, AdapterEventsResponse] = _e(
    "GET",
    "/v1/adapters/history",
    {ACTOR, LEARNER},
    "Announcements after ?after= (up to ?count=, waiting up to ?block_ms=).",
    None,
    AdapterEventsResponse,
)
ADAPTER_DOWNLOAD: Endpoint[None, AdapterDownload] = _e(
    "GET",
    "/v1/adapters/{version}",
    {ACTOR},
    "Manifest and short-lived download URLs of one adapter version.",
    None,
    AdapterDownload,
)
ADAPTER_FILE: Endpoint[None, None] = _e(
    "GET", "/v1/adapters/{version}/files/{name}", {ACTOR}, "One adapter file, streamed by the proxy (file:// stores)."
)
ADD_PROMPTS = _e(
    "POST",
    "/v1/prompts",
    {LEARNER},
    "Queue prompt batches (idempotent by batch id).",
    AddPromptsRequest,
    AddPromptsResponse,
)
READ_ROLLOUTS = _e(
    "POST",
    "/v1/rollouts/read",
    {LEARNER},
    "Read new (or, with pending, unacknowledged) rollout groups.",
    ReadRolloutsRequest,
    RolloutsResponse,
)
ACK = _e("POST", "/v1/rollouts/ack", {LEARNER}, "Acknowledge consumed rollout groups.", AckRequest, AckResponse)
QUARANTINE = _e(
    "POST",
    "/v1/quarantine",
    {LEARNER},
    "Quarantine a worker (a failed audit or adapter digest): its claims are refused with the reason. Answers the "
    "entry written.",
    QuarantineRequest,
    QuarantineResponse,
)
QUARANTINED: Endpoint[None, QuarantineResponse] = _e(
    "GET",
    "/v1/quarantine",
    {LEARNER, ADMIN},
    'The quarantined workers and why ("": lifted by the admin, not yet seen by the learner).',
    None,
    QuarantineResponse,
)
LIFT_QUARANTINE = _e(
    "POST",
    "/v1/quarantine/lift",
    {ADMIN},
    "Let a quarantined worker claim again, and the learner train its groups (`proxy quarantine --lift`).",
    LiftRequest,
    LiftResponse,
)
FORGET_LIFTED = _e(
    "POST",
    "/v1/quarantine/lifted",
    {LEARNER},
    "The learner has seen these lifts: their entries go. Answers no workers.",
    ForgetLiftedRequest,
    QuarantineResponse,
)
RECORD_AUDITS = _e(
    "POST",
    "/v1/audits",
    {LEARNER},
    "Add the learner's audits since it last recorded, per worker, to the run's tallies. Answers the tallies sent.",
    RecordAuditsRequest,
    AuditsResponse,
)
AUDITS: Endpoint[None, AuditsResponse] = _e(
    "GET",
    "/v1/audits",
    {LEARNER, ADMIN},
    "Every audited worker's tally in this run: audits passed and failed (`GET /v1/workers` shows the listed ones).",
    None,
    AuditsResponse,
)
EXPIRE_RUN = _e(
    "POST",
    "/v1/run/expire",
    {LEARNER},
    "The run is over: its keys expire after ttl_s.",
    ExpireRunRequest,
    ExpireRunResponse,
)
RUN_OVER = _e(
    "POST",
    "/v1/run/over",
    {LEARNER},
    "The learner finished the run: claims are refused from now on with its words (410 `run_over`), so workers "
    'stop; "" takes it back (a learner starting or resuming the run).',
    RunOverRequest,
    RunOverResponse,
)
RUN_REWARDS = _e(
    "POST",
    "/v1/run/rewards",
    {LEARNER},
    "The reward functions the run is scored with (a scoring worker with others refuses to start).",
    RunRewardsRequest,
    RunRewardsResponse,
)
RUN_SHARE = _e(
    "POST",
    "/v1/run/share",
    {LEARNER, ADMIN},
    "The run's weight and cap on a fleet that serves several runs (workers learn them with their claims).",
    RunShareRequest,
    RunShareResponse,
)
ANNOUNCE = _e(
    "POST", "/v1/adapters/announce", {LEARNER}, "Make a manifest the latest adapter.", AnnounceRequest, AnnounceResponse
)
DEAD_LETTERS: Endpoint[None, DeadLettersResponse] = _e(
    "GET",
    "/v1/dead-letters",
    {LEARNER, ADMIN},
    "Dead-lettered batches after ?after=, up to ?count=.",
    None,
    DeadLettersResponse,
)
STATS: Endpoint[None, StatsResponse] = _e(
    "GET", "/v1/stats", {LEARNER, ADMIN}, "Stream depths, leases by worker, latest version.", None, StatsResponse
)
METRICS: Endpoint[None, None] = _e("GET", "/metrics", {ADMIN}, "Prometheus metrics.")
HEALTHZ: Endpoint[None, None] = _e("GET", "/healthz", set(), "200 when Redis answers.")
OPENAPI: Endpoint[None, None] = _e("GET", "/openapi.json", set(), "This document.")

ENDPOINTS: tuple[Endpoint[Any, Any], ...] = (
    CLAIM, HEARTBEAT, SUBMIT, RELEASE, REPORT_STATUS, LEAVE, WORKERS, WHOAMI, LATEST_ADAPTER, ADAPTER_EVENTS,
    ADAPTER_HISTORY, ADAPTER_DOWNLOAD, ADAPTER_FILE, ADD_PROMPTS, READ_ROLLOUTS, ACK, EXPIRE_RUN, RUN_OVER, RUN_REWARDS,
    RUN_SHARE, ANNOUNCE,
    DEAD_LETTERS, STATS, QUARANTINE, QUARANTINED, LIFT_QUARANTINE, FORGET_LIFTED, RECORD_AUDITS,
    AUDITS, METRICS, HEALTHZ, OPENAPI,
)  # fmt: skip
"""In the order routes are matched (a literal path before a parametrised one)."""
