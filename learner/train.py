"""One learner step on a batch of scored rollout groups: advantages, the corrected
loss over micro-batches, the optimizer step, and the step's loss-side metrics.

An update whose loss or gradient is not finite is never applied: the gradients are
dropped, the optimizer and schedule do not move, and `skipped_updates` counts it."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from learner.config import LearnerConfig
from learner.loss import advantages, aggregate, importance_weights, kl_k3, policy_loss
from learner.policy import Policy, Sequences, pack_sequences, scatter_completion_values
from protocol import RolloutGroup

log = logging.getLogger(__name__)


@dataclass
class StepBatch:
    seqs: Sequences
    behav_logp_BT: Tensor
    advantages_N: Tensor
    rewards_N: Tensor

    def __len__(self) -> int:
        return len(self.seqs)

    def select(self, rows: slice) -> StepBatch:
        return StepBatch(
            self.seqs.select(rows), self.behav_logp_BT[rows], self.advantages_N[rows], self.rewards_N[rows]
        )


def build_step_batch(groups: list[RolloutGroup], cfg: LearnerConfig, pad_id: int) -> StepBatch:
    """The step's sequences. With `mask_truncated_completions`, a completion that hit
    max_tokens keeps its place in its group's advantages but has no token in the loss."""
    prompts, completions, behav, rewards, sizes, truncated = [], [], [], [], [], []
    for group in groups:
        prompt = group.prompt_tokens.tolist()
        sizes.append(len(group.completions))
        for c in group.completions:
            prompts.append(prompt)
            completions.append(c.tokens.tolist())
            behav.append(c.logps)
            rewards.append(float(c.reward))  # type: ignore[arg-type]  # checked by the collector
            truncated.append(c.finish_reason == "length")
    seqs = pack_sequences(prompts, completions, pad_id)
    if cfg.mask_truncated_completions:
        seqs.mask_BT[torch.tensor(truncated, dtype=torch.bool)] = 0.0
    behav_BT = scatter_completion_values(behav, [len(p) for p in prompts], seqs.input_ids_BL.shape[1])
    rewards_N = torch.tensor(rewards, dtype=torch.float32)
    return StepBatch(seqs, behav_BT, advantages(rewards_N, sizes, cfg.advantage_scale), rewards_N)


def _micro(n: int, size: int) -> list[slice]:
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


class _Sums:
    """Running sums of the loss-side metrics over micro-batches."""

    def __init__(self) -> None:
        self.v = dict.fromkeys(("loss", "w_sum", "w_sq", "corrected", "k3", "clipped", "entropy", "kl_ref", "tokens"), 0.0)
        self.w_max = 0.0


def accumulate(
    policy: Policy, batch: StepBatch, cfg: LearnerConfig, prox_BT: Tensor | None, sums: _Sums
) -> None:
    """Backward the step's loss for `batch` (one optimizer step's worth), micro-batch by
    micro-batch; gradients add up to those of the whole batch at once."""
    num_seqs, num_tokens = len(batch), int(batch.seqs.mask_BT.sum().item())
    for rows in _micro(num_seqs, cfg.micro_batch_size):
        mb = batch.select(rows)
        mask = mb.seqs.mask_BT
        logp, ent = policy.forward_logps(mb.seqs, cfg.temperature, with_entropy=True)
        prox = logp.detach() if prox_BT is None else prox_BT[rows]
        w = importance_weights(
            prox, mb.behav_logp_BT, mask, cfg.correction,
            tis_cap=cfg.tis_cap, mis_level=cfg.mis_level, mis_low=cfg.mis_low, mis_high=cfg.mis_high,
        )
        loss_BT, clip_BT = policy_loss(
            logp, prox, mb.advantages_N, w.weights_BT, epsilon_low=cfg.epsilon_low, epsilon_high=cfg.epsilon_high,
            level=cfg.importance_sampling_level, mask_BT=mask,
        )
        if cfg.beta > 0:
            with torch.no_grad(), policy.reference():
                ref, _ = policy.forward_logps(mb.seqs, cfg.temperature)
            kl_BT = kl_k3(logp, ref)
            loss_BT = loss_BT + cfg.beta * kl_BT
            sums.v["kl_ref"] += float((kl_BT.detach() * mask).sum())
        part = aggregate(
            loss_BT * w.keep_BT, mask, cfg.loss_agg, num_seqs=num_seqs, num_tokens=num_tokens, max_tokens=cfg.max_tokens
        )
        part.backward()

        m = mask.bool()
        r = w.ratio_BT[m]
        sums.v["loss"] += float(part.detach())
        sums.v["w_sum"] += float(r.sum())
        sums.v["w_sq"] += float((r * r).sum())
        sums.w_max = max(sums.w_max, float(r.max())) if r.numel() else sums.w_max
        sums.v["corrected"] += float(w.corrected_BT[m].sum())
        sums.v["k3"] += float((r - 1 - r.log()).sum())
        sums.v["clipped"] += float(clip_BT[m].sum())
        sums.v["entropy"] += float(ent[m].sum())  # type: ignore[index]
        sums.v["tokens"] += float(m.sum())


def train_on(
    policy: Policy,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    batch: StepBatch,
    cfg: LearnerConfig,
) -> dict[str, float]:
    """`cfg.updates_per_batch` optimizer steps on `batch`; returns the step's metrics."""
    prox_BT: Tensor | None = None
    if cfg.updates_per_batch > 1:
        # the proximal policy: the policy as it was when this step began
        with torch.no_grad():
            prox_BT = torch.cat(
                [policy.forward_logps(batch.seqs.select(s), cfg.temperature)[0] for s in _micro(len(batch), cfg.micro_batch_size)]
            )
    sums, grad_norms, k, skipped = _Sums(), [], cfg.updates_per_batch, 0
    for part in [slice(len(batch) * i // k, len(batch) * (i + 1) // k) for i in range(k)]:
        optimizer.zero_grad(set_to_none=True)
        loss_before = sums.v["loss"]
        accumulate(policy, batch.select(part), cfg, None if prox_BT is None else prox_BT[part], sums)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(policy.trainable_parameters(), cfg.max_grad_norm))
        if not (math.isfinite(grad_norm) and math.isfinite(sums.v["loss"] - loss_before)):
            skipped += 1
            log.error("update skipped: loss %s, gradient norm %s (not finite)", sums.v["loss"] - loss_before, grad_norm)
            optimizer.zero_grad(set_to_none=True)
            continue
        grad_norms.append(grad_norm)
        optimizer.step()
        scheduler.step()

    v, n = sums.v, max(sums.v["tokens"], 1.0)
    return {
        "skipped_updates": skipped,
        "loss": v["loss"] / k,
        "grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else math.nan,
        "tokens": int(v["tokens"]),
        "is_weight_mean": v["w_sum"] / n,
        "is_weight_max": sums.w_max,
        "is_truncated_frac": v["corrected"] / n,
        "ess": (v["w_sum"] ** 2) / (n * v["w_sq"]) if v["w_sq"] > 0 else 1.0,
        "kl_behaviour_k3": v["k3"] / n,
        "clip_frac": v["clipped"] / n,
        "entropy": v["entropy"] / n,
        "kl_ref_k3": v["kl_ref"] / n,
        "learning_rate": float(scheduler.get_last_lr()[0]),
    }
