"""Actors that fill their engine: many leases in flight, groups streamed as they finish,
rewards scored (and killed) beside the engine, spot safety with leases in flight. On a
real Redis with the transformers engine (the vLLM engine's share is in test_vllm_engine)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
import psutil
import pytest
from servers import ProxyProcess, free_port_pair, kill_process, through_proxy

from actors.hf_engine import TransformersEngine
from actors.rewards import ScoringPool
from actors.watcher import AdapterWatcher
from actors.worker import Worker
from protocol import (
    LeaseLost,
    Prompt,
    PromptBatch,
    QueueConfig,
    RolloutGroup,
    SamplingParams,
    SubmitResult,
    pack_i32,
)
from protocol.trusted import RedisQueue, open_store
from protocol.trusted.store import StoreSource

REPO = Path(__file__).resolve().parents[1]
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14, 5]]


def _batch(batch_id: str, n: int = 4, max_tokens: int = 6, prompts: Sequence[Sequence[int]] = PROMPTS) -> PromptBatch:
    return PromptBatch(
        batch_id=batch_id,
        prompts=[Prompt(id=f"p{i}", token_ids=pack_i32(p), text=f"prompt {i}") for i, p in enumerate(prompts)],
        num_generations=n,
        sampling=SamplingParams(max_tokens=max_tokens),
        learner_version=0,
        issued_at=time.time(),
    )


class RecordingQueue(RedisQueue):
    """The real Redis queue, noting each submission and the leases held at that moment."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.submits: list[tuple[str, int, SubmitResult]] = []
        self.held: list[int] = []

    def submit(self, worker: str, lease_id: str, groups: Sequence[RolloutGroup]) -> SubmitResult:
        self.held.append(self.stats().leases_by_worker.get(worker, 0))
        result = super().submit(worker, lease_id, groups)
        self.submits.append((lease_id, len(groups), result))
        return result


@pytest.mark.redis
def test_many_leases_in_flight_and_groups_streamed_as_they_finish(
    tmp_path: Path, tiny_model: Path, redis_server, run_name: str
) -> None:
    config = QueueConfig(run=run_name)
    queue = RecordingQueue(RedisQueue.from_url(redis_server.url, config)._r, config)
    queue.add_prompts([_batch(f"b{i}") for i in range(6)])
    engine = TransformersEngine(str(tiny_model), max_batch_sequences=4)  # one group per generate call
    watcher = AdapterWatcher(queue, StoreSource(open_store(tmp_path.as_uri())), engine, tmp_path / "cache")
    from protocol.usercode.rewards import Scorer, load_reward

    worker = Worker(
        queue,
        engine,
        watcher,
        Scorer([load_reward("toy_rewards:digit_first")]),
        "w",
        claim_block_s=0.2,
        max_num_seqs=3 * len(PROMPTS) * 4,
    )  # room for three leases
    assert worker.work(max_batches=6) == 0
    assert max(queue.held) == 3, queue.held  # three leases in flight at once, never more
    assert any(n < len(PROMPTS) for _, n, _ in queue.submits), "no group was streamed ahead of its batch"
    assert sum(1 for _, _, r in queue.submits if r.finished) == 6
    got = [d.group for d in queue.read_rollouts("learner", 100)]
    assert len(got) == 6 * len(PROMPTS) == len({g.group_id for g in got})
    assert queue.stats().prompts.length == 0
    queue.close()


def test_a_hung_reward_is_killed_and_the_pool_recovers(tmp_path: Path) -> None:
    pool = ScoringPool(["toy_rewards:hangs_when_asked"], timeout_s=1.0, workers=1)
    try:
        pid_file = tmp_path / "pid"
        started = time.monotonic()
        hung = pool.submit(
            (Prompt(id="a", text="hang", columns={"pid_file": str(pid_file)}), "hang", ["1", "x"], [[1], [2]], None)
        )
        scores = hung.result(timeout=30)
        assert scores.error is not None and "killed" in scores.error and scores.rewards == [None, None]
        assert time.monotonic() - started < 10
        pid = int(pid_file.read_text())
        deadline = time.monotonic() + 10
        while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the hung reward's process still runs"
            time.sleep(0.1)
        fine = pool.submit((Prompt(id="b", text="fine"), "fine", ["1", "x"], [[1], [2]], None)).result(timeout=60)
        assert fine.error is None and fine.rewards == [1.0, 0.0]  # a fresh process took over
    finally:
        pool.close()


@pytest.mark.redis
def test_a_partial_submission_racing_a_takeover_stores_each_group_once(redis_server, run_name: str) -> None:
    from factories import batch, groups

    q = RedisQueue.from_url(redis_server.url, QueueConfig(run=run_name, lease_timeout_s=0.3))
    q.add_prompts([batch(0, prompts=4)])
    (slow,) = q.claim("slow", 1)
    gs = groups(slow.batch)
    assert not q.submit("slow", slow.lease_id, gs[:2]).finished
    time.sleep(0.4)
    (fast,) = q.claim("fast", 1)
    results: dict[str, object] = {}

    def late() -> None:
        try:
            results["slow"] = q.submit("slow", slow.lease_id, gs[2:])
        except LeaseLost as err:
            results["slow"] = err

    racer = threading.Thread(target=late)
    racer.start()
    results["fast"] = q.submit("fast", fast.lease_id, gs)
    racer.join()
    assert isinstance(results["slow"], LeaseLost) or results["slow"].duplicates == 2
    assert results["fast"].finished
    got = [d.group.group_id for d in q.read_rollouts("learner", 100)]
    assert sorted(got) == sorted(g.group_id for g in gs)
    q.close()


def _actor(tiny_model: Path, proxy: ProxyProcess, worker: str, *extra: str) -> list[str]:
    return proxy.actor_command(
        tiny_model,
        worker,
        "--reward",
        "toy_rewards:slow_digit_first",
        "--lease-timeout-s",
        "2",
        "--claim-block-s",
        "0.2",
        "--max-batch-sequences",
        "4",
        "--max-num-seqs",
        str(3 * len(PROMPTS) * 4),
        *extra,
    )


def _wait_for_leases(queue: RedisQueue, worker: str, n: int, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while queue.stats().leases_by_worker.get(through_proxy(worker), 0) < n:
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.monotonic() < deadline, "the worker never held the leases"
        time.sleep(0.05)


@pytest.mark.redis
@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM])
@pytest.mark.slow
def test_leases_in_flight_survive_sigkill_and_sigterm(
    tmp_path: Path, tiny_model: Path, redis_server, run_name: str, signum: int, make_proxy
) -> None:
    """SIGKILL: the leases expire and another worker finishes them. SIGTERM: they are
    handed back at once (the other worker needs no lease timeout). Either way every
    group is stored exactly once."""
    queue = RedisQueue.from_url(
        redis_server.url, QueueConfig(run=run_name, lease_timeout_s=600 if signum == signal.SIGTERM else 2)
    )
    queue.add_prompts([_batch(f"b{i}", max_tokens=4) for i in range(4)])
    timeout = "600" if signum == signal.SIGTERM else "2"
    proxy = make_proxy(store=tmp_path.as_uri(), extra=("--lease-timeout-s", timeout))
    victim = subprocess.Popen(
        _actor(tiny_model, proxy, "victim", "--lease-timeout-s", timeout),
        cwd=REPO,
        env=proxy.actor_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        _wait_for_leases(queue, "victim", 3, victim)
        sent = time.monotonic()
        victim.send_signal(signum)
        out, _ = victim.communicate(timeout=60)
        if signum == signal.SIGTERM:
            assert victim.returncode == 0, out[-3000:]
            assert time.monotonic() - sent < 10
            # handed back, not expired: the rescuer below gets them at once despite the 600 s lease
    finally:
        kill_process(victim)
    rescuer = subprocess.Popen(
        _actor(tiny_model, proxy, "rescuer", "--lease-timeout-s", timeout),
        cwd=REPO,
        env=proxy.actor_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 180
        while queue.stats().prompts.length:
            assert rescuer.poll() is None, rescuer.communicate()[0][-3000:]
            assert time.monotonic() < deadline, queue.stats()
            time.sleep(0.2)
    finally:
        rescuer.send_signal(signal.SIGTERM)
        rescuer.communicate(timeout=60)
        kill_process(rescuer)
    got = [d.group.group_id for d in queue.read_rollouts("learner", 100)]
    assert len(got) == 4 * len(PROMPTS) == len(set(got))
    assert queue.dead_letters() == []
    queue.close()


class DyingEngine(TransformersEngine):
    """The real engine, whose process "dies" at its second step."""

    steps = 0

    def step(self, timeout_s, abort=None):
        from actors.engine import EngineDead

        self.steps += 1
        if self.steps == 2:
            raise EngineDead("the vLLM engine died: EngineDeadError (simulated)")
        return super().step(timeout_s, abort)


@pytest.mark.redis
def test_an_engine_that_dies_hands_every_lease_back(
    tmp_path: Path, tiny_model: Path, redis_server, run_name: str
) -> None:
    from actors.worker import WorkerEngineDead
    from protocol.usercode.rewards import Scorer, load_reward

    queue = RedisQueue.from_url(redis_server.url, QueueConfig(run=run_name, lease_timeout_s=600))
    queue.add_prompts([_batch(f"b{i}") for i in range(3)])
    engine = DyingEngine(str(tiny_model), max_batch_sequences=4)
    watcher = AdapterWatcher(queue, StoreSource(open_store(tmp_path.as_uri())), engine, tmp_path / "cache")
    worker = Worker(
        queue,
        engine,
        watcher,
        Scorer([load_reward("toy_rewards:digit_first")]),
        "w",
        claim_block_s=0.2,
        max_num_seqs=3 * len(PROMPTS) * 4,
    )
    with pytest.raises(WorkerEngineDead, match="died"):
        worker.work()
    # handed back, not left to a 600 s expiry: another worker has them all at once
    assert sorted(lease.batch.batch_id for lease in queue.claim("other", 10)) == ["b0", "b1", "b2"]
    queue.close()


@pytest.mark.redis
def test_gpus_start_one_worker_per_gpu_and_pass_sigterm_on(
    tiny_model: Path, tmp_path: Path, redis_server, run_name: str, make_proxy
) -> None:
    proxy = make_proxy(store=tmp_path.as_uri(), extra=("--lease-timeout-s", "600"))
    queue = RedisQueue.from_url(redis_server.url, QueueConfig(run=run_name, lease_timeout_s=600))
    queue.add_prompts([_batch(f"b{i}", max_tokens=200) for i in range(4)])
    cmd = [
        sys.executable,
        "-m",
        "actors.cli",
        "run",
        "--queue",
        proxy.url,
        "--run",
        run_name,
        "--model",
        str(tiny_model),
        "--reward",
        "toy_rewards:slow_digit_first",
        "--worker-id",
        "box",
        "--lease-timeout-s",
        "600",
        "--claim-block-s",
        "0.2",
        "--max-num-seqs",
        "16",
        "--metrics-port",
        str(port := free_port_pair(1)),  # the second worker serves on port + 1
        "--gpus",
        "0,1",
    ]
    parent = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=proxy.actor_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: the finally kills the workers too
    )
    try:
        deadline = time.monotonic() + 120
        while set(queue.stats().leases_by_worker) != {through_proxy("box-gpu0"), through_proxy("box-gpu1")}:
            assert parent.poll() is None, parent.communicate()[0][-3000:]
            assert time.monotonic() < deadline, queue.stats()
            time.sleep(0.1)
        # each worker serves its metrics on its own port (one --metrics-port for the box)
        for p in (port, port + 1):
            assert "spotgrpo" in httpx.get(f"http://127.0.0.1:{p}/metrics", timeout=10).text
        parent.send_signal(signal.SIGTERM)
        out, _ = parent.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):  # after a failed wait: workers hold the pipe
            os.killpg(parent.pid, signal.SIGKILL)
        kill_process(parent)
    assert parent.returncode == 0, out[-3000:]
    assert len(queue.claim("other", 10)) == 4  # both handed their leases back
    queue.close()
    bad = subprocess.run(
        [*cmd[:-1], "0,x"], cwd=REPO, env=proxy.actor_env(), capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2 and "--gpus" in bad.stderr


@pytest.mark.redis
def test_prompts_sent_as_text_are_tokenized_by_the_actor(
    tmp_path: Path, tiny_model: Path, redis_server, run_name: str
) -> None:
    from factories import batch

    from protocol.usercode.rewards import Scorer, load_reward

    queue = RedisQueue.from_url(redis_server.url, QueueConfig(run=run_name))
    queue.add_prompts([batch(0)])  # text only, no token ids
    engine = TransformersEngine(str(tiny_model))
    watcher = AdapterWatcher(queue, StoreSource(open_store(tmp_path.as_uri())), engine, tmp_path / "cache")
    worker = Worker(queue, engine, watcher, Scorer([load_reward("toy_rewards:digit_first")]), "w", claim_block_s=0.2)
    assert worker.work(max_batches=1) == 0
    got = {d.group.prompt_id: d.group for d in queue.read_rollouts("learner", 10)}
    for p in batch(0).prompts:
        assert got[p.id].prompt_tokens.tolist() == engine.tokenizer(p.text)["input_ids"]
    queue.close()
