"""Redis Cluster: a `redis://` URL naming any node of a cluster gets redis-py's cluster
client; every key of a run shares its `{run}` slot, so runs spread across the shards by
name; the scoring tier keeps its groups on the cluster and RQ's jobs on a plain Redis
(`--rq-redis`); a whole run (learner, proxy, actor, scorer) completes on a cluster. The
queue contract tests run on the cluster too (`backend`'s "cluster")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import factories
import pytest
from redis.cluster import RedisCluster
from servers import TOKENS, RedisClusterNodes, RedisServer, kill_process

from protocol import QueueConfig
from protocol.trusted import RedisQueue
from protocol.trusted.redis_client import is_cluster_node
from protocol.trusted.scoring import ScoringQueue
from protocol.wire.keys import Keys

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'tests'}"}

pytestmark = pytest.mark.redis


def test_a_node_url_gets_the_cluster_client_and_runs_spread_across_shards(
    redis_cluster: RedisClusterNodes, redis_server: RedisServer
) -> None:
    assert is_cluster_node(redis_cluster.url) and not is_cluster_node(redis_server.url)
    for node in redis_cluster.nodes:  # any node names the cluster
        q = RedisQueue.from_url(node.url, QueueConfig(run="spread-0"))
        assert isinstance(q._r, RedisCluster)
        q.close()
    plain = RedisQueue.from_url(redis_server.url, QueueConfig(run="spread-0"))
    assert not isinstance(plain._r, RedisCluster)
    plain.close()
    with pytest.raises(ValueError, match="only database 0"):
        RedisQueue.from_url(redis_cluster.url.replace("/0", "/3"), QueueConfig(run="spread-0"))
    # a run's keys in one slot; runs on several nodes
    homes = set()
    for i in range(12):
        q = RedisQueue.from_url(redis_cluster.url, QueueConfig(run=f"spread-{i}"))
        keys = Keys(f"spread-{i}").all()
        assert len({q._r.keyslot(k) for k in keys}) == 1
        q.add_prompts([factories.batch(0)])
        homes.add(q._r.get_node_from_key(q.keys.prompts).port)
        (lease,) = q.claim("w", 1)
        assert q.submit("w", lease.lease_id, factories.groups(lease.batch)).finished
        assert len(q.read_rollouts("learner", 10)) == 2
        q.close()
    assert len(homes) >= 2, homes


def test_the_tier_keeps_rq_on_a_plain_redis(
    redis_cluster: RedisClusterNodes, redis_server: RedisServer, run_name: str, tiny_model: Path, tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match="--rq-redis"):
        ScoringQueue.from_url(redis_cluster.url, QueueConfig(run=run_name))
    with pytest.raises(ValueError, match="RQ needs a plain Redis"):
        ScoringQueue.from_url(redis_server.url, QueueConfig(run=run_name), rq_url=redis_cluster.url)
    cmd = [
        sys.executable,
        "-m",
        "learner.cli",
        "score",
        "--queue",
        redis_cluster.url,
        "--run",
        run_name,
        "--reward",
        "toy_rewards:digit_first",
        "--model",
        str(tiny_model),
        "--name",
        f"s-{run_name}",
        "--maintenance-interval-s",
        "1",
        "--monitoring-interval-s",
        "1",
    ]
    refused = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "--rq-redis" in refused.stderr, refused.stderr
    queue = RedisQueue.from_url(redis_cluster.url, QueueConfig(run=run_name))
    queue.add_prompts([factories.trusted(factories.batch(0, prompts=2), answer="7")])
    (lease,) = queue.claim("actor-1", 1)
    assert queue.submit("actor-1", lease.lease_id, factories.groups(lease.batch)).finished
    with (tmp_path / "scorer.log").open("wb") as log:
        scorer = subprocess.Popen([*cmd, "--rq-redis", redis_server.url], env=ENV, stdout=log, stderr=subprocess.STDOUT)
    try:
        got: list = []
        deadline = time.monotonic() + 120
        while len(got) < 2 and time.monotonic() < deadline:
            got += queue.read_rollouts("learner", 10, block_s=1.0)
    finally:
        kill_process(scorer)
    assert len(got) == 2, (tmp_path / "scorer.log").read_text()[-3000:]
    assert all(d.group.scored_by == f"s-{run_name}" for d in got)
    queue.close()


@pytest.mark.slow
def test_a_run_completes_on_a_cluster(
    redis_cluster: RedisClusterNodes,
    redis_server: RedisServer,
    make_proxy,
    tiny_model: Path,
    tmp_path: Path,
    run_name: str,
) -> None:
    """The learner on the cluster itself, an actor through a proxy on the cluster (its
    rate limits counted there), the tier scoring with RQ on a plain Redis."""
    store = (tmp_path / "store").as_uri()
    proxy = make_proxy(store=store, redis_url=redis_cluster.url)
    env = {**ENV, "SPOTGRPO_CA_CERT": proxy.ca}
    with (tmp_path / "actor.log").open("wb") as log:
        actor = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "actors.cli",
                "run",
                "--queue",
                proxy.url,
                "--run",
                run_name,
                "--engine",
                "transformers",
                "--model",
                str(tiny_model),
                "--worker-id",
                "remote-1",
                "--claim-block-s",
                "1",
            ],
            cwd=REPO,
            env={**env, "SPOTGRPO_TOKEN": TOKENS["actor"]},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    with (tmp_path / "scorer.log").open("wb") as log:
        scorer = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "learner.cli",
                "score",
                "--queue",
                redis_cluster.url,
                "--rq-redis",
                redis_server.url,
                "--run",
                run_name,
                "--reward",
                "toy_rewards:digit_first",
                "--model",
                str(tiny_model),
                "--name",
                f"s-{run_name}",
            ],
            env=ENV,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        learner = subprocess.run(
            [
                sys.executable,
                "-m",
                "learner.cli",
                "run",
                "--run",
                run_name,
                "--queue",
                redis_cluster.url,
                "--store",
                store,
                "--model",
                str(tiny_model),
                "--dataset",
                str(factories.write_dataset(tmp_path / "data.jsonl")),
                "--reward",
                "toy_rewards:digit_first",
                "--run-dir",
                str(tmp_path / "run"),
                "--steps",
                "4",
                "--groups-per-step",
                "4",
                "--prompts-per-batch",
                "2",
                "--max-inflight",
                "8",
                "--num-generations",
                "4",
                "--max-tokens",
                "4",
                "--checkpoint-every",
                "2",
                "--no-tensorboard",
            ],
            cwd=REPO,
            env=ENV,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        kill_process(actor)
        kill_process(scorer)
    logs = "".join((tmp_path / f).read_text()[-2000:] for f in ("actor.log", "scorer.log"))
    assert learner.returncode == 0, learner.stderr[-3000:] + logs
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if '"step"' in x]
    assert [r["step"] for r in rows if "wait_s" in r] == [1, 2, 3, 4]
    assert "loaded" in (tmp_path / "actor.log").read_text()  # announced on the cluster, loaded through the proxy
    assert all(r["score_s_mean"] >= 0 for r in rows if "wait_s" in r)  # every step's groups scored by the tier
