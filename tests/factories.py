"""Builders of valid messages for tests."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

from protocol import (
    AdapterFile,
    AdapterManifest,
    ChatTurn,
    Completion,
    Prompt,
    PromptBatch,
    RolloutGroup,
    group_id_for,
    pack_i32,
)

NO_AUDITS = {"audit_rate": 0.0, "audit_probation_groups": 0}
"""A learner's settings for a worker whose tokens are scripted, not sampled
(`tests/scripted.py`, made-up log-probabilities): audits would quarantine it, rightly
(`tests/test_audit.py`), and the test is about something else."""


def batch(i: int | str = 0, prompts: int = 2, *, version: int = 0) -> PromptBatch:
    return PromptBatch(
        batch_id=f"batch-{i}",
        prompts=[
            Prompt(id=f"p{j}", text=f"what is {j} + 1?", columns={"answer": str(j + 1), "level": j})
            for j in range(prompts)
        ],
        num_generations=4,
        learner_version=version,
        issued_at=time.time(),
    )


def trusted(b: PromptBatch, **columns: object) -> PromptBatch:
    """The batch for the trusted scoring tier (its columns stay on the trusted side)."""
    import msgspec

    return msgspec.structs.replace(
        b, scoring="trusted", prompts=[msgspec.structs.replace(p, columns={**p.columns, **columns}) for p in b.prompts]
    )


def chat_batch() -> PromptBatch:
    return PromptBatch(
        batch_id="chat",
        prompts=[
            Prompt(
                id="c0",
                messages=[ChatTurn(role="system", content="be brief"), ChatTurn(role="user", content="2+2?")],
                token_ids=pack_i32([1, 5, 9]),
            )
        ],
        num_generations=2,
        learner_version=3,
        issued_at=time.time(),
    )


def completion(n: int = 4, reward: float | None = 1.0, **fields: object) -> Completion:
    fields = {"finish_reason": "stop", "text": "x" * n, **fields}
    return Completion.of(list(range(10, 10 + n)), [-0.25] * n, reward=reward, **fields)


def group(
    b: PromptBatch,
    prompt_index: int = 0,
    *,
    actor: str = "actor-1",
    version: int = 0,
    completions: int = 4,
    tokens: int = 4,
) -> RolloutGroup:
    prompt = b.prompts[prompt_index]
    return RolloutGroup(
        group_id=group_id_for(b.batch_id, prompt.id),
        batch_id=b.batch_id,
        prompt_id=prompt.id,
        adapter_version=version,
        actor_id=actor,
        prompt_token_ids=pack_i32([1, 2, 3]),
        completions=[
            completion(tokens, reward=float(k % 2), reward_components={"acc": float(k % 2)}) for k in range(completions)
        ],
        timings={"generate_s": 0.5, "reward_s": 0.01},
    )


def groups(b: PromptBatch, **kwargs: object) -> list[RolloutGroup]:
    return [group(b, i, **kwargs) for i in range(len(b.prompts))]


def manifest(version: int = 1, step: int = 0) -> AdapterManifest:
    return AdapterManifest(
        version=version,
        step=step,
        base_model="tiny-llama",
        rank=8,
        files=[
            AdapterFile(name="adapter_model.safetensors", sha256="a" * 64, size=1024),
            AdapterFile(name="adapter_config.json", sha256="b" * 64, size=300),
        ],
        created_at=time.time(),
    )


def stored_manifest(store: Any, version: int, weights: bytes | None = None, config: bytes = b"{}") -> AdapterManifest:
    """An adapter version as the publisher leaves it in `store`: its files, then its
    manifest (`weights` default: a few bytes naming the version)."""
    from protocol import to_json
    from protocol.wire.files import adapter_key, file_entry

    files = {"adapter_model.safetensors": weights or f"weights-{version}".encode(), "adapter_config.json": config}
    for name, data in files.items():
        store.put(adapter_key(version, name), data)
    made = AdapterManifest(
        version=version,
        step=version,
        base_model="m",
        rank=1,
        files=[file_entry(n, d) for n, d in files.items()],
        created_at=time.time(),
    )
    store.put(adapter_key(version, "manifest.json"), to_json(made))
    return made


def write_dataset(path: Path, n: int = 200, seed: int = 0) -> Path:
    """A JSON Lines prompt data set for the toy task (five letters and a colon)."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"prompt": "".join(rng.choice("abcdefgh") for _ in range(5)) + ":", "idx": i}) + "\n")
    return path
