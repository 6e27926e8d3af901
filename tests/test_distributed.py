"""The learner on devices and across processes (`learner.dist`): explicit device
placement, FSDP2 under torchrun (gloo, 2 CPU processes here), checkpoints that resume at
another world size, and a rank that dies."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from factories import batch, group, write_dataset
from rollouts import SyntheticActor
from safetensors.torch import load_file
from servers import kill_process

from learner.batch import build_step_batch, plan_micro_batches
from learner.config import LearnerConfig
from learner.loop import CONSUMER
from learner.policy import Policy
from learner.train import train_on
from protocol import QueueConfig
from protocol.trusted import RedisQueue, open_store

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'tests'}", "OMP_NUM_THREADS": "1"}


# ------------------------------------------------------------ one device


def test_micro_batches_follow_a_token_budget() -> None:
    lengths = [10, 3, 7, 10, 2, 5, 9, 1]
    plan = plan_micro_batches(lengths, list(range(8)), max_tokens=24, max_rows=8)
    assert sorted(i for mb in plan for i in mb) == list(range(8))  # every row once
    for mb in plan:  # rows x longest within the budget (or a lone sequence)
        assert len(mb) * max(lengths[i] for i in mb) <= 24 or len(mb) == 1
    assert [lengths[mb[0]] for mb in plan] == sorted((lengths[mb[0]] for mb in plan), reverse=True)
    assert plan[0] == [0, 3]  # the two longest together, not padded beside short ones
    assert plan_micro_batches([100, 4], [0, 1], max_tokens=16, max_rows=8) == [[0], [1]]  # too long: alone
    assert all(len(mb) <= 2 for mb in plan_micro_batches(lengths, list(range(8)), 1000, max_rows=2))


def test_the_step_names_every_tensor_device(tiny_model: Path) -> None:
    """With torch's default device set to `meta`, any tensor the step makes without
    naming its device is a meta tensor, and mixing it with real ones fails: the step
    below runs, so none does."""
    cfg = LearnerConfig(
        model=str(tiny_model),
        lora_rank=4,
        max_tokens=4,
        micro_batch_size=3,
        max_tokens_per_microbatch=16,
        device="cpu",
        advantage_scale="batch",
        mask_truncated_completions=True,
        updates_per_batch=2,
        beta=0.01,
    )
    policy = Policy(cfg)
    optimizer = torch.optim.AdamW(policy.trainable_parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    b = batch(0, prompts=3)
    groups = [group(b, i, tokens=1 + i) for i in range(3)]
    with torch.device("meta"):
        stats = train_on(policy, optimizer, scheduler, build_step_batch(groups, cfg, policy.pad_id), cfg)
    assert stats["skipped_updates"] == 0 and stats["tokens"] > 0
    # and the check has teeth: an implicitly placed tensor does break under it
    with torch.device("meta"), pytest.raises((RuntimeError, NotImplementedError)):
        torch.ones(2) + torch.ones(2, device="cpu")  # what a missing device= leads to


def test_bad_devices_are_refused_with_the_fix() -> None:
    from learner.dist import resolve_device

    assert resolve_device("cpu").type == "cpu"
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device is visible"):
            resolve_device("cuda:0")
    else:
        with pytest.raises(ValueError, match="LOCAL_RANK"):
            resolve_device("cuda:0", distributed=True)
    with pytest.raises(ValueError, match="device"):
        LearnerConfig(device="tpu")


@pytest.mark.gpu
def test_the_step_on_cuda_matches_the_cpu(tiny_model: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    b = batch(0, prompts=3)
    groups = [group(b, i, tokens=2 + i) for i in range(3)]
    results = {}
    for device in ("cpu", "cuda"):
        cfg = LearnerConfig(
            model=str(tiny_model), lora_rank=4, max_tokens=6, device=device, max_tokens_per_microbatch=16
        )
        torch.manual_seed(0)
        policy = Policy(cfg)
        assert all(p.device.type == device for p in policy.model.parameters())
        optimizer = torch.optim.AdamW(policy.trainable_parameters(), lr=1e-3)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        stats = train_on(policy, optimizer, scheduler, build_step_batch(groups, cfg, policy.pad_id), cfg)
        results[device] = (stats, policy.adapter_state())
    assert results["cuda"][0]["tokens"] == results["cpu"][0]["tokens"]
    for name, t in results["cpu"][1].items():
        assert torch.allclose(t, results["cuda"][1][name], atol=1e-4), name


@pytest.mark.gpu
def test_bfloat16_keeps_lora_and_optimizer_state_in_float32(tiny_model: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    cfg = LearnerConfig(
        model=str(tiny_model), lora_rank=4, max_tokens=6, device="cuda", dtype="bfloat16", gradient_checkpointing=True
    )
    policy = Policy(cfg)
    assert {p.dtype for p in policy.trainable_parameters()} == {torch.float32}
    assert {p.dtype for n, p in policy.model.named_parameters() if not p.requires_grad} == {torch.bfloat16}
    optimizer = torch.optim.AdamW(policy.trainable_parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    b = batch(0, prompts=2)
    stats = train_on(
        policy, optimizer, scheduler, build_step_batch([group(b, 0), group(b, 1)], cfg, policy.pad_id), cfg
    )
    assert stats["skipped_updates"] == 0
    assert all(s["exp_avg"].dtype == torch.float32 for s in optimizer.state.values())
    assert torch.cuda.max_memory_allocated() > 0


# ------------------------------------------------------------ two processes


@pytest.mark.slow
def _one_and_two_ranks(script: str, tiny_model: Path, tmp_path: Path) -> tuple[Path, Path]:
    """`tests/<script> MODEL OUT` in one process, then under torchrun on 2 ranks: the two OUTs."""
    one, two = tmp_path / "one.safetensors", tmp_path / "two.safetensors"
    for cmd, out in (([sys.executable], one), (TORCHRUN, two)):
        run = subprocess.run(
            [*cmd, str(REPO / "tests" / script), str(tiny_model), str(out)],
            cwd=REPO,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert run.returncode == 0, run.stderr[-3000:]
    return one, two


@pytest.mark.slow
def test_one_step_on_two_ranks_equals_one_process(tiny_model: Path, tmp_path: Path) -> None:
    """The same adapter, the same step batch (several uneven micro-batches per rank): the
    LoRA gradient and the updated adapter of 2 FSDP2 ranks equal one process's, for each
    loss aggregation and for two updates per batch."""
    one, two = _one_and_two_ranks("dist_step.py", tiny_model, tmp_path)
    a, b = load_file(str(one)), load_file(str(two))
    assert set(a) == set(b)
    for case in ("token_mean", "seq_mean", "constant", "ppo2"):
        grads = [k for k in a if k.startswith(f"{case}/grad/")]
        assert grads and any(a[k].abs().max() > 1e-3 for k in grads)  # a real gradient, not zeros
        for key in (k for k in a if k.startswith(f"{case}/")):
            assert torch.allclose(a[key], b[key], rtol=1e-4, atol=1e-6), key
    figures_one, figures_two = (
        json.loads(one.with_suffix(".json").read_text()),
        json.loads(two.with_suffix(".json").read_text()),
    )
    for case, stats in figures_one.items():
        for name, value in stats.items():
            assert value == pytest.approx(figures_two[case][name], rel=1e-4, abs=1e-6), (case, name)


@pytest.mark.slow
def test_an_audit_on_two_ranks_equals_one_process_and_puts_the_adapter_back(tiny_model: Path, tmp_path: Path) -> None:
    """Rank 0 drives audits (`Trainer.audit_moments`, the AUDIT command) while rank 1
    follows: each pass (the live adapter, the base model, another version swapped in)
    equals one process's, and the live adapter is back bit for bit after each."""
    one, two = _one_and_two_ranks("dist_audit.py", tiny_model, tmp_path)
    a, b = load_file(str(one)), load_file(str(two))
    assert set(a) == set(b)
    mask = a["mask"].bool()
    for mode in ("live", "base", "swapped"):
        for part in ("logp", "mean", "var"):
            assert torch.allclose(a[f"{mode}/{part}"][mask], b[f"{mode}/{part}"][mask], rtol=1e-4, atol=1e-5), (
                mode,
                part,
            )
        for name in (k.removeprefix("start/adapter/") for k in a if k.startswith("start/adapter/")):
            for t in (a, b):
                assert torch.equal(t[f"{mode}/adapter/{name}"], t[f"start/adapter/{name}"]), (mode, name)
    for other in ("base", "swapped"):  # each pass did see another model
        assert (a[f"{other}/logp"][mask] - a["live/logp"][mask]).abs().max() > 1e-3, other


def _learner(tmp_path: Path, tiny_model: Path, redis_url: str, run: str, steps: int, *extra: str) -> list[str]:
    return [
        # --run-name (TRL's name): under torchrun, whose --run-path makes --run ambiguous
        "-m",
        "learner",
        "run",
        "--run-name",
        run,
        "--queue",
        redis_url,
        "--store",
        (tmp_path / "store").as_uri(),
        "--model",
        str(tiny_model),
        "--dataset",
        str(tmp_path / "data.jsonl"),
        "--run-dir",
        str(tmp_path / "run"),
        "--device",
        "cpu",
        "--steps",
        str(steps),
        "--checkpoint-every",
        "4",
        "--groups-per-step",
        "8",
        "--prompts-per-batch",
        "4",
        "--max-inflight",
        "16",
        "--num-generations",
        "8",
        "--max-tokens",
        "4",
        "--learning-rate",
        "3e-3",
        "--lora-rank",
        "8",
        "--max-tokens-per-microbatch",
        "64",
        "--no-tensorboard",
        "--startup-timeout-s",
        "60",
        *extra,
    ]


def _steps(tmp_path: Path) -> list[int]:
    path = tmp_path / "run" / "metrics.jsonl"
    return [json.loads(x)["step"] for x in path.read_text().splitlines()] if path.exists() else []


def _wait_for_step(proc: subprocess.Popen, tmp_path: Path, step: int, log: Path, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while not (_steps(tmp_path) and _steps(tmp_path)[-1] >= step):
        assert proc.poll() is None, log.read_text()[-4000:]
        assert time.monotonic() < deadline, "the learner made no progress"
        time.sleep(0.1)


def _queue_and_actor(tmp_path: Path, tiny_model: Path, redis_url: str, run: str) -> tuple[RedisQueue, SyntheticActor]:
    write_dataset(tmp_path / "data.jsonl")
    store = open_store((tmp_path / "store").as_uri())
    actor = SyntheticActor(
        RedisQueue.from_url(redis_url, QueueConfig(run=run)),
        store,
        tiny_model,
        lambda _p, _t, text: float(text[:1].isdigit()),
    ).start()
    return RedisQueue.from_url(redis_url, QueueConfig(run=run)), actor


def _two_ranks(tmp_path: Path, tiny_model: Path, redis_url: str, run: str, log: Path) -> subprocess.Popen:
    with log.open("w") as out:
        return subprocess.Popen(
            [*TORCHRUN, *_learner(tmp_path, tiny_model, redis_url, run, 16)],
            cwd=REPO,
            env=_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def _exactly_once(tmp_path: Path, steps: int, actor: SyntheticActor, queue: RedisQueue) -> None:
    consumed = [json.loads(x) for x in (tmp_path / "run" / "consumed.jsonl").read_text().splitlines()]
    assert [c["step"] for c in consumed] == list(range(1, steps + 1))
    trained = [g for c in consumed for g in c["trained"]]
    dropped = [g for c in consumed for g, _ in c["dropped"]]
    assert len(trained) == steps * 8 and len(set(trained)) == len(trained)
    assert not set(trained) & set(dropped) and len(set(dropped)) == len(dropped)
    assert set(trained) | set(dropped) <= {g.group_id for g in actor.submitted}
    assert queue.stats().rollouts.pending == 0 and queue.pending_rollouts(CONSUMER, 10) == []
    versions = [e.manifest.version for e in queue.adapter_events(after="0", count=1000)]
    assert versions == sorted(set(versions))
    step_versions = [
        json.loads(x)["adapter_version"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert step_versions == sorted(step_versions)
    queue.close()
    actor.queue.close()


@pytest.mark.slow
@pytest.mark.redis
@pytest.mark.timeout(900)
def test_checkpoints_resume_at_another_world_size(
    tmp_path: Path, tiny_model: Path, redis_server, run_name: str
) -> None:
    """2 ranks, stopped by SIGTERM (rank 0 checkpoints, the other follows) -> 1 process
    -> 2 ranks again: every group trained once, versions increasing."""
    queue, actor = _queue_and_actor(tmp_path, tiny_model, redis_server.url, run_name)
    log = tmp_path / "first.log"
    try:
        first = _two_ranks(tmp_path, tiny_model, redis_server.url, run_name, log)
        _wait_for_step(first, tmp_path, 6, log)
        first.send_signal(signal.SIGTERM)  # torchrun passes it on: rank 0 checkpoints, the other follows
        first.wait(timeout=120)  # torchrun itself exits non-zero for a signal, whatever its workers did
        stopped_at = _steps(tmp_path)[-1]
        said = log.read_text()  # rank 0 ends as the embedded run does: the done line, summary.json, curve.png
        assert f"checkpoint at step {stopped_at}" in said and f"\ndone: {stopped_at} steps in" in said, said[-3000:]
        assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == stopped_at
        second = subprocess.run(
            [sys.executable, *_learner(tmp_path, tiny_model, redis_server.url, run_name, 12, "--resume")],
            cwd=REPO,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert second.returncode == 0, second.stderr[-3000:]
        assert f"resumed at step {stopped_at}" in second.stderr
        third = subprocess.run(
            [*TORCHRUN, *_learner(tmp_path, tiny_model, redis_server.url, run_name, 16, "--resume")],
            cwd=REPO,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert third.returncode == 0, third.stderr[-3000:]
        assert "resumed at step 12" in third.stderr
    finally:
        kill_process(locals().get("first"))
        actor.close()
    _exactly_once(tmp_path, 16, actor, queue)


@pytest.mark.slow
@pytest.mark.redis
@pytest.mark.timeout(900)
def test_a_rank_killed_takes_the_learner_down_and_resume_is_exactly_once(
    tmp_path: Path, tiny_model: Path, redis_server, run_name: str
) -> None:
    import psutil

    queue, actor = _queue_and_actor(tmp_path, tiny_model, redis_server.url, run_name)
    log = tmp_path / "first.log"
    try:
        first = _two_ranks(tmp_path, tiny_model, redis_server.url, run_name, log)
        _wait_for_step(first, tmp_path, 6, log)  # between checkpoints 4 and 8
        ranks = {
            int(p.environ().get("RANK", -1)): p
            for p in psutil.Process(first.pid).children(recursive=True)
            if "learner" in " ".join(p.cmdline())
        }
        assert set(ranks) == {0, 1}, ranks
        killed_at = time.monotonic()
        ranks[1].send_signal(signal.SIGKILL)
        code = first.wait(timeout=120)
        took = time.monotonic() - killed_at
        assert code != 0, log.read_text()[-3000:]
        assert took < 90
        assert not ranks[0].is_running() or ranks[0].status() == psutil.STATUS_ZOMBIE
        text = log.read_text()
        assert re.search(r"rank 1|local_rank: 1|exitcode\s*:\s*-9", text), text[-3000:]
        # nothing was acknowledged past the checkpoint: the groups consumed since wait in the queue
        assert queue.stats().rollouts.pending > 0
        second = subprocess.run(
            [sys.executable, *_learner(tmp_path, tiny_model, redis_server.url, run_name, 16, "--resume")],
            cwd=REPO,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert second.returncode == 0, second.stderr[-3000:]
        replay = re.search(r"(\d+) already trained, (\d+) to consume again", second.stderr)
        assert replay is not None and int(replay.group(2)) > 0
    finally:
        kill_process(locals().get("first"))
        actor.close()
    _exactly_once(tmp_path, 16, actor, queue)
