"""A base model's fingerprint: what the learner publishes with every adapter manifest and a
worker compares with its own `--model` (`actors check`), so a worker on the wrong model is
named before it generates anything."""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec


def model_fingerprint(config: dict[str, Any], vocab: dict[str, int]) -> str:
    """32 hex characters naming a base model as generation sees it: its configuration
    (less the keys that name where or how it was saved) and its tokenizer's vocabulary.
    The learner publishes it with every adapter; a worker compares its own."""
    volatile = {"transformers_version", "torch_dtype", "dtype", "use_cache"}
    kept = {k: v for k, v in config.items() if not k.startswith("_") and k not in volatile}

    def plain(value: Any) -> Any:  # str keys (id2label has ints), anything else as text
        if isinstance(value, dict):
            return {str(k): plain(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [plain(v) for v in value]
        return value if value is None or isinstance(value, str | bool | int | float) else str(value)

    payload = msgspec.json.encode([plain(kept), sorted(vocab.items())], order="sorted")
    return hashlib.blake2b(payload, digest_size=16).hexdigest()


def fingerprint_of_model(spec: str) -> str:
    """`model_fingerprint` of the model at `spec` (a path or hub id): its config and its
    tokenizer's vocabulary, no weights loaded."""
    from transformers import AutoConfig, AutoTokenizer  # only where a model is checked

    return model_fingerprint(
        AutoConfig.from_pretrained(spec).to_dict(), AutoTokenizer.from_pretrained(spec).get_vocab()
    )
