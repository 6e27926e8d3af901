"""The door under the fourth red team's connection attacks: honest latency and the proxy's
memory while one attacker holds 2,000 connections that never finish a TLS handshake, or
trickles 64 bodies of 16 MB, or sends 14.5 MiB submissions that name a made-up lease.

A private redis-server and one `proxy serve` process (TLS, self-signed) on loopback, as
`bench/proxy.py` starts them. An honest client (its own token) calls `whoami` on a new connection in a loop
before and during each attack (the proxy started with a soft open-files limit of 1,024,
`--nofile`); each row prints its p50/p99 (ms), the calls that failed,
and the proxy's resident memory at the end of the phase (MB, from /proc).

Usage: python bench/door.py [--idle 2000] [--bodies 64] [--big 8] [--seconds 8]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import asyncio
import os
import resource
import socket
import statistics
import subprocess
import tempfile
import threading
import time
import uuid

import httpx

from bench.proxy import free_port
from bench.queue import start_redis, stop
from protocol import Completion, RolloutGroup, group_id_for, pack_i32
from protocol.client.http import CONTENT_TYPE, SubmitRequest, encode_body
from protocol.client.http_queue import HttpQueue
from protocol.client.transport import wait_for_proxy
from proxy.tls import write_self_signed

TOKENS = {"honest": ("actor", "h" * 40), "mallory": ("actor", "m" * 40), "trainer": ("learner", "l" * 40)}


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def honest_calls(url: str, secret: str, stop_at: float) -> tuple[list[float], int]:
    """`whoami` on a new connection each time (a worker joining), TLS handshake included."""
    latencies, failed = [], 0
    while time.monotonic() < stop_at:
        started = time.monotonic()
        queue = HttpQueue(url, secret, retry_s=0.0)
        try:
            queue.whoami()
            latencies.append((time.monotonic() - started) * 1000)
        except Exception:  # a refused or dropped honest call is what this counts
            failed += 1
        finally:
            queue.close()
        time.sleep(0.02)
    return latencies, failed


def row(name: str, latencies: list[float], failed: int, pid: int) -> None:
    q = statistics.quantiles(latencies, n=100) if len(latencies) > 1 else latencies * 99
    print(f"{name:<34} {len(latencies):>6} {q[49]:>7.1f} {q[98]:>7.1f} {failed:>6} {rss_mb(pid):>8.0f}", flush=True)


def idle_connections(port: int, n: int, hold_s: float) -> None:
    socks = []
    for _ in range(n):
        try:
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        except OSError:
            break
    time.sleep(hold_s)
    for s in socks:
        s.close()


def slow_bodies(url: str, ca: str, secret: str, n: int, seconds: float) -> None:
    async def go() -> None:
        headers = {"Authorization": f"Bearer {secret}", "Content-Type": CONTENT_TYPE}
        limits = httpx.Limits(max_connections=n + 4)
        async with httpx.AsyncClient(base_url=url, verify=ca, timeout=seconds + 60, limits=limits) as client:

            async def body():  # type: ignore[no-untyped-def]
                for _ in range(16):  # 16 MB, a MB at a time
                    yield b"\x00" * (1024 * 1024)
                    await asyncio.sleep(seconds / 16)

            async def post() -> None:
                try:
                    await client.post("/v1/leases/submit", content=body(), headers=headers)
                except httpx.HTTPError:
                    pass

            await asyncio.gather(*[post() for _ in range(n)])

    asyncio.run(go())


def big_made_up(url: str, ca: str, secret: str, n: int, stop_at: float) -> None:
    tokens = 237_500
    group = RolloutGroup(
        group_id=group_id_for("x", "p"),
        batch_id="x",
        prompt_id="p",
        adapter_version=0,
        actor_id="w",
        prompt_token_ids=pack_i32([1]),
        completions=[Completion.of([5] * tokens, [-0.5] * tokens, finish_reason="length") for _ in range(8)],
    )
    body = encode_body(SubmitRequest(worker="w", lease_id="1-0", groups=[group]))
    headers = {"Authorization": f"Bearer {secret}", "Content-Type": CONTENT_TYPE}

    def sender() -> None:
        with httpx.Client(base_url=url, verify=ca, timeout=60) as client:
            while time.monotonic() < stop_at:
                client.post("/v1/leases/submit", content=body, headers=headers)

    threads = [threading.Thread(target=sender) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(f"  (each made-up-lease body {len(body) / 2**20:.1f} MiB)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--idle", type=int, default=2000)
    parser.add_argument("--bodies", type=int, default=64)
    parser.add_argument("--big", type=int, default=8, help="threads sending made-up-lease submissions")
    parser.add_argument("--seconds", type=float, default=8.0, help="length of each phase")
    parser.add_argument(
        "--nofile",
        type=int,
        default=1024,
        help="the proxy's soft open-files limit at start (a common default; its hard limit is this machine's)",
    )
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp())
    redis_proc, redis_port = start_redis()
    port = free_port()
    write_self_signed(tmp / "cert.pem", tmp / "key.pem", ["127.0.0.1"])
    (tmp / "tokens.toml").write_text(
        "".join(
            f'[[tokens]]\nname = "{name}"\nrole = "{role}"\nsecret = "{secret}"\n'
            for name, (role, secret) in TOKENS.items()
        )
    )
    proxy = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "proxy.cli",
            "serve",
            "--redis",
            f"redis://127.0.0.1:{redis_port}/0",
            "--store",
            (tmp / "store").as_uri(),
            "--run",
            f"door-{uuid.uuid4().hex[:6]}",
            "--tokens",
            str(tmp / "tokens.toml"),
            "--port",
            str(port),
            "--tls-cert",
            str(tmp / "cert.pem"),
            "--tls-key",
            str(tmp / "key.pem"),
            "--rate-per-s",
            "100000",
            "--log-level",
            "warning",
        ],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
        preexec_fn=lambda: resource.setrlimit(
            resource.RLIMIT_NOFILE, (args.nofile, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
        ),
    )
    url, ca = f"https://127.0.0.1:{port}", str(tmp / "cert.pem")
    try:
        wait_for_proxy(url, ca, proxy)
        os.environ["SPOTGRPO_CA_CERT"] = ca
        honest = (url, TOKENS["honest"][1])
        print(f"{'phase':<34} {'calls':>6} {'p50 ms':>7} {'p99 ms':>7} {'failed':>6} {'proxy MB':>8}")
        row("no attack", *honest_calls(*honest, time.monotonic() + args.seconds), proxy.pid)
        phases = [
            (f"{args.idle} connections, no ClientHello", lambda: idle_connections(port, args.idle, args.seconds)),
            (
                f"{args.bodies} trickled 16 MB bodies",
                lambda: slow_bodies(url, ca, TOKENS["mallory"][1], args.bodies, args.seconds),
            ),
            (
                f"{args.big} senders of made-up-lease bodies",
                lambda: big_made_up(url, ca, TOKENS["mallory"][1], args.big, time.monotonic() + args.seconds),
            ),
        ]
        for name, attack in phases:
            t = threading.Thread(target=attack)
            t.start()
            time.sleep(1.0)  # the attack in place
            latencies, failed = honest_calls(*honest, time.monotonic() + args.seconds)
            row(name, latencies, failed, proxy.pid)
            t.join()
    finally:
        stop([proxy, redis_proc])


if __name__ == "__main__":
    main()
