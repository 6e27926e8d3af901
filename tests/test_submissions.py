"""Submissions checked against their lease (the contract shared with leases in flight):
on a real redis-server and on fakeredis. Each test tries what a hostile or broken worker
would send, and checks that the refusal changes nothing."""

from __future__ import annotations

import time

import msgspec
import pytest
from factories import batch, completion, group, groups, trusted

from protocol import (
    Completion,
    LeaseLost,
    LeaseMismatch,
    PromptBatch,
    SamplingParams,
    SubmissionRejected,
    pack_i32,
)

LEASE_S = 0.3


def _snapshot(q) -> tuple:
    s = q.stats()
    return (s.prompts.length, s.prompts.pending, s.rollouts.length, s.dead_letters, s.leases_by_worker)


def _refused(q, exc: type[Exception], match: str, worker: str, lease_id: str, gs, **kwargs: object) -> None:
    before = _snapshot(q)
    with pytest.raises(exc, match=match):
        q.submit(worker, lease_id, gs, **kwargs)
    assert _snapshot(q) == before


def test_a_lease_that_never_existed_stores_nothing(make_queue) -> None:
    q = make_queue()
    q.add_prompts([batch(0)])
    _refused(q, LeaseLost, "not outstanding", "w", "1-0", groups(batch(0)))
    _refused(q, LeaseLost, "not outstanding", "w", "99999999999999-0", groups(batch(7)))  # never issued
    assert q.read_rollouts("learner", 10) == []


def test_a_queued_batch_cannot_be_front_run(make_queue, backend) -> None:
    """Its entry exists but nobody claimed it: a worker guessing the id (they are
    time-based, so guessable) gets nothing in, nor into a batch another worker holds."""
    q = make_queue()
    q.add_prompts([batch(0), batch(1)])
    ids = [i.decode() for i, _ in backend().xrange(q.keys.prompts)]
    (first,) = q.claim("honest", 1)
    assert first.lease_id == ids[0]
    _refused(q, LeaseLost, "not claimed", "attacker", ids[1], groups(batch(1)))
    _refused(q, LeaseLost, "another worker", "attacker", first.lease_id, groups(batch(0)))
    assert q.submit("honest", first.lease_id, groups(first.batch)).stored == 2


def test_groups_must_answer_their_batch(make_queue) -> None:
    q = make_queue()
    b = PromptBatch(**{**msgspec.structs.asdict(batch(0, prompts=3)), "sampling": SamplingParams(max_tokens=8)})
    other = batch(1)
    q.add_prompts([b, other])
    (lease, _) = q.claim("w", 2)
    too_long = group(b, 0, tokens=9)
    too_few = group(b, 1, completions=3)
    too_many = group(b, 1, completions=5)
    not_in_batch = group(batch(0, prompts=10), 9)  # batch-0's id, a prompt it never had
    for bad, why in [
        ([group(b, 1), too_long], "9 tokens"),
        ([too_few], "3 completions"),
        ([too_many], "5 completions"),
        ([group(b, 0), group(b, 0)], "twice"),
        ([group(b, 0), not_in_batch], "answers no prompt"),
    ]:
        _refused(q, SubmissionRejected, why, "w", lease.lease_id, bad)
    _refused(q, LeaseMismatch, "batch-0", "w", lease.lease_id, [group(other, 0)])
    assert q.submit("w", lease.lease_id, groups(b)).finished


def test_prompt_tokens_must_be_the_issued_ones(make_queue) -> None:
    q = make_queue()
    b = PromptBatch(
        **{
            **msgspec.structs.asdict(batch(0)),
            "prompts": [msgspec.structs.replace(p, token_ids=pack_i32([1, 2, 3])) for p in batch(0).prompts],
        }
    )
    q.add_prompts([b])
    (lease,) = q.claim("w", 1)
    swapped = msgspec.structs.replace(group(b, 0), prompt_token_ids=pack_i32([1, 2, 4]))
    _refused(q, SubmissionRejected, "prompt tokens", "w", lease.lease_id, [swapped])
    assert q.submit("w", lease.lease_id, groups(b)).stored == 2  # factories echo [1, 2, 3]


def test_partial_submissions_keep_the_lease_until_the_last_prompt(make_queue) -> None:
    q = make_queue(lease_timeout_s=LEASE_S)
    q.add_prompts([batch(0, prompts=3)])
    (lease,) = q.claim("w", 1)
    gs = groups(lease.batch)
    first = q.submit("w", lease.lease_id, gs[:1])
    assert (first.stored, first.finished, first.missing, first.lease_held) == (1, False, 2, True)
    assert q.stats().prompts.pending == 1
    assert len(q.read_rollouts("learner", 10)) == 1  # a finished group reaches the learner at once
    time.sleep(LEASE_S * 0.7)
    again = q.submit("w", lease.lease_id, gs[:2])  # a retry plus one new: also a heartbeat
    assert (again.stored, again.duplicates, again.missing) == (1, 1, 1)
    time.sleep(LEASE_S * 0.7)  # longer than the lease since the claim, not since the last call
    assert q.claim("other", 1) == []
    last = q.submit("w", lease.lease_id, gs[2:])
    assert (last.stored, last.finished, last.missing) == (1, True, 0)
    assert q.stats().prompts.length == 0
    retry = q.submit("w", lease.lease_id, gs[2:])  # the answer of the last call was lost
    assert (retry.stored, retry.duplicates, retry.finished, retry.lease_held) == (0, 1, True, False)


def test_a_partly_answered_lease_is_finished_by_the_next_holder(make_queue) -> None:
    q = make_queue(lease_timeout_s=LEASE_S)
    q.add_prompts([batch(0, prompts=3)])
    (lease,) = q.claim("dies", 1)
    q.submit("dies", lease.lease_id, groups(lease.batch)[:2])
    time.sleep(LEASE_S + 0.1)
    (again,) = q.claim("next", 1)
    assert again.lease_id == lease.lease_id and again.deliveries == 2
    result = q.submit("next", again.lease_id, groups(again.batch))
    assert (result.stored, result.duplicates, result.finished) == (1, 2, True)
    assert sorted(d.group.prompt_id for d in q.read_rollouts("learner", 10)) == ["p0", "p1", "p2"]


def test_a_dead_lettered_partial_batch_names_exactly_the_prompts_lost(make_queue) -> None:
    q = make_queue(lease_timeout_s=LEASE_S, max_deliveries=1)
    q.add_prompts([batch(0, prompts=3)])
    (lease,) = q.claim("w", 1)
    q.submit("w", lease.lease_id, [group(lease.batch, 1)])
    time.sleep(LEASE_S + 0.1)
    assert q.claim("w2", 1) == []
    (dead,) = q.dead_letters()
    assert dead.reason == "max_deliveries"
    from protocol import group_id_for

    assert sorted(dead.missing_groups or []) == sorted(group_id_for("batch-0", p) for p in ("p0", "p2"))
    _refused(q, LeaseLost, "not outstanding", "w", lease.lease_id, [group(lease.batch, 0)])


def test_an_empty_completion_is_not_over_any_limit(make_queue) -> None:
    q = make_queue()
    q.add_prompts([batch(0, prompts=1)])
    (lease,) = q.claim("w", 1)
    g = msgspec.structs.replace(
        group(lease.batch, 0),
        completions=[Completion.of([], [], finish_reason="stop", reward=0.0)] + [completion(reward=1.0)] * 3,
    )
    assert q.submit("w", lease.lease_id, [g]).finished


# ----------------------------------------------------------------- the ledger, stateful


@pytest.mark.redis
def test_the_ledger_holds_whatever_two_workers_do(redis_server) -> None:
    """Claims, heartbeats, submissions (whole, partial, retried, malformed, oversized, for
    someone else's lease), releases and lease expiry from two workers, and for batches of
    the trusted scoring tier its scoring: groups whose scored copy cannot be stored, and
    scorers that die between storing a group and acknowledging it (their job run again),
    interleaved by hypothesis. After every step: each issued prompt is stored once, or
    dead-lettered, or waiting to be scored, or still in flight; no group is stored twice;
    nothing is stored that was not issued."""
    import uuid

    import redis as redis_py
    from hypothesis import settings
    from hypothesis import strategies as st
    from hypothesis.stateful import (
        RuleBasedStateMachine,
        initialize,
        invariant,
        rule,
        run_state_machine_as_test,
    )
    from toy_rewards import digit_first

    from learner.scoring import jobs as scoring
    from protocol import Limits, ProtocolError, QueueConfig, QueueRefused, group_id_for
    from protocol.trusted import RedisQueue
    from protocol.trusted.scoring import ScoringQueue
    from protocol.usercode.rewards import RewardFn, Scorer
    from protocol.wire.keys import ACTORS_GROUP

    # small messages, so an oversized group is cheap to make: 56,320 bytes for 4 completions
    limits = Limits(max_message_bytes=64 * 1024, scoring_room_bytes=8 * 1024, scoring_room_per_completion=256)

    workers = st.sampled_from(["w1", "w2"])

    class Ledger(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.raw = redis_py.Redis(port=redis_server.port)
            self.q: RedisQueue | None = None
            self.issued: set[str] = set()
            self.leases: dict[str, object] = {}  # every lease id ever handed out -> its batch
            self.trained: list[str] = []

        @initialize(max_deliveries=st.sampled_from([1, 2]))
        def open_queue(self, max_deliveries: int) -> None:
            config = QueueConfig(
                run=f"sm-{uuid.uuid4().hex[:10]}", max_deliveries=max_deliveries, lease_timeout_s=60, limits=limits
            )
            self.q = RedisQueue(redis_py.Redis(port=redis_server.port), config)
            sq = ScoringQueue(redis_py.Redis(port=redis_server.port), config)
            self.too_big: set[str] = set()  # groups whose scored copy outgrows the limits
            self.tier = scoring.Tier(
                queue=sq,
                scorer=Scorer([RewardFn("digit_first", digit_first)], timeout_s=None, reraise=True),
                name="tier",
                decode=lambda ids: "7" * 70_000 if self.scoring_now in self.too_big else "7",
                timeout_s=10,
            )
            self.scoring_now = ""

        def teardown(self) -> None:
            if self.q is not None:
                self.q.close()
                self.tier.queue.close()
            self.raw.close()

        @rule(prompts=st.integers(1, 3), scored_by_the_tier=st.booleans())
        def add_batch(self, prompts: int, scored_by_the_tier: bool) -> None:
            b = batch(f"{len(self.issued)}-{uuid.uuid4().hex[:6]}", prompts=prompts)
            if scored_by_the_tier:
                b = trusted(b)
            self.q.add_prompts([b])
            self.issued |= {group_id_for(b.batch_id, p.id) for p in b.prompts}

        @rule(worker=workers)
        def claim(self, worker: str) -> None:
            for lease in self.q.claim(worker, 1):
                self.leases[lease.lease_id] = lease.batch

        @rule(worker=workers, data=st.data())
        def heartbeat(self, worker: str, data: st.DataObject) -> None:
            if self.leases:
                self.q.heartbeat(worker, data.draw(st.lists(st.sampled_from(sorted(self.leases)), max_size=3)))

        @rule(data=st.data(), shape=st.sampled_from(["ok", "ok", "ok", "short", "long"]))
        def submit(self, data: st.DataObject, shape: str) -> None:
            """Mostly the holder of a lease held now; sometimes anyone, for any lease ever seen."""
            held = [
                (e["message_id"].decode(), e["consumer"].decode())
                for e in self.raw.xpending_range(self.q.keys.prompts, ACTORS_GROUP, "-", "+", 100)
            ]
            anyone = [(lease_id, w) for lease_id in sorted(self.leases) for w in ("w1", "w2")]
            if not held + anyone:
                return
            lease_id, worker = data.draw(st.sampled_from(held + held + anyone))
            b = self.leases[lease_id]
            picked = data.draw(st.lists(st.integers(0, len(b.prompts) - 1), min_size=1, max_size=3, unique=True))
            gs = [group(b, i, actor=worker, completions={"ok": 4, "short": 3, "long": 5}[shape]) for i in picked]
            try:
                self.q.submit(worker, lease_id, gs)
                seen["stored"] += 1
            except QueueRefused:
                pass  # refusals are the point: the invariants say they changed nothing

        @rule(data=st.data())
        def submit_oversized(self, data: st.DataObject) -> None:
            """A group past the room the tier needs is refused whole: nothing changes."""
            held = [
                (e["message_id"].decode(), e["consumer"].decode())
                for e in self.raw.xpending_range(self.q.keys.prompts, ACTORS_GROUP, "-", "+", 100)
            ]
            if not held:
                return
            lease_id, worker = data.draw(st.sampled_from(held))
            g = group(self.leases[lease_id], 0, actor=worker)
            big = msgspec.structs.replace(
                g, completions=[msgspec.structs.replace(c, text="x" * 15_000) for c in g.completions]
            )
            try:
                self.q.submit(worker, lease_id, [big])
                raise AssertionError("an oversized group was accepted")
            except ProtocolError as err:
                assert "room the scoring tier needs" in str(err)
                seen["oversized"] += 1

        @rule(data=st.data(), unstorable=st.booleans(), dies_after_storing=st.booleans())
        def tier_scores(self, data: st.DataObject, unstorable: bool, dies_after_storing: bool) -> None:
            """The tier scores one waiting group: stored, or (its copy too big) dead-lettered;
            a scorer that died after storing has its job run again, which stores nothing."""
            waiting = self.raw.xrange(self.q.keys.unscored)
            if not waiting:
                return
            entry_id, fields = data.draw(st.sampled_from(waiting))
            self.scoring_now = fields[b"g"].decode()
            if unstorable:
                self.too_big.add(self.scoring_now)
            (first,) = scoring.score_entries(self.tier, [entry_id.decode()])
            seen["tier_dead_lettered" if unstorable else "tier_stored"] += 1
            assert first["stored"] is not unstorable, first
            if dies_after_storing:
                assert scoring.score_entries(self.tier, [entry_id.decode()])[0]["stored"] is False

        @rule(worker=workers)
        def claim_and_answer_every_prompt(self, worker: str) -> None:
            """An honest worker: a whole batch, in one submission."""
            for lease in self.q.claim(worker, 1):
                self.leases[lease.lease_id] = lease.batch
                self.q.submit(worker, lease.lease_id, groups(lease.batch, actor=worker))

        @rule(worker=workers)
        def answer_one_prompt_and_vanish(self, worker: str) -> None:
            """A worker claims a batch, submits its first prompt's group and dies."""
            for lease in self.q.claim(worker, 1):
                self.leases[lease.lease_id] = lease.batch
                self.q.submit(worker, lease.lease_id, [group(lease.batch, 0, actor=worker)])

        @rule(worker=workers, data=st.data())
        def release(self, worker: str, data: st.DataObject) -> None:
            if self.leases:
                self.q.release(worker, data.draw(st.sampled_from(sorted(self.leases))))

        @rule()
        def expire(self) -> None:
            """Time passes: every lease idles past its timeout, delivery counts kept."""
            for entry in self.raw.xpending_range(self.q.keys.prompts, ACTORS_GROUP, "-", "+", 100):
                self.raw.xclaim(
                    self.q.keys.prompts,
                    ACTORS_GROUP,
                    entry["consumer"],
                    0,
                    [entry["message_id"]],
                    idle=10**9,
                    justid=True,
                )

        @rule(worker=workers)
        def expire_and_take_over(self, worker: str) -> None:
            """Time passes and a worker claims: expired leases are taken over or dead-lettered."""
            self.expire()
            self.claim(worker)

        @rule()
        def learner_reads(self) -> None:
            got = self.q.read_rollouts("learner", 100)
            self.trained += [d.group.group_id for d in got]
            self.q.ack_rollouts([d.delivery_id for d in got])

        @invariant()
        def every_prompt_is_accounted_for_once(self) -> None:
            unread = [f[b"g"].decode() for _, f in self.raw.xrange(self.q.keys.rollouts)]
            stored = self.trained + unread
            assert len(stored) == len(set(stored)), "a group was stored twice"
            assert set(stored) <= self.issued, "a group nobody issued was stored"
            letters = self.q.dead_letters(count=1000)
            lost_batches = [g for d in letters for g in (d.missing_groups or [])]
            # a group the tier dead-lettered may belong to a batch still leased (a partial submission)
            lost_groups = [d.group_id for d in letters if d.source == "unscored"]
            dead = lost_batches + lost_groups
            assert len(dead) == len(set(dead)) and not set(dead) & set(stored)
            unscored = [f[b"g"].decode() for _, f in self.raw.xrange(self.q.keys.unscored)]
            assert len(unscored) == len(set(unscored)) and not set(unscored) & (set(stored) | set(dead))
            in_flight = set()
            for _, f in self.raw.xrange(self.q.keys.prompts):
                in_flight |= {gid for gid in re_gids(f[b"g"].decode())} - set(stored) - set(unscored)
            assert not in_flight & set(lost_batches)
            in_flight -= set(lost_groups)
            assert set(stored) | set(dead) | set(unscored) | in_flight == self.issued
            seen["checks"] += 1
            seen["dead"] += bool(dead)
            seen["partial"] += bool(set(stored) & {g for d in self.q.dead_letters(count=1000) for g in issued_of(d)})

    seen = {
        "checks": 0,
        "dead": 0,
        "partial": 0,
        "stored": 0,
        "oversized": 0,
        "tier_stored": 0,
        "tier_dead_lettered": 0,
    }

    def issued_of(d) -> set[str]:
        return {group_id_for(d.batch.batch_id, p.id) for p in d.batch.prompts} if d.batch else set()

    def re_gids(expected: str) -> list[str]:
        return [part.split(":")[0] for part in expected.split(";") if part]

    run_state_machine_as_test(
        Ledger,
        # derandomized: the same examples every run, so the coverage check below is stable. The
        # examples derive from this test's source, so an edit (a reformat) draws others: 60 left
        # no partial dead letter after `ruff format`; 150 give each case below 12 or more
        settings=settings(max_examples=150, stateful_step_count=40, deadline=None, database=None, derandomize=True),
    )
    # the interesting cases happened: batches dead-lettered with some of their groups stored,
    # oversized groups refused, groups scored and dead-lettered by the tier
    assert seen["partial"] > 0 and seen["oversized"] > 0, str(seen)
    assert seen["tier_stored"] > 0 and seen["tier_dead_lettered"] > 0, str(seen)


def test_only_groups_decoded_with_the_queues_bounds_skip_validation(make_queue, monkeypatch) -> None:
    """The proxy hands `submit` the groups it decoded (`CheckedGroups`, made only by
    `decode_submit`): those are not validated twice. Anything else is: a group built in
    code (a bound msgspec checks only on decoding), one decoded with other bounds, or one
    named after another worker than the one submitting."""
    from protocol import Limits, ProtocolError
    from protocol.client.http import SubmitRequest, decode_submit, encode_body
    from protocol.trusted import redis_queue
    from protocol.wire.codec import DEFAULT_LIMITS, CheckedGroups

    q = make_queue()
    q.add_prompts([batch(0), batch(1), batch(2), batch(3)])
    leases = q.claim("w", 4)
    out_of_bounds = [msgspec.structs.replace(g, adapter_version=-1, actor_id="w") for g in groups(leases[0].batch)]
    _refused(q, ProtocolError, "adapter_version", "w", leases[0].lease_id, out_of_bounds)
    with pytest.raises(TypeError, match="decode_submit"):  # nobody else vouches for groups
        CheckedGroups(out_of_bounds, DEFAULT_LIMITS, object())

    validated: list[bool] = []

    def encode(msg, limits, *, validate: bool = True) -> bytes:
        validated.append(validate)
        return real_encode(msg, limits, validate=validate)

    real_encode = redis_queue.encode
    monkeypatch.setattr(redis_queue, "encode", encode)

    def decoded(lease, limits: Limits) -> CheckedGroups:
        body = encode_body(SubmitRequest(worker="w", lease_id=lease.lease_id, groups=groups(lease.batch, actor="x")))
        return decode_submit(body, limits).groups

    proxy_limits = msgspec.structs.replace(DEFAULT_LIMITS, max_message_bytes=1 << 20)  # its size aside, the same
    cases = [
        (decoded(leases[0], proxy_limits).named("w"), False),
        (decoded(leases[1], Limits(max_tokens=DEFAULT_LIMITS.max_tokens - 1)).named("w"), True),
        (decoded(leases[2], proxy_limits).named("someone-else"), True),
        (groups(leases[3].batch, actor="w"), True),
    ]
    for lease, (gs, checked_again) in zip(leases, cases, strict=True):
        validated.clear()
        assert q.submit("w", lease.lease_id, gs).stored == 2
        assert validated == [checked_again] * 2
