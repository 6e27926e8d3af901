"""The built-in math reward and `async def` rewards, through the scorer that runs them."""

from __future__ import annotations

import factories
import msgspec
import pytest

from protocol.usercode.math_reward import accuracy
from protocol.usercode.rewards import RewardError, Scorer, canonical_spec, load_reward, reward_name, without_weight
from protocol.util.config_file import reward_specs


def test_math_accuracy_on_gsm8k_style_answers() -> None:
    answer = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nAltogether 48+24 = <<48+24=72>>72 clips.\n#### 72"
    completions = [
        "She sold 72 clips in total.",
        "The answer is \\boxed{72}",
        "I get 71.",
        "no idea",
        [{"role": "assistant", "content": "72"}],
    ]
    assert accuracy(completions, answer=[answer] * 5) == [1.0, 1.0, 0.0, 0.0, 1.0]
    # MATH-style LaTeX references; an unparsable reference abstains rather than scoring 0
    assert accuracy(["so $\\frac{1}{2}$", "0.5", "1/3"], solution=["$\\frac{1}{2}$"] * 3) == [1.0, 1.0, 0.0]
    assert accuracy(["42"], answer=["#### "]) == [None]
    with pytest.raises(ValueError, match="answer"):
        accuracy(["1"])


def test_math_accuracy_loads_as_a_reward_and_scores_a_group() -> None:
    scorer = Scorer([load_reward("protocol.usercode.math_reward:accuracy")], timeout_s=5.0)  # a thread: no SIGALRM
    prompt = factories.batch(0, 1).prompts[0]  # columns: answer "1"
    scores = scorer.score(prompt, "", ["it is 1", "it is 2"], [[1], [2]])
    assert scores.error is None and scores.rewards == [1.0, 0.0]
    assert scores.components == [{"accuracy": 1.0}, {"accuracy": 0.0}]


@pytest.mark.parametrize("timeout_s", [None, 5.0])
def test_an_async_reward_is_awaited(timeout_s: float | None) -> None:
    scorer = Scorer([load_reward("toy_rewards:async_digit_first")], timeout_s=timeout_s)
    scores = scorer.score(factories.batch(0, 1).prompts[0], "", ["1a", "b"], [[1], [2]])
    assert scores.error is None and scores.rewards == [1.0, 0.0]


def test_a_raising_reward_propagates_only_when_asked() -> None:
    prompt = factories.batch(0, 1).prompts[0]
    failed = Scorer([load_reward("toy_rewards:broken")], timeout_s=None).score(prompt, "", ["x"], [[1]])
    assert failed.rewards == [None] and "ZeroDivisionError" in failed.error
    with pytest.raises(ZeroDivisionError):  # an RQ job: RQ records the traceback and retries
        Scorer([load_reward("toy_rewards:broken")], timeout_s=None, reraise=True).score(prompt, "", ["x"], [[1]])


def test_trl_extras_reach_a_reward_that_takes_them_and_only_such_a_one() -> None:
    from protocol import Progress, Prompt

    prompt = Prompt(id="p", text="q", columns={"answer": "1"})
    at_step = msgspec.structs.replace(prompt, progress=Progress(global_step=3, max_steps=12, epoch=0.5))
    scores = Scorer([load_reward("toy_rewards:scheduled"), load_reward("toy_rewards:strict")], timeout_s=None).score(
        at_step, "", ["1", "x"], [[1], [2]]
    )
    assert scores.error is None and scores.rewards == [2.0, 0.0]
    assert scores.metrics == {"schedule/progress": 0.25}
    # no trainer state known (a hand-made batch): None, as the reward then finds out
    failed = Scorer([load_reward("toy_rewards:scheduled")], timeout_s=None).score(prompt, "", ["1"], [[1]])
    assert "AttributeError" in failed.error and failed.metrics == {}


def test_logged_metrics_are_bounded_and_named_safely() -> None:
    from protocol.usercode.rewards import RewardFn
    from protocol.wire.messages import MAX_LOGGED_METRICS

    def noisy(prompts, completions, log_metric, **_):
        for i in range(40):
            log_metric(f"m{i}", float(i))
        log_metric("m0", 2.0)
        log_metric("bad\x1b[2Jname", 1.0)
        log_metric("inf", float("inf"))
        return [1.0] * len(completions)

    scores = Scorer([RewardFn("noisy", noisy)], timeout_s=None).score(
        factories.batch(0, 1).prompts[0], "", ["a"], [[1]]
    )
    assert len(scores.metrics) == MAX_LOGGED_METRICS and scores.metrics["m0"] == 1.0
    assert "inf" not in scores.metrics


def test_log_extra_columns_reach_each_completion_bounded_and_named_safely() -> None:
    """TRL's `log_extra(column, values)`: a value per completion, split back to each group
    of a batch; a column of another length, an unsafe name, a ninth column are left out,
    and a long value is cut."""
    from protocol.usercode.rewards import RewardFn
    from protocol.wire.messages import MAX_EXTRA_CHARS, MAX_EXTRA_COLUMNS

    def explains(prompts, completions, log_extra, **_):
        log_extra("verdict", [f"saw {c}" for c in completions])
        log_extra("short", ["only one"])  # not one per completion
        log_extra("bad\x1b[2Jname", ["x"] * len(completions))
        log_extra("long", ["y" * 1000] * len(completions))
        for i in range(10):
            log_extra(f"c{i}", [i] * len(completions))
        return [1.0] * len(completions)

    scorer = Scorer([RewardFn("explains", explains)], timeout_s=None)
    p0, p1 = factories.batch(0, 2).prompts
    scores = scorer.score(p0, "", ["a", "b"], [[1], [2]])
    assert [row["verdict"] for row in scores.extras] == ["saw a", "saw b"]
    (row, _) = scores.extras
    assert "short" not in row and not any("\x1b" in k for k in row) and len(row) == MAX_EXTRA_COLUMNS
    assert len(row["long"]) == MAX_EXTRA_CHARS and row["c0"] == "0"
    together = scorer.call_batch([(p0, "", ["a"], [[1]], None), (p1, "", ["b", "c"], [[2], [3]], None)])
    assert [v.extras["verdict"] for v in together] == [["saw a"], ["saw b", "saw c"]]


def test_dapo_soft_overlong_punishment_gives_trl_s_values() -> None:
    from trl.rewards import get_soft_overlong_punishment as trls

    from protocol.usercode.length import get_soft_overlong_punishment as ours

    ids = [[7] * n for n in (0, 1, 79, 80, 81, 90, 99, 100, 101, 500)]
    for limit, cache in ((100, 20), (100, 0), (100, 100), (8, 3)):
        assert ours(limit, cache)(ids) == pytest.approx(trls(limit, cache)(ids)), (limit, cache)
    assert ours(100, 20)(ids)[:8] == [0.0, 0.0, 0.0, 0.0, -0.05, -0.5, -0.95, -1.0]
    with pytest.raises(ValueError, match="soft_punish_cache"):
        ours(10, 11)


PENALTY = (
    "protocol.usercode.length:get_length_penalty_reward"
    "(token_penalty=0.1, turn_penalty=1, free_tokens=2, max_penalty=-10)"
)


def test_the_length_penalty_charges_the_models_tokens_and_turns_past_the_free_ones() -> None:
    from protocol.usercode.length import get_length_penalty_reward

    penalty = load_reward(PENALTY).fn
    ids = [[7] * 2, [7] * 5, [7] * 8, [7] * 9]
    # single turns: every token the model's, one turn (free)
    assert penalty(completion_ids=ids) == pytest.approx([0.0, -0.3, -0.6, -0.7])
    # episodes: 1 marks the model's tokens; tool results (0) cost nothing, a turn costs 1
    masks = [[1, 1], [1, 1, 0, 0, 1], [1, 1, 1, 0, 0, 0, 1, 1], [1, 0, 1, 0, 1, 0, 1, 0, 1]]
    assert penalty(completion_ids=ids, tool_mask=masks) == pytest.approx([0.0, -1.1, -1.3, -4.3])
    # never below max_penalty
    floored = get_length_penalty_reward(token_penalty=1.0, max_penalty=-2.5)
    assert floored(completion_ids=ids) == [-2.0, -2.5, -2.5, -2.5]
    assert get_length_penalty_reward()(completion_ids=ids) == [0.0] * 4  # no price: no penalty
    for bad, why in (
        ({"token_penalty": -0.1}, "token_penalty"),
        ({"free_turns": -1}, "free_turns"),
        ({"max_penalty": 1.0}, "max_penalty"),
    ):
        with pytest.raises(ValueError, match=why):
            get_length_penalty_reward(**bad)


def test_the_tool_mask_reaches_a_reward_that_takes_it_aligned_over_a_batch() -> None:
    """TRL's `tool_mask`, as the scorer hands it: the group's own where it has episodes,
    all 1 for single turns, aligned with `completion_ids` over a batch of groups."""
    from protocol import Prompt
    from protocol.usercode.rewards import group_tool_mask

    scorer = Scorer([load_reward(PENALTY), load_reward("toy_rewards:strict")], timeout_s=None)  # strict: no extras
    prompt = Prompt(id="p", text="q", columns={"answer": "1"})
    ids = [[1] * 5, [2] * 5]
    masks = group_tool_mask([[1, 1, 0, 0, 1], None], ids)
    assert masks == [[1, 1, 0, 0, 1], [1] * 5] and group_tool_mask([None, None], ids) is None
    scored = scorer.score(prompt, "", ["1", "x"], ids, tool_mask=masks)
    assert scored.error is None, scored.error
    assert [c["get_length_penalty_reward"] for c in scored.components] == pytest.approx([-1.1, -0.3])
    together = scorer.call_batch([(prompt, "", ["1", "x"], ids, masks), (prompt, "", ["1"], [[3] * 3], None)])
    assert [v.per_fn["get_length_penalty_reward"] for v in together] == [
        pytest.approx([-1.1, -0.3]),
        pytest.approx([-0.1]),
    ]


def test_the_actors_scoring_processes_get_the_tool_mask() -> None:
    from actors.rewards import ScoringPool

    pool = ScoringPool([PENALTY], timeout_s=30.0, workers=1)
    try:
        prompt = factories.batch(0, 1).prompts[0]
        scores = pool.submit((prompt, "", ["a", "b"], [[1] * 5, [2] * 5], [[1, 1, 0, 0, 1], [1] * 5])).result(60)
    finally:
        pool.close()
    assert scores.error is None and scores.rewards == pytest.approx([-1.1, -0.3])


SPEC = "protocol.usercode.length:get_soft_overlong_punishment(max_completion_len=4, soft_punish_cache=2)"


def test_a_factory_spec_scores_with_the_function_it_returns_beside_the_task_s_reward() -> None:
    """`module:factory(k=v, ...)=weight` (TRL's get_soft_overlong_punishment), as a user
    adds it to the task's reward: each counted with its weight, named after the factory."""
    scorer = Scorer([load_reward("protocol.usercode.math_reward:accuracy"), load_reward(SPEC + "=0.5")], timeout_s=5.0)
    prompt = factories.batch(0, 1).prompts[0]  # columns: answer "1"
    scores = scorer.score(prompt, "", ["1", "1 1 1", "1 1 1 1 1"], [[1], [1, 1, 1], [1] * 5])
    assert scores.error is None and scores.rewards == [1.0, 0.75, 0.5]
    assert [c["get_soft_overlong_punishment"] for c in scores.components] == [0.0, -0.5, -1.0]


LENGTH = "protocol.usercode.length:get_soft_overlong_punishment"


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        (f"{LENGTH}(4, 2)", "name=literal"),
        (f"{LENGTH}(max_completion_len=4, **x)", "name=literal"),
        (f"{LENGTH}(max_completion_len=x)", "name=literal"),
        (f"{LENGTH}(max_completion_len=open('x'))", "expected module:function"),
        (f"{LENGTH}(max_completion_len=4)", "raised TypeError"),
        (f"{LENGTH}(max_completion_len=4, soft_punish_cache=9)", "between"),
        ("protocol.usercode.math_reward:accuracy(answer='1')", "returned list, not a function|raised"),
        (f"{LENGTH}(max_completion_len=4, soft_punish_cache=2)=1e999", "finite"),
        ("protocol.usercode.rewards:TRL_EXTRAS()", "no function"),
        ("protocol.usercode.rewards:reward_name(spec='x')", "returned str, not a function"),
    ],
)
def test_a_bad_factory_spec_is_refused_in_one_line_naming_it(spec: str, why: str) -> None:
    with pytest.raises(RewardError, match=why) as err:
        load_reward(spec)
    assert "\n" not in str(err.value) and spec in str(err.value)


def test_a_factory_spec_has_one_canonical_form_and_its_name_and_weight_come_apart() -> None:
    written = [
        "protocol.usercode.length:get_soft_overlong_punishment(soft_punish_cache=2, max_completion_len=4)=1",
        "protocol.usercode.length.get_soft_overlong_punishment( max_completion_len = 4,soft_punish_cache=2 )",
    ]
    assert {canonical_spec(s) for s in written} == {
        "protocol.usercode.length:get_soft_overlong_punishment(max_completion_len=4, soft_punish_cache=2)=1.0"
    }
    assert reward_name(SPEC + "=2") == "get_soft_overlong_punishment" and reward_name("m:f=2") == "f"
    assert without_weight(SPEC + "=2.5") == SPEC and without_weight(SPEC) == SPEC
    assert reward_specs({"reward": [SPEC + "=3"], "reward_weights": [0.5]}) == [SPEC + "=0.5"]
