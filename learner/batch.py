"""The step's batch: a step's rollout groups as packed sequences with their behaviour
log-probabilities, group-relative advantages and rewards (`build_step_batch`), and its
micro-batches by a token budget (`plan_micro_batches`). Built on the CPU; each
micro-batch moves to the policy's device (`StepBatch.take`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from learner.config import LearnerConfig
from learner.loss import advantages
from learner.policy import Sequences, pack_sequences, scatter_completion_values
from protocol import RolloutGroup


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

    def tensors(self) -> list[Tensor]:
        """Every tensor of the batch, in a fixed order (what rank 0 sends the others)."""
        return [
            self.seqs.input_ids_BL,
            self.seqs.attention_mask_BL,
            self.seqs.mask_BT,
            self.behav_logp_BT,
            self.advantages_N,
            self.rewards_N,
        ]

    def lengths(self) -> list[int]:
        """Prompt+completion tokens of each row (without padding)."""
        return [int(x) for x in self.seqs.attention_mask_BL.sum(1).tolist()]

    def take(self, rows: list[int], device: torch.device) -> StepBatch:
        """These rows, cut to their own longest sequence (right padding beyond it is
        waste), on `device`."""
        index = torch.tensor(rows, dtype=torch.long, device=self.seqs.input_ids_BL.device)
        width = int(self.seqs.attention_mask_BL.index_select(0, index).sum(1).max().item())
        seqs = Sequences(
            self.seqs.input_ids_BL.index_select(0, index)[:, :width].to(device),
            self.seqs.attention_mask_BL.index_select(0, index)[:, :width].to(device),
            self.seqs.mask_BT.index_select(0, index)[:, : width - 1].to(device),
        )
        return StepBatch(
            seqs,
            self.behav_logp_BT.index_select(0, index)[:, : width - 1].to(device),
            self.advantages_N.index_select(0, index).to(device),
            self.rewards_N.index_select(0, index).to(device),
        )


def zeros_batch(b: int, width: int, device: torch.device) -> StepBatch:
    """A step batch of `b` rows of `width`, all zeros (to be filled, or as it is)."""
    return StepBatch(
        Sequences(
            torch.zeros((b, width), dtype=torch.long, device=device),
            torch.zeros((b, width), dtype=torch.long, device=device),
            torch.zeros((b, width - 1), dtype=torch.float32, device=device),
        ),
        torch.zeros((b, width - 1), dtype=torch.float32, device=device),
        torch.zeros(b, dtype=torch.float32, device=device),
        torch.zeros(b, dtype=torch.float32, device=device),
    )


def empty_batch(device: torch.device) -> StepBatch:
    """One two-token sequence with no completion token: a pass that contributes nothing,
    for a rank with fewer micro-batches than another (FSDP's collectives must pair up)."""
    batch = zeros_batch(1, 2, device)
    batch.seqs.attention_mask_BL.fill_(1)
    return batch


def build_step_batch(groups: list[RolloutGroup], cfg: LearnerConfig, pad_id: int) -> StepBatch:
    """The step's sequences, on the CPU (micro-batches go to the device one at a time).
    With `mask_truncated_completions`, a completion that hit max_tokens keeps its place
    in its group's advantages but has no token in the loss. An episode's environment
    tokens (tool results, the template's glue: `Completion.mask`) are context only: out of
    the loss, the importance weights and every token count."""
    prompts, completions, behav, rewards, sizes, truncated, model = [], [], [], [], [], [], []
    episodes = False
    for group in groups:
        prompt = group.prompt_tokens.tolist()
        sizes.append(len(group.completions))
        for c in group.completions:
            prompts.append(prompt)
            completions.append(c.tokens.tolist())
            behav.append(c.logps)
            model.append(c.model_mask)
            episodes = episodes or c.mask is not None
            rewards.append(float(c.reward))  # type: ignore[arg-type]  # checked by the collector
            truncated.append(c.finish_reason == "length")
    seqs = pack_sequences(prompts, completions, pad_id)
    if cfg.mask_truncated_completions:
        seqs.mask_BT[torch.tensor(truncated, dtype=torch.bool, device="cpu")] = 0.0
    width = seqs.input_ids_BL.shape[1]
    if episodes:
        seqs.mask_BT.mul_(scatter_completion_values(model, [len(p) for p in prompts], width))
    behav_BT = scatter_completion_values(behav, [len(p) for p in prompts], width)
    rewards_N = torch.tensor(rewards, dtype=torch.float32, device="cpu")
    return StepBatch(seqs, behav_BT, advantages(rewards_N, sizes, cfg.advantage_scale), rewards_N)


def plan_micro_batches(lengths: list[int], rows: list[int], max_tokens: int, max_rows: int) -> list[list[int]]:
    """`rows` in micro-batches by a token budget: longest first, each micro-batch as many
    rows as keep rows x its longest (the padded size, what memory scales with) within
    `max_tokens`, and at most `max_rows`. A sequence longer than the budget goes alone."""
    out: list[list[int]] = []
    current: list[int] = []
    for i in sorted(rows, key=lambda i: (-lengths[i], i)):
        longest = lengths[current[0]] if current else lengths[i]  # sorted: the first is the longest
        if current and (longest * (len(current) + 1) > max_tokens or len(current) >= max_rows):
            out.append(current)
            current = []
        current.append(i)
    if current:
        out.append(current)
    return out
