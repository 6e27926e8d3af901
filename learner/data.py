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

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from protocol import ChatTurn, Prompt, pack_i32


class DataError(ValueError):
    """The data set cannot be used as configured."""


def load_rows(spec: str, split: str = "train", config: str | None = None) -> list[dict[str, Any]]:
    """Rows of a local file, a local data set folder (a README with `configs:`, as on the
    hub) or a hub data set (hub ids need network access); `config` names its
    configuration (GSM8K's `main`)."""
    path = Path(spec)
    if path.is_dir():
        from datasets import load_dataset

        try:
            return list(load_dataset(str(path), config, split=split))
        except ValueError as err:
            raise DataError(f"--dataset {spec}: {err}") from None
    if path.suffix in (".jsonl", ".json", ".parquet") or path.exists():
        if not path.is_file():
            raise DataError(f"--dataset {spec}: no such file")
        if path.suffix == ".jsonl":
            rows = []
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as err:
                        raise DataError(f"--dataset {spec}, line {n}: {err}") from None
            return rows
        from datasets import load_dataset

        kind = "parquet" if path.suffix == ".parquet" else "json"
        return list(load_dataset(kind, data_files=str(path), split="train"))
    from datasets import load_dataset

    return list(load_dataset(spec, config, split=split))


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


class PromptSource:
    """Turns row indices into protocol `Prompt`s with their token ids."""

    def __init__(
        self, rows: list[dict[str, Any]], tokenizer: Any, prompt_column: str, seed: int, max_prompt_tokens: int,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        if not rows:
            raise DataError("the data set has no rows")
        if prompt_column not in rows[0]:
            raise DataError(
                f"prompt column {prompt_column!r} not in the data set (columns: {sorted(rows[0])}); "
                "set --prompt-column"
            )
        self.rows = rows
        self.tokenizer = tokenizer
        self.prompt_column = prompt_column
        self.seed = seed
        self.max_prompt_tokens = max_prompt_tokens
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        """Passed to the tokenizer's chat template (Qwen3's enable_thinking, ...)."""
        self._orders: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self.rows)

    def row_index(self, position: int) -> int:
        """Row at run position `position` (0, 1, 2, ... across epochs)."""
        epoch, offset = divmod(position, len(self.rows))
        if epoch not in self._orders:
            self._orders = {epoch: np.random.default_rng([self.seed, epoch]).permutation(len(self.rows))}
        return int(self._orders[epoch][offset])

    def prompt(self, position: int) -> Prompt:
        row = self.rows[self.row_index(position)]
        value = row[self.prompt_column]
        columns = {k: _json_like(v) for k, v in row.items() if k != self.prompt_column}
        if isinstance(value, str):
            ids = self.tokenizer(value, add_special_tokens=True)["input_ids"]
            fields: dict[str, Any] = {"text": value}
        elif isinstance(value, list) and all(isinstance(m, dict) for m in value):
            text = self.tokenizer.apply_chat_template(
                value, add_generation_prompt=True, tokenize=False, **self.chat_template_kwargs
            )
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            fields = {"messages": [ChatTurn(role=str(m["role"]), content=str(m["content"])) for m in value]}
        else:
            raise DataError(
                f"row {self.row_index(position)}: column {self.prompt_column!r} must be a string "
                f"or a list of {{role, content}} messages, got {type(value).__name__}"
            )
        if len(ids) > self.max_prompt_tokens:
            ids = ids[-self.max_prompt_tokens :]  # keep the end: that is where the question is
        return Prompt(id=f"p{position}", token_ids=pack_i32(ids), columns=columns, **fields)

    def epochs(self, positions: int) -> float:
        return positions / len(self.rows) if self.rows else math.inf
