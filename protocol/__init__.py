"""The wire protocol and the queue: the only package the learner, actors and proxy share.

Public API: the messages, `encode`/`decode` (MessagePack), `ProtocolError`, the
`Queue` interface and its Redis transport, `open_queue(url)`, and the object store
(`open_store(url)`).
"""

from protocol.errors import (
    LeaseMismatch,
    ProtocolError,
    QueueError,
    QueueUnavailable,
    VersionConflict,
)
from protocol.keys import Keys
from protocol.messages import (
    DEFAULT_LIMITS,
    SCHEMA_VERSION,
    AdapterFile,
    AdapterManifest,
    ChatTurn,
    Completion,
    Limits,
    Message,
    Prompt,
    PromptBatch,
    RolloutGroup,
    SamplingParams,
    decode,
    encode,
    from_json,
    group_id_for,
    pack_f32,
    pack_i32,
    to_json,
    unpack_f32,
    unpack_i32,
)
from protocol.queue import (
    AdapterEvent,
    AdapterSubscription,
    DeadLetter,
    Delivery,
    Lease,
    Queue,
    QueueConfig,
    QueueStats,
    StreamStats,
    SubmitResult,
)
from protocol.redis_queue import RedisQueue
from protocol.store import FileStore, S3Store, Store, StoreError, StoreMissing, open_store
from protocol.urls import open_queue

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
    "Keys",
    "Lease",
    "LeaseMismatch",
    "Limits",
    "Message",
    "Prompt",
    "PromptBatch",
    "ProtocolError",
    "Queue",
    "QueueConfig",
    "QueueError",
    "QueueStats",
    "QueueUnavailable",
    "RedisQueue",
    "RolloutGroup",
    "S3Store",
    "SamplingParams",
    "Store",
    "StoreError",
    "StoreMissing",
    "StreamStats",
    "SubmitResult",
    "VersionConflict",
    "decode",
    "encode",
    "from_json",
    "group_id_for",
    "open_queue",
    "open_store",
    "pack_f32",
    "pack_i32",
    "to_json",
    "unpack_f32",
    "unpack_i32",
]
