"""A rollout worker running episodes whose first turn calls `hang` (a random tiny model
never writes a tool call): `python tests/episode_actor.py REDIS_URL RUN WORKER STORE MODEL`.
The real work loop, engine (transformers), tools sandbox and queue; only the first turn is
scripted. For the test that SIGKILLs a worker mid-episode."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parent)  # scripted, toy_tools
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))


def main(redis_url: str, run: str, worker_id: str, store: str, model: str) -> None:
    import tempfile

    from scripted import FirstTurnCalls, tool_call

    from actors.episodes import EpisodeEngine
    from actors.hf_engine import TransformersEngine
    from actors.tools import Toolbox
    from actors.watcher import AdapterWatcher
    from actors.worker import Worker
    from protocol import QueueConfig
    from protocol.trusted import RedisQueue, open_store
    from protocol.trusted.store import StoreSource
    from protocol.usercode.chat import tool_template

    class Engine(FirstTurnCalls, TransformersEngine):
        FIRST_CALL = tool_call("hang", seconds=60)

    queue = RedisQueue.from_url(redis_url, QueueConfig(run=run, lease_timeout_s=2))
    inner = Engine(model)
    engine = EpisodeEngine(
        inner, Toolbox(["toy_tools:add", "toy_tools:hang"], timeout_s=120), tool_template(inner.tokenizer)
    )
    watcher = AdapterWatcher(queue, StoreSource(open_store(store)), engine, Path(tempfile.mkdtemp()))
    print("working", flush=True)
    Worker(queue, engine, watcher, None, worker_id, claim_block_s=0.5).work()


if __name__ == "__main__":
    main(*sys.argv[1:6])
