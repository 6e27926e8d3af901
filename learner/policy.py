"""The policy: a Hugging Face causal LM with one PEFT LoRA adapter.

The reference policy for the KL term is the same model with the adapter disabled,
so there is never a second copy of the weights. The adapter is what gets
published and checkpointed: `adapter_state()` snapshots it (a copy, so the upload
can run while training continues) and `adapter_files()` renders it as the
`adapter_model.safetensors` + `adapter_config.json` pair that PEFT and vLLM load.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor

from learner.config import LearnerConfig
from learner.data import context_of
from learner.dist import Dist, fill_from_rank0, full_tensor, resolve_device, shard_model
from learner.loss import ACTIVATION_FLOATS_PER_LAYER_WIDTH, entropy, sampling_moments, token_logps
from protocol import SamplingParams
from protocol.wire.files import ADAPTER_CONFIG, ADAPTER_WEIGHTS

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
    ids = torch.full((len(lengths), width), pad_id, dtype=torch.long, device="cpu")
    attn = torch.zeros((len(lengths), width), dtype=torch.long, device="cpu")
    mask = torch.zeros((len(lengths), width - 1), dtype=torch.float32, device="cpu")
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        seq = torch.as_tensor([*list(p), *list(c)], dtype=torch.long, device="cpu")
        ids[i, : len(seq)] = seq
        attn[i, : len(seq)] = 1
        mask[i, len(p) - 1 : len(seq) - 1] = 1.0
    return Sequences(ids, attn, mask)


def scatter_completion_values(values: list[Any], prompt_lens: list[int], width: int) -> Tensor:
    """Place per-completion-token values (behaviour log-probs) into the `_BT` layout."""
    out = torch.zeros((len(values), width - 1), dtype=torch.float32, device="cpu")
    for i, (v, p) in enumerate(zip(values, prompt_lens, strict=True)):
        v = torch.tensor(v, dtype=torch.float32, device="cpu")  # a copy: unpacked arrays are read-only views
        out[i, p - 1 : p - 1 + v.numel()] = v
    return out


class Policy:
    """On `dist.device`; under torchrun, sharded with FSDP2 across the ranks
    (`learner.dist`). The base weights are in `cfg.dtype`; PEFT keeps the LoRA
    parameters (and so the optimizer state) in float32 and casts at their boundary."""

    def __init__(self, cfg: LearnerConfig, dist: Dist | None = None) -> None:
        from peft import LoraConfig, get_peft_model
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        self.cfg = cfg
        self.dist = dist or Dist(device=resolve_device(cfg.device))
        self.device = self.dist.device
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model)
        # under torchrun only rank 0 reads the weights; the others build the model's shape
        # on the meta device (no memory) and receive their shards from rank 0 below
        follower = self.dist.enabled and not self.dist.main
        if follower:
            with torch.device("meta"):
                base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(cfg.model), dtype=_DTYPES[cfg.dtype])
        else:
            base = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=_DTYPES[cfg.dtype])
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        targets: Any = "all-linear" if cfg.target_modules == ["all-linear"] else cfg.target_modules
        lora = LoraConfig(
            r=cfg.lora_rank,
            lora_alpha=cfg.lora_alpha,  # type: ignore[arg-type]  # annotated int by PEFT; used as a float (alpha / r)
            lora_dropout=cfg.lora_dropout,
            target_modules=targets,
            task_type="CAUSAL_LM",
        )
        if cfg.gradient_checkpointing:
            # transformers 5.2x: activation_checkpointing_enable(activation_checkpointing_kwargs=...), the old
            # name deprecated; before it, gradient_checkpointing_enable(gradient_checkpointing_kwargs=...)
            enable = getattr(base, "activation_checkpointing_enable", None)
            if enable is not None and "activation_checkpointing_kwargs" in inspect.signature(enable).parameters:
                enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            base.enable_input_require_grads()
        with warnings.catch_warnings():
            # peft 0.21 reads transformers 5's deprecated `is_gradient_checkpointing`
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            self.model = get_peft_model(base, lora)  # autocast_adapter_dtype: LoRA weights in float32
        if self.dist.enabled:
            full = {} if follower else self.model.state_dict()  # rank 0's whole model, adapter included
            shard_model(self.model, self.dist)  # moves each rank's shards to its device
            fill_from_rank0(self.model, full, self.dist)
        else:
            self.model.to(self.device)
        self.model.train()
        # (name, parameter) of the adapter, in one order on every rank (gathers pair up)
        self._trainable = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.vocab_size = int(base.config.vocab_size)
        text = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
        layers, width = int(getattr(text, "num_hidden_layers", 0) or 0), int(getattr(text, "hidden_size", 0) or 0)
        self.activation_bytes_per_token = (
            layers * width * _DTYPES[cfg.dtype].itemsize * ACTIVATION_FLOATS_PER_LAYER_WIDTH
        )
        """Activations kept for backward per token, by the rule in `learner.train` (0: unknown)."""
        self.activation_budget = (
            torch.cuda.get_device_properties(self.device).total_memory // 4 if self.device.type == "cuda" else 2 << 30
        )
        """What one micro-batch's activations may take: 2 GiB on a CPU, a quarter of a GPU."""
        self.context = context_of(cfg.max_seq_len, base.config)
        self.base_model_name = cfg.model

    @property
    def pad_id(self) -> int:
        return int(self.tokenizer.pad_token_id)

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for _, p in self._trainable]

    def forward_logps(
        self, seqs: Sequences, temperature: float, *, with_entropy: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """Log-probabilities (B, T) of each next token at `temperature`, and entropies (0
        before the first completion token of any row). The LM head runs only from the
        earliest position a completion occupies (transformers' `logits_to_keep`: the
        prompts before it are never projected to the vocabulary, which with 700-token
        prompts was most of the learner's memory), and the log-softmax over those
        positions runs in chunks (`learner.loss.token_logps`)."""
        logits, start = self._completion_logits(seqs)
        logps = token_logps(logits, seqs.targets_BT[:, start:], temperature)
        ent = entropy(logits, temperature) if with_entropy else None
        return _left_pad(logps, start), None if ent is None else _left_pad(ent, start)

    @torch.no_grad()
    def sampling_moments(self, seqs: Sequences, sampling: SamplingParams) -> tuple[Tensor, Tensor, Tensor]:
        """Per position (B, T), with no gradient: the log-probability of the next token, and
        the mean and variance of the log-probability of a token sampled from the
        distribution `sampling` makes there (`learner.loss.sampling_moments`): what
        an audit compares a worker's tokens with (`learner.audit`)."""
        logits, start = self._completion_logits(seqs)
        logp, mean, var = sampling_moments(
            logits,
            seqs.targets_BT[:, start:],
            sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            min_p=sampling.min_p,
        )
        return _left_pad(logp, start), _left_pad(mean, start), _left_pad(var, start)

    def _completion_logits(self, seqs: Sequences) -> tuple[Tensor, int]:
        """The logits (B, T - start, V) from `start`, the first position any completion occupies."""
        T = seqs.mask_BT.shape[1]
        active = seqs.mask_BT.any(0).nonzero()
        start = min(int(active[0]) if len(active) else T, max(T - 1, 0))  # an empty pass keeps one position
        keep = torch.arange(start, T, device=seqs.input_ids_BL.device)
        out = self.model(
            input_ids=seqs.input_ids_BL, attention_mask=seqs.attention_mask_BL, use_cache=False, logits_to_keep=keep
        )
        logits = out.logits  # (B, T - start, V)
        if logits.shape[1] != T - start:  # a model that ignores logits_to_keep: every position came back
            logits = logits[:, start:T]
        return logits, start

    @contextlib.contextmanager
    def reference(self) -> Iterator[None]:
        """The base model: the adapter switched off for the duration."""
        with self.model.disable_adapter():
            yield

    # -- the adapter as files
    def _peft_key(self, name: str) -> str:
        """A parameter's name in PEFT's saved files (without the adapter's name)."""
        return name.replace(".default.", ".")

    def adapter_state(self) -> dict[str, Tensor]:
        """The whole adapter on the CPU, PEFT's keys (a collective under torchrun: every
        rank calls it; rank 0 uses the result)."""
        return {
            self._peft_key(n): full_tensor(p.detach()).to("cpu", copy=True).contiguous() for n, p in self._trainable
        }

    def load_adapter_state(self, state: dict[str, Tensor]) -> None:
        """Set the adapter from `state` (PEFT's keys). Under torchrun every rank calls it
        and rank 0's state is broadcast into every rank's shards (the others pass {})."""
        if self.dist.main:
            names = {self._peft_key(n) for n, _ in self._trainable}
            unexpected, missing = sorted(set(state) - names), sorted(names - set(state))
            if unexpected or missing:
                raise ValueError(
                    f"adapter state does not match the model: unexpected {unexpected[:3]}, missing {missing[:3]}"
                )
        if not self.dist.enabled:
            with torch.no_grad():
                for n, p in self._trainable:
                    p.copy_(state[self._peft_key(n)].to(p.device, p.dtype))
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        full = {n: state[self._peft_key(n)] for n, _ in self._trainable} if self.dist.main else {}
        set_model_state_dict(
            self.model,
            cast(dict[str, Any], full),
            options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False),
        )

    def adapter_config_json(self) -> bytes:
        config = self.model.peft_config["default"].to_dict()
        config["base_model_name_or_path"] = self.base_model_name
        config["inference_mode"] = True
        for key, value in config.items():
            if isinstance(value, set):
                config[key] = sorted(value)
        return json.dumps(config, indent=2, sort_keys=True, default=str).encode()


def _left_pad(values_BT: Tensor, start: int) -> Tensor:
    """`values_BT` from position `start`, with zeros before it."""
    if not start:
        return values_BT
    return torch.cat([values_BT.new_zeros(values_BT.shape[0], start), values_BT], dim=1)


def adapter_files(state: dict[str, Tensor], config_json: bytes) -> dict[str, bytes]:
    """The two files of an adapter, as PEFT's `save_pretrained` names them."""
    from safetensors.torch import save

    return {ADAPTER_WEIGHTS: save(state, metadata={"format": "pt"}), ADAPTER_CONFIG: config_json}


def read_adapter_weights(data: bytes) -> dict[str, Tensor]:
    from safetensors.torch import load

    return load(data)
