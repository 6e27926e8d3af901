"""The `transformers` engine: Hugging Face `generate` with PEFT multi-adapter loading.

For CPU machines, tests and the embedded default. Groups queued with `add` are run by
`step` in batches of up to `max_batch_sequences` sequences that share an adapter
version and sampling settings: the oldest group queued and those queued after it that
share them, wherever they are in the queue, so that groups of several runs (each its own
adapters) queued in turn still batch by adapter. It batches per call, not across a
running batch as vLLM does. One lock orders generation and adapter changes: a load or eviction that
arrives while a batch is generating waits for that batch (which finishes on the adapter
it started with) and is in place for the next one. Adapters are loaded eagerly, so an
evicted version's files are released at once.

Log-probabilities come from the scores `generate` returns, which are the logits after
the logits processors (temperature, top-k, top-p), i.e. the distribution the token was
drawn from; log-softmax of those at the sampled token is what the learner's importance
weights need.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Hashable, Iterator, Sequence
from pathlib import Path
from typing import Any

import msgspec
import torch

from actors.engine import Engine, EngineError, GroupRequest, Sample
from protocol import SamplingParams
from protocol.usercode.chat import stop_token_ids

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TransformersEngine(Engine):
    def __init__(
        self, model: str, *, dtype: str = "float32", device: str | None = None, max_batch_sequences: int = 64
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        loaded: Any = AutoModelForCausalLM.from_pretrained(model, dtype=_DTYPES[dtype])
        self.base: Any = loaded.to(self.device).eval()
        self.model: Any = self.base  # a PeftModel once the first adapter is loaded
        self.max_batch_sequences = self.max_num_seqs = max_batch_sequences
        self._queue: deque[GroupRequest] = deque()
        self._queued_seqs = 0
        self._versions: list[int] = []
        self._evicting: dict[int, Callable[[], None] | None] = {}
        self._lock = threading.RLock()
        self._vocab = int(self.base.config.vocab_size)
        self.context = getattr(self.base.config, "max_position_embeddings", None)
        self.stop_ids = stop_token_ids(self.tokenizer, getattr(self.base, "generation_config", None))

    @property
    def vocab_size(self) -> int:
        return self._vocab

    # ------------------------------------------------------------------ adapters
    def load_adapter(self, version: int, path: Path) -> None:
        from peft import PeftModel

        name = f"v{version}"
        with self._lock, warnings.catch_warnings():
            # peft 0.21 reads transformers 5's deprecated `is_gradient_checkpointing`
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            if version in self._evicting:
                # evicted but still in the model (groups were queued on it): it is wanted
                # again (an evaluation pinned to it), so it stays, files and all
                del self._evicting[version]
                self._versions.append(version)
                return
            if version in self._versions:
                raise EngineError(f"adapter v{version} is already loaded; versions are never reused")
            try:
                if isinstance(self.model, PeftModel):
                    self.model.load_adapter(str(path), adapter_name=name)
                else:
                    self.model = PeftModel.from_pretrained(self.base, str(path), adapter_name=name).eval()
            except (OSError, ValueError, KeyError, RuntimeError) as err:
                raise EngineError(f"cannot load adapter v{version} from {path}: {err}") from err
            self._versions.append(version)

    def evict_adapter(self, version: int, on_released: Callable[[], None] | None = None) -> None:
        with self._lock:
            if version in self._versions:
                self._versions.remove(version)
                self._evicting[version] = on_released
        self._release_evicted()

    def _release_evicted(self) -> None:
        """Delete evicted adapters no queued group names any more (the running batch holds
        the lock, so it finishes first); then their files may go."""
        released = []
        with self._lock:
            for version in [v for v in self._evicting if not any(g.version == v for g in self._queue)]:
                if self._versions:  # never delete the active adapter: activate a kept one first
                    self.model.set_adapter(f"v{self._versions[-1]}")
                self.model.delete_adapter(f"v{version}")
                released.append(self._evicting.pop(version))
        for callback in released:
            if callback is not None:
                callback()

    def loaded_versions(self) -> list[int]:
        with self._lock:
            return list(self._versions)

    @contextlib.contextmanager
    def _using(self, version: int) -> Iterator[torch.nn.Module]:
        """The model with adapter `version` active (0: adapters off). Holds the lock."""
        with self._lock:
            if version == 0:
                if self.model is self.base:
                    yield self.base
                else:
                    with self.model.disable_adapter():
                        yield self.model
                return
            if version not in self._versions and version not in self._evicting:
                raise EngineError(f"adapter v{version} is not loaded (loaded: {self._versions})")
            self.model.set_adapter(f"v{version}")
            yield self.model

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=True))

    # ------------------------------------------------------------------ generation
    @property
    def in_flight(self) -> int:
        return self._queued_seqs

    def add(self, groups: Sequence[GroupRequest]) -> None:
        with self._lock:
            missing = sorted({g.version for g in groups if g.version and g.version not in self._versions})
            if missing:
                raise EngineError(f"adapter v{missing[0]} is not loaded (loaded: {self._versions})")
            fitted = [self.fit(g) for g in groups]  # all or none
            self._queue.extend(fitted)
            self._queued_seqs += sum(g.n for g in groups)

    @torch.no_grad()
    def step(self, timeout_s: float, abort: threading.Event | None = None) -> list[tuple[Hashable, list[Sample]]]:
        if abort is not None and abort.is_set():
            self._drop_all()
            return []
        with self._lock:
            if not self._queue:
                chunk: list[GroupRequest] = []
            else:  # the oldest group, and those queued after it that can share its generate call
                first = self._queue[0]
                alike = (
                    g
                    for g in self._queue
                    if g.version == first.version and g.n == first.n and g.sampling == first.sampling
                )
                chunk = list(itertools.islice(alike, max(1, self.max_batch_sequences // first.n)))
                taken = {id(g) for g in chunk}
                self._queue = deque(g for g in self._queue if id(g) not in taken)
        if not chunk:
            time.sleep(min(timeout_s, 0.05))
            return []
        first = chunk[0]
        with self._using(first.version) as model:
            samples = self._generate_chunk(
                model, [g.prompt for g in chunk], first.n, _seeded(first.sampling, first.seed), abort
            )
        with self._lock:
            self._queued_seqs -= sum(g.n for g in chunk)
        if abort is not None and abort.is_set():
            self._drop_all()
            return []
        self._release_evicted()
        return [(g.key, group) for g, group in zip(chunk, samples, strict=True)]

    def _drop_all(self) -> None:
        with self._lock:
            self._queue.clear()
            self._queued_seqs = 0
        self._release_evicted()

    def _generate_chunk(
        self,
        model: Any,
        prompts: Sequence[Sequence[int]],
        n: int,
        s: SamplingParams,
        abort: threading.Event | None,
    ) -> list[list[Sample]]:
        from transformers import StoppingCriteria, StoppingCriteriaList

        class Aborted(StoppingCriteria):
            def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kw: object) -> torch.Tensor:
                stop = abort is not None and abort.is_set()
                return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)

        pad = self.tokenizer.pad_token_id
        width = max(len(p) for p in prompts)
        # left padding: every row's last prompt token sits at the same position
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.as_tensor(list(p))
            mask[i, width - len(p) :] = 1
        if s.seed is not None:
            torch.manual_seed(s.seed)
        kwargs: dict[str, object] = {
            "do_sample": s.temperature > 0,
            "top_k": s.top_k or None,
            "min_p": s.min_p or None,
            "repetition_penalty": s.repetition_penalty,
        }
        if s.temperature > 0:
            kwargs.update(temperature=s.temperature, top_p=s.top_p)
        if s.stop:
            kwargs.update(stop_strings=list(s.stop), tokenizer=self.tokenizer)
        result = model.generate(
            input_ids=ids.to(self.device),
            attention_mask=mask.to(self.device),
            num_return_sequences=n,
            max_new_tokens=s.max_tokens,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=pad,
            eos_token_id=list(self.stop_ids),
            stopping_criteria=StoppingCriteriaList([Aborted()]),
            **kwargs,
        )
        if abort is not None and abort.is_set():
            return [[Sample([], [], "abort")] * n for _ in prompts]
        new = result.sequences[:, width:].cpu()
        if result.scores:
            logps = torch.stack([torch.log_softmax(sc.float(), -1) for sc in result.scores], 1).cpu()
            picked = logps.gather(-1, new[:, : logps.shape[1]].unsqueeze(-1)).squeeze(-1)
        else:
            picked = torch.zeros(new.shape)
        samples = [self._trim(new[r].tolist(), picked[r].tolist(), s) for r in range(new.shape[0])]
        return [samples[i * n : (i + 1) * n] for i in range(len(prompts))]

    def _trim(self, tokens: list[int], logps: list[float], s: SamplingParams) -> Sample:
        """Cut padding after the end: at the first stop token (kept), or where a stop string ends."""
        end = next((i + 1 for i, t in enumerate(tokens) if t in self.stop_ids), 0)
        if end:
            return Sample(tokens[:end], logps[:end], "stop")
        if s.stop:
            for end in range(1, len(tokens) + 1):
                text = self.tokenizer.decode(tokens[:end], skip_special_tokens=True)
                if any(stop in text for stop in s.stop):
                    return Sample(tokens[:end], logps[:end], "stop")
        return Sample(tokens[: s.max_tokens], logps[: s.max_tokens], "length")


def _seeded(sampling: SamplingParams, seed: int | None) -> SamplingParams:
    """The settings with the group's seed (one torch seed per batch call: the first group's)."""
    return sampling if seed is None or seed == sampling.seed else msgspec.structs.replace(sampling, seed=seed)
