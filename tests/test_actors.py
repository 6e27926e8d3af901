"""Actors: the transformers engine (log-probabilities agree with the learner's), the
adapter watcher (verifies, refuses corrupt adapters, evicts), TRL-style rewards, and
the work loop against a real Redis: hot-swap during a generation, SIGKILL of a worker
mid-batch, SIGTERM handing the lease back, a failing reward."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import pytest
import torch
import toy_rewards
from rollouts import perturbed_policy
from servers import ProxyProcess, kill_process, through_proxy

from actors.engine import Engine, EngineError
from actors.hf_engine import TransformersEngine
from actors.watcher import AdapterWatcher
from actors.worker import Worker
from learner.policy import Policy, pack_sequences
from learner.publish import Publisher, PublishJob
from protocol import (
    AdapterManifest,
    ChatTurn,
    Prompt,
    PromptBatch,
    QueueConfig,
    SamplingParams,
    pack_i32,
)
from protocol.trusted import RedisQueue, open_store
from protocol.trusted.store import Store, StoreSource
from protocol.usercode.rewards import RewardError, RewardFn, Scorer, load_reward
from protocol.wire.files import StoreError, adapter_digest, adapter_key

REPO = Path(__file__).resolve().parents[1]


def learner_policy(tiny_model: Path, seed: int) -> Policy:
    return perturbed_policy(tiny_model, seed)


def publish(store: Store, queue, policy: Policy, version: int) -> None:
    publisher = Publisher(store, queue, base_model="tiny", rank=4)
    publisher.submit(PublishJob(version, version, policy.adapter_state(), policy.adapter_config_json()))
    publisher.close()
    assert publisher.published == [version]


def learner_logps(policy: Policy, prompt: list[int], tokens: list[int], temperature: float) -> torch.Tensor:
    seqs = pack_sequences([prompt], [tokens], policy.pad_id)
    with torch.no_grad():
        logps, _ = policy.forward_logps(seqs, temperature)
    return logps[0][seqs.mask_BT[0].bool()]


def batch_of(
    prompts: list[list[int]], *, batch_id: str = "b0", n: int = 4, max_tokens: int = 8, temperature: float = 1.0
) -> PromptBatch:
    return PromptBatch(
        batch_id=batch_id,
        prompts=[Prompt(id=f"p{i}", token_ids=pack_i32(p), text="x") for i, p in enumerate(prompts)],
        num_generations=n,
        sampling=SamplingParams(temperature=temperature, max_tokens=max_tokens),
        learner_version=0,
        issued_at=time.time(),
    )


PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14]]


# -------------------------------------------------------------------------- engine


@pytest.mark.parametrize("version", [0, 1])
def test_engine_logprobs_agree_with_the_learner(tmp_path: Path, tiny_model: Path, version: int) -> None:
    """Left-padded batch generation at temperature 0.7: mean |Δ| < 1e-3 against the
    learner's full-sequence scoring, with and without an adapter."""
    policy = learner_policy(tiny_model, seed=1)
    engine = TransformersEngine(str(tiny_model))
    if version:
        store = open_store(tmp_path.as_uri())
        publish(store, type("Q", (), {"announce": lambda self, m: "0-1"})(), policy, 1)
        folder = tmp_path / "adapters" / "v1"
        engine.load_adapter(1, folder)
    sampling = SamplingParams(temperature=0.7, max_tokens=12)
    samples = engine.generate(PROMPTS, 4, sampling, version)
    deltas = []
    with policy.reference() if version == 0 else torch.no_grad():
        for prompt, group in zip(PROMPTS, samples, strict=True):
            assert len(group) == 4
            for s in group:
                assert len(s.token_ids) == len(s.logprobs) > 0 and s.finish_reason in ("stop", "length")
                ours = learner_logps(policy, prompt, s.token_ids, 0.7)
                deltas.append((ours - torch.tensor(s.logprobs)).abs())
    delta = torch.cat(deltas)
    assert delta.numel() > 50
    assert delta.mean().item() < 1e-3, delta.mean().item()


def test_engine_refuses_unknown_versions_and_reloads(tmp_path: Path, tiny_model: Path) -> None:
    engine = TransformersEngine(str(tiny_model))
    with pytest.raises(EngineError, match="not loaded"):
        engine.generate(PROMPTS, 1, SamplingParams(max_tokens=2), 3)
    (tmp_path / "empty").mkdir()
    with pytest.raises(EngineError, match="cannot load adapter v3"):
        engine.load_adapter(3, tmp_path / "empty")
    assert engine.loaded_versions() == []


def test_a_completion_is_capped_at_what_the_context_leaves(tmp_path: Path) -> None:
    """A model whose context is 24 tokens, a prompt of 15 and max_tokens 256: the engine asks
    for 9 and tags them truncated (`length`), where the learner would have rejected them."""
    from learner.tiny import save_tiny

    model = save_tiny(tmp_path / "short", max_positions=24)
    engine = TransformersEngine(str(model))
    assert engine.context == 24
    prompt = engine.tokenizer("0123456789012345", add_special_tokens=False)["input_ids"][:15]
    long_ask = SamplingParams(max_tokens=256, temperature=1.0, seed=3)
    engine.stop_ids = (-1,)  # never stop early: the cap is what ends these
    (group,) = engine.generate([prompt], 3, long_ask, 0)
    assert [len(s.token_ids) for s in group] == [9, 9, 9]
    assert {s.finish_reason for s in group} == {"length"}
    with pytest.raises(EngineError, match="leaves no room"):
        engine.generate([prompt * 2], 1, long_ask, 0)


def test_completions_end_on_the_chat_templates_end_of_turn(tmp_path: Path) -> None:
    """EOS is `</s>`, but the template closes a turn with `<|eot|>` and generation_config
    lists one more id: each of them ends a completion, and the engine stops on them."""
    from transformers import GenerationConfig

    from actors.engine import stop_token_ids
    from learner.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|eot|>"]})
    tokenizer.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}<|eot|>{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    eot = tokenizer.convert_tokens_to_ids("<|eot|>")
    assert stop_token_ids(tokenizer, GenerationConfig(eos_token_id=[2, 7])) == (2, 7, eot)
    tokenizer.chat_template = None
    assert stop_token_ids(tokenizer, None) == (2,)
    tokenizer.chat_template = "{{ raise_exception('needs a system turn') }}"
    assert stop_token_ids(tokenizer, None) == (2,)


def test_the_engine_stops_at_any_stop_token(tmp_path: Path, tiny_model: Path) -> None:
    engine = TransformersEngine(str(tiny_model))
    prompt = engine.tokenizer("123", add_special_tokens=True)["input_ids"]
    free = engine.generate([prompt], 8, SamplingParams(max_tokens=12, temperature=1.0, seed=5), 0)[0]
    common = max({t for s in free for t in s.token_ids}, key=lambda t: sum(t in s.token_ids for s in free))
    engine.stop_ids = (2, common)
    stopped = engine.generate([prompt], 8, SamplingParams(max_tokens=12, temperature=1.0, seed=5), 0)[0]
    ended = [s for s in stopped if s.finish_reason == "stop"]
    assert ended and all(s.token_ids[-1] in (2, common) and common not in s.token_ids[:-1] for s in ended)


# ---------------------------------------------------------------------- watcher


class FakeQueue:
    """Only what the watcher's install path calls (the queue has its own tests)."""

    def __init__(self) -> None:
        self.latest: AdapterManifest | None = None

    def announce(self, manifest: AdapterManifest) -> str:
        self.latest = manifest
        return "0-1"

    def latest_adapter(self) -> AdapterManifest | None:
        return self.latest


def test_watcher_refuses_a_corrupt_adapter_and_keeps_generating(tmp_path: Path, tiny_model: Path) -> None:
    store = open_store((tmp_path / "store").as_uri())
    queue = FakeQueue()
    engine = TransformersEngine(str(tiny_model))
    watcher = AdapterWatcher(queue, StoreSource(store), engine, tmp_path / "cache", keep_adapters=2)
    publish(store, queue, learner_policy(tiny_model, 1), 1)
    watcher.sync()
    assert watcher.current == 1 and engine.loaded_versions() == [1]

    publish(store, queue, learner_policy(tiny_model, 2), 2)
    weights = adapter_key(2, "adapter_model.safetensors")
    data = bytearray(store.get(weights))
    data[-1] ^= 0xFF  # one flipped bit in the uploaded weights
    store.put(weights, bytes(data))
    watcher.sync()
    assert watcher.current == 1 and "sha256" in watcher.refused[2]
    assert engine.loaded_versions() == [1] and not (tmp_path / "cache" / "v2").exists()
    assert engine.generate(PROMPTS[:1], 2, SamplingParams(max_tokens=3), watcher.current)  # still serving v1

    publish(store, queue, learner_policy(tiny_model, 3), 3)
    store.delete([adapter_key(3, "adapter_config.json")])
    watcher.sync()
    assert "StoreMissing" in watcher.refused[3] and watcher.current == 1

    for v in (4, 5):
        publish(store, queue, learner_policy(tiny_model, v), v)
        watcher.sync()
    assert watcher.current == 5 and engine.loaded_versions() == [4, 5]  # v1 evicted
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["v4", "v5"]

    # a download the store or the network failed is no verdict on the adapter: tried again
    class Flaky(StoreSource):
        failures = 1

        def fetch(self, manifest, name):
            if self.failures:
                self.failures -= 1
                raise StoreError(f"adapter v{manifest.version}/{name}: read timed out")
            return super().fetch(manifest, name)

    watcher.source = Flaky(store)
    publish(store, queue, learner_policy(tiny_model, 6), 6)
    watcher.sync()
    assert watcher.current == 5 and 6 not in watcher.refused and watcher.retry_soon
    assert not (tmp_path / "cache" / "v6").exists()
    watcher.sync()
    assert watcher.current == 6


# ---------------------------------------------------------------------- rewards


def test_reward_specs() -> None:
    assert load_reward("toy_rewards:digit_first=0.5").weight == 0.5
    for bad, msg in [
        ("nodots", "expected module:function"),
        ("no_such_module_x:f", "cannot import"),
        ("toy_rewards:missing", "no function"),
        ("toy_rewards:digit_first=nan", "expected"),
        ("toy_rewards:digit_first=1e999", "finite"),
    ]:
        with pytest.raises(RewardError, match=msg):
            load_reward(bad)


def test_scorer_follows_trl_conventions() -> None:
    prompt = Prompt(id="p", text="q", columns={"answer": "7"})
    scorer = Scorer([load_reward("toy_rewards:digit_first=2"), load_reward("toy_rewards:uses_columns")])
    s = scorer.score(prompt, "q", ["7a", "b", "12"], [[1, 2], [3], [4, 5]])
    assert s.error is None and s.rewards == [3.0, 0.0, 2.0]
    assert s.components[0] == {"digit_first": 1.0, "uses_columns": 1.0}
    # TRL's own helpers take conversational completions
    chat = Prompt(id="c", messages=[ChatTurn(role="user", content="hi")])
    trl = Scorer([load_reward("trl.rewards:think_format_reward")])
    assert trl.score(chat, "", ["<think>a</think>b", "nope"], [[1], [2]]).rewards == [1.0, 0.0]
    # abstaining: the others decide; all abstaining fails the group
    mixed = Scorer([load_reward("toy_rewards:abstains_on_odd"), load_reward("toy_rewards:digit_first")])
    assert mixed.score(prompt, "q", ["1", "x"], [[1], [1, 2]]).rewards == [1.0, 1.0]
    alone = Scorer([load_reward("toy_rewards:abstains_on_odd")])
    assert alone.score(prompt, "q", ["1", "x"], [[1], [1, 2]]).error is not None


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        (toy_rewards.broken, "raised ZeroDivisionError: the reward model is down"),
        (toy_rewards.hangs, "exceeded its time limit of 0.2s"),
        (lambda prompts, completions, **_: [1.0], "wrong length"),
        (lambda prompts, completions, **_: [float("nan")] * len(completions), "not a finite number"),
        (lambda prompts, completions, **_: ["good"] * len(completions), "not a finite number"),
    ],
)
def test_a_failing_reward_fails_the_group_never_scores_zero(fn, message: str) -> None:
    scores = Scorer([RewardFn("r", fn)], timeout_s=0.2).score(Prompt(id="p", text="q"), "q", ["a", "b"], [[1], [2]])
    assert message in scores.error
    assert scores.rewards == [None, None]


# ----------------------------------------------------------------- work loop


class GatedEngine(TransformersEngine):
    """The real engine, reporting when a generation starts and ends."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.started = threading.Event()
        self.spans: list[tuple[int, float, float]] = []

    def step(self, timeout_s, abort=None):
        version = self._queue[0].version if self._queue else None
        begin = time.monotonic()
        if version is not None:
            self.started.set()
        try:
            return super().step(timeout_s, abort)
        finally:
            if version is not None:
                self.spans.append((version, begin, time.monotonic()))


@pytest.mark.redis
@pytest.mark.slow
def test_hot_swap_during_a_generation(tmp_path: Path, tiny_model: Path, redis_server, run_name: str) -> None:
    """v2 is announced while a batch generates on v1: the samples still generating go on
    with v2 from their prefix (in-flight update), each token's log-probability its own
    version's; the group says v1 (its oldest token) and carries v2's digest too, which the
    learner's judge checks against what it published; the next batch is v2's alone."""
    from learner.judge import Bounds, judge

    make = lambda: RedisQueue.from_url(redis_server.url, QueueConfig(run=run_name))  # noqa: E731
    queue, store = make(), open_store((tmp_path / "store").as_uri())
    v1, v2 = learner_policy(tiny_model, 1), learner_policy(tiny_model, 2)
    publish(store, make(), v1, 1)
    engine = GatedEngine(str(tiny_model))
    watcher = AdapterWatcher(make(), StoreSource(store), engine, tmp_path / "cache", poll_s=0.2)
    watcher.sync()
    watcher.start()
    worker = Worker(make(), engine, watcher, Scorer([load_reward("toy_rewards:digit_first")]), "w1", claim_block_s=0.2)
    loop = threading.Thread(target=worker.work, kwargs={"max_batches": 2})
    loop.start()

    queue.add_prompts([batch_of(PROMPTS, batch_id="first", max_tokens=160, n=8)])
    assert engine.started.wait(30)
    announced_at = time.monotonic()
    publish(store, make(), v2, 2)  # announced while the first batch is generating
    deadline = time.monotonic() + 60
    while watcher.current != 2:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    queue.add_prompts([batch_of(PROMPTS, batch_id="second", max_tokens=8)])
    loop.join(timeout=120)
    watcher.close()

    first_span = engine.spans[0]
    assert first_span[0] == 1 and first_span[1] < announced_at < first_span[2], "the swap did not overlap a generation"
    groups = [d.group for d in queue.read_rollouts("t", 100)]
    assert {(g.batch_id, g.adapter_version) for g in groups} == {("first", 1), ("second", 2)}
    assert any(g.versions == [1, 2] for g in groups if g.batch_id == "first"), "no group went on with v2"
    assert all(g.versions == [2] for g in groups if g.batch_id == "second")
    published = {v: store.read_manifest(v) for v in (1, 2)}
    digest_of = {v: adapter_digest(m.files) for v, m in published.items()}.get
    bounds = Bounds("actor", 10.0, 10_000, 4096, 8, 160, 2)
    first = [g for g in groups if g.batch_id == "first"]
    assert all(
        not judge(g, bounds, 2, None, digest_of) or judge(g, bounds, 2, None, digest_of) == "dropped_flat"
        for g in first
    )
    spanning = next(g for g in first if g.versions == [1, 2])
    forged = msgspec.structs.replace(spanning, later_digests={2: digest_of(1)})
    assert judge(forged, bounds, 2, None, digest_of) == "rejected_adapter_digest"
    policies = {1: v1, 2: v2}
    wrong = []
    for g in groups:
        for c in g.completions:
            versions = torch.tensor(c.token_versions(g.adapter_version))
            ours = {v: learner_logps(p, g.prompt_tokens.tolist(), c.tokens.tolist(), 1.0) for v, p in policies.items()}
            for v in versions.unique().tolist():
                mine = versions == v
                got = torch.tensor(c.logps)[mine]
                assert (ours[v][mine] - got).abs().max() < 1e-3
                wrong.append((ours[3 - v][mine] - got).abs())
    assert torch.cat(wrong).mean() > 1e-2  # and not the other version's
    queue.close()


@pytest.mark.redis
def test_a_failing_reward_is_reported_and_the_worker_goes_on(
    tmp_path: Path, tiny_model: Path, redis_server, run_name: str
) -> None:
    queue = RedisQueue.from_url(redis_server.url, QueueConfig(run=run_name))
    engine = TransformersEngine(str(tiny_model))
    watcher = AdapterWatcher(queue, StoreSource(open_store(tmp_path.as_uri())), engine, tmp_path / "c")
    worker = Worker(queue, engine, watcher, Scorer([load_reward("toy_rewards:broken")]), "w1", claim_block_s=0.2)
    queue.add_prompts([batch_of(PROMPTS[:1], batch_id="a"), batch_of(PROMPTS[:1], batch_id="b")])
    assert worker.work(max_batches=2) == 0
    groups = [d.group for d in queue.read_rollouts("t", 10)]
    assert len(groups) == 2
    for g in groups:
        assert "ZeroDivisionError" in g.error and all(c.reward is None for c in g.completions)
    assert worker.metrics.reward_errors._value.get() == 2
    queue.close()


def _actor_cmd(tiny_model: Path, proxy: ProxyProcess, worker: str, *extra: str) -> list[str]:
    return proxy.actor_command(
        tiny_model,
        worker,
        "--reward",
        "toy_rewards:slow_digit_first",
        "--lease-timeout-s",
        "2",
        "--claim-block-s",
        "0.5",
        *extra,
    )


def _wait_for_lease(queue: RedisQueue, worker: str, proc: subprocess.Popen, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while queue.stats().leases_by_worker.get(through_proxy(worker), 0) == 0:
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.monotonic() < deadline, "the worker never claimed the batch"
        time.sleep(0.05)


@pytest.mark.redis
@pytest.mark.slow
def test_sigkill_mid_batch_another_worker_completes_it(
    tmp_path: Path, tiny_model: Path, redis_server, run_name: str, make_proxy
) -> None:
    proxy = make_proxy(store=tmp_path.as_uri(), extra=("--lease-timeout-s", "2"))
    queue = RedisQueue.from_url(redis_server.url, QueueConfig(run=run_name))
    queue.add_prompts([batch_of(PROMPTS, batch_id="only", n=4)])
    victim = subprocess.Popen(
        _actor_cmd(tiny_model, proxy, "victim"),
        cwd=REPO,
        env=proxy.actor_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        _wait_for_lease(queue, "victim", victim)
        victim.kill()  # SIGKILL while it holds the lease, mid-batch (the reward takes a second)
        victim.communicate(timeout=30)
    finally:
        kill_process(victim)
    assert queue.stats().rollouts.length == 0
    rescuer = subprocess.Popen(
        _actor_cmd(tiny_model, proxy, "rescuer"),
        cwd=REPO,
        env=proxy.actor_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while queue.stats().rollouts.length < len(PROMPTS):
            assert rescuer.poll() is None, rescuer.communicate()[0][-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.1)
        time.sleep(1.0)  # anything stored twice would show up now
        rescuer.send_signal(signal.SIGTERM)
        assert rescuer.wait(timeout=60) == 0
    finally:
        kill_process(rescuer)
    groups = [d.group for d in queue.read_rollouts("t", 100)]
    assert len(groups) == len(PROMPTS) == len({g.group_id for g in groups})
    assert {g.actor_id for g in groups} == {through_proxy("rescuer")}
    stats = queue.stats()
    assert stats.prompts.length == 0 and stats.dead_letters == 0
    queue.close()


@pytest.mark.redis
@pytest.mark.slow
def test_sigterm_hands_the_lease_back_at_once_and_exits_0(
    tmp_path: Path, tiny_model: Path, redis_server, run_name: str, make_proxy
) -> None:
    proxy = make_proxy(store=tmp_path.as_uri(), extra=("--lease-timeout-s", "600"))
    queue = RedisQueue.from_url(redis_server.url, QueueConfig(run=run_name, lease_timeout_s=600))
    queue.add_prompts([batch_of(PROMPTS, batch_id="only", n=8, max_tokens=200)])
    proc = subprocess.Popen(
        _actor_cmd(tiny_model, proxy, "spot", "--lease-timeout-s", "600", "--report-every-s", "1"),
        cwd=REPO,
        env=proxy.actor_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        _wait_for_lease(queue, "spot", proc)
        deadline = time.monotonic() + 30
        while [w.worker for w in queue.workers()] != [through_proxy("spot")]:
            assert time.monotonic() < deadline, "the worker never reported its status"
            time.sleep(0.1)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        kill_process(proc)
    assert proc.returncode == 0, out[-3000:]
    assert time.monotonic() - sent < 20
    assert "handed lease" in out
    # handed back, not expired: another worker gets it at once despite the 600 s lease
    leases = queue.claim("other", 1)
    assert [lease.batch.batch_id for lease in leases] == ["only"]
    assert queue.stats().rollouts.length == 0
    assert queue.workers() == []  # it said goodbye: not listed for the 2 minutes a status lives
    queue.close()


@pytest.mark.redis
@pytest.mark.slow
def test_an_actor_heartbeats_on_the_proxys_lease_timeout_not_its_own(
    tmp_path: Path, tiny_model: Path, redis_server, run_name: str, make_proxy
) -> None:
    """The proxy's `--lease-timeout-s` is the one that counts: an actor whose own says 600 s
    (a heartbeat every 200 s) must still keep a 2 s lease through a 4 s reward."""
    proxy = make_proxy(store=tmp_path.as_uri(), extra=("--lease-timeout-s", "2"))
    queue = RedisQueue.from_url(redis_server.url, QueueConfig(run=run_name))
    queue.add_prompts([batch_of(PROMPTS[:1], batch_id="only", n=2)])
    cmd = proxy.actor_command(tiny_model, "steady", "--reward", "toy_rewards:slow_check", "--lease-timeout-s", "600")
    proc = subprocess.Popen(cmd, cwd=REPO, env=proxy.actor_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while queue.stats().rollouts.length == 0:
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "no group came"
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=60)[0].decode()
    finally:
        kill_process(proc)
    assert "the proxy's lease timeout, 2 s, counts" in out and "a heartbeat every 0.666667 s" in out, out[-3000:]
    assert "lost" not in out.lower(), out[-3000:]
    (delivery,) = queue.read_rollouts("t", 10)
    assert delivery.group.batch_id == "only"
    stats = queue.stats()
    assert stats.prompts.length == 0 and stats.dead_letters == 0 and stats.leases_by_worker == {}
    queue.close()


def test_test_engines_subclass_the_real_interface() -> None:
    assert issubclass(GatedEngine, TransformersEngine) and issubclass(TransformersEngine, Engine)


def test_worker_metrics_are_served_for_prometheus() -> None:
    import httpx
    from servers import free_port

    from actors.metrics import WorkerMetrics

    metrics = WorkerMetrics()
    port = free_port()
    server, _ = metrics.serve(port, host="127.0.0.1")
    metrics.tokens.inc(42)
    metrics.adapter_version.set(7)
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    finally:
        server.shutdown()
        server.server_close()
    assert "spotgrpo_actor_tokens_total 42.0" in text and "spotgrpo_actor_adapter_version 7.0" in text


def test_a_version_evicted_while_in_use_can_be_taken_back(tmp_path: Path, tiny_model: Path) -> None:
    """An evaluation pinned to v1 arrives while v1's eviction waits for its queued groups:
    v1 comes back as it is (the crash this guards against: PEFT's copy deleted under a
    version the engine still listed, and every later group of it failing)."""
    from actors.engine import GroupRequest

    policy = learner_policy(tiny_model, seed=1)
    engine = TransformersEngine(str(tiny_model))
    store = open_store(tmp_path.as_uri())
    for version in (1, 2):
        publish(store, type("Q", (), {"announce": lambda self, m: "0-1"})(), policy, version)
        engine.load_adapter(version, tmp_path / "adapters" / f"v{version}")
    sampling = SamplingParams(max_tokens=2)
    engine.add([GroupRequest("a", PROMPTS[0], 2, sampling, 1)])
    released: list[int] = []
    engine.evict_adapter(1, on_released=lambda: released.append(1))
    assert engine.loaded_versions() == [2] and released == []  # deferred: "a" still queued
    engine.load_adapter(1, tmp_path / "adapters" / "v1")  # wanted again
    assert sorted(engine.loaded_versions()) == [1, 2]
    engine.add([GroupRequest("b", PROMPTS[1], 2, sampling, 1)])
    done = {}
    while len(done) < 2:
        done.update(dict(engine.step(0.1)))
    assert set(done) == {"a", "b"} and released == []  # the revived version's files stay
    engine.evict_adapter(1, on_released=lambda: released.append(1))
    engine.step(0.0)
    assert released == [1] and engine.loaded_versions() == [2]


def test_a_spot_worker_imports_no_redis_client() -> None:
    """What runs on an untrusted machine (`actors run --queue https://...`: the command,
    the work loop, the engines' interface, the watcher, rewards, the HTTPS queue) imports
    neither redis nor rq nor fakeredis: the trust boundary shows in the imports."""
    import subprocess

    code = (
        "import sys\n"
        "import actors.cli, actors.check, actors.worker, actors.watcher, actors.engine, actors.hf_engine\n"
        "import actors.rewards, actors.metrics, actors.episodes, actors.tools\n"
        "actors.cli.build_parser()\n"
        "from protocol import QueueConfig, open_queue\n"
        "q = open_queue('https://127.0.0.1:1', QueueConfig(), 'x' * 40)\n"
        "q.close()\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('redis', 'rq', 'fakeredis')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
    # and no module of the actors package imports them at all: the scoring tier lives with the
    # learner (`learner score`); `actors score` only names it
    import ast

    for path in (REPO / "actors").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            assert not any(n.split(".")[0] in ("redis", "rq", "fakeredis") for n in names), (path.name, names)


def test_the_vllm_engine_core_runs_in_process_only_on_one_core(monkeypatch: pytest.MonkeyPatch) -> None:
    """On one core vLLM's CPU build spins its two engine processes against each other; with
    more cores, or where the user said, vLLM's own default stands."""
    from actors.vllm_engine import engine_core_in_process_on_one_core

    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1})
    assert not engine_core_in_process_on_one_core() and "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {3})
    assert engine_core_in_process_on_one_core() and os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # the user's word
    assert not engine_core_in_process_on_one_core()
