"""Exceptions of the protocol package.

`ProtocolError` is the only exception `protocol.decode` raises, whatever the input.
Queue errors form their own small tree so callers can retry deliberately on
`QueueUnavailable` and treat everything else as a bug or bad input.
"""

from __future__ import annotations


class ProtocolError(ValueError):
    """A message is malformed, violates the schema or exceeds a size limit."""


class QueueError(RuntimeError):
    """Base class of the queue's errors."""


class QueueUnavailable(QueueError, ConnectionError):
    """The queue's backend could not be reached; retrying later is the right answer."""


class QueueRefused(QueueError):
    """The queue refused the call for good: retrying the same call cannot succeed.
    Subclasses say why; `code` names the kind on the wire (the proxy's error bodies)."""

    code = "refused"


class QueueForbidden(QueueRefused, PermissionError):
    """The token was refused (401) or its role may not do this (403)."""

    code = "forbidden"


class QueueTLSError(QueueRefused, ConnectionError):
    """The server's certificate did not verify against the CA: a configuration error,
    never an outage, so it is not retried."""

    code = "tls"


class LeaseMismatch(QueueRefused, ValueError):
    """Rollout groups were submitted against a lease for a different prompt batch."""

    code = "lease_mismatch"


class LeaseLost(QueueRefused, LookupError):
    """The lease named is not this worker's: it never existed, is finished or
    dead-lettered, is not claimed, or is held by another worker. Nothing was stored."""

    code = "lease_lost"


class SubmissionRejected(QueueRefused, ValueError):
    """Rollout groups do not answer their lease's batch (a prompt not in the batch, a
    group twice, the wrong number of completions, a completion over max_tokens, prompt
    tokens other than the issued ones). The whole submission was refused."""

    code = "submission_rejected"


class VersionConflict(QueueRefused, ValueError):
    """An adapter version was announced that does not move the latest version forward."""

    code = "version_conflict"


class TooManyWorkers(QueueRefused):
    """A status report from a worker new to its token, while the token already has as
    many live workers as the proxy allows (`--max-workers-per-token`)."""

    code = "too_many_workers"


class WorkerQuarantined(QueueForbidden):
    """A claim from a worker the learner quarantined (a failed audit or adapter digest,
    `learner.audit`); the message says why. Lifted only by the admin
    (`proxy quarantine --lift`)."""

    code = "quarantined"


class RunOver(QueueRefused):
    """A claim in a run whose learner has finished it (`Queue.set_run_over`): nothing
    more will be issued or trained. The message is the learner's (the step and adapter it
    ended at); a worker stops with exit status 0. A quarantined worker is told that
    instead (`WorkerQuarantined`)."""

    code = "run_over"


class QueueNotFound(QueueError, LookupError):
    """The proxy has no such thing (404): an adapter version that does not exist."""


REFUSALS: dict[str, type[QueueRefused]] = {
    cls.code: cls
    for cls in (
        QueueForbidden,
        QueueTLSError,
        LeaseMismatch,
        LeaseLost,
        SubmissionRejected,
        VersionConflict,
        TooManyWorkers,
        WorkerQuarantined,
        RunOver,
    )
}
"""Refusals by their wire code, so the HTTPS client raises what the proxy's queue raised."""

REFUSAL_STATUS: dict[type[QueueRefused], int] = {
    QueueForbidden: 403,
    WorkerQuarantined: 403,
    SubmissionRejected: 422,
    LeaseLost: 409,
    LeaseMismatch: 409,
    VersionConflict: 409,
    TooManyWorkers: 409,
    RunOver: 410,
}
"""The HTTP status each refusal travels as (its `code` goes in the body); 409 for any other."""


def status_of(err: QueueRefused) -> int:
    """The proxy's side: the status of a refusal."""
    return REFUSAL_STATUS.get(type(err), 409)


def from_response(status: int, code: str, message: str, where: str) -> QueueError | ProtocolError:
    """The client's side: the exception an error answer stands for. The body's `code`
    names a refusal exactly; otherwise the status decides (bad input is a ProtocolError,
    as the queue itself raises it)."""
    if code == WorkerQuarantined.code:
        return WorkerQuarantined(message)
    if status in (401, 403):
        return QueueForbidden(f"{status} {where}: {message}")
    if code in REFUSALS:
        return REFUSALS[code](message)
    if status in (400, 413, 415, 422):
        return ProtocolError(message)
    if status == 409:
        return VersionConflict(message) if "announce" in where else LeaseMismatch(message)
    if status == 404:
        return QueueNotFound(f"404 {where}: {message}")
    return QueueError(f"{status} {where}: {message}")
