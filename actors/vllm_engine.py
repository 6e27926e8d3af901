"""The `vllm` engine: vLLM with LoRA, driven request by request across leases.

Why the engine's step loop (`LLMEngine.add_request` / `step`) rather than `AsyncLLM`:
vLLM documents both; the step loop is synchronous, so one thread of the work loop adds
groups from any number of leases as others finish and collects finished sequences,
with no asyncio event loop in the worker; the scheduler batches whatever is queued
(continuous batching up to `max_num_seqs`), which is what AsyncLLM would give us too.

Each adapter version is a `LoRARequest` with its own name and a fresh integer id:
vLLM caches adapters by that id, and reusing an id would serve the old weights.
Loading a version only registers its request; vLLM loads the weights into a LoRA slot
when the first request names it (milliseconds), so a sync never pauses generation.
Requests of following groups (`GroupRequest.follow`) still running at the next step are
aborted and added again on the new version, their prompt the old one and the tokens so
far (vLLM's prefix cache is per LoRA: the prefix is prefilled again, as it must be), with
the tokens left and no seed; the tokens keep the log-probabilities they were sampled
with. Pinned requests finish on the version they started with. Because that load is lazy, an evicted version's files
must outlive every queued or running request that names it: eviction is deferred until
the version's last sequence finishes, then the LoRA is removed and `on_released` runs
(the watcher deletes the files). An engine that dies anyway raises `EngineDead`.

Log-probabilities: `logprobs=0` returns exactly the sampled token's log-probability per
generated token, and `logprobs_mode="processed_logprobs"` makes it the probability
under the distribution actually sampled from (after temperature and top-k/top-p), which
is what the learner's importance weights compare against.

All engine calls happen on the thread that calls `generate`; `load_adapter` and
`evict_adapter` (called by the watcher thread) only record what to do.

On a CPU with one core to run on (a pinned actor), the engine core runs in the actor's
process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, unless set): vLLM's CPU build otherwise runs
an engine-core process and a model process that spin on shared memory for a second
after every message (`SpinCondition`), and on one core those spins take the core from
the process doing the work (measured: 60% of the actor's samples; `bench/vs_trl.py`
8.3-9.6 -> 11-13 steps/s). GPUs and several cores keep vLLM's default.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import msgspec

from actors.engine import MOVE_MIN_TOKENS_LEFT, Engine, EngineDead, EngineError, GroupRequest, Sample
from protocol import SamplingParams
from protocol.usercode.chat import stop_token_ids
from protocol.util.machine import usable_cores

log = logging.getLogger(__name__)


@dataclass
class _Group:
    request: GroupRequest
    """As queued, its version the one it started on."""
    samples: list[Sample | None]
    left: int
    running: list[int]
    """Each sample's version now (in-flight updates move it on)."""
    before: list[Sample]
    """Each sample's tokens from the versions it left (none until it moves)."""


@dataclass
class _Eviction:
    lora_int_id: int
    on_released: Callable[[], None] | None = None


def _generation_config(model: str) -> object:
    """The model's `generation_config.json` (its stop tokens), if it has one."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(model)
    except (OSError, ValueError):
        return None


def _is_engine_dead(err: BaseException) -> bool:
    return type(err).__name__ == "EngineDeadError"


def engine_core_in_process_on_one_core() -> bool:
    """Where only one CPU core is ours, run vLLM's engine core in this process (see the
    module's text); returns whether it will."""
    if usable_cores() == 1:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    return os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"


class VLLMEngine(Engine):
    def __init__(
        self,
        model: str,
        *,
        dtype: str = "auto",
        max_lora_rank: int = 64,
        max_loras: int = 2,
        max_model_len: int | None = None,
        gpu_memory_utilization: float = 0.9,
        enforce_eager: bool | None = None,
        max_num_seqs: int | None = None,
        tensor_parallel_size: int = 1,
        **extra: object,
    ) -> None:
        import torch
        from vllm import LLM

        on_cpu = not torch.cuda.is_available()
        if on_cpu:
            engine_core_in_process_on_one_core()
        self.llm = LLM(
            model=model,
            dtype=dtype,
            enable_lora=True,
            max_lora_rank=max_lora_rank,
            max_loras=max_loras,
            max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=on_cpu if enforce_eager is None else enforce_eager,
            logprobs_mode="processed_logprobs",
            tensor_parallel_size=tensor_parallel_size,
            **({"max_num_seqs": max_num_seqs} if max_num_seqs else {}),
            **extra,
        )
        self.engine = self.llm.llm_engine
        # what the scheduler runs at once (vLLM picks it for the hardware unless told)
        self.max_num_seqs = int(self.engine.vllm_config.scheduler_config.max_num_seqs)
        self.tokenizer = self.llm.get_tokenizer()
        self._vocab = int(self.engine.model_config.get_vocab_size())
        self.context = int(self.engine.model_config.max_model_len)
        self.stop_ids = stop_token_ids(self.tokenizer, _generation_config(model))
        self._ids = itertools.count(1)
        self._request_ids = itertools.count(1)
        self._lock = threading.Lock()
        self._adapters: dict[int, object] = {}  # version -> LoRARequest
        self._evicting: dict[int, _Eviction] = {}  # version -> its LoRA, removed when unused
        self._groups: dict[Hashable, _Group] = {}
        self._sequences: dict[str, tuple[Hashable, int]] = {}  # request id -> (group key, sample index)
        self._latest: dict[str, Any] = {}  # request id -> its output so far (following groups)
        self._loaded = False  # a version was loaded since the last step: following groups move
        self._uses: Counter[int] = Counter()  # version -> sequences queued or running

    @property
    def vocab_size(self) -> int:
        return self._vocab

    def load_adapter(self, version: int, path: Path) -> None:
        from vllm.lora.request import LoRARequest

        if not (path / "adapter_config.json").is_file():
            raise EngineError(f"cannot load adapter v{version} from {path}: no adapter_config.json")
        with self._lock:
            if version in self._adapters:
                raise EngineError(f"adapter v{version} is already loaded; versions are never reused")
            # a version evicted while requests still named it is wanted again (an evaluation
            # pinned to it): it keeps its LoRA id, so vLLM's copy serves, and its files stay
            eviction = self._evicting.pop(version, None)
            self._adapters[version] = LoRARequest(
                lora_name=f"v{version}",
                lora_int_id=eviction.lora_int_id if eviction else next(self._ids),
                lora_path=str(path),
            )
            self._loaded = True

    def evict_adapter(self, version: int, on_released: Callable[[], None] | None = None) -> None:
        with self._lock:
            request = self._adapters.pop(version, None)
            if request is not None:
                self._evicting[version] = _Eviction(request.lora_int_id, on_released)  # type: ignore[attr-defined]
                return
        if on_released is not None:
            on_released()

    def _release_evicted(self) -> None:
        """On the driving thread: remove the LoRAs of evicted versions no sequence names."""
        with self._lock:
            free = [(v, e) for v, e in self._evicting.items() if not self._uses[v]]
            for version, _ in free:
                del self._evicting[version]
        for _, eviction in free:
            self.engine.remove_lora(eviction.lora_int_id)
            if eviction.on_released is not None:
                eviction.on_released()

    def loaded_versions(self) -> list[int]:
        with self._lock:
            return sorted(self._adapters)

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=True))

    def _sampling(self, s: SamplingParams, seed: int | None) -> Any:
        from vllm import SamplingParams as VSamplingParams

        return VSamplingParams(
            n=1,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k if s.top_k > 0 else -1,
            min_p=s.min_p,
            repetition_penalty=s.repetition_penalty,
            max_tokens=s.max_tokens,
            stop=list(s.stop) or None,
            stop_token_ids=list(self.stop_ids),
            seed=seed,
            logprobs=0,
        )

    @property
    def in_flight(self) -> int:
        return len(self._sequences)

    def add(self, groups: Sequence[GroupRequest]) -> None:
        groups = [g if g.follow is None else replace(g, version=g.follow()) for g in groups]
        with self._lock:
            missing = sorted({g.version for g in groups if g.version and g.version not in self._adapters})
            if missing:
                raise EngineError(f"adapter v{missing[0]} is not loaded (loaded: {sorted(self._adapters)})")
        groups = [self.fit(g) for g in groups]  # all or none
        try:
            for g in groups:
                nothing = Sample([], [], "abort", versions=[])
                self._groups[g.key] = group = _Group(g, [None] * g.n, g.n, [g.version] * g.n, [nothing] * g.n)
                for j in range(g.n):
                    self._submit(group, j, list(g.prompt), g.sampling, None if g.seed is None else g.seed + j)
        except Exception as err:
            if _is_engine_dead(err):
                raise EngineDead(f"the vLLM engine died: {err}") from err
            raise

    def _submit(self, group: _Group, j: int, prompt: list[int], sampling: SamplingParams, seed: int | None) -> None:
        """Sample `j` of `group` as one request, on its version now."""
        version = group.running[j]
        with self._lock:
            lora = self._adapters.get(version) if version else None
        if version and lora is None:
            raise EngineError(f"adapter v{version} is not loaded (loaded: {sorted(self._adapters)})")
        request_id = str(next(self._request_ids))
        self.engine.add_request(
            request_id, {"prompt_token_ids": prompt}, self._sampling(sampling, seed), lora_request=lora
        )
        self._sequences[request_id] = (group.request.key, j)
        with self._lock:
            self._uses[version] += 1

    def _move_on(self) -> None:
        """A version was loaded: the following groups' requests not on their newest are
        aborted and added again on it, from their tokens so far."""
        self._loaded = False
        moving: list[tuple[str, _Group, int, int]] = []
        for request_id, (key, j) in self._sequences.items():
            group = self._groups[key]
            if group.request.follow is None:
                continue
            newest = group.request.follow()
            made = len(group.before[j].token_ids) + len(getattr(self._latest.get(request_id), "token_ids", ()))
            if newest != group.running[j] and group.request.sampling.max_tokens - made >= MOVE_MIN_TOKENS_LEFT:
                moving.append((request_id, group, j, newest))
        if not moving:
            return
        self.engine.abort_request([m[0] for m in moving])
        for request_id, group, j, newest in moving:
            del self._sequences[request_id]
            so_far = self._sample_of(self._latest.pop(request_id, None), group.running[j])
            with self._lock:
                self._uses[group.running[j]] -= 1
            group.before[j] = group.before[j].then(so_far)
            group.running[j] = newest
            full = group.request.sampling
            left = full.max_tokens - len(group.before[j].token_ids)
            sampling = msgspec.structs.replace(full, max_tokens=left)
            self._submit(group, j, list(group.request.prompt) + group.before[j].token_ids, sampling, None)

    def step(self, timeout_s: float, abort: threading.Event | None = None) -> list[tuple[Hashable, list[Sample]]]:
        if self._loaded:
            self._move_on()
        self._release_evicted()
        if abort is not None and abort.is_set():
            self._drop_all()
            return []
        if not self._sequences:
            time.sleep(min(timeout_s, 0.01))
            return []
        done: list[tuple[Hashable, list[Sample]]] = []
        deadline = time.monotonic() + timeout_s
        try:
            while self._sequences and not done and time.monotonic() < deadline:
                if abort is not None and abort.is_set():
                    self._drop_all()
                    return []
                for result in self.engine.step():
                    if result.request_id not in self._sequences:
                        continue
                    if not result.finished:
                        self._latest[result.request_id] = result.outputs[0]
                        continue
                    self._latest.pop(result.request_id, None)
                    finished = self._finish(result)
                    if finished is not None:
                        done.append(finished)
        except Exception as err:
            if _is_engine_dead(err):
                raise EngineDead(f"the vLLM engine died: {err}") from err
            raise
        self._release_evicted()
        return done

    def _sample_of(self, completion: Any, version: int) -> Sample:
        """One request's output as a sample of `version` (none yet: no tokens)."""
        if completion is None:
            return Sample([], [], "abort", versions=[])
        ids = list(completion.token_ids)
        logps = [entry[token].logprob for token, entry in zip(ids, completion.logprobs or [], strict=False)]
        if len(logps) != len(ids):
            raise EngineError(f"vLLM returned {len(logps)} log-probabilities for {len(ids)} tokens")
        reason = completion.finish_reason if completion.finish_reason in ("stop", "length") else "abort"
        return Sample(ids, logps, reason, versions=[version] * len(ids))  # type: ignore[arg-type]

    def _finish(self, result: Any) -> tuple[Hashable, list[Sample]] | None:
        key, j = self._sequences.pop(result.request_id)
        group = self._groups[key]
        version = group.running[j]
        sample = self._sample_of(result.outputs[0], version)
        if group.before[j].token_ids:  # it moved on: the tokens of the versions it left first
            sample = group.before[j].then(sample)
        group.samples[j] = sample.of_group(group.request.version)
        group.left -= 1
        with self._lock:
            self._uses[version] -= 1
        if group.left:
            return None
        del self._groups[key]
        return key, [s for s in group.samples if s is not None]

    def _drop_all(self) -> None:
        if self._sequences:
            self.engine.abort_request(list(self._sequences))
        self._sequences.clear()
        self._latest.clear()
        self._groups.clear()
        with self._lock:
            self._uses.clear()
        self._release_evicted()

    def close(self) -> None:
        del self.engine
        del self.llm
