"""The queue interface: what the learner and the actors need from the transport, nothing more.

Two transports implement it: `RedisQueue` (Redis streams, direct; also over fakeredis
for the embedded default; `protocol.trusted.redis_queue`) and HTTPS through the proxy (`protocol.client.http_queue`).
Code above this interface imports no Redis client: only `protocol.trusted` and the scoring
tier (`learner.scoring`, which runs RQ on the run's Redis) do, and the import contracts in
pyproject.toml (`make lint`) hold that.

Semantics every transport keeps:
- Prompt batches are leased, not popped: a claimed batch stays pending until its
  rollout groups are submitted. A lease not heartbeated for `lease_timeout_s` is
  taken over by the next `claim` of any worker; a batch delivered `max_deliveries`
  times and still not finished goes to the dead-letter stream with its count.
- `submit` is checked against the lease it names, atomically: the lease is held by
  this worker, and the groups answer its batch (one per prompt id of the batch, none
  extra, `num_generations` completions each, none over `max_tokens`, the issued prompt
  tokens). A submission failing any check is refused whole and changes nothing.
- A lease's groups may come in several submissions; the one that gives the last
  prompt its group finishes the lease. A partial submission keeps the lease held (and
  counts as a heartbeat). Every call is idempotent by group id: a retried call whose
  groups are all stored answers as a duplicate, even after the lease is finished, until
  the learner has checkpointed the whole batch (`FinishedBatch`); after that a
  submission for the batch is refused (`LEASE_LOST`), so the dedup records stay bounded
  and no group is ever stored twice.
- A lease that expires `max_deliveries` times goes to the dead letters naming the
  group ids still missing, so a partly answered batch loses no prompt uncounted.
- `add_prompts` is idempotent by batch id, so a retried or re-issued batch is queued
  once, until the learner reports the batch finished (it never issues it again).
- Rollout groups stay pending for the learner until it acknowledges them (after the
  checkpoint that consumed them); after a crash `pending_rollouts` hands them back.
- Streams are trimmed only below the oldest entry still pending or undelivered:
  trimming never deletes an unacknowledged prompt or rollout.
- The latest adapter version only moves forward.
"""

from __future__ import annotations

import abc
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Self

from protocol.wire.codec import DEFAULT_LIMITS, Limits
from protocol.wire.messages import AdapterManifest, PromptBatch, RolloutGroup, RunShare, WorkerStatus

_MAX_U64 = 2**64 - 1


def is_entry_id(text: object) -> bool:
    """A stream entry id as Redis accepts it: `<ms>-<seq>`, both parts within 64 bits.
    Lease, delivery and event ids are all of this form."""
    if not isinstance(text, str) or len(text) > 41:
        return False
    ms, sep, seq = text.partition("-")
    return (
        bool(sep)
        and ms.isascii()
        and seq.isascii()
        and ms.isdigit()
        and seq.isdigit()
        and int(ms) <= _MAX_U64
        and int(seq) <= _MAX_U64
    )


@dataclass(frozen=True)
class QueueConfig:
    """Settings shared by every transport."""

    run: str = "default"
    """Run name; every key of the run lives under it, so runs can share one Redis."""
    lease_timeout_s: float = 60.0
    """A claimed batch not heartbeated for this long may be taken over by another worker.
    Through a proxy the proxy's `--lease-timeout-s` counts; `HttpQueue.whoami` adopts it."""
    max_deliveries: int = 3
    """A batch handed out this many times without being finished goes to the dead letters."""
    max_block_s: float = 10.0
    """Longest blocking wait one call may ask for (keeps sockets and proxies happy)."""
    adapter_events_maxlen: int = 10_000
    """Adapter events kept for late joiners (they need only the recent ones)."""
    limits: Limits = DEFAULT_LIMITS
    """Message size limits applied when reading from the queue."""

    def __post_init__(self) -> None:
        if not self.run or any(c in self.run for c in "{}\x00 \n"):
            raise ValueError(f"run: {self.run!r} must be non-empty without braces, spaces or NUL")
        if not self.lease_timeout_s > 0:
            raise ValueError("lease_timeout_s: must be > 0")
        if self.max_deliveries < 1:
            raise ValueError("max_deliveries: must be >= 1")
        if not 0 < self.max_block_s <= 60:
            raise ValueError("max_block_s: must be in (0, 60]")
        if self.adapter_events_maxlen < 1:
            raise ValueError("adapter_events_maxlen: must be >= 1")


@dataclass(frozen=True)
class Lease:
    """A prompt batch claimed by one worker until submitted, handed back or expired."""

    lease_id: str
    """Opaque; pass it back to heartbeat, submit and release."""
    batch: PromptBatch
    deliveries: int
    """How many times the batch has been handed out, this time included."""


@dataclass(frozen=True)
class SubmitResult:
    stored: int
    """Groups appended to the rollout stream by this call."""
    duplicates: int
    """Groups skipped because a group with the same id was stored before."""
    lease_held: bool
    """True when this worker held the lease at the call; False only for a call whose
    groups were all stored already (a retry after the lease was finished)."""
    finished: bool = True
    """The lease is done: every prompt of its batch has its group (or, for a retry,
    the lease is gone). False after a partial submission: the lease stays held."""
    missing: int = 0
    """Prompts of the batch still without a group; 0 once finished."""


@dataclass(frozen=True)
class FinishedBatch:
    """A batch the learner has consumed to its last prompt (trained, dropped or
    dead-lettered) and checkpointed. Its lease is gone, so no submission can store its
    groups again, and the learner never issues it again: the queue forgets its
    deduplication records (its id in batches-seen, its groups' in groups-seen and
    scored-seen), which keeps those sets bounded by the batches in flight."""

    batch_id: str
    group_ids: list[str]


_GROUP_ID = re.compile(r"^[0-9a-f]{32}$")
_BATCH_ID = re.compile(r"^[^\x00-\x1f]{1,256}$")


def check_finished(batch: FinishedBatch) -> FinishedBatch:
    """A FinishedBatch as the queue accepts it, or ValueError naming what is wrong."""
    if not isinstance(batch.batch_id, str) or not _BATCH_ID.match(batch.batch_id):
        raise ValueError(f"finished.batch_id: {str(batch.batch_id)[:48]!r} is not a batch id")
    if len(batch.group_ids) > DEFAULT_LIMITS.max_prompts:
        raise ValueError(
            f"finished.group_ids: {len(batch.group_ids)} ids, a batch has at most {DEFAULT_LIMITS.max_prompts}"
        )
    for gid in batch.group_ids:
        if not isinstance(gid, str) or not _GROUP_ID.match(gid):
            raise ValueError(f"finished.group_ids: {str(gid)[:48]!r} is not a group id")
    return batch


@dataclass(frozen=True)
class Delivery:
    """A rollout group handed to the learner, to be acknowledged after checkpointing."""

    delivery_id: str
    group: RolloutGroup


@dataclass(frozen=True)
class DeadLetter:
    """A prompt batch that could not be completed, kept for accounting and inspection."""

    entry_id: str
    source: str
    """`prompts` for a batch; `rollouts` or `unscored` for an unreadable group entry."""
    lease_id: str
    """The entry id the message had in its source stream (for a batch, its lease id)."""
    reason: str
    """`max_deliveries`, `malformed: ...` or `missing` (payload lost outside our control)."""
    deliveries: int
    last_worker: str
    batch: PromptBatch | None
    """None when the payload was unreadable or missing, or is not a prompt batch."""
    missing_groups: list[str] | None = None
    """For a batch: the group ids it still lacked (the prompts lost with it; the groups
    of its other prompts were stored and reach the learner). None when unknown."""
    group_id: str | None = None
    """For an unscored group the tier could not score or store: its group id."""
    batch_id: str | None = None
    """For an unscored group: the batch it answers."""


@dataclass(frozen=True)
class AuditTally:
    """The learner's audits of one worker's groups (`learner.audit`): how many passed and
    how many failed (one failure quarantines the worker)."""

    passed: int = 0
    failed: int = 0

    def __post_init__(self) -> None:
        if not (isinstance(self.passed, int) and isinstance(self.failed, int)) or min(self.passed, self.failed) < 0:
            raise ValueError(f"an audit tally counts with whole numbers from 0, got {self.passed}, {self.failed}")

    def __add__(self, other: AuditTally) -> AuditTally:
        return AuditTally(self.passed + other.passed, self.failed + other.failed)


@dataclass(frozen=True)
class AdapterEvent:
    event_id: str
    """Position in the adapter-events stream; pass it as `after` to continue."""
    manifest: AdapterManifest


@dataclass(frozen=True)
class StreamStats:
    length: int
    """Entries held (pending, undelivered and not yet trimmed)."""
    pending: int
    """Delivered, not yet acknowledged."""
    waiting: int
    """Not yet delivered to anyone."""
    oldest_waiting_s: float | None = None
    """Age of the oldest entry not yet delivered to anyone (None: none waits, or not
    reported): minutes here mean nobody reads the stream."""


@dataclass(frozen=True)
class QueueStats:
    prompts: StreamStats
    rollouts: StreamStats
    dead_letters: int
    leases_by_worker: dict[str, int] = field(default_factory=dict)
    """Outstanding prompt leases per worker id."""
    latest_adapter_version: int = 0
    unscored: StreamStats | None = None
    """Groups submitted for trusted scoring and not yet scored (None: not reported)."""
    prompts_waiting: int | None = None
    """Prompts issued whose groups are not in the queue yet (`Queue.prompts_waiting`; None: not counted)."""


class AdapterSubscription(abc.ABC):
    """Push notifications of new adapter versions. Best effort: a subscriber that was
    disconnected catches up from `Queue.adapter_events`."""

    @abc.abstractmethod
    def get(self, timeout_s: float) -> AdapterManifest | None:
        """The next announced manifest, or None if none came within the timeout."""

    @abc.abstractmethod
    def close(self) -> None: ...

    @property
    def gapless(self) -> bool:
        """Whether it now delivers every announcement, a reconnection included (a stream
        resumed from its last event id): a watcher then polls rarely. Pub/sub: never."""
        return False

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Queue(abc.ABC):
    """The queue between learner and actors. See the module docstring for semantics."""

    config: QueueConfig
    retried: bool = False
    """Whether the last call went through an outage, retried until it was answered (a
    transport that retries nothing itself raises `QueueUnavailable` instead)."""

    # -- learner: prompts out
    @abc.abstractmethod
    def add_prompts(self, batches: Sequence[PromptBatch]) -> int:
        """Queue batches; returns how many were new (a batch id seen before is skipped)."""

    # -- actors: leases
    @abc.abstractmethod
    def claim(self, worker: str, count: int = 1, block_s: float = 0.0) -> list[Lease]:
        """Up to `count` batches for `worker`: expired leases first, then new batches,
        waiting up to `block_s` for new ones if none are at hand."""

    @abc.abstractmethod
    def heartbeat(self, worker: str, lease_ids: Sequence[str]) -> list[str]:
        """Extend the worker's leases; returns the ids it still holds."""

    @abc.abstractmethod
    def submit(self, worker: str, lease_id: str, groups: Sequence[RolloutGroup]) -> SubmitResult:
        """Append some or all of the lease's rollout groups, atomically and checked
        against the lease; the call that completes the batch finishes the lease.
        Raises `LeaseLost`, `LeaseMismatch` or `SubmissionRejected` (nothing stored)."""

    @abc.abstractmethod
    def release(self, worker: str, lease_id: str) -> bool:
        """Hand a lease back unfinished so another worker claims it at once; the hand-back
        does not count as a failed delivery. False if the worker no longer held it."""

    # -- learner: rollouts in
    @abc.abstractmethod
    def read_rollouts(self, consumer: str, count: int, block_s: float = 0.0) -> list[Delivery]:
        """New rollout groups, up to `count`, waiting up to `block_s` for the first."""

    @abc.abstractmethod
    def pending_rollouts(self, consumer: str, count: int, after: str = "0") -> list[Delivery]:
        """Groups read by `consumer` and not yet acknowledged (after a restart), oldest
        first, starting after delivery id `after`."""

    @abc.abstractmethod
    def ack_rollouts(self, delivery_ids: Sequence[str], finished: Sequence[FinishedBatch] = ()) -> int:
        """Acknowledge consumed groups, and forget the deduplication records of the
        `finished` batches; returns how many groups were still pending."""

    @abc.abstractmethod
    def dead_letters(self, after: str = "0", count: int = 100) -> list[DeadLetter]:
        """Dead-lettered batches after position `after`, oldest first."""

    # -- adapters
    @abc.abstractmethod
    def announce(self, manifest: AdapterManifest) -> str:
        """Make `manifest` the latest adapter (key, pub/sub, events stream); returns the
        event id. Announcing the current latest again is a no-op returning its event id;
        any other version not above the latest raises `VersionConflict`."""

    @abc.abstractmethod
    def latest_adapter(self) -> AdapterManifest | None:
        """The newest announced adapter, or None before the first announcement."""

    @abc.abstractmethod
    def adapter_events(self, after: str = "0", count: int = 100, block_s: float = 0.0) -> list[AdapterEvent]:
        """Announcements after position `after` ("0": from the oldest kept)."""

    @abc.abstractmethod
    def subscribe_adapters(self) -> AdapterSubscription:
        """Push notifications of announcements made from now on."""

    @abc.abstractmethod
    def expire_run(self, ttl_s: float) -> int:
        """The run is over: its keys go after `ttl_s` seconds (late workers and a `--resume`
        within that time still find them). Returns how many keys there were."""

    def set_run_over(self, why: str) -> None:
        """The learner finished the run: claims are refused from now on with `RunOver` and
        `why` (its last word: the step and adapter it ended at), so workers stop. "" takes
        it back (a learner starting or resuming the run)."""
        raise NotImplementedError(f"{type(self).__name__} cannot end a run")

    def set_run_rewards(self, specs: Sequence[str]) -> None:
        """The learner says which reward functions (canonical `module:function=weight`)
        its run is scored with; a scoring worker with others refuses to start."""
        raise NotImplementedError(f"{type(self).__name__} keeps no run rewards")

    def run_rewards(self) -> list[str] | None:
        """What `set_run_rewards` said (None: the learner has not said yet)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no run rewards")

    def set_run_share(self, share: RunShare) -> None:
        """The run's weight and cap on a fleet that serves several runs (its learner or the
        admin says; workers follow within seconds)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no run share")

    def run_share(self) -> RunShare:
        """The run's weight and cap (weight 1, no cap where nobody said). Through a proxy,
        the one its last claim's answer carried: no call of its own."""
        return RunShare()

    # -- fleet status
    @abc.abstractmethod
    def report_status(self, status: WorkerStatus) -> None:
        """A worker's latest status (replaces its previous one)."""

    @abc.abstractmethod
    def leave(self, worker: str) -> bool:
        """A stopping worker's status goes now, where it would be listed until it aged out;
        False if it was not listed."""

    @abc.abstractmethod
    def workers(self, max_age_s: float = 120.0) -> list[WorkerStatus]:
        """Workers that reported within `max_age_s`, by name (older reports are forgotten)."""

    # -- quarantine (`learner.audit`)
    def quarantine(self, worker: str, reason: str) -> None:
        """The learner quarantines `worker` (its full name): its claims are refused with
        `WorkerQuarantined` and `reason` until the admin lifts it."""
        raise NotImplementedError(f"{type(self).__name__} keeps no quarantine")

    def quarantined(self) -> dict[str, str]:
        """Worker -> why, for every quarantined worker; a worker the admin lifted and the
        learner has not yet forgotten has "" (`forget_lifted`)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no quarantine")

    def lift_quarantine(self, worker: str) -> bool:
        """The admin lets `worker` claim again; False if it was not quarantined."""
        raise NotImplementedError(f"{type(self).__name__} keeps no quarantine")

    def forget_lifted(self, workers: Sequence[str]) -> None:
        """The learner has seen these lifts (it trains their groups again)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no quarantine")

    def record_audits(self, tallies: Mapping[str, AuditTally]) -> None:
        """The learner adds these audits (per worker, since it last recorded) to the run's."""
        raise NotImplementedError(f"{type(self).__name__} keeps no audits")

    def audits(self) -> dict[str, AuditTally]:
        """Every audited worker's tally in this run (learner restarts included)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no audits")

    # -- everyone
    @abc.abstractmethod
    def stats(self) -> QueueStats: ...

    def prompts_waiting(self) -> int | None:
        """The prompts issued whose groups are not in the queue yet, counted one by one
        (None: this transport cannot tell; `stats` counts batches)."""
        return None

    def stop_retrying(self) -> None:
        """From now on, fail fast instead of retrying through an outage (a process on
        its way out). Transports without retries of their own need do nothing."""
        return None

    @abc.abstractmethod
    def close(self) -> None: ...

    @property
    def gapless(self) -> bool:
        """Whether it now delivers every announcement, a reconnection included (a stream
        resumed from its last event id): a watcher then polls rarely. Pub/sub: never."""
        return False

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
