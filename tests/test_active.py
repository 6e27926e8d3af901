"""Active sampling (`learner.active`): each prompt's flat rate moves with its groups, the
feeder passes over a prompt with that chance (never below the floor's chance to be
issued), a prompt flat below the best reward (too hard) keeps its place unless asked, and
the rates are in the checkpoint. The feeder's side (positions passed over, counted, issued
again after a resume) is driven as the learner wires it, on an in-memory Redis."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import fakeredis
import msgspec
import pytest
from factories import NO_AUDITS, completion, group, write_dataset

from learner.active import PromptOutcomes, passes_over, revisits
from learner.checkpoint import LearnerState
from learner.config import LearnerConfig
from learner.feeder import Feeder
from learner.judge import Reason
from learner.loop import Learner
from learner.summary import accounting
from protocol import Delivery, PromptBatch, QueueConfig, RolloutGroup
from protocol.trusted import RedisQueue, open_store


def test_a_prompt_s_flat_rate_follows_its_groups_and_only_mastery_counts_as_flat() -> None:
    o = PromptOutcomes()
    o.record(7, [0.0, 1.0, 0.0, 1.0])  # a spread: nothing to remember
    assert o.best == 1.0 and o.flat_rate == {}
    o.record(7, [1.0] * 4)
    o.record(7, [1.0] * 4)
    assert o.flat_rate == {7: 0.75}
    o.record(7, [0.0] * 4)  # flat below the best reward: too hard for now, not mastered
    assert o.flat_rate == {7: 0.375}
    o.record(8, [0.0] * 4, hard=True)  # unless too hard counts too
    assert o.flat_rate[8] == 0.5
    for _ in range(6):
        o.record(7, [0.0, 1.0, 1.0, 1.0])
    assert 7 not in o.flat_rate  # forgotten below 1 %: a prompt with a spread costs nothing
    o.record(9, [2.0] * 4)  # a new best: flat at it is mastered
    assert o.best == 2.0 and o.flat_rate[9] == 0.5
    assert o.metrics(prompts=4) == {"sampling/flat_prompt_frac": 0.5, "sampling/skip_chance_mean": 0.25}


def test_the_chance_to_pass_over_is_the_flat_rate_capped_by_the_floor_and_drawn_from_the_seed() -> None:
    mastered = [passes_over(1.0, p, seed=3, floor=0.05) for p in range(10_000)]
    half = [passes_over(0.5, p, seed=3, floor=0.05) for p in range(10_000)]
    assert 9_400 < sum(mastered) < 9_600 and 4_850 < sum(half) < 5_150  # within 3 sigma of 95 % and 50 %
    assert not any(passes_over(0.0, p, seed=3, floor=0.05) for p in range(1_000))  # never flat: always issued
    assert mastered == [passes_over(1.0, p, seed=3, floor=0.05) for p in range(10_000)]  # the same draw again
    assert mastered != [passes_over(1.0, p, seed=4, floor=0.05) for p in range(10_000)]
    assert all(passes_over(1.0, p, seed=3, floor=0.0) for p in range(1_000))


def test_the_rates_are_in_the_checkpoint() -> None:
    state = LearnerState()
    state.outcomes.record(3, [1.0] * 4)
    state.outcomes.record(4, [0.5, 1.0, 0.5, 0.5])
    read = LearnerState.from_json(json.loads(json.dumps(asdict(state), sort_keys=True)))
    assert read.outcomes == state.outcomes == PromptOutcomes(flat_rate={3: 0.5}, best=1.0)
    assert LearnerState.from_json({}).outcomes == PromptOutcomes()  # a checkpoint from before


@pytest.fixture
def learner(tmp_path: Path, tiny_model: Path) -> Iterator[Learner]:
    rows = write_dataset(tmp_path / "data.jsonl", n=8)
    lines = rows.read_text().splitlines()
    # rows 0-3 again: the same question is one prompt, known by its content
    rows.write_text("\n".join(lines[:4] + [json.dumps({**json.loads(x), "idx": i}) for i, x in enumerate(lines[:4])]))
    cfg = LearnerConfig(
        run="active",
        queue="redis://unused",
        store=(tmp_path / "store").as_uri(),
        model=str(tiny_model),
        dataset=str(rows),
        run_dir=tmp_path / "run",
        groups_per_step=2,
        num_generations=4,
        prompts_per_batch=2,
        max_inflight=4,
        adaptive_inflight=False,
        max_tokens=4,
        max_staleness=8,
        lora_rank=8,
        tensorboard=False,
        seed=4,  # position 0's question comes again at positions 4-7
        active_sampling_floor=0.0,  # a mastered prompt is never issued again here
        active_sampling_revisit=0.0,  # revisits: their own tests
        **NO_AUDITS,
    )
    queue = RedisQueue(fakeredis.FakeRedis(version=(7, 0)), QueueConfig(run=cfg.run))
    learner = Learner(cfg, queue, open_store(cfg.store))
    yield learner
    learner.publisher.close()


def answer(b: PromptBatch, i: int, rewards: tuple[float, ...]) -> RolloutGroup:
    return msgspec.structs.replace(
        group(b, i),
        prompt_token_ids=b.prompts[i].token_ids,
        completions=[completion(2, reward=r) for r in rewards],
    )


def test_the_feeder_passes_over_a_mastered_prompt_and_counts_the_positions_skipped(learner: Learner) -> None:
    feeder, collector, state, source = learner.feeder, learner.collector, learner.state, learner.source
    keys = [source.row_key(p) for p in range(16)]  # two epochs of 8 rows
    assert source.distinct == 4 and all(keys[:8].count(k) == 2 for k in keys)
    feeder.feed(kept=0)
    first = [lease.batch for lease in learner.queue.claim("w", 10)]
    assert [p.id for b in first for p in b.prompts] == ["p0", "p1", "p2", "p3"]
    flat = keys[0]
    state.policy_version = 9  # max_staleness 8: every group of the base model is stale now
    rejected = next(p for p in range(4) if keys[p] != flat)
    for p in range(4):
        b, i = first[p // 2], p % 2
        if keys[p] == flat:  # stale, and flat at the best reward: mastered is mastered
            g = answer(b, i, (1, 1, 1, 1))
        elif p == rejected:  # flat too, but from the future: a rejected group says nothing of its prompt
            g = msgspec.structs.replace(answer(b, i, (1, 1, 1, 1)), adapter_version=10)
        else:
            g = answer(b, i, (0, 1, 0, 1))
        collector.take(Delivery(f"1-{p}", g))
    assert collector.step.count(Reason.FUTURE_VERSION) == 1 and collector.step.count(Reason.STALE) == 3
    assert {k for k, rate in state.outcomes.flat_rate.items() if rate > 0} == {flat}
    state.outcomes.flat_rate[flat] = 1.0  # mastered for good: at floor 0 never issued again
    feeder.checkpointed()  # the feeder decides from the rates of the last checkpoint
    feeder.reissue(collector.end_step())
    feeder.purge_completed()
    feeder.feed(kept=0)
    second = [lease.batch for lease in learner.queue.claim("w", 10)]
    issued = [int(p.id[1:]) for b in second for p in b.prompts]
    assert issued == sorted(issued) and issued[0] == 4 and all(source.row_key(p) != flat for p in issued)
    cursor = state.ledger.cursor
    assert state.ledger.issued == 8 and state.ledger.skipped == cursor - 8 == keys[4:cursor].count(flat) > 0
    # the outstanding batches name their positions: a resume issues the same prompts again
    read = LearnerState.from_json(json.loads(json.dumps(asdict(state))))
    again = [feeder._batch(b, entry.all_positions()) for b, entry in read.ledger.outstanding.items()]
    assert [[p.id for p in b.prompts] for b in again] == [[p.id for p in b.prompts] for b in second]
    assert accounting(state, learner.cfg, None)["issued"] == 8


def test_with_every_prompt_passed_over_the_feeder_issues_the_next_ones_regardless(learner: Learner) -> None:
    state, source = learner.state, learner.source
    for p in range(8):
        state.outcomes.flat_rate[source.row_key(p)] = 1.0
    learner.feeder.checkpointed()
    assert learner.feeder.next_positions(3, 2) == list(range(3 + 8, 3 + 8 + 2))  # one pass over the data, then on
    learner.cfg.active_sampling = False
    assert learner.feeder.next_positions(3, 2) == [3, 4]


@pytest.mark.parametrize("hard", [False, True])
def test_the_feeder_records_a_too_hard_prompt_only_if_asked(learner: Learner, hard: bool) -> None:
    learner.cfg.active_sampling_hard = hard
    learner.feeder.feed(kept=0)
    b = learner.queue.claim("w", 1)[0].batch
    learner.feeder.outcome(answer(b, 1, (0, 0.5, 1, 0)))  # the best reward read: 1
    learner.feeder.outcome(answer(b, 0, (0, 0, 0, 0)))
    assert learner.state.outcomes.flat_rate.get(learner.source.row_key(0), 0.0) == (0.5 if hard else 0.0)


def test_a_batch_issued_after_a_checkpoint_holds_the_same_prompts_when_a_resumed_learner_issues_it(
    learner: Learner,
) -> None:
    """Batch ids are deterministic and the queue keeps the first of an id: a learner killed
    after issuing a batch, resumed from the checkpoint before, must issue the same prompts
    under that id. The rates that changed since the checkpoint do not count until the next."""
    feeder, state, source = learner.feeder, learner.state, learner.source
    state.outcomes.flat_rate[source.row_key(1)] = 1.0
    feeder.checkpointed()
    saved = json.loads(json.dumps(asdict(state)))  # the checkpoint
    state.outcomes.flat_rate[source.row_key(4)] = 1.0  # learnt after it
    feeder.feed(kept=0)
    before = [(b.batch_id, [p.id for p in b.prompts]) for b in (lease.batch for lease in learner.queue.claim("w", 10))]
    assert before and all(source.row_key(int(p[1:])) != source.row_key(1) for _, ids in before for p in ids)
    learner.state = LearnerState.from_json(saved)  # resumed
    positions = []
    cursor = learner.state.ledger.cursor
    for _, ids in before:
        positions.append(learner.feeder.next_positions(cursor, len(ids)))
        cursor = positions[-1][-1] + 1
    assert [[f"p{p}" for p in ps] for ps in positions] == [ids for _, ids in before]
    assert learner.state.outcomes.flat_rate[source.row_key(1)] == 1.0


def test_a_group_that_taught_revisits_its_prompt_with_the_chance_drawn_from_the_seed_and_its_id() -> None:
    ids = [f"g{i}" for i in range(10_000)]
    half = [revisits([0.0, 1.0], g, seed=3, chance=0.5) for g in ids]
    assert 4_850 < sum(half) < 5_150  # within 3 sigma of 50 %
    assert half == [revisits([0.0, 1.0], g, seed=3, chance=0.5) for g in ids]  # a resumed learner decides the same
    assert half != [revisits([0.0, 1.0], g, seed=4, chance=0.5) for g in ids]
    assert all(revisits([0.0, 0.5, 0.0], g, seed=3, chance=1.0) for g in ids[:100])
    assert not any(revisits([1.0, 1.0], g, seed=3, chance=1.0) for g in ids[:100])  # flat: it taught nothing
    assert not any(revisits([0.0, 1.0], g, seed=3, chance=0.0) for g in ids[:100])


def test_prompts_that_taught_go_out_again_in_whole_batches_before_new_ones_and_a_resume_makes_the_same(
    learner: Learner,
) -> None:
    """Three groups taught, one did not: two revisits make a batch (2 prompts), issued once a
    checkpoint holds them, before the new prompts, under its own numbering; the third waits
    for a partner. A revisit's
    group that taught is not revisited again. The ledger
    counts them as issued, and a learner resumed from before, reading the same groups in
    the stream's order, issues the same batch under the same id."""
    feeder, collector, state = learner.feeder, learner.collector, learner.state
    learner.cfg.active_sampling_revisit = 1.0
    saved = json.loads(json.dumps(asdict(state)))  # the checkpoint
    feeder.feed(kept=0)
    first = [lease.batch for lease in learner.queue.claim("w", 10)]
    assert [p.id for b in first for p in b.prompts] == ["p0", "p1", "p2", "p3"]
    read = [
        answer(first[0], 0, (0, 1, 0, 1)),
        answer(first[0], 1, (1, 1, 1, 1)),  # flat: not revisited
        answer(first[1], 0, (0, 0, 0.5, 0)),
        answer(first[1], 1, (1, 0, 1, 1)),
    ]

    def take_all() -> list[PromptBatch]:
        for i, g in enumerate(read):
            learner.collector.take(Delivery(f"1-{i}", g))
        assert learner.state.ledger.to_revisit == [0, 2, 3]
        learner.feeder.reissue(learner.collector.end_step())
        learner.feeder.purge_completed()
        learner.checkpoint()  # the step's: revisits go out once a checkpoint holds them
        learner.feeder.feed(kept=0)
        return [lease.batch for lease in learner.queue.claim("w", 10)]

    second = take_all()
    second_as_issued = [(b.batch_id, [p.id for p in b.prompts]) for b in second]
    assert second_as_issued == [("active-t0", ["p0", "p2"]), ("active-b2", ["p4", "p5"])]
    assert state.ledger.to_revisit == [3] and state.ledger.revisited == 2 and state.ledger.issued == 8
    assert accounting(state, learner.cfg, None)["revisited"] == 2
    # the revisit's groups answer the prompt as issued (its tokens), and are judged like any other
    assert collector.judge(answer(second[0], 1, (0, 1, 0, 1))) is None
    collector.take(Delivery("2-0", answer(second[0], 0, (0, 1, 0, 1))))
    assert len(collector.step.kept) == 1 and state.ledger.to_revisit == [3]  # once: not revisited again
    # in the checkpoint, all of it
    assert LearnerState.from_json(json.loads(json.dumps(asdict(state)))).ledger == state.ledger

    learner.state = LearnerState.from_json(saved)  # resumed from before: the same groups again
    learner.queue._r.flushall()
    learner.feeder.feed(kept=0)  # its first batches, before it reads their groups (`Feeder.ahead`)
    assert [b.batch_id for b in [lease.batch for lease in learner.queue.claim("w", 10)]] == ["active-b0", "active-b1"]
    assert [(b.batch_id, [p.id for p in b.prompts]) for b in take_all()] == second_as_issued


@pytest.mark.parametrize("every", [4, 10])
def test_revisits_that_no_checkpoint_would_let_out_are_named_at_start(
    learner: Learner, caplog: pytest.LogCaptureFixture, every: int
) -> None:
    """Revisits go out once a checkpoint holds them: a run with none before its end would
    ask for them in vain, so its start says so (a warning: a short trial run is no error)."""
    cfg = learner.cfg.model_copy(update={"active_sampling_revisit": 0.5, "steps": 10, "checkpoint_every": every})
    with caplog.at_level(logging.WARNING, logger="learner.feeder"):
        Feeder(
            cfg,
            learner.queue,
            learner.source,
            learner.admission,
            learner.publisher,
            learner.evals,
            learner.feeder.sampling,
        )
    assert ("lower --checkpoint-every" in caplog.text) == (every >= 10)
