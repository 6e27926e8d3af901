"""Rollout-group submissions through the proxy over TLS, next to Redis direct.

A private redis-server and one `proxy serve` process (TLS, self-signed) on loopback.
Each submission carries one rollout group of about 32 KB (8 completions of 512
tokens) against a lease claimed beforehand, from 1, 8 and 64 concurrent client
threads; the same submissions go straight to Redis through `RedisQueue` in the same
run. Prints groups/s, p50/p99 latency, the proxy/direct ratio, and the CPU time each
submission cost the clients, the proxy process and redis-server (ms per group, from
/proc on Linux): steadier than groups/s on a shared 2-core machine, where the three
take turns on the cores.

Usage: python bench/proxy.py [--groups 1500] [--clients 1 8 64]
"""

from __future__ import annotations

import sys
from pathlib import Path

# run as a script, this folder would come first on the path and shadow packages
sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import os
import shutil
import socket
import ssl
import statistics
import subprocess
import tempfile
import threading
import time
import uuid

import redis

from bench.queue import start_redis, stop
from protocol import (
    Completion,
    Prompt,
    PromptBatch,
    QueueConfig,
    RolloutGroup,
    SamplingParams,
    encode,
    group_id_for,
    pack_i32,
)
from protocol.client.http_queue import HttpQueue
from protocol.client.transport import wait_for_proxy
from protocol.trusted import RedisQueue
from proxy.tls import write_self_signed

TOKENS = {"actor": "a" * 40, "learner": "l" * 40}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_group(batch: PromptBatch, worker: str) -> RolloutGroup:
    prompt = batch.prompts[0]
    completions = [Completion.of(list(range(512)), [-0.5] * 512, finish_reason="length", reward=1.0) for _ in range(8)]
    return RolloutGroup(
        group_id=group_id_for(batch.batch_id, prompt.id),
        batch_id=batch.batch_id,
        prompt_id=prompt.id,
        adapter_version=0,
        actor_id=worker,
        prompt_token_ids=prompt.token_ids,
        completions=completions,
    )


def prepare(
    queue: RedisQueue, n: int, clients: int, tag: str, prefix: str = ""
) -> list[list[tuple[str, RolloutGroup]]]:
    """n one-prompt batches, claimed beforehand, split among the clients. `prefix`: the
    proxy names a worker after its token (`actor/<worker>`), so leases it is to submit
    are claimed under that name."""
    batches = [
        PromptBatch(
            batch_id=f"{tag}-{i}",
            prompts=[Prompt(id="p", token_ids=pack_i32([1, 2, 3]))],
            num_generations=8,
            sampling=SamplingParams(max_tokens=512),
            learner_version=0,
            issued_at=time.time(),
        )
        for i in range(n)
    ]
    queue.add_prompts(batches)
    work: list[list[tuple[str, RolloutGroup]]] = [[] for _ in range(clients)]
    for c in range(clients):
        share = n // clients + (1 if c < n % clients else 0)
        for lease in queue.claim(f"{prefix}{tag}-w{c}", share) if share else []:
            work[c].append((lease.lease_id, make_group(lease.batch, f"{tag}-w{c}")))
    return work


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (Linux; NaN elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(make_queue, work: list[list[tuple[str, RolloutGroup]]], tag: str) -> tuple[float, list[float]]:
    latencies: list[float] = []
    lock = threading.Lock()
    barrier = threading.Barrier(len(work) + 1)

    def client(c: int) -> None:
        q = make_queue()
        mine = []
        barrier.wait()
        for lease_id, group in work[c]:
            t = time.perf_counter()
            q.submit(f"{tag}-w{c}", lease_id, [group])
            mine.append(time.perf_counter() - t)
        with lock:
            latencies.extend(mine)
        q.close()

    threads = [threading.Thread(target=client, args=(c,)) for c in range(len(work))]
    for t in threads:
        t.start()
    barrier.wait()
    started = time.perf_counter()
    for t in threads:
        t.join()
    return len(latencies) / (time.perf_counter() - started), latencies


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] * 1000 if len(values) > 1 else values[0] * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=1500)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 64])
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp())
    redis_proc, redis_port = start_redis()
    proxy_port = free_port()
    write_self_signed(tmp / "cert.pem", tmp / "key.pem", ["127.0.0.1"])
    (tmp / "tokens.toml").write_text(
        "".join(f'[[tokens]]\nname = "{r}"\nrole = "{r}"\nsecret = "{s}"\n' for r, s in TOKENS.items())
    )
    run_name = f"bench-{uuid.uuid4().hex[:6]}"
    redis_url = f"redis://127.0.0.1:{redis_port}/0"
    proxy_proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "proxy.cli",
            "serve",
            "--redis",
            redis_url,
            "--store",
            (tmp / "store").as_uri(),
            "--run",
            run_name,
            "--tokens",
            str(tmp / "tokens.toml"),
            "--port",
            str(proxy_port),
            "--tls-cert",
            str(tmp / "cert.pem"),
            "--tls-key",
            str(tmp / "key.pem"),
            "--rate-per-s",
            "1000000",
            "--max-long-poll-s",
            "1",
            "--log-level",
            "warning",
        ],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    url = f"https://127.0.0.1:{proxy_port}"
    ctx = ssl.create_default_context(cafile=str(tmp / "cert.pem"))
    try:
        wait_for_proxy(url, str(tmp / "cert.pem"), proxy_proc)
        config = QueueConfig(run=run_name, lease_timeout_s=600)
        setup = RedisQueue(redis.Redis(port=redis_port), config)
        sample = PromptBatch(
            batch_id="x",
            prompts=[Prompt(id="p", token_ids=pack_i32([1]))],
            num_generations=1,
            learner_version=0,
            issued_at=time.time(),
        )
        size = len(encode(make_group(sample, "w")))
        print(
            f"one proxy process (uvicorn, TLS) and one redis-server on loopback, {os.cpu_count()} cores shared with "
            f"the clients; {args.groups} submissions of one {size / 1024:.0f} KB group each per row"
        )
        print(
            f"{'clients':>7} {'transport':>9} {'groups/s':>9} {'p50 ms':>7} {'p99 ms':>7} {'ratio':>6}"
            f"   CPU ms per group: {'clients':>7} {'proxy':>6} {'redis':>6}"
        )
        for clients in args.clients:
            rows = {}
            for transport in ("direct", "proxy"):
                tag = f"{transport}{clients}"
                work = prepare(setup, args.groups, clients, tag, prefix="" if transport == "direct" else "actor/")
                if transport == "direct":

                    def make_queue():
                        return RedisQueue(redis.Redis(port=redis_port), config)
                else:

                    def make_queue():
                        return HttpQueue(url, TOKENS["actor"], config, verify=ctx)

                before = (time.process_time(), cpu_s(proxy_proc.pid), cpu_s(redis_proc.pid))
                rate, lat = run(make_queue, work, tag)
                after = (time.process_time(), cpu_s(proxy_proc.pid), cpu_s(redis_proc.pid))
                cpu = [(b - a) * 1000 / len(lat) for a, b in zip(before, after, strict=True)]
                if transport == "direct":
                    cpu[1] = 0.0  # the proxy's own background (event hub, backlog) is not the row's
                rows[transport] = rate
                ratio = f"{rate / rows['direct']:.2f}" if transport == "proxy" else ""
                print(
                    f"{clients:>7} {transport:>9} {rate:>9.0f} {pct(lat, 50):>7.2f} {pct(lat, 99):>7.2f} {ratio:>6}"
                    f"   {'':>17} {cpu[0]:>7.2f} {cpu[1]:>6.2f} {cpu[2]:>6.2f}"
                )
                while setup.read_rollouts("bench-learner", 1000):  # keep the stream from growing
                    pass
        setup.close()
    finally:
        stop([proxy_proc])  # first: its event reader would log Redis going away
        stop([redis_proc])
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
