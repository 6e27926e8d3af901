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


class LeaseMismatch(QueueError, ValueError):
    """Rollout groups were submitted against a lease for a different prompt batch."""


class VersionConflict(QueueError, ValueError):
    """An adapter version was announced that does not move the latest version forward."""
