"""One actor's throughput on the `vllm` engine against vLLM's own ceiling, in one process.

The same work (leases of `--prompts` prompts x `--n` completions of up to `--tokens`
tokens, with a LoRA adapter) is generated:
1. by vLLM's `LLM.generate` on every prompt at once, with the same sampling, adapter and
   processed log-probabilities: the ceiling;
2. by the actor's work loop (`actors.worker.Worker`, the real one, on an in-process
   queue) with 1, 4 and 16 leases in flight (`max_num_seqs` = that many leases' worth of
   sequences), scoring with a trivial reward inline.
It prints completions/s and tokens/s for each and the ratio to the ceiling.

Needs vLLM (`.venv-vllm`, or a GPU machine): `python bench/actor_vllm.py [--leases 1 4 16]`.
On a CPU, set VLLM_CPU_KVCACHE_SPACE=1 (GiB). The engine core runs in its own process, as vLLM
does by default, unless this process may use only one core (then in this one: see
actors/vllm_engine.py); VLLM_ENABLE_V1_MULTIPROCESSING=0/1 decides it either way.
"""

from __future__ import annotations

import sys
from pathlib import Path

# run as a script, this folder would come first on the path and shadow packages
sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import os
import tempfile
import time

import fakeredis


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--leases", type=int, nargs="+", default=[1, 4, 16], help="leases in flight to measure")
    parser.add_argument("--batches", type=int, default=32, help="leases of work per measurement")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--model", default=None, help="a model directory (default: the tiny test model)")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    from vllm import SamplingParams as VSamplingParams
    from vllm.lora.request import LoRARequest

    from actors.vllm_engine import VLLMEngine
    from actors.watcher import AdapterWatcher
    from actors.worker import Worker
    from learner.policy import adapter_files
    from learner.tiny import save_tiny
    from protocol import Prompt, PromptBatch, QueueConfig, SamplingParams, pack_i32
    from protocol.trusted import RedisQueue, open_store
    from protocol.trusted.store import StoreSource
    from protocol.usercode.rewards import Scorer, load_reward

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from rollouts import perturbed_policy

    tmp = Path(tempfile.mkdtemp(prefix="bench-actor-vllm-"))
    model = Path(args.model) if args.model else save_tiny(tmp / "model")
    policy = perturbed_policy(model, seed=1, rank=8)
    (tmp / "v1").mkdir()
    for name, data in adapter_files(policy.adapter_state(), policy.adapter_config_json()).items():
        (tmp / "v1" / name).write_bytes(data)
    widest = max(args.leases) * args.prompts * args.n
    engine = VLLMEngine(
        str(model), dtype="float32", max_lora_rank=8, max_loras=2, max_model_len=256, max_num_seqs=widest
    )
    engine.load_adapter(1, tmp / "v1")
    prompts = [[5 + (i * 7 + j) % 40 for j in range(6 + i % 5)] for i in range(args.batches * args.prompts)]
    sampling = SamplingParams(temperature=1.0, max_tokens=args.tokens)

    # 1. the ceiling: vLLM's own offline batch, everything at once
    vsampling = VSamplingParams(n=args.n, temperature=1.0, max_tokens=args.tokens, logprobs=0)
    lora = LoRARequest(lora_name="ceiling", lora_int_id=10_000, lora_path=str(tmp / "v1"))
    engine.llm.generate([{"prompt_token_ids": p} for p in prompts[:8]], vsampling, lora_request=lora, use_tqdm=False)
    started = time.perf_counter()
    outs = engine.llm.generate([{"prompt_token_ids": p} for p in prompts], vsampling, lora_request=lora, use_tqdm=False)
    ceiling_s = time.perf_counter() - started
    ceiling_tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    completions = len(prompts) * args.n
    print(
        f"work: {args.batches} leases x {args.prompts} prompts x {args.n} completions, up to {args.tokens} tokens; "
        f"vLLM max_num_seqs {engine.max_num_seqs}"
    )
    print(f"{'':>24} {'completions/s':>14} {'tokens/s':>10} {'ratio':>6}")
    ceiling = completions / ceiling_s
    print(f"{'LLM.generate (ceiling)':>24} {ceiling:>14.1f} {ceiling_tokens / ceiling_s:>10.0f} {1.0:>6.2f}")

    # 2. the work loop with k leases in flight
    for k in args.leases:
        server = fakeredis.FakeServer(version=(7, 0))
        queue = RedisQueue(fakeredis.FakeRedis(server=server, version=(7, 0)), QueueConfig(run=f"bench-{k}"))
        batches = [
            PromptBatch(
                batch_id=f"b{b}",
                num_generations=args.n,
                sampling=sampling,
                learner_version=1,
                issued_at=time.time(),
                prompts=[
                    Prompt(id=f"p{i}", token_ids=pack_i32(prompts[b * args.prompts + i])) for i in range(args.prompts)
                ],
            )
            for b in range(args.batches)
        ]
        queue.add_prompts(batches)
        watcher = AdapterWatcher(queue, StoreSource(open_store(tmp.as_uri())), engine, tmp / f"cache-{k}")
        watcher.current = 1  # the adapter loaded above
        worker = Worker(
            queue,
            engine,
            watcher,
            Scorer([load_reward("bench.actor_vllm:constant")], timeout_s=None),
            "bench",
            claim_block_s=0.0,
            max_num_seqs=k * args.prompts * args.n,
        )
        started = time.perf_counter()
        worker.work(max_batches=args.batches)
        took = time.perf_counter() - started
        groups = [d.group for d in queue.read_rollouts("bench", 10_000)]
        assert len(groups) == args.batches * args.prompts, len(groups)
        tokens = sum(c.tokens.size for g in groups for c in g.completions)
        rate = completions / took
        print(f"{f'worker, {k} lease(s) in flight':>24} {rate:>14.1f} {tokens / took:>10.0f} {rate / ceiling:>6.2f}")
        queue.close()
    engine.close()


def constant(prompts: list, completions: list, **_: object) -> list[float]:
    """A reward that costs nothing: the benchmark measures generation."""
    return [0.0] * len(completions)


if __name__ == "__main__":
    main()
