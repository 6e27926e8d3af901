"""The learner: configuration, data, what it refuses, log-probability agreement with
the sampler, and whole runs on a real Redis (reward goes up; SIGKILL and --resume
train every rollout group exactly once)."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import fakeredis
import numpy as np
import pytest
import torch
from factories import NO_AUDITS, write_dataset
from rollouts import SyntheticActor, raw_submit
from servers import kill_process

from learner.cli import main as learner_main
from learner.config import ConfigError, LearnerConfig
from learner.data import DataError, PromptSource, load_rows
from learner.load_config import load_config
from learner.loop import CONSUMER, Learner, LearnerError
from learner.policy import pack_sequences, scatter_completion_values
from protocol import (
    Completion,
    PromptBatch,
    QueueConfig,
    RolloutGroup,
    SamplingParams,
    group_id_for,
    pack_i32,
    unpack_i32,
)
from protocol.trusted import RedisQueue, open_store
from protocol.wire.files import MANIFEST, adapter_key, verify

REPO = Path(__file__).resolve().parents[1]


def digit_first(_prompt: list[int], _tokens: list[int], text: str) -> float:
    """The toy task: 1 when the completion starts with a digit (about 1 in 6 at random)."""
    return 1.0 if text[:1].isdigit() else 0.0


def fake_queue_factory(run: str):
    server = fakeredis.FakeServer(version=(7, 0))
    return lambda: RedisQueue(fakeredis.FakeRedis(server=server, version=(7, 0)), QueueConfig(run=run))


def small_config(tmp_path: Path, tiny_model: Path, **overrides: object) -> LearnerConfig:
    values: dict[str, object] = {
        "run": "t",
        "queue": "redis://unused",
        "store": (tmp_path / "store").as_uri(),
        "model": str(tiny_model),
        "dataset": str(write_dataset(tmp_path / "data.jsonl")),
        "run_dir": tmp_path / "run",
        "steps": 4,
        "groups_per_step": 4,
        "num_generations": 4,
        "prompts_per_batch": 2,
        "max_inflight": 8,
        "max_tokens": 4,
        "learning_rate": 3e-3,
        "lora_rank": 8,
        "checkpoint_every": 2,
        "tensorboard": False,
    }
    values.update(overrides)
    return LearnerConfig(**values)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------ configuration


def test_config_bounds_and_cross_checks_say_how_to_fix(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="lora_rank"):
        load_config(None, {"lora_rank": 0})
    with pytest.raises(ConfigError, match="raise max_inflight"):
        load_config(None, {"groups_per_step": 32, "max_inflight": 16})
    with pytest.raises(ConfigError, match=r"lora_rnak: unknown setting \(did you mean lora_rank\?\)"):
        load_config(None, {"lora_rnak": 8})
    toml = tmp_path / "c.toml"
    toml.write_text('[learner]\nlora_rank = 4\nsteps = 9\ntarget_modules = ["q_proj", "v_proj"]\n')
    cfg = load_config(toml, {"steps": 3})
    assert (cfg.lora_rank, cfg.steps, cfg.target_modules) == (4, 3, ["q_proj", "v_proj"])
    toml.write_text("lora_rank = [")
    with pytest.raises(ConfigError, match=r"c\.toml"):
        load_config(toml, {})


def test_cli_rejects_bad_input_with_a_clear_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert learner_main(["run", "--queue", "redis://127.0.0.1:1/0", "--lora-rank", "-3"]) == 2
    assert "lora_rank" in capsys.readouterr().err
    assert learner_main(["run", "--queue", "redis://127.0.0.1:1/0"]) == 2
    assert "missing --store, --model, --dataset" in capsys.readouterr().err
    args = ["run", "--queue", "ftp://x", "--store", str(tmp_path), "--model", "m", "--dataset", "d"]
    assert learner_main(args) == 2
    assert "redis://" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        learner_main(["run", "--correction", "magic"])


# -------------------------------------------------------------------------- data


def test_prompts_from_jsonl_parquet_and_chat(tmp_path: Path, tiny_model: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    rows = [
        {"prompt": [{"role": "user", "content": "2+2?"}], "answer": np.int64(4)},
        {"prompt": [{"role": "user", "content": "1+1?"}], "answer": 2},
    ]
    import pandas as pd

    pd.DataFrame([{"prompt": "ab", "answer": "c"}]).to_parquet(tmp_path / "d.parquet")
    assert load_rows(str(tmp_path / "d.parquet")) == [{"prompt": "ab", "answer": "c"}]
    source = PromptSource(rows, tok, "prompt", seed=0, max_prompt_tokens=100)
    prompt = source.prompt(0)
    assert prompt.messages is not None and prompt.text is None
    assert tok.decode(unpack_i32(prompt.token_ids)).endswith("[assistant]")
    assert prompt.columns["answer"] in (4, 2) and type(prompt.columns["answer"]) is int
    # the order is a function of (seed, position): the same after any restart
    again = PromptSource(rows, tok, "prompt", seed=0, max_prompt_tokens=100)
    assert [source.row_index(i) for i in range(6)] == [again.row_index(i) for i in range(6)]
    with pytest.raises(DataError, match="prompt column 'question'"):
        PromptSource(rows, tok, "question", seed=0, max_prompt_tokens=100)
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n{oops\n')
    with pytest.raises(DataError, match="line 2"):
        load_rows(str(tmp_path / "bad.jsonl"))
    with pytest.raises(DataError, match="no such file"):
        load_rows(str(tmp_path / "missing.jsonl"))


# ------------------------------------------------------- log-probability agreement


def test_behaviour_logprobs_from_the_same_adapter_give_unit_weights(tmp_path: Path, tiny_model: Path) -> None:
    """An adapter published by the learner, loaded by a sampler with PEFT and sampled at
    temperature 0.7: the learner's importance weights are 1 within 1e-3."""
    from learner.batch import build_step_batch
    from learner.policy import Policy
    from learner.publish import Publisher, PublishJob
    from learner.train import _Sums, accumulate

    cfg = small_config(tmp_path, tiny_model, temperature=0.7, max_tokens=8)
    make = fake_queue_factory("agree")
    store = open_store(cfg.store)
    policy = Policy(cfg)
    torch.manual_seed(3)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)  # an adapter far from the base model
    publisher = Publisher(store, make(), base_model=cfg.model, rank=cfg.lora_rank)
    publisher.submit(PublishJob(1, 1, policy.adapter_state(), policy.adapter_config_json()))
    publisher.close()

    actor = SyntheticActor(make(), store, tiny_model, digit_first)
    actor._refresh()
    assert actor.version == 1
    source = PromptSource(load_rows(cfg.dataset), policy.tokenizer, "prompt", 0, 100)
    batch = PromptBatch(
        batch_id="b",
        prompts=[source.prompt(i) for i in range(4)],
        num_generations=8,
        sampling=SamplingParams(temperature=0.7, max_tokens=8),
        learner_version=1,
        issued_at=time.time(),
    )
    groups = actor.groups(batch)
    sums = _Sums()
    accumulate(policy, build_step_batch(groups, cfg, policy.pad_id), cfg, None, sums)
    is_weight_mean = sums.v["w_sum"] / sums.v["tokens"]
    assert sums.v["tokens"] >= 100
    assert abs(is_weight_mean - 1.0) < 1e-3
    assert sums.w_max < 1.01


# --------------------------------------------------------------- what it refuses


class ScriptedActor(SyntheticActor):
    """A direct Redis writer (past the queue's submission checks): answers its first four
    batches with groups the learner must reject, later ones with valid random ones."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.batches = 0

    def _run(self) -> None:
        try:
            while not self.stop.is_set():
                for lease in self.queue.claim(self.worker, 1, block_s=0.2):
                    groups = self.groups(lease.batch)
                    if self.batches <= 4:
                        raw_submit(self.queue, lease, groups)
                    else:
                        self.queue.submit(self.worker, lease.lease_id, groups)
        except BaseException as err:
            self.error = err

    def groups(self, batch: PromptBatch) -> list[RolloutGroup]:
        self.batches += 1
        out = []
        for i, p in enumerate(batch.prompts):
            tokens = list(range(10, 14))
            rewards = [0.0, 1.0, 0.0, 1.0]
            version, error, prompt_tokens = 0, None, p.token_ids
            if self.batches == 1:
                if i == 0:
                    tokens = [10, 9999, 11]  # not in the vocabulary
                else:
                    version = 50  # a version the learner never made
            elif self.batches == 2:
                if i == 0:
                    tokens = list(range(10, 60)) * 21  # longer than the context (1024)
                else:
                    error = "reward timed out"
            elif self.batches == 3:
                if i == 0:
                    rewards = [0.0, 1e30, 0.0, 1.0]  # finite, but would swamp every advantage
                else:
                    rewards = rewards[:3]  # fewer completions than num_generations
            elif self.batches == 4 and i == 0:
                prompt_tokens = pack_i32([5, 6, 7])  # not the prompt the learner issued
            completions = [
                Completion.of(
                    tokens, [-1.0] * len(tokens), finish_reason="length", reward=None if error else r, error=error
                )
                for r in rewards
            ]
            out.append(
                RolloutGroup(
                    group_id=group_id_for(batch.batch_id, p.id),
                    batch_id=batch.batch_id,
                    prompt_id=p.id,
                    adapter_version=version,
                    actor_id=self.worker,
                    prompt_token_ids=prompt_tokens,
                    completions=completions,
                )
            )
        return out


def test_bad_groups_are_rejected_counted_and_training_continues(tmp_path: Path, tiny_model: Path) -> None:
    cfg = small_config(tmp_path, tiny_model, steps=3, groups_per_step=2, **NO_AUDITS)  # log-probabilities made up
    make = fake_queue_factory("reject")
    store = open_store(cfg.store)
    actor = ScriptedActor(make(), store, tiny_model, digit_first).start()
    state = Learner(cfg, make(), store).run()
    actor.close()
    assert state.step == 3
    expected = {
        "rejected_bad_vocab": 1,
        "rejected_future_version": 1,
        "rejected_too_long": 1,
        "rejected_reward_error": 1,
        "rejected_bad_reward": 1,
        "rejected_bad_shape": 2,
    }
    assert {k: v for k, v in state.totals.items() if k.startswith("rejected_")} == expected
    rows = metrics(cfg.resolved_run_dir)
    assert sum(r["rejected"] for r in rows) == 7 and [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["loss"] is not None and r["skipped_updates"] == 0 for r in rows)


def test_an_update_that_is_not_finite_is_skipped_not_applied(tmp_path: Path, tiny_model: Path) -> None:
    from learner.batch import StepBatch
    from learner.policy import Policy
    from learner.train import train_on

    cfg = small_config(tmp_path, tiny_model)
    policy = Policy(cfg)
    optimizer = torch.optim.AdamW(policy.trainable_parameters(), lr=cfg.learning_rate)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    source = PromptSource(load_rows(cfg.dataset), policy.tokenizer, "prompt", 0, 100)
    prompts = [unpack_i32(source.prompt(i).token_ids).tolist() for i in range(4)]
    seqs = pack_sequences(prompts, [[10, 11, 12]] * 4, policy.pad_id)
    behav = scatter_completion_values([[-1.0] * 3] * 4, [len(p) for p in prompts], seqs.input_ids_BL.shape[1])
    before = {k: v.clone() for k, v in policy.adapter_state().items()}
    poisoned = StepBatch(seqs, behav, torch.tensor([1.0, float("nan"), -1.0, 0.0]), torch.zeros(4))
    stats = train_on(policy, optimizer, scheduler, poisoned, cfg)
    assert stats["skipped_updates"] == 1
    after = policy.adapter_state()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not optimizer.state  # AdamW never stepped: no moments were created
    healthy = StepBatch(seqs, behav, torch.tensor([1.0, -1.0, 1.0, -1.0]), torch.zeros(4))
    assert train_on(policy, optimizer, scheduler, healthy, cfg)["skipped_updates"] == 0
    assert not all(torch.equal(before[k], v) for k, v in policy.adapter_state().items())


def test_an_adapter_with_a_nan_is_never_published(tmp_path: Path, tiny_model: Path) -> None:
    cfg = small_config(tmp_path, tiny_model)
    store = open_store(cfg.store)
    learner = Learner(cfg, fake_queue_factory("nan")(), store)
    with torch.no_grad():
        next(p for n, p in learner.policy.model.named_parameters() if "lora_A" in n)[0, 0] = float("nan")
    with pytest.raises(LearnerError, match="non-finite"):
        learner.publish()
    with pytest.raises(LearnerError, match="non-finite"):
        learner.checkpoint()
    learner.publisher.close()
    assert learner.state.policy_version == 0
    assert store.list("adapters/") == [] and store.list("checkpoints/") == []


def test_the_console_line_copes_with_missing_figures() -> None:
    from learner.metrics import console_line

    row = {
        "step": 3,
        "adapter_version": 2,
        "reward": None,
        "reward_std": None,
        "staleness_mean": 0.5,
        "staleness_max": 1,
        "sampling/importance_sampling_ratio/mean": None,
        "loss": None,
        "grad_norm": None,
        "groups": 4,
        "dropped_stale": 0,
        "dropped_flat": 1,
        "rejected": 0,
        "wait_s": 0.1,
        "step_s": None,
        "publish_s": None,
        "skipped_updates": 1,
    }
    line = console_line(row, 10)
    assert "reward -  reward_std -  frac_reward_zero_std -  loss -  grad_norm -" in line, line
    assert "staleness 0.50/1  groups 4 (dropped: 0 stale, 1 flat, 0 rejected)" in line and "SKIPPED 1" in line
    assert "fleet share" not in line  # serving this run alone, or no worker: nothing to say
    shared = console_line({**row, "fleet_share": 0.25, "workers_live": 8}, 10)
    assert "fleet share 0.25 of 8 workers" in shared, shared
    assert "fleet share" not in console_line({**row, "fleet_share": 1.0, "workers_live": 8}, 10)


# --------------------------------------------------------------- whole runs


@pytest.mark.slow
@pytest.mark.redis
def test_reward_goes_up_on_a_toy_task(tmp_path: Path, tiny_model: Path, redis_server, run_name: str) -> None:
    cfg = small_config(
        tmp_path,
        tiny_model,
        run=run_name,
        queue=redis_server.url,
        steps=20,
        groups_per_step=8,
        num_generations=8,
        prompts_per_batch=4,
        max_inflight=16,
        checkpoint_every=5,
        tensorboard=True,
    )
    store = open_store(cfg.store)
    actor = SyntheticActor(
        RedisQueue.from_url(redis_server.url, QueueConfig(run=run_name)), store, tiny_model, digit_first
    ).start()
    queue = RedisQueue.from_url(redis_server.url, QueueConfig(run=run_name))
    try:
        Learner(cfg, queue, store).run()
    finally:
        actor.close()
        actor.queue.close()
    rows = metrics(cfg.resolved_run_dir)
    first, last = np.mean([r["reward"] for r in rows[:3]]), np.mean([r["reward"] for r in rows[-5:]])
    assert last > first + 0.3, (first, last)
    assert max(r["staleness_max"] for r in rows) <= cfg.max_staleness
    for key in (
        "sampling/importance_sampling_ratio/mean",
        "ess",
        "kl_behaviour_k3",
        "clip_ratio/region_mean",
        "entropy",
        "grad_norm",
        "wait_s",
        "publish_s",
    ):
        assert all(r[key] is not None for r in rows), key
    for r in rows:  # TRL's figures hold together
        assert r["clip_ratio/low_mean"] + r["clip_ratio/high_mean"] == pytest.approx(r["clip_ratio/region_mean"])
        ratio = [r[f"sampling/importance_sampling_ratio/{k}"] for k in ("min", "mean", "max")]
        assert ratio == sorted(ratio) and r["frac_reward_zero_std"] == r["dropped_flat_rate"]
        assert 0 <= r["dropped_flat_unsolved"] <= r["dropped_flat"]
    assert [r["num_tokens"] for r in rows] == sorted(r["num_tokens"] for r in rows) and rows[0]["num_tokens"] > 0
    assert all(1 <= r["completions/mean_length"] <= r["completions/max_length"] <= cfg.max_tokens for r in rows)
    assert all(0 <= r["completions/clipped_ratio"] <= 1 and 0 <= r["dropped_flat_rate"] <= 1 for r in rows)
    assert list((cfg.resolved_run_dir / "tensorboard").iterdir())
    assert queue.stats().rollouts.pending == 0  # everything consumed was acknowledged at the last checkpoint
    # the dedup records hold only the batches still in flight, not the 160 groups trained
    r = queue._r
    assert r.scard(queue.keys.groups_seen) <= cfg.max_inflight
    assert r.scard(queue.keys.batches_seen) <= cfg.max_inflight // cfg.prompts_per_batch
    # the run is complete: its keys expire (a day by default), none is left for ever
    ttls = {key: queue._r.ttl(key) for key in queue.keys.all() if queue._r.exists(key)}
    assert queue.keys.prompts in ttls and all(0 < t <= 86400 for t in ttls.values()), ttls
    queue.close()


def _learner_cmd(tmp_path: Path, tiny_model: Path, redis_url: str, run: str, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "learner.cli",
        "run",
        "--run",
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
        # TRL's names for steps, checkpoints and completion length: the same run
        "--max-steps",
        "16",
        "--save-steps",
        "4",
        "--groups-per-step",
        "8",
        "--prompts-per-batch",
        "4",
        "--max-inflight",
        "16",
        "--num-generations",
        "8",
        "--max-completion-length",
        "4",
        "--learning-rate",
        "3e-3",
        "--lora-rank",
        "8",
        "--no-tensorboard",
        *extra,
    ]


@pytest.mark.slow
@pytest.mark.redis
@pytest.mark.parametrize(
    "extra", [(), ("--active-sampling-revisit", "1.0")], ids=["default", "revisits"]
)  # revisits: batches of a second kind, issued from what was read, numbered on their own
def test_sigkill_then_resume_trains_every_group_exactly_once(
    tmp_path: Path, tiny_model: Path, redis_server, run_name: str, extra: tuple[str, ...]
) -> None:
    write_dataset(tmp_path / "data.jsonl")
    store = open_store((tmp_path / "store").as_uri())
    queue = RedisQueue.from_url(redis_server.url, QueueConfig(run=run_name))
    actor = SyntheticActor(
        RedisQueue.from_url(redis_server.url, QueueConfig(run=run_name)), store, tiny_model, digit_first
    ).start()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    log1 = (tmp_path / "first.log").open("w")
    first = subprocess.Popen(
        _learner_cmd(tmp_path, tiny_model, redis_server.url, run_name, *extra),
        cwd=REPO,
        env=env,
        stdout=log1,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 180
        while True:  # kill between checkpoints 4 and 8, with steps trained and not checkpointed
            path = tmp_path / "run" / "metrics.jsonl"
            steps = [json.loads(x)["step"] for x in path.read_text().splitlines()] if path.exists() else []
            if steps and steps[-1] >= 6:
                break
            assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the learner made no progress"
            time.sleep(0.05)
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
    finally:
        kill_process(first)
        log1.close()
    version_at_kill = queue.latest_adapter().version

    second = subprocess.run(
        _learner_cmd(tmp_path, tiny_model, redis_server.url, run_name, *extra, "--resume"),
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    actor.close()
    assert second.returncode == 0, second.stderr[-3000:]
    replay = re.search(r"(\d+) already trained, (\d+) to consume again", second.stderr)
    assert replay is not None and int(replay.group(2)) > 0, "the kill left no read-but-unsaved groups to replay"
    assert "resumed at step 4" in second.stderr

    # exactly once: every consumed group id once, all of them really submitted
    consumed = [json.loads(x) for x in (tmp_path / "run" / "consumed.jsonl").read_text().splitlines()]
    assert [c["step"] for c in consumed] == list(range(1, 17))
    if extra:
        assert json.loads((tmp_path / "run" / "summary.json").read_text())["accounting"]["revisited"] > 0
    trained = [g for c in consumed for g in c["trained"]]
    dropped = [g for c in consumed for g, _ in c["dropped"]]
    assert len(trained) == 16 * 8 and len(set(trained)) == len(trained)
    assert not set(trained) & set(dropped) and len(set(dropped)) == len(dropped)
    submitted = {g.group_id for g in actor.submitted}
    assert set(trained) | set(dropped) <= submitted
    # the trail of what was issued: a batch the resumed learner issued again (it was
    # issued after the checkpoint) holds the same prompts, and every group answers one
    trail = [json.loads(x) for x in (tmp_path / "run" / "issued.jsonl").read_text().splitlines()]
    named: dict[str, list[str]] = {}
    for entry in trail:
        assert named.setdefault(entry["batch"], entry["prompts"]) == entry["prompts"], entry
    assert len(trail) > len(named)  # some were issued again after the resume
    assert set(trained) | set(dropped) <= {group_id_for(b, p) for b, prompts in named.items() for p in prompts}
    stats = queue.stats()
    assert stats.rollouts.pending == 0
    assert stats.rollouts.waiting == len(submitted) - len(trained) - len(dropped)  # nothing lost either
    assert queue.pending_rollouts(CONSUMER, 10) == []

    # versions continue above everything announced before the kill, each one verifiable
    events = queue.adapter_events(after="0", count=1000)
    versions = [e.manifest.version for e in events]
    assert versions == sorted(set(versions)) and versions[-1] > version_at_kill
    assert [json.loads(x)["adapter_version"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()][
        4
    ] > version_at_kill
    for v in versions[-3:]:
        manifest = store.read_manifest(v)
        for entry in manifest.files:
            verify(entry, store.get(adapter_key(v, entry.name)))
    assert store.exists(adapter_key(versions[-1], MANIFEST))
    queue.close()
    actor.queue.close()


def test_an_existing_checkpoint_needs_resume(tmp_path: Path, tiny_model: Path) -> None:
    cfg = small_config(tmp_path, tiny_model, steps=2, groups_per_step=2)
    make = fake_queue_factory("twice")
    store = open_store(cfg.store)
    actor = SyntheticActor(make(), store, tiny_model, digit_first).start()
    Learner(cfg, make(), store).run()
    with pytest.raises(LearnerError, match="pass --resume"):
        Learner(cfg, make(), store).run()
    # resuming a finished run (a restarted container) is a no-op: nothing published again
    queue = make()
    state = Learner(cfg.model_copy(update={"resume": True}), queue, store).run()
    actor.close()
    assert state.step == 2 and state.policy_version == 2 and queue.latest_adapter().version == 2


@pytest.mark.slow
@pytest.mark.redis
def test_learner_rides_out_a_redis_crash(tmp_path: Path, tiny_model: Path, make_server, caplog) -> None:
    """Redis (AOF, fsync always) is SIGKILLed mid-run and restarted on the same port: the
    learner and the sampler back off, reconnect, and the run completes exactly once."""
    server = make_server(persistent=True)
    server.start()
    cfg = small_config(
        tmp_path,
        tiny_model,
        run="crash",
        queue=server.url,
        steps=10,
        groups_per_step=8,
        num_generations=4,
        prompts_per_batch=4,
        max_inflight=16,
        checkpoint_every=3,
    )
    store = open_store(cfg.store)
    actor = SyntheticActor(
        RedisQueue.from_url(server.url, QueueConfig(run="crash")), store, tiny_model, digit_first
    ).start()
    queue = RedisQueue.from_url(server.url, QueueConfig(run="crash"))
    learner = Learner(cfg, queue, store)

    def crash_redis() -> None:
        path = cfg.resolved_run_dir / "metrics.jsonl"
        while not (path.exists() and len(path.read_text().splitlines()) >= 4):
            time.sleep(0.05)
        server.kill()
        time.sleep(1.5)
        server.start()

    import threading

    crasher = threading.Thread(target=crash_redis)
    crasher.start()
    try:
        state = learner.run()
    finally:
        crasher.join()
        actor.close()
    assert state.step == 10
    assert any("queue unavailable" in r.message for r in caplog.records), "Redis went down after the run ended"
    consumed = [json.loads(x) for x in (cfg.resolved_run_dir / "consumed.jsonl").read_text().splitlines()]
    trained = [g for c in consumed for g in c["trained"]]
    assert len(trained) == 80 and len(set(trained)) == 80
    assert queue.stats().rollouts.pending == 0
    queue.close()
    actor.queue.close()


def test_sigterm_stops_at_once_with_a_checkpoint(tmp_path: Path, tiny_model: Path, redis_server, run_name: str) -> None:
    """No sampler: the learner waits for rollouts; SIGTERM ends it at once with exit 0 and
    a checkpoint holding its data cursor."""
    write_dataset(tmp_path / "data.jsonl")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        _learner_cmd(tmp_path, tiny_model, redis_server.url, run_name),
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    queue = RedisQueue.from_url(redis_server.url, QueueConfig(run=run_name))
    try:
        deadline = time.monotonic() + 60
        while queue.stats().prompts.length < 2:  # it is running: one step's 8 prompts issued (admission's first window)
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        kill_process(proc)
    assert proc.returncode == 0, out[-2000:]
    store = open_store((tmp_path / "store").as_uri())
    assert json.loads(store.get("checkpoints/latest.json"))["step"] == 0
    state = json.loads(store.get("checkpoints/step-0/state.json"))
    assert state["ledger"]["cursor"] == 8 and state["ledger"]["consumed_prompts"] == 0
    assert queue._r.ttl(queue.keys.prompts) == -1  # stopped, not complete: the queue stays for --resume
    queue.close()


def test_store_failures_are_retried_and_training_goes_on(tmp_path: Path, tiny_model: Path) -> None:
    """The store refuses the first writes of each checkpoint (as S3 does with 503 Slow
    Down): the writes are retried with backoff and every checkpoint lands."""
    from protocol.trusted.store import FileStore
    from protocol.wire.files import StoreError

    class FlakyStore(FileStore):
        def __init__(self, root: Path) -> None:
            super().__init__(root)
            self.failed: dict[str, int] = {}

        def put(self, key: str, data: bytes) -> None:
            if key.startswith("checkpoints/step-") and self.failed.get(key, 0) < 2:
                self.failed[key] = self.failed.get(key, 0) + 1
                raise StoreError("503 Slow Down")
            super().put(key, data)

    cfg = small_config(tmp_path, tiny_model, steps=2, groups_per_step=2, checkpoint_every=2)
    make = fake_queue_factory("flaky")
    store = FlakyStore(tmp_path / "store")
    actor = SyntheticActor(make(), store, tiny_model, digit_first).start()
    queue = make()
    state = Learner(cfg, queue, store).run()
    actor.close()
    assert state.step == 2 and "checkpoint_failures" not in state.totals
    assert set(store.failed.values()) == {2} and len(store.failed) == 3  # three files, two refusals each
    assert json.loads(store.get("checkpoints/latest.json"))["step"] == 2
    assert queue.stats().rollouts.pending == 0


def test_a_group_the_tier_dead_letters_is_counted_once_and_its_batch_finishes(tmp_path: Path, tiny_model: Path) -> None:
    """Trusted scoring, with the tier in a thread: the first group's scored copy cannot be
    stored, so the tier dead-letters it. The learner counts its prompt as lost once, and
    the batch it belonged to finishes (its prompt is not outstanding for ever)."""
    import threading

    from transformers import AutoTokenizer

    from learner.scoring import jobs as scoring
    from protocol.trusted.scoring import ScoringQueue
    from protocol.usercode.rewards import Scorer, load_reward

    cfg = small_config(tmp_path, tiny_model, steps=3, groups_per_step=2, reward=["toy_rewards:digit_first"])
    server = fakeredis.FakeServer(version=(7, 0))

    def make() -> RedisQueue:
        return RedisQueue(fakeredis.FakeRedis(server=server, version=(7, 0)), QueueConfig(run=cfg.run))

    store = open_store(cfg.store)
    actor = SyntheticActor(make(), store, tiny_model, digit_first).start()
    sq = ScoringQueue(fakeredis.FakeRedis(server=server, version=(7, 0)), QueueConfig(run=cfg.run))
    tok = AutoTokenizer.from_pretrained(tiny_model)
    doomed: list[str] = []  # the group whose copy outgrows the limits
    current = [""]

    def decode(ids: object) -> str:
        return "7" * 5_000_000 if current[0] in doomed else tok.decode(list(ids), skip_special_tokens=True)

    tier = scoring.Tier(
        queue=sq,
        scorer=Scorer([load_reward("toy_rewards:digit_first")], timeout_s=None, reraise=True),
        name="tier-0",
        decode=decode,
        timeout_s=30,
    )
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            entries = sq.read_unscored("d", 16, block_s=0.2)
            for e in entries:
                if not doomed:
                    doomed.append(e.group_id)
                current[0] = e.group_id
                scoring.score_entries(tier, [e.entry_id])
            sq.dispatched([e.entry_id for e in entries])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        state = Learner(cfg, make(), store).run()
    finally:
        stop.set()
        thread.join(10)
        actor.close()
    (dl,) = make().dead_letters()
    assert dl.group_id == doomed[0] and "unstorable" in dl.reason
    assert state.totals["dead_letter_entries_unscored"] == 1 and state.totals["dead_lettered_prompts"] == 1
    assert dl.batch_id not in state.ledger.outstanding
    assert state.step == 3


def test_a_run_whose_groups_are_all_flat_says_so_within_its_warning_time(
    tmp_path: Path, tiny_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """No silent waits (issue 37): every group flat, so no step ever happens. The learner
    names the cause, the rewards the groups had and the reward function, and says it again
    later; the groups it consumed are counted as flat."""
    cfg = small_config(
        tmp_path,
        tiny_model,
        steps=3,
        groups_per_step=2,
        stall_warning_s=2.0,
        reward=["toy_rewards:nothing"],
        scoring="actors",
    )
    make = fake_queue_factory("flat")
    store = open_store(cfg.store)
    actor = SyntheticActor(make(), store, tiny_model, lambda _p, _t, _text: 0.0).start()
    learner = Learner(cfg, make(), store)
    runner = threading.Thread(target=learner.run)
    with caplog.at_level(logging.WARNING, logger="learner.collector"):
        runner.start()
        deadline = time.monotonic() + 60
        while sum("no step for" in r.getMessage() for r in caplog.records) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        learner.stop_requested.set()
        runner.join(60)
    actor.close()
    lines = [r.getMessage() for r in caplog.records if "no step for" in r.getMessage()]
    assert len(lines) >= 2, [r.getMessage() for r in caplog.records]
    assert "were dropped" in lines[0] and "flat" in lines[0] and "0 in" in lines[0] and "nothing" in lines[0], lines[0]
    # a stop hands the uncounted collection back to the queue; what was read is still told
    assert learner.state.step == 0 and learner.state.totals.get("read/dropped_flat", 0) >= 1
