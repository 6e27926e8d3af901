"""A fleet of up to thousands of rollout workers against one proxy, one Redis, one learner.

Starts, as a deployment would: a private redis-server, moto's S3 server (adapters and
checkpoints, presigned downloads), `proxy serve` over TLS, the trusted scoring tier
(`learner score`) and `learner run` (the tiny model of `learner.tiny` on the next-digit
task, through the proxy). The workers are `bench/fleet_host.py` processes of `--per-host`
real workers each (claim, heartbeat, status, adapter events and presigned downloads,
submit, hand-back on SIGTERM) whose engine is a model of a GPU; a host is one spot machine
(a SIGTERM reaches its workers, a SIGKILL loses them all), run at `--host-nice` so that on
one machine the fleet yields the cores to the run it serves. Time is dilated: a group takes
`--dilation` times what `--tokens-per-s` would give, and the report says so. Audits are off
(`--audit-rate 0`): the simulated log-probabilities are not the model's.

Scenarios, each a table:

1. scale-out: the fleet grows through `--workers` (1,10,100,300,1000); per size, after
   `--warm-s`, over `--window-s`: the learner's wait fraction, groups/s it took (trained,
   or dropped as flat: all the same reward) and groups/s it dropped as stale, door
   latency p50/p99 by call, the proxy's CPU (cores) and RSS and sockets, Redis's CPU and
   memory and clients, calls retried (429/503) and failed, and the adapter fan-out: store
   bytes per publish and seconds from announce until 95 % of the workers had it loaded.
2. reclaim: at the largest size, hosts holding 30 % of the workers get SIGTERM (`--grace-s`
   notice), 10 % SIGKILL; replacements join `--replace-after-s` later. Groups/s every 5 s (over the
   last 20 s), the tokens thrown away (generated, never stored), and the seconds until
   groups/s is back to 90 % of before.
3. churn: `--churn-fraction` of the fleet leaves (SIGTERM) and joins per minute for
   `--churn-minutes`.
4. fanout: a 35 MB adapter (LoRA rank 16 on every linear layer of Qwen2.5-0.5B's shape,
   float32) published `--publishes` times, `--publish-every-s` apart, through the real
   publisher (store, manifest, announce) by the bench itself, on a rig of its own after
   the others (Redis, the store, the proxy and the fleet; no learner or scorer). Per size
   in `--workers`: bytes read from the store per publish (what the workers fetched,
   counted) and seconds until 95 % of the workers had the version loaded. With
   `--node-cache` each host's workers share their downloads as the workers of one machine
   do (`actors run --adapter-cache`): a host of `--per-host` workers stands for one
   machine.

At the end the workers are stopped, the learner checkpoints (SIGTERM), and the ledger of
`bench/chaos.py` is checked: every issued prompt trained once, dropped with its reason,
dead-lettered or still in the queue; nothing trained twice. Exits 1 if it is not exact.

    python bench/fleet.py [--workers 1,10,100,300,1000] [--scenarios scaleout,reclaim,churn]
        [--json figures.json] [--keep DIR]
    python bench/fleet.py --scenarios fanout --workers 100,1000 [--node-cache]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import tempfile
import time
from collections import defaultdict
from typing import Any

import numpy as np
import redis

from bench.chaos import free_port, ledger
from bench.proxy import cpu_s
from bench.queue import start_redis

REPO = Path(__file__).resolve().parents[1]
RUN = "fleet"
PPB = 4
CALLS = ("claim", "claim_wait", "submit", "heartbeat", "status", "latest_adapter", "adapter_urls", "adapter_file")


def rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def sockets(pid: int) -> int:
    count = 0
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                count += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
            except OSError:
                pass
    except OSError:
        pass
    return count


def machine_busy_s() -> float:
    """CPU seconds the whole machine spent busy so far (all cores, /proc/stat)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


class Rig:
    """The run's processes and the fleet's hosts; see the module docstring."""

    def __init__(self, work: Path, args: argparse.Namespace) -> None:
        self.work, self.args = work, args
        self.logs = work / "logs"
        (work / "hosts").mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(exist_ok=True)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.hosts: list[dict[str, Any]] = []
        self.serial = 0
        self.learner: subprocess.Popen[bytes] | None = None

    def _start(self, name: str, cmd: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        with (self.logs / f"{name}.log").open("ab") as out:
            proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
        self.procs[name] = proc
        return proc

    def start(self) -> None:
        import boto3

        from bench.queue import proxy_credentials
        from learner.tasks import write_next_digit_dataset
        from learner.tiny import CHARS, save_tiny
        from protocol.client.transport import wait_for_proxy

        a = self.args
        redis_proc, port = start_redis()
        self.procs["redis"] = redis_proc
        self.redis_url = f"redis://127.0.0.1:{port}/0"
        self.redis = redis.Redis(port=port)
        moto_port = free_port()
        self._start(
            "moto", [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(moto_port)], dict(os.environ)
        )
        self.aws = {
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{moto_port}",
            "AWS_ACCESS_KEY_ID": "fleet",
            "AWS_SECRET_ACCESS_KEY": "fleet",
            "AWS_DEFAULT_REGION": "us-east-1",
        }
        os.environ.update(self.aws)
        deadline = time.monotonic() + 60
        while True:
            try:
                boto3.client("s3").create_bucket(Bucket="fleet")
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        self.store = f"s3://fleet/{RUN}"
        model = save_tiny(self.work / "model", hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2)
        data = write_next_digit_dataset(self.work / "data.jsonl", n=200_000)
        self.vocab = 4 + len(CHARS)
        self.digits = ",".join(str(4 + CHARS.index(str(d))) for d in range(10))
        self.cert, key, tokens, secrets = proxy_credentials(self.work, actor_workers=a.token_workers)
        self.admin = secrets["admin"]
        base = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **self.aws}
        self.proxy_url = f"https://127.0.0.1:{free_port()}"
        self._start(
            "proxy",
            [sys.executable, "-m", "proxy.cli", "serve", "--redis", self.redis_url, "--store", self.store,
             "--run", RUN, "--tokens", str(tokens), "--port", self.proxy_url.rsplit(":", 1)[1],
             "--tls-cert", str(self.cert), "--tls-key", str(key), "--lease-timeout-s", str(a.lease_timeout_s),
             "--log-level", "warning", *a.proxy_flags],
            base,
        )  # fmt: skip
        wait_for_proxy(self.proxy_url, str(self.cert), self.procs["proxy"], timeout_s=60)
        self.actor_env = {**base, "SPOTGRPO_TOKEN": secrets["actor"]}
        if not a.trains:
            return
        for i in range(a.scorers):
            self._start(
                f"scorer{i}",
                [sys.executable, "-m", "learner.cli", "score", "--queue", self.redis_url, "--run", RUN,
                 "--model", str(model), "--reward", "protocol.usercode.tasks:next_digit"],
                base,
            )  # fmt: skip
        self.learner = self._start(
            "learner",
            [sys.executable, "-m", "learner.cli", "run", "--queue", self.proxy_url, "--store", self.store,
             "--run", RUN, "--run-dir", str(self.work / "run"), "--model", str(model), "--dataset", str(data),
             "--reward", "protocol.usercode.tasks:next_digit", "--steps", "1000000",
             "--checkpoint-every", "10", "--groups-per-step", str(a.groups_per_step), "--sync-every", str(a.sync_every),
             "--prompts-per-batch", str(PPB), "--num-generations", str(a.num_generations),
             "--max-inflight", str(a.max_inflight), "--max-staleness", str(a.max_staleness),
             "--max-tokens", str(a.completion_tokens), "--lora-rank", "8", "--learning-rate", "1e-3",
             "--micro-batch-size", "256", "--audit-rate", "0", "--audit-probation-groups", "0",
             "--startup-timeout-s", "600", "--no-tensorboard"],
            {**base, "SPOTGRPO_TOKEN": secrets["learner"], "SPOTGRPO_CA_CERT": str(self.cert)},
        )  # fmt: skip

    # ---------------------------------------------------------------- the fleet
    @property
    def live(self) -> list[dict[str, Any]]:
        return [h for h in self.hosts if h["proc"].poll() is None and not h.get("leaving")]

    def trained_once(self, timeout_s: float) -> None:
        """Wait until the learner has taken a step: a warm-up measured in work, not only in
        seconds. On a loaded machine the first step can come after `--warm-s`, and a window
        before it measures no rate, which any rate after a wave then matches."""
        deadline = time.time() + timeout_s
        while time.time() < deadline and not self.learner_rows(0.0, time.time()):
            time.sleep(1.0)

    def grow_to(self, workers: int) -> None:
        """Start hosts until `workers` workers are live."""
        a = self.args
        while (have := sum(h["count"] for h in self.live)) < workers:
            count = min(a.per_host, workers - have)
            name = f"h{self.serial}"
            self.serial += 1
            stats = self.work / "hosts" / f"{name}.jsonl"
            with (self.logs / f"{name}.log").open("ab") as out:
                proc = subprocess.Popen(
                    ["nice", "-n", str(a.host_nice), sys.executable, str(REPO / "bench" / "fleet_host.py"),
                     "--url", self.proxy_url,
                     "--ca", str(self.cert), "--run", RUN, "--count", str(count), "--name", name,
                     "--stats", str(stats), "--vocab", str(self.vocab), "--digits", self.digits,
                     "--tokens-per-s", str(a.tokens_per_s), "--completion-tokens", str(a.completion_tokens),
                     "--max-num-seqs", str(a.num_generations * PPB), "--dilation", str(a.dilation),
                     "--lease-timeout-s", str(a.lease_timeout_s), "--grace-s", str(a.grace_s),
                     "--join-over-s", str(a.join_over_s),
                     *(["--node-cache", str(self.work / "nodes" / name)] if a.node_cache else [])],
                    env=self.actor_env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                )  # fmt: skip
            self.hosts.append({"name": name, "count": count, "proc": proc, "stats": stats})

    def leave(self, hosts: list[dict[str, Any]], sig: int) -> None:
        for h in hosts:
            h["leaving"] = True
            h["proc"].send_signal(sig)

    # ---------------------------------------------------------------- figures
    def sample(self) -> dict[str, float]:
        info = self.redis.info()
        proxy = self.procs["proxy"].pid
        hosts = [h["proc"].pid for h in self.hosts if h["proc"].poll() is None]
        return {
            "t": time.time(),
            "proxy_cpu_s": cpu_s(proxy),
            "proxy_rss_mb": rss_mb(proxy),
            "proxy_sockets": sockets(proxy),
            "redis_cpu_s": float(info["used_cpu_sys"]) + float(info["used_cpu_user"]),
            "redis_mb": info["used_memory"] / 2**20,
            "redis_clients": info["connected_clients"],
            "learner_cpu_s": cpu_s(self.learner.pid) if self.learner else 0.0,
            "scorer_cpu_s": sum(cpu_s(p.pid) for n, p in self.procs.items() if n.startswith("scorer")),
            "hosts_cpu_s": sum(cpu_s(pid) for pid in hosts),
            "moto_cpu_s": cpu_s(self.procs["moto"].pid),
            "machine_cpu_s": machine_busy_s(),
            "manifest_reads": self.proxy_metric("spotgrpo_proxy_adapter_manifest_reads_total"),
        }

    def proxy_metric(self, name: str) -> float:
        import httpx

        try:
            text = httpx.get(
                f"{self.proxy_url}/metrics",
                headers={"Authorization": f"Bearer {self.admin}"},
                verify=str(self.cert),
                timeout=30,
            ).text
        except httpx.HTTPError:
            return float("nan")
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        return float("nan")

    def host_lines(self, since: float, until: float) -> list[dict[str, Any]]:
        lines = []
        for h in self.hosts:
            if h["stats"].exists():
                for line in h["stats"].read_text().splitlines():
                    row = json.loads(line)
                    if since <= row["t"] < until:
                        lines.append({**row, "host": h["name"]})
        return lines

    def learner_rows(self, since: float, until: float) -> list[dict[str, Any]]:
        path = self.work / "run" / "metrics.jsonl"
        if not path.exists():
            return []
        consumed = self.work / "run" / "consumed.jsonl"
        counts: dict[int, tuple[int, int]] = {}
        if consumed.exists():
            for line in consumed.read_text().splitlines():
                row = json.loads(line)
                stale = sum(reason == "dropped_stale" for _, reason in row["dropped"])
                counts[row["step"]] = (len(row["trained"]) + len(row["dropped"]) - stale, stale)
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        return [
            {**r, "consumed": counts.get(r["step"], (0, 0))[0], "stale": counts.get(r["step"], (0, 0))[1]}
            for r in rows
            if since <= r["time"] < until
        ]

    def announces(self) -> list[tuple[int, float]]:
        """(version, announced at) from the adapter events stream (its ids are milliseconds)."""
        from protocol import QueueConfig
        from protocol.trusted import RedisQueue

        queue = RedisQueue.from_url(self.redis_url, QueueConfig(run=RUN))
        try:
            return [
                (e.manifest.version, int(e.event_id.split("-")[0]) / 1000, sum(f.size for f in e.manifest.files))
                for e in queue.adapter_events(after="0", count=1_000_000)
            ]
        finally:
            queue.close()

    def alive(self) -> None:
        """Raise if a process of the run (not a host) has exited."""
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                tail = (
                    (self.logs / f"{name}.log").read_text(errors="replace").splitlines()[-5:] if name != "redis" else []
                )
                raise RuntimeError(f"{name} exited with {proc.returncode}: " + " | ".join(tail))

    def window(self, s0: dict[str, float], s1: dict[str, float], workers: int) -> dict[str, Any]:
        """The figures of one measured window, from two samples and the lines between."""
        self.alive()
        dt = s1["t"] - s0["t"]
        lines = self.host_lines(s0["t"], s1["t"])
        lat: dict[str, list[float]] = defaultdict(list)
        retried: dict[str, int] = defaultdict(int)
        failed: dict[str, int] = defaultdict(int)
        for line in lines:
            for k, v in line["lat"].items():
                lat[k].extend(v)
            for k, v in line["retried"].items():
                retried[k] += v
            for k, v in line["failed"].items():
                failed[k] += v
        rows = self.learner_rows(s0["t"], s1["t"])
        busy = sum(r["wait_s"] + r["step_s"] + r["publish_s"] for r in rows)
        row: dict[str, Any] = {
            "workers": workers,
            "seconds": dt,
            "steps": len(rows),
            "groups_per_s": sum(r["consumed"] for r in rows) / dt,
            "stale_per_s": sum(r["stale"] for r in rows) / dt,
            "learner_wait": sum(r["wait_s"] for r in rows) / busy if busy else float("nan"),
            "inflight_limit": rows[-1]["inflight_limit"] if rows else float("nan"),
            "stored_per_s": sum(line_groups(lines)) / dt,
            "proxy_cores": (s1["proxy_cpu_s"] - s0["proxy_cpu_s"]) / dt,
            "proxy_rss_mb": s1["proxy_rss_mb"],
            "proxy_sockets": s1["proxy_sockets"],
            "redis_cores": (s1["redis_cpu_s"] - s0["redis_cpu_s"]) / dt,
            "redis_mb": s1["redis_mb"],
            "redis_clients": s1["redis_clients"],
            "learner_cores": (s1["learner_cpu_s"] - s0["learner_cpu_s"]) / dt,
            "scorer_cores": (s1["scorer_cpu_s"] - s0["scorer_cpu_s"]) / dt,
            "hosts_cores": (s1["hosts_cpu_s"] - s0["hosts_cpu_s"]) / dt,
            "moto_cores": (s1["moto_cpu_s"] - s0["moto_cpu_s"]) / dt,
            "machine_cores": (s1["machine_cpu_s"] - s0["machine_cpu_s"]) / dt,
            "manifest_reads": s1["manifest_reads"] - s0["manifest_reads"],
            "calls_per_s": sum(len(v) for v in lat.values()) / dt,
            "retried": dict(retried),
            "failed": dict(failed),
        }
        for call in CALLS:
            row[f"{call}_n"] = len(lat[call])
            row[f"{call}_p50"] = pct(lat[call], 50)
            row[f"{call}_p99"] = pct(lat[call], 99)
        row.update(self.fanout(s0["t"], s1["t"], workers))
        return row

    def fanout(self, since: float, until: float, workers: int) -> dict[str, Any]:
        """Per version announced in the window: bytes the workers fetched, and the seconds
        until 95 % of `workers` had loaded it."""
        loads: dict[int, list[float]] = defaultdict(list)
        read: dict[int, int] = defaultdict(int)
        for h in self.hosts:
            if h["stats"].exists():
                for line in h["stats"].read_text().splitlines():
                    row = json.loads(line)
                    for _worker, version, at in row["loads"]:
                        loads[version].append(at)
                    for version, size in row.get("fetched", []):
                        read[version] += size
        reach, fetched = [], []
        for version, at, _size in self.announces():
            if since <= at < until - 15:
                times = sorted(t - at for t in loads.get(version, []))
                fetched.append(read[version])
                need = max(1, int(np.ceil(0.95 * workers)))
                reach.append(times[need - 1] if len(times) >= need else float("inf"))
        finite = [r for r in reach if np.isfinite(r)]
        return {
            "versions": len(reach),
            "adapter_bytes": self.announces()[-1][2] if self.announces() else 0,
            "bytes_per_publish": float(np.mean(fetched)) if fetched else float("nan"),
            "reach95_p50_s": pct(finite, 50),
            "reach95_missed": len(reach) - len(finite),
        }

    def stop(self) -> dict[str, Any]:
        """Stop the fleet, checkpoint the learner, check the ledger; then stop the rest."""
        for h in self.hosts:
            if h["proc"].poll() is None:
                h["proc"].send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.args.grace_s + 30
        for h in self.hosts:
            try:
                h["proc"].wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                h["proc"].kill()
        if self.learner is None:  # nothing was trained: no ledger to check
            self.close()
            return {}
        self.learner.send_signal(signal.SIGTERM)
        try:
            self.learner.wait(300)
        except subprocess.TimeoutExpired:
            self.learner.kill()
        try:
            return ledger(self.work, self.redis_url, self.store, run=RUN)
        finally:
            self.close()

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        for h in self.hosts:
            if h["proc"].poll() is None:
                h["proc"].kill()


def line_groups(lines: list[dict[str, Any]]) -> list[int]:
    """Groups stored per host over the lines (their counters are cumulative)."""
    by_host: dict[str, list[int]] = defaultdict(list)
    for line in lines:
        by_host[line["host"]].append(line["groups_stored"])
    return [max(v) - min(v) for v in by_host.values()]


def tokens(rig: Rig) -> tuple[float, float, float]:
    """Tokens generated and tokens stored over the whole fleet so far (each host's last line),
    and the tokens the live hosts generated and have not stored yet (running, or waiting to
    be submitted): what a window's start hands to its end, and a departed host's is lost."""
    generated = stored = unsent = 0.0
    live = {id(h) for h in rig.live}
    for h in rig.hosts:
        if h["stats"].exists():
            lines = h["stats"].read_text().splitlines()
            if lines:
                last = json.loads(lines[-1])
                generated += last["tokens_generated"]
                stored += last["tokens_stored"]
                unsent += last["tokens_unsent"] if id(h) in live else 0.0
    return generated, stored, unsent


# ------------------------------------------------------------------- scenarios
def scaleout(rig: Rig, sizes: list[int]) -> list[dict[str, Any]]:
    rows = []
    for n in sizes:
        rig.grow_to(n)
        time.sleep(rig.args.warm_s)
        s0 = rig.sample()
        time.sleep(rig.args.window_s)
        row = rig.window(s0, rig.sample(), n)
        rows.append(row)
        print_rows("scale-out", [row], header=len(rows) == 1)
    return rows


def reclaim(rig: Rig, n: int) -> dict[str, Any]:
    a = rig.args
    rig.grow_to(n)
    rig.trained_once(a.recover_timeout_s)
    time.sleep(a.warm_s)
    s0 = rig.sample()
    time.sleep(a.window_s)
    before = rig.window(s0, rig.sample(), n)["groups_per_s"]
    gen0, stored0, unsent0 = tokens(rig)
    hosts = list(rig.live)
    random.Random(0).shuffle(hosts)
    termed = take(hosts, 0.3 * n)
    killed = take(hosts[len(termed) :], 0.1 * n)
    wave = time.time()
    rig.leave(termed, signal.SIGTERM)
    rig.leave(killed, signal.SIGKILL)
    gone = sum(h["count"] for h in termed + killed)
    print(f"reclaim: SIGTERM to {sum(h['count'] for h in termed)} workers ({len(termed)} hosts), "
          f"SIGKILL to {sum(h['count'] for h in killed)} ({len(killed)} hosts)", flush=True)  # fmt: skip
    buckets: list[tuple[float, float]] = []
    recovered_s = float("nan")
    replaced = False
    while time.time() - wave < a.replace_after_s + a.recover_timeout_s:
        time.sleep(5)
        # over the last 20 s: a step lands its groups at once, seconds apart
        now = time.time()
        rate = sum(r["consumed"] for r in rig.learner_rows(max(wave, now - 20), now)) / min(20.0, now - wave)
        buckets.append((round(now - wave, 1), round(rate, 1)))
        if not replaced and time.time() - wave >= a.replace_after_s:
            rig.grow_to(n)
            replaced = True
        if replaced and before > 0 and rate >= 0.9 * before and np.isnan(recovered_s):
            recovered_s = time.time() - wave
            break
    time.sleep(a.grace_s + 5)  # the SIGTERMed hosts' last words are in their stats files
    gen1, stored1, unsent1 = tokens(rig)
    generated, stored = gen1 - gen0, stored1 - stored0
    # stored in the window includes what was unsent at its start; what is unsent at its end
    # may still be stored: neither was thrown away (without this, a wave that lost little
    # read as less than nothing, -3 to -4 %)
    thrown = generated - stored + unsent0 - unsent1
    result = {
        "workers": n,
        "sigterm": sum(h["count"] for h in termed),
        "sigkill": sum(h["count"] for h in killed),
        "left": gone,
        "groups_per_s_before": before,
        "buckets": buckets,
        "recovered_s": recovered_s,
        "tokens_generated": generated,
        "tokens_stored": stored,
        "thrown_away": thrown / generated if generated else float("nan"),
    }
    print(f"reclaim: groups/s before {before:.1f}; after the wave (s since, groups/s over the last 20 s): {buckets}")
    print(f"reclaim: back to 90 % after {recovered_s:.0f} s; tokens thrown away {result['thrown_away']:.1%} "
          f"of {generated:,.0f} generated since the wave's window began", flush=True)  # fmt: skip
    return result


def take(hosts: list[dict[str, Any]], workers: float) -> list[dict[str, Any]]:
    """The first hosts that hold at least `workers` workers."""
    taken: list[dict[str, Any]] = []
    while hosts[len(taken) :] and sum(h["count"] for h in taken) < workers:
        taken.append(hosts[len(taken)])
    return taken


def churn(rig: Rig, n: int) -> list[dict[str, Any]]:
    a = rig.args
    rig.grow_to(n)
    per_minute = max(1, round(a.churn_fraction * n / a.per_host))
    rows = []
    for minute in range(int(a.churn_minutes)):
        s0 = rig.sample()
        for _ in range(per_minute):
            hosts = rig.live
            if hosts:
                rig.leave([random.choice(hosts)], signal.SIGTERM)
            rig.grow_to(n)
            time.sleep(60 / per_minute)
        row = rig.window(s0, rig.sample(), n)
        row["minute"] = minute + 1
        rows.append(row)
        print_rows("churn", [row], header=minute == 0)
    return rows


def qwen_shaped_adapter(rank: int = 16, seed: int = 0) -> dict[str, Any]:
    """LoRA A and B of every linear layer of Qwen2.5-0.5B's shape (24 layers, hidden 896,
    MLP 4864, 2 key-value heads of 64), float32: 8.8 M values, 35 MB."""
    import torch

    g = torch.Generator().manual_seed(seed)
    shapes = {"q_proj": (896, 896), "k_proj": (896, 128), "v_proj": (896, 128), "o_proj": (896, 896),
              "gate_proj": (896, 4864), "up_proj": (896, 4864), "down_proj": (4864, 896)}  # fmt: skip
    state = {}
    for layer in range(24):
        for module, (fan_in, fan_out) in shapes.items():
            part = "self_attn" if module.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            name = f"base_model.model.model.layers.{layer}.{part}.{module}"
            state[f"{name}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * 0.01
            state[f"{name}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.01
    return state


def fanout(rig: Rig, sizes: list[int]) -> list[dict[str, Any]]:
    """See the module docstring (scenario 4)."""
    from learner.publish import Publisher, PublishJob
    from protocol import QueueConfig
    from protocol.trusted import RedisQueue, open_store

    a = rig.args
    queue = RedisQueue.from_url(rig.redis_url, QueueConfig(run=RUN))
    publisher = Publisher(open_store(rig.store), queue, base_model="fleet", rank=16, keep_adapters=3)
    config = json.dumps({"r": 16, "lora_alpha": 32, "peft_type": "LORA"}).encode()
    version, rows = 0, []
    try:
        for n in sizes:
            rig.grow_to(n)
            time.sleep(a.warm_s)
            s0 = rig.sample()
            for _ in range(a.publishes):
                version += 1
                publisher.submit(PublishJob(version, version, qwen_shaped_adapter(seed=version), config))
                publisher.flush()
                time.sleep(a.publish_every_s)
            time.sleep(20)  # the last version's stragglers (`fanout` counts versions 15 s before the end)
            row = {"workers": n, "node_cache": a.node_cache, **rig.fanout(s0["t"], time.time(), n)}
            s1 = rig.sample()
            dt = s1["t"] - s0["t"]
            row |= {
                "proxy_cores": (s1["proxy_cpu_s"] - s0["proxy_cpu_s"]) / dt,
                "moto_cores": (s1["moto_cpu_s"] - s0["moto_cpu_s"]) / dt,
                "hosts_cores": (s1["hosts_cpu_s"] - s0["hosts_cpu_s"]) / dt,
            }
            rows.append(row)
            if len(rows) == 1:
                print(f"\n== fanout ({'a cache per host of ' + str(a.per_host) if a.node_cache else 'no cache'})")
                print(f"{'workers':>8} {'MB':>6} {'versions':>8} {'MB read/publish':>16} {'reach95 p50 s':>14} "
                      f"{'missed':>6} {'proxy':>6} {'moto':>6} {'hosts':>6}")  # fmt: skip
            print(f"{n:>8} {row['adapter_bytes'] / 1e6:>6.1f} {row['versions']:>8} "
                  f"{row['bytes_per_publish'] / 1e6:>16.1f} {row['reach95_p50_s']:>14.1f} {row['reach95_missed']:>6} "
                  f"{row['proxy_cores']:>6.2f} {row['moto_cores']:>6.2f} {row['hosts_cores']:>6.2f}",
                  flush=True)  # fmt: skip
    finally:
        publisher.close()
        queue.close()
    return rows


def print_rows(title: str, rows: list[dict[str, Any]], header: bool) -> None:
    cols = [
        ("workers", "{:>7}"), ("groups_per_s", "{:>8.1f}"), ("stale_per_s", "{:>6.1f}"), ("stored_per_s", "{:>8.1f}"),
        ("learner_wait", "{:>6.0%}"),
        ("inflight_limit", "{:>6.0f}"),
        ("submit_p50", "{:>7.1f}"),
        ("submit_p99", "{:>7.1f}"), ("heartbeat_p50", "{:>7.1f}"), ("heartbeat_p99", "{:>7.1f}"),
        ("status_p50", "{:>7.1f}"), ("status_p99", "{:>7.1f}"), ("calls_per_s", "{:>7.0f}"),
        ("proxy_cores", "{:>6.2f}"), ("proxy_rss_mb", "{:>6.0f}"),
        ("proxy_sockets", "{:>6}"), ("redis_cores", "{:>6.2f}"), ("redis_mb", "{:>6.1f}"),
        ("learner_cores", "{:>6.2f}"), ("scorer_cores", "{:>6.2f}"), ("hosts_cores", "{:>6.2f}"),
        ("moto_cores", "{:>6.2f}"), ("machine_cores", "{:>6.2f}"), ("versions", "{:>4}"),
        ("manifest_reads", "{:>5.0f}"), ("bytes_per_publish", "{:>9.0f}"), ("reach95_p50_s", "{:>6.1f}"),
    ]  # fmt: skip
    if header:
        print(f"\n== {title}")
        print(" ".join(f"{name[:9]:>9}" for name, _ in cols))
    for row in rows:
        print(" ".join(f"{fmt.format(row[name]):>9}" for name, fmt in cols), flush=True)
        extra = {k: v for k, v in (("retried", row["retried"]), ("failed", row["failed"])) if v}
        if extra:
            print(f"          {extra}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", default="1,10,100,300,1000", help="fleet sizes of the scale-out, comma-separated")
    p.add_argument("--scenarios", default="scaleout,reclaim,churn")
    p.add_argument("--per-host", type=int, default=25, help="workers per host process (one spot machine)")
    p.add_argument("--tokens-per-s", type=float, default=4000.0, help="a worker's GPU: tokens/s over a full batch")
    p.add_argument("--completion-tokens", type=int, default=16)
    p.add_argument("--num-generations", type=int, default=8)
    p.add_argument("--dilation", type=float, default=50.0, help="a group takes this many times the GPU's time")
    p.add_argument("--groups-per-step", type=int, default=64)
    p.add_argument(
        "--sync-every",
        type=int,
        default=8,
        help="publish an adapter every this many steps: the tiny model's steps are ~1 s, a real model's tens of s",
    )
    p.add_argument("--max-inflight", type=int, default=8192)
    p.add_argument("--max-staleness", type=int, default=2, help="in adapter versions (--sync-every steps each)")
    p.add_argument("--scorers", type=int, default=1)
    p.add_argument("--lease-timeout-s", type=float, default=30.0)
    p.add_argument("--grace-s", type=float, default=30.0, help="a SIGTERM's notice (GKE's: about 30 s)")
    p.add_argument(
        "--host-nice",
        type=int,
        default=15,
        help="the hosts' niceness: on one machine the simulated fleet yields the cores to the run (its own machines)",
    )
    p.add_argument("--join-over-s", type=float, default=10.0, help="a host's workers start spread over this long")
    p.add_argument("--warm-s", type=float, default=20.0)
    p.add_argument("--window-s", type=float, default=30.0)
    p.add_argument("--replace-after-s", type=float, default=60.0)
    p.add_argument("--recover-timeout-s", type=float, default=120.0)
    p.add_argument("--churn-fraction", type=float, default=0.1)
    p.add_argument("--churn-minutes", type=float, default=10.0)
    p.add_argument("--token-workers", type=int, default=None, help="size the actor token for this many workers")
    p.add_argument("--node-cache", action="store_true", help="each host's workers share their adapter downloads")
    p.add_argument("--publishes", type=int, default=4, help="fanout: adapters published per fleet size")
    p.add_argument("--publish-every-s", type=float, default=30.0, help="fanout: seconds between publishes")
    p.add_argument("--proxy-flag", dest="proxy_flags", action="append", default=[], help="one more `proxy serve` flag")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--keep", type=Path, default=None, help="work here and keep it (logs, stats, run)")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    sizes = [int(s) for s in args.workers.split(",")]
    scenarios = args.scenarios.split(",")
    args.trains = any(s != "fanout" for s in scenarios)
    work = args.keep or Path(tempfile.mkdtemp(prefix="spotgrpo-fleet-"))
    work.mkdir(parents=True, exist_ok=True)
    group_s = args.completion_tokens / (args.tokens_per_s / (args.num_generations * PPB)) * args.dilation
    print(f"fleet: hosts of {args.per_host} workers; a lease of {PPB} prompts x {args.num_generations} completions "
          f"of {args.completion_tokens} tokens takes {group_s:.1f} s ({args.dilation:g}x a GPU at "
          f"{args.tokens_per_s:g} tokens/s); learner steps of {args.groups_per_step} groups on the tiny model; "
          f"work in {work}", flush=True)  # fmt: skip
    figures: dict[str, Any] = {"args": {k: v for k, v in vars(args).items() if k not in ("json", "keep")}}

    def on_a_rig(where: Path, trains: bool, body: Any) -> dict[str, Any]:
        """Start a rig (with a learner, or only the door for the fan-out), run `body` on it, stop it."""
        rig = Rig(where, argparse.Namespace(**{**vars(args), "trains": trains}))
        try:
            rig.start()
            body(rig)
            return rig.stop()
        except BaseException:
            rig.close()
            raise

    def training(rig: Rig) -> None:
        if "scaleout" in scenarios:
            figures["scaleout"] = scaleout(rig, sizes)
        if "reclaim" in scenarios:
            figures["reclaim"] = reclaim(rig, max(sizes))
        if "churn" in scenarios:
            figures["churn"] = churn(rig, max(sizes))

    try:
        if args.trains:
            figures["ledger"] = on_a_rig(work, True, training)
        if "fanout" in scenarios:  # its own rig: the bench publishes where a learner would
            on_a_rig(work / "fanout", False, lambda rig: figures.update(fanout=fanout(rig, sizes)))
    finally:
        if args.json:
            args.json.write_text(json.dumps(figures, indent=1, default=str))
    if args.keep is None:
        shutil.rmtree(work, ignore_errors=True)
    book = figures.get("ledger")
    if not book:  # nothing trained
        sys.exit(0)
    print(f"\nledger: {book['issued_prompts']} prompts issued, {book['trained']} trained, dropped {book['dropped']}, "
          f"{book['dead_lettered']} dead-lettered, {book['in_queue'] + book['waiting_batches']} in the queue; "
          f"exact: {book['exact']} {book['problems']}")  # fmt: skip
    sys.exit(0 if book["exact"] else 1)


if __name__ == "__main__":
    main()
