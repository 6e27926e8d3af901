"""The trusted scoring tier: groups scored per second, and the latency it adds.

Starts its own redis-server on a free loopback port (never the machine's 6379). For
`--groups` groups of 8 completions, issued as trusted-scoring batches and submitted
unscored (as actors do), it measures:

- throughput: groups scored per second by 1, 2 and 4 `learner score` workers (RQ, a
  forked work horse per group) on a CPU-bound reward of about 20 ms per completion
  (`bench.rewards:busy_20ms`, 160 ms per group), from the first submission to the
  last group readable by the learner; and the same with a reward that costs nothing,
  which leaves the tier's own cost per group;
- latency from a group's submission to the learner reading it, p50 and p99, at a light
  load (one group in flight at a time), against actor-side scoring of the same reward
  (scored inline before the submission; its latency is counted from the same moment,
  the end of generation).

Usage: python bench/scoring.py [--groups 96] [--workers 1 2 4] [--latency-groups 30]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# run as a script, this folder would come first and its queue.py shadow the standard
# library's `queue` (which redis-py imports)
if sys.path and Path(sys.path[0]).resolve() == REPO / "bench":
    sys.path.pop(0)
sys.path.insert(0, str(REPO))

import msgspec

from bench.queue import start_redis, stop
from protocol import (
    Completion,
    Prompt,
    PromptBatch,
    QueueConfig,
    RolloutGroup,
    SamplingParams,
    group_id_for,
    pack_i32,
)
from protocol.trusted import RedisQueue
from protocol.usercode.rewards import Scorer, load_reward


def batch(run: str, i: int, scoring: str = "trusted") -> PromptBatch:
    return PromptBatch(
        batch_id=f"{run}-b{i}",
        prompts=[Prompt(id="p0", text=f"question {i}", columns={"answer": "4"})],
        num_generations=8,
        sampling=SamplingParams(max_tokens=16),
        learner_version=0,
        issued_at=time.time(),
        scoring=scoring,
    )


def unscored(b: PromptBatch, reward: float | None = None) -> RolloutGroup:
    return RolloutGroup(
        group_id=group_id_for(b.batch_id, "p0"),
        batch_id=b.batch_id,
        prompt_id="p0",
        adapter_version=0,
        actor_id="bench",
        prompt_token_ids=pack_i32([1, 2, 3]),
        completions=[
            Completion.of(list(range(1, 9)), [-0.5] * 8, finish_reason="stop", text=f"answer {j}", reward=reward)
            for j in range(8)
        ],
    )


def start_scorers(url: str, run: str, n: int, reward: str, logs: Path) -> list[subprocess.Popen[bytes]]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    model = logs / "model"  # the tier decodes token ids with the run's tokenizer: a tiny model's
    if not model.exists():
        from learner.tiny import save_tiny

        save_tiny(model, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2)
    return [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "learner.cli",
                "score",
                "--queue",
                url,
                "--run",
                run,
                "--reward",
                reward,
                "--model",
                str(model),
                "--name",
                f"bench-{run}-{i}",
            ],
            cwd=REPO,
            env=env,
            stdout=(logs / f"{run}-{i}.log").open("wb"),
            stderr=subprocess.STDOUT,
        )
        for i in range(n)
    ]


def submit_all(q: RedisQueue, run: str, groups: int, offset: int = 0) -> list[tuple[str, float]]:
    batches = [batch(run, offset + i) for i in range(groups)]
    q.add_prompts(batches)
    out = []
    leases = []
    while len(leases) < groups:
        leases += q.claim("bench-actor", groups - len(leases))
    for lease in leases:
        q.submit("bench-actor", lease.lease_id, [unscored(lease.batch)])
        out.append((lease.batch.batch_id, time.perf_counter()))
    return out


def drain(q: RedisQueue, n: int, consumer: str = "learner-0", timeout_s: float = 600) -> dict[str, float]:
    seen: dict[str, float] = {}
    deadline = time.monotonic() + timeout_s
    while len(seen) < n and time.monotonic() < deadline:
        for d in q.read_rollouts(consumer, 64, block_s=1.0):
            seen.setdefault(d.group.batch_id, time.perf_counter())
            q.ack_rollouts([d.delivery_id])
    if len(seen) < n:
        raise RuntimeError(f"only {len(seen)} of {n} groups were scored in {timeout_s}s")
    return seen


def throughput(url: str, workers: int, reward: str, groups: int, logs: Path) -> float:
    run = f"tp{workers}-{reward.split(':')[1]}-{time.time_ns()}"
    q = RedisQueue.from_url(url, QueueConfig(run=run))
    procs = start_scorers(url, run, workers, reward, logs)
    try:
        time.sleep(3.0)  # the workers start (imports) before the clock does
        started = time.perf_counter()
        submit_all(q, run, groups)
        seen = drain(q, groups)
        return groups / (max(seen.values()) - started)
    finally:
        stop(procs)
        q.close()


def latency_trusted(url: str, reward: str, n: int, logs: Path) -> list[float]:
    run = f"lat-{time.time_ns()}"
    q = RedisQueue.from_url(url, QueueConfig(run=run))
    procs = start_scorers(url, run, 1, reward, logs)
    try:
        time.sleep(3.0)
        out = []
        for i in range(n):
            ((batch_id, at),) = submit_all(q, run, 1, offset=i)
            out.append(drain(q, 1)[batch_id] - at)
        return out
    finally:
        stop(procs)
        q.close()


def latency_actor_side(url: str, reward: str, n: int) -> list[float]:
    run = f"lat-actor-{time.time_ns()}"
    q = RedisQueue.from_url(url, QueueConfig(run=run))
    scorer = Scorer([load_reward(reward)], timeout_s=None)
    out = []
    for i in range(n):
        b = batch(run, i, scoring="actors")
        q.add_prompts([b])
        (lease,) = q.claim("bench-actor", 1)
        generated = time.perf_counter()
        group = unscored(b)
        scores = scorer.score(
            b.prompts[0], "", [c.text for c in group.completions], [c.tokens.tolist() for c in group.completions]
        )
        group = msgspec.structs.replace(
            group,
            completions=[
                msgspec.structs.replace(c, reward=r) for c, r in zip(group.completions, scores.rewards, strict=True)
            ],
        )
        q.submit("bench-actor", lease.lease_id, [group])
        out.append(drain(q, 1)[b.batch_id] - generated)
    q.close()
    return out


def pct(values: list[float], p: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(p) - 1] if len(values) > 1 else values[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=96)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--latency-groups", type=int, default=30)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="bench-scoring-"))
    proc, port = start_redis()  # bench/queue.py's: a private redis-server on a free loopback port
    url = f"redis://127.0.0.1:{port}/0"
    try:
        print(f"groups of 8 completions; {os.cpu_count()} cores; RQ forking workers")
        for reward in ("bench.rewards:busy_20ms", "bench.rewards:free"):
            for w in args.workers:
                rate = throughput(url, w, reward, args.groups, workdir)
                print(f"  {reward.split(':')[1]:>9} reward, {w} worker(s): {rate:7.1f} groups/s")
        trusted = latency_trusted(url, "bench.rewards:busy_20ms", args.latency_groups, workdir)
        actor = latency_actor_side(url, "bench.rewards:busy_20ms", args.latency_groups)
        print(f"latency to learner-visible, busy_20ms reward, {args.latency_groups} groups one at a time:")
        print(f"  actor-side scoring: p50 {1000 * pct(actor, 50):6.1f} ms  p99 {1000 * pct(actor, 99):6.1f} ms")
        print(
            f"  trusted tier:       p50 {1000 * pct(trusted, 50):6.1f} ms  p99 {1000 * pct(trusted, 99):6.1f} ms"
            f"  (added p50 {1000 * (pct(trusted, 50) - pct(actor, 50)):+.1f} ms)"
        )
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
