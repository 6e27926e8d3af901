"""The `vllm` engine: vLLM with LoRA, driven request by request.

Each adapter version is a `LoRARequest` with its own name and a fresh integer id:
vLLM caches adapters by that id, and reusing an id would serve the old weights.
Loading a version only registers its request; vLLM loads the weights into a LoRA slot
when the first request names it (milliseconds), so a sync never pauses generation:
requests already running finish on the adapter they were started with, requests added
after the sync use the new one.

Log-probabilities: `logprobs=0` returns exactly the sampled token's log-probability per
generated token, and `logprobs_mode="processed_logprobs"` makes it the probability
under the distribution actually sampled from (after temperature and top-k/top-p), which
is what the learner's importance weights compare against.

All engine calls happen on the thread that calls `generate`; `load_adapter` and
`evict_adapter` (called by the watcher thread) only record what to do.
"""

from __future__ import annotations

import itertools
import logging
import threading
import uuid
from collections.abc import Sequence
from pathlib import Path

from actors.engine import Engine, EngineError, Sample
from protocol import SamplingParams

log = logging.getLogger(__name__)


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
        **extra: object,
    ) -> None:
        import torch
        from vllm import LLM

        on_cpu = not torch.cuda.is_available()
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
            **extra,
        )
        self.engine = self.llm.llm_engine
        self.tokenizer = self.llm.get_tokenizer()
        self._vocab = int(self.engine.model_config.get_vocab_size())
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._adapters: dict[int, object] = {}  # version -> LoRARequest
        self._to_remove: list[int] = []  # lora int ids, removed on the generate thread

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
            self._adapters[version] = LoRARequest(
                lora_name=f"v{version}", lora_int_id=next(self._ids), lora_path=str(path)
            )

    def evict_adapter(self, version: int) -> None:
        with self._lock:
            request = self._adapters.pop(version, None)
            if request is not None:
                self._to_remove.append(request.lora_int_id)  # type: ignore[attr-defined]

    def loaded_versions(self) -> list[int]:
        with self._lock:
            return sorted(self._adapters)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def _sampling(self, s: SamplingParams, seed: int | None):  # type: ignore[no-untyped-def]
        from vllm import SamplingParams as VSamplingParams

        return VSamplingParams(
            n=1, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k if s.top_k > 0 else -1,
            max_tokens=s.max_tokens, stop=list(s.stop) or None, seed=seed, logprobs=0,
        )

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        sampling: SamplingParams,
        version: int,
        abort: threading.Event | None = None,
    ) -> list[list[Sample]]:
        with self._lock:
            removals, self._to_remove = self._to_remove, []
            lora = None if version == 0 else self._adapters.get(version)
        for lora_id in removals:
            self.engine.remove_lora(lora_id)
        if version != 0 and lora is None:
            raise EngineError(f"adapter v{version} is not loaded (loaded: {self.loaded_versions()})")
        tag = uuid.uuid4().hex[:8]
        slots: dict[str, tuple[int, int]] = {}
        for i, prompt in enumerate(prompts):
            for j in range(n):
                request_id = f"{tag}-{i}-{j}"
                seed = None if sampling.seed is None else sampling.seed + i * n + j
                self.engine.add_request(
                    request_id, {"prompt_token_ids": list(prompt)}, self._sampling(sampling, seed), lora_request=lora
                )
                slots[request_id] = (i, j)
        out: list[list[Sample | None]] = [[None] * n for _ in prompts]
        pending = set(slots)
        while pending:
            if abort is not None and abort.is_set():
                self.engine.abort_request(list(pending))
                for request_id in pending:
                    i, j = slots[request_id]
                    out[i][j] = Sample([], [], "abort")
                break
            for result in self.engine.step():
                if not result.finished or result.request_id not in pending:
                    continue
                pending.discard(result.request_id)
                i, j = slots[result.request_id]
                completion = result.outputs[0]
                ids = list(completion.token_ids)
                logps = [entry[token].logprob for token, entry in zip(ids, completion.logprobs or [], strict=False)]
                if len(logps) != len(ids):
                    raise EngineError(f"vLLM returned {len(logps)} log-probabilities for {len(ids)} tokens")
                reason = completion.finish_reason if completion.finish_reason in ("stop", "length") else "abort"
                out[i][j] = Sample(ids, logps, reason)  # type: ignore[arg-type]
        return [[s for s in group if s is not None] for group in out]

    def close(self) -> None:
        del self.engine
        del self.llm
