"""Checkpoints: everything needed to continue a run exactly, in the object store.

    checkpoints/step-<S>/adapter_model.safetensors   the adapter
    checkpoints/step-<S>/trainer_state.pt             optimizer (full, by parameter name), scheduler, torch RNG
    checkpoints/step-<S>/state.json                   cursor, versions, counters, ledger
    checkpoints/latest.json                           pointer, written last

`trainer_state.pt` is the one non-safetensors file: optimizer state the learner wrote
itself, read back with `torch.load(weights_only=True)` (no pickle code runs).

The ledger (`unacked`) holds the rollout groups consumed since they were last
acknowledged: their ids and delivery ids. Groups are acknowledged in the queue only
after the checkpoint holding them is written, so after a crash the queue's pending
list holds exactly the groups that are either in the checkpoint (skip, acknowledge)
or not (train them again: the model state that trained them was lost).
"""

from __future__ import annotations

import functools
import io
import json
import random
from dataclasses import asdict, dataclass, field
from typing import Any, cast

import numpy as np
import torch

from learner.active import PromptOutcomes
from learner.ledger import PromptLedger
from learner.policy import read_adapter_weights
from protocol.trusted.store import Store, retrying
from protocol.wire.files import ADAPTER_WEIGHTS, CHECKPOINT_POINTER, StoreMissing, checkpoint_key

STATE = "state.json"
TRAINER_STATE = "trainer_state.pt"


@dataclass
class LearnerState:
    step: int = 0
    policy_version: int = 0
    """The newest adapter version the learner has produced (0: the base model)."""
    ledger: PromptLedger = field(default_factory=PromptLedger)
    """Where every issued prompt is (`learner.ledger`)."""
    totals: dict[str, int] = field(default_factory=dict)
    """Run-long counters: trained groups, drops and rejections by reason."""
    unacked: dict[str, str] = field(default_factory=dict)
    """group id -> delivery id of groups consumed and not yet acknowledged (a second
    delivery of one, a duplicate: `<group id>@<delivery id>`)."""
    rng: dict[str, Any] = field(default_factory=dict)
    quarantined: dict[str, str] = field(default_factory=dict)
    """worker -> why: the workers whose groups are no longer trained on (`learner.audit`)."""
    outcomes: PromptOutcomes = field(default_factory=PromptOutcomes)
    """Each prompt's recent groups, flat or not, and the prompts set aside (`learner.active`)."""

    def count(self, key: str, n: int = 1) -> None:
        key = str(key)  # a `learner.judge.Reason` is counted under its plain name
        self.totals[key] = self.totals.get(key, 0) + n

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> LearnerState:
        """From state.json; a checkpoint written before the ledger had its own type kept
        its fields at the top level."""
        ledger = raw.get("ledger", raw)
        return cls(
            step=int(raw.get("step", 0)),
            policy_version=int(raw.get("policy_version", 0)),
            ledger=PromptLedger.from_json(ledger),
            totals=dict(raw.get("totals") or {}),
            unacked=dict(raw.get("unacked") or {}),
            rng=dict(raw.get("rng") or {}),
            quarantined=dict(raw.get("quarantined") or {}),
            outcomes=PromptOutcomes.from_json(raw.get("outcomes")),
        )


def _python_rng() -> dict[str, Any]:
    kind, keys, pos, has_gauss, cached = cast(tuple[Any, ...], np.random.get_state())
    return {
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
    }


def _restore_python_rng(rng: dict[str, Any]) -> None:
    if "python" in rng:
        version, state, gauss = rng["python"]
        random.setstate((version, tuple(state), gauss))
    if "numpy" in rng:
        kind, keys, pos, has_gauss, cached = rng["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


def save_checkpoint(
    store: Store,
    state: LearnerState,
    adapter: dict[str, torch.Tensor],
    trainer: dict[str, Any],
    keep: int,
) -> str:
    """Write checkpoint `state.step`, then the pointer; prune older ones. Returns its key.
    `trainer`: the optimizer's full state dict (parameter names as keys), the schedule's
    state and the torch RNG (`learner.trainer.Trainer.snapshot`)."""
    from safetensors.torch import save

    step = state.step
    state.rng = _python_rng()
    buf = io.BytesIO()
    torch.save(trainer, buf)
    files = {
        ADAPTER_WEIGHTS: save(adapter, metadata={"format": "pt"}),
        TRAINER_STATE: buf.getvalue(),
        STATE: json.dumps(asdict(state), indent=1, sort_keys=True).encode(),
    }
    for name, data in files.items():
        key = checkpoint_key(step, name)
        retrying(functools.partial(store.put, key, data), what=f"write {key}")
    pointer = json.dumps({"step": step, "prefix": f"checkpoints/step-{step}/"}).encode()
    retrying(lambda: store.put(CHECKPOINT_POINTER, pointer), what="write checkpoint pointer")
    _prune(store, step, keep)
    return f"checkpoints/step-{step}/"


def _prune(store: Store, newest: int, keep: int) -> None:
    steps = sorted(
        {int(k.split("/")[1].removeprefix("step-")) for k in store.list("checkpoints/") if k.count("/") == 2}
    )
    stale = [s for s in steps if s != newest][: max(0, len(steps) - keep)]
    for s in stale:
        store.delete(store.list(f"checkpoints/step-{s}/"))


@dataclass
class Checkpoint:
    state: LearnerState
    adapter: dict[str, torch.Tensor]
    trainer: dict[str, Any]


def latest_step(store: Store) -> int | None:
    try:
        return int(json.loads(store.get(CHECKPOINT_POINTER))["step"])
    except StoreMissing:
        return None


def load_checkpoint(store: Store) -> Checkpoint | None:
    step = latest_step(store)
    if step is None:
        return None
    raw = json.loads(retrying(lambda: store.get(checkpoint_key(step, STATE)), what="read checkpoint state"))
    state = LearnerState.from_json(raw)
    adapter = read_adapter_weights(
        retrying(lambda: store.get(checkpoint_key(step, ADAPTER_WEIGHTS)), what="read checkpoint adapter")
    )
    trainer_bytes = retrying(lambda: store.get(checkpoint_key(step, TRAINER_STATE)), what="read trainer state")
    trainer = torch.load(io.BytesIO(trainer_bytes), weights_only=True)
    return Checkpoint(state, adapter, trainer)


def restore_rng(ckpt: Checkpoint) -> None:
    torch.set_rng_state(ckpt.trainer["torch_rng"])
    _restore_python_rng(ckpt.state.rng)
