"""The wire protocol and the queue: the only package the learner, actors and proxy share.

Public API: the messages, `encode`/`decode` (MessagePack), `ProtocolError`, the
`Queue` interface and its Redis transport, `open_queue(url)`, and the object store
(`open_store(url)`).

`RedisQueue` is imported on first use (PEP 562), not with the package: a spot worker,
which reaches its queue through the proxy, never imports a Redis client.

Besides the protocol, three small modules every command uses live here because this is
the one package all parts share (the top-level layout is fixed): `logs` (one logging
set-up and its flags), `lifeline` (children of the embedded run end with it) and
`checks` (the preflight runner of `learner check` and `actors check`). None imports
more than the standard library.
"""

from typing import TYPE_CHECKING, Any

from protocol.codec import DEFAULT_LIMITS, Limits, decode, encode, from_json, to_json
from protocol.errors import (
    LeaseLost,
    LeaseMismatch,
    ProtocolError,
    QueueError,
    QueueForbidden,
    QueueRefused,
    QueueTLSError,
    QueueUnavailable,
    SubmissionRejected,
    VersionConflict,
)
from protocol.fingerprint import fingerprint_of_model, model_fingerprint
from protocol.keys import Keys
from protocol.messages import (
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
    SamplingParams,
    WorkerStatus,
    group_id_for,
    pack_f32,
    pack_i32,
    unpack_f32,
    unpack_i32,
)
from protocol.queue import (
    AdapterEvent,
    AdapterSubscription,
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
from protocol.store import FileStore, S3Store, Store, StoreError, StoreMissing, open_store
from protocol.urls import check_model_path, connect_queue, open_queue

if TYPE_CHECKING:
    from protocol.redis_queue import RedisQueue


def __getattr__(name: str) -> Any:
    if name == "RedisQueue":
        from protocol.redis_queue import RedisQueue

        return RedisQueue
    raise AttributeError(f"module 'protocol' has no attribute {name!r}")

__all__ = [
    "DEFAULT_LIMITS",
    "SCHEMA_VERSION",
    "AdapterEvent",
    "AdapterFile",
    "AdapterManifest",
    "AdapterSubscription",
    "ChatTurn",
    "Completion",
    "DeadLetter",
    "Delivery",
    "FileStore",
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
    "RedisQueue",
    "RolloutGroup",
    "S3Store",
    "SamplingParams",
    "Store",
    "StoreError",
    "StoreMissing",
    "StreamStats",
    "SubmissionRejected",
    "SubmitResult",
    "VersionConflict",
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
    "open_store",
    "pack_f32",
    "pack_i32",
    "to_json",
    "unpack_f32",
    "unpack_i32",
]
