"""Actor throughput with and without adapter hot-swaps, and announce-to-loaded time.

1. The transformers engine on the tiny test model: completions/s and tokens/s over a
   run of batches, with no adapter change (the baseline, same process) and with a new
   adapter announced every k batches (downloaded, verified and loaded by the watcher
   thread while the loop generates).
2. Time from `announce` to the watcher having the version loaded, for LoRA ranks 1, 16
   and 64 on a model with Qwen2.5-0.5B's layer shapes (file:// store, fakeredis
   pub/sub), with the adapter size.

Usage: python bench/actor.py [--batches 12] [--swap-every 2] [--ranks 1 16 64]
"""

from __future__ import annotations

import sys
from pathlib import Path

# run as a script, this folder would come first on the path and shadow packages
sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import statistics
import tempfile
import time

import fakeredis
import torch

from actors.hf_engine import TransformersEngine
from actors.watcher import AdapterWatcher
from learner.config import LearnerConfig
from learner.policy import Policy
from learner.publish import Publisher, PublishJob
from learner.tiny import QWEN25_05B_SHAPE, save_tiny
from protocol import QueueConfig, SamplingParams
from protocol.trusted import RedisQueue
from protocol.trusted.store import StoreSource, open_store


def fake_queue_factory():
    server = fakeredis.FakeServer(version=(7, 0))
    return lambda: RedisQueue(fakeredis.FakeRedis(server=server, version=(7, 0)), QueueConfig(run="bench"))


def adapter_snapshots(model_dir: Path, rank: int, count: int) -> tuple[list[dict[str, torch.Tensor]], bytes]:
    policy = Policy(LearnerConfig(model=str(model_dir), lora_rank=rank, lora_alpha=2 * rank))
    out = []
    for i in range(count):
        with torch.no_grad():
            for name, p in policy.model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.01 * (i + 1))
        out.append(policy.adapter_state())
    return out, policy.adapter_config_json()


def throughput(
    model_dir: Path, tmp: Path, batches: int, swap_every: int | None, prompts: int, n: int, tokens: int
) -> tuple[float, float, int]:
    make = fake_queue_factory()
    store = open_store(str(tmp / f"store-{swap_every}"))
    engine = TransformersEngine(str(model_dir))
    watcher = AdapterWatcher(make(), StoreSource(store), engine, tmp / f"cache-{swap_every}", poll_s=0.5).start()
    publisher = Publisher(store, make(), base_model="bench", rank=8)
    states, config = adapter_snapshots(model_dir, 8, 4)
    sampling = SamplingParams(temperature=1.0, max_tokens=tokens)
    prompt_ids = [[5 + i, 6 + i, 7 + i, 8 + i] for i in range(prompts)]
    engine.generate(prompt_ids, n, sampling, 0)  # warm-up
    done_tokens, version = 0, 0
    started = time.perf_counter()
    for b in range(batches):
        if swap_every and b % swap_every == 0:
            version += 1
            publisher.submit(PublishJob(version, b, states[version % len(states)], config))
        samples = engine.generate(prompt_ids, n, sampling, watcher.current)
        done_tokens += sum(len(s.token_ids) for g in samples for s in g)
    elapsed = time.perf_counter() - started
    publisher.close()
    watcher.close()
    swaps = len(watcher.load_s)
    return batches * prompts * n / elapsed, done_tokens / elapsed, swaps


def announce_to_loaded(model_dir: Path, tmp: Path, rank: int, repeats: int) -> tuple[float, float, float]:
    make = fake_queue_factory()
    store = open_store(str(tmp / f"store-r{rank}"))
    states, config = adapter_snapshots(model_dir, rank, repeats)
    engine = TransformersEngine(str(model_dir))
    watcher = AdapterWatcher(make(), StoreSource(store), engine, tmp / f"cache-r{rank}", poll_s=5.0).start()
    time.sleep(0.5)  # subscribed
    queue = make()
    publisher = Publisher(store, queue, base_model="bench", rank=rank)
    times = []
    for version, state in enumerate(states, start=1):
        # upload first, so only announce -> loaded is timed
        publisher._publish(PublishJob(version, version, state, config))
        announced = time.perf_counter()
        while watcher.current != version:
            time.sleep(0.001)
        times.append(time.perf_counter() - announced)
    size_mb = sum(f.size for f in store.read_manifest(1).files) / 2**20
    watcher.close()
    publisher.close()
    del engine
    return size_mb, statistics.median(times), max(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=12)
    parser.add_argument("--swap-every", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        tiny = save_tiny(tmp / "tiny")
        print(
            f"1. transformers engine, tiny Llama (2 layers, hidden 64), {torch.get_num_threads()} threads: "(
                f"{args.batches} batches of {args.prompts} prompts x {args.generations} completions, up to "
                f"{args.tokens} tokens"
            )
        )
        base_cps, base_tps, _ = throughput(tiny, tmp, args.batches, None, args.prompts, args.generations, args.tokens)
        swap_cps, swap_tps, swaps = throughput(
            tiny, tmp, args.batches, args.swap_every, args.prompts, args.generations, args.tokens
        )
        print(f"{'':>22} {'completions/s':>14} {'tokens/s':>9}")
        print(f"{'no swap (baseline)':>22} {base_cps:>14.1f} {base_tps:>9.0f}")
        print(
            f"{f'swap every {args.swap_every} batches':>22} {swap_cps:>14.1f} {swap_tps:>9.0f}   ({swaps} "
            f"swaps; ratio {swap_cps / base_cps:.3f})"
        )

        shaped = save_tiny(tmp / "qwen-shaped", **QWEN25_05B_SHAPE)
        print(f"\n2. announce -> loaded, Qwen2.5-0.5B-shaped model, file:// store, {args.repeats} versions per rank")
        print(f"{'rank':>5} {'adapter MB':>10} {'median s':>9} {'max s':>7}")
        for rank in args.ranks:
            size, median, worst = announce_to_loaded(shaped, tmp, rank, args.repeats)
            print(f"{rank:>5} {size:>10.2f} {median:>9.3f} {worst:>7.3f}")


if __name__ == "__main__":
    main()
