"""The `transformers` engine: Hugging Face `generate` with PEFT multi-adapter loading.

For CPU machines, tests and the embedded default. Groups queued with `add` are run by
`step` in batches of up to `max_batch_sequences` sequences that share an adapter
version and sampling settings: the oldest group queued and those queued after it that
share them, wherever they are in the queue, so that groups of several runs (each its own
adapters) queued in turn still batch by adapter. It batches per call, not across a
running batch as vLLM does. One lock orders generation and adapter changes: an eviction that arrives
while a batch is generating waits for that batch, and a load too, except that a batch of
following groups (`GroupRequest.follow`) stops at its next token for it: its samples
still generating go on as a batch of their own, each from its prompt and tokens so far,
on the newest version (one prefill more per switch, none when no version arrives). Adapters are loaded eagerly, so an
evicted version's files are released at once.

Log-probabilities come from the scores `generate` returns, which are the logits after
the logits processors (temperature, top-k, top-p), i.e. the distribution the token was
drawn from; log-softmax of those at the sampled token is what the learner's importance
weights need.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import torch

from actors.engine import MOVE_MIN_TOKENS_LEFT, Engine, EngineError, GroupRequest, Sample
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
        self._queue: deque[_Job] = deque()
        self._loading = 0
        """Loads waiting for the running batch: a following batch stops for them."""
        self._queued_seqs = 0
        self._versions: list[int] = []
        self._evicting: dict[int, Callable[[], None] | None] = {}
        self._lock = threading.RLock()
        self._loading_lock = threading.Lock()
        self._vocab = int(self.base.config.vocab_size)
        self.context = getattr(self.base.config, "max_position_embeddings", None)
        self.stop_ids = stop_token_ids(self.tokenizer, getattr(self.base, "generation_config", None))

    @property
    def vocab_size(self) -> int:
        return self._vocab

    # ------------------------------------------------------------------ adapters
    def load_adapter(self, version: int, path: Path) -> None:
        with self._loading_lock:
            self._loading += 1
        try:
            self._load(version, path)
        finally:
            with self._loading_lock:
                self._loading -= 1

    def _load(self, version: int, path: Path) -> None:
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
        # without the lock: a load asks first, and must not wait for the running batch
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
            self._queue.extend(_Job(g, [list(g.prompt)], g.n, g.sampling, g.version) for g in fitted)
            self._queued_seqs += sum(g.n for g in groups)

    def _take_chunk(self) -> list[_Job]:
        """The oldest job, and those queued after it that can share its generate call (the
        same version, samples per prompt and settings); a following job takes the newest
        version now."""
        with self._lock:
            for job in self._queue:
                if job.group.follow is not None:
                    job.version = job.group.follow()
            if not self._queue:
                return []
            first = self._queue[0]
            chunk: list[_Job] = []
            seqs = 0
            for job in self._queue:
                if job.batching == first.batching and (not chunk or seqs + job.sequences <= self.max_batch_sequences):
                    chunk.append(job)
                    seqs += job.sequences
            taken = {id(j) for j in chunk}
            self._queue = deque(j for j in self._queue if id(j) not in taken)
            return chunk

    @torch.no_grad()
    def step(self, timeout_s: float, abort: threading.Event | None = None) -> list[tuple[Hashable, list[Sample]]]:
        if abort is not None and abort.is_set():
            self._drop_all()
            return []
        with self._lock:  # the version chosen stays the newest until the batch starts
            chunk = self._take_chunk()
            if chunk:
                first = chunk[0]
                with self._using(first.version) as model:
                    rows, stopped = self._generate_chunk(
                        model,
                        [p for j in chunk for p in j.prompts],
                        first.n,
                        _seeded(first.sampling, first.seed),
                        abort,
                        first.group.follow is not None,
                    )
        if not chunk:
            time.sleep(min(timeout_s, 0.05))
            return []
        with self._lock:
            self._queued_seqs -= sum(j.sequences for j in chunk)
        if abort is not None and abort.is_set():
            self._drop_all()
            return []
        done: list[tuple[Hashable, list[Sample]]] = []
        for job in chunk:
            mine, rows = rows[: job.sequences], rows[job.sequences :]
            finished = job.absorb(mine, stopped, self._trim)
            if finished is not None:
                done.append((job.group.key, finished))
            else:  # a newer version was loaded: the rest goes on with it, from where it is
                with self._lock:
                    self._queue.appendleft(job.continuation())
                    self._queued_seqs += self._queue[0].sequences
        self._release_evicted()
        return done

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
        follows: bool = False,
    ) -> tuple[list[tuple[list[int], list[float]]], bool]:
        """`n` sequences per prompt, each its new tokens (padding included) and their
        log-probabilities; and whether a version being loaded stopped them (`follows`)."""
        from transformers import StoppingCriteria, StoppingCriteriaList

        engine = self

        class Stop(StoppingCriteria):
            """Every row stops on an abort, and (following groups) when a version is loaded."""

            switched = False

            def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kw: object) -> torch.Tensor:
                stop = abort is not None and abort.is_set()
                left = s.max_tokens - (input_ids.shape[1] - width)
                if follows and engine._loading and not stop and left >= MOVE_MIN_TOKENS_LEFT:
                    stop = Stop.switched = True
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
            stopping_criteria=StoppingCriteriaList([Stop()]),
            **kwargs,
        )
        if abort is not None and abort.is_set():
            return [([], [])] * (len(prompts) * n), False
        new = result.sequences[:, width:].cpu()
        if result.scores:
            logps = torch.stack([torch.log_softmax(sc.float(), -1) for sc in result.scores], 1).cpu()
            picked = logps.gather(-1, new[:, : logps.shape[1]].unsqueeze(-1)).squeeze(-1)
        else:
            picked = torch.zeros(new.shape)
        return [(new[r].tolist(), picked[r].tolist()) for r in range(new.shape[0])], Stop.switched

    def _trim(self, tokens: list[int], logps: list[float], s: SamplingParams) -> Sample:
        """Cut padding after the end: at the first stop token (kept), or where a stop string
        ends; else `length` (at `s.max_tokens`, or short of it where generation was stopped)."""
        end = next((i + 1 for i, t in enumerate(tokens) if t in self.stop_ids), 0)
        if end:
            return Sample(tokens[:end], logps[:end], "stop")
        if s.stop:
            for end in range(1, len(tokens) + 1):
                text = self.tokenizer.decode(tokens[:end], skip_special_tokens=True)
                if any(stop in text for stop in s.stop):
                    return Sample(tokens[:end], logps[:end], "stop")
        return Sample(tokens[: s.max_tokens], logps[: s.max_tokens], "length")


@dataclass
class _Job:
    """A group on its way: its prompt rows (one, `n` samples; or, continued after a
    version switch, one row per sample still generating) and what each sample has so far."""

    group: GroupRequest
    prompts: list[list[int]]
    n: int
    sampling: SamplingParams
    """The group's settings, with the tokens left (`max_tokens`) once continued."""
    version: int
    parts: list[Sample] | None = None
    """Continued: each sample so far (the finished ones whole); None before."""
    open_rows: list[int] = field(default_factory=list)
    """Continued: the samples the prompt rows continue."""

    @property
    def sequences(self) -> int:
        return len(self.prompts) * self.n

    @property
    def seed(self) -> int | None:
        return self.group.seed if self.parts is None else None

    @property
    def batching(self) -> tuple[object, ...]:
        """What jobs sharing one generate call have in common."""
        return self.version, self.n, self.sampling, self.group.follow is not None

    def absorb(
        self,
        rows: list[tuple[list[int], list[float]]],
        stopped: bool,
        trim: Callable[[list[int], list[float], SamplingParams], Sample],
    ) -> list[Sample] | None:
        """Take one generate call's rows; the samples if all are finished, else None (the
        generation was stopped for a newer version: `continuation`)."""
        full = self.group.sampling
        before = self.parts or [Sample([], [], "length", versions=[])] * self.n
        index = self.open_rows or list(range(self.n))
        parts = list(before)
        for j, (tokens, logps) in zip(index, rows, strict=True):
            prior = before[j]
            sample = trim(prior.token_ids + tokens, prior.logprobs + logps, full)
            versions = (prior.versions or []) + [self.version] * (len(sample.token_ids) - len(prior.token_ids))
            parts[j] = Sample(sample.token_ids, sample.logprobs, sample.finish_reason, versions=versions)
        self.parts = parts
        self.open_rows = [
            j
            for j in index
            if stopped and parts[j].finish_reason == "length" and len(parts[j].token_ids) < full.max_tokens
        ]
        return None if self.open_rows else [p.of_group(self.group.version) for p in parts]

    def continuation(self) -> _Job:
        """The samples still generating, each its own prompt row (prompt and tokens so far)."""
        assert self.parts is not None
        made = len(self.parts[self.open_rows[0]].token_ids)  # they ran in step: one length
        left = self.group.sampling.max_tokens - made
        return _Job(
            self.group,
            [list(self.group.prompt) + self.parts[j].token_ids for j in self.open_rows],
            1,
            msgspec.structs.replace(self.group.sampling, max_tokens=left, seed=None),
            self.version,
            self.parts,
            self.open_rows,
        )


def _seeded(sampling: SamplingParams, seed: int | None) -> SamplingParams:
    """The settings with the group's seed (one torch seed per batch call: the first group's)."""
    return sampling if seed is None or seed == sampling.seed else msgspec.structs.replace(sampling, seed=seed)
