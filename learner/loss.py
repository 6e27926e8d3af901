"""The GRPO objective as pure functions over tensors.

Shapes: `_N` one value per completion, `_BT` per token of a (micro-)batch of B
completions padded to T, with `mask_BT` marking real completion tokens.

What each option follows, and where we depart:

* Advantages (`advantages`): GRPO (Shao et al. 2024, DeepSeekMath) centres each
  completion's reward on its group's mean and divides by the group's std; `batch`
  divides by the std of the whole batch instead (as TRL's `scale_rewards="batch"`,
  after Liu et al. 2025's remark that per-group std favours easy and hard
  prompts); `none` is Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-like
  training"), centring only. The std is the unbiased one plus 1e-4, as in TRL.
* Off-policy correction (`importance_weights`): rollouts come from an adapter a few
  versions old, sampled by another engine. The behaviour/proximal ratio w = π_prox/μ
  is either truncated at C (TIS: Yao et al. 2025, "Your efficient RL framework
  secretly brings you off-policy RL training"; the weight is a constant in the
  gradient, as there) or used untruncated where it lies in [low, high] and masked
  elsewhere (MIS, token level as in IcePop; sequence level by the geometric mean of
  the token ratios, as GSPO measures sequence ratios). `none` trusts the rollouts.
* Policy loss (`policy_loss`): the decoupled PPO objective (Hilton et al. 2022,
  "Batch size-invariance for policy optimization", as used by AReaL): the clipped
  ratio is taken against the proximal policy π_prox, the policy at the start of the
  learner step, and the behaviour correction multiplies it from outside the min.
  With one optimizer step per batch π_prox = π_θ (detached), the ratio is 1 and its
  gradient is ∇log π_θ: the objective reduces to w·A·∇log π_θ. Clipping is
  asymmetric (DAPO's clip-higher, Yu et al. 2025). `level="sequence"` is GSPO (Zheng
  et al. 2025): one ratio per sequence, the geometric mean of its tokens' ratios (the
  exp of their mean log-ratio), clipped and applied to every token of it, as TRL's
  `importance_sampling_level="sequence"` does.
* Aggregation (`aggregate`): `token_mean` sums over every token of the step and
  divides by their count (DAPO); `seq_mean` averages each sequence over its tokens,
  then over sequences (the original GRPO); `constant` divides the token sum by
  sequences * max_tokens (Dr. GRPO), so no length bias enters through the
  normaliser. Normalisers are for the whole step, so gradient accumulation over
  micro-batches gives the same gradient as one big batch.
* KL (`kl_k3`): the k3 estimator (Schulman 2020) to the reference policy, which is
  the base model (adapter disabled), weighted by β and added per token, as GRPO does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.utils.checkpoint
from torch import Tensor

AdvantageScale = Literal["group", "batch", "none"]
Correction = Literal["tis", "mis", "none"]
Aggregation = Literal["token_mean", "seq_mean", "constant"]

_STD_EPS = 1e-4
_MAX_LOG_RATIO = 20.0  # exp(20) ~ 5e8: keeps a wild ratio finite without changing sane ones


def advantages(rewards_N: Tensor, group_sizes: list[int], scale: AdvantageScale) -> Tensor:
    """Group-relative advantages for completions laid out group after group."""
    if sum(group_sizes) != rewards_N.numel():
        raise ValueError(f"group sizes sum to {sum(group_sizes)}, got {rewards_N.numel()} rewards")
    if any(n < 1 for n in group_sizes):
        raise ValueError("every group needs at least one completion")
    groups = torch.split(rewards_N.to(torch.float64), group_sizes)
    centred = torch.cat([g - g.mean() for g in groups])
    if scale == "group":
        std_N = torch.cat([torch.full_like(g, g.std().item() if g.numel() > 1 else 0.0) for g in groups])
        out = centred / (std_N + _STD_EPS)
    elif scale == "batch":
        std = (
            rewards_N.to(torch.float64).std() if rewards_N.numel() > 1 else rewards_N.new_zeros((), dtype=torch.float64)
        )
        out = centred / (std + _STD_EPS)
    elif scale == "none":
        out = centred
    else:
        raise ValueError(f"advantage scale {scale!r}: use group, batch or none")
    return out.to(rewards_N.dtype if rewards_N.is_floating_point() else torch.float32)


@dataclass(frozen=True)
class ISWeights:
    weights_BT: Tensor
    """Multiplies each token's loss; a constant (no gradient)."""
    keep_BT: Tensor
    """Tokens that take part in the loss (the mask, less those MIS masked out)."""
    ratio_BT: Tensor
    """The raw ratio π_prox/μ, for metrics."""
    corrected_BT: Tensor
    """Tokens whose weight was truncated (TIS) or masked out (MIS)."""


def importance_weights(
    logp_prox_BT: Tensor,
    logp_behav_BT: Tensor,
    mask_BT: Tensor,
    correction: Correction,
    *,
    tis_cap: float = 2.0,
    mis_level: Literal["token", "sequence"] = "token",
    mis_low: float = 0.5,
    mis_high: float = 2.0,
) -> ISWeights:
    """Behaviour correction weights w = π_prox/μ per token (see the module docstring)."""
    mask = mask_BT.bool()
    log_ratio = (logp_prox_BT.detach() - logp_behav_BT).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    log_ratio = torch.where(mask, log_ratio, torch.zeros_like(log_ratio))
    ratio = log_ratio.exp()
    if correction == "none":
        return ISWeights(torch.ones_like(ratio), mask, ratio, torch.zeros_like(mask))
    if correction == "tis":
        truncated = mask & (ratio > tis_cap)
        return ISWeights(ratio.clamp(max=tis_cap), mask, ratio, truncated)
    if correction == "mis":
        if mis_level == "token":
            inside = (ratio >= mis_low) & (ratio <= mis_high)
            weights = ratio
        elif mis_level == "sequence":
            n = mask.sum(-1).clamp(min=1)
            seq_ratio_B = ((log_ratio * mask).sum(-1) / n).exp()
            inside = ((seq_ratio_B >= mis_low) & (seq_ratio_B <= mis_high)).unsqueeze(-1).expand_as(mask)
            weights = seq_ratio_B.unsqueeze(-1).expand_as(ratio)
        else:
            raise ValueError(f"mis level {mis_level!r}: use token or sequence")
        keep = mask & inside
        return ISWeights(torch.where(keep, weights, torch.zeros_like(weights)), keep, ratio, mask & ~inside)
    raise ValueError(f"correction {correction!r}: use tis, mis or none")


def policy_loss(
    logp_BT: Tensor,
    logp_prox_BT: Tensor,
    advantages_B: Tensor,
    weights_BT: Tensor,
    *,
    epsilon_low: float,
    epsilon_high: float,
    level: Literal["token", "sequence"] = "token",
    mask_BT: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Per-token decoupled-PPO loss and where clipping bit; `logp_prox_BT` is detached.
    `level="sequence"` (GSPO) needs `mask_BT` to average each sequence's log-ratios."""
    log_ratio = logp_BT - logp_prox_BT.detach()
    if level == "sequence":
        if mask_BT is None:
            raise ValueError("sequence-level ratios need mask_BT")
        seq_B = (log_ratio * mask_BT).sum(-1) / mask_BT.sum(-1).clamp(min=1.0)
        log_ratio = seq_B.unsqueeze(-1).expand_as(logp_BT)
    elif level != "token":
        raise ValueError(f"importance sampling level {level!r}: use token or sequence")
    ratio = log_ratio.exp()
    adv = advantages_B.unsqueeze(-1)
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - epsilon_low, 1 + epsilon_high) * adv
    loss_BT = -torch.minimum(unclipped, clipped) * weights_BT.detach()
    clip_BT = clipped < unclipped
    return loss_BT, clip_BT


def kl_k3(logp_BT: Tensor, logp_ref_BT: Tensor) -> Tensor:
    """k3 estimate of KL(π_θ || π_ref) per token, for tokens sampled from (about) π_θ."""
    delta = logp_ref_BT.detach() - logp_BT
    return delta.exp() - delta - 1


def aggregate(
    loss_BT: Tensor,
    mask_BT: Tensor,
    mode: Aggregation,
    *,
    num_seqs: int,
    num_tokens: int,
    max_tokens: int,
) -> Tensor:
    """This micro-batch's share of the step's loss; `num_seqs` and `num_tokens` count the
    whole step, so shares summed over micro-batches give the full-batch value."""
    masked = loss_BT * mask_BT
    if mode == "token_mean":
        return masked.sum() / max(num_tokens, 1)
    if mode == "seq_mean":
        per_seq = masked.sum(-1) / mask_BT.sum(-1).clamp(min=1)
        return per_seq.sum() / max(num_seqs, 1)
    if mode == "constant":
        return masked.sum() / (max(num_seqs, 1) * max_tokens)
    raise ValueError(f"aggregation {mode!r}: use token_mean, seq_mean or constant")


ACTIVATION_FLOATS_PER_LAYER_WIDTH = 32
"""What a token's activations kept for backward cost, in units of (layers x hidden x
bytes per element): the residual stream, attention's projections and LoRA's inputs, the MLP
(~2.7x wider). Measured on SmolLM2 (30 x 576, float32): 2.4 MB a token at 796-token
sequences, attention's scores included; this rule says 2.2."""


CHUNK_ELEMENTS = 1 << 25
"""Positions x vocabulary of one chunk of the log-softmax (128 MB in float32): SmolLM2's
49,152-token vocabulary, 682 positions a chunk; Qwen2.5's 151,936, 220."""


def token_logps(logits_BTV: Tensor, targets_BT: Tensor, temperature: float) -> Tensor:
    """log softmax(logits / temperature) at the target tokens, chunk by chunk of positions
    (`CHUNK_ELEMENTS`): the float32 copy, its log-sum-exp and, in backward, its softmax
    exist for one chunk at a time (each chunk is recomputed in backward,
    `torch.utils.checkpoint`), never for the whole (B, T, V). Same values and gradients
    as the whole-tensor form to float32 rounding (tested)."""
    B, T, V = logits_BTV.shape
    flat_NV, targets_N = logits_BTV.reshape(B * T, V), targets_BT.reshape(B * T)
    step = max(1, CHUNK_ELEMENTS // max(V, 1))
    grad = torch.is_grad_enabled() and logits_BTV.requires_grad
    parts = [
        torch.utils.checkpoint.checkpoint(
            _picked_logp, flat_NV[i : i + step], targets_N[i : i + step], temperature, use_reentrant=False
        )
        if grad
        else _picked_logp(flat_NV[i : i + step], targets_N[i : i + step], temperature)
        for i in range(0, B * T, step)
    ]
    return (torch.cat(parts) if parts else flat_NV.new_zeros(0, dtype=torch.float32)).reshape(B, T)


def _picked_logp(logits_NV: Tensor, targets_N: Tensor, temperature: float) -> Tensor:
    scaled = logits_NV.float() / temperature
    return scaled.gather(-1, targets_N.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(scaled, dim=-1)


def entropy(logits_BTV: Tensor, temperature: float) -> Tensor:
    """Entropy of the sampling distribution per position (no gradient), chunk by chunk."""
    B, T, V = logits_BTV.shape
    flat_NV = logits_BTV.reshape(B * T, V)
    step = max(1, CHUNK_ELEMENTS // max(V, 1))
    with torch.no_grad():
        parts = []
        for i in range(0, B * T, step):
            logp = torch.log_softmax(flat_NV[i : i + step].float() / temperature, dim=-1)
            parts.append(-(logp.exp() * logp).sum(-1))
        return (torch.cat(parts) if parts else flat_NV.new_zeros(0, dtype=torch.float32)).reshape(B, T)


def sampling_moments(
    logits_BTV: Tensor,
    targets_BT: Tensor,
    temperature: float,
    *,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """Per position, with no gradient, chunk by chunk, for the distribution q a worker
    samples from (`truncate`: temperature, then top-k, top-p and min-p, as Hugging Face
    and vLLM apply them): log q(target), and E[log q(x)] and Var[log q(x)] for x drawn from
    q. Summed over a sequence of sampled tokens, (log q(x) - E) / sqrt(Var) is a z-score
    near 0 for tokens drawn from q, and far below it for tokens drawn elsewhere
    (`learner.audit`). A target outside q's support (a worker rounding differently at
    the top-p boundary) counts as q's least likely token there."""
    B, T, V = logits_BTV.shape
    flat_NV, targets_N = logits_BTV.reshape(B * T, V), targets_BT.reshape(B * T)
    step = max(1, CHUNK_ELEMENTS // max(V, 1))
    picked, means, variances = [], [], []
    with torch.no_grad():
        for i in range(0, B * T, step):
            kept = truncate(flat_NV[i : i + step].float() / temperature, top_k, top_p, min_p)
            out = ~torch.isfinite(kept)
            logq = torch.log_softmax(kept, dim=-1).masked_fill(out, 0.0)  # q = 0 there: no term of the sums
            q = logq.exp().masked_fill(out, 0.0)
            floor = logq.masked_fill(out, math.inf).amin(-1)
            mean = (q * logq).sum(-1)
            target = logq.gather(-1, targets_N[i : i + step].unsqueeze(-1)).squeeze(-1)
            outside = out.gather(-1, targets_N[i : i + step].unsqueeze(-1)).squeeze(-1)
            picked.append(torch.where(outside, floor, target))
            means.append(mean)
            variances.append(((q * logq.square()).sum(-1) - mean.square()).clamp_min(0.0))
    empty = flat_NV.new_zeros(0, dtype=torch.float32)
    return tuple(  # type: ignore[return-value]
        (torch.cat(parts) if parts else empty).reshape(B, T) for parts in (picked, means, variances)
    )


def truncate(scaled_NV: Tensor, top_k: int, top_p: float, min_p: float) -> Tensor:
    """Temperature-scaled logits with the tokens top-k, top-p and min-p leave out set to
    -inf, in that order (Hugging Face's warpers; vLLM's sampler keeps the same sets)."""
    out = scaled_NV
    V = out.shape[-1]
    if 0 < top_k < V:
        kth = out.topk(top_k, dim=-1).values[..., -1:]
        out = out.masked_fill(out < kth, -math.inf)
    if top_p < 1.0:
        sorted_, order = out.sort(dim=-1, descending=True)
        probs = sorted_.softmax(-1)
        mass_before = probs.cumsum(-1) - probs  # the first token is always kept
        drop = torch.zeros_like(out, dtype=torch.bool).scatter(-1, order, mass_before >= top_p)
        out = out.masked_fill(drop, -math.inf)
    if min_p > 0.0:
        probs = out.softmax(-1)
        out = out.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), -math.inf)
    return out
