"""A lease in flight on a worker, and the rollout group each of its prompts becomes
(`actors.worker`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from actors.engine import Sample
from actors.runs import RunLink
from protocol import Completion, Lease, RolloutGroup, group_id_for, pack_i32
from protocol.usercode.rewards import Scores


@dataclass
class Flight:
    """One lease in flight: its groups queued, generating, scoring or ready to submit."""

    lease: Lease
    link: RunLink
    """The run the lease is of."""
    prompt_ids: list[list[int]]
    version: int
    """The adapter version the lease's groups were queued with (they start on the newest
    when the engine takes them up, and follow newer ones: `actors.engine`)."""
    queued_at: float
    waiting: set[int] = field(default_factory=set)
    """Prompt indexes whose group is not yet generated and scored."""
    ready: list[RolloutGroup] = field(default_factory=list)
    """Scored groups not yet submitted."""
    lost: bool = False
    """The heartbeat found the lease gone: its groups will be refused; stop sending them."""

    @property
    def done(self) -> bool:
        return not self.waiting and not self.ready


def rollout_group(
    flight: Flight, i: int, samples: list[Sample], texts: list[str], scores: Scores, actor_id: str
) -> RolloutGroup:
    """Prompt `i`'s group as the worker `actor_id` submits it: its completions with their
    texts and scores, tagged with its oldest token's adapter version and digest, and the
    digests of the newer versions its tokens name (in-flight updates)."""
    batch = flight.lease.batch
    per_token = [s.token_versions(flight.version) for s in samples]
    oldest = min((v[0] for v in per_token if v), default=flight.version)
    later = sorted({x for v in per_token for x in v} - {oldest})
    digests = flight.link.watcher.digests  # every version's, as the engine loaded them
    prompt = batch.prompts[i]
    timings = {"in_flight_s": time.monotonic() - flight.queued_at, "generated_at": time.time()}
    if batch.tools:
        timings["tool_s"] = sum(s.tool_s for s in samples)
    return RolloutGroup(
        group_id=group_id_for(batch.batch_id, prompt.id),
        batch_id=batch.batch_id,
        prompt_id=prompt.id,
        adapter_version=oldest,
        adapter_digest=digests.get(oldest) if oldest else None,
        later_digests={v: digest for v in later if (digest := digests.get(v)) is not None},
        actor_id=actor_id,
        prompt_token_ids=pack_i32(flight.prompt_ids[i]),
        completions=[
            Completion.of(
                s.token_ids,
                s.logprobs,
                s.mask,
                None if all(x == oldest for x in v) else v,
                finish_reason=s.finish_reason,
                text=t,
                reward=r,
                reward_components=c,
                error=scores.error,
                extra=x,
                turns=s.turns,
                tool_calls=s.tool_calls,
                tool_errors=s.tool_errors,
                turn_limit=s.turn_limit,
            )
            for s, v, t, r, c, x in zip(
                samples,
                per_token,
                texts,
                scores.rewards,
                scores.components,
                scores.extras or [{}] * len(texts),
                strict=True,
            )
        ],
        error=scores.error,
        timings=timings,
        metrics=scores.metrics,
    )
