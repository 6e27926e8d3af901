"""One learner step, in one process or as a rank of torchrun (tests/test_distributed.py).

    python tests/dist_step.py MODEL OUT              # one process
    torchrun --nproc-per-node 2 tests/dist_step.py MODEL OUT

For each loss aggregation (and once with two updates per batch), from the same adapter
and the same step batch: every rank trains on its share (`train_on` with each row's
rank), then the full LoRA gradient and the updated adapter are gathered; rank 0 writes
them to OUT (safetensors, `<case>/grad/<name>` and `<case>/adapter/<name>`) and the
step's metrics to OUT.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])  # the repository, as under pytest

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from learner.batch import StepBatch  # noqa: E402
from learner.config import LearnerConfig  # noqa: E402
from learner.dist import Dist, full_tensor, split_rows  # noqa: E402
from learner.loss import advantages  # noqa: E402
from learner.policy import pack_sequences  # noqa: E402
from learner.train import train_on  # noqa: E402
from learner.trainer import Trainer  # noqa: E402

CASES = {
    "token_mean": {"loss_agg": "token_mean"},
    "seq_mean": {"loss_agg": "seq_mean"},
    "constant": {"loss_agg": "constant"},
    "ppo2": {"loss_agg": "token_mean", "updates_per_batch": 2},
}


def step_batch(policy, temperature: float) -> StepBatch:
    g = torch.Generator(device="cpu").manual_seed(0)
    lengths = [(3, 6), (5, 2), (3, 4), (5, 6), (4, 1), (2, 6), (6, 3), (3, 5)]
    prompts = [torch.randint(4, 60, (p,), generator=g).tolist() for p, _ in lengths]
    completions = [torch.randint(4, 60, (c,), generator=g).tolist() for _, c in lengths]
    seqs = pack_sequences(prompts, completions, policy.pad_id)
    with torch.no_grad():  # every rank runs this forward (FSDP's gathers pair up)
        logp, _ = policy.forward_logps(seqs, temperature)
    # behaviour log-probabilities near the policy's: weights away from 1, a few masked by MIS
    behav = (seqs.mask_BT * (logp + 0.4 * torch.randn(logp.shape, generator=g, device="cpu"))).float()
    rewards = torch.rand(len(lengths), generator=g, device="cpu")
    return StepBatch(seqs, behav, advantages(rewards, [2, 2, 2, 2], "group"), rewards)


def main() -> None:
    model, out = sys.argv[1], Path(sys.argv[2])
    dist = Dist.from_env("cpu")
    tensors, figures = {}, {}
    for case, overrides in CASES.items():
        cfg = LearnerConfig(
            model=model,
            lora_rank=4,
            max_tokens=6,
            learning_rate=1e-2,
            temperature=0.9,
            micro_batch_size=2,
            max_tokens_per_microbatch=24,
            **overrides,
        )  # several uneven passes
        torch.manual_seed(0)
        trainer = Trainer(cfg, dist)
        g = torch.Generator(device="cpu").manual_seed(1)
        start = {
            n: 0.05 * torch.randn(t.shape, generator=g, device="cpu") for n, t in trainer.policy.adapter_state().items()
        }
        trainer.policy.load_adapter_state(start if dist.main else {})
        batch = step_batch(trainer.policy, cfg.temperature)
        owner = split_rows(batch.lengths(), dist.world) if dist.enabled else None
        figures[case] = train_on(trainer.policy, trainer.optimizer, trainer.scheduler, batch, cfg, dist, owner)
        for name, p in trainer.policy.model.named_parameters():
            if p.requires_grad:
                tensors[f"{case}/grad/{name}"] = full_tensor(p.grad).detach().cpu().contiguous()
        for name, t in trainer.policy.adapter_state().items():
            tensors[f"{case}/adapter/{name}"] = t
    if dist.main:
        save_file(tensors, str(out))
        out.with_suffix(".json").write_text(json.dumps(figures))
    dist.exit(0)


if __name__ == "__main__":
    main()
