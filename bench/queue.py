"""Rollout-group throughput and latency through the Redis transport, next to raw redis-py.

Starts its own redis-server on a free loopback port (never the machine's 6379), then for
groups of 8 completions x 512 tokens (about 32 KB encoded) measures, in one process:

- raw:       redis-py XADD of the same bytes, then XREADGROUP + XACK (the floor)
- transport: RedisQueue.submit (encode + validate, then one MULTI/EXEC: the lease's checks
             and dedup in Lua, the message in a plain XADD, the lease finished),
             then read_rollouts (decode + validate; the read's groups' arrays in one
             pass) + ack_rollouts (XACK and XDEL of those entries in one MULTI/EXEC)

Each round runs both side by side, one operation of each in turn (this machine's speed
drifts within seconds: two phases one after the other measured read ratios of 0.28 and
0.50 for the same code); the figures are the rounds' medians, and the ratios the median of
each round's ratio.

Usage: python bench/queue.py [--groups 2000] [--read-batch 16] [--rounds 5] [--appendfsync always]
"""

from __future__ import annotations

import os
import sys

# This file is named queue.py: run as a script, its folder would shadow the standard
# library's `queue` module that redis-py imports.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)

import argparse
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import redis

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
from protocol.trusted import RedisQueue


def make_group(batch_id: str, completions: int = 8, tokens: int = 512) -> RolloutGroup:
    rng = np.random.default_rng(0)
    return RolloutGroup(
        group_id=group_id_for(batch_id, "p0"),
        batch_id=batch_id,
        prompt_id="p0",
        adapter_version=3,
        actor_id="bench",
        prompt_token_ids=pack_i32(rng.integers(0, 32000, 64)),
        completions=[
            Completion.of(
                rng.integers(0, 32000, tokens),
                -rng.random(tokens, dtype=np.float32),
                finish_reason="length",
                reward=float(k % 2),
            )
            for k in range(completions)
        ],
    )


def figures(n: int, write_s: float, read_s: float, latencies_s: list[float]) -> dict[str, float]:
    lat_ms = np.array(latencies_s) * 1000
    return {
        "write_per_s": n / write_s,
        "read_per_s": n / read_s,
        "total_per_s": n / (write_s + read_s),
        "p50_ms": float(np.percentile(lat_ms, 50)),
        "p99_ms": float(np.percentile(lat_ms, 99)),
    }


def start_redis(prefix: Sequence[str] = ()) -> tuple[subprocess.Popen[bytes], int]:
    """A private redis-server on a free loopback port, answering when this returns;
    `prefix` goes before its command line (`taskset -c 0`)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    binary = shutil.which("redis-server")
    if binary is None:
        sys.exit("redis-server not found")
    proc = subprocess.Popen(
        [
            *prefix,
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            tempfile.mkdtemp(),
        ],
        stdout=subprocess.DEVNULL,
    )
    client = redis.Redis(port=port)
    for _ in range(500):
        try:
            client.ping()
            break
        except redis.exceptions.ConnectionError:
            time.sleep(0.01)
    client.close()
    return proc, port


def proxy_credentials(work: Path, actor_workers: int | None = None) -> tuple[Path, Path, Path, dict[str, str]]:
    """What `proxy serve` needs on loopback, written under `work`: a self-signed certificate
    and key (`proxy selfsigned`), and a tokens file with a fresh secret for each role (the
    actor token sized for `actor_workers` workers, if given). Returns (cert, key, tokens
    file, secrets by role)."""
    tls = work / "tls"
    subprocess.run(
        [sys.executable, "-m", "proxy.cli", "selfsigned", "--cert", str(tls / "cert.pem"), "--key",
         str(tls / "key.pem"), "--host", "127.0.0.1"],
        check=True, cwd=Path(__file__).resolve().parents[1], stdout=subprocess.DEVNULL,
    )  # fmt: skip
    secrets = {role: f"{role}-bench-{os.urandom(12).hex()}" for role in ("actor", "learner", "admin")}
    tokens = work / "tokens.toml"
    sized = {"actor": f"workers = {actor_workers}\n" if actor_workers else ""}
    tokens.write_text(
        "".join(
            f'[[tokens]]\nname = "{r}"\nrole = "{r}"\nsecret = "{s}"\n{sized.get(r, "")}' for r, s in secrets.items()
        )
    )
    return tls / "cert.pem", tls / "key.pem", tokens, secrets


def start_proxy(
    work: Path, redis_url: str, store: str, run: str, prefix: Sequence[str] = (), env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[bytes], str, dict[str, str]]:
    """`proxy serve` over TLS on a free loopback port (a self-signed certificate and role
    tokens written under `work`), answering when this returns: (process, URL, the
    environment a worker needs: SPOTGRPO_TOKEN and SPOTGRPO_CA_CERT). Workers reach a run
    only through a proxy."""
    from protocol.client.transport import wait_for_proxy

    repo = Path(__file__).resolve().parents[1]
    cert, key, tokens, secrets = proxy_credentials(work)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"https://127.0.0.1:{port}"
    with (work / "proxy.log").open("ab") as log:
        proc = subprocess.Popen(
            [
                *prefix,
                sys.executable,
                "-m",
                "proxy.cli",
                "serve",
                "--redis",
                redis_url,
                "--store",
                store,
                "--run",
                run,
                "--tokens",
                str(tokens),
                "--port",
                str(port),
                "--tls-cert",
                str(cert),
                "--tls-key",
                str(key),
                "--log-level",
                "warning",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=repo,
            env={**(env or os.environ), "PYTHONPATH": str(repo)},
        )
    wait_for_proxy(url, str(cert), proc, timeout_s=60)
    return proc, url, {"SPOTGRPO_TOKEN": secrets["actor"], "SPOTGRPO_CA_CERT": str(cert)}


def stop(procs: Sequence[subprocess.Popen[bytes]], timeout_s: float = 30) -> None:
    """Terminate the processes still running, then wait for each (killing what outstays `timeout_s`)."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def bench_round(client: redis.Redis, payload: bytes, n: int, read_batch: int) -> dict[str, dict[str, float]]:
    """One round: raw and the transport side by side, one operation of each in turn (a raw
    XADD, then a submit; a raw read of `read_batch` and its XACK, then the transport's),
    so that the machine's speed, which drifts within seconds here, is the same for both."""
    stream = "bench:raw"
    client.delete(stream)
    client.xgroup_create(stream, "g", id="0", mkstream=True)
    q = RedisQueue(client, QueueConfig(run=f"bench-{time.time_ns()}"))
    batches = [
        PromptBatch(
            batch_id=f"b{i}",
            prompts=[Prompt(id="p0", text="x")],
            num_generations=8,
            sampling=SamplingParams(max_tokens=512),
            learner_version=0,
            issued_at=time.time(),
        )
        for i in range(n)
    ]
    for i in range(0, n, 500):
        q.add_prompts(batches[i : i + 500])
    leases = []
    while len(leases) < n:
        leases += q.claim("bench", 500)
    clock = time.perf_counter
    lat: dict[str, list[float]] = {"raw": [], "transport": []}
    for lease in leases:
        # each side's message made just before it is sent, as an actor's is (3000 groups
        # made beforehand are 100 MB: the transport's would be read cold, and raw's one
        # payload sent again and again hot)
        raw_payload = bytes(bytearray(payload))  # a copy: bytes(payload) is payload itself
        group = make_group(lease.batch.batch_id)
        s = clock()
        client.xadd(stream, {"m": raw_payload})
        m = clock()
        q.submit("bench", lease.lease_id, [group])
        e = clock()
        lat["raw"].append(m - s)
        lat["transport"].append(e - m)
    read = {"raw": 0.0, "transport": 0.0}
    got = 0
    while got < n:
        s = clock()
        resp = client.xreadgroup("g", "c", {stream: ">"}, count=read_batch)
        client.xack(stream, "g", *[i for _s, entries in resp for i, _f in entries])
        m = clock()
        deliveries = q.read_rollouts("learner", read_batch)
        q.ack_rollouts([d.delivery_id for d in deliveries])
        e = clock()
        read["raw"] += m - s
        read["transport"] += e - m
        got += len(deliveries)
    return {k: figures(n, sum(lat[k]), read[k], lat[k]) for k in ("raw", "transport")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=2000)
    parser.add_argument("--read-batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--appendfsync",
        choices=("off", "everysec", "always"),
        default="off",
        help="the server's append-only file: none (off), or one written with this fsync policy",
    )
    args = parser.parse_args()
    payload = encode(make_group("b0"))
    proc, port = start_redis()
    raws, transports = [], []
    try:
        client = redis.Redis(port=port)
        if args.appendfsync != "off":
            client.config_set("appendfsync", args.appendfsync)
            client.config_set("appendonly", "yes")
            while client.info("persistence")["aof_rewrite_in_progress"]:
                time.sleep(0.05)
        for _ in range(args.rounds):
            row = bench_round(client, payload, args.groups, args.read_batch)
            raws.append(row["raw"])
            transports.append(row["transport"])
            client.flushall()
    finally:
        proc.terminate()
        proc.wait()

    def median(rows: list[dict[str, float]], key: str) -> float:
        return float(np.median([r[key] for r in rows]))

    def ratio(key: str) -> float:
        return float(np.median([t[key] / r[key] for r, t in zip(raws, transports, strict=True)]))

    print(
        f"groups: {args.groups} x {len(payload) / 1024:.1f} KiB (8 completions x 512 tokens), "
        f"read batch {args.read_batch}, redis-server on loopback (append-only file: {args.appendfsync}), "
        f"one client, median of {args.rounds} rounds"
    )
    print(f"{'':12}{'submit/s':>10}{'read+ack/s':>12}{'both/s':>10}{'p50 ms':>9}{'p99 ms':>9}")
    for name, rows in (("raw XADD", raws), ("RedisQueue", transports)):
        print(
            f"{name:12}{median(rows, 'write_per_s'):>10.0f}{median(rows, 'read_per_s'):>12.0f}"
            f"{median(rows, 'total_per_s'):>10.0f}{median(rows, 'p50_ms'):>9.2f}{median(rows, 'p99_ms'):>9.2f}"
        )
    print(
        f"ratio RedisQueue/raw: submit {ratio('write_per_s'):.2f}, read {ratio('read_per_s'):.2f}, "
        f"submit+read {ratio('total_per_s'):.2f}, p50 latency x{ratio('p50_ms'):.2f}"
    )
    for key, name in (("write_per_s", "submit"), ("read_per_s", "read")):
        print(
            f"each round's {name} ratio: "
            + ", ".join(f"{t[key] / r[key]:.2f}" for r, t in zip(raws, transports, strict=True))
        )


if __name__ == "__main__":
    main()
