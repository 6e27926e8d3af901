"""Episodes on the `vllm` engine: the engine kept busy while tools run, against the same
episodes run lease after lease, the synchronous way.

Each episode: a first turn that calls a tool (scripted: a random tiny model never writes a
tool call; `tests/scripted.FirstTurnCalls`), the tool (`toy_tools:slow_add`, which sleeps
0.2 s, in the actor's sandbox: `--tool-workers` processes), then a second turn of up to
`--tokens` tokens that vLLM generates on the episode's whole prefix. A lease is
`--prompts` prompts x `--n` episodes.

- pipelined: `actors.episodes.EpisodeEngine`, as the worker drives it, with 1, 4 and 16
  leases' groups kept in the engine (a lease is added as soon as another finishes);
- synchronous (TRL's tool loop, one lease at a time): the lease's first turns, then its
  tool calls (all at once, on the same sandbox), then its second turns as one batch.

Prints episodes/s and generated tokens/s for each, and the ratio to the synchronous run.
Needs vLLM (`.venv-vllm`): `VLLM_CPU_KVCACHE_SPACE=1 python bench/episodes.py`.
"""

from __future__ import annotations

import sys
from pathlib import Path

# run as a script, this folder would come first on the path and shadow packages
sys.path[0] = str(Path(__file__).resolve().parents[1])
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "tests"))  # scripted, toy_tools

import argparse
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--leases", type=int, nargs="+", default=[1, 4, 16], help="leases in flight to measure")
    parser.add_argument("--batches", type=int, default=16, help="leases of work per measurement")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32, help="most tokens of the generated (second) turn")
    parser.add_argument("--tool-workers", type=int, default=8)
    args = parser.parse_args()

    from scripted import FirstTurnCalls

    from actors.engine import GroupRequest
    from actors.episodes import EpisodeEngine, episode_request
    from actors.tools import Toolbox
    from actors.vllm_engine import VLLMEngine
    from learner.tiny import save_tiny
    from protocol import SamplingParams
    from protocol.usercode.chat import load_tools, tool_result_ids, tool_template

    class Engine(FirstTurnCalls, VLLMEngine):
        FIRST_CALL = '<tool_call>\n{"name": "slow_add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'

    model = save_tiny(Path(tempfile.mkdtemp(prefix="spotgrpo-episodes-")) / "model", chatml=True, max_positions=4096)
    inner = Engine(str(model), dtype="float32", max_lora_rank=8, max_loras=2, max_model_len=2048)
    toolbox = Toolbox(["toy_tools:slow_add"], timeout_s=10.0, workers=args.tool_workers)
    template = tool_template(inner.tokenizer)
    engine = EpisodeEngine(inner, toolbox, template)
    tok = inner.tokenizer
    prompts = []
    for i in range(args.prompts):
        text = tok.apply_chat_template(
            [{"role": "user", "content": f"what is {i}+{i + 1}"}],
            tools=load_tools(["toy_tools:slow_add"]),
            chat_template=template,
            add_generation_prompt=True,
            tokenize=False,
        )
        prompts.append(tok(text, add_special_tokens=False)["input_ids"])
    first = [*tok(Engine.FIRST_CALL, add_special_tokens=False)["input_ids"], inner.stop_ids[0]]
    glue = tool_result_ids(tok, template, [("slow_add", "5")], inner.stop_ids)
    budget = len(first) + len(glue) + args.tokens  # the call, the result's tokens, the answer: both ways alike
    episodes_per_run = args.batches * args.prompts * args.n
    warm = [toolbox.call("slow_add", {"a": 1, "b": 1}) for _ in range(args.tool_workers)]
    while not all(f.done() for f in warm):  # the sandbox's processes started before any clock
        time.sleep(0.05)

    def generated(samples) -> int:
        return sum(sum(s.mask) - len(first) if s.mask else len(s.token_ids) - len(first) for s in samples)

    def synchronous(batches: int = args.batches) -> tuple[float, int]:
        started, tokens = time.perf_counter(), 0
        for _ in range(batches):
            results = [toolbox.call("slow_add", {"a": 2, "b": 3}) for _ in range(args.prompts * args.n)]
            while not all(f.done() for f in results):
                time.sleep(0.005)
            assert all(f.result().content == "5" for f in results)
            continued = [p + first + glue for p in prompts]
            out = VLLMEngine.generate(inner, continued, args.n, SamplingParams(max_tokens=args.tokens), 0)
            tokens += sum(len(s.token_ids) for group in out for s in group)
        return time.perf_counter() - started, tokens

    def pipelined(leases: int, batches: int = args.batches) -> tuple[float, int]:
        started, tokens, added, open_leases = time.perf_counter(), 0, 0, {}
        while added < batches or open_leases:
            while len(open_leases) < leases and added < batches:
                lease = added
                added += 1
                open_leases[lease] = args.prompts
                engine.add(
                    [
                        episode_request(GroupRequest((lease, i), p, args.n, SamplingParams(max_tokens=budget), 0), 1)
                        for i, p in enumerate(prompts)
                    ]
                )
            for (lease, _), samples in engine.step(0.02):
                tokens += generated(samples)
                open_leases[lease] -= 1
                if not open_leases[lease]:
                    del open_leases[lease]
        return time.perf_counter() - started, tokens

    print(
        f"episodes: {args.batches} leases x {args.prompts} prompts x {args.n}; a {0.2:g} s tool per episode; "(
            f"second turns of up to {args.tokens} tokens; vLLM "
            f"{inner.engine.vllm_config.cache_config.enable_prefix_caching=}"
        )
    )
    synchronous(2), pipelined(2, 2)  # warm: vLLM's first steps, its prefix cache, the sandbox
    sync_s, sync_tokens = synchronous()
    print(
        f"synchronous (lease after lease): {episodes_per_run / sync_s:7.1f} episodes/s "
        f"{sync_tokens / sync_s:8.1f} tokens/s  ({sync_s:.1f} s)"
    )
    for leases in args.leases:
        took, tokens = pipelined(leases)
        print(
            f"pipelined, {leases:2d} leases in flight:   {episodes_per_run / took:7.1f} episodes/s "
            f"{tokens / took:8.1f} tokens/s  ({took:.1f} s)  {sync_s / took:.2f}x the synchronous episodes/s"
        )
    again, _ = synchronous()
    print(f"synchronous again:               {episodes_per_run / again:7.1f} episodes/s  ({again:.1f} s)")
    engine.close()


if __name__ == "__main__":
    main()
