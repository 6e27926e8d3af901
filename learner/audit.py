"""Audits: what an untrusted worker says it generated, checked before it is trained on.

A worker's group names its adapter version (proven by digest, `learner.judge`) and carries
the log-probability of every token it sampled. Neither proves the tokens were sampled
from that adapter: a worker could send another model's text, or the base model's under
the newest version's name, or log-probabilities of its choosing (they decide what the
importance weights keep). So the learner audits a random share of the groups it is
about to train on. It recomputes, under the adapter of the version each token names (the
group's, or a newer one where an in-flight update moved it on; the learner keeps the last
`max_staleness + 1`), for every model token:

- the log-probability: the worker's must agree (`mean_abs_diff`, and `tail_frac`, the share
  of tokens off by more than `tail_nats`);
- where the token falls in its distribution (GRAIL's sampling-shape test): summed over the
  group, log q(x) - E[log q] over sqrt(sum Var[log q]) is a z-score near 0 for tokens
  sampled from q at the run's temperature, and far below 0 for text sampled elsewhere,
  however self-consistent its log-probabilities (`shape_z`). Top-p/top-k truncation
  only raises it (the tokens come from the head), so the test is one-sided.

Which groups are audited is drawn with the operating system's randomness after the group
is read: a worker cannot know it or influence it. A worker's groups are all audited until
`probation_groups` of them passed; after that, a share `rate` of them. A failed audit quarantines the
worker for the rest of the run (`LearnerState.quarantined`): its groups not yet trained
are dropped, and the ones it sends later are rejected.

The audit runs on the training thread, between reads, on the policy itself (its adapter
swapped for the audited version's and back, bit for bit): no second model, and no wait
on anything but the forward pass it costs (`bench/audit.py` measures it).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from learner.config import LearnerConfig
from learner.dist import reshard
from learner.policy import Policy, Sequences, pack_sequences, read_adapter_weights, scatter_completion_values
from protocol import AuditTally, ProtocolError, Queue, QueueError, RolloutGroup, SamplingParams
from protocol.trusted.store import Store
from protocol.wire.files import ADAPTER_WEIGHTS, adapter_key
from protocol.wire.text import printable

if TYPE_CHECKING:
    from learner.trainer import Trainer

log = logging.getLogger(__name__)

_SYSTEM_RANDOM = random.SystemRandom()
"""The operating system's randomness: which groups are audited cannot be foreseen."""


@dataclass(frozen=True)
class AuditLimits:
    """Where an honest worker's figures end, calibrated by `bench/audit.py`."""

    max_mean_abs_diff: float = 0.1
    """Nats: the mean over a group's model tokens of |worker's log-probability - the learner's|."""
    tail_nats: float = 1.0
    max_tail_frac: float = 0.05
    """Share of a group's model tokens whose log-probabilities differ by more than `tail_nats`."""
    min_shape_z: float = -8.0
    """The sampling-shape z-score below which the tokens were not sampled from the adapter."""


@dataclass(frozen=True)
class Findings:
    """One audited group's figures."""

    tokens: int
    mean_abs_diff: float
    tail_frac: float
    shape_z: float

    def failed(self, limits: AuditLimits) -> str | None:
        """The check this group fails ('log-probabilities' or 'sampling shape'), or None."""
        if self.mean_abs_diff > limits.max_mean_abs_diff or self.tail_frac > limits.max_tail_frac:
            return "log-probabilities"
        if self.shape_z < limits.min_shape_z:
            return "sampling shape"
        return None

    def describe(self) -> str:
        return (
            f"{self.tokens} tokens, mean |logp difference| {self.mean_abs_diff:.3f} nats, "
            f"{self.tail_frac:.1%} off by more than the tail, sampling-shape z {self.shape_z:.1f}"
        )


def findings(
    claimed_BT: Tensor, logp_BT: Tensor, mean_BT: Tensor, var_BT: Tensor, mask_BT: Tensor, tail_nats: float
) -> Findings:
    """The figures of one group from its tensors in the learner's layout (`mask_BT`: 1 at
    the model's tokens)."""
    n = float(mask_BT.sum())
    if n == 0:
        return Findings(0, 0.0, 0.0, 0.0)
    diff = (claimed_BT - logp_BT).abs() * mask_BT
    spread = float((var_BT * mask_BT).sum())
    z = float(((logp_BT - mean_BT) * mask_BT).sum()) / math.sqrt(spread) if spread > 0 else 0.0
    return Findings(
        tokens=int(n),
        mean_abs_diff=float(diff.sum()) / n,
        tail_frac=float(((diff > tail_nats).float() * mask_BT).sum()) / n,
        shape_z=z,
    )


def open_auditor(cfg: LearnerConfig, trainer: Trainer, store: Store) -> Auditor | None:
    """The run's auditor, or None (with the reason logged) where audits are off. Its
    forward passes go through `trainer` (every rank runs them under torchrun)."""
    if not cfg.audit_rate and not cfg.audit_probation_groups:
        return None
    try:
        return Auditor(
            trainer.policy,
            trainer.sampling,
            rate=cfg.audit_rate,
            probation_groups=cfg.audit_probation_groups,
            keep_versions=cfg.max_staleness + 1,
            load_version=functools.partial(published_state, store),
            moments=trainer.audit_moments,
        )
    except ValueError as err:
        log.warning("audits are off: %s", err)
        return None


def published_state(store: Store, version: int) -> dict[str, Tensor] | None:
    """Adapter `version` as the store holds it (published before a restart), or None."""
    try:
        return read_adapter_weights(store.get(adapter_key(version, ADAPTER_WEIGHTS)))
    except Exception as err:  # a store outage, a file safetensors refuses: that group goes unaudited
        log.warning("adapter v%d cannot be had to audit its groups: %s", version, err)
        return None


def sync_quarantine(queue: Queue, quarantined: dict[str, str]) -> None:
    """Bring the door's quarantine (`Queue.quarantine`) and the learner's (`quarantined`,
    changed in place) in step: the workers the learner quarantined are written (again, if
    Redis lost them), and the ones the admin lifted (`proxy quarantine --lift`) leave
    `quarantined`. Best effort: the learner calls it again at its next fleet check."""
    try:
        door = queue.quarantined()
        lifted = [w for w, why in door.items() if not why]
        for worker in lifted:
            if quarantined.pop(worker, None) is not None:
                log.warning("worker %s: quarantine lifted by the admin; its groups are trained again", worker)
        queue.forget_lifted(lifted)
        for worker, why in quarantined.items():
            if not door.get(worker):
                queue.quarantine(worker, why)
    except (QueueError, ProtocolError, NotImplementedError) as err:
        log.debug("the door's quarantine list is not in step yet: %s", printable(str(err)))


def record_audits(queue: Queue, auditor: Auditor | None) -> None:
    """Add the audits made since the last call to the run's tallies (`Queue.record_audits`:
    `GET /v1/workers` and the proxy's /metrics show them). Best effort: what could not be
    written is sent with the next call."""
    if auditor is None or not auditor.unrecorded:
        return
    tallies, auditor.unrecorded = auditor.unrecorded, {}
    try:
        queue.record_audits(tallies)
    except NotImplementedError:
        return
    except (QueueError, ProtocolError) as err:
        log.debug("the run's audit tallies are not written yet: %s", printable(str(err)))
        for worker, tally in tallies.items():
            auditor.unrecorded[worker] = tally + auditor.unrecorded.get(worker, AuditTally())


class Auditor:
    """Picks groups, audits them on `policy`, and remembers the verdicts."""

    def __init__(
        self,
        policy: Policy,
        sampling: SamplingParams,
        *,
        rate: float,
        probation_groups: int = 4,
        keep_versions: int = 5,
        limits: AuditLimits | None = None,
        load_version: Callable[[int], dict[str, Tensor] | None] | None = None,
        draw: Callable[[], float] = _SYSTEM_RANDOM.random,
        moments: Callable[[Sequences, int, dict[str, Tensor] | None], tuple[Tensor, Tensor, Tensor]] | None = None,
    ) -> None:
        """`load_version`: an adapter's state by version when it is not kept (one published
        before a restart); None where it cannot be had. `moments`: the forward pass
        (`moments_as` on `policy` by default; under torchrun `Trainer.audit_moments`, which
        every rank runs)."""
        if sampling.temperature <= 0 or sampling.repetition_penalty != 1.0:
            raise ValueError(
                "they need a temperature above 0 and no repetition penalty (--temperature, --repetition-penalty: "
                "the distribution each token was sampled from must be known)"
            )
        self.policy, self.sampling = policy, sampling
        self.rate, self.probation_groups = rate, probation_groups
        self.keep_versions = keep_versions
        self.limits = limits or AuditLimits()
        self.load_version = load_version
        self.draw = draw
        self.moments = moments or (lambda seqs, mode, state: moments_as(policy, seqs, sampling, mode, state))
        self.versions: collections.OrderedDict[int, dict[str, Tensor]] = collections.OrderedDict()
        self.live_version: int | None = 0
        """The version the policy's weights are now (None: trained past the last publish)."""
        self.passed: collections.Counter[str] = collections.Counter()
        """Audits passed, per worker: its reputation."""
        self.unrecorded: dict[str, AuditTally] = {}
        """Audits per worker not yet added to the run's tallies (`record_audits`)."""

    def remember(self, version: int, state: dict[str, Tensor]) -> None:
        """A published version's adapter (a CPU copy, as published); the oldest beyond
        `keep_versions` is forgotten. The policy's weights are that version now."""
        self.versions[version] = state
        while len(self.versions) > self.keep_versions:
            self.versions.popitem(last=False)
        self.live_version = version

    def trained(self) -> None:
        """The policy took a step: its weights are no published version."""
        self.live_version = None

    def picks(self, group: RolloutGroup) -> bool:
        """Whether to audit this group (drawn now: no worker can know it beforehand)."""
        on_probation = self.passed[group.actor_id] < self.probation_groups
        return on_probation or self.draw() < self.rate

    def audit(self, group: RolloutGroup) -> Findings | None:
        """The group's figures, each token under the adapter of the version it names (a
        group that met in-flight updates costs a forward pass per version); None when one
        of those adapters is not at hand (too old, or its files unreadable): the group is
        not audited."""
        states = {version: self._state_of(version) for version in group.versions}
        if any(state is None and version != self.live_version for version, state in states.items()):
            return None
        seqs = pack_sequences(
            [group.prompt_tokens] * len(group.completions),
            [c.tokens for c in group.completions],
            self.policy.pad_id,
        )
        prompt_lens = [group.prompt_tokens.size] * len(group.completions)
        width = seqs.input_ids_BL.shape[1]
        claimed = scatter_completion_values([c.logps for c in group.completions], prompt_lens, width)
        model = scatter_completion_values([c.model_mask for c in group.completions], prompt_lens, width)
        device = self.policy.device
        seqs = type(seqs)(*(t.to(device) for t in (seqs.input_ids_BL, seqs.attention_mask_BL, seqs.mask_BT)))
        moments: list[Tensor] | None = None
        if len(states) > 1:
            named = [c.token_versions(group.adapter_version).astype("float32") for c in group.completions]
            versions_BT = scatter_completion_values(named, prompt_lens, width)
        for version, state in states.items():
            mode = LIVE if version == self.live_version else BASE if version == 0 else SWAPPED
            mine = [t.float().cpu() for t in self.moments(seqs, mode, state if mode == SWAPPED else None)]
            if moments is None:
                moments = mine
            else:  # this version's tokens take its figures
                here = versions_BT == version
                moments = [torch.where(here, new, old) for new, old in zip(mine, moments, strict=True)]
        assert moments is not None
        logp, mean, var = moments
        result = findings(claimed, logp, mean, var, model * seqs.mask_BT.cpu(), self.limits.tail_nats)
        passed = result.failed(self.limits) is None
        if passed:
            self.passed[group.actor_id] += 1
        tally = AuditTally(passed=1) if passed else AuditTally(failed=1)
        self.unrecorded[group.actor_id] = self.unrecorded.get(group.actor_id, AuditTally()) + tally
        return result

    def _state_of(self, version: int) -> dict[str, Tensor] | None:
        if version in self.versions or version == 0:
            return self.versions.get(version)
        if self.load_version is None:
            return None
        state = self.load_version(version)
        if state is not None:
            self.versions[version] = state
            self.versions.move_to_end(version, last=False)  # older than the ones kept since
            while len(self.versions) > self.keep_versions:
                self.versions.popitem(last=False)
        return state


LIVE, BASE, SWAPPED = range(3)
"""How an audit's forward pass sees the policy: as it is (the group's version is the live
one), as the base model (version 0), or with the group's version's adapter swapped in."""


def moments_as(
    policy: Policy, seqs: Sequences, sampling: SamplingParams, mode: int, state: dict[str, Tensor] | None
) -> tuple[Tensor, Tensor, Tensor]:
    """`Policy.sampling_moments` of `seqs` with the policy as `mode` says, in eval mode (no
    dropout), then the policy back as it was, bit for bit. Under torchrun every rank calls
    it alike (rank 0 with the state, the others with {}: the swap and the pass are
    collectives, `Trainer.audit_moments`)."""
    saved = None
    policy.model.eval()
    try:
        with contextlib.ExitStack() as stack:
            if mode == BASE:
                stack.enter_context(policy.reference())
            elif mode == SWAPPED:
                saved = policy.adapter_state()
                policy.load_adapter_state(state or {})
            moments = policy.sampling_moments(seqs, sampling)
            reshard(policy.model)
            return moments
    finally:
        if saved is not None:
            policy.load_adapter_state(saved)
        policy.model.train()


def quarantine_reason(check: str, found: Findings, group: RolloutGroup) -> str:
    """Why a worker is quarantined, in one line."""
    return f"failed the {check} audit of a group it said adapter {named_versions(group)} generated ({found.describe()})"


def named_versions(group: RolloutGroup) -> str:
    """The adapter versions a group's tokens name: `v3`, or `v3/v4` across an in-flight update."""
    return "/".join(f"v{v}" for v in group.versions)
