"""A learner run with one real worker loop beside it, in a thread: the loop the actors
run (`actors.worker.Worker`) with an engine, a scorer and an adapter source of the test's
choosing."""

from __future__ import annotations

import json
import threading
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
    watcher = AdapterWatcher(actor_queue, source, engine, cache, poll_s=0.2)
    watcher.start()
    worker = Worker(actor_queue, engine, watcher, scorer, "w", claim_block_s=0.2)
    loop = threading.Thread(target=worker.work)
    loop.start()
    learner_queue = RedisQueue.from_url(cfg.queue, QueueConfig(run=cfg.run))
    try:
        state = Learner(cfg, learner_queue, open_store(cfg.store)).run()
    finally:
        worker.stop()
        loop.join(timeout=60)
        watcher.close()
        engine.close()
        learner_queue.close()
        actor_queue.close()
    rows = [json.loads(line) for line in (cfg.resolved_run_dir / "metrics.jsonl").read_text().splitlines()]
    return state, rows
