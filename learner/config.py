"""The learner's configuration: declared once, typed, bounded, one line of doc per field.

Parsed once at the entry point, from a TOML file (`--config`) and then command-line
flags, which override the file (`learner.load_config`). The flags are generated from this class, so a field
added here is a flag at once.

TRL's vocabulary (`learner.grpoconfig`): every setting with a `GRPOConfig` counterpart
also takes the `GRPOConfig` name, as a key and as a flag, and gives the same configuration
object; any other unknown key is refused with the nearest known name.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from learner.grpoconfig import ConfigError as ConfigError  # callers import it from here
from protocol.util.config_file import reward_specs

SECTIONS = {
    "run": "where things are",
    "model": "model and adapter",
    "dataset": "data, rewards and tools",
    "num_generations": "sampling (sent with every prompt batch)",
    "steps": "the loop",
    "learning_rate": "optimizer",
    "advantage_scale": "the loss",
    "eval_dataset": "evaluation",
    "actors": "the embedded default",
    "tensorboard": "reporting",
}
"""The first setting of each section of `LearnerConfig` and its title: `--help` groups the
flags by them."""

IN_FLIGHT = "a generation running when a newer adapter arrives goes on with it from its prefix (--in-flight-updates)."


class LearnerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)

    # -- where things are
    run: str = Field(
        "default",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$",
        description="Run name: namespaces the queue keys, batch ids and the run directory.",
    )
    queue: str = Field("", description="Queue URL: redis://host:port/db (or https://proxy:port with --token).")
    token: str | None = Field(None, description="Bearer token for an https:// queue (or SPOTGRPO_TOKEN).")
    store: str = Field("", description="Object store for adapters and checkpoints: s3://bucket/prefix or file:///dir.")
    run_dir: Path | None = Field(None, description="Local directory for metrics.jsonl and logs (default runs/<run>).")
    resume: bool = Field(False, description="Continue the run from the latest checkpoint in the store.")
    startup_timeout_s: float = Field(
        300.0, gt=0, description="Give up (one line, exit 1) when the queue stays unreachable this long at start-up."
    )

    # -- model and adapter
    model: str = Field("", description="Hugging Face model id or local path of the base model.")
    device: str = Field(
        "auto",
        pattern=r"^(auto|cpu|cuda|cuda:\d+)$",
        description=(
            "Where the learner trains: auto (CUDA when available), cpu, cuda or cuda:N (under torchrun each rank "
            "takes cuda:LOCAL_RANK)."
        ),
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32",
        description=(
            "The frozen base weights' dtype (and the forward's); LoRA parameters, optimizer state and "
            "log-probabilities stay float32."
        ),
    )
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward to save memory.")
    lora_rank: int = Field(16, ge=1, le=1024, description="LoRA rank r.")
    lora_alpha: float = Field(32.0, gt=0, description="LoRA alpha (scale = alpha / r).")
    lora_dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the LoRA input.")
    target_modules: list[str] = Field(
        ["all-linear"], min_length=1, description="Modules that get LoRA: names, or all-linear."
    )
    max_seq_len: int | None = Field(
        None, ge=8, description="Longest prompt+completion trained on (default: the model's context)."
    )

    # -- data
    dataset: str = Field("", description="Hugging Face dataset id, or a local .jsonl/.json/.parquet file.")
    dataset_split: str = Field("train", description="Split of a hub dataset.")
    dataset_config: str | None = Field(
        None, description="Configuration name of a hub or local data set (GSM8K's main)."
    )
    prompt_column: str = Field("prompt", description="Column holding the prompt: a string or a list of chat messages.")
    reward: list[str] = Field(
        [],
        description=(
            "Reward functions module:function[=weight], or module:factory(name=value, ...)[=weight]: what the run's "
            "scorers run (`learner score --reward`, or "
            "the actors' own with --scoring actors); the embedded default starts them with these."
        ),
    )
    scoring: Literal["trusted", "actors"] | None = Field(
        None,
        description=(
            "Who scores: trusted (RQ workers on the trusted side, `learner score`; dataset columns never leave it; "
            "the default when --reward is given) or actors (each worker scores its own groups; the default without "
            "--reward)."
        ),
    )
    reward_weights: list[float] | None = Field(
        None, description="One weight per --reward (TRL's way of weighting; or module:function=weight)."
    )
    tools: list[str] = Field(
        [],
        description=(
            "Tools episodes may call, module:function (TRL's tools=[...]: typed, documented functions, sync or "
            "async): offered to the model in its prompts, run by the actors (`actors run --tools`, the same "
            "functions)."
        ),
    )
    environment: str = Field(
        "",
        description=(
            "Stateful episodes, module:Class (TRL's environment_factory): one instance per episode on the actor, "
            "built with no arguments and reset(**the prompt's public columns); its public methods are more tools; "
            "its `done` attribute ends the episode (`actors run --environment`, the same class)."
        ),
    )
    max_tool_calling_iterations: int | None = Field(
        None,
        ge=0,
        description="Most tool-calling turns per episode (default: until max_tokens, which bounds the whole episode).",
    )

    # -- sampling (sent with every prompt batch)
    num_generations: int = Field(8, ge=2, le=1024, description="Completions per prompt (the GRPO group size).")
    prompts_per_batch: int = Field(4, ge=1, le=4096, description="Prompts per PromptBatch message (one actor lease).")
    temperature: float = Field(
        1.0, gt=0, le=10, description="Sampling temperature; the learner scores tokens at the same temperature."
    )
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling.")
    top_k: int = Field(0, ge=0, description="Top-k sampling (0: off).")
    min_p: float = Field(0.0, ge=0, le=1, description="Min-p sampling (0: off).")
    repetition_penalty: float = Field(1.0, gt=0, le=10, description="Repetition penalty on the actors (1: off).")
    chat_template_kwargs: dict[str, Any] = Field(
        {}, description="Extra arguments of the chat template, as JSON on the command line (Qwen3's enable_thinking)."
    )
    max_tokens: int = Field(256, ge=1, description="Longest completion.")

    # -- the loop
    steps: int = Field(200, ge=1, description="Optimizer steps to run (in total, across resumes).")
    groups_per_step: int = Field(16, ge=1, description="Rollout groups (prompts) per optimizer step.")
    max_inflight: int = Field(64, ge=1, description="Most prompts issued and not yet consumed.")
    adaptive_inflight: bool = Field(
        True,
        description=(
            "Open the prompts in flight at groups_per_step and widen them (up to max_inflight) while the learner "
            "waits, narrow them while groups arrive at max_staleness, or aged while the learner did not wait "
            "(learner/admission.py); false: always max_inflight."
        ),
    )
    max_staleness: int = Field(4, ge=0, description="Drop groups generated more than this many adapter versions ago.")
    sync_every: int = Field(1, ge=1, description="Publish a new adapter version every this many steps.")
    checkpoint_every: int = Field(
        10, ge=1, description="Checkpoint (and acknowledge consumed rollouts) every this many steps."
    )
    stall_warning_s: float = Field(
        60.0,
        gt=0,
        description=(
            "With no step for this long, one line says why (groups read and all flat, with their rewards; nothing "
            "arriving, with the queue's depths), again at doubling intervals; each time, the batches still out "
            "are issued again where the queue lost them (a Redis failover; a no-op where it kept them)."
        ),
    )
    keep_checkpoints: int = Field(2, ge=1, description="Checkpoints kept in the store.")
    keep_queue: bool = Field(
        False, description="Keep the run's Redis keys when the run completes (default: they expire after queue_ttl_s)."
    )
    fleet_weight: float | None = Field(
        None,
        gt=0,
        le=1000,
        description="Shared fleet: the run's weight in workers' claims (default: the admin's, else 1).",
    )
    fleet_cap: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Shared fleet: most of a worker's sequences it holds at once (default: no cap).",
    )
    queue_ttl_s: float = Field(
        86400.0,
        gt=0,
        description=(
            "A completed run's Redis keys expire this long after its last step (late workers and a --resume find "
            "them until then)."
        ),
    )
    keep_adapters: int | None = Field(
        None,
        ge=0,
        description=(
            "Adapter versions kept in the store, newest first, besides those that evaluations or kept checkpoints "
            "pin (default: max_staleness + 2, what actors may still generate with; 0: keep all)."
        ),
    )
    seed: int = Field(0, description="Seeds data order and torch.")
    micro_batch_size: int = Field(
        16, ge=1, description="Most sequences in one forward/backward pass (gradient accumulation)."
    )
    max_tokens_per_microbatch: int | None = Field(
        None,
        ge=16,
        description=(
            "Token budget of one forward/backward pass: sequences sorted by length fill a micro-batch while rows x "
            "its longest stays within it (one longer sequence goes alone). Default: 16384, or fewer for a large "
            "vocabulary, keeping a pass's float32 logits near 1 GiB (SmolLM2: 5461 tokens)."
        ),
    )
    updates_per_batch: int = Field(
        1, ge=1, description="Optimizer steps per collected batch (minibatches); >1 uses the decoupled PPO objective."
    )
    lag_versions: int | None = Field(
        None,
        ge=0,
        description=(
            "For benchmarks and tests: generate every training batch with the adapter exactly this many versions "
            "behind (pinned); needs max_inflight = groups_per_step."
        ),
    )
    audit_rate: float = Field(
        0.05,
        ge=0,
        le=1,
        description=(
            "Share of the groups about to be trained whose log-probabilities the learner recomputes under the "
            "adapter they name, and whose tokens it tests for having been sampled from it (learner/audit.py); a "
            "worker that fails is quarantined. 0 with no probation: no audits."
        ),
    )
    audit_probation_groups: int = Field(
        4, ge=0, description="Audit each worker's first this many groups, all of them (then at audit_rate)."
    )
    max_abs_reward: float = Field(
        1e6,
        gt=0,
        le=1e30,
        description=(
            "Groups with a reward outside [-this, this] are rejected (a worker's garbage must not reach float32 as "
            "inf)."
        ),
    )

    # -- optimizer
    learning_rate: float = Field(1e-5, gt=0, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1.")
    adam_beta2: float = Field(0.99, ge=0, lt=1, description="AdamW beta2.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    lr_scheduler: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="Learning-rate schedule after warmup."
    )
    warmup_steps: int = Field(0, ge=0, description="Linear warmup steps.")
    warmup_ratio: float | None = Field(
        None, ge=0, le=1, description="Warmup as a fraction of the steps (TRL's way); instead of warmup_steps."
    )

    # -- the loss
    advantage_scale: Literal["group", "batch", "none"] = Field(
        "group", description="Divide centred rewards by the group's std, the batch's std, or nothing (Dr. GRPO)."
    )
    correction: Literal["tis", "mis", "none"] = Field(
        "mis",
        description=(
            "Off-policy correction: masked (the default; docs/benchmarks.md compares them) or truncated importance "
            "sampling."
        ),
    )
    tis_cap: float = Field(2.0, ge=1, description="Truncation cap C of TIS weights.")
    mis_level: Literal["token", "sequence"] = Field(
        "token", description="Masked IS: mask tokens, or whole sequences by their geometric-mean ratio."
    )
    mis_low: float = Field(0.5, ge=0, le=1, description="Masked IS: lower bound of kept ratios.")
    mis_high: float = Field(2.0, ge=1, description="Masked IS: upper bound of kept ratios.")
    epsilon_low: float = Field(0.2, ge=0, lt=1, description="PPO clip below 1 (proximal ratio).")
    epsilon_high: float = Field(0.28, ge=0, description="PPO clip above 1 (DAPO's clip-higher).")
    loss_agg: Literal["token_mean", "seq_mean", "constant"] = Field(
        "token_mean",
        description="Token mean over the batch (DAPO), per-sequence mean (GRPO), or constant normaliser (Dr. GRPO).",
    )
    importance_sampling_level: Literal["token", "sequence"] = Field(
        "token",
        description="Policy ratio per token (GRPO/PPO), or per sequence as the geometric mean of its tokens' (GSPO).",
    )
    active_sampling: bool = Field(
        True,
        description="Pass over prompts whose recent groups were flat at the best reward (mastered: no advantage), "
        "with their flat rate as the chance (learner/active.py).",
    )
    active_sampling_floor: float = Field(
        0.05, ge=0, le=1, description="Active sampling: the least chance a prompt met is issued (it is retried)."
    )
    active_sampling_revisit: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Active sampling: the chance a prompt whose group taught (its rewards spread) is issued again, "
        "once, before new prompts, from the next checkpoint on (learner/active.py); for a data set a run reads once "
        "(0.5 in the arithmetic example).",
    )
    active_sampling_hard: bool = Field(
        False, description="Active sampling: pass over prompts flat below the best reward (too hard) as well."
    )
    mask_truncated_completions: bool = Field(
        False, description="Leave completions that hit max_tokens out of the loss (DAPO's overlong filtering)."
    )
    beta: float = Field(0.0, ge=0, description="Weight of the k3 KL to the base model (adapter disabled).")

    # -- evaluation
    eval_dataset: str = Field("", description="Held-out prompts (same formats as --dataset); empty: no evaluation.")
    eval_split: str = Field("test", description="Split of a hub eval data set.")
    eval_every: int = Field(
        0, ge=0, description="Evaluate every this many adapter versions, and the base model first (0: never)."
    )
    eval_generations: int = Field(4, ge=1, le=1024, description="Completions per eval prompt (the k of pass@k).")
    eval_temperature: float = Field(1.0, ge=0, le=10, description="Sampling temperature of evaluations (0: greedy).")
    eval_max_prompts: int = Field(
        64, ge=1, description="Eval prompts per evaluation (the first ones of the eval data set)."
    )
    eval_pass_reward: float = Field(1.0, description="A completion passes (pass@k) when its reward is at least this.")
    eval_final_timeout_s: float = Field(
        600.0,
        ge=0,
        description=(
            "At the end of the run, how long to wait for the evaluations still due, the final adapter's included "
            "(what is cut short is recorded as such)."
        ),
    )

    # -- the embedded default
    actors: int = Field(2, ge=0, le=64, description="Actor processes the embedded default starts (no --queue given).")
    actor_engine: Literal["transformers", "vllm"] = Field(
        "transformers",
        description="The embedded default's actors' engine (vllm needs the vllm package: vLLM's CPU build runs here).",
    )
    actor_in_flight_updates: bool = Field(True, description="The embedded default's actors: " + IN_FLIGHT)
    embedded_redis: Literal["auto", "server", "memory"] = Field(
        "auto",
        description=(
            "The embedded default's Redis: server = a private redis-server on a loopback port (Linux; it stops "
            "when the learner does, however it ends), memory = fakeredis in the proxy's process (nothing to "
            "install, but every command costs the proxy's Python; the scoring tier's RQ traffic most of all), auto "
            "= server where redis-server is on PATH, else memory."
        ),
    )
    example: Literal["", "arithmetic", "calculator"] = Field(
        "",
        description=(
            "A built-in example, run embedded, on SmolLM2-135M-Instruct (made by `learner make-model` if missing), "
            "with held-out pass@1 before and after: arithmetic = one-step word problems, scored by the math reward "
            "on the trusted tier; calculator = sums of five-digit numbers with an add tool (episodes), scored on "
            "the trusted tier."
        ),
    )

    # -- reporting
    tensorboard: bool = Field(
        True,
        description=(
            "Write TensorBoard event files when tensorboard is installed (--no-tensorboard drops it from report_to)."
        ),
    )
    report_to: list[str] = Field(
        ["tensorboard"],
        description=(
            "Trackers: tensorboard, wandb, trackio, mlflow, or none (each library's own settings apply, e.g. "
            "WANDB_MODE=offline)."
        ),
    )
    samples_every: int = Field(
        10,
        ge=0,
        description=(
            "Every this many steps, send the trackers TRL's completions table: a few prompts, completions, rewards "
            "(in all and by function) and advantages (0: never)."
        ),
    )
    log_every: int = Field(1, ge=1, description="Console line every this many steps.")

    @field_validator("report_to", mode="before")
    @classmethod
    def _report_to_list(cls, value: Any) -> Any:
        """TRL's report_to may be one string ("wandb", "wandb,mlflow", "none")."""
        return [v.strip() for v in value.split(",") if v.strip()] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _cross_checks(self) -> LearnerConfig:
        if self.groups_per_step > self.max_inflight:
            raise ValueError(
                f"groups_per_step ({self.groups_per_step}) exceeds max_inflight "
                f"({self.max_inflight}): raise max_inflight or the learner can never fill a step"
            )
        if self.prompts_per_batch > self.max_inflight:
            raise ValueError(
                f"prompts_per_batch ({self.prompts_per_batch}) exceeds max_inflight "
                f"({self.max_inflight}): no batch could ever be issued"
            )
        if self.groups_per_step % self.updates_per_batch:
            raise ValueError(
                f"groups_per_step ({self.groups_per_step}) must divide into "
                f"updates_per_batch ({self.updates_per_batch}) minibatches"
            )
        if self.lag_versions is not None and self.max_inflight != self.groups_per_step:
            raise ValueError(
                f"lag_versions: needs max_inflight ({self.max_inflight}) = groups_per_step ({self.groups_per_step}), "
                "so that each step's batches are issued after the version they lag behind is published"
            )
        if self.lag_versions is not None and self.lag_versions > self.max_staleness:
            raise ValueError(
                f"lag_versions ({self.lag_versions}) above max_staleness ({self.max_staleness}): "
                "every group would be dropped as stale; raise max_staleness"
            )
        if self.eval_every and not self.eval_dataset:
            raise ValueError("eval_every: needs --eval-dataset (held-out prompts)")
        if self.warmup_ratio is not None and self.warmup_steps:
            raise ValueError("warmup_ratio and warmup_steps are the same setting: give one of them")
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward):
            raise ValueError(
                f"reward_weights: one weight per reward function ({len(self.reward)} given), got "
                f"{len(self.reward_weights)}"
            )
        if self.top_k and self.top_k < 2:
            raise ValueError("top_k: 1 is greedy decoding, which GRPO cannot learn from; use 0 or >= 2")
        return self

    def require_distributed(self) -> None:
        """The fields a run against a real queue cannot do without."""
        missing = [name for name in ("queue", "store", "model", "dataset") if not getattr(self, name)]
        if missing:
            raise ConfigError(
                "missing "
                + ", ".join(f"--{m.replace('_', '-')}" for m in missing)
                + " (or run `learner run` with no arguments for the embedded default)"
            )

    @property
    def trackers(self) -> list[str]:
        """report_to, less TensorBoard when --no-tensorboard was given."""
        return [t for t in self.report_to if self.tensorboard or t != "tensorboard"]

    @property
    def warmup(self) -> int:
        """Warmup steps, from warmup_steps or warmup_ratio."""
        return self.warmup_steps if self.warmup_ratio is None else math.ceil(self.warmup_ratio * self.steps)

    @property
    def adapters_kept(self) -> int:
        """keep_adapters, or its default: every version actors may still generate with."""
        return self.keep_adapters if self.keep_adapters is not None else self.max_staleness + 2

    @property
    def scoring_mode(self) -> str:
        """--scoring, or its default: trusted when the learner is given the rewards."""
        return self.scoring or ("trusted" if self.reward else "actors")

    @property
    def reward_specs(self) -> list[str]:
        """The reward functions as the actors take them: module:function=weight (the other
        roles read the same from a config file: `protocol.util.config_file.reward_specs`)."""
        return reward_specs({"reward": self.reward, "reward_weights": self.reward_weights}) or []

    @property
    def resolved_run_dir(self) -> Path:
        return self.run_dir if self.run_dir is not None else Path("runs") / self.run
