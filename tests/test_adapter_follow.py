"""In-flight adapter updates: a generation still running when a newer adapter is loaded
goes on with it from its prefix, each token keeping the version and log-probability it was
sampled with; the group names every version it spans, and the trusted side checks each
(the wire, the judge's digests, the audit's per-version log-probabilities)."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import msgspec
import pytest
import torch
from factories import batch, completion, group
from rollouts import perturbed_policy

from actors.engine import MOVE_MIN_TOKENS_LEFT, GroupRequest, Sample
from actors.hf_engine import TransformersEngine
from learner.audit import Auditor
from learner.config import LearnerConfig
from learner.judge import Bounds, judge
from learner.policy import Policy, adapter_files, pack_sequences
from protocol import Completion, ProtocolError, RolloutGroup, SamplingParams, group_id_for, pack_i32

D1, D2, D3 = "1" * 64, "2" * 64, "3" * 64

# ------------------------------------------------------------------ the wire


def spanning(versions: list[list[int]], adapter_version: int = 1, later: dict[int, str] | None = None) -> RolloutGroup:
    """A group whose completions' tokens name `versions` (one list per completion)."""
    g = group(batch(0), version=adapter_version, completions=len(versions), tokens=4)
    completions = [
        Completion.of(c.tokens, c.logps, None, None if all(x == adapter_version for x in v) else v, **_rest(c))
        for c, v in zip(g.completions, versions, strict=True)
    ]
    later = {2: D2} if later is None else later
    return msgspec.structs.replace(g, completions=completions, adapter_digest=D1, later_digests=later)


def _rest(c: Completion) -> dict[str, object]:
    return {"finish_reason": c.finish_reason, "reward": c.reward, "text": c.text}


def test_a_group_names_every_version_its_tokens_span_and_no_other() -> None:
    good = spanning([[1, 1, 2, 2], [1, 1, 1, 1], [2, 2, 2, 2], [1, 2, 2, 2]])
    assert good.versions == [1, 2] and good.newest_version == 2
    assert good.completions[1].versions is None  # all the group's: sent as none
    assert good.completions[2].token_versions(1).tolist() == [2, 2, 2, 2]
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(good), type=RolloutGroup)
    assert decoded == good
    cases = [
        ([[1, 2, 1, 2]] * 4, None, "older than the one before it"),
        ([[2, 2, 2, 2]] * 4, None, "the oldest token is v2"),  # the group says v1
        ([[1, 1, 2, 2]] * 4, {}, r"later_digests: names v\[\]; the completions' newer versions are v\[2\]"),
        ([[1, 1, 2, 2]] * 4, {2: D2, 3: D3}, r"names v\[2, 3\]"),  # a digest for a version no token names
        ([[1, 1, 1, 1]] * 4, {2: D2}, r"newer versions are v\[\]"),
    ]
    for versions, later, message in cases:
        with pytest.raises(ProtocolError, match=message):
            spanning(versions, later=later)
    with pytest.raises(ProtocolError, match="versions: 12 bytes for 4 token ids"):
        msgspec.structs.replace(completion(4), versions=pack_i32([1, 1, 2]))


BOUNDS = Bounds("actor", 10.0, 1000, 2048, 4, 64, 2)


def test_the_judge_checks_every_version_a_group_spans() -> None:
    good = spanning([[1, 1, 2, 2], [1, 1, 1, 1], [1, 2, 2, 2], [2, 2, 2, 2]])
    published = {1: D1, 2: D2}.get
    assert judge(good, BOUNDS, 2, None, published) is None
    # a newer version's digest wrong: the worker served other files under its name
    lying = msgspec.structs.replace(good, later_digests={2: D3})
    assert judge(lying, BOUNDS, 2, None, published) == "rejected_adapter_digest"
    # its newest token from a version the learner has not published yet
    assert judge(good, BOUNDS, 1, None, {1: D1}.get) == "rejected_future_version"
    # staleness is measured on the oldest token: v1 with the policy at v4, bound 2
    assert judge(good, BOUNDS, 4, None, {}.get) == "dropped_stale"
    assert judge(good, BOUNDS, 3, None, {}.get) is None


# ------------------------------------------------------------------ the engine


class Watched(TransformersEngine):
    """The real engine, saying when a generation call starts."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.started = threading.Event()
        self.calls = 0

    def _generate_chunk(self, *args, **kwargs):
        self.calls += 1
        self.started.set()
        return super()._generate_chunk(*args, **kwargs)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> dict[int, tuple[Policy, Path]]:
    out = {}
    for version in (1, 2):
        policy = perturbed_policy(tiny_model, version)
        folder = tmp_path_factory.mktemp(f"v{version}")
        for name, data in adapter_files(policy.adapter_state(), policy.adapter_config_json()).items():
            (folder / name).write_bytes(data)
        out[version] = (policy, folder)
    return out


PROMPTS = [[5, 6, 7], [8, 9, 10, 11]]
LONG = SamplingParams(temperature=1.0, max_tokens=160)


def _run(engine: Watched, groups: list[GroupRequest], load: tuple[int, Path] | None) -> dict[object, list[Sample]]:
    """Queue `groups`, load `load` once the first generation call runs, step to the end."""
    engine.add(groups)
    loader = threading.Thread(target=lambda: engine.started.wait(30) and load and engine.load_adapter(*load))
    loader.start()
    done: dict[object, list[Sample]] = {}
    while len(done) < len(groups):
        done.update(engine.step(1.0))
    loader.join(30)
    return done


def _logps(policy: Policy, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    seqs = pack_sequences([prompt], [tokens], policy.pad_id)
    with torch.no_grad():
        logps, _ = policy.forward_logps(seqs, 1.0)
    return logps[0][seqs.mask_BT[0].bool()]


def test_a_generation_goes_on_with_the_adapter_loaded_while_it_runs(tiny_model: Path, adapters) -> None:
    """v2 is loaded while a following group generates on v1: the samples still running go
    on with v2 from their prefix; each token's log-probability is its own version's."""
    engine = Watched(str(tiny_model))
    engine.load_adapter(1, adapters[1][1])
    groups = [GroupRequest(i, p, 8, LONG, 1, seed=i, follow=engine.newest_version) for i, p in enumerate(PROMPTS)]
    done = _run(engine, groups, (2, adapters[2][1]))
    assert engine.calls >= 2  # stopped for v2, continued
    spans = 0
    deltas: dict[str, list[float]] = {"right": [], "wrong": []}
    for i, prompt in enumerate(PROMPTS):
        for s in done[i]:
            versions = s.token_versions(1)
            assert len(versions) == len(s.token_ids) == len(s.logprobs) and versions == sorted(versions)
            if 2 in versions:
                spans += versions[0] == 1
            tokens = torch.tensor(versions)
            for v in (1, 2):
                mine = tokens == v
                if not mine.any():
                    continue
                got = torch.tensor(s.logprobs)[mine]
                deltas["right"] += (_logps(adapters[v][0], prompt, s.token_ids)[mine] - got).abs().tolist()
                deltas["wrong"] += (_logps(adapters[3 - v][0], prompt, s.token_ids)[mine] - got).abs().tolist()
    assert spans > 0, "no sample was generating when v2 arrived"
    assert sum(deltas["right"]) / len(deltas["right"]) < 1e-3
    assert sum(deltas["wrong"]) / len(deltas["wrong"]) > 1e-2
    assert engine.in_flight == 0


def test_a_pinned_group_finishes_on_its_version_and_a_queued_one_starts_on_the_newest(
    tiny_model: Path, adapters
) -> None:
    engine = Watched(str(tiny_model))
    engine.load_adapter(1, adapters[1][1])
    pinned = GroupRequest("pinned", PROMPTS[0], 8, LONG, 1, seed=1)
    done = _run(engine, [pinned], (2, adapters[2][1]))
    assert engine.calls == 1 and all(s.versions is None for s in done["pinned"])  # the load waited
    assert engine.loaded_versions() == [1, 2]
    # following, but near its end: it finishes on v1, and the load waits those few tokens
    engine = Watched(str(tiny_model))
    engine.load_adapter(1, adapters[1][1])
    near = GroupRequest("near", PROMPTS[0], 8, SamplingParams(max_tokens=MOVE_MIN_TOKENS_LEFT), 1, seed=1)
    done = _run(engine, [dataclasses.replace(near, follow=engine.newest_version)], (2, adapters[2][1]))
    assert engine.calls == 1 and all(s.versions is None for s in done["near"])
    # queued on v1 and taken up after v2 was loaded: every token is v2's
    short = SamplingParams(temperature=1.0, max_tokens=8)
    queued = GroupRequest("queued", PROMPTS[1], 4, short, 1, follow=engine.newest_version)
    engine.add([queued])
    samples = engine.step(30.0)[0][1]
    assert all(s.versions == [2] * len(s.token_ids) for s in samples)


# ------------------------------------------------------------------ the audit


def test_the_audit_checks_each_token_under_the_version_it_names(tiny_model: Path, adapters) -> None:
    engine = Watched(str(tiny_model))
    engine.load_adapter(1, adapters[1][1])
    sampling = SamplingParams(temperature=1.0, max_tokens=160)
    groups = [GroupRequest(i, p, 8, sampling, 1, seed=i, follow=engine.newest_version) for i, p in enumerate(PROMPTS)]
    done = _run(engine, groups, (2, adapters[2][1]))
    policy = Policy(LearnerConfig(model=str(tiny_model), lora_rank=4))
    auditor = Auditor(policy, sampling, rate=1.0)
    auditor.remember(1, adapters[1][0].adapter_state())
    auditor.remember(2, adapters[2][0].adapter_state())
    auditor.trained()

    def as_group(i: int, versions_of) -> RolloutGroup:
        samples = done[i]
        versions = [versions_of(s) for s in samples]
        oldest = min(v[0] for v in versions)
        return RolloutGroup(
            group_id=group_id_for("b", f"p{i}"),
            batch_id="b",
            prompt_id=f"p{i}",
            adapter_version=oldest,
            adapter_digest=D1 if oldest == 1 else D2,
            later_digests={2: D2} if oldest == 1 and any(2 in v for v in versions) else {},
            actor_id="w",
            prompt_token_ids=pack_i32(PROMPTS[i]),
            completions=[
                Completion.of(s.token_ids, s.logprobs, None, v, finish_reason=s.finish_reason, reward=0.0)
                for s, v in zip(samples, versions, strict=True)
            ],
        )

    honest = [as_group(i, lambda s: s.token_versions(1)) for i in range(len(PROMPTS))]
    assert any(len(g.versions) == 2 for g in honest)
    assert [f.failed(auditor.limits) for g in honest if (f := auditor.audit(g))] == [None, None]
    # the same tokens told as all v1's (an update hidden): the v2 part gives it away
    told_one = [as_group(i, lambda s: [1] * len(s.token_ids)) for i, g in enumerate(honest) if len(g.versions) == 2]
    assert {f.failed(auditor.limits) for g in told_one if (f := auditor.audit(g))} == {"log-probabilities"}
