"""TRL's vocabulary: `GRPOConfig`'s names read as the learner's settings.

Every setting with a `GRPOConfig` counterpart also takes the `GRPOConfig` name, as a key
and as a flag (`TRL_NAMES`: `max_completion_length` is `max_tokens`, `loss_type =
"dr_grpo"` is `loss_agg = "constant"`, ...). Keys whose value maps onto ours are
`TRL_VALUES` (`bf16 = true` is `dtype = "bfloat16"`); keys taken at values that change
nothing, with a note, are `TRL_NO_OPS`; TRL's batch size becomes `groups_per_step`
(`trl_batch`). A `GRPOConfig` key with no counterpart here is refused with what to do
instead (`TRL_ONLY`).
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Callable, Iterable
from typing import Any


class ConfigError(ValueError):
    """The configuration is invalid; the message says which field and how to fix it."""


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


def unknown_settings(keys: list[str], ours: Iterable[str]) -> str:
    """One line for the unknown `keys`, each with the nearest of `ours` and TRL's names."""
    known = [*ours, *TRL_NAMES, *TRL_VALUES, *TRL_NO_OPS, *TRL_BATCH_KEYS]
    parts = []
    for key in keys:
        near = difflib.get_close_matches(key, known, n=1)
        parts.append(f"{key}: unknown setting" + (f" (did you mean {near[0]}?)" if near else ""))
    return "; ".join(parts)
