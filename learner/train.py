"""One learner step on a batch of scored rollout groups: advantages, the corrected
loss over micro-batches, the optimizer step, and the step's loss-side metrics.

The algorithm, in the order it runs (each a plain function of `learner.loss`):

    build_step_batch   rewards -> group-relative `advantages`, sequences packed (`learner.batch`)
    train_on           per update: micro-batches, then clip, check, optimizer step
      micro_batch_loss   forward -> `importance_weights` (behaviour -> proximal policy)
                         -> `policy_loss` (clipped, PPO/GSPO level) -> + beta x `kl_k3`
                         -> `aggregate` (grpo / dapo / dr_grpo / bnpo)

Micro-batches are formed by a token budget (`token_budget`, `learner.batch.plan_micro_batches`:
sequences sorted by length, each micro-batch cut to its own longest), so long completions do not
run the device out of memory and short ones are not padded to the longest of the step.
The step is built on the CPU and each micro-batch moves to the policy's device; every
tensor made here names its device.

An update whose loss or gradient is not finite is never applied: the gradients are
dropped, the optimizer and schedule do not move, and `skipped_updates` counts it."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from learner.batch import StepBatch, empty_batch, plan_micro_batches
from learner.config import LearnerConfig
from learner.dist import Dist, full_tensor
from learner.loss import ISWeights, aggregate, importance_weights, kl_k3, policy_loss
from learner.policy import Policy

log = logging.getLogger(__name__)


class _Sums:
    """Running sums of the loss-side metrics over micro-batches (this rank's)."""

    KEYS = (
        "loss",
        "w_sum",
        "w_sq",
        "corrected",
        "k3",
        "clipped",
        "clipped_low",
        "entropy",
        "kl_ref",
        "tokens",
        "logp_diff",
    )

    def __init__(self) -> None:
        self.v = dict.fromkeys(self.KEYS, 0.0)
        self.w_max, self.w_min = 0.0, math.inf

    def add(self, loss: float, t: Terms, mb: StepBatch) -> None:
        m = mb.seqs.mask_BT.bool()
        r = t.weights.ratio_BT[m]
        self.v["loss"] += loss
        self.v["w_sum"] += float(r.sum())
        self.v["w_sq"] += float((r * r).sum())
        if r.numel():
            self.w_max, self.w_min = max(self.w_max, float(r.max())), min(self.w_min, float(r.min()))
        self.v["corrected"] += float(t.weights.corrected_BT[m].sum())
        self.v["k3"] += float((r - 1 - r.log()).sum())
        self.v["clipped"] += float(t.clipped_BT[m].sum())
        # a clip binds below the ratio's range for a negative advantage, above it for a positive one
        low_BT = t.clipped_BT & (mb.advantages_N < 0).unsqueeze(1)
        self.v["clipped_low"] += float(low_BT[m].sum())
        self.v["entropy"] += float(t.entropy_BT[m].sum())
        self.v["tokens"] += float(m.sum())
        self.v["logp_diff"] += float((t.logp_BT.detach() - mb.behav_logp_BT)[m].abs().sum())
        if t.kl_BT is not None:
            self.v["kl_ref"] += float((t.kl_BT.detach() * mb.seqs.mask_BT).sum())

    def reduce(self, dist: Dist) -> None:
        """Every rank's sums, added up (and the largest weight)."""
        totals = dist.all_reduce([self.v[k] for k in self.KEYS])
        self.v = dict(zip(self.KEYS, totals, strict=True))
        self.w_max = dist.all_reduce([self.w_max], op="max")[0]
        self.w_min = -dist.all_reduce([-self.w_min], op="max")[0]


LOGITS_BYTES = 1 << 30
"""What one micro-batch's float32 logits may take when `max_tokens_per_microbatch` is not
set: the LM head runs from a micro-batch's earliest completion position on, so a budget of
whole-sequence tokens bounds them with room to spare."""


def token_budget(cfg: LearnerConfig, vocab_size: int, bytes_per_token: int = 0, activation_bytes: int = 2 << 30) -> int:
    """Tokens per micro-batch: `max_tokens_per_microbatch`, or the fewest of 16,384, what
    keeps the logits near `LOGITS_BYTES` (SmolLM2's 49,152-word vocabulary: 5,461), and
    what keeps the activations near `activation_bytes` (`Policy.activation_budget`: 2 GiB on
    a CPU, a quarter of a GPU) at `bytes_per_token` (`Policy.activation_bytes_per_token`;
    SmolLM2 in float32: 970 tokens). The calculator example's step of 16 x 796 tokens peaked
    at 17.7 GB in micro-batches of 5,461 tokens and at 3.4 GB in micro-batches of one
    sequence (bench/learner_memory.py)."""
    if cfg.max_tokens_per_microbatch is not None:
        return cfg.max_tokens_per_microbatch
    by_activations = activation_bytes // bytes_per_token if bytes_per_token else 16384
    return max(256, min(16384, LOGITS_BYTES // (4 * vocab_size), by_activations))


def _plan(batch: StepBatch, rows: list[int], cfg: LearnerConfig, dist: Dist, policy: Policy) -> list[list[int] | None]:
    """This rank's micro-batches of `rows`, as many as every other rank's (`Dist.same_passes`)."""
    budget = token_budget(cfg, policy.vocab_size, policy.activation_bytes_per_token, policy.activation_budget)
    return dist.same_passes(plan_micro_batches(batch.lengths(), rows, budget, cfg.micro_batch_size))


def accumulate(
    policy: Policy,
    batch: StepBatch,
    cfg: LearnerConfig,
    prox_BT: Tensor | None,
    sums: _Sums,
    *,
    plan: list[list[int] | None] | None = None,
    num_seqs: int | None = None,
    num_tokens: int | None = None,
    dist: Dist | None = None,
) -> None:
    """Backward this rank's share of the step's loss for `batch` (one optimizer step's
    worth), micro-batch by micro-batch; `num_seqs` and `num_tokens` count the whole step
    on every rank, so the gradients add up to those of the whole batch at once. FSDP
    averages gradients over ranks: each rank's loss is scaled by the world size."""
    device = policy.device
    dist = dist or Dist(device=device)
    if plan is None:  # the whole batch, in one process
        plan = _plan(batch, list(range(len(batch))), cfg, dist, policy)
        num_seqs, num_tokens = len(batch), int(batch.seqs.mask_BT.sum().item())
    assert num_seqs is not None and num_tokens is not None
    for rows in plan:
        mb = empty_batch(device) if rows is None else batch.take(rows, device)
        prox = (
            None
            if prox_BT is None or rows is None
            else prox_BT.index_select(0, torch.tensor(rows, dtype=torch.long, device="cpu")).to(device)
        )
        part, t = micro_batch_loss(policy, mb, prox, cfg, num_seqs=num_seqs, num_tokens=num_tokens)
        (part * dist.world if dist.enabled else part).backward()
        sums.add(float(part.detach()), t, mb)


@dataclass
class Terms:
    """What a micro-batch's loss was made of, for the step's metrics."""

    logp_BT: Tensor
    entropy_BT: Tensor
    weights: ISWeights
    clipped_BT: Tensor
    kl_BT: Tensor | None


def micro_batch_loss(
    policy: Policy, mb: StepBatch, prox_BT: Tensor | None, cfg: LearnerConfig, *, num_seqs: int, num_tokens: int
) -> tuple[Tensor, Terms]:
    """One micro-batch's share of the step's loss (`num_seqs` sequences and `num_tokens`
    completion tokens in the whole step). `prox_BT`: the proximal policy's
    log-probabilities (decoupled PPO, several updates per batch); None: the policy itself."""
    mask = mb.seqs.mask_BT
    logp, ent = policy.forward_logps(mb.seqs, cfg.temperature, with_entropy=True)
    prox = logp.detach() if prox_BT is None else prox_BT[:, : logp.shape[1]]
    w = importance_weights(
        prox,
        mb.behav_logp_BT,
        mask,
        cfg.correction,
        tis_cap=cfg.tis_cap,
        mis_level=cfg.mis_level,
        mis_low=cfg.mis_low,
        mis_high=cfg.mis_high,
    )
    loss_BT, clip_BT = policy_loss(
        logp,
        prox,
        mb.advantages_N,
        w.weights_BT,
        epsilon_low=cfg.epsilon_low,
        epsilon_high=cfg.epsilon_high,
        level=cfg.importance_sampling_level,
        mask_BT=mask,
    )
    kl_BT = None
    if cfg.beta > 0:
        with torch.no_grad(), policy.reference():
            ref, _ = policy.forward_logps(mb.seqs, cfg.temperature)
        kl_BT = kl_k3(logp, ref)
        loss_BT = loss_BT + cfg.beta * kl_BT
    loss = aggregate(
        loss_BT * w.keep_BT, mask, cfg.loss_agg, num_seqs=num_seqs, num_tokens=num_tokens, max_tokens=cfg.max_tokens
    )
    assert ent is not None
    return loss, Terms(logp, ent, w, clip_BT, kl_BT)


def proximal_logps(policy: Policy, batch: StepBatch, cfg: LearnerConfig, rows: list[int], dist: Dist) -> Tensor:
    """The policy's log-probabilities as this step begins, for this rank's rows (on the
    CPU, in the batch's layout): the proximal policy of decoupled PPO."""
    out = torch.zeros_like(batch.behav_logp_BT)
    with torch.no_grad():
        for mb_rows in _plan(batch, rows, cfg, dist, policy):
            mb = empty_batch(policy.device) if mb_rows is None else batch.take(mb_rows, policy.device)
            logp, _ = policy.forward_logps(mb.seqs, cfg.temperature)
            if mb_rows is not None:
                out[torch.tensor(mb_rows, dtype=torch.long, device="cpu"), : logp.shape[1]] = logp.float().cpu()
    return out


def train_on(
    policy: Policy,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    batch: StepBatch,
    cfg: LearnerConfig,
    dist: Dist | None = None,
    owner: list[int] | None = None,
) -> dict[str, float]:
    """`cfg.updates_per_batch` optimizer steps on `batch`; returns the step's metrics.
    Under torchrun every rank calls it with the whole batch and `owner` (each row's
    rank, `send_step`); each trains on its rows and the metrics are the whole step's."""
    dist = dist or Dist(device=policy.device)
    mine = [i for i in range(len(batch)) if owner is None or owner[i] == dist.rank]
    prox_BT = proximal_logps(policy, batch, cfg, mine, dist) if cfg.updates_per_batch > 1 else None
    sums, grad_norms, k, skipped = _Sums(), [], cfg.updates_per_batch, 0
    for part in [range(len(batch) * i // k, len(batch) * (i + 1) // k) for i in range(k)]:
        optimizer.zero_grad(set_to_none=True)
        loss_before = sums.v["loss"]
        rows = [i for i in mine if i in part]
        num_tokens = int(batch.seqs.mask_BT[part.start : part.stop].sum().item())
        accumulate(
            policy,
            batch,
            cfg,
            prox_BT,
            sums,
            plan=_plan(batch, rows, cfg, dist, policy),
            num_seqs=len(part),
            num_tokens=num_tokens,
            dist=dist,
        )
        grad_norm = float(full_tensor(torch.nn.utils.clip_grad_norm_(policy.trainable_parameters(), cfg.max_grad_norm)))
        loss = dist.all_reduce([sums.v["loss"] - loss_before])[0]
        if not (math.isfinite(grad_norm) and math.isfinite(loss)):  # the same verdict on every rank
            skipped += 1
            log.error("update skipped: loss %s, gradient norm %s (not finite)", loss, grad_norm)
            optimizer.zero_grad(set_to_none=True)
            continue
        grad_norms.append(grad_norm)
        optimizer.step()
        scheduler.step()

    sums.reduce(dist)
    v, n = sums.v, max(sums.v["tokens"], 1.0)
    return {
        "skipped_updates": skipped,
        "loss": v["loss"] / k,
        "grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else math.nan,
        "tokens": int(v["tokens"]),
        # TRL's names: its importance sampling ratio corrects the engine's mismatch, this one
        # also the policy's lag (pi_theta / mu of the version that generated)
        "sampling/importance_sampling_ratio/min": sums.w_min if math.isfinite(sums.w_min) else math.nan,
        "sampling/importance_sampling_ratio/mean": v["w_sum"] / n,
        "sampling/importance_sampling_ratio/max": sums.w_max,
        "sampling/sampling_logp_difference/mean": v["logp_diff"] / n,
        "is_truncated_frac": v["corrected"] / n,
        "ess": (v["w_sum"] ** 2) / (n * v["w_sq"]) if v["w_sq"] > 0 else 1.0,
        "kl_behaviour_k3": v["k3"] / n,
        "clip_ratio/low_mean": v["clipped_low"] / n,
        "clip_ratio/high_mean": (v["clipped"] - v["clipped_low"]) / n,
        "clip_ratio/region_mean": v["clipped"] / n,
        "entropy": v["entropy"] / n,
        "kl": v["kl_ref"] / n,
        "learning_rate": float(scheduler.get_last_lr()[0]),
    }
