"""What a worker says it generated is checked: the adapter digest each group carries, and
the learner's audits of log-probabilities and sampling shape (`learner.audit`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import torch

from actors.hf_engine import TransformersEngine
from actors.watcher import AdapterWatcher, ProxySource
from learner.audit import AuditLimits, Auditor, findings
from learner.config import LearnerConfig
from learner.loss import sampling_moments, truncate
from learner.policy import Policy
from protocol import AdapterManifest, Completion, RolloutGroup, SamplingParams, group_id_for, pack_i32
from protocol.wire.files import adapter_digest, file_entry, folder_digest

# ------------------------------------------------------------------ the figures


def test_the_adapter_digest_is_one_for_its_files_however_listed(tmp_path: Path) -> None:
    files = {"adapter_model.safetensors": b"weights", "adapter_config.json": b"{}"}
    entries = [file_entry(name, data) for name, data in files.items()]
    assert adapter_digest(entries) == adapter_digest(entries[::-1])
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    assert folder_digest(tmp_path) == adapter_digest(entries)
    (tmp_path / "adapter_config.json").write_bytes(b"{ }")
    assert folder_digest(tmp_path) != adapter_digest(entries)


@pytest.mark.parametrize(("top_k", "top_p", "min_p"), [(0, 0.9, 0.0), (5, 1.0, 0.0), (0, 1.0, 0.1), (7, 0.8, 0.05)])
def test_truncation_keeps_the_tokens_hugging_face_keeps(top_k: int, top_p: float, min_p: float) -> None:
    from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    scaled = torch.randn(64, 50, generator=torch.Generator().manual_seed(top_k)) * 2
    theirs = scaled.clone()
    if top_k:
        theirs = TopKLogitsWarper(top_k)(None, theirs)
    if top_p < 1:
        theirs = TopPLogitsWarper(top_p)(None, theirs)
    if min_p:
        theirs = MinPLogitsWarper(min_p)(None, theirs)
    assert torch.equal(torch.isfinite(truncate(scaled, top_k, top_p, min_p)), torch.isfinite(theirs))


def test_the_shape_z_is_near_zero_for_sampled_tokens_and_far_below_for_others() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 40, 30, generator=g) * 3  # (B, T, V)
    sampled = torch.distributions.Categorical(logits=logits).sample()
    elsewhere = torch.distributions.Categorical(logits=torch.randn(8, 40, 30, generator=g) * 3).sample()
    mask = torch.ones(8, 40)
    for tokens, near in ((sampled, True), (elsewhere, False)):
        logp, mean, var = sampling_moments(logits, tokens, 1.0)
        z = findings(logp, logp, mean, var, mask, 1.0).shape_z
        assert (abs(z) < 4) if near else (z < -8), z
    # truncation: a token outside top-k counts as the least likely token inside it, never -inf
    logp, _, _ = sampling_moments(logits, sampled, 1.0, top_k=3)
    assert torch.isfinite(logp).all()


# ------------------------------------------------------------------ the auditor


def _perturbed(policy: Policy, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return policy.adapter_state()


def _groups(
    engine: TransformersEngine, version: int, sampling: SamplingParams, scale: float = 1.0
) -> list[RolloutGroup]:
    prompts = [[1, 5, 6, 7], [1, 9, 3], [1, 4, 4, 8, 3]]
    return [
        RolloutGroup(
            group_id=group_id_for("b", f"p{i}"),
            batch_id="b",
            prompt_id=f"p{i}",
            adapter_version=1,
            actor_id="w",
            prompt_token_ids=pack_i32(p),
            completions=[
                Completion.of(s.token_ids, [v * scale for v in s.logprobs], finish_reason=s.finish_reason, reward=0.0)
                for s in samples
            ],
        )
        for i, (p, samples) in enumerate(zip(prompts, engine.generate(prompts, 8, sampling, version), strict=True))
    ]


def test_the_auditor_passes_honest_groups_and_fails_each_lie(tmp_path: Path, tiny_model: Path) -> None:
    from learner.policy import adapter_files

    policy = Policy(LearnerConfig(model=str(tiny_model), lora_rank=4))
    v1 = _perturbed(policy, 1)
    folder = tmp_path / "v1"
    folder.mkdir()
    for name, data in adapter_files(v1, policy.adapter_config_json()).items():
        (folder / name).write_bytes(data)
    engine = TransformersEngine(str(tiny_model))
    engine.load_adapter(1, folder)
    sampling = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=48, seed=3)
    auditor = Auditor(policy, sampling, rate=1.0)
    auditor.remember(1, v1)
    with torch.no_grad():  # the policy trained on: each audit swaps v1 in, and back
        for p in policy.trainable_parameters():
            p.add_(0.05)
    auditor.trained()
    live = [p.detach().clone() for p in policy.trainable_parameters()]

    def verdicts(groups: list[RolloutGroup]) -> list[str | None]:
        return [f.failed(auditor.limits) for g in groups if (f := auditor.audit(g)) is not None]

    assert verdicts(_groups(engine, 1, sampling)) == [None] * 3
    assert set(verdicts(_groups(engine, 0, sampling))) == {"log-probabilities"}  # the base model, claiming v1
    assert set(verdicts(_groups(engine, 1, sampling, scale=0.5))) == {"log-probabilities"}
    # another model's text with its own log-probabilities, told as v1's: the shape test alone sees it
    lenient = Auditor(policy, sampling, rate=1.0, limits=AuditLimits(max_mean_abs_diff=99, max_tail_frac=1.0))
    lenient.remember(1, v1)
    lenient.trained()
    assert {f.failed(lenient.limits) for g in _groups(engine, 0, sampling) if (f := lenient.audit(g))} == {
        "sampling shape"
    }
    assert all(torch.equal(a, b) for a, b in zip(live, policy.trainable_parameters(), strict=True))
    assert policy.model.training  # back in training mode
    assert auditor.passed["w"] == 3
    with pytest.raises(ValueError, match="no repetition penalty"):
        Auditor(policy, SamplingParams(repetition_penalty=1.2), rate=0.1)


def test_a_worker_is_audited_at_every_group_on_probation_then_at_the_rate(tiny_model: Path) -> None:
    policy = Policy(LearnerConfig(model=str(tiny_model), lora_rank=4))
    draws = iter([0.5] * 10)
    auditor = Auditor(policy, SamplingParams(), rate=0.1, probation_groups=2, draw=lambda: next(draws))
    group = msgspec.structs.replace(
        RolloutGroup(
            group_id=group_id_for("b", "p"),
            batch_id="b",
            prompt_id="p",
            adapter_version=0,
            actor_id="new",
            prompt_token_ids=pack_i32([1, 2]),
            completions=[Completion.of([5], [-1.0], finish_reason="stop", reward=0.0)],
        )
    )
    assert auditor.picks(group)  # on probation: 0.5 < 1.0
    auditor.passed["new"] = 2
    assert not auditor.picks(group)  # past it: 0.5 >= 0.1


# ------------------------------------------------------- through the machine


class NeverLoads(TransformersEngine):
    """An engine whose adapters never reach the sampler (verl#7495's failure): it takes
    every version, and generates with the base model under its name."""

    @contextlib.contextmanager
    def _using(self, version: int) -> Iterator[torch.nn.Module]:
        with super()._using(0) as model:
            yield model


class PreviousFiles(ProxySource):
    """A mirror that serves each version's predecessor, files and list alike."""

    def fetch(self, manifest: AdapterManifest, name: str) -> bytes:
        older = super().manifest(manifest.version - 1) if manifest.version > 1 else manifest
        return super().fetch(older, name)


class ServesPreviousFiles(AdapterWatcher):
    """A worker that loads the adapter its mirror hands it (`PreviousFiles`), as told."""

    def install(self, manifest: AdapterManifest) -> bool:
        if manifest.version > 1 and isinstance(self.source, PreviousFiles):
            manifest = msgspec.structs.replace(manifest, files=self.source.manifest(manifest.version - 1).files)
        return super().install(manifest)


@pytest.mark.redis
def test_dishonest_workers_are_quarantined_and_the_honest_one_never(
    make_proxy, redis_server, run_name: str, tiny_model: Path, tmp_path: Path
) -> None:
    """Three workers through the proxy over TLS on a real Redis: an honest one; one whose
    engine never loads an adapter and claims the newest (caught by the audit); one that
    loads the wrong files (caught by the digest). The run trains on the honest one."""
    from factories import write_dataset
    from servers import through_proxy
    from with_worker import WorkerParts, run_with_workers

    from protocol.usercode.rewards import Scorer, load_reward

    store = (tmp_path / "store").as_uri()
    proxy = make_proxy(store=store)
    cfg = LearnerConfig(
        run=run_name,
        queue=redis_server.url,
        store=store,
        model=str(tiny_model),
        dataset=str(write_dataset(tmp_path / "train.jsonl")),
        run_dir=tmp_path / "run",
        steps=8,
        groups_per_step=4,
        num_generations=4,
        prompts_per_batch=2,
        max_tokens=8,
        learning_rate=2e-2,
        lora_rank=8,
        checkpoint_every=4,
        tensorboard=False,
        audit_rate=1.0,
        audit_probation_groups=4,
    )
    queues = {name: proxy.queue("actor", lease_timeout_s=30) for name in ("honest", "never-loads", "wrong-files")}

    def scorer() -> Scorer:
        return Scorer([load_reward("toy_rewards:digit_first")])

    workers = [
        WorkerParts(
            "honest", queues["honest"], ProxySource(queues["honest"]), TransformersEngine(str(tiny_model)), scorer()
        ),
        WorkerParts(
            "never-loads",
            queues["never-loads"],
            ProxySource(queues["never-loads"]),
            NeverLoads(str(tiny_model)),
            scorer(),
        ),
        WorkerParts(
            "wrong-files",
            queues["wrong-files"],
            PreviousFiles(queues["wrong-files"]),
            TransformersEngine(str(tiny_model)),
            scorer(),
            ServesPreviousFiles,
        ),
    ]
    state, _rows = run_with_workers(cfg, workers, tmp_path / "cache")
    assert state.step == 8
    quarantined = state.quarantined
    assert through_proxy("honest") not in quarantined
    assert "audit" in quarantined.get(through_proxy("never-loads"), "")
    assert "digest" in quarantined.get(through_proxy("wrong-files"), "")
    assert state.totals.get("rejected_adapter_digest", 0) >= 1 and state.totals.get("rejected_audit", 0) >= 1
    assert state.totals["audited_groups"] >= 4
    tallies = proxy.queue("admin").audits()  # the run's tallies: what the fleet view shows
    assert sum(t.passed + t.failed for t in tallies.values()) == state.totals["audited_groups"]
    assert tallies[through_proxy("honest")].passed >= 4 and tallies[through_proxy("honest")].failed == 0
    assert tallies[through_proxy("never-loads")].failed == 1  # its later groups are rejected unaudited
    # the door refuses them, and says why
    from protocol import WorkerQuarantined

    door = proxy.queue("admin").quarantined()
    assert set(door) == {through_proxy("never-loads"), through_proxy("wrong-files")}
    with pytest.raises(WorkerQuarantined, match="audit"):
        proxy.queue("actor").claim("never-loads", 1)
    honest, never_loads, wrong_files = workers  # the dishonest ones were told, and stopped
    assert honest.ended is None
    assert "quarantined by the learner: failed the" in str(never_loads.ended)
    assert "quarantined by the learner: its group named adapter" in str(wrong_files.ended)
    # their dropped groups' prompts went out again, each counted once (exactly-once holds)
    reissued = state.totals.get("reissued_prompts", 0)
    assert reissued >= 1 and reissued == state.ledger.reissued + len(state.ledger.to_reissue)
    dropped = sum(
        v for k, v in state.totals.items() if k in ("rejected_audit", "rejected_adapter_digest", "rejected_quarantined")
    )
    assert reissued == dropped


# ------------------------------------------------------------- the door's quarantine


@pytest.mark.redis
def test_a_quarantined_worker_claims_nothing_until_the_admin_lifts_it(redis_server, run_name: str) -> None:
    from factories import batch, groups

    from protocol import QueueConfig, WorkerQuarantined
    from protocol.trusted import RedisQueue

    q = RedisQueue.from_url(redis_server.url, QueueConfig(run=run_name))
    q.add_prompts([batch(0), batch(1), batch(2)])
    (held,) = q.claim("fleet/bad", 1)  # claimed before the verdict
    q.quarantine("fleet/bad", "failed the sampling shape audit")
    with pytest.raises(WorkerQuarantined, match="fleet/bad is quarantined by the learner: failed the sampling shape"):
        q.submit("fleet/bad", held.lease_id, groups(held.batch, actor="fleet/bad"))
    assert q.stats().rollouts.length == 0  # nothing of it was stored: the lease expires and goes to another
    assert q.stats().leases_by_worker == {"fleet/bad": 1}
    with pytest.raises(WorkerQuarantined, match="fleet/bad is quarantined by the learner: failed the sampling shape"):
        q.claim("fleet/bad", 1)
    assert len(q.claim("fleet/good", 1)) == 1  # the others claim as before
    assert q.quarantined() == {"fleet/bad": "failed the sampling shape audit"}
    assert q.lift_quarantine("fleet/bad") and not q.lift_quarantine("fleet/bad") and not q.lift_quarantine("x/y")
    assert q.quarantined() == {"fleet/bad": ""}  # lifted, until the learner has seen it
    (again,) = q.claim("fleet/bad", 1)
    assert q.submit("fleet/bad", again.lease_id, groups(again.batch, actor="fleet/bad")).stored == 2
    q.forget_lifted(["fleet/bad", "fleet/other"])
    assert q.quarantined() == {}
    assert q.keys.quarantined in q.keys.all()  # it expires with the run
    with pytest.raises(ValueError, match="worker"):
        q.quarantine("a worker\nwith a newline", "x")
    q.close()


@pytest.mark.redis
def test_through_the_door_the_learner_quarantines_the_worker_is_told_and_the_admin_lifts(
    make_proxy, run_name: str, tmp_path: Path
) -> None:
    import os
    import subprocess
    import sys

    from factories import batch, groups
    from servers import TOKENS, through_proxy

    from protocol import QueueForbidden, WorkerQuarantined

    proxy = make_proxy()
    learner, actor, admin = proxy.queue("learner"), proxy.queue("actor"), proxy.queue("admin")
    learner.add_prompts([batch(0), batch(1), batch(2)])
    with pytest.raises(QueueForbidden):  # an actor cannot quarantine another, nor read the list
        actor.quarantine(through_proxy("w2"), "framed")
    with pytest.raises(QueueForbidden):
        actor.quarantined()
    (held,) = actor.claim("w1", 1)
    learner.quarantine(through_proxy("w1"), "failed the log-probabilities audit of a group")
    with pytest.raises(WorkerQuarantined, match="failed the log-probabilities audit"):
        actor.claim("w1", 1)
    with pytest.raises(WorkerQuarantined, match="claims and submits nothing more"):
        actor.submit("w1", held.lease_id, groups(held.batch, actor=through_proxy("w1")))
    assert learner.stats().rollouts.length == 0
    assert len(actor.claim("w2", 1)) == 1
    env = {**os.environ, "SPOTGRPO_TOKEN": TOKENS["admin"], "SPOTGRPO_CA_CERT": proxy.ca}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "proxy.cli", "quarantine", proxy.url, *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )

    listed = cli()
    assert (
        listed.returncode == 0
        and listed.stdout == f"{through_proxy('w1')}\tfailed the log-probabilities audit of a group\n"
    )
    lifted = cli("--lift", through_proxy("w1"))
    assert lifted.returncode == 0 and "lifted" in lifted.stdout
    assert cli("--lift", through_proxy("w1")).returncode == 1  # not quarantined any more
    assert len(actor.claim("w1", 1)) == 1
    assert admin.quarantined() == {through_proxy("w1"): ""}
    learner.forget_lifted([through_proxy("w1")])
    assert admin.quarantined() == {}
    for q in (learner, actor, admin):
        q.close()


@pytest.mark.redis
def test_the_runs_audit_tallies_add_up_on_redis_and_expire_with_the_run(redis_server, run_name: str) -> None:
    from protocol import AuditTally, ProtocolError, QueueConfig
    from protocol.trusted import RedisQueue

    q = RedisQueue.from_url(redis_server.url, QueueConfig(run=run_name))
    assert q.audits() == {}
    q.record_audits({"fleet/a": AuditTally(passed=3)})
    q.record_audits({"fleet/a": AuditTally(passed=1, failed=1), "fleet/b": AuditTally(passed=2)})  # a restart adds
    assert q.audits() == {"fleet/a": AuditTally(4, 1), "fleet/b": AuditTally(2, 0)}
    with pytest.raises(ValueError, match="worker"):
        q.record_audits({"fleet/c": AuditTally(1), "a\nb": AuditTally(1)})
    with pytest.raises(ProtocolError, match="AuditTally"):
        q.record_audits({"fleet/c": (1, 0)})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="whole numbers from 0"):
        AuditTally(passed=-1)
    assert q.audits() == {"fleet/a": AuditTally(4, 1), "fleet/b": AuditTally(2, 0)}  # nothing of those was written
    assert q.keys.audits in q.keys.all()
    q.close()


@pytest.mark.redis
def test_through_the_door_the_fleet_view_shows_each_workers_audits_and_quarantine(make_proxy, run_name: str) -> None:
    import httpx
    import msgspec
    from factories import batch
    from servers import TOKENS, through_proxy

    from protocol import AuditTally, QueueForbidden, WorkerStatus

    proxy = make_proxy()
    learner, actor, admin = proxy.queue("learner"), proxy.queue("actor"), proxy.queue("admin")
    learner.add_prompts([batch(0)])
    for name in ("w1", "w2", "w3"):
        actor.report_status(WorkerStatus(worker=name, engine="transformers", reported_at=1.0))
    w1, w2, gone = through_proxy("w1"), through_proxy("w2"), through_proxy("gone")
    learner.record_audits({w1: AuditTally(passed=4), w2: AuditTally(passed=4), gone: AuditTally(passed=1)})
    learner.record_audits({w2: AuditTally(passed=1, failed=1), gone: AuditTally(failed=1)})
    learner.quarantine(w2, "failed the sampling shape audit of a group")
    learner.quarantine(gone, "failed the log-probabilities audit of a group")
    with pytest.raises(QueueForbidden):  # an actor cannot write its own record, nor read the others'
        actor.record_audits({w1: AuditTally(passed=100)})
    with pytest.raises(QueueForbidden):
        actor.audits()
    with httpx.Client(base_url=proxy.url, verify=proxy.ssl(), timeout=15) as raw:  # garbage changes nothing
        bad = msgspec.msgpack.encode({"type": "record_audits", "workers": {w1: {"passed": -5, "failed": 0}}})
        r = raw.post(
            "/v1/audits",
            content=bad,
            headers={"Authorization": f"Bearer {TOKENS['learner']}", "Content-Type": "application/vnd.msgpack"},
        )
        assert r.status_code == 400
    assert admin.audits() == {w1: AuditTally(4, 0), w2: AuditTally(5, 1), gone: AuditTally(1, 1)}
    fleet = admin.fleet()
    assert fleet.total == 3 and {w.worker for w in fleet.workers} == {w1, w2, through_proxy("w3")}
    assert fleet.quarantined == {
        w2: "failed the sampling shape audit of a group",
        gone: "failed the log-probabilities audit of a group",  # quarantined, no longer reporting
    }
    assert fleet.audits == {w1: AuditTally(4, 0), w2: AuditTally(5, 1), gone: AuditTally(1, 1)}  # w3: none yet
    with httpx.Client(base_url=proxy.url, verify=proxy.ssl(), timeout=15) as raw:
        text = raw.get("/metrics", headers={"Authorization": f"Bearer {TOKENS['admin']}"}).text
    assert f'spotgrpo_worker_audits{{outcome="failed",worker="{w2}"}} 1.0' in text
    assert f'spotgrpo_worker_audits{{outcome="passed",worker="{w1}"}} 4.0' in text
    assert gone not in text.split("spotgrpo_token_audits")[0].split("spotgrpo_worker_audits")[-1]  # live ones only
    token = w1.split("/", 1)[0]
    assert f'spotgrpo_token_audits{{outcome="passed",token="{token}"}} 10.0' in text
    assert f'spotgrpo_token_audits{{outcome="failed",token="{token}"}} 2.0' in text
    assert "spotgrpo_workers_quarantined 2.0" in text
    for q in (learner, actor, admin):
        q.close()
