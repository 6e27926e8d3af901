"""The learner's prompt ledger and its filter, as plain objects: every issued prompt is
trained, dropped, dead-lettered or in flight, exactly once; `judge` as a table."""

from __future__ import annotations

import json
from dataclasses import asdict

import msgspec
import pytest
from factories import batch, group

from learner.checkpoint import LearnerState
from learner.judge import Bounds, Reason, StepGroups, judge
from learner.ledger import Outstanding, PromptLedger, Span
from protocol import Completion, DeadLetter, FinishedBatch, ProtocolError, group_id_for, pack_i32


def test_issue_consume_and_finish_account_for_every_prompt() -> None:
    ledger = PromptLedger()
    assert ledger.issue("b0", 2) == 0 and ledger.issue("b1", 2) == 2
    assert (ledger.cursor, ledger.batches_issued, ledger.inflight, ledger.room(6)) == (4, 2, 4, 2)
    ledger.consume("b0", "p0")
    assert ledger.is_consumed("b0", "p0") and not ledger.is_consumed("b0", "p1")
    assert ledger.purge_completed() == [] and ledger.inflight == 3
    ledger.consume("b0", "p1")
    assert ledger.purge_completed() == ["b0"] and set(ledger.outstanding) == {"b1"}
    assert ledger.finished_batches() == [FinishedBatch("b0", [group_id_for("b0", "p0"), group_id_for("b0", "p1")])]
    ledger.reported()
    assert ledger.finished == {} and ledger.inflight == 2


def test_undo_gives_a_prompt_back() -> None:
    ledger = PromptLedger()
    ledger.issue("b0", 2)
    ledger.consume("b0", "p1")
    ledger.undo("b0", "p1")
    assert ledger.outstanding["b0"].consumed == [] and ledger.inflight == 2


@pytest.mark.parametrize(
    ("letter", "lost", "consumed"),
    [
        # a batch lost with the group it lacked (p2); its stored group (p1) comes later, as a
        # group: the batch stays outstanding until it has
        (
            DeadLetter(
                "1-0",
                "prompts",
                "1-0",
                "max_deliveries",
                3,
                "w",
                batch(0, prompts=3),
                missing_groups=[group_id_for("batch-0", "p2")],
            ),
            1,
            ["p0", "p2"],
        ),
        # a batch lost, nothing known of its groups: what the ledger had not consumed, and it is finished
        (DeadLetter("1-0", "prompts", "1-0", "missing", 0, "", batch(0, prompts=3)), 2, None),
        # one group the scoring tier could not store: its prompt is consumed, the batch goes on
        (
            DeadLetter(
                "1-0",
                "unscored",
                "5-0",
                "unstorable",
                0,
                "",
                None,
                group_id=group_id_for("batch-0", "p2"),
                batch_id="batch-0",
            ),
            1,
            ["p0", "p2"],
        ),
    ],
)
def test_a_dead_letter_loses_exactly_its_prompts(letter: DeadLetter, lost: int, consumed: list[str] | None) -> None:
    ledger = PromptLedger()
    ledger.issue("batch-0", 3)
    ledger.consume("batch-0", "p0")
    assert ledger.dead_letter(letter) == lost
    assert ledger.consumed_prompts == 1 + lost
    if consumed is None:
        assert "batch-0" not in ledger.outstanding and ledger.finished == {"batch-0": Span(0, 3)}
        return
    assert ledger.outstanding["batch-0"].consumed == consumed and ledger.purge_completed() == []
    ledger.consume("batch-0", "p1")
    assert ledger.purge_completed() == ["batch-0"] and ledger.inflight == 0


def test_the_ledger_round_trips_through_a_checkpoint_and_reads_the_old_layout() -> None:
    state = LearnerState(step=3)
    state.ledger.issue("b0", 2)
    state.ledger.consume("b0", "p0")
    state.ledger.finish("e0", 100, 4)
    state.ledger.to_reissue = [1, 0]
    state.ledger.issue_again("a0")
    state.ledger.to_revisit = [0, 1, 5]
    state.ledger.issue_revisit("t0", 2)
    state.quarantined = {"fleet/w": "failed the sampling shape audit"}
    again = LearnerState.from_json(json.loads(json.dumps(asdict(state))))
    assert again == state
    old = {
        "step": 3,
        "policy_version": 2,
        "cursor": 4,
        "batches_issued": 2,
        "consumed_prompts": 1,
        "dead_letter_after": "7-0",
        "outstanding": {"b1": [2, 2, ["p2"]]},
        "finished": {"b0": [0, 2]},
        "totals": {"trained_groups": 1},
        "unacked": {},
        "rng": {},
    }
    read = LearnerState.from_json(old)
    assert read.ledger.outstanding == {"b1": Outstanding(2, 2, consumed=["p2"])}
    assert read.ledger.finished == {"b0": Span(0, 2)}
    assert (read.ledger.cursor, read.ledger.dead_letter_after, read.policy_version) == (4, "7-0", 2)


def test_a_dishonest_worker_s_prompts_go_out_again_and_are_counted_once_each() -> None:
    ledger = PromptLedger()
    ledger.issue("b0", 3)
    for p in ("p0", "p1", "p2"):
        ledger.consume("b0", p)
    ledger.to_reissue = [2, 0]  # p2 and p0: their groups failed an audit
    assert ledger.inflight == 0 and ledger.issued == 3
    assert ledger.issue_again("a0") == 2 and ledger.to_reissue == [0]
    assert ledger.outstanding["a0"].prompt_ids() == ["p2"] and ledger.issued == 4 and ledger.inflight == 1
    assert ledger.room(1) == 0  # a prompt issued again takes a place in flight like any other
    assert ledger.batches_issued == 1  # numbered apart: the next new batch is b1 whatever was issued again
    ledger.consume("a0", "p2")
    assert sorted(ledger.purge_completed()) == ["a0", "b0"] and ledger.inflight == 0
    finished = {f.batch_id: f.group_ids for f in ledger.finished_batches()}
    assert finished["a0"] == [group_id_for("a0", "p2")]  # the queue forgets the new batch's group, by its own id
    assert ledger.issue_again("a1") == 0 and ledger.to_reissue == [] and ledger.inflight == 1
    assert ledger.outstanding["a1"].prompt_ids() == ["p0"] and ledger.reissued == 2


def test_revisits_go_out_in_whole_batches_and_are_counted_as_issued_apart_from_the_others() -> None:
    ledger = PromptLedger()
    ledger.issue("b0", 4)
    for p in ("p0", "p1", "p2", "p3"):
        ledger.consume("b0", p)
    ledger.to_revisit = [3, 1, 2]  # their groups taught (`learner.active.revisits`)
    assert ledger.issue_revisit("t0", 2) == [3, 1] and ledger.to_revisit == [2]
    assert ledger.outstanding["t0"].prompt_ids() == ["p3", "p1"]
    assert (ledger.issued, ledger.inflight, ledger.revisited, ledger.reissued) == (6, 2, 2, 0)
    assert (ledger.batches_issued, ledger.revisit_batches) == (1, 1)  # the others' numbering is not moved
    ledger.consume("t0", "p3")
    ledger.consume("t0", "p1")
    assert sorted(ledger.purge_completed()) == ["b0", "t0"] and ledger.inflight == 0
    assert ledger.consumed_prompts == ledger.issued == 6


BOUNDS = Bounds(
    scoring_mode="actors",
    max_abs_reward=10.0,
    vocab_size=100,
    context=32,
    num_generations=4,
    max_tokens=8,
    max_staleness=2,
)


def _with(g, **changes):
    return msgspec.structs.replace(g, **changes)


def _rewards(g, *values):
    return _with(
        g, completions=[msgspec.structs.replace(c, reward=v) for c, v in zip(g.completions, values, strict=True)]
    )


B = batch(0)
GOOD = _with(_rewards(group(B, 0), 0.0, 1.0, 0.0, 1.0), adapter_version=4)
ISSUED = {"p0": pack_i32([1, 2, 3]), "p1": None}

CASES = [
    ("good", GOOD, 5, ISSUED, None),
    ("trusted run, no scorer", GOOD, 5, ISSUED, "rejected_unscored"),
    ("the tier gave up", _with(GOOD, error="hung", scored_by="tier"), 5, ISSUED, "rejected_scoring"),
    ("a reward missing", _rewards(GOOD, 0.0, None, 1.0, 1.0), 5, ISSUED, "rejected_reward_error"),
    # the learner trains mask-1 tokens, the rewards score every token: without tools, no mask
    (
        "a mask in a run without tools",
        _with(
            GOOD,
            completions=[
                msgspec.structs.replace(c, mask=b"\x01" + b"\x00" * (c.tokens.size - 1)) for c in GOOD.completions
            ],
        ),
        5,
        ISSUED,
        "rejected_mask",
    ),
    ("a reward too large", _rewards(GOOD, 0.0, 11.0, 1.0, 1.0), 5, ISSUED, "rejected_bad_reward"),
    ("no prompt", _with(GOOD, prompt_token_ids=pack_i32([])), 5, ISSUED, "rejected_empty_prompt"),
    ("a token past the vocabulary", _with(GOOD, prompt_token_ids=pack_i32([1, 200])), 5, ISSUED, "rejected_bad_vocab"),
    ("longer than the context", _with(GOOD, prompt_token_ids=pack_i32([1] * 30)), 5, ISSUED, "rejected_too_long"),
    ("too few completions", _with(GOOD, completions=GOOD.completions[:3]), 5, ISSUED, "rejected_bad_shape"),
    (
        "a completion past max_tokens",
        _with(
            GOOD,
            completions=[Completion.of([5] * 9, [-0.1] * 9, finish_reason="length", reward=1.0), *GOOD.completions[1:]],
        ),
        5,
        ISSUED,
        "rejected_bad_shape",
    ),
    (
        "other prompt tokens than issued",
        _with(GOOD, prompt_token_ids=pack_i32([1, 2, 4])),
        5,
        ISSUED,
        "rejected_bad_shape",
    ),
    ("a prompt not issued", GOOD, 5, {"p1": None}, "rejected_bad_shape"),
    ("a batch from before a restart", _with(GOOD, prompt_token_ids=pack_i32([1, 2, 4])), 5, None, None),
    ("from the future", _with(GOOD, adapter_version=6), 5, ISSUED, "rejected_future_version"),
    ("at the staleness bound", _with(GOOD, adapter_version=3), 5, ISSUED, None),
    ("past the staleness bound", _with(GOOD, adapter_version=2), 5, ISSUED, "dropped_stale"),
    ("every reward equal", _rewards(GOOD, 1.0, 1.0, 1.0, 1.0), 5, ISSUED, "dropped_flat"),
    (
        "a rejection comes before staleness",
        _rewards(_with(GOOD, adapter_version=0), 0.0, 99.0, 0.0, 0.0),
        5,
        ISSUED,
        "rejected_bad_reward",
    ),
]


@pytest.mark.parametrize(("group_", "version", "issued", "reason"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_judge(group_, version: int, issued, reason: str | None) -> None:
    bounds = Bounds(**{**asdict(BOUNDS), "scoring_mode": "trusted"}) if reason == "rejected_unscored" else BOUNDS
    assert judge(group_, bounds, version, issued) == reason


def test_a_group_naming_a_version_must_carry_that_version_s_digest() -> None:
    published = "a" * 64
    proven = _with(GOOD, adapter_digest=published)
    digest_of = {v: published for v in range(1, 6)}.get
    assert judge(proven, BOUNDS, 5, ISSUED, digest_of) is None
    assert judge(_with(GOOD, adapter_digest="b" * 64), BOUNDS, 5, ISSUED, digest_of) == "rejected_adapter_digest"
    assert judge(GOOD, BOUNDS, 5, ISSUED, digest_of) == "rejected_adapter_digest"  # none at all
    # unknown to the learner now (a pruned manifest): not checked, judged by the rest
    assert judge(_with(GOOD, adapter_digest="b" * 64), BOUNDS, 5, ISSUED, {}.get) is None
    # a rejection: it comes before staleness, so a worker serving the wrong files is named
    stale = _with(GOOD, adapter_version=1, adapter_digest="b" * 64)
    assert judge(stale, BOUNDS, 5, ISSUED, digest_of) == "rejected_adapter_digest"
    # the base model has no adapter: a group of version 0 carries no digest (the wire says so)
    with pytest.raises(ProtocolError, match="adapter_digest: the base model"):
        _with(GOOD, adapter_version=0, adapter_digest=published)


def test_a_mask_is_judged_by_the_rest_of_the_rules_in_a_run_with_tools() -> None:
    masked = _with(
        GOOD,
        completions=[
            msgspec.structs.replace(c, mask=b"\x01" + b"\x00" * (c.tokens.size - 1)) for c in GOOD.completions
        ],
    )
    assert judge(masked, Bounds(**{**asdict(BOUNDS), "episodes": True}), 5, ISSUED) is None


def test_step_groups_keep_the_verdicts_in_order() -> None:
    step = StepGroups()
    stale, flat = _with(GOOD, adapter_version=0), _rewards(GOOD, 1.0, 1.0, 1.0, 1.0)
    for g, reason in ((GOOD, None), (stale, Reason.STALE), (flat, Reason.FLAT), (GOOD, Reason.BAD_VOCAB)):
        step.add(g, reason)
    assert step.kept == [GOOD] and step.count(Reason.STALE) == 1
    assert step.reasons() == [
        (stale.group_id, "dropped_stale"),
        (flat.group_id, "dropped_flat"),
        (GOOD.group_id, "rejected_bad_vocab"),
    ]
    assert step.dropped_rewards() == [0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0]  # the stale and flat ones only


def test_every_reason_is_a_rejection_or_a_drop_and_names_its_counter() -> None:
    assert {r for r in Reason if r.dropped} == {Reason.STALE, Reason.FLAT}
    assert all(r.rejected != r.dropped for r in Reason)
    assert {r for r in Reason if r.reissued} == {Reason.AUDIT, Reason.ADAPTER_DIGEST, Reason.QUARANTINED}
    assert all(r.rejected for r in Reason if r.reissued)  # a good group's prompt is never asked again
    state = LearnerState()
    state.count(Reason.STALE)
    state.count("dropped_stale")
    assert state.totals == {"dropped_stale": 2} and type(next(iter(state.totals))) is str
    assert json.loads(json.dumps(asdict(state)))["totals"] == {"dropped_stale": 2}


def test_a_repeated_rejection_is_logged_once_a_minute_with_its_count(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from learner.judge import RepeatedWarnings

    now = [0.0]
    warnings = RepeatedWarnings(logging.getLogger("test-repeats"), every_s=60, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="test-repeats"):
        for t in range(0, 130, 2):  # one too_long group every 2 s for 130 s, and one other rejection
            now[0] = float(t)
            warnings.warn("rejected_too_long", f"group g{t}: too_long")
        warnings.warn("rejected_bad_shape", "group x: bad_shape")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "group g0: too_long",
        "group g60: too_long (and 29 more like it in the last 60s)",
        "group g120: too_long (and 29 more like it in the last 60s)",
        "group x: bad_shape",
    ], lines
