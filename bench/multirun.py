"""One fleet, several runs: a worker serving N runs on one engine against the same runs
each on its own worker and engine.

Each run has its own adapter (published through the real publisher and loaded by the
run's own watcher) and a backlog that never runs dry; the worker loops are the real
`actors.worker.Worker`, in threads of this process, on fakeredis queues (the scheduling
is measured, not the door). Per N in `--runs` (weights 1, 2, ... N):

- **alone**: one worker serving one run: groups/s, the engine's busy fraction (sampled
  every 10 ms: sequences in flight). The baseline of the ratios below.
- **shared**: one worker serving the N runs on one engine: groups/s per run and in all,
  the busy fraction, and the fairness error: max over runs of |share - weight share| /
  weight share, by groups stored (target within +-10 %).
- **separate**: N workers, each its own engine and run, side by side: groups/s per run
  and in all, and the engines' base-model bytes (N copies against one).
- **new run**: while the shared worker is busy, a run with no backlog gets its first
  prompts: seconds until its first group is stored.

The transformers engine batches a lease at a time per adapter, so several runs cost it
batch size; vLLM (`--engine vllm`, on a GPU) batches requests of different LoRAs in one
step (`max_loras`: each run's kept versions).

    python bench/multirun.py [--runs 2,4] [--seconds 20] [--engine transformers|vllm]
        [--model PATH] [--json figures.json]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import json
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import fakeredis
import torch

from actors.engine import Engine, open_engine
from actors.runs import AdapterSlots, RunEngine, RunLink
from actors.watcher import AdapterWatcher
from actors.worker import Worker
from learner.config import LearnerConfig
from learner.policy import Policy
from learner.publish import Publisher, PublishJob
from learner.tiny import save_tiny
from protocol import Prompt, PromptBatch, QueueConfig, RunShare, SamplingParams
from protocol.trusted import RedisQueue
from protocol.trusted.store import StoreSource, open_store

PROMPTS_PER_BATCH, GENERATIONS, TOKENS = 2, 4, 16


@dataclass
class Rig:
    """Queues on one fake Redis server, a store per run, each run's adapter v1 published."""

    model: Path
    tmp: Path
    server: Any = field(default_factory=lambda: fakeredis.FakeServer(version=(7, 0)))
    issued: dict[str, int] = field(default_factory=dict)
    slots: dict[int, AdapterSlots] = field(default_factory=dict)
    """Each engine's adapter numbers, for its whole life (the runs it served before kept theirs)."""

    def queue(self, run: str) -> RedisQueue:
        return RedisQueue(fakeredis.FakeRedis(server=self.server, version=(7, 0)), QueueConfig(run=run))

    def store(self, run: str) -> Any:
        return open_store(str(self.tmp / "store" / run))

    def open_run(self, run: str, weight: float, state: dict[str, torch.Tensor], config: bytes, backlog: int) -> None:
        queue = self.queue(run)
        queue.set_run_share(RunShare(weight=weight))
        publisher = Publisher(self.store(run), queue, base_model="bench", rank=8)
        publisher._publish(PublishJob(1, 1, state, config))  # uploaded and announced before the clock starts
        publisher.close()
        self.feed(run, backlog)
        queue.close()

    def feed(self, run: str, batches: int) -> None:
        queue, first = self.queue(run), self.issued.get(run, 0)
        sampling = SamplingParams(temperature=1.0, max_tokens=TOKENS)
        queue.add_prompts(
            [
                PromptBatch(
                    batch_id=f"{run}-{b}",
                    prompts=[Prompt(id=f"p{i}", text=f"{run} {b} {i}:") for i in range(PROMPTS_PER_BATCH)],
                    num_generations=GENERATIONS,
                    sampling=sampling,
                    learner_version=1,
                    issued_at=time.time(),
                    scoring="trusted",  # the worker only generates: its groups wait for a scoring tier
                )
                for b in range(first, first + batches)
            ]
        )
        self.issued[run] = first + batches
        queue.close()

    def stored(self, run: str) -> int:
        queue = self.queue(run)
        try:
            unscored = queue.stats().unscored
            return 0 if unscored is None else unscored.length
        finally:
            queue.close()


def link_for(rig: Rig, run: str, engine: Engine) -> RunLink:
    queue = rig.queue(run)
    view = RunEngine(engine, run, rig.slots.setdefault(id(engine), AdapterSlots()))
    watcher = AdapterWatcher(queue, StoreSource(rig.store(run)), view, rig.tmp / "cache" / f"{run}-{id(engine)}")
    watcher.sync()
    watcher.start()
    return RunLink(run, queue, watcher, view)


class Busy:
    """The fraction of samples (every 10 ms) at which the engines had sequences in flight."""

    def __init__(self, engines: list[Engine]) -> None:
        self.engines, self.samples, self.busy = engines, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            for engine in self.engines:
                self.samples += 1
                self.busy += engine.in_flight > 0

    def __enter__(self) -> Busy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def fraction(self) -> float:
        return self.busy / max(1, self.samples)


def serve(rig: Rig, groups: list[tuple[Engine, list[str]]], seconds: float, new_run: str | None = None) -> dict:
    """Worker loops, one per (engine, runs), for `seconds`: groups/s per run and the busy
    fraction; with `new_run` (served by the first, no backlog), its prompts come halfway
    and the seconds until its first group are measured."""
    workers, links, loops = [], [], []
    for engine, runs in groups:
        served = [*runs, *([new_run] if new_run and not workers else [])]
        mine = [link_for(rig, run, engine) for run in served]
        links += mine
        worker = Worker(
            mine[0].queue, engine, mine[0].watcher, None, f"w{len(workers)}", claim_block_s=0.5, more_runs=mine[1:]
        )
        workers.append(worker)
    for engine, _ in groups:  # warm-up, outside the clock
        engine.generate([[5, 6, 7]], 2, SamplingParams(max_tokens=4), 0)
    before = {link.run: rig.stored(link.run) for link in links}
    first_group_s = None
    with Busy([engine for engine, _ in groups]) as busy:
        loops = [threading.Thread(target=w.work, daemon=True) for w in workers]
        started = time.monotonic()
        for loop in loops:
            loop.start()
        if new_run:
            time.sleep(seconds / 2)
            rig.feed(new_run, 4)
            fed = time.monotonic()
            while rig.stored(new_run) == 0 and time.monotonic() - fed < seconds:
                time.sleep(0.01)
            first_group_s = time.monotonic() - fed
            time.sleep(max(0.0, started + seconds - time.monotonic()))
        else:
            time.sleep(seconds)
        elapsed = time.monotonic() - started
        counts = {link.run: rig.stored(link.run) - before[link.run] for link in links}
    for worker in workers:
        worker.stop()
        worker.abort.set()
    for loop in loops:
        loop.join(timeout=60)
    for link in links:
        link.watcher.close()
        link.queue.close()
    return {
        "groups_per_s": {run: n / elapsed for run, n in counts.items()},
        "busy": busy.fraction,
        "first_group_s": first_group_s,
    }


def fairness_error(per_run: dict[str, float], weights: dict[str, float]) -> float:
    total, wsum = sum(per_run[r] for r in weights), sum(weights.values())
    return max(abs(per_run[r] / total - w / wsum) / (w / wsum) for r, w in weights.items())


def weights_mib(engines: list[Engine]) -> str:
    """The engines' weights in memory, base and adapters (the transformers engine's; "-" for
    vLLM's, whose weights live in its engine process)."""
    models = [getattr(engine, "base", None) for engine in engines]
    if any(model is None for model in models):
        return "-"
    return f"{sum(p.numel() * p.element_size() for m in models for p in m.parameters()) / 2**20:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", default="2,4", help="run counts to measure (default 2,4)")
    parser.add_argument("--seconds", type=float, default=20.0, help="each measurement's length (default 20)")
    parser.add_argument("--engine", choices=["transformers", "vllm"], default="transformers")
    parser.add_argument("--model", type=Path, default=None, help="base model (default: the tiny test model)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    counts = [int(n) for n in args.runs.split(",")]
    figures: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        model = args.model or save_tiny(tmp / "tiny")
        policy = Policy(LearnerConfig(model=str(model), lora_rank=8, lora_alpha=16))
        config = policy.adapter_config_json()
        states = []
        for i in range(max(counts) + 2):
            with torch.no_grad():
                for pname, p in policy.model.named_parameters():
                    if "lora_B" in pname:
                        p.normal_(0, 0.01 * (i + 1))
            states.append(policy.adapter_state())
        rig = Rig(model, tmp)
        backlog = 2000

        def engine(runs: int = 1, of: int = 1) -> Engine:
            """An engine for `runs` runs, one of `of` sharing the GPU at once."""
            options: dict[str, Any] = {}
            if args.engine == "vllm":
                memory = 0.3 if of == 1 else 0.5 / of  # the shared engine stays loaded beside the separate ones
                options = {"max_loras": 3 * runs, "gpu_memory_utilization": memory, "max_model_len": 512}
                if not torch.cuda.is_available():  # vLLM's CPU build (.venv-vllm): bfloat16 needs CPU support
                    options["dtype"] = "float32"
            return open_engine(args.engine, str(model), **options)

        print(
            f"bench/multirun.py, {args.engine} engine on {model.name}, {torch.get_num_threads()} threads, "
            f"leases of {PROMPTS_PER_BATCH} prompts x {GENERATIONS} completions, up to {TOKENS} tokens, "
            f"{args.seconds:g} s each"
        )
        rig.open_run("alone", 1.0, states[0], config, backlog)
        shared_engine = engine(max(counts) + 1)
        alone = serve(rig, [(shared_engine, ["alone"])], args.seconds)
        base = alone["groups_per_s"]["alone"]
        print(f"\nalone: {base:.2f} groups/s, engine busy {alone['busy']:.0%} (the baseline)")
        figures["alone"] = alone
        for n in counts:
            runs = [f"n{n}-r{i}" for i in range(n)]
            weights = {run: float(i + 1) for i, run in enumerate(runs)}
            for i, run in enumerate(runs):
                rig.open_run(run, weights[run], states[i], config, backlog)
            rig.open_run(f"n{n}-new", 1.0, states[n], config, 0)
            shared = serve(rig, [(shared_engine, runs)], args.seconds, new_run=f"n{n}-new")
            engines = [engine(1, n) for _ in runs]
            separate = serve(rig, [(e, [run]) for e, run in zip(engines, runs, strict=True)], args.seconds)
            memory = weights_mib(engines)
            for e in engines:
                e.close()
            total_shared = sum(shared["groups_per_s"][r] for r in runs)
            total_separate = sum(separate["groups_per_s"].values())
            error = fairness_error(shared["groups_per_s"], weights)
            print(f"\n{n} runs, weights {', '.join(f'{w:g}' for w in weights.values())}")
            print(f"{'run':>10} {'weight':>6} {'shared g/s':>10} {'share':>6} {'target':>6} {'separate g/s':>12}")
            for run in runs:
                got = shared["groups_per_s"][run]
                print(
                    f"{run:>10} {weights[run]:>6g} {got:>10.2f} {got / total_shared:>6.1%} "
                    f"{weights[run] / sum(weights.values()):>6.1%} {separate['groups_per_s'][run]:>12.2f}"
                )
            print(
                f"{'all':>10} {'':>6} {total_shared:>10.2f} {'':>6} {'':>6} {total_separate:>12.2f}\n"
                f"shared/alone {total_shared / base:.2f}, shared/separate {total_shared / total_separate:.2f}, "
                f"engine busy {shared['busy']:.0%} shared against {separate['busy']:.0%} separate; fairness error "
                f"{error:.1%} (target <= 10 %); engine weights (base and adapters) "
                f"{weights_mib([shared_engine])} MiB shared against {memory} MiB separate; "
                f"a new run's first group {shared['first_group_s']:.2f} s"
                " after its first prompts, on the busy worker"
            )
            figures[f"runs_{n}"] = {
                "shared": shared,
                "separate": separate,
                "fairness_error": error,
                "shared_over_alone": total_shared / base,
                "shared_over_separate": total_shared / total_separate,
            }
        shared_engine.close()
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
