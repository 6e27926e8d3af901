"""The built-in math reward and `async def` rewards, through the scorer that runs them."""

from __future__ import annotations

import factories
import pytest

from actors.math_reward import accuracy
from protocol.rewards import Scorer, load_reward


def test_math_accuracy_on_gsm8k_style_answers() -> None:
    answer = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nAltogether 48+24 = <<48+24=72>>72 clips.\n#### 72"
    completions = ["She sold 72 clips in total.", "The answer is \\boxed{72}", "I get 71.", "no idea",
                   [{"role": "assistant", "content": "72"}]]
    assert accuracy(completions, answer=[answer] * 5) == [1.0, 1.0, 0.0, 0.0, 1.0]
    # MATH-style LaTeX references; an unparsable reference abstains rather than scoring 0
    assert accuracy(["so $\\frac{1}{2}$", "0.5", "1/3"], solution=["$\\frac{1}{2}$"] * 3) == [1.0, 1.0, 0.0]
    assert accuracy(["42"], answer=["#### "]) == [None]
    with pytest.raises(ValueError, match="answer"):
        accuracy(["1"])


def test_math_accuracy_loads_as_a_reward_and_scores_a_group() -> None:
    scorer = Scorer([load_reward("actors.math_reward:accuracy")], timeout_s=5.0)  # a thread: no SIGALRM
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
