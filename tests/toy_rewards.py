"""Reward functions with TRL's signature, importable by actor processes in tests
(`--reward toy_rewards:digit_first` with the tests folder on PYTHONPATH)."""

from __future__ import annotations

import time


def _text(completion: object) -> str:
    return completion[0]["content"] if isinstance(completion, list) else str(completion)


def digit_first(prompts: list, completions: list, **_: object) -> list[float]:
    """1 when the completion starts with a digit."""
    return [1.0 if _text(c)[:1].isdigit() else 0.0 for c in completions]


def length_bonus(prompts: list, completions: list, **_: object) -> list[float]:
    return [min(len(_text(c)), 10) / 10 for c in completions]


def slow_digit_first(prompts: list, completions: list, **kw: object) -> list[float]:
    """digit_first, taking a second: keeps a batch in hand long enough to kill the worker."""
    time.sleep(1.0)
    return digit_first(prompts, completions, **kw)


def slow_check(prompts: list, completions: list, **kw: object) -> list[float]:
    """digit_first, taking 4 s: time for a test to publish while `actors check` runs."""
    time.sleep(4.0)
    return digit_first(prompts, completions, **kw)


def broken(prompts: list, completions: list, **_: object) -> list[float]:
    raise ZeroDivisionError("the reward model is down")


def hangs(prompts: list, completions: list, **_: object) -> list[float]:
    time.sleep(30)
    return [0.0] * len(completions)


def abstains_on_odd(prompts: list, completions: list, completion_ids: list, **_: object) -> list[float | None]:
    return [None if len(ids) % 2 else 1.0 for ids in completion_ids]


def uses_columns(prompts: list, completions: list, answer: list, **_: object) -> list[float]:
    """Data set columns arrive as lists aligned with the completions, as in TRL."""
    return [1.0 if _text(c).startswith(str(a)) else 0.0 for c, a in zip(completions, answer, strict=True)]


def hangs_when_asked(prompts: list, completions: list, **_: object) -> list[float]:
    """Hangs (after writing its process id next to the prompt's `pid_file` column) when
    the prompt says "hang"; digit_first otherwise."""
    if "hang" in str(prompts[0]):
        pid_file = _.get("pid_file")
        if isinstance(pid_file, list) and pid_file:
            import os
            from pathlib import Path

            Path(str(pid_file[0])).write_text(str(os.getpid()))
        time.sleep(300)
    return digit_first(prompts, completions)


def _attempt(attempts_file: list) -> int:
    """Appends this call to the prompt's private `attempts_file` column; returns how many
    calls came before it (the column proves the private columns reach the scorer)."""
    import os
    from pathlib import Path

    path = Path(str(attempts_file[0]))
    before = len(path.read_text().splitlines()) if path.exists() else 0
    with path.open("a") as f:
        f.write(f"{os.getpid()}\n")
    return before


def raises_counting(prompts: list, completions: list, attempts_file: list, **_: object) -> list[float]:
    _attempt(attempts_file)
    raise ZeroDivisionError("the judge is down")


def hangs_counting(prompts: list, completions: list, attempts_file: list, **_: object) -> list[float]:
    _attempt(attempts_file)
    time.sleep(60)
    return [0.0] * len(completions)


def slow_first_attempt(prompts: list, completions: list, attempts_file: list, **kw: object) -> list[float]:
    """Hangs on the first call (long enough to kill its worker), digit_first after."""
    if _attempt(attempts_file) == 0:
        time.sleep(60)
    return digit_first(prompts, completions, **kw)


def answer_length(prompts: list, completions: list, answer: list, **_: object) -> list[float]:
    """Reads a private column: the length of the reference answer, plus the completion's."""
    return [float(len(str(a)) + len(_text(c))) for c, a in zip(completions, answer, strict=True)]


async def async_digit_first(prompts: list, completions: list, **kw: object) -> list[float]:
    """An `async def` reward (an HTTP judge would await its client here)."""
    import asyncio

    await asyncio.sleep(0.01)
    return digit_first(prompts, completions, **kw)


def last_line_is_answer(prompts: list, completions: list, answer: list, **_: object) -> list[float]:
    """1 when the completion's last line (an episode's final answer) is the private answer."""
    return [
        1.0 if _text(c).strip().splitlines()[-1:] == [str(a)] else 0.0 for c, a in zip(completions, answer, strict=True)
    ]


def found_it(prompts: list, completions: list, **_: object) -> list[float]:
    """1 when the episode's environment said "correct" (the guessing game of episode tests)."""
    return [1.0 if "correct" in _text(c) else 0.0 for c in completions]


def scheduled(prompts: list, completions: list, trainer_state, log_metric, log_extra, **kw: object) -> list[float]:
    """A TRL reward that reads `trainer_state` (a schedule over the run) and logs a metric
    and an extra column: digit_first, with the run's progress logged."""
    progress = trainer_state.global_step / trainer_state.max_steps
    assert 0.0 <= progress < 1.0 and trainer_state.epoch >= 0.0
    log_metric("schedule/progress", progress)
    log_extra("why", ["digit" if _text(c)[:1].isdigit() else "no digit" for c in completions])
    return digit_first(prompts, completions)


def strict(prompts: list, completions: list, completion_ids: list, answer: list) -> list[float]:
    """A reward without `**kwargs` (TRL always passes `completion_ids`): it is handed only
    what it names."""
    return [1.0 if _text(c).strip() == a else 0.0 for c, a in zip(completions, answer, strict=True)]


_calls: list[int] = []


def counts_its_calls(prompts: list, completions: list, **_: object) -> list[float]:
    """Its own call number (state built when first called, as a client or a judge model is):
    a reward module that keeps its state across groups counts 1, 2, 3, ..."""
    _calls.append(len(_calls) + 1)
    return [float(_calls[-1])] * len(completions)


def counts_or_hangs(prompts: list, completions: list, **kw: object) -> list[float]:
    """Hangs when the prompt says "hang"; counts its calls otherwise."""
    if "hang" in str(prompts[0]):
        time.sleep(300)
    return counts_its_calls(prompts, completions, **kw)


def its_mark(prompts: list, completions: list, mark: list, calls_file: list, **_: object) -> list[float]:
    """Each completion's prompt's `mark` column (so a batch's values show where they were
    split); appends the call's size to the `calls_file` column's file."""
    from pathlib import Path

    with Path(str(calls_file[0])).open("a") as f:
        f.write(f"{len(completions)}\n")
    return [float(m) for m in mark]


def fails_in_batches(prompts: list, completions: list, mark: list, calls_file: list, **kw: object) -> list[float]:
    """`its_mark`, raising when given more than one group's completions (4)."""
    values = its_mark(prompts, completions, mark, calls_file, **kw)
    if len(completions) > 4:
        raise RuntimeError("this judge takes one group at a time")
    return values


def explains(prompts: list, completions: list, log_extra=None, **kw: object) -> list[float]:
    """digit_first, logging each completion's verdict with TRL's `log_extra`."""
    values = digit_first(prompts, completions, **kw)
    if log_extra is not None:
        log_extra("verdict", ["starts with a digit" if v else "no digit first" for v in values])
    return values
