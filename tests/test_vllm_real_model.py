"""The vllm engine on the real model (SmolLM2-135M-Instruct, `learner make-model`), on
vLLM's CPU build: a completion is capped at the context its prompt leaves, completions
end on the chat template's end-of-turn token, and an exported adapter loads in vLLM and
generates the same first tokens as PEFT does with it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.real_model,
    pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning"),
]
vllm = pytest.importorskip("vllm", reason="the vllm engine is tested in .venv-vllm (make test-vllm)")

from rollouts import perturbed_policy  # noqa: E402

from actors.vllm_engine import VLLMEngine  # noqa: E402
from learner.models import make_model  # noqa: E402
from learner.policy import adapter_files  # noqa: E402
from learner.publish import Publisher, PublishJob  # noqa: E402
from protocol import SamplingParams  # noqa: E402
from protocol.trusted import open_store  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


class _Announcements:
    def announce(self, manifest) -> str:
        return "0-1"


def test_the_real_model_on_vllm_caps_stops_and_serves_an_exported_adapter(tmp_path: Path) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = make_model()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # an adapter far from the base, published to a store and exported as a user would
    policy = perturbed_policy(model, 1, rank=8, scale=0.05)
    store = open_store((tmp_path / "run" / "store").as_uri())
    publisher = Publisher(store, _Announcements(), base_model=str(model), rank=8)
    publisher.submit(PublishJob(1, 1, policy.adapter_state(), policy.adapter_config_json()))
    publisher.close()
    del policy
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "learner.cli",
            "export",
            "--run-dir",
            str(tmp_path / "run"),
            "--out",
            str(tmp_path / "adapter"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, proc.stderr
    assert adapter_files  # the same two files the actors load

    engine = VLLMEngine(str(model), dtype="float32", max_lora_rank=8, max_loras=2, max_model_len=96)
    try:
        end_of_turn = engine.tokenizer.convert_tokens_to_ids("<|im_end|>")
        assert engine.context == 96 and end_of_turn in engine.stop_ids
        story = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": "Write a long story about a cat who learns to count."}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
        )["input_ids"]
        (group,) = engine.generate([story], 2, SamplingParams(temperature=0.8, max_tokens=256, seed=1), 0)
        assert all(len(story) + len(s.token_ids) <= 96 for s in group)
        assert any(s.finish_reason == "length" and len(story) + len(s.token_ids) == 96 for s in group), group
        yes = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": "Say yes."}], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        (group,) = engine.generate([yes], 4, SamplingParams(temperature=0.7, max_tokens=40, seed=2), 0)
        ended = [s for s in group if s.finish_reason == "stop"]
        assert ended and all(s.token_ids[-1] == end_of_turn for s in ended)

        engine.load_adapter(1, tmp_path / "adapter")
        question = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": "Ana has 3 apples and gets 4 more. How many apples does Ana have?"}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
        )["input_ids"]
        (served,) = engine.generate([question], 1, SamplingParams(temperature=0.0, max_tokens=8), 1)
        (base,) = engine.generate([question], 1, SamplingParams(temperature=0.0, max_tokens=8), 0)
    finally:
        engine.close()
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model), str(tmp_path / "adapter")).eval()
    out = peft.generate(input_ids=torch.tensor([question]), do_sample=False, max_new_tokens=8, pad_token_id=2)
    expected = out[0, len(question) :].tolist()
    expected = expected[: expected.index(2) + 1] if 2 in expected else expected  # generate pads after the end
    assert served[0].token_ids[:4] == expected[:4], (served[0].token_ids, expected)
    assert served[0].token_ids != base[0].token_ids  # the adapter is in use
