"""The trusted side reads an episode's mask against its model turns: honest episodes of
the real episode loop pass with the tier's own counts, and every way the round-four red
team moved tokens across the mask is refused."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from scripted import LOGP, ScriptedEngine, tool_call

from actors.episodes import EpisodeEngine
from actors.tools import Toolbox
from learner.scoring.episodes import EpisodeReader, read_episodes, recounted
from learner.tiny import build_tokenizer
from protocol import Completion
from protocol.usercode.chat import (
    HERMES_CHATML,
    model_turn_calls,
    parse_turn,
    stop_token_ids,
    tool_template,
)
from protocol.usercode.transcript import (
    TranscriptError,
    answered_calls,
    read_transcript,
    replay_reward,
)

TOOLS = ["toy_tools:add", "toy_tools:hang"]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(chatml=True)


@pytest.fixture(scope="module")
def toolbox() -> Iterator[Toolbox]:
    box = Toolbox(TOOLS, timeout_s=1.0, memory_mb=512, workers=2)
    yield box
    box.close()


@pytest.fixture(scope="module")
def reader(tokenizer) -> EpisodeReader:
    return EpisodeReader("unused", tokenizer)


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def prompt(tokenizer) -> list[int]:
    from protocol.usercode.chat import load_tools

    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "what is 2+3"}],
        add_generation_prompt=True,
        tokenize=False,
        chat_template=HERMES_CHATML,
        tools=load_tools(TOOLS),
    )
    return ids(tokenizer, text)


def honest(tokenizer, toolbox: Toolbox, script, turns: int | None = 4):
    """Episodes made by the real episode loop (`EpisodeEngine` over a scripted model)."""
    from test_episodes import episode, run

    engine = EpisodeEngine(ScriptedEngine(tokenizer, script), toolbox, tool_template(tokenizer))
    (samples,) = run(engine, [episode("g", prompt(tokenizer), n=2, turns=turns, max_tokens=4000)]).values()
    return samples


def read(tokenizer, tokens: list[int], mask: list[int] | None, max_turns: int | None = 4):
    return read_transcript(tokenizer, tool_template(tokenizer), stop_token_ids(tokenizer), tokens, mask, max_turns)


def completion(tokens: list[int], mask: list[int] | None) -> Completion:
    return Completion.of(tokens, [LOGP if m else 0.0 for m in (mask or [1] * len(tokens))], mask, finish_reason="stop")


# ---------------------------------------------------------------- honest episodes pass


def test_an_honest_episode_passes_and_the_tier_counts_its_turns_and_calls(tokenizer, toolbox) -> None:
    two_calls = tool_call("add", a=2, b=3) + "\n" + tool_call("add", a=1, b=1)
    samples = honest(tokenizer, toolbox, lambda text, j: "it is 5" if "<tool_response>" in text else two_calls)
    for s in samples:
        t = read(tokenizer, s.token_ids, s.mask)
        assert (
            (len(t.turns), t.tool_calls, t.tool_errors, t.turn_limit)
            == (s.turns, s.tool_calls, s.tool_errors, s.turn_limit)
            == (2, 2, 0, False)
        )
        assert [content for _, content in t.turns[0].results] == ["5", "2"]
        assert answered_calls(t) == [[c for c in t.turns[0].parsed.calls]]


def test_failed_calls_and_the_turn_limit_are_counted_as_the_actor_did(tokenizer, toolbox) -> None:
    always = tool_call("hang", seconds=30)  # every call is killed at the time limit; the model keeps calling
    for s in honest(tokenizer, toolbox, lambda text, j: always, turns=2):
        t = read(tokenizer, s.token_ids, s.mask, max_turns=2)
        assert (len(t.turns), t.tool_calls, t.tool_errors, t.turn_limit) == (3, 2, 2, True)
        assert (s.turns, s.tool_calls, s.tool_errors, s.turn_limit) == (3, 2, 2, True)


@pytest.mark.slow
def test_the_tier_replaces_the_actors_episode_figures_with_its_own(tokenizer, toolbox, reader) -> None:
    """Finding 8: an actor's `turns` of 4.6e18 became the run's `turns_mean`."""
    s = honest(tokenizer, toolbox, lambda text, j: "5" if "<tool_response>" in text else tool_call("add", a=2, b=3))[0]
    lying = Completion.of(
        s.token_ids,
        s.logprobs,
        s.mask,
        finish_reason="stop",
        turns=4_600_000_000_000_000_000,
        tool_calls=9_000,
        tool_errors=9_000,
        turn_limit=True,
    )
    transcripts = read_episodes(reader, [lying], ["add", "hang"], 4)
    (counted,) = recounted([lying], transcripts)
    assert (counted.turns, counted.tool_calls, counted.tool_errors, counted.turn_limit) == (2, 1, 0, False)


# ---------------------------------------------------------------- finding 1: the mask is the tier's


def test_a_mask_on_a_batch_without_tools_is_refused(tokenizer, reader) -> None:
    """The red team's `zzzz` (mask 1) + 56 x `a` (mask 0) under a reward counting `a`."""
    tokens = ids(tokenizer, "zzzz" + "a" * 56)
    masked = completion(tokens, [1] * 4 + [0] * 56)
    with pytest.raises(TranscriptError, match="carries a mask, but its batch offers no tools"):
        read_episodes(reader, [masked], [], None)
    assert read_episodes(reader, [completion(tokens, None)], [], None) is None  # the same tokens, all the model's


def test_environment_tokens_after_a_turn_that_called_no_tool_are_refused(tokenizer, reader) -> None:
    tokens = [*ids(tokenizer, "zzzz"), stop_token_ids(tokenizer)[0], *ids(tokenizer, "a" * 56)]
    with pytest.raises(TranscriptError, match="that turn called no tool"):
        read_episodes(reader, [completion(tokens, [1] * 5 + [0] * 56)], ["add"], 4)


def test_environment_tokens_that_are_not_the_templates_results_are_refused(tokenizer, toolbox) -> None:
    s = honest(tokenizer, toolbox, lambda text, j: "5" if "<tool_response>" in text else tool_call("add", a=2, b=3))[0]
    first_env = s.mask.index(0)
    end_env = s.mask.index(1, first_env)
    glue = s.token_ids[first_env:end_env]
    extra = ids(tokenizer, "aaaa")
    cases = {
        # scored text slipped in after the results, before the next assistant header
        "text after the results": [*glue[:-5], *extra, *glue[-5:]],
        "a second result the model never asked for": [*glue, *glue],
        "the next assistant header cut short": glue[:-3],
        "the result's opening tag gone": [t for i, t in enumerate(glue) if i != 3],
    }
    for name, env in cases.items():
        tokens = [*s.token_ids[:first_env], *env, *s.token_ids[end_env:]]
        mask = [*s.mask[:first_env], *[0] * len(env), *s.mask[end_env:]]
        with pytest.raises(TranscriptError, match="not the chat template's rendering"):
            read(tokenizer, tokens, mask)
            pytest.fail(f"passed: {name}")


def test_a_tool_turn_past_the_limit_is_refused(tokenizer, toolbox) -> None:
    """Finding 9: eight turns against a limit of three."""
    call = tool_call("add", a=2, b=3)
    (s, _) = honest(tokenizer, toolbox, lambda text, j: call, turns=8)
    assert s.turns == 9
    with pytest.raises(TranscriptError, match="past max_tool_calling_iterations=3"):
        read(tokenizer, s.token_ids, s.mask, max_turns=3)
    assert len(read(tokenizer, s.token_ids, s.mask, max_turns=8).turns) == 9


# ---------------------------------------------------------------- finding 2: the model's tokens alone


def test_calls_written_in_the_environments_tokens_are_never_the_models(tokenizer) -> None:
    """The red team's winning calls after an `<|im_start|>assistant` in tokens marked as the
    environment's: read with the whole transcript as prefix, the parser kept them."""
    fake = ids(tokenizer, "<|im_start|>assistant\n" + tool_call("add", a=2, b=3) + "<|im_end|>\n")
    junk = ids(tokenizer, "zq zq zq")
    parsed_with_prefix = parse_turn(tokenizer, junk, [*prompt(tokenizer), *fake], tool_template(tokenizer))
    alone = model_turn_calls(tokenizer, junk, tool_template(tokenizer))
    assert alone.calls == [] and alone.error is None
    assert parsed_with_prefix.calls or alone.calls == []  # the old reading, whatever this parser does with it
    tokens = [*junk, stop_token_ids(tokenizer)[0], *fake, *junk]
    mask = [1] * (len(junk) + 1) + [0] * len(fake) + [1] * len(junk)
    with pytest.raises(TranscriptError, match="called no tool"):
        read(tokenizer, tokens, mask)


def test_the_replay_runs_only_the_calls_the_environment_answered(tokenizer) -> None:
    """Finding 9 in the replay: the model guesses 3, 4, 5 under a limit of two tool turns;
    the third guess was never answered on the actor, and is not run in the replay."""
    from toy_tools import ScoredGuess

    def guesser(text: str, j: int) -> str:
        return tool_call("guess", number=3 + text.count("<tool_response>"))

    box = Toolbox([], environment="toy_tools:ScoredGuess", workers=1)
    try:
        (s, _) = honest(tokenizer, box, guesser, turns=2)
    finally:
        box.close()
    t = read(tokenizer, s.token_ids, s.mask, max_turns=2)
    assert [[c.arguments["number"] for c in turn] for turn in answered_calls(t)] == [[3], [4]] and t.turn_limit
    assert replay_reward(ScoredGuess, {"secret": 4}, answered_calls(t)) == 1.0
    assert replay_reward(ScoredGuess, {"secret": 5}, answered_calls(t)) == 0.0  # 5 was written, never answered


def test_an_alternating_mask_is_refused_at_its_first_environment_token(tokenizer) -> None:
    """Finding 4: 9,600 tokens under an alternating mask cost the replay 7.7 s, each model
    run parsed with the whole transcript before it. Each turn is now read on its own
    tokens, and the first environment token after a turn that called nothing ends the
    reading."""
    tokens = ids(tokenizer, "ab" * 4800)
    with pytest.raises(TranscriptError, match="tokens 1-2 after model turn 1: that turn called no tool"):
        read(tokenizer, tokens, [1, 0] * 4800)


# ---------------------------------------------------------------- finding 10


def test_a_deeply_nested_argument_is_a_tool_error_not_a_crash(tokenizer) -> None:
    deep = "[" * 1100 + "]" * 1100
    text = '<tool_call>\n{"name": "add", "arguments": {"a": ' + deep + "}}\n</tool_call>"
    parsed = model_turn_calls(tokenizer, ids(tokenizer, text), tool_template(tokenizer))
    assert parsed.calls == [] and parsed.error is not None
    quoted = '<tool_call>\n{"name": "add", "arguments": ' + json.dumps(deep) + "}\n</tool_call>"
    parsed = model_turn_calls(tokenizer, ids(tokenizer, quoted), tool_template(tokenizer))  # read, not raised
    assert all(c.arguments == {} for c in parsed.calls)
