"""The built-in math reward and `async def` rewards, through the scorer that runs them."""

from __future__ import annotations

import factories
import msgspec
import pytest

from protocol.usercode.math_reward import accuracy
from protocol.usercode.rewards import Scorer, load_reward


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
