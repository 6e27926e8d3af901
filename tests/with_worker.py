"""A learner run with one real worker loop beside it, in a thread: the loop the actors
run (`actors.worker.Worker`) with an engine, a scorer and an adapter source of the test's
choosing."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from actors.engine import Engine
from actors.watcher import AdapterSource, AdapterWatcher
from actors.worker import Scoring, Worker
from learner.config import LearnerConfig
from learner.loop import Learner
from protocol import QueueConfig
from protocol.trusted import RedisQueue, open_store


def run_with_a_worker(
    cfg: LearnerConfig, actor_queue: Any, source: AdapterSource, engine: Engine, scorer: Scoring | None, cache: Path
) -> tuple[Any, list[dict[str, Any]]]:
    """The learner's state at the end and its metrics rows. The learner reads `cfg.queue`
    (Redis); the worker, `actor_queue` (Redis or the proxy). Everything it was handed is
    closed when the run ends."""
    return run_with_workers(cfg, [WorkerParts("w", actor_queue, source, engine, scorer)], cache)


@dataclass
class WorkerParts:
    """One worker loop's name, queue, adapter source, engine and scorer."""

    name: str
    queue: Any
    source: AdapterSource
    engine: Engine
    scorer: Scoring | None = None
    watcher: type[AdapterWatcher] = AdapterWatcher
    ended: BaseException | None = None
    """How its loop ended, if it raised (a worker the learner quarantined is refused)."""

    def work(self, worker: Worker) -> None:
        try:
            worker.work()
        except BaseException as err:  # kept for the test to look at, not lost in a thread
            self.ended = err


def run_with_workers(cfg: LearnerConfig, workers: list[WorkerParts], cache: Path) -> tuple[Any, list[dict[str, Any]]]:
    """`run_with_a_worker` with several worker loops, each in its own thread."""
    running = []
    for parts in workers:
        watcher = parts.watcher(parts.queue, parts.source, parts.engine, cache / parts.name, poll_s=0.2)
        watcher.start()
        worker = Worker(parts.queue, parts.engine, watcher, parts.scorer, parts.name, claim_block_s=0.2)
        loop = threading.Thread(target=parts.work, args=(worker,))
        loop.start()
        running.append((parts, watcher, worker, loop))
    learner_queue = RedisQueue.from_url(cfg.queue, QueueConfig(run=cfg.run))
    try:
        state = Learner(cfg, learner_queue, open_store(cfg.store)).run()
    finally:
        for parts, watcher, worker, loop in running:
            worker.stop()
            loop.join(timeout=60)
            watcher.close()
            parts.engine.close()
            parts.queue.close()
        learner_queue.close()
    rows = [json.loads(line) for line in (cfg.resolved_run_dir / "metrics.jsonl").read_text().splitlines()]
    return state, rows
