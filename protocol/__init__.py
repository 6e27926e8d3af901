"""The wire protocol: the only package the learner, actors and proxy share.

It is split by who may run it (DESIGN.md, "The tree shows the trust boundary"; the
import contracts in pyproject.toml, checked by `make lint`, hold it there):

- `protocol.wire`: the messages and their MessagePack codec, errors, key names and the
  adapter files' layout and digests. msgspec and numpy only.
- `protocol.client`: the `Queue` interface, the HTTP API's table and the workers' HTTPS
  client (`HttpQueue`, `open_queue`). What a worker anywhere runs.
- `protocol.trusted`: the Redis implementation of the queue, the scoring tier's queue
  and the object store's writers. Only the learner, its tier and the proxy import it;
  only it imports `redis` or `rq`.
- `protocol.usercode`: loading user code (rewards, tools, environments, chat
  templates), the episode transcript, and the built-in tasks and rewards both tiers run.
- `protocol.util`: logging, the lifeline, the preflight runner, retries, paths, the
  model fingerprint. The standard library, transformers' config at most.

This module re-exports what every part uses: the messages, `encode`/`decode`,
`ProtocolError` and the queue errors, the `Queue` interface, and the worker's
`open_queue`/`connect_queue` (https:// only). The trusted side's `RedisQueue`,
`open_store` and Redis-capable `open_queue` are `protocol.trusted`'s.
"""

from protocol.client.queue import (
    AdapterEvent,
    AdapterSubscription,
    AuditTally,
    DeadLetter,
    Delivery,
    FinishedBatch,
    Lease,
    Queue,
    QueueConfig,
    QueueStats,
    StreamStats,
    SubmitResult,
    is_entry_id,
)
from protocol.client.urls import connect_queue, open_queue
from protocol.util.fingerprint import fingerprint_of_model, model_fingerprint
from protocol.util.paths import check_model_path
from protocol.wire.codec import DEFAULT_LIMITS, Limits, decode, encode, from_json, to_json
from protocol.wire.errors import (
    LeaseLost,
    LeaseMismatch,
    ProtocolError,
    QueueError,
    QueueForbidden,
    QueueRefused,
    QueueTLSError,
    QueueUnavailable,
    RunOver,
    SubmissionRejected,
    VersionConflict,
    WorkerQuarantined,
)
from protocol.wire.files import StoreError, StoreMissing
from protocol.wire.keys import Keys
from protocol.wire.messages import (
    SCHEMA_VERSION,
    AdapterFile,
    AdapterManifest,
    ChatTurn,
    Completion,
    Message,
    Progress,
    Prompt,
    PromptBatch,
    RolloutGroup,
    RunShare,
    SamplingParams,
    WorkerStatus,
    group_id_for,
)
from protocol.wire.packing import pack_f32, pack_i32, unpack_f32, unpack_i32

__all__ = [
    "DEFAULT_LIMITS",
    "SCHEMA_VERSION",
    "AdapterEvent",
    "AdapterFile",
    "AdapterManifest",
    "AdapterSubscription",
    "AuditTally",
    "ChatTurn",
    "Completion",
    "DeadLetter",
    "Delivery",
    "FinishedBatch",
    "Keys",
    "Lease",
    "LeaseLost",
    "LeaseMismatch",
    "Limits",
    "Message",
    "Progress",
    "Prompt",
    "PromptBatch",
    "ProtocolError",
    "Queue",
    "QueueConfig",
    "QueueError",
    "QueueForbidden",
    "QueueRefused",
    "QueueStats",
    "QueueTLSError",
    "QueueUnavailable",
    "RolloutGroup",
    "RunOver",
    "RunShare",
    "SamplingParams",
    "StoreError",
    "StoreMissing",
    "StreamStats",
    "SubmissionRejected",
    "SubmitResult",
    "VersionConflict",
    "WorkerQuarantined",
    "WorkerStatus",
    "check_model_path",
    "connect_queue",
    "decode",
    "encode",
    "fingerprint_of_model",
    "from_json",
    "group_id_for",
    "is_entry_id",
    "model_fingerprint",
    "open_queue",
    "pack_f32",
    "pack_i32",
    "to_json",
    "unpack_f32",
    "unpack_i32",
]
