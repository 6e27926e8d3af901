"""A built-in reward for math answers, on Hugging Face's `math-verify`.

`--reward protocol.usercode.math_reward:accuracy` on GSM8K-style data: the reference is the column
`answer` (GSM8K: the worked solution ending in `#### 72`; only what follows `####`
counts) or `solution` (MATH-style, LaTeX). A completion scores 1.0 when the answer it
states (LaTeX, `\\boxed{}`, or a plain number, the last one by preference of
math-verify's extraction) is mathematically equal to the reference, else 0.0; `None`
(abstain) when the reference itself cannot be parsed.

math-verify guards its parsing with SIGALRM, which only the main thread may use: the
scoring tier's jobs and the actors' scoring processes run rewards there; elsewhere the
guard is off and the caller's own time limit is the guard.
"""

from __future__ import annotations

import threading
from typing import Any

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

_EXTRACT = [LatexExtractionConfig(), ExprExtractionConfig()]


def _text(completion: Any) -> str:
    if isinstance(completion, list):  # conversational: [{"role": "assistant", "content": ...}]
        return str(completion[-1].get("content", "")) if completion else ""
    return str(completion)


def _reference(value: Any) -> str:
    text = str(value)
    return text.rsplit("####", 1)[1].strip() if "####" in text else text.strip()


def accuracy(
    completions: list[Any], answer: list[Any] | None = None, solution: list[Any] | None = None, **_: Any
) -> list[float | None]:
    references = answer if answer is not None else solution
    if references is None:
        raise ValueError("math_reward.accuracy needs an `answer` or `solution` column")
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    scores: list[float | None] = []
    for completion, reference in zip(completions, references, strict=True):
        gold = parse(_reference(reference), extraction_config=_EXTRACT, parsing_timeout=timeout)
        if not gold:
            scores.append(None)
            continue
        predicted = parse(_text(completion), extraction_config=_EXTRACT, parsing_timeout=timeout)
        scores.append(1.0 if predicted and verify(gold, predicted, timeout_seconds=timeout) else 0.0)
    return scores
