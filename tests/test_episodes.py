"""Episodes: tool calls turn after turn, the environment's tokens masked, tools sandboxed."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator
from dataclasses import replace as dataclass_replace
from pathlib import Path

import pytest
from factories import NO_AUDITS
from scripted import LOGP, ScriptedEngine, tool_call
from with_worker import run_with_a_worker

from actors.engine import GroupRequest, Sample
from actors.episodes import EpisodeEngine, episode_request
from actors.tools import Toolbox
from learner.tiny import build_tokenizer
from protocol import ProtocolError, SamplingParams, decode, encode
from protocol.usercode.chat import HERMES_CHATML, ToolError, load_tools, tool_template

TOOLS = ["toy_tools:add", "toy_tools:slow_add", "toy_tools:hang", "toy_tools:hog", "toy_tools:divide"]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(chatml=True)


@pytest.fixture(scope="module")
def toolbox() -> Iterator[Toolbox]:
    box = Toolbox(TOOLS, timeout_s=1.0, memory_mb=512, workers=2)
    yield box
    box.close()


def episodes(tokenizer, toolbox: Toolbox, script, context: int | None = None) -> tuple[EpisodeEngine, ScriptedEngine]:
    inner = ScriptedEngine(tokenizer, script, context)
    return EpisodeEngine(inner, toolbox, tool_template(tokenizer)), inner


def prompt(tokenizer, question: str = "what is 2+3") -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}],
        add_generation_prompt=True,
        tokenize=False,
        chat_template=HERMES_CHATML,
        tools=load_tools(TOOLS),
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def run(engine: EpisodeEngine, groups: list[GroupRequest], timeout_s: float = 30) -> dict:
    engine.add(groups)
    done: dict = {}
    deadline = time.monotonic() + timeout_s
    while len(done) < len(groups):
        assert time.monotonic() < deadline, f"episodes not done: {set(g.key for g in groups) - set(done)}"
        done.update(engine.step(0.02))
    return done


def episode(
    key: object, ids: list[int], n: int = 1, max_tokens: int = 400, turns: int | None = 4, version: int = 0
) -> GroupRequest:
    return episode_request(GroupRequest(key, ids, n, SamplingParams(max_tokens=max_tokens), version), turns)


def until_result(call: str, answer: str = "the answer is 5"):
    """A model that makes `call` until it sees a tool's result, then answers."""
    return lambda text, j: answer if "<tool_response>" in text else call


def parts(tokenizer, s: Sample) -> tuple[str, str]:
    """(the model's text, the environment's text) of an episode."""
    assert s.mask is not None
    model = [t for t, m in zip(s.token_ids, s.mask, strict=True) if m]
    env = [t for t, m in zip(s.token_ids, s.mask, strict=True) if not m]
    return tokenizer.decode(model, skip_special_tokens=False), tokenizer.decode(env, skip_special_tokens=False)


# ---------------------------------------------------------------- one episode


def test_a_tool_call_is_run_and_its_result_masked_out_of_the_models_tokens(tokenizer, toolbox) -> None:
    engine, inner = episodes(tokenizer, toolbox, until_result(tool_call("add", a=2, b=3)))
    [(_, [s])] = run(engine, [episode("g", prompt(tokenizer))]).items()
    model, env = parts(tokenizer, s)
    assert (s.turns, s.tool_calls, s.tool_errors, s.finish_reason, s.turn_limit) == (2, 1, 0, "stop", False)
    assert model == tool_call("add", a=2, b=3) + "<|im_end|>" + "the answer is 5<|im_end|>"
    assert env == "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert [lp for lp, m in zip(s.logprobs, s.mask, strict=True) if not m] == [0.0] * env_len(tokenizer, env)
    assert all(lp == LOGP for lp, m in zip(s.logprobs, s.mask, strict=True) if m)
    # the second turn continued the whole episode: prompt, first turn, the result's tokens
    second = inner.requests[-1]
    assert list(second.prompt) == prompt(tokenizer) + s.token_ids[: len(second.prompt) - len(prompt(tokenizer))]
    assert second.n == 1 and second.sampling.max_tokens == 400 - (len(second.prompt) - len(prompt(tokenizer)))


def env_len(tokenizer, env: str) -> int:
    return len(tokenizer(env, add_special_tokens=False)["input_ids"])


def test_an_async_tool_and_several_calls_in_one_turn(tokenizer, toolbox) -> None:
    calls = tool_call("slow_add", a=1, b=1) + "\n" + tool_call("add", a=40, b=2)
    engine, _ = episodes(tokenizer, toolbox, until_result(calls))
    [(_, [s])] = run(engine, [episode("g", prompt(tokenizer))]).items()
    _, env = parts(tokenizer, s)
    assert s.tool_calls == 2 and s.tool_errors == 0
    assert "<tool_response>\n2\n</tool_response>\n<tool_response>\n42\n</tool_response>" in env
    assert s.tool_s >= 0.2


@pytest.mark.parametrize(
    ("call", "told"),
    [
        (tool_call("hang", seconds=60), "time limit of 1s"),
        (tool_call("hog", megabytes=4096), "out of memory"),
        (tool_call("divide", a=1, b=0), "raised ZeroDivisionError"),
        (tool_call("add", a=1), "bad arguments for add"),
        (tool_call("rm_rf", path="/"), "unknown tool 'rm_rf'"),
        ('<tool_call>\n{"name": "add", "arguments": {"a": 1,}}\n</tool_call>', "could not be read"),
        ('<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>', "needs a name"),
    ],
)
def test_a_tool_that_fails_hangs_or_eats_memory_is_an_error_the_model_sees(
    tokenizer, toolbox, call: str, told: str
) -> None:
    """The episode goes on: the model's next turn sees the error where the result would be."""
    engine, _ = episodes(tokenizer, toolbox, until_result(call, "sorry"))
    started = time.monotonic()
    [(_, [s])] = run(engine, [episode("g", prompt(tokenizer))]).items()
    _, env = parts(tokenizer, s)
    assert told in env and "error" in env
    assert (s.turns, s.tool_calls, s.tool_errors, s.finish_reason) == (2, 1, 1, "stop")
    assert time.monotonic() - started < 15
    # the pool is whole again: the next call works
    engine2, _ = episodes(tokenizer, toolbox, until_result(tool_call("add", a=2, b=3)))
    [(_, [again])] = run(engine2, [episode("g2", prompt(tokenizer))]).items()
    assert "<tool_response>\n5\n</tool_response>" in parts(tokenizer, again)[1]


def test_episodes_end_at_the_turn_limit_and_at_the_token_limit(tokenizer, toolbox) -> None:
    always = lambda text, j: tool_call("add", a=1, b=2)  # noqa: E731 - a model that never stops calling
    engine, _ = episodes(tokenizer, toolbox, always)
    [(_, [s])] = run(engine, [episode("g", prompt(tokenizer), turns=2)]).items()
    assert (s.turns, s.tool_calls, s.finish_reason) == (3, 2, "stop")  # two rounds of tools, then its last turn
    assert s.turn_limit  # which called a tool too, unanswered
    # max_tokens bounds the whole episode: a result that does not fit ends it, cut
    one_turn = len(tokenizer(tool_call("add", a=1, b=2), add_special_tokens=False)["input_ids"]) + 1
    [(_, [cut])] = run(engine, [episode("h", prompt(tokenizer), max_tokens=one_turn + 10, turns=None)]).items()
    assert (cut.turns, cut.finish_reason, len(cut.token_ids)) == (1, "length", one_turn)
    assert cut.mask is None  # nothing but the model's tokens
    # and the model's context bounds prompt and episode
    engine, _ = episodes(tokenizer, toolbox, always, context=len(prompt(tokenizer)) + one_turn + 10)
    [(_, [cut])] = run(engine, [episode("i", prompt(tokenizer), turns=None)]).items()
    assert (cut.turns, cut.finish_reason) == (1, "length")


def test_the_engine_generates_other_groups_while_a_tool_runs(tokenizer, toolbox) -> None:
    def script(text: str, j: int) -> str:
        if "slow" in text and "<tool_response>" not in text:
            return tool_call("hang", seconds=0.5)
        return "7"

    engine, _ = episodes(tokenizer, toolbox, script)
    engine.add([episode("slow", prompt(tokenizer, "slow one"))])
    finished: list[tuple[object, float]] = []
    started = time.monotonic()
    while not any(k == "slow" for k, _ in finished):
        assert time.monotonic() - started < 30
        if engine.in_flight < 3:  # keep feeding plain groups while the episode waits on its tool
            engine.add(
                [
                    GroupRequest(
                        f"plain-{len(finished)}-{time.monotonic()}",
                        prompt(tokenizer),
                        2,
                        SamplingParams(max_tokens=8),
                        0,
                    )
                ]
            )
        finished += [(k, time.monotonic() - started) for k, _ in engine.step(0.02)]
    plain_done_meanwhile = [k for k, _ in finished if k != "slow"]
    assert len(plain_done_meanwhile) >= 5  # the tool's 0.5 s did not stop the engine


def test_an_episode_keeps_its_adapter_version_through_an_eviction(tokenizer, toolbox, tmp_path: Path) -> None:
    engine, inner = episodes(tokenizer, toolbox, until_result(tool_call("slow_add", a=2, b=3)))
    engine.load_adapter(1, tmp_path)
    engine.add([episode("g", prompt(tokenizer), version=1)])
    released = threading.Event()
    while not inner.requests or engine.inner.in_flight:  # its first turn is generated
        engine.step(0.01)
    engine.evict_adapter(1, released.set)  # while its tool runs
    assert engine.loaded_versions() == [] and not released.is_set()
    done: dict = {}
    while not done:
        done.update(engine.step(0.02))
    assert [r.version for r in inner.requests] == [1, 1]  # both turns on v1
    assert released.is_set() and inner.evicted == [1]


def test_a_following_episode_takes_the_newest_adapter_at_its_next_turn(tokenizer, toolbox, tmp_path: Path) -> None:
    """In-flight updates: v2 is loaded while the episode's tool runs; its next turn is
    queued on v2, and its tokens say so (the environment's carry the turn before's)."""
    engine, inner = episodes(tokenizer, toolbox, until_result(tool_call("slow_add", a=2, b=3)))
    engine.load_adapter(1, tmp_path)
    group = episode("g", prompt(tokenizer), version=1)
    engine.add([dataclasses.replace(group, follow=engine.newest_version)])
    while not inner.requests or engine.inner.in_flight:  # its first turn is generated
        engine.step(0.01)
    engine.load_adapter(2, tmp_path)  # while its tool runs
    done: dict = {}
    while not done:
        done.update(engine.step(0.02))
    assert [r.version for r in inner.requests] == [1, 2]
    [s] = done["g"]
    assert s.versions is not None and s.mask is not None
    first_turn = s.mask.index(0)  # the first environment token
    second_turn = first_turn + s.mask[first_turn:].index(1)
    assert s.versions == [1] * second_turn + [2] * (len(s.token_ids) - second_turn)


def test_groups_without_tools_pass_straight_through(tokenizer, toolbox) -> None:
    engine, inner = episodes(tokenizer, toolbox, lambda text, j: tool_call("add", a=1, b=1))
    plain = GroupRequest("plain", prompt(tokenizer), 3, SamplingParams(max_tokens=200), 0)
    [(_, samples)] = run(engine, [plain]).items()
    assert [s.turns for s in samples] == [1, 1, 1] and all(s.mask is None for s in samples)
    assert len(inner.requests) == 1


def test_a_group_of_episodes_ends_when_its_last_episode_ends(tokenizer, toolbox) -> None:
    """Each sample of a group goes its own way: one answers at once, one calls a tool."""

    def script(text: str, j: int) -> str:
        return "5" if j == 0 or "<tool_response>" in text else tool_call("add", a=2, b=3)

    engine, inner = episodes(tokenizer, toolbox, script)
    [(_, samples)] = run(engine, [episode("g", prompt(tokenizer), n=2)]).items()
    assert [(s.turns, s.tool_calls) for s in samples] == [(1, 0), (2, 1)]
    assert [r.n for r in inner.requests] == [2, 1]


# ---------------------------------------------------------------- tools and templates


def test_tools_must_be_typed_and_documented_and_uniquely_named() -> None:
    with pytest.raises(ToolError, match="no function"):
        load_tools(["toy_tools:nope"])
    with pytest.raises(ToolError, match=r"docstring|description"):
        load_tools(["toy_tools:undocumented"])
    with pytest.raises(ToolError, match="type hint"):
        load_tools(["toy_rewards:digit_first"])  # untyped
    with pytest.raises(ToolError, match="share a name"):
        load_tools(["toy_tools:add", "toy_tools.add"])
    with pytest.raises(ToolError, match="no weight"):
        load_tools(["toy_tools:add=2"])


def test_a_template_without_tools_falls_back_to_chatml_or_is_refused(tokenizer) -> None:
    from protocol.usercode.chat import ToolTemplateError

    assert tool_template(tokenizer) is HERMES_CHATML  # plain ChatML, as SmolLM2's
    tokenizer_with_tools = build_tokenizer(chatml=True)
    tokenizer_with_tools.chat_template = HERMES_CHATML
    assert tool_template(tokenizer_with_tools) is None  # its own template offers tools
    with pytest.raises(ToolTemplateError, match="not ChatML"):
        tool_template(build_tokenizer())


# ---------------------------------------------------------------- the wire


def test_the_mask_travels_and_is_checked() -> None:
    import msgspec
    from factories import batch, group

    from protocol import Completion

    c = Completion.of(
        [5, 6, 7, 8], [-0.1, 0.0, 0.0, -0.2], [1, 0, 0, 1], finish_reason="stop", reward=1.0, turns=2, tool_calls=1
    )
    episode_group = msgspec.structs.replace(group(batch()), completions=[c])
    assert decode(encode(episode_group)).completions[0] == c  # type: ignore[union-attr]
    assert c.model_tokens == 2 and c.model_mask.tolist() == [1.0, 0.0, 0.0, 1.0]
    assert Completion.of([5, 6], [-0.1, -0.2], [1, 1], finish_reason="stop").mask is None  # all the model's
    for mask, match in [
        (b"\x01\x00", "2 bytes for 4"),
        (b"\x00\x01\x01\x01", "starting with a model token"),
        (b"\x01\x02\x01\x01", "0 or 1"),
    ]:
        with pytest.raises(ProtocolError, match=match):
            Completion(token_ids=c.token_ids, logprobs=c.logprobs, mask=mask, finish_reason="stop")
    with pytest.raises(ProtocolError, match="tool_errors"):
        Completion.of([5], [-0.1], finish_reason="stop", tool_calls=1, tool_errors=2)


def test_a_message_of_the_old_schema_is_refused_with_what_to_do() -> None:
    import msgspec

    from protocol import SCHEMA_VERSION

    assert SCHEMA_VERSION == 4  # 4: tokens carry the adapter version they were sampled with
    for schema in (1, 2, 3):
        old = msgspec.msgpack.encode({"type": "prompt_batch", "schema": schema, "batch_id": "b"})
        with pytest.raises(
            ProtocolError, match=rf"unknown schema version {schema}; this build speaks 4 .*same spotgrpo release"
        ):
            decode(old)


# ---------------------------------------------------------------- through the machine


def arithmetic_script(text: str, j: int) -> str:
    """Even samples use the add tool and answer with its result; odd ones guess 0."""
    import re

    if j % 2:
        return "0"
    if "<tool_response>" in text:
        return re.findall(r"<tool_response>\n(-?\d+)\n</tool_response>", text)[-1]
    a, b = re.findall(r"what is (\d+)\+(\d+)", text)[-1]
    return tool_call("add", a=int(a), b=int(b))


def write_chat_dataset(path: Path, n: int = 16) -> Path:
    import json

    rows = [
        {"prompt": [{"role": "user", "content": f"what is {i}+{2 * i + 1}"}], "answer": str(3 * i + 1)}
        for i in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.redis
@pytest.mark.slow
def test_episodes_through_the_proxy_scored_by_the_tier_and_trained(
    tmp_path: Path, tiny_chatml_model: Path, make_proxy, scorers, redis_server, run_name: str
) -> None:
    """The learner offers the tool in its prompts; a worker behind the proxy runs the
    episodes (its model scripted, its tools real); the trusted tier scores the transcript
    decoded from the token ids against the private answer; the learner trains on the
    model's tokens only and reports the episodes' shape."""

    from actors.watcher import ProxySource
    from learner.config import LearnerConfig

    store = (tmp_path / "store").as_uri()
    proxy = make_proxy(store=store)
    scorers(reward="toy_rewards:last_line_is_answer", model=tiny_chatml_model)
    cfg = LearnerConfig(
        run=run_name,
        queue=redis_server.url,
        store=store,
        model=str(tiny_chatml_model),
        dataset=str(write_chat_dataset(tmp_path / "train.jsonl")),
        run_dir=tmp_path / "run",
        reward=["toy_rewards:last_line_is_answer"],
        tools=["toy_tools:add"],
        max_tool_calling_iterations=2,
        steps=3,
        groups_per_step=2,
        num_generations=4,
        prompts_per_batch=2,
        max_tokens=160,
        lora_rank=4,
        checkpoint_every=3,
        tensorboard=False,
        max_staleness=8,
        **NO_AUDITS,
    )
    tokenizer = build_tokenizer(chatml=True)
    engine = EpisodeEngine(
        ScriptedEngine(tokenizer, arithmetic_script), Toolbox(["toy_tools:add"]), tool_template(tokenizer)
    )
    actor_queue = proxy.queue("actor", lease_timeout_s=30)
    state, rows = run_with_a_worker(cfg, actor_queue, ProxySource(actor_queue), engine, None, tmp_path / "cache")
    assert state.step == 3
    steps = [r for r in rows if "turns_mean" in r]
    assert len(steps) == 3
    for r in steps:
        assert r["turns_mean"] == 1.5 and r["tools/call_frequency"] == 0.5 and r["tools/failure_frequency"] == 0.0
        assert 0.0 < r["model_token_frac"] < 1.0 and r["turn_limit_frac"] == 0.0
        assert r["reward"] == 0.5  # the tool users answer right, the guessers do not: scored by the tier
        assert r["tokens"] < r["completions/mean_length"] * 8  # the environment's tokens are not trained


@pytest.mark.redis
def test_a_worker_without_the_batchs_tools_hands_it_back_and_stops(
    tokenizer, redis_server, run_name: str, tmp_path: Path
) -> None:
    import time as clock

    import msgspec
    from factories import batch

    from actors.watcher import AdapterWatcher
    from actors.worker import Worker, WorkerRefused
    from protocol import QueueConfig
    from protocol.trusted import RedisQueue, open_store
    from protocol.trusted.store import StoreSource

    queue = RedisQueue.from_url(redis_server.url, QueueConfig(run=run_name, lease_timeout_s=60))
    queue.add_prompts([msgspec.structs.replace(batch(), tools=["add"], scoring="trusted")])
    engine = ScriptedEngine(tokenizer, lambda text, j: "5")  # no toolbox
    watcher = AdapterWatcher(queue, StoreSource(open_store((tmp_path / "store").as_uri())), engine, tmp_path / "c")
    worker = Worker(queue, engine, watcher, None, "w", claim_block_s=0.2)
    with pytest.raises(WorkerRefused, match="tools add; this worker lacks add: start it with the learner's --tools"):
        worker.work()
    started = clock.monotonic()
    assert len(queue.claim("other", 1, block_s=1.0)) == 1  # handed back, not left to expire
    assert clock.monotonic() - started < 2
    queue.close()


def test_episodes_on_the_transformers_engine(tiny_chatml_model: Path, toolbox: Toolbox) -> None:
    """The model's later turns are the real engine's: greedy, each continues exactly the
    episode's tokens (prompt, the call, the result's tokens), as one more request."""
    from scripted import FirstTurnCalls

    from actors.hf_engine import TransformersEngine

    class Engine(FirstTurnCalls, TransformersEngine):
        pass

    inner = Engine(str(tiny_chatml_model))
    engine = EpisodeEngine(inner, toolbox, tool_template(inner.tokenizer))
    ids = prompt(inner.tokenizer)
    request = episode_request(GroupRequest("g", ids, 2, SamplingParams(temperature=0.0, max_tokens=300), 0), 1)
    [(_, samples)] = run(engine, [request], timeout_s=120).items()
    for s in samples:
        assert s.mask is not None and s.turns == 2 and s.tool_calls == 1
        model, env = parts(inner.tokenizer, s)
        assert model.startswith(FirstTurnCalls.FIRST_CALL) and "<tool_response>\n5\n</tool_response>" in env
        second = s.mask.index(1, s.mask.index(0))  # where the model's second turn starts
        assert len(s.token_ids) <= 300 and all(lp <= 0.0 for lp in s.logprobs)
        alone = TransformersEngine.generate(
            inner, [ids + s.token_ids[:second]], 1, SamplingParams(temperature=0.0, max_tokens=300 - second), 0
        )[0][0]
        assert s.token_ids[second:] == alone.token_ids
        assert s.logprobs[second:] == pytest.approx(alone.logprobs, abs=1e-4)


# ---------------------------------------------------------------- environments


def guesser(start: int):
    """A model that guesses `start`, then moves by one towards what the environment says."""
    import re

    def script(text: str, j: int) -> str:
        guesses = [int(g) for g in re.findall(r'"number": (\d+)', text)]
        answers = re.findall(r"<tool_response>\n(\w+)\n</tool_response>", text)
        if not guesses:
            return tool_call("guess", number=start + j)
        step = {"higher": 1, "lower": -1}.get(answers[-1], 0) if answers else 0
        return tool_call("guess", number=guesses[-1] + step)

    return script


@pytest.fixture(scope="module")
def environment() -> Iterator[Toolbox]:
    box = Toolbox([], environment="toy_tools:GuessNumber", timeout_s=1.0, memory_mb=512, workers=2)
    yield box
    box.close()


def test_each_episode_has_its_own_environment_which_ends_it(tokenizer, environment: Toolbox) -> None:
    engine, _ = episodes(tokenizer, environment, guesser(3))
    request = episode("g", prompt(tokenizer, "guess"), n=3, max_tokens=3000, turns=20)
    [(_, samples)] = run(engine, [dataclass_replace(request, columns={"secret": 6})]).items()
    # guesses 3, 4, 5 (the j-th starts at 3 + j) climb to 6, one instance each
    assert [(s.turns, s.tool_calls, s.finish_reason) for s in samples] == [
        (4, 4, "stop"),
        (3, 3, "stop"),
        (2, 2, "stop"),
    ]
    for s in samples:
        model, env = parts(tokenizer, s)
        assert model.endswith(tool_call("guess", number=6) + "<|im_end|>")
        assert env.count("higher") == s.turns - 1 and env.count("correct") == 1  # and the environment ended it
    assert environment._host_of == {}  # every instance was let go


@pytest.mark.parametrize(
    ("environment_spec", "told"),
    [
        ("toy_tools:BrokenReset", "could not be made: RuntimeError: no board today"),
        ("toy_tools:Observing", "reset() returned an observation"),
    ],
)
def test_an_environment_that_cannot_be_made_ends_its_episode_with_the_reason(
    tokenizer, environment_spec: str, told: str
) -> None:
    box = Toolbox([], environment=environment_spec, timeout_s=2.0, workers=1)
    try:
        engine, _ = episodes(tokenizer, box, guesser(3))
        [(_, [s])] = run(engine, [episode("g", prompt(tokenizer, "guess"), max_tokens=3000, turns=20)]).items()
        assert (s.turns, s.tool_calls, s.tool_errors, s.finish_reason) == (1, 1, 1, "stop")
        assert told in parts(tokenizer, s)[1]  # the last word, the model's first call answered with the reason
    finally:
        box.close()


def test_an_environment_call_past_its_limit_loses_that_hosts_instances_and_says_so(tokenizer) -> None:
    box = Toolbox([], environment="toy_tools:GuessNumber", timeout_s=1.0, workers=1)

    def script(text: str, j: int) -> str:
        return tool_call("stall", seconds=30) if "<tool_response>" not in text else tool_call("guess", number=1)

    try:
        engine, _ = episodes(tokenizer, box, script)
        [(_, [s])] = run(engine, [episode("g", prompt(tokenizer, "stall"), max_tokens=3000, turns=20)]).items()
        _, env = parts(tokenizer, s)
        assert "time limit of 1s" in env  # the stalled call, answered
        assert (s.turns, s.tool_calls, s.tool_errors, s.finish_reason) == (2, 2, 2, "stop")  # then: instance lost
    finally:
        box.close()


@pytest.mark.redis
@pytest.mark.slow
def test_an_environment_run_trains_with_the_actors_scoring(
    tmp_path: Path, tiny_chatml_model: Path, redis_server, run_name: str
) -> None:
    """`--environment` end to end: the learner offers its methods, a worker runs one
    instance per episode (reset with the prompt's columns: actors' scoring sends them),
    the episodes end when the environment says so or at the turn limit."""
    import json

    from learner.config import LearnerConfig
    from protocol import QueueConfig
    from protocol.trusted import RedisQueue, open_store
    from protocol.trusted.store import StoreSource
    from protocol.usercode.rewards import Scorer, load_reward

    rows = [{"prompt": [{"role": "user", "content": "guess my number"}], "secret": 4 + i % 4} for i in range(8)]
    (tmp_path / "guess.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    store = (tmp_path / "store").as_uri()
    cfg = LearnerConfig(
        run=run_name,
        queue=redis_server.url,
        store=store,
        model=str(tiny_chatml_model),
        dataset=str(tmp_path / "guess.jsonl"),
        run_dir=tmp_path / "run",
        environment="toy_tools:GuessNumber",
        max_tool_calling_iterations=3,
        steps=2,
        groups_per_step=2,
        num_generations=4,
        prompts_per_batch=2,
        max_tokens=800,
        lora_rank=4,
        checkpoint_every=2,
        tensorboard=False,
        max_staleness=8,
        eval_dataset=str(tmp_path / "guess.jsonl"),
        eval_every=1,
        eval_generations=4,
        eval_max_prompts=4,
        **NO_AUDITS,
    )
    tokenizer = build_tokenizer(chatml=True)
    box = Toolbox([], environment="toy_tools:GuessNumber", workers=2)
    engine = EpisodeEngine(ScriptedEngine(tokenizer, guesser(3)), box, tool_template(tokenizer))
    state, rows = run_with_a_worker(
        cfg,
        RedisQueue.from_url(redis_server.url, QueueConfig(run=run_name)),
        StoreSource(open_store(store)),
        engine,
        Scorer([load_reward("toy_rewards:found_it")]),
        tmp_path / "cache",
    )
    assert state.step == 2
    for r in [r for r in rows if "tools/call_frequency" in r]:
        assert r["tools/call_frequency"] > 1.0 and 0.0 < r["reward"] < 1.0, r
        assert r["turns_mean"] <= 4.0 and r["turn_limit_frac"] > 0.0  # the far guessers ran out of turns
    from learner.progress import read_evals

    evals = read_evals(tmp_path / "run")
    assert {e["eval/version"] for e in evals} >= {0, 2}  # the base model and the final adapter, as episodes
    for e in evals:  # secrets 4-7 from guesses 3-6, 4 turns each: pass@4 always, pass@1 not
        assert e["eval/pass@4"] == 1.0 and 0.0 < e["eval/pass@1"] < 1.0, e


def generated_guesses(tokenizer, redis_server, run_name: str, tmp_path: Path):
    """A group of four episodes of the number guessing environment (`toy_tools:ScoredGuess`,
    its secret 4 a private column), generated by a worker and waiting for the tier; its
    guesses start at 3, 4, 5 and 6 and climb to the actor's 7, a turn a guess."""
    import msgspec
    from factories import batch, trusted

    from actors.watcher import AdapterWatcher
    from actors.worker import Worker
    from protocol import QueueConfig
    from protocol.trusted import RedisQueue, open_store
    from protocol.trusted.store import StoreSource

    queue = RedisQueue.from_url(redis_server.url, QueueConfig(run=run_name, lease_timeout_s=60))
    episodes_batch = msgspec.structs.replace(
        trusted(batch(), secret=4),
        tools=["guess", "stall"],
        environment="ScoredGuess",
        sampling=SamplingParams(max_tokens=3000),
    )
    queue.add_prompts([episodes_batch])
    box = Toolbox([], environment="toy_tools:ScoredGuess", workers=2)
    engine = EpisodeEngine(ScriptedEngine(tokenizer, guesser(3)), box, tool_template(tokenizer))
    watcher = AdapterWatcher(queue, StoreSource(open_store((tmp_path / "store").as_uri())), engine, tmp_path / "c")
    worker = Worker(queue, engine, watcher, None, "w", claim_block_s=0.2)
    try:
        worker.work(max_batches=1)
    finally:
        engine.close()
    return queue, len(episodes_batch.prompts)


@pytest.mark.redis
@pytest.mark.slow
def test_the_tier_replays_the_environment_with_the_private_columns_for_its_reward(
    tokenizer, tiny_chatml_model: Path, redis_server, scorers, run_name: str, tmp_path: Path
) -> None:
    """Trusted scoring of episodes whose environment owns its reward: the actor's instance
    never sees the secret (a private column; it plays with the default, 7, and says
    "correct" there), the tier replays the model's calls in an instance reset with the
    secret. The transcript's "correct" is the actor's word; the replay's reward is not."""
    from conftest import read_all

    queue, n = generated_guesses(tokenizer, redis_server, run_name, tmp_path)
    scorers("--environment", "toy_tools:ScoredGuess", reward="toy_rewards:found_it", model=tiny_chatml_model)
    for group in read_all(queue, n):
        assert group.error is None and group.scored_by is not None
        # guesses climb from 3 + j to the actor's 7: only the first two pass the secret, 4
        assert [c.reward_components for c in group.completions] == [
            {"found_it": 1.0, "ScoredGuess": r} for r in (1.0, 1.0, 0.0, 0.0)
        ]
        assert group.rewards == [2.0, 2.0, 1.0, 1.0]
    queue.close()


PENALTY = "protocol.usercode.length:get_length_penalty_reward(token_penalty=0.01, turn_penalty=0.5, max_penalty=-100)"


@pytest.mark.redis
@pytest.mark.slow
def test_the_tiers_length_penalty_charges_the_models_tokens_and_turns_it_read(
    tokenizer, tiny_chatml_model: Path, redis_server, scorers, run_name: str, tmp_path: Path
) -> None:
    """`get_length_penalty_reward` on the trusted tier: per episode, the model's own tokens
    (the mask the tier checked against the transcript, not the tool results) and its
    turns past the first, each with its price."""
    from conftest import read_all

    queue, n = generated_guesses(tokenizer, redis_server, run_name, tmp_path)
    scorers(
        "--environment",
        "toy_tools:ScoredGuess",
        "--reward",
        PENALTY,
        reward="toy_rewards:found_it",
        model=tiny_chatml_model,
    )
    for group in read_all(queue, n):
        assert group.error is None and group.scored_by is not None
        turns = [c.turns for c in group.completions]
        assert turns == [5, 4, 3, 2]  # 3, 4, 5, 6 climbing to 7
        model_tokens = [sum(c.mask) for c in group.completions]
        assert all(0 < m < c.tokens.size for m, c in zip(model_tokens, group.completions, strict=True))
        assert [c.reward_components["get_length_penalty_reward"] for c in group.completions] == pytest.approx(
            [-(0.01 * m + 0.5 * (t - 1)) for m, t in zip(model_tokens, turns, strict=True)]
        )
    queue.close()


@pytest.mark.redis
@pytest.mark.slow
def test_a_worker_killed_mid_episode_loses_nothing(
    tmp_path: Path, tiny_chatml_model: Path, redis_server, run_name: str
) -> None:
    """SIGKILL while its episodes wait on a tool: the lease expires, another worker
    regenerates the episodes whole, each group is stored once."""
    import os
    import signal
    import subprocess
    import sys

    import msgspec
    from factories import batch, trusted
    from scripted import FirstTurnCalls
    from servers import kill_process

    from actors.hf_engine import TransformersEngine
    from actors.watcher import AdapterWatcher
    from actors.worker import Worker
    from protocol import QueueConfig
    from protocol.trusted import RedisQueue, open_store
    from protocol.trusted.store import StoreSource

    repo = Path(__file__).resolve().parents[1]
    queue = RedisQueue.from_url(redis_server.url, QueueConfig(run=run_name, lease_timeout_s=2))
    work = msgspec.structs.replace(trusted(batch()), tools=["add", "hang"], sampling=SamplingParams(max_tokens=400))
    queue.add_prompts([work])
    store = (tmp_path / "store").as_uri()
    log = tmp_path / "victim.log"
    with log.open("wb") as out:  # a machine that dies: the worker and its tool processes, one process group
        victim = subprocess.Popen(
            [
                sys.executable,
                str(repo / "tests" / "episode_actor.py"),
                redis_server.url,
                run_name,
                "victim",
                store,
                str(tiny_chatml_model),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(repo)},
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 60
        while queue.stats().leases_by_worker.get("victim", 0) == 0:
            assert victim.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        time.sleep(1.0)  # its episodes are waiting on their 60 s tool
        os.killpg(victim.pid, signal.SIGKILL)
        victim.wait(timeout=30)
    finally:
        kill_process(victim)

    class Engine(FirstTurnCalls, TransformersEngine):
        pass

    inner = Engine(str(tiny_chatml_model))
    engine = EpisodeEngine(inner, Toolbox(["toy_tools:add", "toy_tools:hang"]), tool_template(inner.tokenizer))
    watcher = AdapterWatcher(queue, StoreSource(open_store(store)), engine, tmp_path / "cache")
    try:
        Worker(queue, engine, watcher, None, "rescuer", claim_block_s=0.5).work(max_batches=1)
    finally:
        engine.close()
    from protocol.trusted.scoring import ScoringQueue

    tier = ScoringQueue.from_url(redis_server.url, QueueConfig(run=run_name))
    entries = queue._r.xrange(queue.keys.unscored)  # trusted: the groups wait for the tier
    groups = [tier.fetch_unscored(entry_id.decode()).group for entry_id, _ in entries]
    tier.close()
    assert sorted(g.prompt_id for g in groups) == sorted(p.id for p in work.prompts)  # each once
    for g in groups:
        assert g.actor_id == "rescuer"
        assert all(c.turns == 2 and c.tool_calls == 1 and c.mask is not None for c in g.completions)
    queue.close()
