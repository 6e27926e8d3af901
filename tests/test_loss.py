"""The loss functions against hand-computed values, micro-batching against one big
batch, and the on-policy gradient against TRL's GRPOTrainer."""

from __future__ import annotations

import math

import pytest
import torch

from learner.batch import StepBatch
from learner.config import LearnerConfig
from learner.loss import advantages, aggregate, importance_weights, kl_k3, policy_loss, token_logps
from learner.policy import Policy, pack_sequences
from learner.train import _Sums, accumulate

LOG = math.log


def test_advantages_by_group_batch_and_none() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5])
    group_std = math.sqrt(0.5)  # unbiased std of [1, 0]
    assert advantages(rewards, [2, 2], "group").tolist() == pytest.approx(
        [0.5 / (group_std + 1e-4), -0.5 / (group_std + 1e-4), 0.0, 0.0]
    )
    batch_std = math.sqrt(0.5 / 3)
    assert advantages(rewards, [2, 2], "batch").tolist() == pytest.approx(
        [0.5 / (batch_std + 1e-4), -0.5 / (batch_std + 1e-4), 0.0, 0.0]
    )
    assert advantages(rewards, [2, 2], "none").tolist() == pytest.approx([0.5, -0.5, 0.0, 0.0])
    # unequal groups
    assert advantages(torch.tensor([3.0, 1.0, 2.0]), [1, 2], "none").tolist() == pytest.approx([0.0, -0.5, 0.5])
    with pytest.raises(ValueError, match="group sizes"):
        advantages(rewards, [2, 3], "group")


def test_truncated_importance_sampling() -> None:
    prox = torch.tensor([[LOG(1.0), LOG(3.0), LOG(0.5), 5.0]])
    behav = torch.zeros(1, 4)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])  # the last token is padding
    w = importance_weights(prox, behav, mask, "tis", tis_cap=2.0)
    assert w.weights_BT[0, :3].tolist() == pytest.approx([1.0, 2.0, 0.5])
    assert w.corrected_BT[0].tolist() == [False, True, False, False]
    assert w.keep_BT[0].tolist() == [True, True, True, False]
    assert w.ratio_BT[0, 3].item() == 1.0  # padding never produces a wild ratio


def test_masked_importance_sampling_token_and_sequence() -> None:
    prox = torch.tensor([[LOG(1.0), LOG(3.0), LOG(0.5), LOG(0.4)]])
    w = importance_weights(prox, torch.zeros(1, 4), torch.ones(1, 4), "mis", mis_low=0.5, mis_high=2.0)
    assert w.keep_BT[0].tolist() == [True, False, True, False]
    assert w.weights_BT[0].tolist() == pytest.approx([1.0, 0.0, 0.5, 0.0])
    assert w.corrected_BT[0].tolist() == [False, True, False, True]

    # sequence level: geometric mean of token ratios; 2 is inside [0.5, 2], 3 is not
    prox = torch.tensor([[LOG(2.0), LOG(2.0)], [LOG(9.0), 0.0]])
    w = importance_weights(
        prox, torch.zeros(2, 2), torch.ones(2, 2), "mis", mis_level="sequence", mis_low=0.5, mis_high=2.0
    )
    assert w.keep_BT.tolist() == [[True, True], [False, False]]
    assert w.weights_BT.flatten().tolist() == pytest.approx([2.0, 2.0, 0.0, 0.0])


def test_no_correction_weights_are_one() -> None:
    w = importance_weights(torch.tensor([[3.0]]), torch.tensor([[-3.0]]), torch.ones(1, 1), "none")
    assert w.weights_BT.tolist() == [[1.0]] and w.ratio_BT.item() == pytest.approx(math.exp(6))


def test_policy_loss_clips_against_the_proximal_policy() -> None:
    prox = torch.zeros(1, 3)
    logp = torch.tensor([[LOG(1.5), LOG(0.5), LOG(0.9)]], requires_grad=True)
    adv = torch.tensor([1.0])
    weights = torch.tensor([[1.0, 2.0, 1.0]])
    loss, clipped = policy_loss(logp, prox, adv, weights, epsilon_low=0.2, epsilon_high=0.28)
    # ratio 1.5 with A>0 clips at 1+0.28; ratio 0.5 with A>0 is not clipped (min takes it)
    assert loss[0].tolist() == pytest.approx([-1.28, -0.5 * 2.0, -0.9])
    assert clipped[0].tolist() == [True, False, False]
    loss.sum().backward()
    # d/dlogp of -ratio*A*w = -ratio*w where unclipped, 0 where clipped
    assert logp.grad[0].tolist() == pytest.approx([0.0, -0.5 * 2.0, -0.9])

    neg = policy_loss(
        torch.tensor([[LOG(0.5)]]),
        torch.zeros(1, 1),
        torch.tensor([-1.0]),
        torch.ones(1, 1),
        epsilon_low=0.2,
        epsilon_high=0.28,
    )
    assert neg[0].item() == pytest.approx(0.8) and neg[1].item()


def test_k3_kl() -> None:
    kl = kl_k3(torch.zeros(1, 2), torch.tensor([[LOG(2.0), 0.0]]))
    assert kl[0].tolist() == pytest.approx([2.0 - LOG(2.0) - 1.0, 0.0])


def test_aggregation_modes() -> None:
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    kw = {"num_seqs": 2, "num_tokens": 4, "max_tokens": 5}
    assert aggregate(loss, mask, "token_mean", **kw).item() == pytest.approx(10 / 4)
    assert aggregate(loss, mask, "seq_mean", **kw).item() == pytest.approx((6 / 3 + 4 / 1) / 2)
    assert aggregate(loss, mask, "constant", **kw).item() == pytest.approx(10 / (2 * 5))
    # shares of a split batch add up to the whole
    for mode in ("token_mean", "seq_mean", "constant"):
        parts = aggregate(loss[:1], mask[:1], mode, **kw) + aggregate(loss[1:], mask[1:], mode, **kw)
        assert parts.item() == pytest.approx(aggregate(loss, mask, mode, **kw).item())


def test_token_logps_match_log_softmax_at_temperature() -> None:
    logits = torch.randn(2, 3, 7)
    targets = torch.randint(0, 7, (2, 3))
    expected = torch.log_softmax(logits / 0.7, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(token_logps(logits, targets, 0.7), expected, atol=1e-6)


def test_token_logps_in_chunks_give_the_whole_tensors_values_and_gradients(monkeypatch) -> None:
    """The log-softmax runs chunk by chunk of positions, each recomputed in backward: the
    same values, gradients and entropies as on the whole (B, T, V) tensor."""
    import learner.loss as loss

    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11, requires_grad=True)
    targets = torch.randint(0, 11, (3, 5))
    weights = torch.randn(3, 5)
    whole = torch.log_softmax(logits / 0.7, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    (whole * weights).sum().backward()
    expected_grad, logits.grad = logits.grad.clone(), None
    monkeypatch.setattr(loss, "CHUNK_ELEMENTS", 4 * 11)  # 4 positions a chunk: 4 chunks, the last one short
    chunked = token_logps(logits, targets, 0.7)
    (chunked * weights).sum().backward()
    assert torch.allclose(chunked, whole, atol=1e-6)
    assert torch.allclose(logits.grad, expected_grad, atol=1e-7)
    p = torch.softmax(logits.detach() / 0.7, -1)
    assert torch.allclose(loss.entropy(logits.detach(), 0.7), -(p * p.log()).sum(-1), atol=1e-5)


# ---------------------------------------------------------------- on a real model


def _policy(tiny_model, **overrides) -> Policy:
    cfg = LearnerConfig(model=str(tiny_model), lora_rank=4, temperature=0.8, max_tokens=6, **overrides)
    policy = Policy(cfg)
    torch.manual_seed(1)
    with torch.no_grad():  # a non-zero B, so every LoRA weight gets a gradient
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return policy


def _on_policy_batch(policy: Policy) -> tuple[StepBatch, list[list[int]], list[list[int]]]:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 60, (n,), generator=g).tolist() for n in (3, 5, 3, 5)]
    completions = [torch.randint(4, 60, (n,), generator=g).tolist() for n in (6, 2, 4, 6)]
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.2])
    seqs = pack_sequences(prompts, completions, policy.pad_id)
    with torch.no_grad():
        behaviour, _ = policy.forward_logps(seqs, policy.cfg.temperature)
    return StepBatch(seqs, behaviour, advantages(rewards, [2, 2], "group"), rewards), prompts, completions


def _grads(policy: Policy) -> dict[str, torch.Tensor]:
    out = {
        n.removeprefix("base_model.model."): p.grad.clone()
        for n, p in policy.model.named_parameters()
        if p.requires_grad
    }
    policy.model.zero_grad(set_to_none=True)
    return out


def test_the_head_runs_only_from_the_first_completion_and_the_gradient_is_unchanged(tiny_model, monkeypatch) -> None:
    """`forward_logps` projects to the vocabulary only from the earliest completion
    position (`logits_to_keep`) and takes the log-softmax in chunks: its log-probabilities
    and the adapter's gradient are those of the whole-logits computation."""
    import learner.loss as loss

    policy = _policy(tiny_model)
    batch, _, _ = _on_policy_batch(policy)
    seqs, mask = batch.seqs, batch.seqs.mask_BT
    logits = policy.model(input_ids=seqs.input_ids_BL, attention_mask=seqs.attention_mask_BL, use_cache=False).logits
    whole = torch.log_softmax(logits[:, :-1].float() / 0.8, -1).gather(-1, seqs.targets_BT.unsqueeze(-1)).squeeze(-1)
    (whole * mask).sum().backward()
    expected = _grads(policy)
    monkeypatch.setattr(loss, "CHUNK_ELEMENTS", 3 * policy.vocab_size)
    seen: list[int] = []
    original = policy.model.forward

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        seen.append(out.logits.shape[1])
        return out

    monkeypatch.setattr(policy.model, "forward", spy)
    logps, ent = policy.forward_logps(seqs, 0.8, with_entropy=True)
    (logps * mask).sum().backward()
    got = _grads(policy)
    first = int(mask.any(0).nonzero()[0])
    assert first == 2 and seen == [mask.shape[1] - first]  # the shortest prompt is 3 tokens: two positions skipped
    assert torch.allclose(logps * mask, whole.detach() * mask, atol=1e-5)
    assert ent is not None and ent.shape == mask.shape
    for name, grad in expected.items():  # to float32 rounding at the gradient's scale (other matmul shapes)
        assert torch.allclose(grad, got[name], atol=1e-5 * float(grad.abs().max()), rtol=1e-4), name


def test_gradient_checkpointing_gives_the_same_gradient(tiny_model) -> None:
    """`--gradient-checkpointing` (activations recomputed in backward, to fit long sequences)
    changes memory, not the gradient; it failed to start under transformers 5.2x."""
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)  # the same LoRA A in both
        policy = _policy(tiny_model, gradient_checkpointing=checkpointing)
        batch, _, _ = _on_policy_batch(policy)
        accumulate(policy, batch, policy.cfg, None, _Sums())
        grads.append(_grads(policy))
    for name, grad in grads[0].items():
        assert torch.allclose(grad, grads[1][name], atol=1e-6, rtol=1e-4), name


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean", "constant"])
def test_micro_batches_give_the_full_batch_gradient(tiny_model, mode) -> None:
    policy = _policy(tiny_model, loss_agg=mode)
    batch, _, _ = _on_policy_batch(policy)
    accumulate(policy, batch, policy.cfg.model_copy(update={"micro_batch_size": 4}), None, _Sums())
    whole = _grads(policy)
    accumulate(policy, batch, policy.cfg.model_copy(update={"micro_batch_size": 1}), None, _Sums())
    split = _grads(policy)
    for name, grad in whole.items():
        assert torch.allclose(grad, split[name], atol=1e-6, rtol=1e-4), name


@pytest.mark.slow
# TRL and transformers emit deprecation warnings about their own internals
@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning", "ignore::DeprecationWarning")
@pytest.mark.parametrize(("mode", "trl_loss"), [("token_mean", "bnpo"), ("seq_mean", "grpo"), ("constant", "dr_grpo")])
def test_on_policy_gradient_equals_trl_grpo_trainer(tiny_model, tmp_path, mode, trl_loss) -> None:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    policy = _policy(tiny_model, loss_agg=mode, micro_batch_size=3)
    batch, prompts, completions = _on_policy_batch(policy)
    accumulate(policy, batch, policy.cfg, None, _Sums())
    ours = _grads(policy)

    args = GRPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        loss_type=trl_loss,
        beta=0.0,
        temperature=policy.cfg.temperature,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=policy.cfg.max_tokens,
        report_to="none",
        epsilon=0.2,
        epsilon_high=0.28,
    )
    trainer = GRPOTrainer(
        model=policy.model,
        reward_funcs=lambda completions, **_: [0.0] * len(completions),
        args=args,
        train_dataset=Dataset.from_list([{"prompt": "ab"}] * 4),
        processing_class=policy.tokenizer,
    )
    trainer.current_gradient_accumulation_steps = 1
    width_p, width_c = max(map(len, prompts)), max(map(len, completions))
    inputs = {  # TRL's layout: prompts left-padded, completions right-padded
        "prompt_ids": torch.tensor([[0] * (width_p - len(p)) + p for p in prompts]),
        "prompt_mask": torch.tensor([[0] * (width_p - len(p)) + [1] * len(p) for p in prompts]),
        "completion_ids": torch.tensor([c + [0] * (width_c - len(c)) for c in completions]),
        "completion_mask": torch.tensor([[1] * len(c) + [0] * (width_c - len(c)) for c in completions]),
        "advantages": batch.advantages_N,
    }
    inputs["num_items_in_batch"] = inputs["completion_mask"].sum()
    trainer.model.train()
    trainer._compute_loss(trainer.model, inputs).backward()
    theirs = _grads(policy)

    assert set(ours) == set(theirs) and len(ours) > 0
    for name, grad in ours.items():
        scale = theirs[name].abs().max().item()
        assert scale > 0, f"{name}: TRL computed no gradient"
        assert (grad - theirs[name]).abs().max().item() <= 1e-4 * scale, name


def test_an_episodes_environment_tokens_take_no_part_in_the_loss(tiny_model) -> None:
    """Tool results and the template's glue (mask 0) are context only: what they say, and
    any log-probability sent for them, changes no gradient except through the model
    tokens after them (none here: they end the episode), and the step counts the model's
    tokens only. Trained as the model's, the same tokens would change the gradient."""
    import msgspec
    from factories import batch, group

    from learner.batch import build_step_batch
    from protocol import Completion

    policy = _policy(tiny_model)
    cfg = policy.cfg
    mask = [1, 1, 0, 0, 0, 1, 1, 0, 0]  # model, tool result, model, glue at the end

    def step_grads(
        tail: list[int], env_logp: float, episode_mask: list[int] | None, cfg: LearnerConfig = cfg
    ) -> tuple[dict, float]:
        completions = [
            Completion.of(
                [10 + k, 11, 20, 21, 22, 12 + k, 13, *tail],
                [-1.0 if m else env_logp for m in mask],
                episode_mask,
                finish_reason="stop",
                reward=float(k),
                turns=2,
                tool_calls=1,
            )
            for k in range(2)
        ]
        episode_group = msgspec.structs.replace(group(batch(), completions=2), completions=completions)
        sums = _Sums()
        accumulate(policy, build_step_batch([episode_group], cfg, policy.pad_id), cfg, None, sums)
        return _grads(policy), sums.v["tokens"]

    masked, tokens = step_grads([30, 31], 0.0, mask)
    assert tokens == 2 * sum(mask)
    other_tail, _ = step_grads([40, 41], -7.0, mask)  # other glue, and a lie about its log-probability
    for name, grad in masked.items():
        assert torch.equal(grad, other_tail[name]), name
    # without the mask and its correction (MIS would mask tokens whose ratio to a 0.0
    # log-probability is far off), the same tokens are trained
    no_correction = cfg.model_copy(update={"correction": "none"})
    masked, _ = step_grads([30, 31], 0.0, mask, no_correction)
    trained, all_tokens = step_grads([30, 31], 0.0, None, no_correction)
    assert all_tokens == 2 * len(mask)
    assert any(not torch.allclose(grad, trained[name]) for name, grad in masked.items())


def test_the_token_budget_shrinks_with_the_vocabulary() -> None:
    """A real vocabulary's logits, several float32 copies per pass, ran 16,384 tokens out of
    a 24 GiB machine: unless told, the budget keeps one copy near 1 GiB."""
    from learner.train import token_budget

    cfg = LearnerConfig()
    assert token_budget(cfg, 67) == 16384  # the tiny model: the old default
    assert token_budget(cfg, 49152) == 5461  # SmolLM2
    assert token_budget(cfg, 151936) == 1766  # Qwen2.5
    assert token_budget(cfg.model_copy(update={"max_tokens_per_microbatch": 20000}), 151936) == 20000
    smollm2 = 30 * 576 * 4 * 32  # the activation rule: layers x hidden x float32 x 32
    assert token_budget(cfg, 49152, smollm2) == 970  # activations, not logits, bind (2 GiB on a CPU)
    assert token_budget(cfg, 49152, smollm2, 80 << 30) == 5461  # a quarter of an 80 GB GPU: the logits bind
