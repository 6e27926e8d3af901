"""The environment's replay on the scoring tier runs apart, under limits: a call past its
time is stopped, a group past its own limit is killed, memory is capped, and one group's
replay never waits for another's."""

from __future__ import annotations

import time

from toy_tools import Hungry, ScoredGuess

from learner.scoring import replay
from protocol.usercode.chat import ToolCall

LIMITS = replay.ReplayLimits(call_timeout_s=0.5, memory_mb=256)


def calls(*pairs: tuple[str, dict]) -> list[list[ToolCall]]:
    """One episode: one call per turn."""
    return [[ToolCall(name, args)] for name, args in pairs]


def finish(running: list[replay.Replay], timeout_s: float = 30.0) -> list[replay.Replay]:
    """The replays in the order they finished."""
    order: list[replay.Replay] = []
    deadline = time.monotonic() + timeout_s
    while len(order) < len(running):
        assert time.monotonic() < deadline, "replays did not finish"
        order += replay.wait([r for r in running if r not in order], 0.5)
    return order


def test_a_replay_in_its_own_process_gives_each_episodes_reward() -> None:
    found = calls(("guess", {"number": 3}), ("guess", {"number": 4}))
    missed = calls(("guess", {"number": 3}))
    (r,) = finish([replay.start(ScoredGuess, {"secret": 4}, [found, missed], LIMITS, 30.0)])
    assert r.result == [1.0, 0.0]


def test_a_call_past_its_time_limit_fails_the_replay_with_its_name() -> None:
    stalled = calls(("guess", {"number": 3}), ("stall", {"seconds": 100000}), ("guess", {"number": 4}))
    started = time.monotonic()
    (r,) = finish([replay.start(ScoredGuess, {"secret": 4}, [stalled], LIMITS, 30.0)])
    assert r.result == "the environment's stall ran past its time limit of 0.5s in the replay"
    assert time.monotonic() - started < 15  # not the 1e5 s it asked for


def test_a_call_the_alarm_cannot_interrupt_is_killed_at_the_groups_limit() -> None:
    spun = calls(("spin", {"n": 10**13}))
    (r,) = finish([replay.start(Hungry, {}, [spun], replay.ReplayLimits(call_timeout_s=60), 1.0)])
    assert r.result == "the environment's replay ran past the group's time limit and was killed"


def test_memory_past_the_limit_fails_the_call_not_the_tier() -> None:
    """As on an actor, a call that runs out of memory is a failed call the model was told
    of; the episode goes on and its reward is computed."""
    hungry = calls(("eat", {"megabytes": 4096}), ("guess", {"number": 4}))
    (r,) = finish([replay.start(Hungry, {"secret": 4}, [hungry], LIMITS, 30.0)])
    assert r.result == [1.0]


def test_one_groups_slow_replay_delays_no_other() -> None:
    slow = replay.start(
        ScoredGuess, {"secret": 4}, [calls(("stall", {"seconds": 100000}))], replay.ReplayLimits(call_timeout_s=3), 30.0
    )
    fast = [replay.start(ScoredGuess, {"secret": 4}, [calls(("guess", {"number": 4}))], LIMITS, 30.0) for _ in range(3)]
    order = finish([slow, *fast])
    assert order[-1] is slow and [r.result for r in order[:3]] == [[1.0]] * 3


def test_a_replay_still_running_when_the_job_ends_is_killed() -> None:
    r = replay.start(ScoredGuess, {}, [calls(("stall", {"seconds": 100000}))], replay.ReplayLimits(60), 60.0)
    replay.close([r])
    assert r.result == "the job ended before the environment's replay"
