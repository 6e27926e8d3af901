"""A synthetic rollout source for learner tests: a worker thread that claims prompt
batches, samples completions from the newest announced adapter with Hugging Face
`generate`, scores them with a toy reward, and submits the groups.

It is test scaffolding, not the actors package: it exists so the learner's tests can
close the loop without importing `actors` (parts meet only on the wire)."""

from __future__ import annotations

import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from protocol import (
    Completion,
    Lease,
    Prompt,
    PromptBatch,
    Queue,
    QueueUnavailable,
    RolloutGroup,
    RunOver,
    encode,
    group_id_for,
    unpack_i32,
)
from protocol.trusted import RedisQueue
from protocol.trusted.store import Store
from protocol.wire.files import adapter_digest, adapter_key
from protocol.wire.keys import ACTORS_GROUP

Reward = Callable[[list[int], list[int], str], float]


class SyntheticActor:
    def __init__(
        self, queue: Queue, store: Store, model_dir: Path, reward: Reward, worker: str = "synthetic-0"
    ) -> None:
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.queue, self.store, self.reward, self.worker = queue, store, reward, worker
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model_dir = model_dir
        self.base = base
        self.model = None
        self.version = 0
        self.digest: str | None = None
        self.stop = threading.Event()
        self.submitted: list[RolloutGroup] = []
        self.error: BaseException | None = None
        self._lora_cls = (LoraConfig, get_peft_model)
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> SyntheticActor:
        self.thread.start()
        return self

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=30)
        if self.error is not None:
            raise self.error

    def _refresh(self) -> None:
        from peft import PeftModel

        latest = self.queue.latest_adapter()
        if latest is None or latest.version == self.version:
            return
        with tempfile.TemporaryDirectory() as tmp:
            for f in latest.files:
                (Path(tmp) / f.name).write_bytes(self.store.get(adapter_key(latest.version, f.name)))
            if self.model is None:
                self.model = PeftModel.from_pretrained(self.base, tmp, adapter_name=f"v{latest.version}")
            else:
                self.model.load_adapter(tmp, adapter_name=f"v{latest.version}")
                self.model.set_adapter(f"v{latest.version}")
                self.model.delete_adapter(f"v{self.version}")
            self.model.set_adapter(f"v{latest.version}")
        self.version, self.digest = latest.version, adapter_digest(latest.files)

    def _run(self) -> None:
        try:
            while not self.stop.is_set():
                try:
                    leases = self.queue.claim(self.worker, 1, block_s=0.2)
                    if not leases:
                        continue
                    self._refresh()
                    lease = leases[0]
                    groups = self.groups(lease.batch)
                    self.queue.submit(self.worker, lease.lease_id, groups)
                    self.submitted.extend(groups)
                except QueueUnavailable:
                    self.stop.wait(0.2)
                except RunOver:  # the learner finished; `actors run` stops, this one stays for a --resume
                    self.stop.wait(0.2)  # with more steps (the learner takes the mark back when it starts)
        except BaseException as err:
            self.error = err

    def groups(self, batch: PromptBatch) -> list[RolloutGroup]:
        return [self.group(batch, p) for p in batch.prompts]

    @torch.no_grad()
    def group(self, batch: PromptBatch, prompt: Prompt) -> RolloutGroup:
        s = batch.sampling
        model = self.model if self.model is not None else self.base
        model.eval()
        prompt_tokens = unpack_i32(prompt.token_ids).tolist()
        ids = torch.as_tensor(prompt_tokens)
        inputs = ids.unsqueeze(0).repeat(batch.num_generations, 1)
        out = model.generate(
            input_ids=inputs,
            attention_mask=torch.ones_like(inputs),
            do_sample=True,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k or None,
            max_new_tokens=s.max_tokens,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=self.tokenizer.pad_token_id,
            eos_token_id=self.tokenizer.eos_token_id,
        )
        new = out.sequences[:, inputs.shape[1] :]
        logps = torch.stack([torch.log_softmax(sc.float(), -1) for sc in out.scores], 1)  # (G, T, V)
        picked = logps.gather(-1, new.unsqueeze(-1)).squeeze(-1)
        completions = []
        for g in range(new.shape[0]):
            toks = new[g].tolist()
            end = toks.index(self.tokenizer.eos_token_id) + 1 if self.tokenizer.eos_token_id in toks else len(toks)
            toks, lp = toks[:end], picked[g, :end].tolist()
            text = self.tokenizer.decode(toks, skip_special_tokens=True)
            completions.append(
                Completion.of(
                    toks,
                    lp,
                    finish_reason="stop"
                    if end < len(new[g]) or toks[-1:] == [self.tokenizer.eos_token_id]
                    else "length",
                    text=text,
                    reward=float(self.reward(prompt_tokens, toks, text)),
                )
            )
        return RolloutGroup(
            group_id=group_id_for(batch.batch_id, prompt.id),
            batch_id=batch.batch_id,
            prompt_id=prompt.id,
            adapter_version=self.version,
            adapter_digest=self.digest,
            actor_id=self.worker,
            prompt_token_ids=prompt.token_ids,
            completions=completions,
        )


def raw_submit(queue: RedisQueue, lease: Lease, groups: list[RolloutGroup]) -> None:
    """What a process with Redis credentials can do past every check of the queue: store
    the groups and finish the lease with plain commands. The learner must defend itself."""
    r = queue._r
    for g in groups:
        r.sadd(queue.keys.groups_seen, g.group_id)
        r.xadd(queue.keys.rollouts, {"g": g.group_id, "m": encode(g)})
    r.xack(queue.keys.prompts, ACTORS_GROUP, lease.lease_id)
    r.xdel(queue.keys.prompts, lease.lease_id)


def perturbed_policy(model_dir: Path, seed: int, rank: int = 4, scale: float = 0.3):  # -> learner.policy.Policy
    """A learner policy whose LoRA B matrices are seeded noise, so its adapter is far from
    the base model: something to publish, load elsewhere and compare log-probabilities with."""
    from learner.config import LearnerConfig
    from learner.policy import Policy

    policy = Policy(LearnerConfig(model=str(model_dir), lora_rank=rank))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    return policy
