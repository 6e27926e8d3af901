"""Names of the streams, keys and consumer groups of one run.

Every key of a run shares the hash tag `{run}`, so on Redis Cluster they live in one
slot and the Lua scripts that touch several of them stay legal.
"""

from __future__ import annotations

from dataclasses import dataclass

ACTORS_GROUP = "actors"
"""Consumer group on the prompts stream; consumers are worker ids."""
LEARNER_GROUP = "learner"
"""Consumer group on the rollouts stream."""
SCORERS_GROUP = "scorers"
"""Consumer group on the unscored stream; consumers are the scoring tier's dispatchers."""
RUNS_KEY = "spotgrpo:runs"
"""Hash, one for every run on the Redis: run -> when its learner opened it (a run in
progress; removed when the learner finishes it). What a proxy token's run patterns
(`runs = ["sweep-*"]`) match: a run is served to them once its learner has started."""


@dataclass(frozen=True)
class Keys:
    run: str

    def _key(self, name: str) -> str:
        return f"spotgrpo:{{{self.run}}}:{name}"

    @property
    def prompts(self) -> str:
        """Stream of prompt batches (fields: b = batch id, m = message)."""
        return self._key("prompts")

    @property
    def rollouts(self) -> str:
        """Stream of rollout groups (fields: g = group id, b = batch id, m = message)."""
        return self._key("rollouts")

    @property
    def unscored(self) -> str:
        """Stream of groups submitted by actors for trusted scoring (fields: g = group id,
        b = batch id, m); only the scoring tier reads it. An entry is pending while a
        dispatcher has read it and not yet made it a job, and deleted once scored."""
        return self._key("unscored")

    @property
    def private(self) -> str:
        """Hash: group id -> the full prompt (dataset columns included) of a trusted-scoring
        batch, kept on the trusted side until its group is scored."""
        return self._key("private")

    @property
    def scored_seen(self) -> str:
        """Set of group ids ever scored into the rollouts stream: makes scoring idempotent."""
        return self._key("scored-seen")

    @property
    def dead_letters(self) -> str:
        """Stream of batches that could not be completed, with reason and delivery count."""
        return self._key("dead-letters")

    @property
    def batches_seen(self) -> str:
        """Set of batch ids ever queued: makes add_prompts idempotent."""
        return self._key("batches-seen")

    @property
    def groups_seen(self) -> str:
        """Set of group ids ever stored: makes submit idempotent."""
        return self._key("groups-seen")

    @property
    def workers(self) -> str:
        """Hash: worker name -> its latest WorkerStatus (MessagePack)."""
        return self._key("workers")

    def workers_of(self, owner: str) -> str:
        """Sorted set: the workers of one owner (a proxy token) -> when each last reported,
        so the proxy can bound the live statuses per token."""
        return self._key(f"workers-of:{owner}")

    @property
    def worker_owners(self) -> str:
        """Set of the `workers_of` keys in use (so that they expire with the run)."""
        return self._key("worker-owners")

    @property
    def quarantined(self) -> str:
        """Hash: worker name -> why the learner quarantined it ("" once the admin lifted it,
        until the learner has seen the lift)."""
        return self._key("quarantined")

    @property
    def over(self) -> str:
        """String: the learner's last word when it finished the run (claims are refused
        with it, `RunOver`); absent while the run goes on."""
        return self._key("over")

    @property
    def share(self) -> str:
        """String: the run's share of a fleet that serves several runs (JSON `RunShare`:
        weight and cap), set by its learner or the admin; absent: weight 1, no cap."""
        return self._key("share")

    @property
    def rewards(self) -> str:
        """String: the reward functions the learner scores its run with (JSON, canonical
        `module:function=weight` specs), against which a scoring worker checks its own."""
        return self._key("rewards")

    @property
    def audits(self) -> str:
        """Hash: worker name -> "<passed> <failed>", the learner's audits of its groups
        (`learner.audit`), for the fleet view (`GET /v1/workers`, /metrics)."""
        return self._key("audits")

    @property
    def adapter_latest(self) -> str:
        """Hash: version, m (manifest), event (its id in adapter-events)."""
        return self._key("adapter-latest")

    @property
    def adapter_events(self) -> str:
        """Stream of adapter announcements, for late joiners (fields: v, m)."""
        return self._key("adapter-events")

    @property
    def submit_gate(self) -> str:
        """Hash: the submission being stored, between the steps of its SUBMIT transaction
        (`protocol.trusted.redis_lua.SUBMIT`); exists only inside that transaction."""
        return self._key("submit-gate")

    @property
    def submit_alias(self) -> str:
        """The name the rollouts (or unscored) stream takes inside a SUBMIT transaction while
        the gate for one group is open; exists only inside that transaction."""
        return self._key("submit-alias")

    def all(self) -> list[str]:
        """Every key of the run (the pub/sub channel is not a key)."""
        return [
            self.prompts,
            self.rollouts,
            self.unscored,
            self.dead_letters,
            self.batches_seen,
            self.groups_seen,
            self.private,
            self.scored_seen,
            self.workers,
            self.worker_owners,
            self.quarantined,
            self.over,
            self.rewards,
            self.share,
            self.audits,
            self.adapter_latest,
            self.adapter_events,
        ]

    @property
    def adapter_channel(self) -> str:
        """Pub/sub channel on which each announcement's manifest is published."""
        return self._key("adapters")
