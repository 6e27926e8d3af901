"""One actor token cannot hurt a run: what a hostile worker with a valid actor token
tried, each through `proxy serve` over real TLS on a real Redis. Whatever it sends, the
run keeps its data, its accounting and its availability, and a refusal is a clear 4xx
that changes nothing."""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import msgspec
import pytest
from conftest import read_all
from door import Door
from factories import batch, group, groups, trusted
from servers import TOKENS, ProxyProcess
from waiting import wait_until

from protocol import (
    SCHEMA_VERSION,
    Completion,
    LeaseLost,
    LeaseMismatch,
    QueueConfig,
    SamplingParams,
    WorkerStatus,
)
from protocol.client.http import (
    CONTENT_TYPE,
    ClaimRequest,
    ErrorResponse,
    HeartbeatRequest,
    SubmitRequest,
    SubmitResponse,
    WorkersResponse,
    decode_body,
    encode_body,
)
from protocol.client.http_queue import HttpQueue
from protocol.wire.errors import TooManyWorkers
from protocol.wire.text import is_safe, printable

pytestmark = pytest.mark.redis

REPO = Path(__file__).resolve().parents[1]
MALLORY = "mallory-secret-for-tests-0123456789-abcdef"
"""A second actor token: a worker of another fleet, or a stolen token."""
SMALL_FLEET = "small-fleet-secret-for-tests-0123456789"
"""An actor token sized for a fleet of 12 workers (`workers = 12`)."""


TOKENS_TOML = "".join(
    f'[[tokens]]\nname = "{name}"\nrole = "{role}"\nsecret = "{secret}"\n{sized}'
    for name, role, secret, sized in [
        ("fleet-a", "actor", TOKENS["actor"], ""),
        ("mallory", "actor", MALLORY, ""),
        ("fleet-small", "actor", SMALL_FLEET, "workers = 12\n"),
        ("trainer", "learner", TOKENS["learner"], ""),
        ("ops", "admin", TOKENS["admin"], ""),
    ]
)
"""Three actor tokens (one sized for 12 workers), a learner's and an admin's."""


@pytest.fixture
def proxy(redis_server, run_name: str, tls_pair, tmp_path: Path):
    """A `proxy serve` process over TLS with `TOKENS_TOML`; `proxy.extra` flags go to serve."""
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(TOKENS_TOML)
    started: list[ProxyProcess] = []

    def make(*extra: str) -> ProxyProcess:
        p = ProxyProcess(redis_server.url, (tmp_path / "store").as_uri(), run_name, tls_pair, tokens, extra=extra)
        started.append(p)
        return p.start()

    yield make
    for p in started:
        p.kill()


@pytest.fixture
def door(redis_server, run_name: str, tmp_path: Path) -> Iterator[Door]:
    """The proxy's app with `TOKENS_TOML` in this process, behind Starlette's TestClient:
    for what the door answers to a request (`tests/door.py`)."""
    with Door(redis_server.url, run_name, tmp_path / "store", TOKENS_TOML) as d:
        yield d


_OPEN: list[HttpQueue] = []


@pytest.fixture(autouse=True)
def _close_queues():
    yield
    while _OPEN:
        _OPEN.pop().close()


def _queue(p: ProxyProcess, secret: str) -> HttpQueue:
    run = p.run
    _OPEN.append(HttpQueue(p.url, secret, QueueConfig(run=run), verify=p.ca, retry_s=2))
    return _OPEN[-1]


def _raw(p: ProxyProcess, secret: str) -> httpx.Client:
    return httpx.Client(
        base_url=p.url,
        verify=p.ssl(),
        timeout=20,
        headers={"Authorization": f"Bearer {secret}", "Content-Type": CONTENT_TYPE},
    )


def _error(r: httpx.Response) -> ErrorResponse:
    assert r.headers["content-type"] == CONTENT_TYPE, r.text
    return decode_body(r.content, ErrorResponse)


def _ledger(learner: HttpQueue) -> tuple:
    s = learner.stats()
    return (s.prompts.length, s.prompts.pending, s.rollouts.length, s.dead_letters)


def test_a_reward_that_overflows_float32_is_refused_at_the_door(door: Door) -> None:
    door.queue.add_prompts([batch(0)])
    (lease,) = door.claim(TOKENS["actor"], "w")
    body = msgspec.msgpack.decode(
        encode_body(SubmitRequest(worker="w", lease_id=lease.lease_id, groups=groups(lease.batch)))
    )
    body["groups"][0]["completions"][0]["reward"] = 1e39  # finite in float64, inf in float32
    before = _ledger(door.queue)
    r = door.request(TOKENS["actor"], "POST", "/v1/leases/submit", content=msgspec.msgpack.encode(body))
    assert r.status_code == 400 and "float32" in _error(r).error
    assert _ledger(door.queue) == before
    r = door.submit(TOKENS["actor"], "w", lease.lease_id, groups(lease.batch))
    assert decode_body(r.content, SubmitResponse).result.finished  # the honest answer still goes in


def test_a_lease_never_issued_or_held_by_another_takes_nothing(proxy) -> None:
    p = proxy()
    learner, honest, mallory = _queue(p, TOKENS["learner"]), _queue(p, TOKENS["actor"]), _queue(p, MALLORY)
    learner.add_prompts([batch(0), batch(1)])
    (mine,) = honest.claim("gpu-1", 1)
    before = _ledger(learner)
    with pytest.raises(LeaseLost, match="not outstanding"):
        mallory.submit("gpu-1", "1-0", groups(batch(7)))  # a batch never issued, on an invented lease
    with pytest.raises(LeaseLost, match="another worker"):  # front-running: same worker name, other token
        mallory.submit("gpu-1", mine.lease_id, groups(mine.batch))
    assert mallory.heartbeat("gpu-1", [mine.lease_id]) == []
    assert mallory.release("gpu-1", mine.lease_id) is False
    assert _ledger(learner) == before
    (theirs,) = mallory.claim("gpu-1", 1)
    with pytest.raises(LeaseMismatch):  # its own lease, but the groups answer the honest one's batch
        mallory.submit("gpu-1", theirs.lease_id, groups(mine.batch))
    assert learner.stats().leases_by_worker == {"fleet-a/gpu-1": 1, "mallory/gpu-1": 1}
    assert honest.heartbeat("gpu-1", [mine.lease_id]) == [mine.lease_id]
    assert honest.submit("gpu-1", mine.lease_id, groups(mine.batch)).stored == 2
    stored = learner.read_rollouts("learner-0", 10)
    assert {d.group.actor_id for d in stored} == {"fleet-a/gpu-1"}  # the proxy names the submitter


def test_a_partial_submission_keeps_the_lease_until_every_prompt_has_its_group(proxy) -> None:
    p = proxy()
    learner, actor = _queue(p, TOKENS["learner"]), _queue(p, TOKENS["actor"])
    learner.add_prompts([batch(0, prompts=3)])
    (lease,) = actor.claim("w", 1)
    gs = groups(lease.batch)
    first = actor.submit("w", lease.lease_id, gs[:1])
    assert (first.finished, first.missing) == (False, 2)
    assert learner.stats().prompts.pending == 1  # still held, nothing lost
    assert len(learner.read_rollouts("learner-0", 10)) == 1
    last = actor.submit("w", lease.lease_id, gs)
    assert (last.stored, last.duplicates, last.finished) == (2, 1, True)
    assert learner.stats().prompts.length == 0


def test_groups_that_do_not_answer_their_batch_are_refused_whole(door: Door) -> None:
    door.queue.add_prompts([batch(0)])
    (lease,) = door.claim(TOKENS["actor"], "w")
    before = _ledger(door.queue)
    for bad, why in [
        ([group(lease.batch, 0), group(lease.batch, 1, completions=9)], "9 completions"),
        ([group(batch(0, prompts=5), 4)], "answers no prompt"),
        ([group(lease.batch, 0, completions=2)], "2 completions"),
    ]:
        r = door.submit(TOKENS["actor"], "w", lease.lease_id, bad)
        assert r.status_code == 422 and _error(r).code == "submission_rejected", r.text
        assert why in _error(r).error, _error(r).error
    assert _ledger(door.queue) == before


def test_stream_ids_past_64_bits_are_a_400_not_a_500(door: Door) -> None:
    huge = "99999999999999999999-0"
    actor, learner = TOKENS["actor"], TOKENS["learner"]
    heartbeat = encode_body(HeartbeatRequest(worker="w", lease_ids=[huge]))
    answers = [
        door.request(actor, "GET", "/v1/adapters/history", params={"after": huge}),
        door.request(actor, "GET", "/v1/adapters/events", headers={"Last-Event-ID": huge}),
        door.request(actor, "GET", "/v1/adapters/events", params={"after": "1-99999999999999999999"}),
        door.request(learner, "GET", "/v1/dead-letters", params={"after": huge}),
        door.request(actor, "POST", "/v1/leases/heartbeat", content=heartbeat),
    ]
    for r in answers:
        assert r.status_code == 400, (r.request.url, r.status_code, r.text)
        assert "id" in _error(r).error


def test_one_token_holding_many_connections_starves_nobody(proxy) -> None:
    """150 event streams and 100 long-polls from one actor token: the streams are served
    (they share one Redis reader), the long-polls past its cap get 429, and the admin,
    the learner and the other actor token keep getting answers. The long-polls block
    longer than 100 TLS handshakes take on a loaded machine, so none of the 32 admitted
    ends (freeing its place) before the other 68 are answered; the learner's prompts then
    end them."""
    p = proxy("--max-long-poll-s", "20", "--max-long-polls-per-token", "32", "--rate-per-s", "10000")
    learner, other = _queue(p, TOKENS["learner"]), _queue(p, MALLORY)

    async def flood() -> tuple[int, list[int], list[float]]:
        limits = httpx.Limits(max_connections=400, max_keepalive_connections=0)
        headers = {"Authorization": f"Bearer {TOKENS['actor']}"}
        async with httpx.AsyncClient(
            base_url=p.url, verify=p.ssl(), timeout=30, limits=limits, headers=headers
        ) as client:
            opened = asyncio.Event()
            streams_up = 0

            async def stream() -> None:
                nonlocal streams_up
                async with client.stream("GET", "/v1/adapters/events") as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith(": connected"):
                            streams_up += 1
                            if streams_up == 150:
                                opened.set()
                            await asyncio.sleep(30)

            async def long_poll() -> int:
                body = encode_body(msgspec.convert({"type": "claim", "worker": "w", "block_s": 20.0}, type=_claim()))
                r = await client.post("/v1/leases/claim", content=body, headers={"Content-Type": CONTENT_TYPE})
                return r.status_code

            tasks = [asyncio.create_task(stream()) for _ in range(150)]
            await asyncio.wait_for(opened.wait(), 60)
            polls = [asyncio.create_task(long_poll()) for _ in range(100)]
            pending = set(polls)
            deadline = time.monotonic() + 30
            while len(pending) > 32 and time.monotonic() < deadline:  # 68 refused: all 100 have arrived
                _, pending = await asyncio.wait(pending, timeout=0.1)
            latencies = []
            prompts = [batch(i) for i in range(33)]  # one for each admitted long-poll, one for the other token
            for call in (learner.stats, lambda: learner.add_prompts(prompts), lambda: other.claim("m", 1)):
                started = time.monotonic()
                await asyncio.to_thread(call)
                latencies.append(time.monotonic() - started)
            with httpx.Client(base_url=p.url, verify=p.ssl(), timeout=10) as admin:
                started = time.monotonic()
                r = await asyncio.to_thread(
                    admin.get, "/v1/stats", headers={"Authorization": f"Bearer {TOKENS['admin']}"}
                )
                latencies.append(time.monotonic() - started)
                admin_status = r.status_code
            codes = await asyncio.gather(*polls)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            return admin_status, codes, latencies

    admin_status, codes, latencies = asyncio.run(flood())
    assert admin_status == 200
    assert max(latencies) < 5.0, latencies
    assert codes.count(429) == 100 - 32 and codes.count(200) == 32, sorted(codes)
    with httpx.Client(base_url=p.url, verify=p.ssl(), timeout=10) as c:  # and the holds were all given back
        assert c.get("/healthz").status_code == 200


def _claim():
    from protocol.client.http import ClaimRequest

    return ClaimRequest


def test_a_fleet_token_holds_what_its_workers_need_and_no_more(proxy) -> None:
    """`workers = 12` in the tokens file: that token's event streams, live workers (twice
    the fleet, for churn) and requests/s are sized for 12 workers (5 requests/s each),
    whatever the per-token flags allow the others; the other tokens keep the flags' caps."""
    p = proxy("--max-streams-per-token", "256", "--max-workers-per-token", "256", "--rate-per-s", "10000")

    async def streams(secret: str, n: int) -> list[int]:
        limits = httpx.Limits(max_connections=n + 5, max_keepalive_connections=0)
        async with httpx.AsyncClient(
            base_url=p.url, verify=p.ssl(), timeout=30, limits=limits, headers={"Authorization": f"Bearer {secret}"}
        ) as client:
            codes: list[int] = []
            all_open = asyncio.Event()

            async def stream() -> None:
                async with client.stream("GET", "/v1/adapters/events") as r:
                    codes.append(r.status_code)
                    if len(codes) == n:
                        all_open.set()
                    if r.status_code == 200:
                        await asyncio.sleep(30)

            tasks = [asyncio.create_task(stream()) for _ in range(n)]
            await asyncio.wait_for(all_open.wait(), 60)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            return codes

    small = asyncio.run(streams(SMALL_FLEET, 15))
    assert small.count(200) == 12 and small.count(429) == 3, small
    assert asyncio.run(streams(TOKENS["actor"], 15)).count(200) == 15

    fleet = _queue(p, SMALL_FLEET)
    reported = 0
    for i in range(30):  # twice the fleet: its departed workers' statuses stay live for 2 minutes
        try:
            fleet.report_status(WorkerStatus(worker=f"gpu-{i}", reported_at=time.time()))
            reported += 1
        except TooManyWorkers:
            pass
    assert reported == 24

    def refused(secret: str) -> int:
        with _raw(p, secret) as client:
            return sum(client.get("/v1/whoami").status_code == 429 for _ in range(400))

    assert refused(SMALL_FLEET) > 100  # 60 requests/s (burst 120) against 400 at once
    assert refused(TOKENS["actor"]) == 0


def test_a_connection_that_never_finishes_its_headers_is_closed(proxy) -> None:
    p = proxy("--header-timeout-s", "1")
    context = ssl.create_default_context(cafile=p.ca)
    for first_bytes in (b"", b"GET /healthz HTTP/1.1\r\nHost: x\r\n"):
        with (
            socket.create_connection(("127.0.0.1", p.port), timeout=10) as raw,
            context.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
        ):
            tls.sendall(first_bytes)
            started = time.monotonic()
            assert tls.recv(1024) == b""  # closed by the proxy, not by our timeout
            assert 0.5 < time.monotonic() - started < 5
    with httpx.Client(base_url=p.url, verify=p.ssl()) as c:  # a normal client is not affected
        assert c.get("/healthz").status_code == 200


def test_malformed_worker_names_are_a_400(door: Door) -> None:
    for worker in ("x" * 250, "a b", ""):
        r = door.request(TOKENS["actor"], "POST", "/v1/leases/claim", content=encode_body(ClaimRequest(worker=worker)))
        assert r.status_code == 400 and "worker" in _error(r).error, (worker, r.status_code, r.text)


def test_two_proxies_share_one_rate_budget_per_token(proxy) -> None:
    """The rate is counted in the run's Redis: a token spreading its requests over two
    proxies gets the budget of one (10 requests per 2 s at --rate-per-s 5), not twice it."""
    a, b = proxy("--rate-per-s", "5"), proxy("--rate-per-s", "5")
    codes = []
    with _raw(a, TOKENS["admin"]) as ca, _raw(b, TOKENS["admin"]) as cb:
        for i in range(14):
            codes.append((ca if i % 2 else cb).get("/v1/stats").status_code)
    # counted per process, each proxy would have let its 7 through; the sliding window may
    # weigh a request of the window before, hence a margin of one
    assert 10 <= codes.count(200) <= 11 and codes.count(429) == 14 - codes.count(200), codes


def test_proxies_take_a_tokens_budget_in_slices_and_never_exceed_it(redis_server) -> None:
    """At 200 requests/s (a slice is 10), two proxies' limiters on one Redis let a burst of
    300 of one token's requests through no more than its 200, and lose at most a slice
    each to what they reserved and did not spend; Redis is asked once per slice, not per
    request, and the refused cost it nothing for a while; another token has its own budget."""
    from proxy.fairness import SharedRateLimit

    async def burst() -> tuple[list[float], int, float]:
        prefix = f"test-{uuid.uuid4().hex[:8]}"
        a, b = (SharedRateLimit("async+" + redis_server.url, 200, 200, prefix=prefix) for _ in range(2))
        calls = 0
        for limiter in (a, b):
            hit = limiter.limiter.hit

            async def counted(*args, _hit=hit, **kwargs):
                nonlocal calls
                calls += 1
                return await _hit(*args, **kwargs)

            limiter.limiter.hit = counted  # type: ignore[method-assign]
        waits = await asyncio.gather(*[(a if i % 2 else b).retry_after("fleet-a") for i in range(300)])
        other = await a.retry_after("fleet-b")
        await a.aclose()
        await b.aclose()
        return list(waits), calls, other

    waits, calls, other = asyncio.run(burst())
    admitted = waits.count(0.0)
    assert 200 - 2 * 10 <= admitted <= 200, admitted
    assert all(w > 0 for w in waits if w != 0.0)  # the refused are told how long to wait
    assert calls <= 200 // 10 + 2 * 3, calls  # the slices, then a few single hits and refusals per proxy
    assert other == 0.0


# ------------------------------------------------------------- round three (issue 22)


def _saying(b, i: int, ids: list[int], text: str):
    """Prompt i's group whose every completion has these token ids and claims this text."""
    g = group(b, i)
    return msgspec.structs.replace(
        g,
        completions=[
            Completion.of(ids, [-0.5] * len(ids), finish_reason="stop", text=text, reward=1.0) for _ in g.completions
        ],
    )


def test_the_tier_scores_the_token_ids_not_the_text_an_actor_sends(proxy, scorers, tiny_model: Path) -> None:
    from transformers import AutoTokenizer

    p = proxy()
    learner, actor = _queue(p, TOKENS["learner"]), _queue(p, MALLORY)
    learner.add_prompts([trusted(batch(0, prompts=2))])
    (lease,) = actor.claim("w", 1)
    tok = AutoTokenizer.from_pretrained(tiny_model)
    zz, one = tok.encode("zz", add_special_tokens=False), tok.encode("1", add_special_tokens=False)
    # the right answer as text on wrong tokens, and the right tokens with a wrong text
    assert actor.submit(
        "w", lease.lease_id, [_saying(lease.batch, 0, zz, "1"), _saying(lease.batch, 1, one, "q")]
    ).finished
    scorers(reward="toy_rewards:digit_first")
    got = {g.prompt_id: g for g in read_all(learner, 2)}
    assert got["p0"].rewards == [0.0] * 4 and {c.text for c in got["p0"].completions} == {"zz"}
    assert got["p1"].rewards == [1.0] * 4 and {c.text for c in got["p1"].completions} == {"1"}


def test_a_group_that_leaves_the_tier_no_room_is_refused_at_the_door(door: Door) -> None:
    """Just under the 16 MiB body limit, but past the message limit less the room the tier
    needs for its scores: refused with the numbers, and nothing changes."""
    door.queue.add_prompts([trusted(batch(0, prompts=1))])
    (lease,) = door.claim(MALLORY, "w")
    g = group(lease.batch, 0)
    big = msgspec.structs.replace(
        g, completions=[msgspec.structs.replace(c, text="x" * 4_185_000) for c in g.completions]
    )
    assert len(encode_body(SubmitRequest(worker="w", lease_id=lease.lease_id, groups=[big]))) < 16 * 1024 * 1024
    before = _ledger(door.queue)
    r = door.submit(MALLORY, "w", lease.lease_id, [big])
    assert r.status_code == 400 and "room the scoring tier needs" in _error(r).error, r.text[:300]
    assert _ledger(door.queue) == before and door.queue.stats().unscored.length == 0
    r = door.submit(MALLORY, "w", lease.lease_id, [g])
    assert decode_body(r.content, SubmitResponse).result.finished  # the honest group still goes in


def test_a_hanging_reward_costs_only_its_own_group(proxy, scorers, tmp_path: Path) -> None:
    """One group of a lease of eight hangs its reward: it is rejected at the per-group limit,
    not retried, and the seven others are scored meanwhile, not after it."""
    p = proxy()
    learner, actor = _queue(p, TOKENS["learner"]), _queue(p, MALLORY)
    b = trusted(batch(0, prompts=8), pid_file=str(tmp_path / "pid"))
    b = msgspec.structs.replace(b, prompts=[msgspec.structs.replace(b.prompts[0], text="hang now"), *b.prompts[1:]])
    learner.add_prompts([b])
    (lease,) = actor.claim("w", 1)
    assert actor.submit("w", lease.lease_id, groups(lease.batch)).finished
    started = time.monotonic()
    scorers("--reward-timeout-s", "3", "--retries", "2", reward="toy_rewards:hangs_when_asked")
    got = {g.prompt_id: g for g in read_all(learner, 8, timeout_s=40)}
    elapsed = time.monotonic() - started
    assert len(got) == 8 and elapsed < 20, (len(got), elapsed)  # the old way: 3 attempts of 8 x 3 s, then a split
    assert "time limit of 3s" in got["p0"].error and "not retried" in got["p0"].error
    assert all(got[f"p{i}"].rewards == [1.0] * 4 for i in range(1, 8))


def test_one_token_cannot_grow_the_fleet_view_the_learners_log_or_the_metrics(proxy, caplog) -> None:
    p = proxy("--max-workers-per-token", "20", "--rate-per-s", "10000")
    learner, mallory, honest = _queue(p, TOKENS["learner"]), _queue(p, MALLORY), _queue(p, TOKENS["actor"])
    long_error = "e" * 500

    def status(name: str, version: int = 0) -> WorkerStatus:
        return WorkerStatus(
            worker=name, engine="flood", adapter_version=version, last_error=long_error, reported_at=time.time()
        )

    refused = 0
    for i in range(60):
        try:
            mallory.report_status(status(f"gpu-{i}"))
        except TooManyWorkers:
            refused += 1
    assert refused == 40
    assert honest.leave("gpu-0") is False  # a worker of that name under another token is not its to remove
    assert mallory.leave("gpu-0") is True and mallory.leave("gpu-0") is False
    mallory.report_status(status("gpu-59"))  # the place it left is free at once, not in 2 minutes
    with pytest.raises(TooManyWorkers):
        mallory.report_status(status("gpu-58"))
    mallory.report_status(status("gpu-3", version=2))  # a worker it already has still reports
    honest.report_status(status("real-0"))  # and other tokens are not affected
    with _raw(p, TOKENS["learner"]) as client:
        r = client.get("/v1/workers", params={"limit": 5})
    listed = decode_body(r.content, WorkersResponse)
    assert listed.total == 21 and len(listed.workers) == 5
    assert learner.workers()[0].adapter_version == 0 and len(learner.workers()) == 21
    with _raw(p, TOKENS["admin"]) as client:
        text = client.get("/metrics").text
    assert text.count("spotgrpo_worker_adapter_version{") == 21 and "spotgrpo_workers_live 21.0" in text
    # the learner's view is advice: it names a few and counts the rest, once
    from learner.fleet import FleetWatch

    watch = FleetWatch()
    drops = {w.worker: 1 for w in learner.workers()}  # every one of them had a group dropped as stale
    with caplog.at_level("WARNING", logger="learner.fleet"):
        lines = watch.update(learner.workers(), latest_version=10, max_staleness=2, stale_drops=drops)
        assert watch.update(learner.workers(), latest_version=10, max_staleness=2, stale_drops=drops) == []
    assert len(lines) == 6 and "16 more worker(s)" in lines[-1] and len(caplog.records) == 6


def test_the_metrics_keep_at_most_a_hundred_worker_series(proxy) -> None:
    p = proxy("--max-workers-per-token", "150", "--rate-per-s", "10000")
    actor = _queue(p, MALLORY)
    for i in range(130):
        actor.report_status(WorkerStatus(worker=f"w{i}", reported_at=time.time()))
    with _raw(p, TOKENS["admin"]) as client:
        text = client.get("/metrics").text
    assert text.count("spotgrpo_worker_adapter_version{") == 100 and "spotgrpo_workers_live 130.0" in text


UNSAFE_SAMPLES = [
    "\x1b]0;owned\x07",
    "\r",
    "\x7f",
    "\x9b31m",
    "\u202e",
    "\u2066",
    "\u200b",
    "\u2028",
    # invisible (fourth red team, finding 13): tags, soft hyphen, grapheme joiner, selectors, fillers
    "\U000e0041\U000e0042",
    "\u00ad",
    "\u034f",
    "\ufe0f",
    "\u3164",
    "\u180e",
]


@pytest.mark.parametrize("bad", UNSAFE_SAMPLES, ids=[repr(s) for s in UNSAFE_SAMPLES])
def test_no_string_an_actor_writes_can_carry_a_control_or_reordering_character(door: Door, bad: str) -> None:
    """Worker names, the engine, the last error, reward-function names, timing keys and
    errors: a 400 naming the field, and nothing stored."""
    good = {"type": "worker_status", "schema": SCHEMA_VERSION, "worker": "w", "reported_at": time.time()}
    statuses = [{**good, "worker": f"w{bad}"}, {**good, "engine": f"vllm{bad}"}, {**good, "last_error": f"boom{bad}"}]
    for st in statuses:
        body = msgspec.msgpack.encode({"type": "report_status", "status": st})
        r = door.request(MALLORY, "POST", "/v1/workers/status", content=body)
        assert r.status_code == 400, (st, r.status_code, r.text)
    claim = {"type": "claim", "schema": SCHEMA_VERSION, "worker": f"gpu{bad}", "count": 1, "block_s": 0.0}
    r = door.request(MALLORY, "POST", "/v1/leases/claim", content=msgspec.msgpack.encode(claim))
    assert r.status_code == 400 and "worker" in _error(r).error, r.text
    door.queue.add_prompts([batch(0)])
    (lease,) = door.claim(MALLORY, "w")
    sent = msgspec.msgpack.decode(
        encode_body(SubmitRequest(worker="w", lease_id=lease.lease_id, groups=groups(lease.batch)))
    )
    for where in ("components", "timings", "completion_error", "group_error"):
        body = msgspec.msgpack.decode(msgspec.msgpack.encode(sent))
        g, c = body["groups"][0], body["groups"][0]["completions"][0]
        if where == "components":
            c["reward_components"] = {f"acc{bad}": 1.0}
        elif where == "timings":
            g["timings"] = {f"generate_s{bad}": 1.0}
        elif where == "completion_error":
            c["error"] = f"oops{bad}"
        else:
            g["error"] = f"oops{bad}"
        r = door.request(MALLORY, "POST", "/v1/leases/submit", content=msgspec.msgpack.encode(body))
        assert r.status_code == 400, (where, r.status_code, r.text)
    assert door.queue.workers() == []
    assert door.queue.stats().rollouts.length == 0
    r = door.submit(MALLORY, "w", lease.lease_id, groups(lease.batch))
    assert decode_body(r.content, SubmitResponse).result.finished  # clean text still goes in


def test_printable_escapes_what_the_wire_refuses() -> None:
    assert printable("a\x1b[31mb\r\u202ec\x9b") == "a\\x1b[31mb\\x0d\\u202ec\\x9b"
    assert printable("x" * 600, 10) == "x" * 9 + "…"
    assert is_safe(printable("".join(chr(c) for c in range(0x2100))))
    assert printable("a\U000e0041\u00adb") == "a\\U000e0041\\xadb" and is_safe(printable("\U000e0041"))


def _actors(
    p: ProxyProcess, *args: str, token: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "actors.cli", *args],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "PYTHONPATH": str(REPO), "SPOTGRPO_TOKEN": token, "SPOTGRPO_CA_CERT": p.ca, **(env or {})},
    )


def test_a_worker_checks_its_token_role_run_and_ca_before_it_loads_a_model(proxy, tmp_path: Path) -> None:
    p = proxy()
    run = p.run
    model = tmp_path / "not-a-model"  # a folder a model load fails on: the refusals must come first
    model.mkdir()
    flags = ("--queue", p.url, "--model", str(model))
    r = _actors(p, "run", *flags, token=TOKENS["learner"])
    assert r.returncode == 2 and "has role learner" in r.stderr, r.stderr[-2000:]
    r = _actors(p, "run", *flags, "--run", "another-run", token=MALLORY)
    assert r.returncode == 2 and f"the proxy serves run '{run}'" in r.stderr, r.stderr[-2000:]
    bad_ca = tmp_path / "ca.pem"
    bad_ca.write_text("not a certificate\n")
    r = _actors(p, "run", *flags, token=MALLORY, env={"SPOTGRPO_CA_CERT": str(bad_ca)})
    assert r.returncode == 2 and "not a PEM certificate" in r.stderr, r.stderr[-2000:]
    r = _actors(p, "check", *flags, "--run", "another-run", "--skip-engine", token=MALLORY)
    assert r.returncode == 1 and f"the proxy serves run '{run}'" in r.stdout + r.stderr, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    # the right token and run get as far as the model (which this folder is not)
    r = _actors(p, "run", *flags, "--run", run, token=MALLORY)
    assert r.returncode == 2 and "cannot load" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_a_proxy_started_before_its_redis_waits_for_it(make_server, tls_pair, tokens_file, tmp_path: Path) -> None:
    server = make_server()
    store = (tmp_path / "store").as_uri()
    gone = ProxyProcess(server.url, store, "waits", tls_pair, tokens_file, extra=("--startup-timeout-s", "1"))
    r = subprocess.run(gone.cmd, env=gone.env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "unreachable for 1s" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    p = ProxyProcess(server.url, store, "waits", tls_pair, tokens_file, extra=("--startup-timeout-s", "60"))
    with p.log.open("ab") as log:
        p.proc = subprocess.Popen(p.cmd, env=p.env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: "redis unreachable, retrying" in p.log.read_text(), "the proxy to wait for Redis", 30)
        assert p.proc.poll() is None, p.log.read_text()[-2000:]
        server.start()
        from protocol.client.transport import wait_for_proxy

        wait_for_proxy(p.url, p.ca, p.proc, timeout_s=30)
    finally:
        p.kill()
        server.kill()


# ------------------------------------------------------------- round four (issue 36)


def _masked(b, i: int, tokens: list[int], mask: list[int]):
    """Prompt i's group whose every completion is `tokens` under `mask`."""
    g = group(b, i)
    return msgspec.structs.replace(
        g,
        completions=[
            Completion.of(tokens, [-0.5 if m else 0.0 for m in mask], mask, finish_reason="stop") for _ in g.completions
        ],
    )


def test_a_mask_on_a_batch_without_tools_trains_nothing(proxy, scorers, tiny_model: Path) -> None:
    """Finding 1: `zzzz` marked the model's and 56 x `a` marked the environment's, under a
    reward counting `a`: the tier scored 0.933 and the learner trained the `zzzz`. Now the
    tier refuses the group, with the reason; the honest group beside it is scored."""
    from transformers import AutoTokenizer

    p = proxy()
    learner, actor = _queue(p, TOKENS["learner"]), _queue(p, MALLORY)
    learner.add_prompts([trusted(batch(0, prompts=2))])
    (lease,) = actor.claim("w", 1)
    tok = AutoTokenizer.from_pretrained(tiny_model)
    attack = tok.encode("zzzz" + "a" * 56, add_special_tokens=False)
    one = tok.encode("1", add_special_tokens=False)
    assert actor.submit(
        "w", lease.lease_id, [_masked(lease.batch, 0, attack, [1] * 4 + [0] * 56), _saying(lease.batch, 1, one, "1")]
    ).finished
    scorers(reward="toy_rewards:digit_first")
    got = {g.prompt_id: g for g in read_all(learner, 2)}
    assert got["p0"].error is not None and "carries a mask, but its batch offers no tools" in got["p0"].error
    assert got["p0"].rewards == [None] * 4
    assert got["p1"].error is None and got["p1"].rewards == [1.0] * 4


def test_calls_in_the_environments_tokens_get_no_reward(proxy, scorers, tiny_chatml_model: Path) -> None:
    """Finding 2: the winning call written in tokens marked as the environment's, after an
    `<|im_start|>assistant` also marked so, and junk as the model's tokens: the replay ran
    the call as the model's and the junk was trained with the full reward. Now the tier
    reads each model turn on its own tokens and refuses environment tokens after a turn
    that called no tool."""
    from scripted import tool_call
    from transformers import AutoTokenizer

    p = proxy()
    learner, actor = _queue(p, TOKENS["learner"]), _queue(p, MALLORY)
    b = msgspec.structs.replace(
        trusted(batch(0, prompts=1), secret=4),
        tools=["guess", "stall"],
        environment="ScoredGuess",
        max_tool_calling_iterations=4,
    )
    learner.add_prompts([b])
    (lease,) = actor.claim("w", 1)
    tok = AutoTokenizer.from_pretrained(tiny_chatml_model)
    junk = tok.encode("zq zq zq<|im_end|>", add_special_tokens=False)
    fake = tok.encode(
        "\n<|im_start|>assistant\n" + tool_call("guess", number=4) + "<|im_end|>\n", add_special_tokens=False
    )
    tokens = [*junk, *fake, *junk]
    assert actor.submit(
        "w", lease.lease_id, [_masked(lease.batch, 0, tokens, [1] * len(junk) + [0] * len(fake) + [1] * len(junk))]
    ).finished
    scorers("--environment", "toy_tools:ScoredGuess", reward="toy_rewards:found_it", model=tiny_chatml_model)
    (got,) = read_all(learner, 1)
    assert got.error is not None and "called no tool" in got.error, got.error
    assert got.rewards == [None] * 4


def _one_call_episode(tok, call: str, result: str, answer: str) -> tuple[list[int], list[int]]:
    """(tokens, mask) of an episode: a turn making `call`, its `result` as the template
    renders it, and a last turn saying `answer`."""
    return _episode(tok, [(call, result)], answer)


def _episode(tok, turns: list[tuple[str, str]], answer: str) -> tuple[list[int], list[int]]:
    """(tokens, mask) of an episode as an honest actor renders it: each (call, result) a
    turn and the result after it, then a last turn saying `answer`."""
    from protocol.usercode.chat import stop_token_ids, tool_result_ids, tool_template

    stop = stop_token_ids(tok)
    tokens: list[int] = []
    mask: list[int] = []
    for call, result in turns:
        turn = [*tok.encode(call, add_special_tokens=False), stop[0]]
        name = call.split('"name": "')[1].split('"')[0] if '"name": "' in call else "tool"
        glue = tool_result_ids(tok, tool_template(tok), [(name, result)], stop)
        tokens += [*turn, *glue]
        mask += [1] * len(turn) + [0] * len(glue)
    last = [*tok.encode(answer, add_special_tokens=False), stop[0]]
    return [*tokens, *last], [*mask, *[1] * len(last)]


def test_a_stalling_replay_holds_up_no_other_group(proxy, scorers, tiny_chatml_model: Path) -> None:
    """Finding 3: the test environment's `stall(1e5)` in one group of a job kept the job's
    honest groups waiting 120 s. Now the replay runs in a process per group with a limit
    per call: the honest groups are stored first, and the staller is rejected with its
    call's name."""
    from scripted import tool_call
    from transformers import AutoTokenizer

    p = proxy()
    learner, actor = _queue(p, TOKENS["learner"]), _queue(p, MALLORY)
    b = msgspec.structs.replace(
        trusted(batch(0, prompts=6), secret=4),
        tools=["guess", "stall"],
        environment="ScoredGuess",
        max_tool_calling_iterations=4,
    )
    learner.add_prompts([b])
    (lease,) = actor.claim("w", 1)
    tok = AutoTokenizer.from_pretrained(tiny_chatml_model)
    stall = _one_call_episode(tok, tool_call("stall", seconds=100000), "done thinking", "ok")
    honest = _one_call_episode(tok, tool_call("guess", number=4), "correct", "found it")
    assert actor.submit(
        "w", lease.lease_id, [_masked(lease.batch, i, *(stall if i == 0 else honest)) for i in range(6)]
    ).finished
    scorers(
        "--environment",
        "toy_tools:ScoredGuess",
        "--tool-timeout-s",
        "2",
        "--reward-timeout-s",
        "30",
        reward="toy_rewards:found_it",
        model=tiny_chatml_model,
    )
    got = read_all(learner, 6, timeout_s=90)
    assert [g.prompt_id for g in got][-1] == "p0", [g.prompt_id for g in got]  # the staller comes last
    assert all(g.error is None and g.rewards == [2.0] * 4 for g in got[:-1]), [(g.error, g.rewards) for g in got]
    assert "stall ran past its time limit of 2s" in (got[-1].error or ""), got[-1].error


def test_connections_that_never_say_hello_are_closed_at_the_handshake_limit(proxy) -> None:
    """Finding 5: a TLS slow-loris needs no token. 2,000 connections that never send a
    ClientHello were held for asyncio's 60 s handshake timeout (the header timer starts
    after the handshake). Now the handshake has `--handshake-timeout-s`, and honest calls
    are answered meanwhile."""
    import selectors

    p = proxy("--handshake-timeout-s", "2")
    learner = _queue(p, TOKENS["learner"])
    idle = [socket.create_connection(("127.0.0.1", p.port), timeout=10) for _ in range(2000)]
    try:
        started = time.monotonic()
        for _ in range(5):
            learner.stats()  # honest calls through the crowd
        assert time.monotonic() - started < 5
        selector = selectors.DefaultSelector()
        for s in idle:
            s.setblocking(False)
            selector.register(s, selectors.EVENT_READ)
        closed: set[socket.socket] = set()
        deadline = time.monotonic() + 20
        while len(closed) < len(idle) and time.monotonic() < deadline:
            for key, _ in selector.select(timeout=1):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                try:
                    data = sock.recv(1)
                except ConnectionResetError:
                    data = b""
                if data == b"":
                    closed.add(sock)
                    selector.unregister(sock)
        took = time.monotonic() - started
        assert len(closed) == len(idle) and took < 20, (len(closed), took)  # 60 s each before
    finally:
        for s in idle:
            s.close()
    learner.stats()


def test_bodies_in_flight_are_capped_per_token(proxy) -> None:
    """Finding 6: 64 trickled 16 MB bodies took the proxy from 399 MB to 1,113 MB. Now a
    token's bodies in flight are capped (`--max-body-bytes-per-token`): past it 429, and
    the bytes are given back when a request is answered."""
    p = proxy("--max-body-bytes-per-token", str(3 * 1024 * 1024), "--rate-per-s", "10000")
    learner, actor = _queue(p, TOKENS["learner"]), _queue(p, MALLORY)
    learner.add_prompts([batch(0)])
    (lease,) = actor.claim("w", 1)

    async def trickle() -> list[int]:
        headers = {"Authorization": f"Bearer {MALLORY}", "Content-Type": CONTENT_TYPE}
        async with httpx.AsyncClient(base_url=p.url, verify=p.ssl(), timeout=30) as client:

            async def slow_body() -> AsyncIterator[bytes]:
                for _ in range(4):  # 4 MiB a body, a MiB at a time, never finished quickly
                    yield b"\x00" * (1024 * 1024)
                    await asyncio.sleep(1.0)

            async def post() -> int:
                r = await client.post("/v1/leases/submit", content=slow_body(), headers=headers)
                return r.status_code

            return list(await asyncio.gather(*[post() for _ in range(4)]))

    codes = asyncio.run(trickle())
    assert codes.count(429) >= 3, codes  # at most one body's first megabytes fit under 3 MiB with the others'
    assert actor.submit("w", lease.lease_id, groups(lease.batch)).finished  # the budget came back


def test_a_big_submission_for_a_made_up_lease_is_decoded_off_the_event_loop(proxy) -> None:
    """Finding 7: a 14.5 MiB submission naming a lease that does not exist was decoded and
    encoded again on the event loop before the lease was checked (honest p50 3 -> 57-87 ms).
    It is refused as before, nothing changes, and honest calls are answered meanwhile."""
    p = proxy("--rate-per-s", "10000")
    learner, actor = _queue(p, TOKENS["learner"]), _queue(p, MALLORY)
    learner.add_prompts([batch(0, prompts=1)])
    (lease,) = actor.claim("w", 1)
    g = group(lease.batch, 0)
    n = 237_500
    big = msgspec.structs.replace(
        g, completions=[Completion.of([5] * n, [-0.5] * n, finish_reason="length") for _ in range(8)]
    )
    body = encode_body(SubmitRequest(worker="w", lease_id="1-0", groups=[big]))
    assert 14 * 1024 * 1024 < len(body) < 16 * 1024 * 1024
    before = _ledger(learner)
    with _raw(p, MALLORY) as client:
        r = client.post("/v1/leases/submit", content=body)
    assert r.status_code == 409 and "is not held by worker w" in _error(r).error, r.text[:300]  # read before decoding
    assert _ledger(learner) == before
    body = encode_body(SubmitRequest(worker="w", lease_id=lease.lease_id, groups=[big]))  # its own lease: decoded
    with _raw(p, MALLORY) as client:
        r = client.post("/v1/leases/submit", content=body)
    assert r.status_code == 422 and "not held" not in _error(r).error, r.text[:300]  # not the batch's shape
    assert actor.submit("w", lease.lease_id, [g]).finished


def test_the_tier_reads_each_episode_before_it_scores_it(proxy, scorers, tiny_chatml_model: Path) -> None:
    """Findings 4, 8, 9 and 10, one group each, in one lease: an alternating mask over 9,600
    tokens (7.7 s of replay before; refused at its first environment token now), eight tool
    turns against a limit of three (scored 1.0 before; refused now), an honest episode whose
    actor claims 4.6e18 turns (the run's `turns_mean` before; the tier's count now), and a
    call with a 1,100-deep argument answered as an error (a RecursionError retried three
    times before; scored now)."""
    from scripted import tool_call
    from transformers import AutoTokenizer

    p = proxy()
    learner, actor = _queue(p, TOKENS["learner"]), _queue(p, MALLORY)
    b = msgspec.structs.replace(
        trusted(batch(0, prompts=4), secret=4),
        tools=["guess", "stall"],
        environment="ScoredGuess",
        max_tool_calling_iterations=3,
        sampling=SamplingParams(max_tokens=12_000),
    )
    learner.add_prompts([b])
    (lease,) = actor.claim("w", 1)
    tok = AutoTokenizer.from_pretrained(tiny_chatml_model)
    alternating = (tok.encode("ab" * 4800, add_special_tokens=False), [1, 0] * 4800)
    eight = _episode(tok, [(tool_call("guess", number=n), "lower") for n in range(9, 1, -1)], "found it")
    honest = _episode(tok, [(tool_call("guess", number=4), "correct")], "found it")
    deep = '<tool_call>\n{"name": "guess", "arguments": {"number": ' + "[" * 1100 + "]" * 1100 + "}}\n</tool_call>"
    error = str({"error": "the tool call could not be read: a tool call needs a name and an object of arguments"})
    deep_episode = _episode(tok, [(deep, error), (tool_call("guess", number=4), "correct")], "found it")
    made = [_masked(lease.batch, i, *e) for i, e in enumerate([alternating, eight, honest, deep_episode])]
    made[2] = msgspec.structs.replace(
        made[2],
        completions=[
            msgspec.structs.replace(c, turns=4_600_000_000_000_000_000, tool_calls=10**9) for c in made[2].completions
        ],
    )
    assert actor.submit("w", lease.lease_id, made).finished
    scorers("--environment", "toy_tools:ScoredGuess", reward="toy_rewards:found_it", model=tiny_chatml_model)
    got = {g.prompt_id: g for g in read_all(learner, 4, timeout_s=90)}
    assert "tokens 1-2 after model turn 1: that turn called no tool" in (got["p0"].error or ""), got["p0"].error
    assert "past max_tool_calling_iterations=3" in (got["p1"].error or ""), got["p1"].error
    assert got["p2"].error is None and got["p2"].rewards == [2.0] * 4  # found_it and the replay: 1 + 1
    assert {(c.turns, c.tool_calls, c.tool_errors) for c in got["p2"].completions} == {(2, 1, 0)}
    assert got["p3"].error is None, got["p3"].error
    assert {(c.turns, c.tool_calls, c.tool_errors) for c in got["p3"].completions} == {(3, 2, 1)}
