"""The wire codec: messages to and from MessagePack (and JSON for files a person reads),
validated on the way in and out, within size limits.

- `decode` raises `ProtocolError` (a `ValueError`) and nothing else, whatever bytes it is
  given; the message names the offending field.
- Sizes are bounded twice: by `Limits.max_message_bytes` before parsing (so a hostile
  length prefix cannot make the parser allocate more than the input) and by the per-field
  limits after.
- A message that would be rejected on decode is also rejected on `encode`, so a bad
  message is caught where it was made.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Sequence

import msgspec

from protocol.wire.arrays import check_groups_arrays, deferred_group_arrays
from protocol.wire.errors import ProtocolError
from protocol.wire.messages import (
    SCHEMA_VERSION,
    TAGS,
    AdapterManifest,
    Message,
    NonNegInt,
    PosInt,
    PromptBatch,
    RolloutGroup,
    WorkerStatus,
    check_schema,
)

# ---------------------------------------------------------------------------- limits


class Limits(msgspec.Struct, frozen=True, kw_only=True):
    """Size limits a receiver enforces; a proxy facing the internet may lower them."""

    max_message_bytes: PosInt = 16 * 1024 * 1024
    """Largest encoded message accepted, checked before parsing."""
    max_prompts: PosInt = 4096
    """Most prompts in one batch."""
    max_completions: PosInt = 1024
    """Most completions in one rollout group."""
    max_tokens: PosInt = 262_144
    """Most tokens in one prompt or completion."""
    max_text_chars: PosInt = 4 * 1024 * 1024
    """Longest prompt or completion text."""
    scoring_room_bytes: NonNegInt = 64 * 1024
    """Room a submitted group leaves under `max_message_bytes` for what the trusted side
    adds to it (the scorer's name, its timings, the group's error), plus
    `scoring_room_per_completion` for each completion (its reward, a score per reward
    function, a short error): a group an actor can submit is a group the tier can store."""
    scoring_room_per_completion: NonNegInt = 1024

    def submit_limit(self, completions: int) -> int:
        """The largest encoded group of `completions` completions an actor may submit."""
        return self.max_message_bytes - self.scoring_room_bytes - self.scoring_room_per_completion * completions


DEFAULT_LIMITS = Limits()


def same_bounds(a: Limits, b: Limits) -> bool:
    """The same bounds on a message's fields (its size aside: a proxy reads bodies of its own size)."""
    return msgspec.structs.replace(a, max_message_bytes=0) == msgspec.structs.replace(b, max_message_bytes=0)


_CHECKED = object()
"""What only the decoder of a submission holds (`protocol.client.http.decode_submit`)."""


class CheckedGroups(Sequence[RolloutGroup]):
    """Rollout groups as the decoder validated them against `limits`, and since then at most
    named after one worker (`named`, what a proxy does): a queue whose limits bound the same
    fields stores them without validating them again. Only the decoder of a submission
    makes one (`protocol.client.http.decode_submit`); any other sequence of groups is
    validated when it is encoded."""

    __slots__ = ("_groups", "limits")

    def __init__(self, groups: Sequence[RolloutGroup], limits: Limits, made_by: object) -> None:
        if made_by is not _CHECKED:
            raise TypeError("CheckedGroups come from decoding a submission (protocol.client.http.decode_submit)")
        self._groups, self.limits = tuple(groups), limits

    def __len__(self) -> int:
        return len(self._groups)

    def __getitem__(self, i: int) -> RolloutGroup:  # type: ignore[override]  # no slices
        return self._groups[i]

    def __iter__(self) -> Iterator[RolloutGroup]:
        return iter(self._groups)

    def named(self, worker: str) -> CheckedGroups:
        """The same groups, each with `actor_id` `worker` (a proxy names a worker after its token)."""
        groups = [g if g.actor_id == worker else msgspec.structs.replace(g, actor_id=worker) for g in self._groups]
        return CheckedGroups(groups, self.limits, _CHECKED)

    def trusted_by(self, limits: Limits) -> bool:
        """Validated within the same field bounds as `limits` (`same_bounds`)."""
        return same_bounds(self.limits, limits)


def _check_limits(msg: Message, limits: Limits, size: int) -> None:
    """`msg`'s fields within `limits`; `size`: the bytes it was decoded from (a field
    can be no longer than they are)."""
    if isinstance(msg, RolloutGroup):
        _check_group_limits(msg, limits, size)
        return
    if isinstance(msg, PromptBatch):
        if len(msg.prompts) > limits.max_prompts:
            raise ProtocolError(f"prompts: {len(msg.prompts)} prompts exceed the limit of {limits.max_prompts}")
        if msg.num_generations > limits.max_completions:
            raise ProtocolError(f"num_generations: {msg.num_generations} exceeds the limit of {limits.max_completions}")
        if msg.sampling.max_tokens > limits.max_tokens:
            raise ProtocolError(f"sampling.max_tokens: exceeds the limit of {limits.max_tokens}")
        for i, p in enumerate(msg.prompts):
            _check_tokens(f"prompts[{i}].token_ids", p.token_ids, limits)
            _check_text(f"prompts[{i}].text", p.text, limits)
            for j, turn in enumerate(p.messages or ()):
                _check_text(f"prompts[{i}].messages[{j}].content", turn.content, limits)


def _check_group_limits(msg: RolloutGroup, limits: Limits, size: int) -> None:
    """Every group a learner reads passes here: nothing to look at when the message is
    shorter than the shortest field that could break a limit (a string of n characters
    takes at least n bytes), else the longest first, then the culprit named."""
    if len(msg.completions) > limits.max_completions:
        raise ProtocolError(
            f"completions: {len(msg.completions)} completions exceed the limit of {limits.max_completions}"
        )
    most_bytes = (limits.max_tokens + 1) * 4 - 1  # `_check_tokens` refuses from (max_tokens + 1) * 4
    if size <= most_bytes and size <= limits.max_text_chars:
        return
    if (
        len(msg.prompt_token_ids) > most_bytes
        or max([len(c.token_ids) for c in msg.completions], default=0) > most_bytes
        or max([len(c.text) for c in msg.completions], default=0) > limits.max_text_chars
    ):
        _check_tokens("prompt_token_ids", msg.prompt_token_ids, limits)
        for i, c in enumerate(msg.completions):
            _check_tokens(f"completions[{i}].token_ids", c.token_ids, limits)
            _check_text(f"completions[{i}].text", c.text, limits)


def _check_tokens(field: str, data: bytes | None, limits: Limits) -> None:
    if data is not None and len(data) // 4 > limits.max_tokens:
        raise ProtocolError(f"{field}: {len(data) // 4} tokens exceed the limit of {limits.max_tokens}")


def _check_text(field: str, value: str | None, limits: Limits) -> None:
    if value is not None and len(value) > limits.max_text_chars:
        raise ProtocolError(f"{field}: {len(value)} characters exceed the limit of {limits.max_text_chars}")


# ---------------------------------------------------------------------------- codec


class _Envelope(msgspec.Struct):
    """Read first, so an unknown schema version gets its own message rather than a
    confusing complaint about fields."""

    type: str
    schema: int


_ENVELOPE = msgspec.msgpack.Decoder(_Envelope)
_DECODER = msgspec.msgpack.Decoder(Message)
_ENCODER = msgspec.msgpack.Encoder()
_JSON_ENCODER = msgspec.json.Encoder()
_JSON_DECODER = msgspec.json.Decoder(Message)


def _field_path(err: msgspec.MsgspecError) -> str:
    """Rewrite msgspec's "... - at `$.a[0].b`" as "a[0].b: ..." so the field leads."""
    text = str(err)
    m = re.match(r"^(.*) - at `\$\.?(.*)`$", text, re.S)
    path, detail = (m.group(2), m.group(1)) if m else ("", text)
    if _LEADS_WITH_FIELD.match(detail):  # our own checks already name their field
        return f"{path}.{detail}" if path else detail
    return f"{path or 'message'}: {detail}"


_LEADS_WITH_FIELD = re.compile(r"^[A-Za-z_][\w\[\]'.]*: ")


_KNOWN_ENVELOPES = tuple(
    _ENCODER.encode("type") + _ENCODER.encode(tag) + _ENCODER.encode("schema") + _ENCODER.encode(SCHEMA_VERSION)
    for tag in TAGS
)


def _known_envelope(data: bytes | bytearray | memoryview) -> bool:
    """The message's map opens with a known `type` and this build's `schema`, as every
    message this codec encodes does: then the envelope need not be decoded on its own (a
    second pass over the whole message, ~7% of a group's decode)."""
    head = data[0] if len(data) else 0
    start = 1 if 0x80 <= head <= 0x8F else 3 if head == 0xDE else 0
    if not start:
        return False
    if isinstance(data, memoryview):
        return bytes(data[start : start + 48]).startswith(_KNOWN_ENVELOPES)
    return data.startswith(_KNOWN_ENVELOPES, start)


def decode(data: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS) -> Message:
    """Parse and validate one message. Raises `ProtocolError` (only) on bad input."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise ProtocolError(f"message: expected bytes, got {type(data).__name__}")
    if len(data) > limits.max_message_bytes:
        raise ProtocolError(f"message: {len(data)} bytes exceed the limit of {limits.max_message_bytes}")
    try:  # inline, not `_as_protocol_error`: a context manager costs a group's decode ~6%
        if not _known_envelope(data):
            envelope = _ENVELOPE.decode(data)
            if envelope.type not in TAGS:
                raise ProtocolError(f"type: unknown message type {envelope.type[:64]!r}")
            check_schema(envelope.schema)
        msg = _DECODER.decode(data)
    except (msgspec.MsgspecError, RecursionError) as err:
        raise _translated(err) from None
    _check_limits(msg, limits, len(data))
    return msg


def decode_each(
    payloads: Sequence[bytes | bytearray | memoryview], limits: Limits = DEFAULT_LIMITS
) -> list[Message | ProtocolError]:
    """`decode` of each payload, in order: the message, or what is wrong with that payload
    as a `ProtocolError` in its place. The rollout groups' arrays are checked together,
    one pass for all (`check_groups_arrays`)."""
    out: list[Message | ProtocolError] = []
    token = deferred_group_arrays.set(True)
    try:
        for data in payloads:
            try:
                out.append(decode(data, limits))
            except ProtocolError as err:
                out.append(err)
    finally:
        deferred_group_arrays.reset(token)
    groups = [(i, m) for i, m in enumerate(out) if isinstance(m, RolloutGroup)]
    if groups:
        for (i, _group), problem in zip(groups, check_groups_arrays([g for _i, g in groups]), strict=True):
            if problem is not None:
                out[i] = problem
    return out


@contextlib.contextmanager
def _as_protocol_error() -> Iterator[None]:
    """What msgspec raises on bad input (and Python on input nested too deeply) as
    `ProtocolError`, naming the field; a `ProtocolError` passes as it is."""
    try:
        yield
    except (msgspec.MsgspecError, RecursionError) as err:
        raise _translated(err) from None


def _translated(err: msgspec.MsgspecError | RecursionError) -> ProtocolError:
    if isinstance(err, RecursionError):
        return ProtocolError("message: nested too deeply")
    return ProtocolError(_field_path(err))


def encode(msg: Message, limits: Limits = DEFAULT_LIMITS, *, validate: bool = True) -> bytes:
    """Serialize one message to MessagePack, validated exactly as `decode` would.
    `validate=False` only for a message that came out of `decode` with these limits."""
    if not isinstance(msg, PromptBatch | RolloutGroup | AdapterManifest | WorkerStatus):
        raise ProtocolError(f"message: cannot encode {type(msg).__name__}")
    try:
        data = _ENCODER.encode(msg)
    except (TypeError, ValueError, OverflowError) as err:
        raise ProtocolError(f"message: cannot encode: {err}") from None
    if validate:
        decode(data, limits)  # field bounds are only enforced when decoding
    return data


def to_json(msg: Message) -> bytes:
    """JSON for files a person may read (manifest.json); bytes fields become base64."""
    encode(msg)
    return _JSON_ENCODER.encode(msg)


def from_json(data: bytes | str) -> Message:
    """Parse a message written by `to_json`. Raises `ProtocolError` on bad input."""
    with _as_protocol_error():
        return _JSON_DECODER.decode(data)
