"""The messages that cross the network: prompt batches, rollout groups, adapter manifests.

Every message is a frozen, typed struct carrying a `schema` version and a `type` tag.
On the wire they are MessagePack (`protocol.wire.codec`: decoded within size limits, raising
`ProtocolError` and nothing else); token ids and log-probabilities travel as packed
little-endian int32 / float32 byte strings, never as lists of Python numbers. Each struct
checks its own fields when built, so a bad message is caught where it is made.
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Any, Literal

import msgspec
import numpy as np

from protocol.wire.arrays import check_group_arrays, check_group_versions, deferred_group_arrays
from protocol.wire.errors import ProtocolError
from protocol.wire.packing import (
    F32_MAX,
    all_f32,
    all_finite,
    check_f32,
    check_finite,
    check_json_like,
    check_token_ids,
    check_whole_i32,
    pack_f32,
    pack_i32,
    unpack_f32,
    unpack_i32,
)
from protocol.wire.text import SAFE_LINE, SAFE_NAME

SCHEMA_VERSION = 4
"""Bumped on any incompatible change; decoders refuse versions they do not know.
2: episodes (a completion's `mask`, `turns`, `tool_calls`, `tool_errors`; a batch's `tools`).
3: a group's `adapter_digest`, the proof of the adapter it was generated with.
4: in-flight adapter updates (a completion's `versions`, a group's `later_digests`)."""

MAX_GROUP_VERSIONS = 64  # most adapter versions one group may span (its `later_digests`)

MAX_LOGGED_METRICS = 16
"""Most `log_metric` names one group may carry."""
MAX_EXTRA_COLUMNS = 8
"""Most `log_extra` columns one completion may carry."""
MAX_EXTRA_CHARS = 300
"""Longest `log_extra` value a completion may carry (the scorer cuts longer ones)."""

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PosInt = Annotated[int, msgspec.Meta(ge=1)]
Ident = Annotated[str, msgspec.Meta(min_length=1, max_length=256, pattern=SAFE_NAME)]
"""An identifier: 1-256 characters, none of them a control or text-reordering character
(`protocol.wire.text`): identifiers are logged and shown."""
Label = Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=SAFE_NAME)]
"""A short name an actor may write (a reward function, a timing, an engine): becomes a
metric key or a label, so safe characters only."""
OneLine = Annotated[str, msgspec.Meta(max_length=2000, pattern=SAFE_LINE)]
"""An error or note an actor may write: one line of safe characters (`protocol.wire.text.printable`
makes one from any text)."""
Timestamp = Annotated[float, msgspec.Meta(ge=0.0, le=1e11)]
"""Seconds since the epoch."""

FileName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")]
"""A plain file name: no directory part, no leading dot, so it can never escape its folder."""
Sha256Hex = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{64}$")]


# ---------------------------------------------------------------------------- messages


class _Struct(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pass


class SamplingParams(_Struct, frozen=True):
    """How an actor samples completions. Log-probabilities are reported under this
    (temperature-scaled, top-p/top-k truncated) distribution."""

    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=100.0)] = 1.0
    """0 means greedy decoding."""
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    top_k: NonNegInt = 0
    """0 disables top-k."""
    min_p: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.0
    """Drop tokens less likely than min_p times the likeliest; 0 disables it."""
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0.0, le=10.0)] = 1.0
    """Divide the logits of tokens already in the prompt or completion (1: off), as in
    Hugging Face and vLLM."""
    max_tokens: PosInt = 256
    """Most tokens generated per completion."""
    stop: list[str] = []
    """Extra stop strings; the tokenizer's end-of-sequence token always stops."""
    seed: int | None = None
    """None: the actor picks its own seed."""

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
            check_finite(name, getattr(self, name))


class ChatTurn(_Struct, frozen=True):
    """One turn of a chat prompt, as TRL's conversational datasets have them."""

    role: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    content: str


class Progress(_Struct, frozen=True):
    """Where training stood when the learner issued a prompt: what a TRL reward function
    reads from its `trainer_state` (`global_step`, `max_steps`, `epoch`)."""

    global_step: NonNegInt
    max_steps: NonNegInt
    epoch: Annotated[float, msgspec.Meta(ge=0.0, le=1e9)]


class Prompt(_Struct, frozen=True):
    """One dataset row to be completed `num_generations` times."""

    id: Ident
    """Unique within its batch; with the batch id it names the rollout group."""
    text: str | None = None
    """Plain-text prompt; None when the prompt is a chat or only token ids."""
    messages: list[ChatTurn] | None = None
    """Chat prompt, to be rendered with the tokenizer's chat template; None if plain."""
    token_ids: bytes | None = None
    """Packed <i4 prompt tokens, authoritative when present; None: the actor tokenizes."""
    columns: dict[str, Any] = {}
    """Other dataset columns, passed to reward functions as keyword arguments."""
    progress: Progress | None = None
    """The learner's step when it issued the prompt (reward functions' `trainer_state`);
    None: not known (an evaluation, a hand-made batch)."""

    def __post_init__(self) -> None:
        if self.text is None and self.messages is None and self.token_ids is None:
            raise ProtocolError(f"prompt {self.id!r}: one of text, messages or token_ids is required")
        if self.token_ids is not None:
            check_token_ids("token_ids", self.token_ids)
        check_json_like("columns", self.columns, depth=0)


class PromptBatch(_Struct, frozen=True, tag="prompt_batch", tag_field="type", kw_only=True):
    """Prompts the learner hands to the actors; an actor claims one batch as a lease."""

    schema: int = SCHEMA_VERSION
    batch_id: Ident
    """Unique per run and deterministic from the data cursor, so re-issuing is idempotent."""
    prompts: Annotated[list[Prompt], msgspec.Meta(min_length=1)]
    num_generations: PosInt
    """Completions to sample per prompt (the GRPO group size)."""
    sampling: SamplingParams = SamplingParams()
    learner_version: NonNegInt
    """The newest adapter version the learner had announced when it issued the batch."""
    issued_at: Timestamp
    pinned_version: NonNegInt | None = None
    """Generate with exactly this adapter version (an evaluation; 0 is the base model);
    None: with the newest the actor has, as for training."""
    tools: Annotated[list[Label], msgspec.Meta(max_length=64)] = []
    """Episodes: the tools (`--tools`, `--environment`) each completion may call, by name,
    which the actor must have; the prompt tokens already offer them to the model. Empty:
    one completion per sample, no tool calls."""
    environment: Label | None = None
    """Episodes: the class name of the environment (`--environment`) whose methods are among
    `tools`, one instance per episode, which the actor must have; None: none."""
    max_tool_calling_iterations: NonNegInt | None = None
    """Most tool-calling turns per episode (None: until `sampling.max_tokens`, which
    bounds the whole episode)."""
    model: Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{16,64}$")] | None = None
    """`model_fingerprint` of the learner's base model: a worker serving several runs
    generates only for those whose base model is its own (None: a learner that does not
    say, taken as the worker's)."""
    scoring: Literal["actors", "trusted"] = "actors"
    """Who scores the groups. `actors`: the worker, with its reward functions. `trusted`:
    the scoring tier on the trusted side; the worker only generates, its prompts carry
    no dataset columns, and its submission goes to a stream only the tier reads."""

    def __post_init__(self) -> None:
        check_schema(self.schema)
        ids = [p.id for p in self.prompts]
        if len(set(ids)) != len(ids):
            raise ProtocolError("prompts: prompt ids must be unique within a batch")


class PrivatePrompt(_Struct, frozen=True):
    """What the trusted side keeps of an issued prompt for the scoring tier (never sent to
    an actor): the prompt with every dataset column, and its batch's episode rules, which
    the tier checks each episode's mask against (`protocol.usercode.transcript`)."""

    prompt: Prompt
    tools: Annotated[list[Label], msgspec.Meta(max_length=64)] = []
    """The batch's tools; empty: its completions are single turns and carry no mask."""
    max_tool_calling_iterations: NonNegInt | None = None


FinishReason = Literal["stop", "length", "abort"]


class Completion(_Struct, frozen=True):
    """One sampled completion with what the learner needs to train on it."""

    token_ids: bytes
    """Packed <i4 generated tokens (the prompt excluded)."""
    logprobs: bytes
    """Packed <f4 log-probability of each sampled token under the distribution it was
    sampled from (after temperature and top-p/top-k); same length as token_ids."""
    finish_reason: FinishReason
    """stop: end-of-sequence or a stop string; length: hit max_tokens; abort: cut short."""
    text: str = ""
    """Decoded completion, as the reward functions saw it."""
    reward: float | None = None
    """Weighted total reward; None when no reward could be computed (see error)."""
    reward_components: Annotated[dict[Label, float | None], msgspec.Meta(max_length=64)] = {}
    """Each reward function's score by name, before weighting; None where it abstained."""
    error: OneLine | None = None
    """Why this completion has no reward; None when it has one."""
    mask: bytes | None = None
    """Episodes: one byte per token, 1 for the model's tokens (trained, with their
    log-probabilities) and 0 for the environment's (tool results and the chat template's
    glue between turns: never trained, log-probability 0). None: every token is the model's."""
    turns: PosInt = 1
    """Model turns in the episode (1: a single completion)."""
    tool_calls: NonNegInt = 0
    tool_errors: NonNegInt = 0
    """Tool calls that failed (malformed, unknown tool, raised, timed out, killed)."""
    turn_limit: bool = False
    """The episode's last turn called tools past `max_tool_calling_iterations`: it was
    ended there, its calls unanswered."""
    extra: Annotated[
        dict[Label, Annotated[str, msgspec.Meta(max_length=MAX_EXTRA_CHARS, pattern=SAFE_LINE)]],
        msgspec.Meta(max_length=MAX_EXTRA_COLUMNS),
    ] = {}
    """What the reward functions logged for this completion with TRL's `log_extra(column,
    values)`: columns of the learner's completions table (set by whoever scored it; the
    tier replaces an actor's)."""
    versions: bytes | None = None
    """In-flight adapter updates: packed <i4, the adapter version each token was sampled
    with (never decreasing: a generation that met a newer adapter went on with it from its
    prefix); an environment token has its model turn's. None: every token is the group's
    `adapter_version`'s. Checked against the group (`RolloutGroup.later_digests`)."""

    def __post_init__(self) -> None:
        """Shapes here; the values of the arrays (no negative id, every log-probability
        finite and <= 0) are checked by the group, for all its completions at once
        (`check_arrays`): numpy's cost per call, not per value, is what a group pays. What a
        plain completion has is tested in one expression (a group decodes eight or more of
        these), each problem named on a path of its own."""
        n = len(self.token_ids)
        if (
            n & 3
            or len(self.logprobs) != n
            or self.mask is not None
            or self.tool_errors > self.tool_calls
            or (self.versions is not None and len(self.versions) != n)
        ):
            self._check_shapes()
        if not (self.reward is None or -F32_MAX <= self.reward <= F32_MAX):
            check_f32("reward", self.reward)
        if self.reward_components and not all_f32(self.reward_components.values()):
            for name, value in self.reward_components.items():
                check_f32(f"reward_components[{name!r}]", value)

    def _check_shapes(self) -> None:
        if len(self.token_ids) % 4:
            raise ProtocolError(f"token_ids: {len(self.token_ids)} bytes is not a whole number of int32 values")
        n = len(self.token_ids) // 4
        if self.mask is not None:
            if len(self.mask) != n:
                raise ProtocolError(f"mask: {len(self.mask)} bytes for {n} token ids")
            if n and (self.mask[0] != 1 or self.mask.strip(b"\x00\x01")):
                raise ProtocolError("mask: one byte per token, 0 or 1, starting with a model token (1)")
        if self.tool_errors > self.tool_calls:
            raise ProtocolError(f"tool_errors: {self.tool_errors} errors for {self.tool_calls} tool calls")
        if len(self.logprobs) % 4:
            raise ProtocolError(f"logprobs: {len(self.logprobs)} bytes is not a whole number of float32 values")
        if len(self.logprobs) // 4 != n:
            raise ProtocolError(f"logprobs: {len(self.logprobs) // 4} values for {n} token ids")
        if self.versions is not None and len(self.versions) != 4 * n:
            raise ProtocolError(f"versions: {len(self.versions)} bytes for {n} token ids (one <i4 each)")

    def check_arrays(self) -> None:
        """The values `__post_init__` leaves to the group, for this completion alone."""
        check_token_ids("token_ids", self.token_ids)
        lp = unpack_f32(self.logprobs)
        if lp.size:
            if not np.isfinite(lp).all():
                raise ProtocolError("logprobs: NaN or infinite value")
            if lp.max() > 0.0:
                raise ProtocolError(f"logprobs: positive log-probability {float(lp.max())}")

    @property
    def tokens(self) -> np.ndarray:
        return unpack_i32(self.token_ids)

    @property
    def logps(self) -> np.ndarray:
        return unpack_f32(self.logprobs)

    @property
    def model_mask(self) -> np.ndarray:
        """1.0 where the token is the model's (trained), 0.0 where the environment's."""
        if self.mask is None:
            return np.ones(len(self.token_ids) // 4, dtype=np.float32)
        return np.frombuffer(self.mask, dtype=np.uint8).astype(np.float32)

    @property
    def model_tokens(self) -> int:
        return len(self.token_ids) // 4 if self.mask is None else self.mask.count(1)

    def token_versions(self, adapter_version: int) -> np.ndarray:
        """The adapter version of each token (int32), in a group of `adapter_version`."""
        if self.versions is None:
            return np.full(len(self.token_ids) // 4, adapter_version, dtype=np.int32)
        return unpack_i32(self.versions)

    @classmethod
    def of(cls, token_ids: Any, logprobs: Any, mask: Any = None, versions: Any = None, **fields: Any) -> Completion:
        """Build from sequences or arrays of token ids, log-probabilities, (episodes) the
        model-token mask and (in-flight updates) each token's adapter version (None: all
        the group's); a mask of all ones is sent as none."""
        packed = None if mask is None or all(mask) else bytes(int(bool(m)) for m in mask)
        spans = None if versions is None else pack_i32(versions)
        completion = cls(
            token_ids=pack_i32(token_ids), logprobs=pack_f32(logprobs), mask=packed, versions=spans, **fields
        )
        completion.check_arrays()  # where the values were made, not only in the group
        return completion


def group_id_for(batch_id: str, prompt_id: str) -> str:
    """The rollout group id of one prompt of one batch: the same however often the batch
    is completed, so a batch finished twice is stored once."""
    digest = hashlib.blake2b(msgspec.msgpack.encode([batch_id, prompt_id]), digest_size=16)
    return digest.hexdigest()


class RolloutGroup(_Struct, frozen=True, tag="rollout_group", tag_field="type", kw_only=True):
    """All completions of one prompt, scored; generated with one adapter version, or (an
    in-flight update) with several in turn, each token's named (`Completion.versions`)."""

    schema: int = SCHEMA_VERSION
    group_id: Ident
    """`group_id_for(batch_id, prompt_id)`; the deduplication key."""
    batch_id: Ident
    prompt_id: Ident
    adapter_version: NonNegInt
    """The adapter that generated the group's oldest token (every token, unless a
    completion says otherwise in its `versions`); 0 is the base model. Staleness is
    measured on it."""
    adapter_digest: Sha256Hex | None = None
    """`protocol.wire.files.adapter_digest` of the adapter files the worker loaded into
    its engine for `adapter_version`; None for the base model (version 0). The learner
    compares it with the digest of the version it published (`learner.judge`): a worker
    serving the wrong adapter, or none, is found at its first group."""
    later_digests: Annotated[dict[PosInt, Sha256Hex], msgspec.Meta(max_length=MAX_GROUP_VERSIONS)] = {}
    """In-flight updates: the digest of each newer version a completion's `versions`
    names, checked like `adapter_digest`; exactly those versions, no other."""
    actor_id: Ident
    prompt_token_ids: bytes
    """Packed <i4 prompt tokens exactly as the actor fed them to the model."""
    completions: Annotated[list[Completion], msgspec.Meta(min_length=1)]
    error: OneLine | None = None
    """Set when the whole group failed (a reward raised or timed out); such a group is
    never trained on as if its reward were 0."""
    timings: Annotated[dict[Label, float], msgspec.Meta(max_length=64)] = {}
    """Seconds spent per phase (e.g. generate_s, reward_s) and wall-clock marks."""
    scored_by: Ident | None = None
    """The scoring-tier worker that scored the group (trusted scoring); None when the
    actor scored it, or for a group not yet scored."""
    metrics: Annotated[dict[Label, float], msgspec.Meta(max_length=MAX_LOGGED_METRICS)] = {}
    """What the reward functions logged with TRL's `log_metric` for this group (set by
    whoever scored it; the tier replaces an actor's)."""

    def __post_init__(self) -> None:
        if self.schema != SCHEMA_VERSION:
            check_schema(self.schema)
        if self.group_id != group_id_for(self.batch_id, self.prompt_id):
            raise ProtocolError("group_id: does not match group_id_for(batch_id, prompt_id)")
        if self.adapter_version == 0 and self.adapter_digest is not None:
            raise ProtocolError("adapter_digest: the base model (adapter_version 0) has no adapter to digest")
        if deferred_group_arrays.get():
            check_whole_i32("prompt_token_ids", self.prompt_token_ids)
        else:
            check_group_arrays(self.prompt_token_ids, self.completions)
        if self.later_digests or any(c.versions is not None for c in self.completions):
            check_group_versions(self.adapter_version, self.later_digests, self.completions)
        for field, values in (("timings", self.timings), ("metrics", self.metrics)):
            if values and not all_finite(values.values()):
                for name, value in values.items():
                    check_finite(f"{field}[{name!r}]", value)

    @property
    def versions(self) -> list[int]:
        """Every adapter version the group's tokens name, oldest first."""
        return [self.adapter_version, *sorted(self.later_digests)]

    @property
    def newest_version(self) -> int:
        return max(self.later_digests, default=self.adapter_version)

    @property
    def prompt_tokens(self) -> np.ndarray:
        return unpack_i32(self.prompt_token_ids)

    @property
    def rewards(self) -> list[float | None]:
        return [c.reward for c in self.completions]


class AdapterFile(_Struct, frozen=True):
    name: FileName
    sha256: Sha256Hex
    size: NonNegInt
    """Bytes."""


class AdapterManifest(_Struct, frozen=True, tag="adapter_manifest", tag_field="type", kw_only=True):
    """Describes one published adapter version; also the announcement actors receive.

    Written last as `adapters/v<N>/manifest.json`, so a manifest's presence means its
    files are complete."""

    schema: int = SCHEMA_VERSION
    version: PosInt
    """Names one adapter forever; never reused, even across learner restarts."""
    step: NonNegInt
    """The optimizer step the adapter was taken after."""
    base_model: Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]
    rank: PosInt
    files: Annotated[list[AdapterFile], msgspec.Meta(min_length=1, max_length=64)]
    created_at: Timestamp
    fingerprint: Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{16,64}$")] | None = None
    """`model_fingerprint` of the learner's base model (config and tokenizer): a worker
    checks its own `--model` against it (`actors check`). None: not published."""

    def __post_init__(self) -> None:
        check_schema(self.schema)
        names = [f.name for f in self.files]
        if len(set(names)) != len(names):
            raise ProtocolError("files: file names must be unique")


class WorkerStatus(_Struct, frozen=True, tag="worker_status", tag_field="type", kw_only=True):
    """What a rollout worker reports about itself, every few seconds, for the fleet view
    (`GET /v1/workers`, the learner's warnings about lagging or refusing workers)."""

    schema: int = SCHEMA_VERSION
    worker: Ident
    """The queue's name for it (through the proxy: the token's name first)."""
    engine: Annotated[str, msgspec.Meta(max_length=64, pattern=SAFE_LINE)] = ""
    adapter_version: NonNegInt = 0
    """The newest adapter version it has loaded (0: the base model)."""
    leases: NonNegInt = 0
    """Leases in flight."""
    groups_done: NonNegInt = 0
    tokens_per_s: Annotated[float, msgspec.Meta(ge=0.0, le=1e9)] = 0.0
    """Generated tokens per second over the last report interval."""
    adapters_refused: NonNegInt = 0
    """Adapter versions it could not load (a bad download, a rank above its limit...)."""
    last_error: Annotated[str, msgspec.Meta(max_length=500, pattern=SAFE_LINE)] | None = None
    """The latest refusal or error it met, in one line (`protocol.wire.text.printable`); None if none."""
    reported_at: Timestamp
    share: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None
    """A worker serving several runs: the fraction of its sequences this run got lately
    (`actors.runs.shares`); None: it serves this run alone."""

    def __post_init__(self) -> None:
        check_schema(self.schema)
        check_finite("tokens_per_s", self.tokens_per_s)


class RunShare(_Struct, frozen=True):
    """A run's part of a fleet that serves several runs (`actors.runs`): each worker claims
    from the run furthest below `weight` (relative to the other runs it serves), and gives
    it at most `cap` of its sequences at once (None: no cap)."""

    weight: Annotated[float, msgspec.Meta(gt=0.0, le=1000.0)] = 1.0
    cap: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] | None = None

    def __post_init__(self) -> None:
        check_finite("weight", self.weight)


Message = PromptBatch | RolloutGroup | AdapterManifest | WorkerStatus

TAGS = {
    "prompt_batch": PromptBatch,
    "rollout_group": RolloutGroup,
    "adapter_manifest": AdapterManifest,
    "worker_status": WorkerStatus,
}


def check_schema(schema: int) -> None:
    if schema != SCHEMA_VERSION:
        raise ProtocolError(
            f"schema: unknown schema version {schema}; this build speaks {SCHEMA_VERSION} "
            "(every part of a run, learner, proxy, actors and scorers, must run the same spotgrpo release)"
        )
