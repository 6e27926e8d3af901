"""The peer of `bench/vs_trl.py`: TRL's `AsyncGRPOTrainer` as its documentation sets it up,
run in vLLM's environment (`python -m bench.vs_trl_peer SPEC.json`, pinned by vs_trl.py).

Three things TRL 1.16 needs on a CPU, each the smallest change that lets it run here:
- `get_peak_flops_per_device` asks CUDA for the device's name (for MFU, a logged figure only);
- its packed "tree" attention calls FlashAttention-3 (a CUDA kernel): `varlen_attention`
  is the same function in torch's SDPA;
- its rollout worker sends every request with a random `seed`, which vLLM's CPU build
  cannot rewind (`CPU Generator does not use offset`: the engine dies within a few steps);
  `UnseededLoop` leaves the seed out (it only decorrelates data-parallel engines, and
  there is one).
It also gives the tiny tokenizer a response template (TRL knows only big models' own) and
records the wall time of each step.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from trl.experimental.async_grpo import async_grpo_trainer, packing
from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker, _AsyncRolloutLoop

from bench.vs_trl import digits  # by its module's name: TRL pickles it into its rollout process


def varlen_attention(
    q: Any,
    k: Any,
    v: Any,
    cu_q: Any,
    cu_k: Any,
    _max_q: Any,
    _max_k: Any,
    *,
    softmax_scale: float | None = None,
    causal: bool = True,
    window_size: Any = (-1, -1),
    **_: Any,
) -> Any:
    """flash-attn's `flash_attn_varlen_func` in torch's SDPA: same arguments, same result
    (causal aligned to the end of each key segment, as flash-attn's); no sliding window
    (the tiny model has none)."""
    import torch
    import torch.nn.functional as F

    assert window_size == (-1, -1) and causal
    out = torch.empty_like(q)
    groups = q.shape[1] // k.shape[1]
    for i in range(cu_q.numel() - 1):
        a, b, c, d = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        qs, ks, vs = (
            x.transpose(0, 1)
            for x in (q[a:b], k[c:d].repeat_interleave(groups, 1), v[c:d].repeat_interleave(groups, 1))
        )
        mask = torch.ones(b - a, d - c, dtype=torch.bool).tril(diagonal=(d - c) - (b - a))
        out[a:b] = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=softmax_scale).transpose(0, 1)
    return out


class UnseededLoop(_AsyncRolloutLoop):  # type: ignore[misc]
    async def _post(self, path: str, payload: dict, timeout: float, max_retries: int = 3) -> dict:
        payload.pop("seed", None)
        return await super()._post(path, payload, timeout, max_retries)


def trl_trainer(spec_file: str) -> None:
    """The peer's trainer process: AsyncGRPOTrainer as its docs set it up, on the CPU."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer, TrainerCallback
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    async_grpo_trainer.get_peak_flops_per_device = lambda *_: None
    packing._flash_attn = lambda: SimpleNamespace(flash_attn_varlen_func=varlen_attention)
    AsyncRolloutWorker._loop_cls = UnseededLoop

    spec = json.loads(Path(spec_file).read_text())
    rows = [json.loads(line) for line in Path(spec["data"]).read_text().splitlines()]
    steps: list[dict[str, Any]] = []

    class Times(TrainerCallback):  # type: ignore[misc]
        def on_log(self, _args: Any, state: Any, _control: Any, logs: dict | None = None, **_: Any) -> None:
            if logs and "loss" in logs:
                steps.append({**logs, "step": state.global_step, "time": time.time()})

    config = AsyncGRPOConfig(
        output_dir=spec["out"],
        max_steps=spec["steps"],
        learning_rate=spec["lr"],
        lr_scheduler_type="constant",
        per_device_train_batch_size=spec["groups"] * spec.get("num_generations", 8),
        gradient_accumulation_steps=1,
        num_generations=spec.get("num_generations", 8),
        max_completion_length=16,
        temperature=1.0,
        max_staleness=spec["max_staleness"],
        vllm_server_base_url=spec["url"],
        dtype="float32",
        bf16=False,
        use_cpu=True,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=0,
    )
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    # how TRL reads an assistant turn out of the tiny model's chat template (it knows only the big models' own)
    tokenizer.response_template = {
        "defaults": {"role": "assistant"},
        "start_anchor": "[assistant]",
        "fields": {"content": {"close_pattern": r"</s>\s*", "content": "text"}},
    }

    trainer = AsyncGRPOTrainer(
        model=spec["model"],
        reward_funcs=digits,
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM"),
        callbacks=[Times()],
    )
    trainer.train()
    Path(spec["out"], "steps.json").write_text(json.dumps(steps))


if __name__ == "__main__":
    trl_trainer(sys.argv[1])
