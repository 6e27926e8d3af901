"""Prompts from a data set, in a deterministic order addressed by a cursor.

A data set is a Hugging Face `datasets` id or a local `.jsonl`/`.json`/`.parquet`
file with a prompt column: a string, or a list of chat messages (which go through
the tokenizer's chat template, as TRL does for conversational data). The other
columns travel with the prompt so reward functions receive them as keyword
arguments, as in TRL.

Order: epoch e visits the rows in a permutation seeded by (seed, e), so batch k of
the run is the same batch after any number of restarts; the cursor in a checkpoint
is all it takes to continue.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from protocol import ChatTurn, Prompt, pack_i32
from protocol.util.logs import own_handlers_off


class DataError(ValueError):
    """The data set cannot be used as configured."""

    fix = "check --dataset-config, --dataset-split and --prompt-column"


class ModelCannotOfferTools(DataError):
    """The model's chat template cannot render tool calls, and no fallback fits it."""

    fix = (
        "give --model a model whose chat template offers tools (Qwen2.5, Llama 3.1, SmolLM3, ...), "
        "or set a tool-calling chat template on its tokenizer"
    )


class HubUnreachable(DataError):
    """A hub data set was asked for and the hub cannot be reached."""

    fix = (
        "check this machine's network and proxy settings, HF_TOKEN for a gated or private data set, or "
        "HF_HUB_OFFLINE=1 to read the local cache; or give a local .jsonl/.json/.parquet file or folder"
    )

    def __init__(self, reason: str) -> None:
        super().__init__(f"{reason}; {self.fix}")
        self.reason = reason


class DoesNotFit(DataError):
    """A prompt and the longest completion do not fit in the model's context."""

    def __init__(self, reason: str, fix: str) -> None:
        super().__init__(f"{reason}; {fix}")
        self.reason, self.fix = reason, fix


def load_rows(spec: str, split: str = "train", config: str | None = None) -> list[dict[str, Any]]:
    """Rows of a local file, a local data set folder (a README with `configs:`, as on the
    hub) or a hub data set (hub ids need network access); `config` names its
    configuration (GSM8K's `main`)."""
    path = Path(spec)
    if path.is_dir():
        try:
            return list(_load_dataset()(str(path), config, split=split))
        except ValueError as err:
            raise DataError(f"--dataset {spec}: {err}") from None
    if path.suffix in (".jsonl", ".json", ".parquet") or path.exists():
        if not path.is_file():
            raise DataError(f"--dataset {spec}: no such file")
        if config:
            raise DataError(
                f"--dataset {spec}: a single file has no configurations, and --dataset-config {config} "
                "would be ignored; leave it out (or give the data set's folder, whose README names them)"
            )
        if path.suffix == ".jsonl":
            rows = []
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as err:
                        raise DataError(f"--dataset {spec}, line {n}: {err}") from None
            return rows
        kind = "parquet" if path.suffix == ".parquet" else "json"
        return list(_load_dataset()(kind, data_files=str(path), split="train"))
    try:
        return list(_load_dataset()(spec, config, split=split))
    except ConnectionError as err:  # datasets' own, for a hub it cannot reach (after its retries)
        raise HubUnreachable(f"--dataset {spec}: {err}") from None


def _load_dataset() -> Callable[..., Any]:
    """datasets' `load_dataset`, imported when first needed (it takes seconds), with the
    library's own log handler off: its records (a hub retry) print once, in our format."""
    from datasets import load_dataset

    own_handlers_off("datasets")
    load: Callable[..., Any] = load_dataset
    return load


Sources = tuple["PromptSource", "PromptSource | None"]
"""The training prompts, and the held-out ones (None without evaluation)."""


def context_of(max_seq_len: int | None, model_config: Any) -> int:
    """Tokens a sequence may hold, prompt and completion: `--max-seq-len`, else the model's."""
    return int(max_seq_len or getattr(model_config, "max_position_embeddings", None) or 4096)


def open_sources(cfg: Any, tokenizer: Any, context: int) -> Sources:
    """The training prompts and the held-out ones (None without evaluation), each checked
    to fit the context with `max_tokens`."""

    tools = episode_tools(cfg, tokenizer)

    def source(spec: str, split: str, what: str) -> PromptSource:
        made = PromptSource(
            load_rows(spec, split, cfg.dataset_config),
            tokenizer,
            cfg.prompt_column,
            cfg.seed,
            max_prompt_tokens=max(1, context - cfg.max_tokens),
            chat_template_kwargs=cfg.chat_template_kwargs,
            tools=tools,
        )
        made.check_fits(what, cfg.max_tokens, context)
        return made

    train = source(cfg.dataset, cfg.dataset_split, f"--dataset {cfg.dataset}")
    held_out = (
        source(cfg.eval_dataset, cfg.eval_split, f"--eval-dataset {cfg.eval_dataset}") if cfg.eval_every else None
    )
    return train, held_out


def episode_tools(cfg: Any, tokenizer: Any) -> Tools | None:
    """`--tools` and the `--environment`'s methods loaded and described, with the chat
    template that offers them (None: single completions). Raises `DataError` with what to do."""
    if not cfg.tools and not cfg.environment:
        return None
    from protocol.usercode.chat import (
        ToolError,
        ToolTemplateError,
        load_episode_tools,
        say_template,
        tool_template,
    )

    try:
        functions, environment = load_episode_tools(cfg.tools, cfg.environment or None)
        tools = Tools(
            functions,
            tool_template(tokenizer),
            environment.__name__ if environment else None,
            cfg.max_tool_calling_iterations,
        )
    except ToolTemplateError as err:
        raise ModelCannotOfferTools(str(err)) from None
    except ToolError as err:
        raise DataError(str(err)) from None
    say_template(tools.template)
    return tools


def open_sources_for(cfg: Any) -> Sources:
    """`open_sources` with the model's tokenizer and context, without loading its weights:
    the data checks a run can make before it starts anything."""
    from transformers import AutoConfig, AutoTokenizer

    return open_sources(
        cfg,
        AutoTokenizer.from_pretrained(cfg.model),
        context_of(cfg.max_seq_len, AutoConfig.from_pretrained(cfg.model)),
    )


def _json_like(value: Any) -> Any:
    """Columns must travel as MessagePack: numpy scalars and the like become plain values."""
    if isinstance(value, dict):
        return {str(k): _json_like(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_like(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    if value is None or isinstance(value, str | bool | int | float):
        return value
    return str(value)


@dataclass(frozen=True)
class Tools:
    """The tools of a run's episodes and the chat template that offers them to the model."""

    functions: list[Callable[..., Any]]
    template: str | None
    """`protocol.usercode.chat.tool_template`: None for the tokenizer's own."""
    environment: str | None = None
    """The environment's class name (its methods are among `functions`)."""
    max_iterations: int | None = None
    """`--max-tool-calling-iterations`."""

    @property
    def names(self) -> list[str]:
        return [fn.__name__ for fn in self.functions]


class PromptSource:
    """Turns row indices into protocol `Prompt`s with their token ids. With `tools`, chat
    prompts are rendered offering them (episodes); plain-text prompts are refused."""

    def __init__(
        self,
        rows: list[dict[str, Any]],
        tokenizer: Any,
        prompt_column: str,
        seed: int,
        max_prompt_tokens: int,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: Tools | None = None,
    ) -> None:
        if not rows:
            raise DataError("the data set has no rows")
        if prompt_column not in rows[0]:
            raise DataError(
                f"prompt column {prompt_column!r} not in the data set (columns: {sorted(rows[0])}); set --prompt-column"
            )
        self.rows = rows
        self.tokenizer = tokenizer
        self.prompt_column = prompt_column
        self.seed = seed
        self.max_prompt_tokens = max_prompt_tokens
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        """Passed to the tokenizer's chat template (Qwen3's enable_thinking, ...)."""
        self.tools = tools
        self._orders: dict[int, np.ndarray] = {}
        self._keys: list[int] | None = None

    def __len__(self) -> int:
        return len(self.rows)

    def episodes(self) -> dict[str, Any]:
        """A prompt batch's episode fields (`PromptBatch.tools`, ...): none without tools."""
        if self.tools is None:
            return {}
        return {
            "tools": self.tools.names,
            "environment": self.tools.environment,
            "max_tool_calling_iterations": self.tools.max_iterations,
        }

    def row_index(self, position: int) -> int:
        """Row at run position `position` (0, 1, 2, ... across epochs)."""
        epoch, offset = divmod(position, len(self.rows))
        if epoch not in self._orders:
            self._orders = {epoch: np.random.default_rng([self.seed, epoch]).permutation(len(self.rows))}
        return int(self._orders[epoch][offset])

    def row_key(self, position: int) -> int:
        """The prompt at run position `position`, known by its row's content: the index of
        the first row with the same columns (active sampling's key, `learner.active`)."""
        return self._row_keys()[self.row_index(position)]

    @functools.cached_property
    def distinct(self) -> int:
        """Distinct prompts (rows with other content)."""
        return len(set(self._row_keys()))

    def _row_keys(self) -> list[int]:
        if self._keys is None:
            first: dict[str, int] = {}
            self._keys = [
                first.setdefault(json.dumps(row, sort_keys=True, default=str), i) for i, row in enumerate(self.rows)
            ]
        return self._keys

    def _render(self, index: int) -> tuple[list[int], dict[str, Any]]:
        """Row `index`'s prompt token ids (uncut) and its text or messages."""
        value = self.rows[index][self.prompt_column]
        if isinstance(value, str) and self.tools is not None:
            raise DataError(
                f"row {index}: with --tools, column {self.prompt_column!r} must hold chat messages "
                "(a list of {role, content}), as TRL's tool-calling data sets do"
            )
        if isinstance(value, str):
            return self.tokenizer(value, add_special_tokens=True)["input_ids"], {"text": value}
        if isinstance(value, list) and all(isinstance(m, dict) for m in value):
            offered: dict[str, Any] = (
                {} if self.tools is None else {"tools": self.tools.functions, "chat_template": self.tools.template}
            )
            text = self.tokenizer.apply_chat_template(
                value, add_generation_prompt=True, tokenize=False, **offered, **self.chat_template_kwargs
            )
            return (
                self.tokenizer(text, add_special_tokens=False)["input_ids"],
                {"messages": [ChatTurn(role=str(m["role"]), content=str(m["content"])) for m in value]},
            )
        raise DataError(
            f"row {index}: column {self.prompt_column!r} must be a string "
            f"or a list of {{role, content}} messages, got {type(value).__name__}"
        )

    def prompt(self, position: int) -> Prompt:
        index = self.row_index(position)
        ids, fields = self._render(index)
        columns = {k: _json_like(v) for k, v in self.rows[index].items() if k != self.prompt_column}
        if len(ids) > self.max_prompt_tokens:
            ids = ids[-self.max_prompt_tokens :]  # keep the end: that is where the question is
        return Prompt(id=f"p{position}", token_ids=pack_i32(ids), columns=columns, **fields)

    def longest_prompt(self) -> tuple[int, int]:
        """(tokens, row) of the longest prompt of the data set."""
        return max((len(self._render(i)[0]), i) for i in range(len(self.rows)))

    def check_fits(self, what: str, max_tokens: int, context: int) -> None:
        """Refuse, before any work, a data set whose longest prompt and `max_tokens` do not
        fit in the model's context: every such group would be cut or thrown away."""
        longest, row = self.longest_prompt()
        if longest + max_tokens > context:
            room = context - longest
            fix = (
                f"lower --max-tokens (max_completion_length) to {room} or less"
                if room > 0
                else "shorten that prompt or leave it out"
            )
            raise DoesNotFit(
                f"{what}: its longest prompt (row {row}) is {longest} tokens and --max-tokens is {max_tokens}: "
                f"{longest + max_tokens} tokens do not fit in the model's context of {context}",
                f"{fix}, or shorten the prompts (--max-seq-len raises the context only if the model takes more)",
            )

    def epochs(self, positions: int) -> float:
        return positions / len(self.rows) if self.rows else math.inf
