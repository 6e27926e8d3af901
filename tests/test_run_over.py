"""A run its learner finished tells its workers so: claims are refused with the learner's
last word (`RunOver`), and `actors run` stops with exit status 0 instead of waiting on a
queue nobody fills. A learner that continues the run takes it back."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from factories import batch
from servers import kill_process, through_proxy

from protocol import ProtocolError, QueueConfig, QueueForbidden, RunOver, WorkerQuarantined
from protocol.trusted import RedisQueue

pytestmark = pytest.mark.redis

WORDS = "run 'r' is over: its learner finished at step 3 (adapter v3)"


def test_a_finished_run_refuses_every_claim_with_the_learners_words(redis_server, run_name: str) -> None:
    q = RedisQueue.from_url(redis_server.url, QueueConfig(run=run_name))
    q.add_prompts([batch(0), batch(1)])
    q.quarantine("fleet/bad", "failed an audit")
    q.set_run_over(WORDS)
    with pytest.raises(RunOver, match=r"finished at step 3 \(adapter v3\)"):
        q.claim("fleet/a", 1)
    with pytest.raises(WorkerQuarantined, match="failed an audit"):  # its operator must still learn why
        q.claim("fleet/bad", 1)
    assert q.stats().leases_by_worker == {}  # nothing was handed out
    with pytest.raises(ProtocolError, match="expected a str"):
        q.set_run_over(3)  # type: ignore[arg-type]
    with pytest.raises(RunOver):
        q.claim("fleet/a", 1)  # the bad call changed nothing
    q.set_run_over("")  # a learner continuing the run (more --steps, --resume)
    assert len(q.claim("fleet/a", 1)) == 1
    assert q.keys.over in q.keys.all()  # it expires with the run
    q.close()


@pytest.mark.slow
def test_through_the_door_a_working_actor_is_told_and_exits_0(make_proxy, tiny_model: Path) -> None:
    proxy = make_proxy()
    learner, actor = proxy.queue("learner"), proxy.queue("actor")
    with pytest.raises(QueueForbidden):  # only the run's learner ends it
        actor.set_run_over("not yours to say")
    proc = subprocess.Popen(
        proxy.actor_command(tiny_model, "w1", "--claim-block-s", "1", "--report-every-s", "1"),
        env=proxy.actor_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while through_proxy("w1") not in {w.worker for w in learner.workers()}:  # it is up and claiming
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
            time.sleep(0.5)
        told = time.monotonic()
        learner.set_run_over(WORDS)
        out, _ = proc.communicate(timeout=60)
        took = time.monotonic() - told
    finally:
        kill_process(proc)
    assert proc.returncode == 0, out[-3000:]
    assert f"actors run: {WORDS}" in out and "Traceback" not in out, out[-3000:]
    assert took < 30  # within a long-poll or two, not a lease timeout
    with pytest.raises(RunOver, match="finished at step 3"):  # a late joiner is told the same at once
        actor.claim("w2", 1)
    learner.close()
    actor.close()
