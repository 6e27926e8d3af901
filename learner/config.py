"""The learner's configuration: declared once, typed, bounded, one line of doc per field.

Parsed once at the entry point, from a TOML file (`--config`) and then command-line
flags, which override the file. The flags are generated from this class, so a field
added here is a flag at once.

TRL's vocabulary: every setting with a `GRPOConfig` counterpart also takes the
`GRPOConfig` name, as a key and as a flag (`TRL_NAMES`: `max_completion_length` is
`max_tokens`, `loss_type = "dr_grpo"` is `loss_agg = "constant"`, ...), and gives the
same configuration object. A `GRPOConfig` key with no counterpart here is refused with
the reason (`TRL_ONLY`); any other unknown key is refused with the nearest known name.
"""

from __future__ import annotations

import difflib
import math
import os
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from protocol.util.config_file import learner_part


class ConfigError(ValueError):
    """The configuration is invalid; the message says which field and how to fix it."""


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
            "Reward functions module:function[=weight]: what the run's scorers run (`learner score --reward`, or "
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
            "waits, narrow them while groups arrive at or past max_staleness (learner/admission.py); false: always "
            "max_inflight."
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
            "arriving, with the queue's depths), again at doubling intervals."
        ),
    )
    keep_checkpoints: int = Field(2, ge=1, description="Checkpoints kept in the store.")
    keep_queue: bool = Field(
        False, description="Keep the run's Redis keys when the run completes (default: they expire after queue_ttl_s)."
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
        """The reward functions as the actors take them: module:function=weight."""
        if self.reward_weights is None:
            return list(self.reward)
        return [f"{spec.split('=')[0]}={w!r}" for spec, w in zip(self.reward, self.reward_weights, strict=True)]

    @property
    def resolved_run_dir(self) -> Path:
        return self.run_dir if self.run_dir is not None else Path("runs") / self.run


_LOSS_TYPES = {"grpo": "seq_mean", "dapo": "token_mean", "bnpo": "token_mean", "dr_grpo": "constant"}


def _scale_rewards(value: Any) -> Any:
    if value is True:
        return "group"
    if value is False:
        return "none"
    return value


TRL_NAMES: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "max_completion_length": ("max_tokens", lambda v: v),
    "loss_type": ("loss_agg", lambda v: _LOSS_TYPES.get(v, v)),
    "epsilon": ("epsilon_low", lambda v: v),
    "scale_rewards": ("advantage_scale", _scale_rewards),
    "lr_scheduler_type": ("lr_scheduler", lambda v: v),
    "max_steps": ("steps", lambda v: v),
    "logging_steps": ("log_every", lambda v: v),
    "save_steps": ("checkpoint_every", lambda v: v),
    "save_total_limit": ("keep_checkpoints", lambda v: v),
    "output_dir": ("run_dir", lambda v: v),
    # also the spelling that works under torchrun, whose own --run-path makes --run ambiguous
    "run_name": ("run", lambda v: v),
    # GRPOTrainer's own arguments, which a config file carries beside GRPOConfig's keys
    "reward_funcs": ("reward", lambda v: [v] if isinstance(v, str) else v),
    "environment_factory": ("environment", lambda v: v),
}
"""GRPOConfig name (or GRPOTrainer argument) -> (our field, how its value reads here). Names that are the same in
both (num_generations, epsilon_high, beta, learning_rate, warmup_ratio, reward_weights,
seed, temperature, top_p, top_k, min_p, repetition_penalty, chat_template_kwargs,
importance_sampling_level, mask_truncated_completions) need no entry."""


def _each(keys: str, answer: str) -> dict[str, str]:
    return dict.fromkeys(keys.split(), answer)


TRL_ONLY: dict[str, str] = {
    "vllm_gpu_memory_utilization": "set it on the actors: `actors run --gpu-memory-utilization`",
    "vllm_tensor_parallel_size": "set it on the actors: `actors run --tensor-parallel-size`",
    "vllm_max_model_length": "set it on the actors: `actors run --max-model-len`",
    **_each(
        "vllm_model_impl vllm_enable_sleep_mode vllm_server_base_url vllm_server_host vllm_server_port "
        "vllm_server_timeout vllm_group_port use_transformers_continuous_batching "
        "transformers_continuous_batching_config use_transformers_paged cache_implementation "
        "ds3_gather_for_generation",
        "generation runs on the actors, which load adapters from the store: "
        "no server to reach and no weights to sync; configure the engine on `actors run`",
    ),
    "vllm_structured_outputs_regex": "structured outputs are not built; use a stop string or a reward on the format",
    **_each(
        "vllm_importance_sampling_correction vllm_importance_sampling_mode vllm_importance_sampling_cap "
        "vllm_importance_sampling_clip_min vllm_importance_sampling_clip_max off_policy_mask_threshold",
        "the off-policy correction is --correction (tis, mis, none) with --tis-cap, --mis-level, --mis-low, "
        "--mis-high: every group is off-policy by its measured staleness here",
    ),
    "generation_batch_size": "the actors batch across leases on their own; prompts_per_batch sets a lease",
    "steps_per_generation": "generation is asynchronous here; updates_per_batch sets optimizer steps per batch",
    "max_prompt_length": "prompts are cut to the context less max_tokens (keeping their end)",
    "num_train_epochs": "the run is counted in steps (max_steps / steps); the data set repeats as needed",
    "delta": "two-sided clipping is not built; use epsilon / epsilon_high",
    "top_entropy_quantile": "entropy-based token masking is not built",
    "use_liger_loss": "the loss is spotgrpo's own (learner/loss.py)",
    **_each(
        "use_liger_kernel liger_kernel_config torch_compile torch_compile_backend torch_compile_mode "
        "neftune_noise_alpha label_smoothing_factor average_tokens_across_devices",
        "not built: the loss is spotgrpo's own (learner/loss.py); leave it out",
    ),
    **_each(
        "optim optim_args optim_target_modules adam_epsilon lr_scheduler_kwargs",
        "the optimizer is AdamW on the LoRA weights (--adam-beta1, --adam-beta2, --weight-decay, --lr-scheduler); "
        "leave it out",
    ),
    **_each(
        "tf32 bf16_full_eval fp16_full_eval cast_lm_head_to_fp32",
        "precision is --dtype (the frozen base weights'); LoRA weights, optimizer state and log-probabilities "
        "stay float32",
    ),
    **_each(
        "activation_checkpointing activation_checkpointing_kwargs gradient_checkpointing_kwargs",
        "use --gradient-checkpointing (on or off; the non-reentrant kind)",
    ),
    **_each(
        "use_cache torch_empty_cache_steps auto_find_batch_size include_num_input_tokens_seen "
        "router_aux_loss_coef pad_to_multiple_of",
        "the learner manages this itself (micro-batches by --max-tokens-per-microbatch); leave it out",
    ),
    **_each(
        "logging_strategy logging_first_step log_on_each_node logging_nan_inf_filter log_level "
        "log_level_replica disable_tqdm debug skip_memory_metrics",
        "the learner logs a line every --log-every steps (logging_steps), rank 0 only, to every tracker in "
        "report_to; `-v` for debug; leave it out",
    ),
    **_each(
        "project trackio_space_id trackio_bucket_id trackio_static_space_id",
        "the trackers read their own environment (WANDB_PROJECT, TRACKIO_PROJECT, TRACKIO_SPACE_ID, "
        "MLFLOW_EXPERIMENT_NAME); --run names the run",
    ),
    **_each(
        "eval_delay per_device_eval_batch_size prediction_loss_only eval_on_start eval_do_concat_batches "
        "eval_use_gather_object eval_accumulation_steps include_for_metrics batch_eval_metrics "
        "num_generations_eval load_best_model_at_end metric_for_best_model greater_is_better",
        "evaluation runs on the actors: --eval-dataset, --eval-every (eval_steps) versions, the base model "
        "first and the final adapter last, --eval-generations per prompt (pass@k); `learner export --version "
        "best` picks the best by pass@1",
    ),
    **_each(
        "save_only_model save_on_each_node enable_jit_checkpoint resume_from_checkpoint "
        "restore_callback_states_from_checkpoint ignore_data_skip",
        "checkpoints hold the adapter, optimizer, data cursor and ledger every --checkpoint-every steps "
        "(save_steps); --resume continues the run exactly where its last checkpoint was; leave it out",
    ),
    **_each(
        "push_to_hub hub_token hub_private_repo hub_model_id hub_strategy hub_always_push hub_revision "
        "log_completions_hub_repo",
        "publish the trained adapter after the run: `learner export --version last|best --push-to-hub "
        "REPO [--private]` (HF_TOKEN)",
    ),
    **_each("full_determinism data_seed", "--seed sets the data order, the adapter's initialisation and sampling"),
    **_each(
        "accelerator_config parallelism_config ddp_find_unused_parameters ddp_bucket_cap_mb "
        "ddp_broadcast_buffers ddp_static_graph ddp_backend ddp_timeout fsdp fsdp_config deepspeed local_rank",
        "more GPUs: `torchrun --nproc-per-node N -m learner run ...` shards the model with FSDP2 by itself; "
        "leave it out",
    ),
    **_each(
        "dataloader_drop_last dataloader_num_workers dataloader_pin_memory dataloader_persistent_workers "
        "dataloader_prefetch_factor dataloader_multiprocessing_context dataloader_in_order "
        "remove_unused_columns label_names train_sampling_strategy length_column_name",
        "prompts are issued in a seeded order by the learner, every column travelling to the rewards; leave it out",
    ),
    **_each("do_train do_eval do_predict", "`learner run` trains; leave it out"),
    "model_init_kwargs": "--dtype sets the base weights' dtype; other loading options are not taken (the actors load "
    "the same --model path with their own settings)",
    "trust_remote_code": "not taken: models are loaded with their transformers classes only",
    "disable_dropout": "dropout is --lora-dropout (0 by default); the base model runs as its config says",
    "generation_kwargs": "sampling is temperature, top_p, top_k, min_p, repetition_penalty (all taken); others are not",
    **_each(
        "sapo_temperature_neg sapo_temperature_pos vespo_k_pos vespo_lambda_pos vespo_k_neg vespo_lambda_neg "
        "multi_objective_aggregation use_bias_correction_kl",
        "this loss variant is not built: loss_type grpo, dapo, bnpo or dr_grpo (learner/loss.py)",
    ),
    **_each(
        "sync_ref_model ref_model_mixup_alpha ref_model_sync_steps",
        "the reference model is the base model with the adapter off (beta > 0); it is never synced",
    ),
    **_each(
        "entropy_coef use_adaptive_entropy entropy_coef_min entropy_coef_max entropy_coef_delta entropy_target",
        "an entropy bonus is not built; the entropy is logged each step",
    ),
    **_each(
        "log_multimodal num_completions_to_print log_unique_prompts",
        "TRL's completions table goes to the trackers every --samples-every steps",
    ),
}
"""GRPOConfig keys with no counterpart here, and what to do instead (every key of TRL
1.16's GRPOConfig is answered: ours by the same name, `TRL_NAMES`, `TRL_VALUES`, `TRL_NO_OPS`,
`TRL_BATCH_KEYS`, or this;
`tests/test_trl_vocabulary.py` checks)."""

TRL_VALUES: dict[str, Callable[[Any], dict[str, Any]]] = {
    "bf16": lambda v: {"dtype": "bfloat16"} if v else {},
    "fp16": lambda v: {"dtype": "float16"} if v else {},
    "use_cpu": lambda v: {"device": "cpu"} if v else {},
    "log_completions": lambda v: {} if v else {"samples_every": 0},
    "eval_steps": lambda v: {"eval_every": v},
    "eval_strategy": lambda v: (
        {"eval_every": 0}
        if v == "no"
        else {}
        if v == "steps"
        else _refuse(
            "eval_strategy", f'{v!r}: evaluation is counted in adapter versions: eval_strategy "steps" with eval_steps'
        )
    ),
    "save_strategy": lambda v: (
        {}
        if v == "steps"
        else _refuse(
            "save_strategy",
            f'{v!r}: checkpoints are every --checkpoint-every steps (save_strategy "steps", save_steps)',
        )
    ),
    "shuffle_dataset": lambda v: (
        {} if v else _refuse("shuffle_dataset", "false: prompts are always issued in a seeded random order (--seed)")
    ),
}
"""GRPOConfig keys whose value maps onto our settings (bf16 = true is dtype = bfloat16);
an empty mapping means the value is what spotgrpo does anyway."""

TRL_NO_OPS: dict[str, tuple[Callable[[Any], bool], str, str]] = {
    "use_vllm": (
        lambda v: isinstance(v, bool),
        "generation always runs on the actors, vLLM or transformers: choose with `actors run --engine vllm`",
        "true or false",
    ),
    "vllm_mode": (
        lambda v: v == "server",
        "generation runs on the actors, as in TRL's server mode (`actors run --engine vllm`)",
        '"server" (the actors are separate processes; colocating them with the learner is not built)',
    ),
    "num_iterations": (
        lambda v: v == 1,
        "each collected batch is trained once (as TRL's default)",
        "1 (for several optimizer steps per collected batch use updates_per_batch: decoupled PPO over "
        "minibatches; the same batch taken several times over is not built)",
    ),
}
"""GRPOConfig keys that migrated configs carry at values that change nothing here:
(accepted value, what the note says, what the key takes here). Other values are refused."""

TRL_BATCH_KEYS = ("per_device_train_batch_size", "gradient_accumulation_steps")
TRL_BATCH_DEFAULT = 8
"""GRPOConfig's per_device_train_batch_size default: what a config giving only
gradient_accumulation_steps trains per device."""


def trl_batch(user: dict[str, Any], generations: Any, notes: list[str]) -> dict[str, Any]:
    """The user's settings with TRL's batch-size keys as groups_per_step: a TRL optimizer
    step takes per_device_train_batch_size x gradient_accumulation_steps x processes
    completions, `generations` (num_generations) to a prompt's group. Said in a note with
    the arithmetic; raises ConfigError where it does not divide or clashes."""
    given = {k: user[k] for k in TRL_BATCH_KEYS if k in user}
    if not given:
        return user
    rest = {k: v for k, v in user.items() if k not in TRL_BATCH_KEYS}
    if "groups_per_step" in user:
        raise ConfigError(f"{' and '.join(given)} and groups_per_step are the same setting: give one of them")
    if any(not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in given.values()):
        raise ConfigError(f"{', '.join(f'{k} = {v!r}' for k, v in given.items())}: takes a positive whole number")
    per_device = given.get("per_device_train_batch_size", TRL_BATCH_DEFAULT)
    accumulation = given.get("gradient_accumulation_steps", 1)
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    completions = per_device * accumulation * processes
    if not isinstance(generations, int) or generations < 1 or completions % generations:
        raise ConfigError(
            f"per_device_train_batch_size x gradient_accumulation_steps x processes = {per_device} x {accumulation} "
            f"x {processes} = {completions} completions a step is not a whole number of groups of num_generations "
            f"{generations} (TRL requires it too); change one, or give groups_per_step instead"
        )
    groups = completions // generations
    notes.append(
        f"groups_per_step = {groups}: per_device_train_batch_size {per_device} x gradient_accumulation_steps "
        f"{accumulation} x {processes} process(es) = {completions} completions a step, / num_generations "
        f"{generations} (micro-batches are by max_tokens_per_microbatch: accumulation needs no setting)"
    )
    return {**rest, "groups_per_step": groups}


def _refuse(key: str, answer: str) -> dict[str, Any]:
    raise _Refused(f"{key} = {answer}")


class _Refused(ValueError):
    pass


def translate_trl(values: dict[str, Any], notes: list[str] | None = None) -> dict[str, Any]:
    """Settings given by their GRPOConfig names, under ours. Raises ConfigError naming
    every GRPOConfig key with no counterpart (with what to do instead) and every name
    given both ways, all at once. A key taken at a value that changes nothing, or
    translated by arithmetic, adds a line to `notes`."""
    notes = notes if notes is not None else []
    refused: list[str] = []
    out: dict[str, Any] = {}
    for key, value in values.items():
        if key in TRL_BATCH_KEYS:  # translated once every source is read (`trl_batch`)
            out[key] = value
            continue
        if key in TRL_NO_OPS:
            accepted, note, takes = TRL_NO_OPS[key]
            if accepted(value):
                notes.append(f"{key} = {value!r} taken: {note}")
            else:
                refused.append(f"{key} = {value!r}: takes {takes}")
            continue
        if key in TRL_ONLY:
            refused.append(f"{key}: {TRL_ONLY[key]}")
            continue
        if key in TRL_VALUES:
            try:
                mapped = TRL_VALUES[key](value)
            except _Refused as err:
                refused.append(str(err))
                continue
            for field, converted in mapped.items():
                if field in values:
                    refused.append(f"{key} and {field} are the same setting: give one of them")
                out[field] = converted
            continue
        field, convert = TRL_NAMES.get(key, (key, lambda v: v))
        if field != key and field in values:
            refused.append(f"{key} and {field} are the same setting: give one of them")
            continue
        if key == "loss_type" and value not in _LOSS_TYPES and value not in _LOSS_TYPES.values():
            refused.append(
                f"loss_type = {value!r}: not built here; loss_type is one of {', '.join(_LOSS_TYPES)} "
                "(or loss_agg token_mean, seq_mean, constant)"
            )
            continue
        out[field] = convert(value)
    if refused:
        raise ConfigError(
            "GRPOConfig settings with no counterpart here (what to do instead):\n  " + "\n  ".join(refused)
        )
    steps = out.get("warmup_steps")
    if isinstance(steps, float) and 0 < steps < 1:  # transformers 5: a warmup_steps below 1 is a ratio
        if "warmup_ratio" in out:
            raise ConfigError("warmup_ratio and a fractional warmup_steps are the same setting: give one of them")
        out["warmup_ratio"] = out.pop("warmup_steps")
    return out


def _unknown(keys: list[str]) -> str:
    known = [*LearnerConfig.model_fields, *TRL_NAMES, *TRL_VALUES, *TRL_NO_OPS, *TRL_BATCH_KEYS]
    parts = []
    for key in keys:
        near = difflib.get_close_matches(key, known, n=1)
        parts.append(f"{key}: unknown setting" + (f" (did you mean {near[0]}?)" if near else ""))
    return "; ".join(parts)


def load_config(
    toml_path: Path | None,
    overrides: dict[str, object],
    defaults: dict[str, object] | None = None,
    notes: list[str] | None = None,
) -> LearnerConfig:
    """`defaults`, then the TOML file's values, then `overrides` (flags the user gave);
    GRPOConfig names are read as ours in each (what that took without a change, or
    translated, is added to `notes`)."""
    values: dict[str, Any] = {}
    if toml_path is not None:
        try:
            values = tomllib.loads(toml_path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as err:
            raise ConfigError(f"--config {toml_path}: {err}") from err
        values = learner_part(values)  # a [learner] table, or top-level keys less the other roles' tables
    notes = notes if notes is not None else []
    user = {**translate_trl(values, notes), **translate_trl(dict(overrides), notes)}
    defaults = defaults or {}
    default_generations = defaults.get("num_generations", LearnerConfig.model_fields["num_generations"].default)
    values = {**defaults, **trl_batch(user, user.get("num_generations", default_generations), notes)}
    unknown = [k for k in values if k not in LearnerConfig.model_fields]
    if unknown:
        raise ConfigError(f"invalid configuration: {_unknown(unknown)}")
    try:
        return LearnerConfig.model_validate(values)
    except ValidationError as err:
        lines = [f"{'.'.join(str(p) for p in e['loc']) or 'config'}: {e['msg']}" for e in err.errors()]
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(lines)) from None
