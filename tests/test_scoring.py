"""The trusted scoring tier (`--scoring trusted`): real Redis, real RQ workers (`actors
score` processes, forking a work horse per job), the proxy over real TLS for what actors
see on the wire."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import factories
import msgspec
import psutil
import pytest
import redis
from conftest import read_all
from servers import RedisServer, kill_process
from waiting import wait_until

from protocol import FinishedBatch, PromptBatch, QueueConfig
from protocol.trusted import RedisQueue
from protocol.trusted.scoring import ScoringQueue

pytestmark = [pytest.mark.redis, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
SECRET = "the-answer-is-4217"


def trusted_batch(i: int, prompts: int = 2, **columns: object) -> PromptBatch:
    b = factories.batch(i, prompts)
    return msgspec.structs.replace(
        b,
        scoring="trusted",
        prompts=[msgspec.structs.replace(p, columns={**p.columns, "answer": SECRET, **columns}) for p in b.prompts],
    )


@pytest.fixture
def queue(redis_server: RedisServer, run_name: str) -> Iterator[RedisQueue]:
    q = RedisQueue.from_url(redis_server.url, QueueConfig(run=run_name, lease_timeout_s=30))
    yield q
    q.close()


def submit_unscored(q: RedisQueue, batches: list[PromptBatch], reward: float = 100.0) -> list[str]:
    """Claim and submit each batch as an actor would, with a forged reward on every completion."""
    q.add_prompts(batches)
    gids = []
    for _ in batches:
        (lease,) = q.claim("actor-1", 1)
        groups = factories.groups(lease.batch)
        forged = [
            msgspec.structs.replace(
                g,
                timings={"submitted_at": 1.0, "score_s": 0.0, "generated_at": 2.0},
                metrics={"forged": reward},
                completions=[
                    msgspec.structs.replace(c, reward=reward, reward_components={"forged": reward})
                    for c in g.completions
                ],
            )
            for g in groups
        ]
        assert q.submit("actor-1", lease.lease_id, forged).finished
        gids += [g.group_id for g in groups]
    return gids


def test_private_columns_never_reach_an_actor_on_the_wire(make_proxy, run_name: str) -> None:
    proxy = make_proxy()
    learner, actor = proxy.queue("learner"), proxy.queue("actor")
    wire: list[bytes] = []
    receive = actor.pool.urlopen

    def recorded(*args, **kwargs):  # every byte the actor's calls receive, as they arrive
        response = receive(*args, **kwargs)
        wire.append(response.data)
        return response

    actor.pool.urlopen = recorded
    try:
        learner.add_prompts([trusted_batch(0), factories.batch(1)])
        leases = actor.claim("w", 2)
        assert {lease.batch.batch_id for lease in leases} == {"batch-0", "batch-1"}
        trusted = next(lease for lease in leases if lease.batch.scoring == "trusted")
        assert all(p.columns == {} for p in trusted.batch.prompts)
        assert all(p.text for p in trusted.batch.prompts)  # what generation needs does travel
        raw = b"".join(wire)
        assert SECRET.encode() not in raw
        assert b"level" in raw  # the actors-scored batch next to it keeps its columns: the check can fail
    finally:
        learner.close()
        actor.close()
    # nor in anything an actor could be handed later: the prompts stream holds the stripped batch
    client = redis.Redis.from_url(proxy.cmd[proxy.cmd.index("--redis") + 1])
    entries = client.xrange(f"spotgrpo:{{{run_name}}}:prompts")
    assert entries and all(SECRET.encode() not in v for _, f in entries for v in f.values())
    client.close()


def test_a_forged_reward_is_ignored_and_only_the_tier_writes_rollouts(
    queue: RedisQueue, scorers, run_name: str
) -> None:
    gids = submit_unscored(queue, [trusted_batch(i) for i in range(3)], reward=100.0)
    # the actor's submission went to the unscored stream, not to the learner
    assert queue.read_rollouts("learner-0", 10) == []
    assert queue.stats().unscored.length == 6
    scorers(reward="toy_rewards:answer_length")
    groups = read_all(queue, 6)
    assert sorted(g.group_id for g in groups) == sorted(gids)
    for g in groups:
        assert g.scored_by == f"scorer-0-{run_name}" and g.error is None
        # len(SECRET) + len("xxxx"): the private column reached the scorer, the forgery did not
        assert g.rewards == [float(len(SECRET) + 4)] * 4
        assert all(c.reward_components == {"answer_length": float(len(SECRET) + 4)} for c in g.completions)
        assert g.metrics == {}  # what the actor claimed its rewards logged is gone too
        assert "score_s" in g.timings
        # the tier's clocks, not the actor's: Redis's time of arrival, then the score
        assert time.time() - 120 < g.timings["submitted_at"] <= g.timings["scored_at"] <= time.time() + 1
    stats = queue.stats()
    assert stats.unscored.length == 0
    assert queue._r.hlen(queue.keys.private) == 0  # private prompts go once scored


def test_a_hung_reward_is_killed_at_its_timeout_and_its_group_rejected(
    queue: RedisQueue, scorers, tmp_path: Path
) -> None:
    attempts = tmp_path / "attempts"
    submit_unscored(queue, [trusted_batch(0, prompts=1, attempts_file=str(attempts))])
    started = time.monotonic()
    scorers("--reward-timeout-s", "1", "--retries", "0", reward="toy_rewards:hangs_counting")
    (group,) = read_all(queue, 1)
    assert time.monotonic() - started < 30  # not the reward's 60 s
    assert group.rewards == [None] * 4 and group.scored_by.startswith("scorer-0")
    assert "time limit of 1s" in group.error and "not retried" in group.error, group.error
    assert len(attempts.read_text().splitlines()) == 1


def test_a_groups_time_limit_does_not_count_the_reward_hosts_imports(queue: RedisQueue, scorers) -> None:
    """The reward module takes 3 s to import, the limit is 1 s: the first group's clock
    starts when the host is ready, so it is scored, not rejected."""
    submit_unscored(queue, [trusted_batch(0, prompts=1)])
    scorers("--reward-timeout-s", "1", "--retries", "0", reward="slow_import_rewards:digit_first")
    (group,) = read_all(queue, 1)
    assert group.error is None and group.rewards == [1.0] * 4, group.error  # each starts with a digit


def test_a_reward_module_keeps_its_state_across_jobs_and_a_hang_costs_only_that_state(
    queue: RedisQueue, scorers, tmp_path: Path
) -> None:
    """The rewards run in the worker's reward host, which outlives the work horses RQ forks
    per job: a reward's state built on its first call is there for every later group. A
    hung reward's host is killed at the group's limit and replaced: the groups after it
    are scored, by a fresh host."""
    submit_unscored(queue, [trusted_batch(i, prompts=1) for i in range(4)])
    scorers("--groups-per-job", "1", "--reward-timeout-s", "2", "--retries", "0", reward="toy_rewards:counts_or_hangs")
    got = read_all(queue, 4)
    assert sorted(g.rewards[0] for g in got) == [1.0, 2.0, 3.0, 4.0]  # four jobs, one count
    assert len({g.scored_by for g in got}) == 1
    hang = trusted_batch(4, prompts=1)
    submit_unscored(
        queue, [msgspec.structs.replace(hang, prompts=[msgspec.structs.replace(hang.prompts[0], text="hang")])]
    )
    (hung,) = read_all(queue, 1)
    assert "time limit of 2s" in hung.error
    submit_unscored(queue, [trusted_batch(i, prompts=1) for i in range(5, 7)])
    assert sorted(g.rewards[0] for g in read_all(queue, 2)) == [1.0, 2.0]  # a fresh host: its state is new


@pytest.mark.parametrize("reward", ["toy_rewards:its_mark", "toy_rewards:fails_in_batches"])
def test_reward_batch_calls_each_reward_once_per_job_and_falls_back_to_each_group_alone(
    queue: RedisQueue, scorers, tmp_path: Path, reward: str
) -> None:
    """`--reward-batch`: a lease of four groups is one job, and each reward one call on its
    16 completions (TRL's batch), the values split back to their groups; a reward that fails
    on the batch is called on each group alone."""
    calls = tmp_path / "calls"
    b = trusted_batch(0, prompts=4, calls_file=str(calls))
    b = msgspec.structs.replace(
        b, prompts=[msgspec.structs.replace(p, columns={**p.columns, "mark": i}) for i, p in enumerate(b.prompts)]
    )
    submit_unscored(queue, [b])
    scorers("--reward-batch", "--retries", "0", reward=reward)
    got = {g.prompt_id: g for g in read_all(queue, 4)}
    assert {p: g.rewards for p, g in got.items()} == {f"p{i}": [float(i)] * 4 for i in range(4)}
    assert all(g.error is None for g in got.values())
    together = [16] if reward.endswith("its_mark") else [16, 4, 4, 4, 4]
    assert [int(n) for n in calls.read_text().split()] == together


def test_log_extra_reaches_the_learners_completions_table_and_an_actors_own_is_replaced(
    queue: RedisQueue, scorers
) -> None:
    from learner.metrics import samples

    queue.add_prompts([trusted_batch(0, prompts=1)])
    (lease,) = queue.claim("actor-1", 1)
    forged = [
        msgspec.structs.replace(
            g, completions=[msgspec.structs.replace(c, extra={"verdict": "trust me"}) for c in g.completions]
        )
        for g in factories.groups(lease.batch)
    ]
    assert queue.submit("actor-1", lease.lease_id, forged).finished
    scorers(reward="toy_rewards:explains")
    (group,) = read_all(queue, 1)
    assert [c.extra for c in group.completions] == [
        {"verdict": "starts with a digit"}
    ] * 4  # the tier's, not the actor's
    rows = samples([group], [0.0] * 4, lambda ids, **_: "".join(map(str, ids)))
    assert [r["verdict"] for r in rows] == ["starts with a digit"] * 2 and rows[0]["reward"] == 1.0


def test_a_raising_reward_is_retried_with_backoff_then_rejected(queue: RedisQueue, scorers, tmp_path: Path) -> None:
    attempts = tmp_path / "attempts"
    # two prompts of one lease: one job; it fails, is split per group, and each is retried
    submit_unscored(queue, [trusted_batch(0, prompts=2, attempts_file=str(attempts))])
    scorers("--retries", "2", "--retry-backoff-s", "0.2", reward="toy_rewards:raises_counting")
    groups = read_all(queue, 2)
    assert len(groups) == 2
    for g in groups:
        assert g.rewards == [None] * 4
        assert (
            g.error.startswith("scoring failed after 3 attempt(s)")
            and "ZeroDivisionError: the judge is down" in g.error
        )
        # rejected, the group still carries its tokens' text, never the actor's ("xxxx")
        assert {c.text for c in g.completions} == {"6789"}
    # the lease's job: 3 attempts, each stopping at the first group; then 3 per group
    assert len(attempts.read_text().splitlines()) == 3 + 2 * 3
    assert queue.stats().unscored.length == 0


@pytest.mark.long
def test_a_scoring_worker_killed_mid_job_has_its_job_rerun_and_the_group_stored_once(
    queue: RedisQueue, scorers, tmp_path: Path
) -> None:
    attempts = tmp_path / "attempts"
    (gid,) = submit_unscored(queue, [trusted_batch(0, prompts=1, attempts_file=str(attempts))])
    first = scorers("--retries", "1", reward="toy_rewards:slow_first_attempt")
    deadline = time.monotonic() + 30
    while not attempts.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert int(attempts.read_text().split()[0]) != first.pid  # the reward runs in the worker's reward host
    # the worker dies, with its work horse (a process group of its own) and its reward host (a spawned
    # interpreter), SIGKILL; RQ's scheduler process lives on, as it did when only the horse was the worker's
    tree = [
        p
        for p in psutil.Process(first.pid).children(recursive=True)
        if os.getpgid(p.pid) == p.pid or "spawn_main" in " ".join(p.cmdline())
    ]
    assert len(tree) == 2, tree
    first.kill()
    for child in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
    first.wait(10)
    scorers("--retries", "1", reward="toy_rewards:slow_first_attempt")
    groups = read_all(queue, 2, timeout_s=60)  # ask for more than one: a second copy would show
    assert [g.group_id for g in groups] == [gid]
    assert groups[0].error is None and groups[0].scored_by.startswith("scorer-1")
    assert len(attempts.read_text().splitlines()) == 2  # run, killed, run again by RQ
    assert queue._r.scard(queue.keys.scored_seen) == 1


def test_scoring_workers_joining_and_leaving_during_a_run(queue: RedisQueue, scorers) -> None:
    gids = submit_unscored(queue, [trusted_batch(i) for i in range(5)])
    first = scorers("--groups-per-job", "1", reward="toy_rewards:slow_digit_first")
    got = read_all(queue, 2)
    second = scorers("--groups-per-job", "1", reward="toy_rewards:slow_digit_first")
    gids += submit_unscored(queue, [trusted_batch(i) for i in range(5, 10)])
    # SIGTERM: RQ's warm shutdown finishes the job in hand, then stops RQ's scheduler process
    # and joins it without a limit; that join took over 10 s once in four CI runs
    first.terminate()
    assert first.wait(timeout=60) == 0
    got += read_all(queue, 20 - len(got), timeout_s=90)
    assert sorted(g.group_id for g in got) == sorted(gids)  # each once
    assert {g.scored_by.split("-")[1] for g in got} == {"0", "1"}
    assert second.poll() is None


def test_scoring_is_idempotent_by_group_id(queue: RedisQueue, redis_server: RedisServer) -> None:
    (gid, _) = submit_unscored(queue, [trusted_batch(0)])
    sq = ScoringQueue.from_url(redis_server.url, queue.config)
    entries = sq.read_unscored("d", 10)
    item = sq.fetch_unscored(entries[0].entry_id)
    assert item is not None and item.prompt is not None and item.prompt.columns["answer"] == SECRET
    scored = msgspec.structs.replace(item.group, scored_by="t")
    assert sq.store_scored(entries[0].entry_id, scored) is True
    assert sq.store_scored(entries[0].entry_id, scored) is False  # a re-run job
    assert sq.fetch_unscored(entries[0].entry_id) is None
    assert [d.group.group_id for d in queue.read_rollouts("learner-0", 10)] == [gid]
    # the learner finishes with the batch and the queue forgets it: a job run again even
    # later still stores nothing, because the group's unscored entry is gone
    queue.ack_rollouts([], [FinishedBatch(item.group.batch_id, [gid])])
    assert not queue._r.sismember(queue.keys.scored_seen, gid)
    assert sq.store_scored(entries[0].entry_id, scored) is False
    assert queue.read_rollouts("learner-0", 10) == []
    sq.close()


def test_a_dead_lettered_trusted_batch_drops_its_private_prompts(redis_server: RedisServer, run_name: str) -> None:
    q = RedisQueue.from_url(redis_server.url, QueueConfig(run=run_name, lease_timeout_s=0.2, max_deliveries=1))
    q.add_prompts([trusted_batch(0)])
    assert q._r.hlen(q.keys.private) == 2
    q.claim("w", 1)
    time.sleep(0.4)
    assert q.claim("w", 1) == []
    (dl,) = q.dead_letters()
    assert len(dl.missing_groups) == 2 and q._r.hlen(q.keys.private) == 0
    q.close()


def test_an_actor_without_rewards_refuses_a_batch_the_actors_must_score(
    queue: RedisQueue, tiny_model: Path, make_proxy
) -> None:
    proxy = make_proxy()
    queue.add_prompts([factories.batch(0)])
    proc = subprocess.run(
        proxy.actor_command(tiny_model, "w", "--claim-block-s", "1"),
        capture_output=True,
        text=True,
        timeout=120,
        env=proxy.actor_env(),
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "start this worker with --reward" in proc.stderr
    # and the lease went back at once, for a worker that can score it
    assert queue.claim("other", 1)[0].batch.batch_id == "batch-0"


def queue_url(q: RedisQueue) -> str:
    kw = q._r.connection_pool.connection_kwargs
    return f"redis://{kw['host']}:{kw['port']}/0"


def test_learner_score_refuses_the_proxy_and_bad_rewards(redis_server: RedisServer, tiny_model: Path) -> None:
    def score(*args: str, cli: str = "learner.cli") -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", cli, "score", "--model", str(tiny_model), *args],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )

    proc = score("--redis", "https://proxy:8443", "--reward", "protocol.usercode.tasks:next_digit")
    assert proc.returncode == 2 and "never through the proxy" in proc.stderr
    # the command's earlier name only says where it went: a worker's package holds no Redis client
    proc = score("--queue", "https://proxy:8443", "--reward", "protocol.usercode.tasks:next_digit", cli="actors.cli")
    assert proc.returncode == 2 and proc.stderr.startswith("actors score: the trusted scoring tier is `learner score`")
    proc = score("--redis", redis_server.url, "--reward", "no_such_module:f")
    assert proc.returncode == 2 and "cannot import no_such_module" in proc.stderr
    proc = score("--redis", redis_server.url)
    assert proc.returncode == 2 and "at least one --reward is needed" in proc.stderr
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "learner.cli",
            "score",
            "--model",
            str(tiny_model),
            "--redis",
            redis_server.url,
            "--environment",
            "toy_tools:GuessNumber",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'tests'}"},
    )
    assert proc.returncode == 2 and "has no get_reward()" in proc.stderr, proc.stderr


def test_a_scoring_worker_rides_out_a_redis_restart(
    make_server, run_name: str, tmp_path: Path, tiny_model: Path
) -> None:
    """RQ's own worker quits when Redis goes away; `learner score` waits for it to come
    back (on its AOF, the same port) and scores on under a new RQ worker name."""
    server = make_server(persistent=True)
    server.start()
    q = RedisQueue.from_url(server.url, QueueConfig(run=run_name, lease_timeout_s=30))
    with (tmp_path / "scorer.log").open("wb") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "learner.cli",
                "score",
                "--queue",
                server.url,
                "--run",
                run_name,
                "--model",
                str(tiny_model),
                "--reward",
                "toy_rewards:digit_first",
                "--maintenance-interval-s",
                "1",
                "--monitoring-interval-s",
                "1",
            ],
            env={**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'tests'}"},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        first = submit_unscored(q, [trusted_batch(0)])
        assert sorted(g.group_id for g in read_all(q, 2)) == sorted(first)
        server.kill()
        wait_until(lambda: "RQ's worker" in (tmp_path / "scorer.log").read_text(), "RQ's worker to notice and quit", 30)
        server.start()
        second = submit_unscored(q, [trusted_batch(1)])
        assert sorted(g.group_id for g in read_all(q, 2, timeout_s=90)) == sorted(second)
        assert proc.poll() is None, (tmp_path / "scorer.log").read_text()[-3000:]
        assert "Redis answers again" in (tmp_path / "scorer.log").read_text()
        proc.terminate()  # and SIGTERM still stops it cleanly
        assert proc.wait(timeout=60) == 0
    finally:
        kill_process(proc)
        q.close()


def test_a_scored_copy_the_tier_cannot_store_is_dead_lettered_and_holds_up_nobody(
    queue: RedisQueue, run_name: str
) -> None:
    """A scored copy past the wire's limits (here: a tokenizer whose text outgrows what the
    actor sent) leaves the unscored stream for the dead letters with its reason and its
    group, at once and never again; the job's other group is stored."""
    from learner.scoring import jobs as scoring
    from protocol.usercode.rewards import Scorer, load_reward

    gids = submit_unscored(queue, [factories.trusted(factories.batch(0, prompts=2))])
    sq = ScoringQueue.from_url(queue_url(queue), QueueConfig(run=run_name))
    entries = sq.read_unscored("d", 10)
    sq.dispatched([e.entry_id for e in entries])  # as after enqueueing: no longer pending
    big = {entries[0].group_id}

    decoding = [""]  # the group being scored

    def decode(ids: object) -> str:  # the first group's text outgrows the limits
        return "7" * 5_000_000 if decoding[0] in big else "7"

    tier = scoring.Tier(
        queue=sq,
        scorer=Scorer([load_reward("toy_rewards:digit_first")], timeout_s=None, reraise=True),
        name="t",
        decode=decode,
        timeout_s=10,
    )
    results = []
    for e in entries:
        decoding[0] = e.group_id
        results += scoring.score_entries(tier, [e.entry_id])
    assert [r["stored"] for r in results] == [False, True]
    (dl,) = queue.dead_letters()
    assert (dl.source, dl.group_id, dl.batch_id) == ("unscored", entries[0].group_id, "batch-0")
    assert "unstorable after scoring" in dl.reason and "exceed the limit" in dl.reason
    assert sq.stats().unscored.length == 0 and not sq._r.hexists(sq.keys.private, entries[0].group_id)
    assert scoring.score_entries(tier, [entries[0].entry_id]) == [
        {"entry": entries[0].entry_id, "stored": False}
    ]  # a re-run
    assert [g.group_id for g in read_all(queue, 1)] == [gids[1]] and len(queue.dead_letters()) == 1
    sq.close()


def test_a_scorer_name_is_scoped_to_its_run_and_a_taken_one_is_refused(
    queue: RedisQueue, run_name: str, redis_server: RedisServer, tiny_model: Path
) -> None:
    from learner.scoring.tier import NameTaken, free_name

    sq = ScoringQueue.from_url(queue_url(queue), QueueConfig(run=run_name))
    key = f"rq:worker:spotgrpo:{run_name}:scorer-h-1"
    queue._r.hset(key, "birth", "now")  # a live registration (a SIGKILLed worker's outlives it)
    assert free_name(sq, "scorer-h-1", chosen=False) == "scorer-h-1-2"
    with pytest.raises(NameTaken, match="choose another name"):
        free_name(sq, "scorer-h-1", chosen=True)
    other = ScoringQueue.from_url(queue_url(queue), QueueConfig(run=f"{run_name}-other"))
    assert free_name(other, "scorer-h-1", chosen=True) == "scorer-h-1"  # another run's name space
    queue._r.hset(key, "death", "then")
    assert free_name(sq, "scorer-h-1", chosen=True) == "scorer-h-1"  # a worker that died cleanly
    queue._r.hdel(key, "death")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "learner.cli",
            "score",
            "--queue",
            redis_server.url,
            "--run",
            run_name,
            "--model",
            str(tiny_model),
            "--reward",
            "toy_rewards:digit_first",
            "--name",
            "scorer-h-1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'tests'}"},
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("learner score: --name scorer-h-1: a scoring worker")
    sq.close()
    other.close()


def _ignores_sigterm() -> None:
    import signal as signals

    signals.signal(signals.SIGTERM, signals.SIG_IGN)
    time.sleep(120)


def test_a_scheduler_that_ignores_sigterm_does_not_hold_the_warm_shutdown_forever() -> None:
    """RQ joins its scheduler process without a limit; ours kills it after a few seconds."""
    import multiprocessing
    import types

    import fakeredis

    from learner.scoring.rq_worker import ScoringWorker

    worker = ScoringWorker(["q"], connection=fakeredis.FakeRedis())
    worker.SCHEDULER_STOP_S = 1.0
    process = multiprocessing.get_context("fork").Process(target=_ignores_sigterm, daemon=True)
    process.start()
    time.sleep(0.5)  # its SIG_IGN is in place
    worker.scheduler = types.SimpleNamespace(_process=process)
    started = time.monotonic()
    worker.stop_scheduler()
    assert not process.is_alive() and time.monotonic() - started < 10


def test_the_warm_shutdown_does_not_wait_on_rqs_command_channel(redis_server: RedisServer) -> None:
    """RQ's teardown unsubscribes, then stops its pubsub thread, which redis-py 8.2 joins. A
    thread that read the unsubscription first waits out its poll (RQ's: 60 s) for a
    subscription that never comes; the embedded run's Ctrl-C killed the scorer after 15 s."""
    from learner.scoring.rq_worker import ScoringWorker

    worker = ScoringWorker(["q"], connection=redis.Redis.from_url(redis_server.url))
    worker.subscribe()
    worker.pubsub.unsubscribe()  # what the teardown does first; the thread reads the reply
    deadline = time.monotonic() + 10
    while worker.pubsub.subscribed and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # the thread is now in its wait for a subscription
    started = time.monotonic()
    worker.unsubscribe()
    assert not worker.pubsub_thread.is_alive() and time.monotonic() - started < 5


def test_redis_going_away_under_rq_is_one_line_not_a_traceback(caplog: pytest.LogCaptureFixture) -> None:
    """The embedded run's Redis ends with the run, sometimes while its scorer stops: RQ's
    worker and scheduler say so in one line each (they printed tracebacks)."""
    import logging

    from learner.scoring.rq_worker import RedisGoneInOneLine, _scheduler_run

    class Scheduler:
        log = logging.getLogger("rq.scheduler")

        def work(self) -> None:
            raise redis.exceptions.ConnectionError("Connection closed by server.")

    with caplog.at_level(logging.INFO):
        _scheduler_run(Scheduler())  # returns: the process ends quietly
        try:
            raise redis.exceptions.ConnectionError("Error 111 connecting")
        except redis.exceptions.ConnectionError:
            logger = logging.getLogger("rq.worker.test")
            logger.addFilter(RedisGoneInOneLine())
            logger.error("Worker %s: found an unhandled exception, quitting...", "w", exc_info=True)
    assert [r.getMessage() for r in caplog.records] == [
        "RQ's scheduler stopped: redis unreachable: Connection closed by server.",
        "Worker w: found an unhandled exception, quitting... (redis unreachable: Error 111 connecting)",
    ]
    assert "Traceback" not in caplog.text


def test_importing_the_tier_changes_nothing_of_rqs_until_it_serves() -> None:
    code = (
        "import logging, rq.scheduler as s; own = s.run\n"
        "import learner.scoring.tier, learner.scoring.rq_worker as t\n"
        "assert s.run is own and not logging.getLogger('rq.worker').filters, 'changed at import'\n"
        "t.adjust_rq(); t.adjust_rq()\n"
        "assert s.run is t._scheduler_run and len(logging.getLogger('rq.worker').filters) == 1\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_a_trl_reward_gets_the_trainer_state_on_the_tier_and_its_logged_metric_reaches_the_step(
    redis_server: RedisServer, scorers, run_name: str, tiny_model: Path, tmp_path: Path
) -> None:
    """A reward reading `trainer_state` (a schedule) and calling `log_metric`, as TRL users
    write them, scored by the tier in a learner run: its metric is a figure of each step,
    and the state it saw is the issuing step's, so it never runs backwards."""
    from with_worker import run_with_a_worker

    from actors.hf_engine import TransformersEngine
    from learner.config import LearnerConfig
    from protocol.trusted import open_store
    from protocol.trusted.store import StoreSource

    scorers(reward="toy_rewards:scheduled")
    cfg = LearnerConfig(
        run=run_name,
        queue=redis_server.url,
        store=(tmp_path / "store").as_uri(),
        model=str(tiny_model),
        dataset=str(factories.write_dataset(tmp_path / "train.jsonl")),
        run_dir=tmp_path / "run",
        reward=["toy_rewards:scheduled"],
        steps=4,
        groups_per_step=2,
        num_generations=4,
        prompts_per_batch=2,
        max_tokens=4,
        lora_rank=4,
        checkpoint_every=4,
        tensorboard=False,
    )
    assert cfg.scoring_mode == "trusted"
    state, rows = run_with_a_worker(
        cfg,
        RedisQueue.from_url(redis_server.url, QueueConfig(run=run_name)),
        StoreSource(open_store(cfg.store)),
        TransformersEngine(str(tiny_model)),
        None,
        tmp_path / "cache",
    )
    assert state.step == 4
    # the learner said its rewards for the scorers to check theirs against (this one agreed)
    said = RedisQueue.from_url(redis_server.url, QueueConfig(run=run_name))
    assert said.run_rewards() == ["toy_rewards:scheduled=1.0"]
    said.close()
    progress = [r["schedule/progress"] for r in rows]
    assert progress == sorted(progress) and progress[0] == 0.0 and progress[-1] < 1.0, progress
    assert all(0 <= r["reward"] <= 1 for r in rows)


def test_a_busy_tier_gets_fuller_jobs(queue: RedisQueue, run_name: str) -> None:
    """While a job waits in RQ's queue for every worker, the dispatcher holds what it
    reads; when the queue empties, the groups held go out together, in jobs of up to
    `groups_per_job` across leases. An idle tier dispatches a lease at once."""
    from rq import Queue as RQQueue
    from rq.serializers import JSONSerializer

    from learner.scoring.dispatcher import Dispatcher
    from learner.scoring.tier import rq_queue_name

    sq = ScoringQueue.from_url(queue_url(queue), QueueConfig(run=run_name))
    rq = RQQueue(rq_queue_name(run_name), connection=sq.client, serializer=JSONSerializer)
    dispatcher = Dispatcher(
        sq, rq, "d", str, job_timeout_s=10, retries=0, retry_backoff_s=0, groups_per_job=5, sweep_s=60
    )
    dispatcher.start()
    try:
        submit_unscored(queue, [factories.trusted(factories.batch(0, prompts=2))])
        deadline = time.monotonic() + 10
        while rq.count < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        (first,) = rq.jobs  # idle: the lease's two groups at once, as one job
        assert first.args and len(first.args) == 2
        # the job waits (no worker runs here): three leases of two more come in, and are held
        submit_unscored(queue, [factories.trusted(factories.batch(i, prompts=2)) for i in (1, 2, 3)])
        time.sleep(0.6)
        assert rq.count == 1 and sq.stats().unscored.pending == 6  # read, held, not yet jobs
        first.delete()  # a worker took it
        while rq.count < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)
        assert sorted(len(j.args) for j in rq.jobs) == [1, 5]  # six groups of three leases, in jobs of up to 5
        assert {b for j in rq.jobs for b in j.meta["batches"]} == {"batch-1", "batch-2", "batch-3"}
        assert sq.stats().unscored.pending == 0
    finally:
        dispatcher.stopping.set()
        dispatcher.join(5)
        sq.close()


def test_a_dispatcher_whose_rq_redis_goes_away_says_so_in_a_line_and_keeps_going(
    queue: RedisQueue, caplog: pytest.LogCaptureFixture
) -> None:
    """RQ's own calls (the sweep's worker count, an enqueue) raise redis-py's errors, not the
    queue's: the dispatcher takes them as the outage they are — a warning, a backoff, no
    traceback (the embedded run's scorer logged one when its Redis ended first)."""
    import logging
    import socket

    from rq import Queue as RQQueue
    from rq.serializers import JSONSerializer

    from learner.scoring.dispatcher import Dispatcher

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sq = ScoringQueue.from_url(queue_url(queue), queue.config)
    rq = RQQueue("gone", connection=redis.Redis(port=port, socket_connect_timeout=1), serializer=JSONSerializer)
    dispatcher = Dispatcher(sq, rq, "d", lambda ids: "", job_timeout_s=1.0, retries=0, retry_backoff_s=0.1, sweep_s=0.1)
    with caplog.at_level(logging.INFO, logger="learner.scoring.dispatcher"):
        dispatcher.start()
        deadline = time.monotonic() + 10
        while "redis unavailable" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
        dispatcher.stopping.set()
        dispatcher.join(5)
    sq.close()
    assert not dispatcher.is_alive()
    assert "redis unavailable" in caplog.text
    assert "Traceback" not in caplog.text and not [r for r in caplog.records if r.exc_info]
