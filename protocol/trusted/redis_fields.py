"""How the queue's messages sit in Redis: the fields of stream entries, a batch's
expected groups and its private part, stored payloads decoded back, and the checks on
worker names and entry ids every call makes. Shared by `RedisQueue` and the scoring
tier's `ScoringQueue`."""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Sequence
from typing import TypeVar

import msgspec

from protocol.client.queue import is_entry_id
from protocol.wire.codec import DEFAULT_LIMITS, Limits, decode, decode_each
from protocol.wire.errors import ProtocolError
from protocol.wire.messages import (
    AdapterManifest,
    PrivatePrompt,
    PromptBatch,
    RolloutGroup,
    WorkerStatus,
    group_id_for,
)
from protocol.wire.text import UNSAFE

log = logging.getLogger(__name__)

M = TypeVar("M", PromptBatch, RolloutGroup, AdapterManifest, WorkerStatus)
_WORKER = re.compile(f"^[^\\x20{UNSAFE}]{{1,256}}$")


def check_worker(worker: str) -> None:
    if not isinstance(worker, str) or not _WORKER.match(worker):
        raise ValueError(f"worker: {worker!r} must be 1-256 characters without spaces or control characters")


_SHORT_IDS = re.compile(r"[0-9]{1,19}-[0-9]{1,19}(?: [0-9]{1,19}-[0-9]{1,19})*")
"""Entry ids joined by spaces, each part short enough to fit in 64 bits: all of them, in
one match (`is_entry_id` of each costs an acknowledgement of 16 groups ~12 us)."""


def check_ids(field: str, ids: Sequence[str]) -> None:
    if ids and all(type(i) is str for i in ids):
        joined = " ".join(ids)
        if joined.count(" ") == len(ids) - 1 and _SHORT_IDS.fullmatch(joined):  # no id holds a space
            return
    for i in ids:
        if not is_entry_id(i):
            raise ValueError(f"{field}: {str(i)[:48]!r} is not a stream entry id")


_NO_TOKENS = "-" * 16
"""The digest of a prompt the learner sent without token ids (the actor tokenizes)."""


def prompt_digest(token_ids: bytes | None) -> str:
    """16 hex characters naming a prompt's packed token ids, as SUBMIT compares them."""
    return _NO_TOKENS if token_ids is None else hashlib.blake2b(token_ids, digest_size=8).hexdigest()


def expected_groups(b: PromptBatch) -> str:
    """The batch's `g` field: "<group id>:<prompt digest>;" per prompt."""
    return "".join(f"{group_id_for(b.batch_id, p.id)}:{prompt_digest(p.token_ids)};" for p in b.prompts)


def split_private(b: PromptBatch) -> tuple[PromptBatch, dict[str, bytes]]:
    """A batch as the actors may see it, and what stays on the trusted side. A batch
    scored by the actors travels whole. A trusted-scoring batch loses its prompts'
    dataset columns, which are kept per group id (the full `Prompt` and the batch's
    episode rules, a `PrivatePrompt` in MessagePack) for the scoring tier."""
    if b.scoring != "trusted":
        return b, {}
    private = {
        group_id_for(b.batch_id, p.id): msgspec.msgpack.encode(
            PrivatePrompt(prompt=p, tools=b.tools, max_tool_calling_iterations=b.max_tool_calling_iterations)
        )
        for p in b.prompts
    }
    public = msgspec.structs.replace(b, prompts=[msgspec.structs.replace(p, columns={}) for p in b.prompts])
    return public, private


def text_of(value: bytes | str | None) -> str:
    return value.decode() if isinstance(value, bytes) else (value or "")


def fields_of(flat: dict[bytes, bytes] | None) -> dict[str, bytes]:
    return {text_of(k): v for k, v in (flat or {}).items()}


def decode_as(payload: bytes | None, cls: type[M], limits: Limits = DEFAULT_LIMITS) -> M:
    """Decode a stored payload that must be a `cls`; `ProtocolError` otherwise."""
    return _as(cls, None if payload is None else decode(payload, limits))


def decode_each_as(
    payloads: Sequence[bytes | None], cls: type[M], limits: Limits = DEFAULT_LIMITS
) -> list[M | ProtocolError]:
    """`decode_as` of each stored payload, in order, each one's `ProtocolError` in its place
    (`protocol.wire.codec.decode_each`: a read's rollout groups have their arrays checked together)."""
    decoded = iter(decode_each([p for p in payloads if p is not None], limits))
    out: list[M | ProtocolError] = []
    for p in payloads:
        msg = None if p is None else next(decoded)
        try:
            out.append(msg if isinstance(msg, ProtocolError) else _as(cls, msg))
        except ProtocolError as err:
            out.append(err)
    return out


def _as(cls: type[M], msg: object) -> M:
    """`msg` (None: the entry had no payload) if it is a `cls`; `ProtocolError` otherwise."""
    if msg is None:
        raise ProtocolError("message: entry payload is missing")
    if not isinstance(msg, cls):
        raise ProtocolError(f"message: expected {cls.__name__}, got {type(msg).__name__}")
    return msg


def decode_manifest(payload: bytes | None) -> AdapterManifest | None:
    try:
        return decode_as(payload, AdapterManifest)
    except ProtocolError as err:
        log.error("ignoring an unreadable adapter announcement: %s", err)
        return None
