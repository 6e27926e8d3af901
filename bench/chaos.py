"""Chaos soak: the distributed system under random faults, then an exact ledger.

Starts, as processes a user would run: a redis-server with AOF (fsync always), moto's S3
server, `proxy serve` over TLS, the trusted scoring tier (`learner score`), 3 rollout
workers (`actors run`, transformers engine, through the proxy) and `learner run` (through
the proxy, adapters and checkpoints in the bucket), on a tiny model and the next-digit task.
After the learner's first step, for `--minutes`, at random intervals it injects, in a
shuffled round over the kinds: an actor SIGKILLed (a new one starts), an actor SIGTERMed
(a new one starts once it has handed its lease back), the proxy SIGKILLed and restarted,
Redis SIGKILLed and restarted on its AOF, a Redis failover (restarted from a snapshot taken
0.5-3 s before: the last writes lost, as a replica promoted in the primary's place lacks
them), the scoring worker SIGKILLed and restarted, and the learner SIGKILLed and resumed
(`--resume`). A process that exits on its own is
restarted too and counted. Then it lets the run recover, stops the learner with SIGTERM
(a checkpoint), stops the workers, and checks the ledger from the checkpoint, the queue,
`issued.jsonl` and `consumed.jsonl`. The learner runs with active sampling (the default:
mastered prompts passed over) and revisits, so its batches are new prompts or revisits
(the third kind, a dishonest worker's prompts issued again, needs one: see
tests/test_audit.py) and hold the prompts it chose, which `issued.jsonl` names:

- a batch issued again after a crash holds the same prompts as when first issued, and
  the trail names as many prompts as the checkpoint counts issued;
- every issued prompt is trained once, dropped with its reason, dead-lettered, or still
  in flight (found in the queue: a batch not yet finished, a group not yet scored or read);
- no group is trained or dropped twice, and no consumed group waits in the queue again;
- the step numbers are 1..N, each once;
- adapter versions only increase (announcements, and the steps' versions).

Prints the counts and the faults of each kind; exits 1 if the ledger is not exact.

    python bench/chaos.py --minutes 15 [--seed 0] [--json figures.json] [--keep DIR]
"""

from __future__ import annotations

import sys
from pathlib import Path

# the repository, not bench/ (whose queue.py would shadow the standard library's)
sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import json
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections import Counter
from typing import Any

import redis

REPO = Path(__file__).resolve().parents[1]
RUN = "chaos"
PPB = 4
"""Prompts per batch."""
KINDS = (
    "actor_sigkill",
    "actor_sigterm",
    "proxy_sigkill",
    "redis_sigkill",
    "redis_failover",
    "scorer_sigkill",
    "learner_sigkill",
)
ACTORS = 3
LEASE_S = 5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Proc:
    """One supervised process: started with its command, restarted when it dies."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log: Path) -> None:
        self.name, self.cmd, self.env, self.log = name, cmd, env, log
        self.popen: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self, *extra: str) -> Proc:
        with self.log.open("ab") as out:
            out.write(f"\n=== start {self.starts} at {time.strftime('%H:%M:%S')}: {' '.join(extra)}\n".encode())
            self.popen = subprocess.Popen(
                [*self.cmd, *extra], env=self.env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO
            )
        self.starts += 1
        return self

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal(self, signum: int) -> None:
        if self.alive:
            assert self.popen is not None
            self.popen.send_signal(signum)

    def wait(self, timeout: float) -> int | None:
        assert self.popen is not None
        try:
            return self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        if self.alive:
            assert self.popen is not None
            self.popen.kill()
            self.popen.wait(timeout=30)


class Soak:
    def __init__(self, work: Path, seed: int) -> None:
        self.work = work
        self.rng = random.Random(seed)
        self.faults: Counter[str] = Counter()
        self.unexpected: Counter[str] = Counter()
        self.redis_port, self.proxy_port = free_port(), free_port()
        self.redis_url = f"redis://127.0.0.1:{self.redis_port}/0"
        self.proxy_url = f"https://127.0.0.1:{self.proxy_port}"
        self.redis_proc: Proc | None = None
        self.actors: list[Proc] = []
        self.retiring: list[Proc] = []
        self.actor_serial = 0
        self.logs = work / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------------ set-up
    def prepare(self) -> None:
        import boto3
        from moto.server import ThreadedMotoServer

        from learner.tasks import write_next_digit_dataset
        from learner.tiny import save_tiny

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's request log
        self.moto_port = free_port()
        self.moto = ThreadedMotoServer(ip_address="127.0.0.1", port=self.moto_port, verbose=False)
        self.moto.start()
        self.aws = {
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{self.moto_port}",
            "AWS_ACCESS_KEY_ID": "chaos",
            "AWS_SECRET_ACCESS_KEY": "chaos",
            "AWS_DEFAULT_REGION": "us-east-1",
        }
        os.environ.update(self.aws)
        boto3.client("s3").create_bucket(Bucket="chaos")
        self.store = f"s3://chaos/{RUN}"
        self.model = save_tiny(self.work / "model", hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2)
        self.data = write_next_digit_dataset(self.work / "data.jsonl")
        from bench.queue import proxy_credentials

        self.cert, tls_key, self.tokens, self.secrets = proxy_credentials(self.work)
        base = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **self.aws}
        self.redis_proc = Proc(
            "redis",
            [
                shutil.which("redis-server") or "redis-server",
                "--port",
                str(self.redis_port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.work),
                "--save",
                "",
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
                "--protected-mode",
                "no",
            ],
            base,
            self.logs / "redis.log",
        )
        self.proxy = Proc(
            "proxy",
            [
                sys.executable,
                "-m",
                "proxy.cli",
                "serve",
                "--redis",
                self.redis_url,
                "--store",
                self.store,
                "--run",
                RUN,
                "--tokens",
                str(self.tokens),
                "--port",
                str(self.proxy_port),
                "--tls-cert",
                str(self.cert),
                "--tls-key",
                str(tls_key),
                "--lease-timeout-s",
                str(LEASE_S),
                "--log-level",
                "warning",
            ],
            base,
            self.logs / "proxy.log",
        )
        self.scorer = Proc(
            "scorer",
            [
                sys.executable,
                "-m",
                "learner.cli",
                "score",
                "--queue",
                self.redis_url,
                "--run",
                RUN,
                "--model",
                str(self.model),
                "--reward",
                "protocol.usercode.tasks:next_digit",
                "--abandon-after-s",
                "5",
                "--monitoring-interval-s",
                "2",
                "--maintenance-interval-s",
                "5",
                "--redispatch-s",
                "10",
            ],
            base,
            self.logs / "scorer.log",
        )
        self.actor_env = {**base, "SPOTGRPO_TOKEN": self.secrets["actor"], "SPOTGRPO_CA_CERT": str(self.cert)}
        self.learner = Proc(
            "learner",
            [
                sys.executable,
                "-m",
                "learner.cli",
                "run",
                "--queue",
                self.proxy_url,
                "--store",
                self.store,
                "--run",
                RUN,
                "--run-dir",
                str(self.work / "run"),
                "--model",
                str(self.model),
                "--dataset",
                str(self.data),
                "--reward",
                "protocol.usercode.tasks:next_digit",
                "--steps",
                "1000000",
                "--checkpoint-every",
                "4",
                "--groups-per-step",
                "8",
                "--prompts-per-batch",
                str(PPB),
                "--num-generations",
                "8",
                "--max-inflight",
                "32",
                "--max-staleness",
                "4",
                "--max-tokens",
                "2",
                "--lora-rank",
                "8",
                "--learning-rate",
                "3e-3",
                "--micro-batch-size",
                "64",
                "--startup-timeout-s",
                "600",
                "--no-tensorboard",
                # active sampling is on (the default), with revisits: new batches and revisits
                "--active-sampling-revisit",
                "0.5",
            ],
            {**base, "SPOTGRPO_TOKEN": self.secrets["learner"], "SPOTGRPO_CA_CERT": str(self.cert)},
            self.logs / "learner.log",
        )

    def start_redis(self) -> None:
        assert self.redis_proc is not None
        self.redis_proc.start()
        self.wait_for_redis()

    def wait_for_redis(self) -> None:
        client = redis.Redis(port=self.redis_port)
        deadline = time.monotonic() + 30
        while True:
            try:
                client.ping()
                break
            except (redis.exceptions.ConnectionError, redis.exceptions.BusyLoadingError):
                if time.monotonic() > deadline:
                    raise RuntimeError("redis-server did not come back") from None
                time.sleep(0.05)
        client.close()

    def fail_over(self) -> None:
        """A replica promoted in the primary's place that lacks its last writes (Redis
        replicates asynchronously): a snapshot now, up to 3 s more of the run, then Redis
        SIGKILLed and started again from the snapshot alone; its append-only file starts
        anew from there, so the next SIGKILL keeps what came since."""
        assert self.redis_proc is not None
        with redis.Redis(port=self.redis_port) as primary:
            primary.save()
        time.sleep(self.rng.uniform(0.5, 3))
        self.redis_proc.kill()
        shutil.rmtree(self.work / "appendonlydir", ignore_errors=True)
        self.redis_proc.start("--appendonly", "no")  # the snapshot, dump.rdb
        self.wait_for_redis()
        client = redis.Redis(port=self.redis_port)
        client.config_set("appendonly", "yes")
        while int(client.info("persistence")["aof_rewrite_in_progress"]) or not int(
            client.info("persistence")["aof_enabled"]
        ):
            time.sleep(0.05)
        (self.work / "dump.rdb").unlink()
        client.close()

    def start_proxy(self) -> None:
        from protocol.client.transport import wait_for_proxy

        self.proxy.start()
        wait_for_proxy(self.proxy_url, str(self.cert), self.proxy.popen, timeout_s=60)

    def new_actor(self) -> None:
        name = f"chaos-{self.actor_serial}"
        self.actor_serial += 1
        self.actors.append(
            Proc(
                name,
                [
                    sys.executable,
                    "-m",
                    "actors.cli",
                    "run",
                    "--queue",
                    self.proxy_url,
                    "--run",
                    RUN,
                    "--engine",
                    "transformers",
                    "--model",
                    str(self.model),
                    "--worker-id",
                    name,
                    "--lease-timeout-s",
                    str(LEASE_S),
                    "--claim-block-s",
                    "2",
                    "--startup-timeout-s",
                    "600",
                    "--report-every-s",
                    "5",
                ],
                self.actor_env,
                self.logs / f"{name}.log",
            ).start()
        )

    def start(self) -> None:
        self.prepare()
        self.start_redis()
        self.start_proxy()
        self.scorer.start()
        for _ in range(ACTORS):
            self.new_actor()
        self.learner.start()

    # ---------------------------------------------------------------- progress
    def steps(self) -> int:
        path = self.work / "run" / "metrics.jsonl"
        if not path.exists():
            return 0
        last = 0
        for line in path.read_text().splitlines():
            try:
                last = json.loads(line)["step"]
            except (json.JSONDecodeError, KeyError):
                continue
        return last

    def supervise(self) -> None:
        """Restart whatever died on its own (a process manager's job), and count it."""
        assert self.redis_proc is not None
        if not self.redis_proc.alive:
            self.unexpected["redis"] += 1
            self.start_redis()
        if not self.proxy.alive:
            self.unexpected["proxy"] += 1
            self.start_proxy()
        if not self.scorer.alive:
            self.unexpected["scorer"] += 1
            self.scorer.start()
        if not self.learner.alive:
            self.unexpected[f"learner (exit {self.learner.popen.returncode if self.learner.popen else '?'})"] += 1
            self.learner.start("--resume")
        for actor in list(self.actors):
            if not actor.alive:
                self.unexpected["actor"] += 1
                self.actors.remove(actor)
                self.new_actor()
        for actor in list(self.retiring):  # SIGTERMed: a new one once it has handed its lease back
            if not actor.alive or actor.wait(0) is not None:
                self.retiring.remove(actor)
                self.new_actor()

    def inject(self, kind: str) -> None:
        self.faults[kind] += 1
        print(f"  {time.strftime('%H:%M:%S')} {kind} (step {self.steps()})", flush=True)
        if kind == "actor_sigkill" and self.actors:
            victim = self.rng.choice(self.actors)
            self.actors.remove(victim)
            victim.kill()
            self.new_actor()
        elif kind == "actor_sigterm" and self.actors:
            victim = self.rng.choice(self.actors)
            self.actors.remove(victim)
            victim.signal(signal.SIGTERM)
            self.retiring.append(victim)
        elif kind == "proxy_sigkill":
            self.proxy.kill()
            time.sleep(self.rng.uniform(0, 2))
            self.start_proxy()
        elif kind == "redis_sigkill":
            assert self.redis_proc is not None
            self.redis_proc.kill()
            time.sleep(self.rng.uniform(0, 3))
            self.start_redis()
        elif kind == "redis_failover":
            self.fail_over()
        elif kind == "scorer_sigkill":
            self.scorer.kill()
            self.scorer.start()
        elif kind == "learner_sigkill":
            self.learner.kill()
            self.learner.start("--resume")

    def soak(self, minutes: float, mean_interval_s: float, warmup_timeout_s: float) -> dict[str, Any]:
        started = time.monotonic()
        while self.steps() < 1:
            self.supervise()
            if time.monotonic() - started > warmup_timeout_s:
                raise RuntimeError(f"no first step in {warmup_timeout_s:.0f}s; see {self.logs}")
            time.sleep(0.5)
        warmup_s = time.monotonic() - started
        print(f"first step after {warmup_s:.0f}s; faults for {minutes:g} min", flush=True)
        fault_end = time.monotonic() + minutes * 60
        queue: list[str] = []
        next_at = time.monotonic() + self.rng.uniform(0.5, 1.5) * mean_interval_s
        while time.monotonic() < fault_end:
            self.supervise()
            if time.monotonic() >= next_at:
                if not queue:
                    queue = list(KINDS)
                    self.rng.shuffle(queue)
                self.inject(queue.pop())
                next_at = time.monotonic() + self.rng.uniform(0.5, 1.5) * mean_interval_s
            time.sleep(0.2)
        # recovery: the run goes on after the last fault
        at_last_fault, deadline = self.steps(), time.monotonic() + 300
        while self.steps() < at_last_fault + 4 and time.monotonic() < deadline:
            self.supervise()
            time.sleep(0.5)
        recovered = self.steps() >= at_last_fault + 4
        # stop: the learner first (SIGTERM: a checkpoint that acknowledges what it consumed)
        self.learner.signal(signal.SIGTERM)
        learner_exit = self.learner.wait(180)
        for actor in self.actors + self.retiring:
            actor.signal(signal.SIGTERM)
        for actor in self.actors + self.retiring:
            if actor.wait(60) is None:
                actor.kill()
        self.scorer.signal(signal.SIGTERM)
        if self.scorer.wait(30) is None:
            self.scorer.kill()
        return {
            "warmup_s": round(warmup_s, 1),
            "fault_minutes": minutes,
            "steps_at_last_fault": at_last_fault,
            "recovered": recovered,
            "learner_exit": learner_exit,
        }

    def close(self) -> None:
        for proc in [self.learner, self.scorer, self.proxy, *self.actors, *self.retiring]:
            proc.kill()
        if self.redis_proc is not None:
            self.redis_proc.kill()
        if getattr(self, "moto", None) is not None:
            self.moto.stop()


# ------------------------------------------------------------------------ ledger


def ledger(
    work: Path,
    redis_url: str,
    store_url: str,
    rows: list[dict[str, Any]] | None = None,
    run: str = RUN,
    trail: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The exact ledger of run `run` (see the module docstring);
    `problems` lists every breach. `rows` replaces consumed.jsonl and `trail` issued.jsonl
    (the self-test plants breaches in copies)."""
    from learner.ledger import PromptLedger
    from protocol import QueueConfig, group_id_for
    from protocol.trusted import RedisQueue, open_store
    from protocol.wire.files import CHECKPOINT_POINTER, checkpoint_key

    store = open_store(store_url)
    pointer = json.loads(store.get(CHECKPOINT_POINTER))
    state = json.loads(store.get(checkpoint_key(pointer["step"], "state.json")))
    problems: list[str] = []
    queue = RedisQueue.from_url(redis_url, QueueConfig(run=run))
    r = queue._r
    keys = queue.keys

    # issued: what the learner's trail names (`issued.jsonl`), up to the checkpoint's counts of
    # each kind of batch; a batch a crashed learner issued past them and the last one never
    # reached is not the run's (the old layout's check left them out the same way)
    ledger = state["ledger"]
    counts = {"b": ledger["batches_issued"], "t": ledger["revisit_batches"], "a": ledger["reissued"]}
    named: dict[str, list[str]] = {}
    for entry in trail if trail is not None else run_rows(work, "issued.jsonl"):
        if named.setdefault(entry["batch"], entry["prompts"]) != entry["prompts"]:
            problems.append(f"batch {entry['batch']} issued twice with different prompts")
    issued = {}
    for kind, count in counts.items():
        for i in range(count):
            batch = f"{run}-{kind}{i}"
            if batch not in named:
                problems.append(f"issued.jsonl does not name batch {batch}")
                continue
            issued |= {group_id_for(batch, p): batch for p in named[batch]}
    counted = PromptLedger.from_json(ledger)
    issued_n = counted.issued
    if len(issued) != issued_n:
        problems.append(f"the checkpoint counts {issued_n} prompts issued; issued.jsonl names {len(issued)}")

    if rows is None:
        rows = run_rows(work, "consumed.jsonl")
    steps = [row["step"] for row in rows]
    if steps != list(range(1, state["step"] + 1)):
        problems.append(f"steps in consumed.jsonl are not 1..{state['step']}: {steps[:5]}...{steps[-5:]}")
    fates: dict[str, list[str]] = {}
    reasons: Counter[str] = Counter()
    duplicates = 0
    for row in rows:
        for gid in row["trained"]:
            fates.setdefault(gid, []).append("trained")
        for gid, reason in row["dropped"]:
            if reason == "rejected_duplicate":
                duplicates += 1
                continue
            fates.setdefault(gid, []).append(reason)
            reasons[reason] += 1
    twice = {g: f for g, f in fates.items() if len(f) > 1}
    if twice:
        problems.append(f"{len(twice)} groups consumed twice, e.g. {next(iter(twice.items()))}")
    strangers = set(fates) - set(issued)
    if strangers:
        problems.append(f"{len(strangers)} consumed groups answer no issued prompt")

    dead: set[str] = set()
    dead_entries: Counter[str] = Counter()
    for dl in queue.dead_letters(count=100_000):
        dead_entries[dl.source] += 1
        if dl.source == "prompts" and dl.batch is not None:
            lost = (
                dl.missing_groups
                if dl.missing_groups is not None
                else [group_id_for(dl.batch.batch_id, p.id) for p in dl.batch.prompts]
            )
            dead.update(lost)
        elif dl.source == "unscored" and dl.group_id:  # a group the scoring tier could not store
            dead.add(dl.group_id)
    # where the groups still in flight are: a stream entry each
    in_streams: Counter[str] = Counter()
    for stream in (keys.rollouts, keys.unscored):
        for _, fields in r.xrange(stream):
            in_streams[fields[b"g"].decode()] += 1
    waiting_prompts: set[str] = set()
    seen = {m.decode() for m in r.smembers(keys.groups_seen)}
    for _, fields in r.xrange(keys.prompts):
        for part in fields.get(b"g", b"").decode().split(";"):
            gid = part.split(":", 1)[0]
            if gid and gid not in seen:
                waiting_prompts.add(gid)
    again = {g for g in fates if in_streams[g]}
    if again:
        problems.append(f"{len(again)} consumed groups wait in the queue again")
    stored_twice = [g for g, n in in_streams.items() if n > 1]
    if stored_twice:
        problems.append(f"{len(stored_twice)} groups stored twice in the queue")

    accounted = Counter()
    unaccounted = []
    for gid in issued:
        where = [
            name
            for name, yes in (
                ("consumed", gid in fates),
                ("dead_lettered", gid in dead),
                ("in_queue", in_streams[gid] > 0),
                ("waiting_batch", gid in waiting_prompts),
            )
            if yes
        ]
        if len(where) != 1:
            unaccounted.append((gid, where))
        for name in where:
            accounted[name] += 1
    if unaccounted:
        problems.append(f"{len(unaccounted)} issued prompts are not in exactly one place, e.g. {unaccounted[:3]}")
    inflight = counted.inflight
    if inflight != accounted["in_queue"] + accounted["waiting_batch"]:
        problems.append(
            f"the checkpoint counts {inflight} prompts in flight; the queue holds "
            f"{accounted['in_queue'] + accounted['waiting_batch']}"
        )

    # adapter versions only increase
    versions = [e.manifest.version for e in queue.adapter_events(after="0", count=100_000)]
    if versions != sorted(set(versions)):
        problems.append(f"announced versions are not strictly increasing: {versions}")
    step_versions = [
        json.loads(line)["adapter_version"] for line in (work / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    if step_versions != sorted(step_versions):
        problems.append("the steps' adapter versions go down somewhere")
    if versions and state["policy_version"] < versions[-1]:
        problems.append(f"checkpoint version {state['policy_version']} is below announced v{versions[-1]}")
    queue.close()
    trained = sum(1 for f in fates.values() if f == ["trained"])
    return {
        "issued_prompts": len(issued),
        "batches_issued": counts,
        "trained": trained,
        "dropped": dict(reasons),
        "dead_lettered": len(dead),
        "dead_letter_entries": dict(dead_entries),
        "in_queue": accounted["in_queue"],
        "waiting_batches": accounted["waiting_batch"],
        "duplicates_rejected": duplicates,
        "steps": state["step"],
        "versions_announced": len(versions),
        "last_version": versions[-1] if versions else 0,
        "exact": not problems,
        "problems": problems,
    }


def run_rows(work: Path, name: str) -> list[dict[str, Any]]:
    """The rows of one of the run directory's JSON-lines trails (consumed.jsonl, issued.jsonl)."""
    return [json.loads(line) for line in (work / "run" / name).read_text().splitlines()]


def self_test(work: Path, redis_url: str, store_url: str) -> dict[str, bool]:
    """The ledger on planted breaches of the same run: each must be caught."""
    rows, trail = run_rows(work, "consumed.jsonl"), run_rows(work, "issued.jsonl")
    donor = next(row for row in rows if row["trained"])
    twice = [*rows[:-1], {**rows[-1], "trained": [*rows[-1]["trained"], donor["trained"][0]]}]
    lost = [{**row, "trained": row["trained"][1:]} if row is donor else row for row in rows]
    repeated = [*rows, {**rows[-1]}]
    # a batch issued again after a crash with other prompts than the first time; a batch unnamed
    changed = [*trail, {**trail[0], "prompts": [f"p{int(trail[-1]['prompts'][-1][1:]) + 1}", *trail[0]["prompts"][1:]]}]
    unnamed = [entry for entry in trail if entry["batch"] != trail[0]["batch"]]
    caught = {
        name: not ledger(work, redis_url, store_url, planted)["exact"]
        for name, planted in (("trained_twice", twice), ("group_lost", lost), ("step_repeated", repeated))
    }
    for name, planted_trail in (("issued_otherwise", changed), ("issued_unnamed", unnamed)):
        caught[name] = not ledger(work, redis_url, store_url, trail=planted_trail)["exact"]
    return caught


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=15.0, help="how long faults are injected (default 15)")
    parser.add_argument("--mean-interval-s", type=float, default=10.0, help="mean time between faults (default 10)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup-timeout-s", type=float, default=300.0)
    parser.add_argument("--json", type=Path, default=None, help="write the figures here too")
    parser.add_argument("--keep", type=Path, default=None, help="work in this folder and keep it (logs, run)")
    parser.add_argument(
        "--self-test",
        action="store_true",
        help="also check that the ledger catches breaches planted in a copy of consumed.jsonl",
    )
    args = parser.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="spotgrpo-chaos-"))
    work.mkdir(parents=True, exist_ok=True)
    soak = Soak(work, args.seed)
    started = time.monotonic()
    try:
        soak.start()
        run = soak.soak(args.minutes, args.mean_interval_s, args.warmup_timeout_s)
        figures = {
            **run,
            **ledger(work, soak.redis_url, soak.store),
            "faults": dict(soak.faults),
            "unexpected_exits": dict(soak.unexpected),
            "actors_started": soak.actor_serial,
            "learner_starts": soak.learner.starts,
            "wall_s": round(time.monotonic() - started, 1),
        }
        if args.self_test:
            figures["self_test_caught"] = self_test(work, soak.redis_url, soak.store)
    finally:
        soak.close()
    print(json.dumps(figures, indent=1))
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=1))
    ok = (
        figures["exact"]
        and figures["recovered"]
        and figures["learner_exit"] == 0
        and all(figures.get("self_test_caught", {}).values())
    )
    if args.keep is None and ok:
        shutil.rmtree(work, ignore_errors=True)
    elif not ok:
        print(f"logs and run kept in {work}", file=sys.stderr)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
