"""Episodes on the vLLM engine (CPU build, `make test-vllm`): the model's later turns are
vLLM requests continuing the episode's tokens, on the adapter version it started with,
scheduled beside every other request while a tool runs."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning"),
]
vllm = pytest.importorskip("vllm", reason="the vllm engine is tested in .venv-vllm (make test-vllm)")

from rollouts import perturbed_policy  # noqa: E402
from scripted import FirstTurnCalls  # noqa: E402

from actors.engine import GroupRequest  # noqa: E402
from actors.episodes import EpisodeEngine, episode_request  # noqa: E402
from actors.tools import Toolbox  # noqa: E402
from actors.vllm_engine import VLLMEngine  # noqa: E402
from learner.policy import adapter_files  # noqa: E402
from protocol import SamplingParams  # noqa: E402
from protocol.usercode.chat import HERMES_CHATML, load_tools, tool_template  # noqa: E402


class Engine(FirstTurnCalls, VLLMEngine):
    pass


def test_episodes_on_the_vllm_engine(tiny_chatml_model: Path, tmp_path: Path) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    policy = perturbed_policy(tiny_chatml_model, 1)
    (tmp_path / "v1").mkdir()
    for name, data in adapter_files(policy.adapter_state(), policy.adapter_config_json()).items():
        (tmp_path / "v1" / name).write_bytes(data)
    inner = Engine(str(tiny_chatml_model), dtype="float32", max_lora_rank=8, max_loras=2, max_model_len=2048)
    toolbox = Toolbox(["toy_tools:slow_add", "toy_tools:add"], timeout_s=5.0)
    engine = EpisodeEngine(inner, toolbox, tool_template(inner.tokenizer))
    try:
        engine.load_adapter(1, tmp_path / "v1")
        tok = inner.tokenizer
        text = tok.apply_chat_template(
            [{"role": "user", "content": "what is 2+3"}],
            add_generation_prompt=True,
            tokenize=False,
            chat_template=HERMES_CHATML,
            tools=load_tools(["toy_tools:add"]),
        )
        ids = tok(text, add_special_tokens=False)["input_ids"]
        greedy = SamplingParams(temperature=0.0, max_tokens=300)
        engine.add([episode_request(GroupRequest("episode", ids, 2, greedy, 1), 1)])
        done: dict = {}
        plain = 0
        started = time.monotonic()
        while "episode" not in done:
            assert time.monotonic() - started < 120
            if engine.in_flight < 4:  # other leases' requests, meanwhile
                engine.add([GroupRequest(("plain", plain), [5, 6, 7], 2, SamplingParams(max_tokens=4), 0)])
                plain += 1
            done.update(engine.step(0.05))
        assert sum(1 for k in done if k != "episode") >= 2  # generated while the tool ran
        for s in done["episode"]:
            assert s.mask is not None and s.turns == 2 and s.tool_calls == 1 and s.tool_errors == 0
            second = s.mask.index(1, s.mask.index(0))
            glue = tok.decode(s.token_ids[s.mask.index(0) : second])
            assert "<tool_response>\n5\n</tool_response>" in glue
            alone = VLLMEngine.generate(
                inner, [ids + s.token_ids[:second]], 1, SamplingParams(temperature=0.0, max_tokens=300 - second), 1
            )[0][0]
            assert s.token_ids[second:] == alone.token_ids  # the second turn continued the episode, on v1
    finally:
        engine.close()
