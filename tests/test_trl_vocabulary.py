"""TRL's vocabulary: GRPOConfig names as keys and flags, GSPO's sequence-level ratio,
truncated completions left out of the loss, and data set configurations."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from factories import write_dataset

from learner.cli import build_parser
from learner.config import ConfigError
from learner.data import load_rows
from learner.grpoconfig import TRL_NAMES, TRL_ONLY
from learner.load_config import load_config
from learner.loss import policy_loss

REPO = Path(__file__).resolve().parents[1]

OURS = {
    "max_tokens": 64,
    "loss_agg": "constant",
    "epsilon_low": 0.3,
    "advantage_scale": "none",
    "lr_scheduler": "cosine",
    "steps": 50,
    "log_every": 5,
    "checkpoint_every": 25,
    "keep_checkpoints": 3,
    "run_dir": "out/run",
    "num_generations": 4,
    "epsilon_high": 0.3,
    "beta": 0.04,
    "learning_rate": 1e-6,
    "seed": 7,
    "warmup_ratio": 0.1,
    "importance_sampling_level": "sequence",
    "mask_truncated_completions": True,
    "reward": ["toy_rewards:digit_first", "toy_rewards:length_bonus"],
    "reward_weights": [1.0, 0.5],
    "run": "trl-names",
    "environment": "toy_tools:GuessNumber",
}
TRL = {
    "max_completion_length": 64,
    "loss_type": "dr_grpo",
    "epsilon": 0.3,
    "scale_rewards": False,
    "lr_scheduler_type": "cosine",
    "max_steps": 50,
    "logging_steps": 5,
    "save_steps": 25,
    "save_total_limit": 3,
    "output_dir": "out/run",
    "num_generations": 4,
    "epsilon_high": 0.3,
    "beta": 0.04,
    "learning_rate": 1e-6,
    "seed": 7,
    "warmup_ratio": 0.1,
    "importance_sampling_level": "sequence",
    "mask_truncated_completions": True,
    # GRPOTrainer's arguments beside GRPOConfig's keys
    "reward_funcs": ["toy_rewards:digit_first", "toy_rewards:length_bonus"],
    "reward_weights": [1.0, 0.5],
    "run_name": "trl-names",
    "environment_factory": "toy_tools:GuessNumber",
}


def _toml(values: dict[str, object]) -> str:
    return "".join(f"{k} = {json.dumps(v)}\n" for k, v in values.items())


def test_grpoconfig_names_give_the_same_configuration(tmp_path: Path) -> None:
    (tmp_path / "ours.toml").write_text(_toml(OURS))
    (tmp_path / "trl.toml").write_text("[learner]\n" + _toml(TRL))
    ours = load_config(tmp_path / "ours.toml", {})
    assert load_config(tmp_path / "trl.toml", {}) == ours
    assert ours.warmup == 5 and ours.reward_specs == ["toy_rewards:digit_first=1.0", "toy_rewards:length_bonus=0.5"]
    assert set(TRL_NAMES) <= set(TRL)  # every translated name is exercised here
    flags = build_parser().parse_args(
        [
            "run",
            "--max-completion-length",
            "64",
            "--loss-type",
            "dr_grpo",
            "--epsilon",
            "0.3",
            "--scale-rewards",
            "none",
            "--lr-scheduler-type",
            "cosine",
            "--max-steps",
            "50",
            "--logging-steps",
            "5",
            "--save-steps",
            "25",
            "--save-total-limit",
            "3",
            "--output-dir",
            "out/run",
            "--num-generations",
            "4",
            "--epsilon-high",
            "0.3",
            "--beta",
            "0.04",
            "--learning-rate",
            "1e-6",
            "--seed",
            "7",
            "--warmup-ratio",
            "0.1",
            "--importance-sampling-level",
            "sequence",
            "--mask-truncated-completions",
            "--reward",
            "toy_rewards:digit_first",
            "--reward",
            "toy_rewards:length_bonus",
            "--reward-weights",
            "1.0",
            "0.5",
            "--run-name",
            "trl-names",
            "--environment-factory",
            "toy_tools:GuessNumber",
            "--log-level",
            "warning",
        ]
    )
    overrides = {k: v for k, v in vars(flags).items() if k not in ("command", "config", "verbose", "log_level")}
    assert load_config(None, overrides) == ours
    for loss_type, agg in (("grpo", "seq_mean"), ("dapo", "token_mean"), ("bnpo", "token_mean")):
        assert load_config(None, {"loss_type": loss_type}).loss_agg == agg
    assert load_config(None, {"scale_rewards": True}).advantage_scale == "group"
    assert load_config(None, {"warmup_steps": 0.2, "steps": 10}).warmup == 2  # transformers 5's ratio form


def test_unknown_and_trl_only_keys_are_refused_with_a_way_forward(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"max_complection_length: unknown setting \(did you mean max_completion_length\?\)"
    ):
        load_config(None, {"max_complection_length": 3})
    with pytest.raises(ConfigError, match=r"lerning_rate: unknown setting \(did you mean learning_rate\?\)"):
        load_config(None, {"lerning_rate": 3})
    with pytest.raises(ConfigError, match=r"no counterpart here.*\n  vllm_server_port: generation runs on the actors"):
        load_config(None, {"vllm_server_port": 8000})
    assert all(reason for reason in TRL_ONLY.values())
    with pytest.raises(ConfigError, match="max_completion_length and max_tokens are the same setting"):
        load_config(None, {"max_completion_length": 3, "max_tokens": 4})
    with pytest.raises(ConfigError, match="warmup_ratio and warmup_steps"):
        load_config(None, {"warmup_ratio": 0.1, "warmup_steps": 4})
    with pytest.raises(ConfigError, match="one weight per reward function"):
        load_config(None, {"reward": ["a:b"], "reward_weights": [1.0, 2.0]})


def test_every_grpoconfig_key_is_answered() -> None:
    """TRL 1.16's GRPOConfig, every field: ours by the same name, translated, mapped by its
    value, or refused with what to do instead."""
    import dataclasses

    from trl import GRPOConfig

    from learner.config import LearnerConfig
    from learner.grpoconfig import TRL_BATCH_KEYS, TRL_NO_OPS, TRL_VALUES

    keys = [f.name for f in dataclasses.fields(GRPOConfig) if not f.name.startswith("_")]
    answered = set(LearnerConfig.model_fields) | set(TRL_NAMES) | set(TRL_VALUES) | set(TRL_ONLY)
    answered |= set(TRL_NO_OPS) | set(TRL_BATCH_KEYS)
    assert [k for k in keys if k not in answered] == []


def test_a_migrating_config_gets_every_answer_at_once(tmp_path: Path) -> None:
    carried = {
        "bf16": True,
        "log_completions": False,
        "use_cpu": True,
        "eval_strategy": "steps",
        "eval_steps": 5,
        "eval_dataset": "held.jsonl",
        "save_strategy": "steps",
        "shuffle_dataset": True,
    }
    cfg = load_config(None, carried)
    assert (cfg.dtype, cfg.samples_every, cfg.device, cfg.eval_every) == ("bfloat16", 0, "cpu", 5)
    assert load_config(None, {"fp16": True}).dtype == "float16"
    assert load_config(None, {"eval_strategy": "no"}).eval_every == 0
    (tmp_path / "trl.toml").write_text(
        'model_init_kwargs = { torch_dtype = "bfloat16" }\n'
        + _toml(
            {
                "push_to_hub": True,
                "disable_dropout": True,
                "vllm_importance_sampling_correction": True,
                "loss_type": "cispo",
                "eval_strategy": "epoch",
                "dataloader_num_workers": 4,
                "num_iterations": 2,
                "vllm_mode": "colocate",
                "learning_rate": 1e-6,
            }
        )
    )
    with pytest.raises(ConfigError) as caught:
        load_config(tmp_path / "trl.toml", {})
    message = str(caught.value)
    for answer in (
        "push_to_hub: publish the trained adapter after the run: `learner export",
        "model_init_kwargs: --dtype",
        "disable_dropout: dropout is --lora-dropout",
        "vllm_importance_sampling_correction: the off-policy correction is --correction",
        "loss_type = 'cispo': not built here; loss_type is one of grpo, dapo, bnpo, dr_grpo",
        "eval_strategy = 'epoch': evaluation is counted in adapter versions",
        "dataloader_num_workers: prompts are issued",
        "num_iterations = 2: takes 1 (for several optimizer steps per collected batch use updates_per_batch",
        "vllm_mode = 'colocate': takes \"server\"",
    ):
        assert answer in message, message
    assert "token_mean" not in message.split("loss_agg")[0]  # our internal names come second, as an alternative
    with pytest.raises(ConfigError, match="bf16 and dtype are the same setting"):
        load_config(None, {"bf16": True, "dtype": "float32"})


def test_trl_no_op_values_are_taken_with_a_note(tmp_path: Path) -> None:
    """What migrated configs carry at values that change nothing here is taken, each with
    one line; the same keys at values that would change something are refused."""
    (tmp_path / "trl.toml").write_text(
        _toml({"use_vllm": True, "vllm_mode": "server", "num_iterations": 1, "gradient_accumulation_steps": 1})
    )
    notes: list[str] = []
    cfg = load_config(tmp_path / "trl.toml", {}, notes=notes)
    assert cfg == load_config(None, {"groups_per_step": 1})  # 8 x 1 x 1 completions: one group of 8
    assert [n.split(" ")[0] for n in notes] == ["use_vllm", "vllm_mode", "num_iterations", "groups_per_step"]
    assert "use_vllm = True taken: generation always runs on the actors" in notes[0]
    assert load_config(None, {"use_vllm": False}).groups_per_step == 16  # either value: the actors' --engine decides
    with pytest.raises(ConfigError, match="use_vllm = 'yes': takes true or false"):
        load_config(None, {"use_vllm": "yes"})


def test_trl_batch_size_becomes_groups_per_step_with_the_arithmetic(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    notes: list[str] = []
    cfg = load_config(
        None, {"per_device_train_batch_size": 16, "gradient_accumulation_steps": 2, "num_generations": 4}, notes=notes
    )
    assert cfg.groups_per_step == 8
    assert notes == [
        "groups_per_step = 8: per_device_train_batch_size 16 x gradient_accumulation_steps 2 x 1 process(es) = 32 "
        "completions a step, / num_generations 4 (micro-batches are by max_tokens_per_microbatch: accumulation "
        "needs no setting)"
    ]
    assert load_config(None, {"gradient_accumulation_steps": 4}).groups_per_step == 4  # TRL's default 8 a device
    # the flag overrides the file's num_generations before the arithmetic, as the last word on it
    assert load_config(None, {"per_device_train_batch_size": 8, "num_generations": 2}).groups_per_step == 4
    monkeypatch.setenv("WORLD_SIZE", "2")  # torchrun's processes, as TRL's
    assert load_config(None, {"per_device_train_batch_size": 8}).groups_per_step == 2
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(ConfigError, match=r"8 x 1 x 1 = 8 completions a step is not a whole number of groups of"):
        load_config(None, {"per_device_train_batch_size": 8, "num_generations": 3})
    with pytest.raises(ConfigError, match="per_device_train_batch_size and groups_per_step are the same setting"):
        load_config(None, {"per_device_train_batch_size": 8, "groups_per_step": 2})
    with pytest.raises(ConfigError, match=r"gradient_accumulation_steps = 0: takes a positive whole number"):
        load_config(None, {"gradient_accumulation_steps": 0})


def test_the_console_says_what_trl_keys_were_taken_as() -> None:
    from learner.cli import resolve_config

    cfg, notice = resolve_config(None, {"per_device_train_batch_size": 16, "num_iterations": 1})
    assert cfg.groups_per_step == 2 and cfg.run == "demo"  # the embedded default's other settings stand
    assert notice is not None and "learner run: groups_per_step = 2: per_device_train_batch_size 16" in notice
    assert "learner run: num_iterations = 1 taken" in notice


def test_gspo_ratio_is_the_geometric_mean_of_the_sequence(tmp_path: Path) -> None:
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, 0.0]], requires_grad=True)
    prox = torch.tensor([[-1.2, -1.8, -3.0], [-0.4, -0.9, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv = torch.tensor([1.0, -1.0])
    loss, clipped = policy_loss(
        logp, prox, adv, torch.ones(2, 3), epsilon_low=0.2, epsilon_high=0.2, level="sequence", mask_BT=mask
    )
    # by hand: sequence 0 log-ratios 0.2, -0.2, 0 -> mean 0 -> ratio 1, inside the clip
    # sequence 1 log-ratios -0.1, 0.4 (the third is padding) -> mean 0.15 -> ratio e^0.15
    r1 = math.exp(0.15)
    expected = torch.tensor([[-1.0, -1.0, -1.0], [max(r1 * -1.0, 1.2 * -1.0) * -1.0] * 3])
    assert torch.allclose(loss, expected, atol=1e-6)
    assert clipped.tolist() == [[False] * 3, [False] * 3]  # e^0.15 = 1.16 < 1.2
    # d/dlogp_k of -A·exp(mean log-ratio), ratio 1: -A/3 for every token, whichever token's loss
    loss[0, 0].backward()
    assert torch.allclose(logp.grad[0], torch.full((3,), -1.0 / 3), atol=1e-6)
    token_level, _ = policy_loss(logp.detach(), prox, adv, torch.ones(2, 3), epsilon_low=0.2, epsilon_high=0.2)
    assert not torch.allclose(token_level, loss.detach())


def test_truncated_completions_are_left_out_of_the_loss(tmp_path: Path, tiny_model: Path) -> None:
    from factories import batch, group

    from learner.batch import build_step_batch
    from protocol import Completion, group_id_for, pack_i32

    b = batch(0, prompts=1)
    g = group(b, 0)
    cut = Completion.of([10, 11, 12], [-0.5] * 3, finish_reason="length", reward=1.0)
    g = type(g)(
        **{
            **{f: getattr(g, f) for f in g.__struct_fields__},
            "completions": [cut, *g.completions[1:]],
            "group_id": group_id_for(b.batch_id, "p0"),
            "prompt_token_ids": pack_i32([1, 2, 3]),
        }
    )
    for masked in (False, True):
        cfg = load_config(None, {"mask_truncated_completions": masked, "num_generations": 4})
        step = build_step_batch([g], cfg, pad_id=0)
        assert step.seqs.mask_BT[0].sum().item() == (0 if masked else 3)
        assert all(step.seqs.mask_BT[i].sum().item() == 4 for i in (1, 2, 3))
        assert step.advantages_N.numel() == 4  # it still counts in its group's advantages


def test_a_local_data_set_with_configurations(tmp_path: Path) -> None:
    folder = tmp_path / "gsm8k-like"
    for config in ("main", "socratic"):
        (folder / config).mkdir(parents=True)
        write_dataset(folder / config / "train.jsonl", n=3 if config == "main" else 5)
    (folder / "README.md").write_text(
        "---\nconfigs:\n"
        "- config_name: main\n  data_files:\n  - split: train\n    path: main/train.jsonl\n"
        "- config_name: socratic\n  data_files:\n  - split: train\n    path: socratic/train.jsonl\n---\n"
    )
    assert len(load_rows(str(folder), "train", "main")) == 3
    assert len(load_rows(str(folder), "train", "socratic")) == 5
    assert load_config(None, {"dataset": str(folder), "dataset_config": "main"}).dataset_config == "main"


def test_min_p_and_repetition_penalty_reach_the_transformers_engine(tiny_model: Path) -> None:
    from actors.hf_engine import TransformersEngine
    from protocol import SamplingParams

    engine = TransformersEngine(str(tiny_model))
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    greedy = engine.generate(prompts, 1, SamplingParams(temperature=0.0, max_tokens=8), 0)
    # min_p = 1 keeps only the likeliest token: sampling at temperature 1 is greedy decoding
    only_top = engine.generate(prompts, 4, SamplingParams(temperature=1.0, min_p=1.0, max_tokens=8), 0)
    for g, samples in zip(greedy, only_top, strict=True):
        assert all(s.token_ids == g[0].token_ids for s in samples)
    penalised = engine.generate(prompts, 1, SamplingParams(temperature=0.0, repetition_penalty=10.0, max_tokens=8), 0)
    for prompt, plain, pen in zip(prompts, greedy, penalised, strict=True):
        seen = prompt + plain[0].token_ids
        assert len(set(seen)) < len(seen), "this check needs greedy decoding to repeat a token"
        body = [t for t in pen[0].token_ids if t != engine.tokenizer.eos_token_id]
        assert len(set(prompt + body)) == len(prompt + body), (prompt, body)


def test_chat_template_kwargs_reach_the_template(tiny_model: Path) -> None:
    from transformers import AutoTokenizer

    from learner.data import PromptSource
    from protocol import unpack_i32

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}:{% else %}?{% endif %}"
    )
    rows = [{"prompt": [{"role": "user", "content": "abc"}]}]
    plain = PromptSource(rows, tokenizer, "prompt", 0, 100).prompt(0)
    no_think = PromptSource(rows, tokenizer, "prompt", 0, 100, chat_template_kwargs={"enable_thinking": False}).prompt(
        0
    )
    decode = lambda p: tokenizer.decode(unpack_i32(p.token_ids).tolist())  # noqa: E731
    assert decode(plain).endswith("abc?") and decode(no_think).endswith("abc:")
    assert build_parser().parse_args(
        ["run", "--chat-template-kwargs", '{"enable_thinking": false}']
    ).chat_template_kwargs == {"enable_thinking": False}
