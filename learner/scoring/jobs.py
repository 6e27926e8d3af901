"""The scoring tier's jobs: what an RQ work horse does with the unscored entries of one
job (read each group and its episodes, replay the environment, score the decoded text,
store the scored or rejected copy). `learner.scoring.tier` describes the tier as a whole;
`serve` installs the `Tier` the jobs use before RQ's worker forks its horses."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from learner.scoring import replay
from learner.scoring.episodes import EpisodeReader, read_episodes, recounted, single_turns
from protocol import Completion, ProtocolError, RolloutGroup
from protocol.trusted.scoring import ScoringQueue, UnscoredGroup
from protocol.usercode.rewards import RewardRefused, Scorer, Scores, ToolMask, Values, group_tool_mask
from protocol.usercode.transcript import (
    EnvironmentReward,
    Transcript,
    TranscriptError,
    answered_calls,
)
from protocol.util.deadline import PastLimit
from protocol.wire.text import printable

log = logging.getLogger(__name__)

Decode = Callable[[Sequence[int]], str]


@dataclass
class Tier:
    """What a job needs, made once in the worker before it forks its work horses."""

    queue: ScoringQueue
    scorer: Scorer
    name: str
    decode: Decode
    """The run's tokenizer: token ids -> the text rewards see (special tokens skipped, as
    the actors' engines decode)."""
    timeout_s: float
    """Per group."""
    environment: EnvironmentReward | None = None
    """Episodes' environment, when it owns a reward: replayed per completion."""
    episodes: EpisodeReader | None = None
    """Reads episodes' masks against their model turns (`learner.scoring.episodes`)."""
    replay_limits: replay.ReplayLimits = field(default_factory=replay.ReplayLimits)
    batch: bool = False
    """`--reward-batch`: each reward function called once per job (`call_together`)."""
    """Per call and memory, for the environment's replay (`learner.scoring.replay`)."""


_TIER: Tier | None = None


def install(tier: Tier) -> None:
    """The `Tier` this process's jobs use (`serve`, before RQ's worker forks)."""
    global _TIER
    _TIER = tier


ERROR_CHARS = 300
"""A completion's error as the tier writes it (the group's error says it whole)."""


def scored_group(
    item: UnscoredGroup,
    scores: Scores,
    texts: list[str],
    scored_by: str,
    score_s: float,
    completions: Sequence[Completion] | None = None,
) -> RolloutGroup:
    """The actor's group with the tier's rewards in place of whatever it sent, and the
    text the tier scored (decoded from the token ids) in place of the actor's;
    `completions`: the group's with the tier's episode counts (`recounted`)."""
    group = item.group
    error = printable(scores.error, 2000) if scores.error is not None else None
    short = printable(scores.error, ERROR_CHARS) if scores.error is not None else None
    extras = scores.extras or [{}] * len(texts)  # the tier's, in place of any an actor sent
    completions = [
        msgspec.structs.replace(c, text=t, reward=r, reward_components=comp, error=short, extra=x)
        for c, t, r, comp, x in zip(
            completions or group.completions, texts, scores.rewards, scores.components, extras, strict=True
        )
    ]
    submitted = entry_time(item.entry_id)
    timings = {k: v for k, v in group.timings.items() if k not in ("score_s", "scored_at", "submitted_at")}
    timings.update(score_s=score_s, scored_at=time.time(), **({"submitted_at": submitted} if submitted else {}))
    return msgspec.structs.replace(
        group, completions=completions, error=error, scored_by=scored_by, timings=timings, metrics=scores.metrics
    )


def rejected_group(item: UnscoredGroup, error: str, scored_by: str, decode: Decode) -> RolloutGroup:
    """The group with no rewards and the reason; its text decoded from its tokens too (the
    actor's text never reaches the learner from the tier)."""
    n = len(item.group.completions)
    return scored_group(
        item,
        Scores([None] * n, [{} for _ in range(n)], error),
        [decode(c.tokens.tolist()) for c in item.group.completions],
        scored_by,
        0.0,
    )


def entry_time(entry_id: str) -> float | None:
    """The Redis time (seconds) at which a stream entry was added: its id's first part."""
    head = entry_id.split("-", 1)[0]
    return int(head) / 1000 if head.isdigit() else None


def score_job(*entry_ids: str) -> list[dict[str, Any]]:
    """One RQ job: score the groups of these unscored entries (a lease's, as they came in)
    and store each. A reward that raises fails the job (RQ retries it; groups stored by an
    earlier attempt are skipped); any other failure of the reward (past the group's time
    limit, wrong shape, every function abstaining) rejects that group at once: running it
    again would give the same answer."""
    tier = _TIER
    if tier is None:
        raise RuntimeError("score_job runs in an `learner score` worker")
    return score_entries(tier, entry_ids)


def score_entries(tier: Tier, entry_ids: Sequence[str]) -> list[dict[str, Any]]:
    """`score_job`'s work on `tier`: what each entry became. Every group's episodes are
    read first; the environment's replays of all the job's groups then start at once, each
    in its own process (`learner.scoring.replay`, forked before this process starts a thread); each
    group is scored and stored as soon as its replay is in, so a slow one delays only its own."""
    items = tier.queue.fetch_unscored_many(entry_ids)  # two round trips for the job's groups, not three each
    out: dict[str, dict[str, Any]] = {}
    ready: list[_Ready] = []
    for entry_id, item in zip(entry_ids, items, strict=True):
        done = _read_one(tier, entry_id, item)
        if isinstance(done, dict):
            out[entry_id] = done
        else:
            ready.append(done)
    if tier.batch and len(ready) > 1:
        call_together(tier, ready)
    running = [r.running for r in ready if r.running is not None]
    owner = {id(r.running): r for r in ready if r.running is not None}
    try:
        for r in ready:
            if r.running is None:
                out[r.entry_id] = _score_ready(tier, r)
        waiting = list(running)
        while waiting:
            for finished in replay.wait(waiting, timeout_s=1.0):
                waiting.remove(finished)
                r = owner[id(finished)]
                out[r.entry_id] = _score_ready(tier, r)
    finally:
        replay.close(running)
    return [out[e] for e in entry_ids]


@dataclass
class _Ready:
    """A group read and checked, to be scored (its environment's replay running, if any)."""

    entry_id: str
    item: UnscoredGroup
    transcripts: list[Transcript] | None
    started: float
    running: replay.Replay | None = None
    """The environment's replay of its episodes."""
    called: Values | None = None
    """The reward functions' values and what they logged, when the job's groups were scored
    together (`call_together`)."""

    decoded: tuple[list[str], list[list[int]], ToolMask] | None = None

    def texts_and_ids(self, tier: Tier) -> tuple[list[str], list[list[int]], ToolMask]:
        """The completions' texts (decoded from their tokens: what rewards score), ids and
        tool mask (read against the episodes' model turns before the group came here; None
        when no reward takes it)."""
        if self.decoded is None:
            completions = self.item.group.completions
            ids = [c.tokens.tolist() for c in completions]
            mask = None
            if tier.scorer.wants_tool_mask:
                mask = group_tool_mask([None if c.mask is None else list(c.mask) for c in completions], ids)
            self.decoded = [tier.decode(i) for i in ids], ids, mask
        return self.decoded


def call_together(tier: Tier, ready: list[_Ready]) -> None:
    """`--reward-batch`: each reward function called once on all the ready groups (within
    their limits together). If that fails (a reward raised, hung, returned garbage, the
    groups' columns differ), each group is scored alone as without it, so one bad group
    still costs only itself."""
    groups = []
    for r in ready:
        assert r.item.prompt is not None
        texts, ids, mask = r.texts_and_ids(tier)
        groups.append((r.item.prompt, "", texts, ids, mask))
    try:
        results = tier.scorer.call_batch_within(tier.timeout_s * len(ready), groups)
    except PastLimit:
        why = f"past {tier.timeout_s * len(ready):g}s"
    except Exception as err:  # the user's reward raised: alone, it is retried as always
        why = f"{type(err).__name__}: {printable(str(err), 300)}"
    else:
        failed = next((c for c in results if isinstance(c, Scores)), None)
        if failed is None:
            for r, called in zip(ready, results, strict=True):
                assert not isinstance(called, Scores)
                r.called = called
            return
        why = failed.error or "failed"
    log.warning("scoring %d groups together failed (%s); scoring each alone", len(ready), why)


def _read_one(tier: Tier, entry_id: str, item: UnscoredGroup | ProtocolError | None) -> dict[str, Any] | _Ready:
    """What became of an entry that needs no scoring, or the group ready to score."""
    if isinstance(item, ProtocolError):
        reason = printable(f"malformed: {item}", 2000)
        tier.queue.dead_letter_unscored(entry_id, reason)
        return {"entry": entry_id, "stored": False, "dead_lettered": reason}
    if item is None or item.scored:
        return {"entry": entry_id, "stored": False}
    if item.prompt is None:
        return _stored(
            tier,
            entry_id,
            rejected_group(item, "scoring: the private prompt record is missing", tier.name, tier.decode),
        )
    started = time.monotonic()
    completions = item.group.completions
    try:
        transcripts = read_episodes(tier.episodes, completions, item.tools, item.max_tool_calling_iterations)
    except TranscriptError as err:
        log.warning(
            "group %s of worker %s rejected: %s", item.group.group_id, item.group.actor_id, printable(str(err), 300)
        )
        return _stored(tier, entry_id, rejected_group(item, f"episode refused: {err}", tier.name, tier.decode))
    ready = _Ready(entry_id, item, transcripts, started)
    if tier.environment is not None:
        episodes = [answered_calls(t) for t in (transcripts if transcripts is not None else single_turns(completions))]
        ready.running = replay.start(
            tier.environment.environment, item.prompt.columns, episodes, tier.replay_limits, tier.timeout_s
        )
    return ready


def _score_ready(tier: Tier, r: _Ready) -> dict[str, Any]:
    item, completions = r.item, r.item.group.completions
    assert item.prompt is not None
    extra = None
    if r.running is not None:
        outcome = r.running.result

        def extra() -> list[float]:
            if isinstance(outcome, str) or outcome is None:
                raise RewardRefused(outcome or "the environment's replay gave no answer")
            return outcome

    texts, ids, mask = r.texts_and_ids(tier)
    if r.called is not None:
        scores = tier.scorer.combine(len(texts), r.called, extra)
    else:
        scores = tier.scorer.score_within(tier.timeout_s, item.prompt, "", texts, ids, extra, tool_mask=mask)
    group = scored_group(
        item, scores, texts, tier.name, time.monotonic() - r.started, recounted(completions, r.transcripts)
    )
    return _stored(tier, r.entry_id, group)


def _stored(tier: Tier, entry_id: str, group: RolloutGroup) -> dict[str, Any]:
    stored = store_or_dead_letter(tier.queue, entry_id, group)
    return {"entry": entry_id, "group": group.group_id, "stored": stored, "error": group.error}


def store_or_dead_letter(queue: ScoringQueue, entry_id: str, group: RolloutGroup) -> bool:
    """Store a scored or rejected group; one the wire's limits refuse (an actor's group
    that left no room for the scores) goes to the dead letters with the reason instead:
    trying again would fail the same way. False if nothing new was stored."""
    try:
        return queue.store_scored(entry_id, group)
    except ProtocolError as err:
        reason = printable(f"unstorable after scoring: {err}", 2000)
        log.error("group %s dead-lettered: %s", group.group_id, reason)
        queue.dead_letter_unscored(entry_id, reason)
        return False
