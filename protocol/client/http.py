"""Request and response bodies of the proxy's HTTP API (MessagePack, `application/vnd.msgpack`).

Each is a typed message with a `type` tag and a `schema` version, like the stream
messages, and carries those messages (`PromptBatch`, `RolloutGroup`, `AdapterManifest`)
inside it, validated the same way. The queue's result records (`Lease`, `Delivery`,
`SubmitResult`, ...) travel as they are. `decode_body` raises `ProtocolError` (only),
with the offending field first; the proxy turns it into a 400.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Annotated, Any, TypeVar

import msgspec

from protocol.client.queue import (
    AdapterEvent,
    AuditTally,
    DeadLetter,
    Delivery,
    FinishedBatch,
    Lease,
    QueueStats,
    SubmitResult,
)
from protocol.wire.codec import _CHECKED, DEFAULT_LIMITS, CheckedGroups, Limits, _check_limits, _field_path
from protocol.wire.errors import ProtocolError
from protocol.wire.messages import (
    SCHEMA_VERSION,
    AdapterManifest,
    Ident,
    NonNegInt,
    OneLine,
    PosInt,
    PromptBatch,
    RolloutGroup,
    RunShare,
    WorkerStatus,
    check_schema,
)

CONTENT_TYPE = "application/vnd.msgpack"
ACCEPTED_CONTENT_TYPES = frozenset({CONTENT_TYPE, "application/msgpack", "application/x-msgpack"})

MAX_ITEMS = 4096
"""Upper bound on the entries of any list in a body; the proxy applies a lower limit."""
CHUNK_ITEMS = 256
"""The most entries the client puts in one call's list (a learner's prompts or acks for a
fleet go in several calls); a proxy's --max-messages may not be lower."""

EntryId = Annotated[str, msgspec.Meta(pattern=r"^[0-9]{1,20}-[0-9]{1,20}$")]
"""A Redis stream entry id (lease ids, delivery ids and event ids are all of this form)."""
BlockS = Annotated[float, msgspec.Meta(ge=0.0, le=60.0)]
Count = Annotated[int, msgspec.Meta(ge=1, le=MAX_ITEMS)]


RUN_HEADER = "Spotgrpo-Run"
"""The request header naming the run a call is for; without it, the token's run (a proxy
serves its `--run` and every run its tokens name). `HttpQueue` sends its `config.run`, but
for the run named "default": a client told no run gets the token's."""


class _Body(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag_field="type"):
    schema: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        check_schema(self.schema)


# ----------------------------------------------------------------- actor routes


class ClaimRequest(_Body, frozen=True, tag="claim"):
    worker: Ident
    count: Count = 1
    block_s: BlockS = 0.0
    """Long-poll: wait up to this long for a batch (the proxy may cap it)."""


class ClaimResponse(_Body, frozen=True, tag="leases"):
    leases: list[Lease]
    share: RunShare | None = None
    """The run's weight and cap (`Queue.set_run_share`), for a worker serving several runs:
    it learns them with every claim, at no call of its own (None: a proxy that does not say)."""


class HeartbeatRequest(_Body, frozen=True, tag="heartbeat"):
    worker: Ident
    lease_ids: Annotated[list[EntryId], msgspec.Meta(max_length=MAX_ITEMS)]


class HeartbeatResponse(_Body, frozen=True, tag="held"):
    lease_ids: list[str]


class SubmitRequest(_Body, frozen=True, tag="submit"):
    worker: Ident
    lease_id: EntryId
    groups: Annotated[list[RolloutGroup], msgspec.Meta(min_length=1, max_length=MAX_ITEMS)]


class SubmitHead(msgspec.Struct, frozen=True):
    """A submission's worker and lease alone, read without decoding its groups (msgspec
    skips unknown fields by their lengths): the proxy checks the lease of a big body before
    it pays for the rest."""

    worker: str
    lease_id: str


class SubmitResponse(_Body, frozen=True, tag="submitted"):
    result: SubmitResult


class ReleaseRequest(_Body, frozen=True, tag="release"):
    worker: Ident
    lease_id: EntryId


class ReleaseResponse(_Body, frozen=True, tag="released"):
    released: bool


class AdapterDownload(_Body, frozen=True, tag="adapter_download"):
    """Where to fetch each file of an adapter version: short-lived presigned URLs, or
    the proxy's own file route (which needs the actor's token) for a file:// store."""

    manifest: AdapterManifest
    urls: dict[str, str]
    proxied: bool
    """True when the URLs are the proxy's own and need the bearer token."""


class ReportStatusRequest(_Body, frozen=True, tag="report_status"):
    status: WorkerStatus
    """Its `worker` is the worker's own name; the proxy puts the token's name first."""


class ReportStatusResponse(_Body, frozen=True, tag="reported"):
    worker: str
    """The name the status is listed under."""


class LeaveRequest(_Body, frozen=True, tag="leave"):
    worker: Ident
    """The worker's own name; the proxy puts the token's name first."""


class LeaveResponse(_Body, frozen=True, tag="left"):
    left: bool
    """False: it was not listed (never reported, or aged out)."""


class WorkersResponse(_Body, frozen=True, tag="workers"):
    workers: Annotated[list[WorkerStatus], msgspec.Meta(max_length=1000)]
    """At most `?limit=` of them (default 500, at most 1,000): the furthest behind first
    (lowest adapter version, then most refusals), then by name."""
    total: int = 0
    """How many workers reported within `max_age_s`, listed or not."""
    quarantined: Annotated[dict[Ident, str], msgspec.Meta(max_length=1000)] = {}
    """The learner's verdict on the fleet: every quarantined worker (listed or gone) and why."""
    audits: Annotated[dict[Ident, AuditTally], msgspec.Meta(max_length=2000)] = {}
    """The learner's audits of the listed and quarantined workers' groups (`learner.audit`);
    a worker not yet audited has none."""


class WhoAmIResponse(_Body, frozen=True, tag="whoami"):
    """Who the proxy takes the caller for, and the run it serves: a client checks its
    token's role and its `--run` before it spends anything (a model load, a GPU)."""

    name: str
    """The token's name (its secret is never sent back)."""
    role: str
    run: str
    """The run the call named, or the token's ("": a token of several runs, and none named)."""
    lease_timeout_s: float | None = None
    """The proxy's `--lease-timeout-s`: a lease claimed through it lapses after this long
    without a heartbeat, whatever the client's own setting (None: a proxy that does not say)."""
    runs: Annotated[list[str], msgspec.Meta(max_length=1000)] = []
    """Every run the token may touch on this proxy now, `run` among them (empty: a proxy
    that does not say)."""
    patterns: Annotated[list[str], msgspec.Meta(max_length=1000)] = []
    """The token's run patterns (`"sweep-*"`): `runs` grows as learners start runs they match."""


# --------------------------------------------------------------- learner routes


class AddPromptsRequest(_Body, frozen=True, tag="add_prompts"):
    batches: Annotated[list[PromptBatch], msgspec.Meta(min_length=1, max_length=MAX_ITEMS)]


class AddPromptsResponse(_Body, frozen=True, tag="added"):
    added: NonNegInt


class QuarantineRequest(_Body, frozen=True, tag="quarantine"):
    """The learner quarantines a worker (its full name, `token/worker`)."""

    worker: Ident
    reason: OneLine


class QuarantineResponse(_Body, frozen=True, tag="quarantined"):
    workers: Annotated[dict[Ident, str], msgspec.Meta(max_length=100_000)]
    """Worker -> why; "" for one the admin lifted that the learner has not yet seen."""


class RecordAuditsRequest(_Body, frozen=True, tag="record_audits"):
    """Audits the learner made since it last recorded, per worker (added to the run's)."""

    workers: Annotated[dict[Ident, AuditTally], msgspec.Meta(max_length=MAX_ITEMS)]


class AuditsResponse(_Body, frozen=True, tag="audits"):
    workers: Annotated[dict[Ident, AuditTally], msgspec.Meta(max_length=100_000)]
    """Worker -> its tally (POST: the tallies written, as sent)."""


class ForgetLiftedRequest(_Body, frozen=True, tag="forget_lifted"):
    workers: Annotated[list[Ident], msgspec.Meta(max_length=MAX_ITEMS)]


class LiftRequest(_Body, frozen=True, tag="lift"):
    worker: Ident


class LiftResponse(_Body, frozen=True, tag="lifted"):
    lifted: bool
    """False: the worker was not quarantined."""


class ExpireRunRequest(_Body, frozen=True, tag="expire_run"):
    ttl_s: Annotated[float, msgspec.Meta(gt=0.0, le=365 * 86400.0)]


class ExpireRunResponse(_Body, frozen=True, tag="expiring"):
    keys: NonNegInt


class RunOverRequest(_Body, frozen=True, tag="run_over"):
    why: Annotated[str, msgspec.Meta(max_length=500)]
    """The learner's last word, which refused claims carry ("": the run goes on again)."""


class RunOverResponse(_Body, frozen=True, tag="run_over_set"):
    over: bool


class RunRewardsRequest(_Body, frozen=True, tag="run_rewards"):
    specs: Annotated[list[Annotated[str, msgspec.Meta(max_length=300)]], msgspec.Meta(max_length=64)]
    """The reward functions the run is scored with, canonical `module:function=weight`."""


class RunRewardsResponse(_Body, frozen=True, tag="run_rewards_set"):
    specs: list[str]


class RunShareRequest(_Body, frozen=True, tag="run_share"):
    share: RunShare


class RunShareResponse(_Body, frozen=True, tag="run_share_set"):
    share: RunShare


class ReadRolloutsRequest(_Body, frozen=True, tag="read_rollouts"):
    consumer: Ident
    count: Count = 1
    block_s: BlockS = 0.0
    pending: bool = False
    """Read the consumer's pending (delivered, unacknowledged) groups instead of new ones."""
    after: str = "0"


class RolloutsResponse(_Body, frozen=True, tag="rollouts"):
    deliveries: list[Delivery]


class AckRequest(_Body, frozen=True, tag="ack"):
    delivery_ids: Annotated[list[EntryId], msgspec.Meta(max_length=MAX_ITEMS)]
    finished: Annotated[list[FinishedBatch], msgspec.Meta(max_length=MAX_ITEMS)] = []
    """Batches the learner has checkpointed to the end: their dedup records go."""


class AckResponse(_Body, frozen=True, tag="acked"):
    acked: NonNegInt


class AnnounceRequest(_Body, frozen=True, tag="announce"):
    manifest: AdapterManifest


class AnnounceResponse(_Body, frozen=True, tag="announced"):
    event_id: str


class LatestAdapterResponse(_Body, frozen=True, tag="latest_adapter"):
    manifest: AdapterManifest | None


class AdapterEventsResponse(_Body, frozen=True, tag="adapter_events"):
    events: list[AdapterEvent]


class DeadLettersResponse(_Body, frozen=True, tag="dead_letters"):
    entries: list[DeadLetter]


class StatsResponse(_Body, frozen=True, tag="stats"):
    stats: QueueStats


class ErrorResponse(_Body, frozen=True, tag="error"):
    status: PosInt
    error: str
    """One line saying what was wrong; never a traceback."""
    code: str = ""
    """For a refusal, its kind (`lease_lost`, `submission_rejected`, ...: the `code` of the
    `QueueRefused` subclass the client should raise); empty for other errors."""


REQUESTS = (
    ClaimRequest, HeartbeatRequest, SubmitRequest, ReleaseRequest, ReportStatusRequest, LeaveRequest, AddPromptsRequest,
    ReadRolloutsRequest, AckRequest, AnnounceRequest, ExpireRunRequest, QuarantineRequest, LiftRequest,
    ForgetLiftedRequest, RecordAuditsRequest, RunOverRequest, RunRewardsRequest, RunShareRequest,
)  # fmt: skip
RESPONSES = (
    ClaimResponse, HeartbeatResponse, SubmitResponse, ReleaseResponse, ReportStatusResponse, LeaveResponse,
    AdapterDownload, AddPromptsResponse, RolloutsResponse, AckResponse, AnnounceResponse, LatestAdapterResponse,
    AdapterEventsResponse, DeadLettersResponse, StatsResponse, WorkersResponse, ExpireRunResponse, ErrorResponse,
    WhoAmIResponse, QuarantineResponse, LiftResponse, AuditsResponse, RunOverResponse, RunRewardsResponse,
    RunShareResponse,
)  # fmt: skip

_ENCODER = msgspec.msgpack.Encoder()


@cache
def _decoder(cls: type) -> msgspec.msgpack.Decoder[Any]:
    return msgspec.msgpack.Decoder(cls)


def encode_body(body: _Body) -> bytes:
    return _ENCODER.encode(body)


T = TypeVar("T")


def decode_body(data: bytes, cls: type[T], limits: Limits = DEFAULT_LIMITS) -> T:
    """Parse and validate one body of type `cls`, nested messages included."""
    if len(data) > limits.max_message_bytes:
        raise ProtocolError(f"body: {len(data)} bytes exceed the limit of {limits.max_message_bytes}")
    try:
        body = _decoder(cls).decode(data)  # type: ignore[arg-type]  # a class is hashable; typeshed's cache says otherwise
    except ProtocolError:
        raise
    except msgspec.MsgspecError as err:
        raise ProtocolError(_field_path(err)) from None
    except RecursionError:
        raise ProtocolError("body: nested too deeply") from None
    for msg in _nested(body):
        _check_limits(msg, limits, len(data))
    checked: T = body  # msgspec's decoder for `cls` returns a `cls`
    return checked


@dataclass(frozen=True)
class CheckedSubmit:
    """A submission as the proxy decoded it: its groups are `CheckedGroups`."""

    worker: str
    lease_id: str
    groups: CheckedGroups


def decode_submit(data: bytes, limits: Limits = DEFAULT_LIMITS) -> CheckedSubmit:
    """`decode_body` of a `SubmitRequest`, its groups marked as validated against `limits`."""
    body = decode_body(data, SubmitRequest, limits)
    return CheckedSubmit(body.worker, body.lease_id, CheckedGroups(body.groups, limits, _CHECKED))


def _nested(body: Any) -> list[Any]:
    if isinstance(body, SubmitRequest):
        return list(body.groups)
    if isinstance(body, AddPromptsRequest):
        return list(body.batches)
    if isinstance(body, ClaimResponse):
        return [lease.batch for lease in body.leases]
    if isinstance(body, RolloutsResponse):
        return [d.group for d in body.deliveries]
    return []


def schema_components() -> tuple[dict[str, Any], dict[str, Any]]:
    """JSON Schemas of every body, for the OpenAPI document: ({name: ref}, components)."""
    refs, components = msgspec.json.schema_components(REQUESTS + RESPONSES, ref_template="#/components/schemas/{name}")
    return {cls.__name__: ref for cls, ref in zip(REQUESTS + RESPONSES, refs, strict=True)}, components
