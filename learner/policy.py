"""The policy: a Hugging Face causal LM with one PEFT LoRA adapter.

The reference policy for the KL term is the same model with the adapter disabled,
so there is never a second copy of the weights. The adapter is what gets
published and checkpointed: `adapter_state()` snapshots it (a copy, so the upload
can run while training continues) and `adapter_files()` renders it as the
`adapter_model.safetensors` + `adapter_config.json` pair that PEFT and vLLM load.
"""

from __future__ import annotations

import contextlib
import json
import logging
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from learner.config import LearnerConfig
from learner.loss import entropy, token_logps
from protocol.store import ADAPTER_CONFIG, ADAPTER_WEIGHTS

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Sequences:
    """Prompt+completion sequences, right-padded, in the learner's layout: position t
    of the `_BT` tensors is the prediction of token t+1 of the sequence."""

    input_ids_BL: Tensor
    attention_mask_BL: Tensor
    mask_BT: Tensor
    """1 where token t+1 is a completion token (what the loss sees)."""

    @property
    def targets_BT(self) -> Tensor:
        return self.input_ids_BL[:, 1:]

    def __len__(self) -> int:
        return self.input_ids_BL.shape[0]

    def select(self, rows: slice) -> Sequences:
        return Sequences(self.input_ids_BL[rows], self.attention_mask_BL[rows], self.mask_BT[rows])


def pack_sequences(
    prompts: list[list[int]] | list[Any], completions: list[list[int]] | list[Any], pad_id: int
) -> Sequences:
    """Right-pad prompt+completion pairs into one batch."""
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions, strict=True)]
    width = max(lengths)
    ids = torch.full((len(lengths), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(lengths), width), dtype=torch.long)
    mask = torch.zeros((len(lengths), width - 1), dtype=torch.float32)
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        seq = torch.as_tensor([*list(p), *list(c)], dtype=torch.long)
        ids[i, : len(seq)] = seq
        attn[i, : len(seq)] = 1
        mask[i, len(p) - 1 : len(seq) - 1] = 1.0
    return Sequences(ids, attn, mask)


def scatter_completion_values(values: list[Any], prompt_lens: list[int], width: int) -> Tensor:
    """Place per-completion-token values (behaviour log-probs) into the `_BT` layout."""
    out = torch.zeros((len(values), width - 1), dtype=torch.float32)
    for i, (v, p) in enumerate(zip(values, prompt_lens, strict=True)):
        v = torch.tensor(v, dtype=torch.float32)  # a copy: unpacked arrays are read-only views
        out[i, p - 1 : p - 1 + v.numel()] = v
    return out


class Policy:
    def __init__(self, cfg: LearnerConfig) -> None:
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.cfg = cfg
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model)
        base = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=_DTYPES[cfg.dtype])
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        targets: Any = "all-linear" if cfg.target_modules == ["all-linear"] else cfg.target_modules
        lora = LoraConfig(
            r=cfg.lora_rank,
            lora_alpha=cfg.lora_alpha,
            lora_dropout=cfg.lora_dropout,
            target_modules=targets,
            task_type="CAUSAL_LM",
        )
        if cfg.gradient_checkpointing:
            # transformers 5 renamed it; 4.x only has the old name
            enable = getattr(base, "activation_checkpointing_enable", None) or base.gradient_checkpointing_enable
            enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            base.enable_input_require_grads()
        with warnings.catch_warnings():
            # peft 0.21 reads transformers 5's deprecated `is_gradient_checkpointing`
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            self.model = get_peft_model(base, lora)
        self.model.train()
        self.vocab_size = int(base.config.vocab_size)
        self.context = int(
            cfg.max_seq_len or getattr(base.config, "max_position_embeddings", None) or 4096
        )
        self.base_model_name = cfg.model

    @property
    def pad_id(self) -> int:
        return int(self.tokenizer.pad_token_id)

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def forward_logps(
        self, seqs: Sequences, temperature: float, *, with_entropy: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """Log-probabilities (B, T) of each next token at `temperature`, and entropies."""
        out = self.model(input_ids=seqs.input_ids_BL, attention_mask=seqs.attention_mask_BL, use_cache=False)
        logits = out.logits[:, :-1]
        logps = token_logps(logits, seqs.targets_BT, temperature)
        ent = entropy(logits, temperature) if with_entropy else None
        return logps, ent

    @contextlib.contextmanager
    def reference(self) -> Iterator[None]:
        """The base model: the adapter switched off for the duration."""
        with self.model.disable_adapter():
            yield

    # -- the adapter as files
    def adapter_state(self) -> dict[str, Tensor]:
        from peft import get_peft_model_state_dict

        return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in get_peft_model_state_dict(self.model).items()}

    def load_adapter_state(self, state: dict[str, Tensor]) -> None:
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(self.model, state)
        unexpected = getattr(result, "unexpected_keys", [])
        if unexpected:
            raise ValueError(f"adapter state has keys the model lacks: {unexpected[:3]}")

    def adapter_config_json(self) -> bytes:
        config = self.model.peft_config["default"].to_dict()
        config["base_model_name_or_path"] = self.base_model_name
        config["inference_mode"] = True
        for key, value in config.items():
            if isinstance(value, set):
                config[key] = sorted(value)
        return json.dumps(config, indent=2, sort_keys=True, default=str).encode()


def adapter_files(state: dict[str, Tensor], config_json: bytes) -> dict[str, bytes]:
    """The two files of an adapter, as PEFT's `save_pretrained` names them."""
    from safetensors.torch import save

    return {ADAPTER_WEIGHTS: save(state, metadata={"format": "pt"}), ADAPTER_CONFIG: config_json}


def read_adapter_weights(data: bytes) -> dict[str, Tensor]:
    from safetensors.torch import load

    return load(data)
