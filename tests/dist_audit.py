"""An audit's forward passes, in one process or as rank 0 of torchrun driving the others
with AUDIT (tests/test_distributed.py).

    python tests/dist_audit.py MODEL OUT              # one process
    torchrun --nproc-per-node 2 tests/dist_audit.py MODEL OUT

From the same live adapter, rank 0 runs `Trainer.audit_moments` on the same sequences as
the live policy, as the base model and with another version's adapter swapped in, while
the other ranks `follow`. It writes each pass's three tensors (`<mode>/logp|mean|var`)
and the live adapter read after each pass (`<mode>/adapter/<name>`) to OUT.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])  # the repository, as under pytest

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from learner.audit import BASE, LIVE, SWAPPED  # noqa: E402
from learner.config import LearnerConfig  # noqa: E402
from learner.dist import Dist  # noqa: E402
from learner.policy import pack_sequences  # noqa: E402
from learner.trainer import Trainer  # noqa: E402


def main() -> None:
    model, out = sys.argv[1], Path(sys.argv[2])
    dist = Dist.from_env("cpu")
    cfg = LearnerConfig(model=model, lora_rank=4, max_tokens=6, temperature=0.9, top_p=0.95)
    torch.manual_seed(0)
    trainer = Trainer(cfg, dist)
    g = torch.Generator(device="cpu").manual_seed(1)
    shapes = {n: t.shape for n, t in trainer.policy.adapter_state().items()}
    live = {n: 0.05 * torch.randn(s, generator=g, device="cpu") for n, s in shapes.items()}
    other = {n: 0.2 * torch.randn(s, generator=g, device="cpu") for n, s in shapes.items()}
    trainer.policy.load_adapter_state(live if dist.main else {})
    if not dist.main:
        trainer.follow()  # AUDIT, AUDIT, AUDIT, then ADAPTER after each, then STOP
        dist.exit(0)
    lengths = [(3, 6), (5, 2), (3, 4), (5, 6)]
    prompts = [torch.randint(4, 60, (p,), generator=g).tolist() for p, _ in lengths]
    completions = [torch.randint(4, 60, (c,), generator=g).tolist() for _, c in lengths]
    seqs = pack_sequences(prompts, completions, trainer.policy.pad_id)
    tensors = {}
    for name, mode, state in (("live", LIVE, None), ("base", BASE, None), ("swapped", SWAPPED, other)):
        logp, mean, var = trainer.audit_moments(seqs, mode, state)
        tensors |= {f"{name}/logp": logp, f"{name}/mean": mean, f"{name}/var": var}
        tensors |= {f"{name}/adapter/{n}": t for n, t in trainer.adapter().items()}
    tensors |= {f"start/adapter/{n}": t.contiguous() for n, t in live.items()}
    tensors["mask"] = seqs.mask_BT
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(out))
    trainer.stop()
    dist.exit(0)


if __name__ == "__main__":
    main()
