"""One host of `bench/fleet.py`'s simulated fleet: real rollout workers with a model of a GPU.

Each worker here is the real thing (`actors.worker.Worker`, `actors.watcher.AdapterWatcher`,
`ProxySource`, `HttpQueue` through the proxy over TLS: claim, heartbeat, status reports,
the adapter event stream, presigned adapter downloads, submit, hand-back on SIGTERM) except
generation, which `SimEngine` models: a subclass of the real `Engine` that answers each
group after the time a GPU would take (`--tokens-per-s` shared by `--max-num-seqs`
sequences, times `--dilation`, with log-normal jitter), with ids from the vocabulary,
finite log-probabilities and a digit first (so the next-digit reward varies in a group).

Many workers share the process as threads; a SIGTERM reaches all of them (each stops
claiming and hands back what it cannot finish within `--grace-s`, as `actors run` does),
a SIGKILL loses all of them at once: a host is one spot machine. Every second the host
appends one JSON line to `--stats`: latencies of the door's calls (ms, by call), tokens
generated so far (finished and in progress), tokens in groups the queue stored, adapter
loads (version, time), adapter bytes read from the store (version, bytes) and the workers
still running. With `--node-cache DIR` the host's workers share their downloads as the
workers of one machine do (`actors run --adapter-cache`).

    python bench/fleet_host.py --url https://127.0.0.1:PORT --ca cert.pem --count 25 \
        --name h3 --stats h3.jsonl --run fleet --vocab 80 --digits 4,5,...
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
import signal
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from actors.engine import Engine, EngineError, GroupRequest, Sample
from actors.node_cache import NodeCache
from actors.watcher import AdapterWatcher, ProxySource
from actors.worker import Worker, WorkerRefused
from protocol import QueueConfig, QueueError
from protocol.client.http_queue import HttpQueue

log = logging.getLogger("fleet.host")


@dataclass
class _Running:
    key: Hashable
    n: int
    version: int
    started: float
    due: float


class SimEngine(Engine):
    """A GPU's timing without the GPU: see the module docstring. `step` waits for the next
    group due (up to a second, or until `abort`) where a real engine returns within
    `timeout_s`: a simulated worker's loop wakes when there is something to do, not twenty
    times a second, so that a thousand of them fit on two cores."""

    def __init__(
        self,
        vocab: int,
        digits: Sequence[int],
        *,
        tokens_per_s: float,
        completion_tokens: int,
        max_num_seqs: int,
        dilation: float,
        seed: int,
    ) -> None:
        self.max_num_seqs = max_num_seqs
        self._vocab, self._digits = vocab, list(digits)
        self._tokens_per_s, self._completion = tokens_per_s, completion_tokens
        self._dilation = dilation
        self._rng = random.Random(seed)
        self._loaded: set[int] = set()
        self._running: list[_Running] = []
        self._releases: dict[int, Callable[[], None] | None] = {}
        self._lock = threading.Lock()
        self.tokens_done = 0
        """Tokens of groups finished or aborted (aborted: the share generated before)."""

    def group_s(self) -> float:
        """Seconds one group takes: every sequence decodes at the GPU's rate shared by a full batch."""
        per_sequence = self._tokens_per_s / self.max_num_seqs
        return self._completion / per_sequence * self._dilation * self._rng.lognormvariate(0.0, 0.25)

    def tokens_so_far(self, now: float) -> float:
        with self._lock:
            running = sum(
                r.n * self._completion * min(1.0, (now - r.started) / max(r.due - r.started, 1e-9))
                for r in self._running
            )
            return self.tokens_done + running

    def load_adapter(self, version: int, path: Path) -> None:
        if not (path / "adapter_model.safetensors").is_file():
            raise EngineError(f"{path}: no adapter_model.safetensors")
        with self._lock:
            self._loaded.add(version)

    def evict_adapter(self, version: int, on_released: Callable[[], None] | None = None) -> None:
        with self._lock:
            self._loaded.discard(version)
            if any(r.version == version for r in self._running):
                self._releases[version] = on_released
                return
        if on_released is not None:
            on_released()

    def loaded_versions(self) -> list[int]:
        with self._lock:
            return sorted(self._loaded)

    def add(self, groups: Sequence[GroupRequest]) -> None:
        with self._lock:
            missing = [g.version for g in groups if g.version and g.version not in self._loaded]
            if missing:
                raise EngineError(f"adapter v{missing[0]} is not loaded")
            now = time.monotonic()
            for g in groups:
                self._running.append(_Running(g.key, g.n, g.version, now, now + self.group_s()))

    def _sample(self) -> Sample:
        ids = [self._rng.choice(self._digits)] + [
            4 + self._rng.randrange(self._vocab - 4) for _ in range(self._completion - 1)
        ]
        return Sample(ids, [-self._rng.uniform(0.05, 3.0) for _ in ids], "length")

    def step(self, timeout_s: float, abort: threading.Event | None = None) -> list[tuple[Hashable, list[Sample]]]:
        with self._lock:
            next_due = min((r.due for r in self._running), default=None)
        if next_due is not None and (abort is None or not abort.is_set()):
            wait = min(max(next_due - time.monotonic(), 0.0), max(timeout_s, 1.0))
            if abort is not None:
                abort.wait(wait)
            else:
                time.sleep(wait)
        now = time.monotonic()
        released: list[Callable[[], None]] = []
        with self._lock:
            if abort is not None and abort.is_set():
                self.tokens_done += int(
                    sum(
                        r.n * self._completion * min(1.0, (now - r.started) / (r.due - r.started))
                        for r in self._running
                    )
                )
                done, self._running = self._running, []
                finished: list[tuple[Hashable, list[Sample]]] = []
            else:
                done = [r for r in self._running if r.due <= now]
                self._running = [r for r in self._running if r.due > now]
                finished = [(r.key, [self._sample() for _ in range(r.n)]) for r in done]
                self.tokens_done += sum(r.n * self._completion for r in done)
            for version in {r.version for r in done}:
                if version in self._releases and not any(r.version == version for r in self._running):
                    callback = self._releases.pop(version)
                    if callback is not None:
                        released.append(callback)
        for callback in released:
            callback()
        return finished

    @property
    def in_flight(self) -> int:
        with self._lock:
            return sum(r.n for r in self._running)

    def decode(self, token_ids: Sequence[int]) -> str:
        return "".join(str(t - self._digits[0]) if t in self._digits else "x" for t in token_ids)

    @property
    def vocab_size(self) -> int:
        return self._vocab


class Recorder:
    """The host's figures, written as one JSON line a second (see the module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lock = threading.Lock()
        self.latencies: dict[str, list[float]] = defaultdict(list)
        self.retried: dict[str, int] = defaultdict(int)
        self.failed: dict[str, int] = defaultdict(int)
        self.loads: list[tuple[str, int, float]] = []
        self.fetched: list[tuple[int, int]] = []
        self.tokens_stored = 0
        self.groups_stored = 0
        self.engines: list[SimEngine] = []
        self.workers: list[Worker] = []

    def call(self, name: str, seconds: float, retried: bool) -> None:
        with self.lock:
            self.latencies[name].append(round(seconds * 1000, 2))
            if retried:
                self.retried[name] += 1

    def flush(self, running: int) -> None:
        now = time.monotonic()
        generated = sum(e.tokens_so_far(now) for e in self.engines)
        # generated, not stored yet: running, or finished and waiting to be submitted (a
        # snapshot read across threads: an estimate, as the running share is)
        ready = [g for w in list(self.workers) for f in list(w.flights.values()) for g in list(f.ready)]
        unsent = generated - sum(e.tokens_done for e in self.engines)
        unsent += sum(c.tokens.size for g in ready for c in g.completions)
        with self.lock:
            line = {
                "t": time.time(),
                "running": running,
                "lat": dict(self.latencies),
                "retried": dict(self.retried),
                "failed": dict(self.failed),
                "loads": self.loads,
                "fetched": self.fetched,
                "tokens_generated": generated,
                "tokens_stored": self.tokens_stored,
                "tokens_unsent": unsent,
                "groups_stored": self.groups_stored,
            }
            self.latencies, self.retried, self.failed = defaultdict(list), defaultdict(int), defaultdict(int)
            self.loads, self.fetched = [], []
        with self.path.open("a") as f:
            f.write(json.dumps(line) + "\n")


class TimedQueue(HttpQueue):
    """The real client, each door call timed for the host's figures (claims that may wait,
    `claim_wait`, apart from those that do not, `claim`)."""

    recorder: Recorder

    def _timed(self, name: str, call: Callable[[], Any]) -> Any:
        started = time.monotonic()
        try:
            result = call()
        except QueueError:
            with self.recorder.lock:
                self.recorder.failed[name] += 1
            raise
        self.recorder.call(name, time.monotonic() - started, self.retried)
        return result

    def claim(self, worker: str, count: int = 1, block_s: float = 0.0) -> Any:
        return self._timed(
            "claim_wait" if block_s else "claim", lambda: super(TimedQueue, self).claim(worker, count, block_s)
        )

    def heartbeat(self, worker: str, lease_ids: Sequence[str]) -> Any:
        return self._timed("heartbeat", lambda: super(TimedQueue, self).heartbeat(worker, lease_ids))

    def submit(self, worker: str, lease_id: str, groups: Sequence[Any]) -> Any:
        result = self._timed("submit", lambda: super(TimedQueue, self).submit(worker, lease_id, groups))
        stored = [g for g in groups][: result.stored]
        with self.recorder.lock:
            self.recorder.groups_stored += result.stored
            self.recorder.tokens_stored += sum(sum(c.tokens.size for c in g.completions) for g in stored)
        return result

    def report_status(self, status: Any) -> None:
        self._timed("status", lambda: super(TimedQueue, self).report_status(status))

    def latest_adapter(self) -> Any:
        return self._timed("latest_adapter", lambda: super(TimedQueue, self).latest_adapter())

    def adapter_download(self, version: int) -> Any:
        return self._timed("adapter_urls", lambda: super(TimedQueue, self).adapter_download(version))

    def fetch_adapter_file(self, download: Any, name: str) -> bytes:
        data: bytes = self._timed("adapter_file", lambda: super(TimedQueue, self).fetch_adapter_file(download, name))
        with self.recorder.lock:
            self.recorder.fetched.append((download.manifest.version, len(data)))
        return data


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True)
    p.add_argument("--ca", required=True)
    p.add_argument("--run", default="fleet")
    p.add_argument("--count", type=int, required=True)
    p.add_argument("--name", required=True, help="host name: workers are <name>-w<j>")
    p.add_argument("--stats", type=Path, required=True)
    p.add_argument("--vocab", type=int, required=True)
    p.add_argument("--digits", required=True, help="token ids of the digits 0-9, comma-separated")
    p.add_argument("--tokens-per-s", type=float, default=4000.0)
    p.add_argument("--completion-tokens", type=int, default=32)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--dilation", type=float, default=1.0)
    p.add_argument("--lease-timeout-s", type=float, default=30.0)
    p.add_argument("--grace-s", type=float, default=30.0)
    p.add_argument("--claim-block-s", type=float, default=5.0)
    p.add_argument("--report-every-s", type=float, default=10.0)
    p.add_argument("--join-over-s", type=float, default=2.0, help="workers start spread over this long")
    p.add_argument("--node-cache", type=Path, default=None, help="the host's shared adapter cache (one machine's)")
    args = p.parse_args()
    logging.basicConfig(level=logging.ERROR, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    token = os.environ["SPOTGRPO_TOKEN"]
    digits = [int(d) for d in args.digits.split(",")]
    recorder = Recorder(args.stats)
    stop = threading.Event()
    workers: list[Worker] = []
    recorder.workers = workers  # one list: the signal handler stops them, the recorder reads their flights
    workers_lock = threading.Lock()
    cache = Path(tempfile.mkdtemp(prefix=f"fleet-{args.name}-"))

    def on_signal(signum: int, _frame: object) -> None:
        stop.set()
        with workers_lock:
            for w in workers:
                w.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    def run_worker(j: int) -> None:
        if stop.wait(random.uniform(0, args.join_over_s)):
            return
        worker_id = f"{args.name}-w{j}"
        queue = TimedQueue(
            args.url, token, QueueConfig(run=args.run, lease_timeout_s=args.lease_timeout_s), verify=args.ca
        )
        queue.recorder = recorder
        engine = SimEngine(
            args.vocab,
            digits,
            tokens_per_s=args.tokens_per_s,
            completion_tokens=args.completion_tokens,
            max_num_seqs=args.max_num_seqs,
            dilation=args.dilation,
            seed=hash(worker_id) & 0xFFFFFFFF,
        )
        with recorder.lock:
            recorder.engines.append(engine)

        def loaded(manifest: Any, _seconds: float) -> None:
            with recorder.lock:
                recorder.loads.append((worker_id, manifest.version, time.time()))

        node_cache = NodeCache(args.node_cache) if args.node_cache else None
        watcher = AdapterWatcher(
            queue, ProxySource(queue), engine, cache / f"w{j}", on_loaded=loaded, node_cache=node_cache
        )
        worker = Worker(
            queue,
            engine,
            watcher,
            None,
            worker_id,
            claim_block_s=args.claim_block_s,
            grace_s=args.grace_s,
            report_every_s=args.report_every_s,
        )
        with workers_lock:
            if stop.is_set():
                return
            workers.append(worker)
        try:
            queue.whoami()  # what `actors run` asks first
            watcher.sync()
            watcher.start()
            worker.work()
        except (WorkerRefused, QueueError) as err:
            log.error("%s: %s", worker_id, err)
        finally:
            watcher.close()
            queue.close()

    threads = [threading.Thread(target=run_worker, args=(j,), daemon=True) for j in range(args.count)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        time.sleep(1.0)
        recorder.flush(sum(t.is_alive() for t in threads))
    recorder.flush(0)


if __name__ == "__main__":
    main()
