"""The real model (SmolLM2-135M-Instruct, `learner make-model`) on this machine: what
the learner's dtype costs, and what each engine generates.

- dtype: one learner step (forward, backward, AdamW on LoRA r=16) on the arithmetic
  example's shape (2 groups of 8, 60 prompt + 32 completion tokens) with the base
  weights in float32 and in bfloat16, the same batch, in this process: seconds per step,
  the ratio bfloat16/float32, and how far bfloat16's token log-probabilities are from
  float32's (mean |delta|).
- engine: completion tokens per second of the `transformers` engine (float32 and
  bfloat16) on 16 arithmetic prompts x 8 samples of up to 32 tokens at temperature 0.8.
- trl: the arithmetic example against TRL's `GRPOTrainer` (synchronous: generate, score,
  step, on the same 2 cores) on the same model, LoRA (r=16, alpha 32), data, reward
  (`protocol.usercode.math_reward:accuracy`) and settings (2 prompts x 8 completions of <= 32 tokens
  a step, temperature 0.8, lr 3e-4, token-mean loss, no KL). spotgrpo runs first
  (`learner run --example arithmetic --steps N`); TRL then trains for the same wall time.
  Each reports steps, steps/s, and the held-out greedy pass@1 (48 problems) of its final
  adapter, TRL's measured here the way spotgrpo's evaluation does (greedy, <= 32 tokens,
  the same reward).

Usage: python bench/real_model.py [--part dtype|engine|trl|all] [--steps 3] [--trl-steps 30]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import statistics
import time

import torch

from learner import tasks
from learner.config import LearnerConfig
from learner.models import make_model
from learner.policy import Policy
from learner.tiny import synthetic_batch
from learner.train import train_on


def bench_dtype(model: Path, steps: int) -> None:
    times: dict[str, float] = {}
    logps: dict[str, torch.Tensor] = {}
    for dtype in ("float32", "bfloat16"):
        cfg = LearnerConfig(
            model=str(model), dtype=dtype, lora_rank=16, lora_alpha=32, max_tokens=32, learning_rate=1e-5
        )
        torch.manual_seed(0)
        policy = Policy(cfg)
        optimizer = torch.optim.AdamW(policy.trainable_parameters(), lr=cfg.learning_rate)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        batch = synthetic_batch(policy, 2, 8, 60, 32)
        with torch.no_grad():
            logps[dtype], _ = policy.forward_logps(batch.seqs, 1.0)
        train_on(policy, optimizer, scheduler, batch, cfg)  # warm-up
        spent = []
        for _ in range(steps):
            started = time.perf_counter()
            train_on(policy, optimizer, scheduler, batch, cfg)
            spent.append(time.perf_counter() - started)
        times[dtype] = statistics.median(spent)
        print(f"dtype {dtype:9s} learner step {times[dtype]:6.2f} s (median of {steps})", flush=True)
        del policy, optimizer
    mask = batch.seqs.mask_BT.bool()
    delta = (logps["bfloat16"].float() - logps["float32"])[mask].abs().mean().item()
    print(
        f"bfloat16/float32 step time {times['bfloat16'] / times['float32']:.2f}x; "
        f"mean |delta log-prob| of bfloat16 against float32 {delta:.4f}"
    )


def bench_engine(model: Path) -> None:
    from actors.hf_engine import TransformersEngine
    from protocol import SamplingParams

    rows = tasks.arithmetic_rows(16, seed=3)
    for dtype in ("float32", "bfloat16"):
        engine = TransformersEngine(str(model), dtype=dtype)
        prompts = [
            engine.tokenizer.apply_chat_template(
                r["prompt"], add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
            for r in rows
        ]
        engine.generate(prompts[:2], 2, SamplingParams(temperature=0.8, max_tokens=8, seed=0), 0)  # warm-up
        started = time.perf_counter()
        groups = engine.generate(prompts, 8, SamplingParams(temperature=0.8, max_tokens=32, seed=1), 0)
        spent = time.perf_counter() - started
        tokens = sum(len(s.token_ids) for g in groups for s in g)
        ended = sum(s.finish_reason == "stop" for g in groups for s in g) / sum(len(g) for g in groups)
        print(
            f"engine transformers {dtype:9s} {tokens / spent:7.1f} completion tokens/s "
            f"({tokens} tokens in {spent:.1f} s; {ended:.0%} ended on a stop token)",
            flush=True,
        )
        engine.close()


def held_out_pass_at_1(model: Path, adapter: Path | None, rows: list[dict]) -> float:
    """Greedy pass@1 on `rows` with the math reward, as spotgrpo's evaluation computes it."""
    from actors.hf_engine import TransformersEngine
    from protocol import SamplingParams
    from protocol.usercode.math_reward import accuracy

    engine = TransformersEngine(str(model))
    version = 0
    if adapter is not None:
        engine.load_adapter(1, adapter)
        version = 1
    prompts = [
        engine.tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True, return_dict=True)[
            "input_ids"
        ]
        for r in rows
    ]
    groups = engine.generate(prompts, 1, SamplingParams(temperature=0.0, max_tokens=32), version)
    texts = [engine.decode(g[0].token_ids) for g in groups]
    scores = accuracy(texts, answer=[r["answer"] for r in rows])
    return sum(s or 0.0 for s in scores) / len(rows)


def bench_trl(model: Path, steps: int) -> None:
    import json
    import subprocess
    import tempfile

    from datasets import Dataset
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    from protocol.usercode.math_reward import accuracy

    work = Path(tempfile.mkdtemp(prefix="bench-real-"))
    run_dir = work / "spotgrpo"
    started = time.monotonic()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "learner.cli",
            "run",
            "--example",
            "arithmetic",
            "--steps",
            str(steps),
            "--run-dir",
            str(run_dir),
            "--model",
            str(model),
            "--no-tensorboard",
        ],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    ours_wall = time.monotonic() - started
    summary = json.loads((run_dir / "summary.json").read_text())
    evals = summary["evaluations"]
    last = max(evals, key=int)
    print(
        f"spotgrpo: {summary['steps']} steps in {ours_wall:.0f}s ({summary['steps'] / ours_wall:.4f} steps/s, "
        f"process start and the final evaluation included); held-out pass@1 v0 {evals['0']['pass@1']:.3f} -> "
        f"v{last} {evals[last]['pass@1']:.3f}",
        flush=True,
    )

    rows = tasks.arithmetic_rows(2000, seed=0)
    held_out = tasks.arithmetic_rows(200, seed=1)[:48]

    def reward(completions: list, answer: list, **_: object) -> list[float]:
        return [float(s or 0.0) for s in accuracy(completions, answer=answer)]

    from transformers import TrainerCallback

    class StopAtWallTime(TrainerCallback):  # TRL gets spotgrpo's wall time
        def __init__(self, budget_s: float) -> None:
            self.deadline, self.steps = time.monotonic() + budget_s, 0

        def on_step_end(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
            self.steps = state.global_step
            control.should_training_stop = time.monotonic() > self.deadline
            return control

    config = GRPOConfig(
        output_dir=str(work / "trl"),
        per_device_train_batch_size=16,
        num_generations=8,
        max_completion_length=32,
        temperature=0.8,
        learning_rate=3e-4,
        lr_scheduler_type="constant",
        beta=0.0,
        loss_type="dapo",
        max_steps=10_000,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        seed=0,
        shuffle_dataset=True,
    )
    started = time.monotonic()
    clock = StopAtWallTime(ours_wall)
    trainer = GRPOTrainer(
        model=str(model),
        reward_funcs=reward,
        args=config,
        train_dataset=Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows]),
        peft_config=LoraConfig(
            r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
        ),
        callbacks=[clock],
    )
    trainer.train()
    trl_wall = time.monotonic() - started
    trainer.model.save_pretrained(str(work / "trl-adapter"))
    ours_final = evals[last]["pass@1"]
    theirs = held_out_pass_at_1(model, work / "trl-adapter", held_out)
    print(
        f"TRL GRPOTrainer: {clock.steps} steps in {trl_wall:.0f}s ({clock.steps / trl_wall:.4f} steps/s); "
        f"held-out pass@1 {theirs:.3f}",
        flush=True,
    )
    print(
        f"spotgrpo/TRL: steps/s {summary['steps'] / ours_wall / max(clock.steps / trl_wall, 1e-9):.2f}x; "
        f"final pass@1 {ours_final:.3f} vs {theirs:.3f} after the same wall time"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=["dtype", "engine", "trl", "all"], default="all")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--trl-steps", type=int, default=30, help="spotgrpo's steps; TRL gets its wall time")
    args = parser.parse_args()
    model = make_model()
    print(f"model {model}; torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    if args.part in ("dtype", "all"):
        bench_dtype(model, args.steps)
    if args.part in ("engine", "all"):
        bench_engine(model)
    if args.part in ("trl", "all"):
        bench_trl(model, args.trl_steps)


if __name__ == "__main__":
    main()
