"""One actor token cannot hurt a run: what a hostile worker with a valid actor token
tried, each through `proxy serve` over real TLS on a real Redis. Whatever it sends, the
run keeps its data, its accounting and its availability, and a refusal is a clear 4xx
that changes nothing."""

from __future__ import annotations

import asyncio
import socket
import ssl
import time
from pathlib import Path

import httpx
import msgspec
import pytest
from conftest import TOKENS, ProxyProcess
from factories import batch, group, groups

from protocol import (
    LeaseLost,
    LeaseMismatch,
    ProtocolError,
    QueueConfig,
    SubmissionRejected,
)
from protocol.http import CONTENT_TYPE, ErrorResponse, SubmitRequest, decode_body, encode_body
from protocol.http_queue import HttpQueue

pytestmark = pytest.mark.redis

MALLORY = "mallory-secret-for-tests-0123456789-abcdef"
"""A second actor token: a worker of another fleet, or a stolen token."""


@pytest.fixture
def proxy(redis_server, run_name: str, tls_pair, tmp_path: Path):  # type: ignore[no-untyped-def]
    """A proxy whose tokens file has two actor tokens; `proxy.extra` flags go to serve."""
    tokens = tmp_path / "tokens.toml"
    tokens.write_text("".join(
        f'[[tokens]]\nname = "{name}"\nrole = "{role}"\nsecret = "{secret}"\n'
        for name, role, secret in [
            ("fleet-a", "actor", TOKENS["actor"]), ("mallory", "actor", MALLORY),
            ("trainer", "learner", TOKENS["learner"]), ("ops", "admin", TOKENS["admin"]),
        ]
    ))
    started: list[ProxyProcess] = []

    def make(*extra: str) -> ProxyProcess:
        p = ProxyProcess(redis_server.url, (tmp_path / "store").as_uri(), run_name, tls_pair, tokens, extra=extra)
        started.append(p)
        return p.start()

    yield make
    for p in started:
        p.kill()


_OPEN: list[HttpQueue] = []


@pytest.fixture(autouse=True)
def _close_queues():  # type: ignore[no-untyped-def]
    yield
    while _OPEN:
        _OPEN.pop().close()


def _queue(p: ProxyProcess, secret: str) -> HttpQueue:
    run = p.cmd[p.cmd.index("--run") + 1]
    _OPEN.append(HttpQueue(p.url, secret, QueueConfig(run=run), verify=p.ca, retry_s=2))
    return _OPEN[-1]


def _raw(p: ProxyProcess, secret: str) -> httpx.Client:
    return httpx.Client(base_url=p.url, verify=p.ssl(), timeout=20,
                        headers={"Authorization": f"Bearer {secret}", "Content-Type": CONTENT_TYPE})


def _error(r: httpx.Response) -> ErrorResponse:
    assert r.headers["content-type"] == CONTENT_TYPE, r.text
    return decode_body(r.content, ErrorResponse)


def _ledger(learner: HttpQueue) -> tuple:
    s = learner.stats()
    return (s.prompts.length, s.prompts.pending, s.rollouts.length, s.dead_letters)


def test_a_reward_that_overflows_float32_is_refused_at_the_door(proxy) -> None:  # type: ignore[no-untyped-def]
    p = proxy()
    learner, actor = _queue(p, TOKENS["learner"]), _queue(p, TOKENS["actor"])
    learner.add_prompts([batch(0)])
    (lease,) = actor.claim("w", 1)
    body = msgspec.msgpack.decode(encode_body(SubmitRequest(worker="w", lease_id=lease.lease_id,
                                                             groups=groups(lease.batch))))
    body["groups"][0]["completions"][0]["reward"] = 1e39  # finite in float64, inf in float32
    before = _ledger(learner)
    with _raw(p, TOKENS["actor"]) as client:
        r = client.post("/v1/leases/submit", content=msgspec.msgpack.encode(body))
    assert r.status_code == 400 and "float32" in _error(r).error
    assert _ledger(learner) == before
    assert actor.submit("w", lease.lease_id, groups(lease.batch)).finished  # the honest answer still goes in


def test_a_lease_never_issued_or_held_by_another_takes_nothing(proxy) -> None:  # type: ignore[no-untyped-def]
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


def test_a_partial_submission_keeps_the_lease_until_every_prompt_has_its_group(proxy) -> None:  # type: ignore[no-untyped-def]
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


def test_groups_that_do_not_answer_their_batch_are_refused_whole(proxy) -> None:  # type: ignore[no-untyped-def]
    p = proxy()
    learner, actor = _queue(p, TOKENS["learner"]), _queue(p, TOKENS["actor"])
    learner.add_prompts([batch(0)])
    (lease,) = actor.claim("w", 1)
    before = _ledger(learner)
    for bad, why in [
        ([group(lease.batch, 0), group(lease.batch, 1, completions=9)], "9 completions"),
        ([group(batch(0, prompts=5), 4)], "answers no prompt"),
    ]:
        with pytest.raises(SubmissionRejected, match=why):
            actor.submit("w", lease.lease_id, bad)
    assert _ledger(learner) == before
    with _raw(p, TOKENS["actor"]) as client:
        r = client.post("/v1/leases/submit", content=encode_body(
            SubmitRequest(worker="w", lease_id=lease.lease_id, groups=[group(lease.batch, 0, completions=2)])))
    assert r.status_code == 422 and _error(r).code == "submission_rejected"


def test_stream_ids_past_64_bits_are_a_400_not_a_500(proxy) -> None:  # type: ignore[no-untyped-def]
    p = proxy()
    huge = "99999999999999999999-0"
    with _raw(p, TOKENS["actor"]) as actor, _raw(p, TOKENS["learner"]) as learner:
        answers = [
            actor.get("/v1/adapters/history", params={"after": huge}),
            actor.get("/v1/adapters/events", headers={"Last-Event-ID": huge}),
            actor.get("/v1/adapters/events", params={"after": "1-99999999999999999999"}),
            learner.get("/v1/dead-letters", params={"after": huge}),
            actor.post("/v1/leases/heartbeat", content=encode_body(
                msgspec.convert({"type": "heartbeat", "worker": "w", "lease_ids": [huge]}, type=_heartbeat()))),
        ]
    for r in answers:
        assert r.status_code == 400, (r.request.url, r.status_code, r.text)
        assert "id" in _error(r).error


def _heartbeat():  # type: ignore[no-untyped-def]
    from protocol.http import HeartbeatRequest

    return HeartbeatRequest


def test_one_token_holding_many_connections_starves_nobody(proxy) -> None:  # type: ignore[no-untyped-def]
    """150 event streams and 100 long-polls from one actor token: the streams are served
    (they share one Redis reader), the long-polls past its cap get 429, and the admin,
    the learner and the other actor token keep getting answers."""
    p = proxy("--max-long-poll-s", "3", "--max-long-polls-per-token", "32", "--rate-per-s", "10000")
    learner, other = _queue(p, TOKENS["learner"]), _queue(p, MALLORY)

    async def flood() -> tuple[int, list[int], list[float]]:
        limits = httpx.Limits(max_connections=400, max_keepalive_connections=0)
        headers = {"Authorization": f"Bearer {TOKENS['actor']}"}
        async with httpx.AsyncClient(base_url=p.url, verify=p.ssl(), timeout=30, limits=limits, headers=headers) as client:
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
                body = encode_body(msgspec.convert({"type": "claim", "worker": "w", "block_s": 3.0},
                                                   type=_claim()))
                r = await client.post("/v1/leases/claim", content=body, headers={"Content-Type": CONTENT_TYPE})
                return r.status_code

            tasks = [asyncio.create_task(stream()) for _ in range(150)]
            await asyncio.wait_for(opened.wait(), 60)
            polls = [asyncio.create_task(long_poll()) for _ in range(100)]
            await asyncio.sleep(0.5)
            latencies = []
            for call in (learner.stats, lambda: learner.add_prompts([batch(0)]), lambda: other.claim("m", 1)):
                started = time.monotonic()
                await asyncio.to_thread(call)
                latencies.append(time.monotonic() - started)
            with httpx.Client(base_url=p.url, verify=p.ssl(), timeout=10) as admin:
                started = time.monotonic()
                r = await asyncio.to_thread(admin.get, "/v1/stats", headers={"Authorization": f"Bearer {TOKENS['admin']}"})
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


def _claim():  # type: ignore[no-untyped-def]
    from protocol.http import ClaimRequest

    return ClaimRequest


def test_a_connection_that_never_finishes_its_headers_is_closed(proxy) -> None:  # type: ignore[no-untyped-def]
    p = proxy("--header-timeout-s", "1")
    context = ssl.create_default_context(cafile=p.ca)
    for first_bytes in (b"", b"GET /healthz HTTP/1.1\r\nHost: x\r\n"):
        with socket.create_connection(("127.0.0.1", p.port), timeout=10) as raw, \
                context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            tls.sendall(first_bytes)
            started = time.monotonic()
            assert tls.recv(1024) == b""  # closed by the proxy, not by our timeout
            assert 0.5 < time.monotonic() - started < 5
    with httpx.Client(base_url=p.url, verify=p.ssl()) as c:  # a normal client is not affected
        assert c.get("/healthz").status_code == 200


def test_malformed_worker_names_are_a_400(proxy) -> None:  # type: ignore[no-untyped-def]
    p = proxy()
    actor = _queue(p, TOKENS["actor"])
    with pytest.raises(ProtocolError, match="worker"):
        actor.claim("x" * 250, 1)


def test_two_proxies_share_one_rate_budget_per_token(proxy) -> None:  # type: ignore[no-untyped-def]
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
