"""Token ids -> text for the scoring tier, without transformers where it can be done
exactly.

RQ forks a work horse per job, and a fork costs with the size of the process: with
transformers imported (which imports torch, ~300 MB and ~500 mappings) 25-37 ms here,
without it 9 ms. The tier only decodes, so for a tokenizer that transformers itself
decodes as `tokenizers` does (a `tokenizer.json` loaded as it is, by the generic classes,
with no clean-up of spaces: `TokenizersBackend._decode`) it uses `tokenizers` directly.
Any other tokenizer (a model-specific class, which may rebuild the pipeline; a hub id; a
slow tokenizer; clean-up on) is loaded by transformers, as before.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

Decode = Callable[[Sequence[int]], str]

PLAIN_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})
"""transformers' generic classes: the `tokenizer.json` pipeline as it is."""


def plain_tokenizer(model: str) -> Any | None:
    """`tokenizers.Tokenizer` of a local model folder whose transformers tokenizer decodes
    exactly as it does; None otherwise."""
    folder = Path(model)
    config_file, tokenizer_file = folder / "tokenizer_config.json", folder / "tokenizer.json"
    if not (config_file.is_file() and tokenizer_file.is_file()):
        return None
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or config.get("tokenizer_class") not in PLAIN_CLASSES:
        return None
    if config.get("clean_up_tokenization_spaces") or config.get("added_tokens_decoder"):
        return None  # transformers' own post-processing or token table: let it do it
    try:
        special = {
            t["content"] for t in json.loads(tokenizer_file.read_text()).get("added_tokens", ()) if t.get("special")
        }
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None
    # transformers skips every token its config names special (bos, eos, pad, extras);
    # tokenizers only those its file marks special: the two must agree
    named = [
        config.get(k)
        for k in ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
    ]
    named += list(config.get("extra_special_tokens") or ()) + list(config.get("additional_special_tokens") or ())
    if not all(isinstance(t, str) and t in special for t in named if t is not None):
        return None
    import tokenizers

    try:
        return tokenizers.Tokenizer.from_file(str(tokenizer_file))
    except Exception:
        return None


def load_decode(model: str, tokenizer: Any | None = None) -> Decode:
    """Decode as the actors' engines and the learner do (special tokens skipped).
    `tokenizer`: a transformers tokenizer already loaded (episodes need one anyway)."""
    plain = None if tokenizer is not None else plain_tokenizer(model)
    if plain is not None:

        def decode_plain(ids: Sequence[int]) -> str:
            return str(plain.decode(list(ids), skip_special_tokens=True))

        return decode_plain
    tok = tokenizer if tokenizer is not None else load_tokenizer(model)

    def decode(ids: Sequence[int]) -> str:
        return str(tok.decode(list(ids), skip_special_tokens=True))

    return decode


def load_tokenizer(model: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError) as err:
        raise OSError(f"--model {model}: cannot load its tokenizer: {err}") from None


def load_generation_config(model: str) -> Any:
    """The model's `generation_config.json` (its end-of-sequence ids), if it has one: the
    actors' engines stop on them, and the tier reads episodes' turns by them."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(model)
    except (OSError, ValueError):
        return None
