"""The real model (SmolLM2-135M-Instruct, `learner make-model`) through the machine: the
arithmetic example's first steps, a completion that would overflow the context capped,
a configuration that cannot fit refused, and the exported adapter generating in PEFT
what the actor generated with that version. One training step takes seconds to tens of
seconds on 2 cores, so the run is short and shared by the tests of this module."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from filelock import FileLock

from learner.models import make_model

pytestmark = [pytest.mark.slow, pytest.mark.real_model]

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def real_model() -> Path:
    """Made once per machine (`~/.cache/spotgrpo/models`, or $SPOTGRPO_MODELS), as a user would."""
    return make_model()


def _learner(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "learner.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


@pytest.fixture(scope="module")
def example_run(real_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The arithmetic example's run, made once per test session: pytest-xdist's workers share
    it (the first makes it under a file lock, the others wait and read it)."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # the session's folder, above each worker's own
    run_dir = shared / "arithmetic" / "run"
    with FileLock(shared / "arithmetic.lock"):
        if not (run_dir / "summary.json").exists():
            _run_arithmetic(real_model, run_dir)
    return run_dir


def _run_arithmetic(real_model: Path, run_dir: Path) -> None:
    proc = _learner(
        "run",
        "--example",
        "arithmetic",
        "--run-dir",
        str(run_dir),
        "--steps",
        "3",
        "--actors",
        "1",
        "--eval-max-prompts",
        "6",
        "--model",
        str(real_model),
        "--no-tensorboard",
    )
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.mark.timeout(900)  # the example's run is this test's set-up: ~3 min on 2 cores beside other tests
def test_the_arithmetic_example_trains_the_real_model(example_run: Path) -> None:
    rows = [json.loads(line) for line in (example_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["rejected"] == 0 for r in rows), rows  # nothing too long, nothing malformed
    assert all(r["completions/max_length"] <= 32 for r in rows)
    evals = {
        r["eval/version"]: r for r in (json.loads(x) for x in (example_run / "evals.jsonl").read_text().splitlines())
    }
    assert sorted(evals) == [0, 3] and all(r["eval/prompts"] == 6 and "eval/cut_short" not in r for r in evals.values())
    summary = json.loads((example_run / "summary.json").read_text())
    assert summary["accounting"]["balanced"], summary["accounting"]
    data = [json.loads(line) for line in (example_run / "arithmetic.jsonl").read_text().splitlines()[:3]]
    assert all(row["answer"].split("#### ")[1].isdigit() and row["prompt"][0]["role"] == "system" for row in data)


@pytest.mark.timeout(900)  # 2-5 min on 2 cores, more beside other work or when the first groups are flat
def test_the_calculator_example_runs_episodes_on_the_real_model(real_model: Path, tmp_path: Path) -> None:
    """Its first step: SmolLM2 offered the add tool through the ChatML fallback template,
    episodes on the actor, the answer scored on the trusted tier, the shape reported. One
    group a step: the untrained model's groups are often flat (all wrong), and each flat
    pair of groups cost a batch of episodes (over 600 s once, beside the chaos test)."""
    run_dir = tmp_path / "run"
    proc = _learner(
        "run",
        "--example",
        "calculator",
        "--run-dir",
        str(run_dir),
        "--steps",
        "1",
        "--groups-per-step",
        "1",
        "--actors",
        "1",
        "--eval-every",
        "0",
        "--model",
        str(real_model),
        "--no-tensorboard",
        timeout=840,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "episodes use Qwen2.5's ChatML tool template" in proc.stderr
    [row] = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert row["rejected"] == 0 and row["turns_mean"] >= 1.0 and 0.0 < row["model_token_frac"] <= 1.0, row
    assert row["completions/max_length"] <= 96


@pytest.mark.timeout(900)  # the example's run, if this test comes first (or waits for it on another worker)
def test_the_exported_adapter_generates_what_the_actor_generated(
    example_run: Path, real_model: Path, tmp_path: Path
) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from actors.hf_engine import TransformersEngine
    from protocol import SamplingParams

    proc = _learner("export", "--run-dir", str(example_run), "--out", str(tmp_path / "adapter"))
    assert proc.returncode == 0, proc.stderr
    version = int(proc.stdout.split("adapter v", 1)[1].split()[0])
    engine = TransformersEngine(str(real_model))
    engine.load_adapter(version, example_run / "store" / "adapters" / f"v{version}")
    messages = [{"role": "user", "content": "Ana has 3 apples and gets 4 more. How many apples does Ana have?"}]
    prompt = engine.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    (actor,) = engine.generate([prompt], 1, SamplingParams(temperature=0.0, max_tokens=12), version)
    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(real_model), str(tmp_path / "adapter")
    ).eval()
    out = model.generate(
        input_ids=torch.tensor([prompt]),
        do_sample=False,
        max_new_tokens=12,
        eos_token_id=list(engine.stop_ids),
        pad_token_id=engine.tokenizer.pad_token_id,
    )
    peft_tokens = out[0, len(prompt) :].tolist()
    ends = [i for i, t in enumerate(peft_tokens) if t in engine.stop_ids]
    peft_tokens = peft_tokens[: ends[0] + 1] if ends else peft_tokens  # generate pads after the end
    assert peft_tokens[:8] == actor[0].token_ids[:8]


def test_completions_stop_at_end_of_turn_and_are_capped_at_the_context(real_model: Path, tmp_path: Path) -> None:
    """The same weights with a context of 96: a chat prompt of ~50 tokens and max_tokens
    256 get the rest of the context and end `length`; free to stop, they end on <|im_end|>."""
    from actors.hf_engine import TransformersEngine
    from protocol import SamplingParams

    short = tmp_path / "short-context"
    short.mkdir()
    for item in real_model.iterdir():
        if item.name != "config.json":
            (short / item.name).symlink_to(item)
    config = json.loads((real_model / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 96}))
    engine = TransformersEngine(str(short))
    end_of_turn = engine.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert engine.context == 96 and end_of_turn in engine.stop_ids
    messages = [{"role": "user", "content": "Write a long story about a cat who learns to count."}]
    prompt = engine.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    (group,) = engine.generate([prompt], 2, SamplingParams(temperature=0.8, max_tokens=256, seed=1), 0)
    assert all(len(prompt) + len(s.token_ids) <= 96 for s in group)
    assert any(s.finish_reason == "length" and len(prompt) + len(s.token_ids) == 96 for s in group), group
    messages = [{"role": "user", "content": "Say yes."}]
    prompt = engine.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    (group,) = engine.generate([prompt], 4, SamplingParams(temperature=0.7, max_tokens=40, seed=2), 0)
    ended = [s for s in group if s.finish_reason == "stop"]
    assert ended and all(s.token_ids[-1] == end_of_turn for s in ended)
    shutil.rmtree(short)


def test_a_configuration_that_cannot_fit_is_refused_on_the_real_model(real_model: Path, tmp_path: Path) -> None:
    proc = _learner(
        "run",
        "--example",
        "arithmetic",
        "--run-dir",
        str(tmp_path / "run"),
        "--model",
        str(real_model),
        "--max-tokens",
        "8180",
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "do not fit in the model's context of 8192" in proc.stderr and "lower --max-tokens" in proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
