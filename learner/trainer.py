"""The model side of the learner: policy, optimizer and schedule, on one device or
sharded over torchrun's ranks (`learner.dist`).

Rank 0's `Learner` calls these methods; under torchrun each first tells the other ranks
(a command), and every rank then runs the same collectives. `follow` is the other
ranks' whole life: build the same policy, optimizer and schedule, then obey rank 0
until STOP.

Optimizer state travels as torch's *full* state dict (keys are parameter names, the
tensors whole), gathered from the shards to save and broadcast into them to restore,
so a checkpoint taken at one world size resumes at any other.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor

from learner.batch import StepBatch, zeros_batch
from learner.config import LearnerConfig
from learner.dist import ADAPTER, AUDIT, RESTORE, SAVE, STEP, STOP, Dist
from learner.policy import Policy, Sequences
from learner.train import train_on
from protocol import SamplingParams

log = logging.getLogger(__name__)


def send_step(dist: Dist, batch: StepBatch) -> list[int]:
    """Rank 0: the step's tensors to every rank, and each row's rank (`Dist.send_step`)."""
    return dist.send_step(batch.tensors(), batch.lengths())


def receive_step(dist: Dist, b: int, width: int) -> tuple[StepBatch, list[int]]:
    """A follower: the batch rank 0 sent with `send_step`."""
    batch = zeros_batch(b, width, torch.device("cpu"))
    return batch, dist.receive_step(batch.tensors())


class Trainer:
    def __init__(self, cfg: LearnerConfig, dist: Dist) -> None:
        from transformers import get_scheduler

        self.cfg, self.dist = cfg, dist
        self.policy = Policy(cfg, dist)
        self.optimizer = torch.optim.AdamW(
            self.policy.trainable_parameters(),
            lr=cfg.learning_rate,
            weight_decay=cfg.weight_decay,
            betas=(cfg.adam_beta1, cfg.adam_beta2),
        )
        self.scheduler = get_scheduler(
            cfg.lr_scheduler,
            self.optimizer,
            num_warmup_steps=cfg.warmup * cfg.updates_per_batch,
            num_training_steps=cfg.steps * cfg.updates_per_batch,
        )

    @property
    def sampling(self) -> SamplingParams:
        """How the run's training groups are sampled (every batch's `sampling`)."""
        cfg = self.cfg
        return SamplingParams(
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            top_k=cfg.top_k,
            min_p=cfg.min_p,
            repetition_penalty=cfg.repetition_penalty,
            max_tokens=cfg.max_tokens,
        )

    def _tell(self, cmd: int, *args: int) -> None:
        if self.dist.enabled and self.dist.main:
            self.dist.command(cmd, *args)

    # ------------------------------------------------------------------ rank 0
    def step(self, batch: StepBatch) -> dict[str, float]:
        owner = send_step(self.dist, batch) if self.dist.enabled else None
        return train_on(self.policy, self.optimizer, self.scheduler, batch, self.cfg, self.dist, owner)

    def audit_moments(
        self, seqs: Sequences, mode: int, state: dict[str, Tensor] | None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """An audit's forward pass (`learner.audit.moments_as`) on rank 0's `seqs`, which
        every rank runs: the sequences travel to the others, the swapped-in state with
        `load_adapter_state`'s broadcast."""
        from learner.audit import moments_as

        if self.dist.enabled:
            self._tell(AUDIT, mode, *seqs.input_ids_BL.shape)
            seqs = Sequences(
                *(self.dist.broadcast(t) for t in (seqs.input_ids_BL, seqs.attention_mask_BL, seqs.mask_BT))
            )
        return moments_as(self.policy, seqs, self.sampling, mode, state)

    def adapter(self) -> dict[str, torch.Tensor]:
        """The whole adapter, on the CPU."""
        self._tell(ADAPTER)
        return self.policy.adapter_state()

    def snapshot(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The adapter and the trainer state (optimizer, schedule, torch RNG) for a checkpoint."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )

        self._tell(SAVE)
        adapter = self.policy.adapter_state()
        optimizer = get_optimizer_state_dict(
            self.policy.model, self.optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        return adapter, {
            "optimizer": optimizer,
            "scheduler": self.scheduler.state_dict(),
            "torch_rng": torch.get_rng_state(),
        }

    def restore(self, adapter: dict[str, torch.Tensor], trainer: dict[str, Any]) -> None:
        """Rank 0's checkpoint into every rank (the others pass empty dicts)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_optimizer_state_dict,
        )

        self._tell(RESTORE)
        self.policy.load_adapter_state(adapter)
        optimizer = trainer.get("optimizer", {})
        if self.dist.main and optimizer.get("state") and all(isinstance(k, int) for k in optimizer["state"]):
            if self.dist.enabled:  # written before checkpoints held parameter names
                raise ValueError("this checkpoint's optimizer state is keyed by position: resume it in one process")
            self.optimizer.load_state_dict(optimizer)
        else:
            set_optimizer_state_dict(
                self.policy.model,
                self.optimizer,
                optim_state_dict=optimizer,
                options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=self.dist.enabled),
            )
        schedule = self.dist.broadcast_json(trainer.get("scheduler")) if self.dist.enabled else trainer["scheduler"]
        self.scheduler.load_state_dict(schedule)

    def stop(self) -> None:
        self._tell(STOP)

    # -------------------------------------------------------------- the others
    def follow(self) -> None:
        """Obey rank 0 until STOP."""
        while True:
            cmd, *args = self.dist.receive()
            if cmd == STOP:
                return
            if cmd == STEP:
                batch, owner = receive_step(self.dist, args[0], args[1])
                train_on(self.policy, self.optimizer, self.scheduler, batch, self.cfg, self.dist, owner)
            elif cmd == AUDIT:
                self._follow_audit(*args[:3])
            elif cmd == ADAPTER:
                self.policy.adapter_state()
            elif cmd == SAVE:
                self.snapshot()
            elif cmd == RESTORE:
                self.restore({}, {})
            else:
                raise RuntimeError(f"unknown command {cmd} from rank 0")

    def _follow_audit(self, mode: int, b: int, width: int) -> None:
        """Another rank's part in `audit_moments`: rank 0's sequences, the same pass."""
        from learner.audit import moments_as

        device = self.policy.device
        seqs = Sequences(
            self.dist.broadcast(torch.zeros(b, width, dtype=torch.long, device="cpu")).to(device),
            self.dist.broadcast(torch.zeros(b, width, dtype=torch.long, device="cpu")).to(device),
            self.dist.broadcast(torch.zeros(b, width - 1, dtype=torch.float32, device="cpu")).to(device),
        )
        moments_as(self.policy, seqs, self.sampling, mode, {})
