"""One proxy, several runs: each run its own keys on Redis and its own prefix in the store,
and a token confined to the runs it names (`proxy.auth.Token.run_of`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from factories import batch, groups, stored_manifest
from servers import ProxyProcess, kill_process

from protocol import QueueConfig
from protocol.client.http_queue import HttpQueue, QueueForbidden, confirm_identity
from protocol.trusted import RedisQueue
from protocol.trusted.store import open_store
from protocol.wire.errors import LeaseLost
from protocol.wire.files import StoreMissing
from proxy.auth import RunRefused, TokenError, Tokens

pytestmark = pytest.mark.redis
REPO = Path(__file__).resolve().parents[1]

SECRETS = {
    "admin": "admin-secret-for-multirun-0123456789-abc",
    "learner-a": "learner-a-secret-for-multirun-012345678",
    "learner-b": "learner-b-secret-for-multirun-012345678",
    "fleet-ab": "fleet-ab-secret-for-multirun-0123456789",
    "fleet-c": "fleet-c-secret-for-multirun-01234567890",
    "fleet-home": "fleet-home-secret-for-multirun-01234567",
    "ops-ab": "ops-ab-secret-for-multirun-0123456789012",
    "fleet-sweep": "fleet-sweep-secret-for-multirun-01234567",
}


def _tokens_text(a: str, b: str, c: str, sweep: str | None = None) -> str:
    """The test's tokens; `sweep`: a run pattern, for a fleet token of every run it matches."""
    entries = [
        *([("fleet-sweep", "actor", [sweep])] if sweep else []),
        ("admin", "admin", None),
        ("learner-a", "learner", [a]),
        ("learner-b", "learner", [b]),
        ("fleet-ab", "actor", [a, b]),
        ("fleet-c", "actor", [c]),
        ("fleet-home", "actor", None),  # names no runs: the proxy's --run alone
        ("ops-ab", "admin", [a, b]),
    ]
    text = ""
    for name, role, runs in entries:
        text += f'[[tokens]]\nname = "{name}"\nrole = "{role}"\nsecret = "{SECRETS[name]}"\n'
        if runs is not None:
            text += "runs = [" + ", ".join(f'"{r}"' for r in runs) + "]\n"
    return text


@pytest.fixture
def runs(run_name: str) -> tuple[str, str, str]:
    return f"{run_name}-a", f"{run_name}-b", f"{run_name}-c"


@pytest.fixture
def multirun_proxy(redis_server, run_name: str, runs, tls_pair, tmp_path: Path):
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(_tokens_text(*runs, sweep=f"{run_name}-p*"))
    store = (tmp_path / "store").as_uri() + "/{run}"
    proxy = ProxyProcess(redis_server.url, store, run_name, tls_pair, tokens).start()
    yield proxy
    proxy.kill()


def _queue(proxy: ProxyProcess, token: str, run: str) -> HttpQueue:
    return HttpQueue(proxy.url, SECRETS[token], QueueConfig(run=run), verify=proxy.ca)


def test_a_token_names_its_runs_and_a_learner_token_one() -> None:
    base = '[[tokens]]\nname = "t"\nrole = "%s"\nsecret = "' + "x" * 32 + '"\n'
    tokens = Tokens.from_toml(base % "actor" + 'runs = ["a", "b"]\n')
    (token,) = tokens.tokens
    assert token.runs == {"a", "b"} and tokens.runs() == {"a", "b"}
    assert token.run_of("b", "home") == "b"
    with pytest.raises(RunRefused, match="may not touch run 'home'"):
        token.run_of("home", "home")
    with pytest.raises(RunRefused, match="may touch runs a, b: name one"):
        token.run_of(None, "home")
    (single,) = Tokens.from_toml(base % "learner" + 'runs = ["a"]\n').tokens
    assert single.run_of(None, "home") == "a"  # its only run, without naming it
    (plain,) = Tokens.from_toml(base % "actor").tokens
    assert plain.runs is None and plain.run_of(None, "home") == "home"
    with pytest.raises(RunRefused):
        plain.run_of("a", "home")
    for extra, msg in [
        ('runs = ["a", "b"]\n', "a learner token belongs to one run"),
        ("runs = []\n", "runs must be a list"),
        ('runs = "a"\n', "runs must be a list"),
        ('runs = ["a", "a"]\n', "runs must be a list of 1-1000 distinct"),
        ('runs = ["../up"]\n', "runs must be a list"),
        ('runs = ["{a}"]\n', "runs must be a list"),
    ]:
        with pytest.raises(TokenError, match=msg):
            Tokens.from_toml(base % "learner" + extra)


def test_a_tokens_run_patterns_match_the_runs_started_and_no_learner_has_one() -> None:
    base = '[[tokens]]\nname = "t"\nrole = "%s"\nsecret = "' + "x" * 32 + '"\n'
    (fleet,) = Tokens.from_toml(base % "actor" + 'runs = ["sweep-*", "home"]\n').tokens
    assert fleet.patterns == ("sweep-",)
    assert fleet.allowed("proxy-run", {"sweep-1", "other", "sweep-2"}) == {"home", "sweep-1", "sweep-2"}
    assert fleet.run_of("sweep-1", "proxy-run", {"sweep-1"}) == "sweep-1"
    with pytest.raises(RunRefused, match="is not started"):
        fleet.run_of("sweep-9", "proxy-run", {"sweep-1"})
    with pytest.raises(RunRefused, match="may not touch run 'other'"):
        fleet.run_of("other", "proxy-run", {"other"})
    with pytest.raises(RunRefused, match="name one"):  # a pattern's runs come and go: always name one
        Tokens.from_toml(base % "actor" + 'runs = ["sweep-*"]\n').tokens[0].run_of(None, "p", {"sweep-1"})
    (anything,) = Tokens.from_toml(base % "admin" + 'runs = ["*"]\n').tokens
    assert anything.allowed("p", {"a", "b"}) == {"a", "b"}
    for bad in ('runs = ["sweep-*"]', 'runs = ["*"]'):
        with pytest.raises(TokenError, match="belongs to one run, by name"):
            Tokens.from_toml(base % "learner" + bad + "\n")
    for bad in ('runs = ["sw*ep"]', 'runs = ["**"]', 'runs = ["-x*"]'):
        with pytest.raises(TokenError, match="patterns ending in"):
            Tokens.from_toml(base % "actor" + bad + "\n")


def test_one_proxy_serves_several_runs_each_confined_to_its_own_keys_and_store(
    multirun_proxy: ProxyProcess, redis_server, run_name: str, runs, tmp_path: Path
) -> None:
    a, b, c = runs
    direct = {r: RedisQueue.from_url(redis_server.url, QueueConfig(run=r)) for r in (a, b, c, run_name)}
    learner_a, learner_b = _queue(multirun_proxy, "learner-a", a), _queue(multirun_proxy, "learner-b", b)
    learner_a.add_prompts([batch("in-a")])
    learner_b.add_prompts([batch("in-b", prompts=1)])

    fleet_a, fleet_b = _queue(multirun_proxy, "fleet-ab", a), _queue(multirun_proxy, "fleet-ab", b)
    (lease_a,) = fleet_a.claim("w", 1)
    (lease_b,) = fleet_b.claim("w", 1)
    assert (lease_a.batch.batch_id, lease_b.batch.batch_id) == ("batch-in-a", "batch-in-b")
    assert fleet_a.claim("w", 1) == [] and fleet_b.claim("w", 1) == []  # each run's prompts, once
    assert fleet_b.submit("w", lease_b.lease_id, groups(lease_b.batch)).stored == 1
    with pytest.raises(LeaseLost):  # a lease of run a is not submitted into run b
        fleet_b.submit("w", lease_a.lease_id, groups(lease_a.batch))
    assert fleet_a.submit("w", lease_a.lease_id, groups(lease_a.batch)).stored == 2

    (got_b,) = learner_b.read_rollouts("l", 10)
    assert got_b.group.batch_id == "batch-in-b" and got_b.group.actor_id == "fleet-ab/w"
    assert sorted(d.group.batch_id for d in learner_a.read_rollouts("l", 10)) == ["batch-in-a"] * 2
    assert direct[a].stats().rollouts.length == 2 and direct[b].stats().rollouts.length == 1

    # refused, and nothing of any run changed
    before = {r: q.stats() for r, q in direct.items()}
    fleet_c_as_ab = _queue(multirun_proxy, "fleet-ab", c)
    for call in (
        lambda: fleet_c_as_ab.claim("w", 1),
        lambda: fleet_c_as_ab.latest_adapter(),
        lambda: _queue(multirun_proxy, "learner-a", b).add_prompts([batch("sneaked")]),
        lambda: _queue(multirun_proxy, "learner-a", b).read_rollouts("l", 10),
        lambda: _queue(multirun_proxy, "fleet-home", a).claim("w", 1),
        lambda: _queue(multirun_proxy, "fleet-c", run_name).claim("w", 1),
    ):
        with pytest.raises(QueueForbidden, match="may not touch run"):
            call()
    with httpx.Client(base_url=multirun_proxy.url, verify=multirun_proxy.ssl(), timeout=15) as raw:
        for name in ("{" + a + "}", "../" + a, a + "*", ""):
            garbage = raw.post(
                "/v1/leases/claim",
                headers={"Authorization": f"Bearer {SECRETS['fleet-ab']}", "Spotgrpo-Run": name},
                content=b"\x80",
            )
            assert garbage.status_code == 403, (name, garbage.text)
    assert {r: q.stats() for r, q in direct.items()} == before
    assert direct[c].stats().prompts.length == 0

    # the adapters: each run its own prefix, its own announcements
    store_a = open_store((tmp_path / "store" / a).as_uri())
    learner_a.announce(stored_manifest(store_a, 1))
    assert fleet_a.fetch_adapter_file(fleet_a.adapter_download(1), "adapter_model.safetensors") == b"weights-1"
    assert fleet_a.latest_adapter().version == 1 and fleet_b.latest_adapter() is None
    with pytest.raises(StoreMissing):
        fleet_b.adapter_download(1)
    assert [e.manifest.version for e in fleet_a.adapter_events()] == [1] and fleet_b.adapter_events() == []
    for q in (*direct.values(), learner_a, learner_b, fleet_a, fleet_b, fleet_c_as_ab):
        q.close()


def test_a_client_that_names_no_run_gets_its_tokens_run(multirun_proxy: ProxyProcess, run_name: str, runs) -> None:
    a, _, c = runs
    home = _queue(multirun_proxy, "fleet-home", "default")
    assert confirm_identity(home, "actor", None, "a worker") == run_name == home.config.run
    only_c = _queue(multirun_proxy, "fleet-c", "default")
    assert confirm_identity(only_c, "actor", None, "a worker") == c
    assert only_c.whoami().runs == [c]
    either = _queue(multirun_proxy, "fleet-ab", "default")
    assert confirm_identity(either, "actor", None, "a worker") == ""  # several: it may ask, then name one
    assert either.whoami().runs == sorted([a, runs[1]]) and either.config.run == "default"
    with pytest.raises(QueueForbidden, match="name one"):
        either.claim("w", 1)
    assert confirm_identity(_queue(multirun_proxy, "fleet-ab", a), "actor", a, "a worker") == a
    with pytest.raises(QueueForbidden, match="may not touch run"):
        confirm_identity(_queue(multirun_proxy, "learner-a", c), "learner", c, "the learner")
    for q in (home, only_c, either):
        q.close()
    admin = [sys.executable, "-m", "proxy.cli", "quarantine", multirun_proxy.url, "--token", SECRETS["ops-ab"]]
    env = {"SPOTGRPO_CA_CERT": multirun_proxy.ca, "PATH": "/usr/bin:/bin"}
    told = subprocess.run(admin, capture_output=True, text=True, timeout=60, env=env, cwd=REPO)
    assert told.returncode == 2 and "name one" in told.stderr and "Traceback" not in told.stderr, told.stderr
    listed = subprocess.run([*admin, "--run", a], capture_output=True, text=True, timeout=60, env=env, cwd=REPO)
    assert listed.returncode == 0 and "no worker is quarantined" in listed.stderr, listed.stderr


def test_tokens_naming_other_runs_need_a_store_prefix_per_run(redis_server, runs, tls_pair, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(_tokens_text(*runs))
    cmd = [sys.executable, "-m", "proxy.cli", "serve", "--redis", redis_server.url, "--store",
           (tmp_path / "store").as_uri(), "--tokens", str(tokens), "--insecure-http", "--port", "1"]  # fmt: skip
    started = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "give --store with {run} in it" in done.stderr, done.stderr
    assert time.monotonic() - started < 30


def test_an_actor_serves_the_run_it_names_and_no_other(
    multirun_proxy: ProxyProcess, redis_server, runs, tiny_model: Path
) -> None:
    """`actors run --run B` with a token for A and B: B's prompts are answered, A's stay."""
    a, b, _ = runs
    direct = {r: RedisQueue.from_url(redis_server.url, QueueConfig(run=r)) for r in (a, b)}
    direct[a].add_prompts([batch("left-alone", prompts=1)])
    direct[b].add_prompts([batch("answered", prompts=1)])
    cmd = multirun_proxy.actor_command(tiny_model, "spot", "--reward", "toy_rewards:digit_first")
    cmd[cmd.index("--run") + 1] = b
    env = {**multirun_proxy.actor_env(), "SPOTGRPO_TOKEN": SECRETS["fleet-ab"]}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 90
        while direct[b].stats().rollouts.length == 0:
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "run b's prompt was never answered"
            time.sleep(0.1)
        time.sleep(1.0)  # a claim of run a, were there one, would show by now
    finally:
        kill_process(proc)
    (delivery,) = direct[b].read_rollouts("l", 10)
    assert delivery.group.batch_id == "batch-answered" and delivery.group.actor_id == "fleet-ab/spot"
    stats_a = direct[a].stats()
    assert stats_a.prompts.length == 1 and stats_a.prompts.pending == 0 and stats_a.rollouts.length == 0
    for q in direct.values():
        q.close()


def test_the_deploy_pages_tokens_for_several_runs_are_what_the_proxy_reads() -> None:
    import re

    page = (REPO / "docs" / "deploy.md").read_text().split("### Several runs behind one proxy", 1)[1]
    (block,) = re.findall(r"^```toml\n(.*?)^```", page.split("\n### ", 1)[0], re.S | re.M)
    tokens = Tokens.from_toml(block.replace('"..."', '"' + "s" * 40 + '"', 1).replace('"..."', '"' + "t" * 40 + '"'))
    learner, fleet = tokens.tokens
    assert learner.run_of(None, "elsewhere") == "gsm8k-lr3e-5"
    assert fleet.runs == {"gsm8k-lr3e-5", "gsm8k-lr1e-4"} and fleet.workers == 64


def test_sighup_reads_the_tokens_again_runs_come_and_go_without_a_restart(
    multirun_proxy: ProxyProcess, redis_server, runs, tmp_path: Path
) -> None:
    import signal

    a, b, c = runs
    d = f"{c}-new"
    tokens = tmp_path / "tokens.toml"
    learner_d = 'name = "learner-d"\nrole = "learner"\nsecret = "' + "d" * 40 + f'"\nruns = ["{d}"]\n'
    fleet_ab, fleet_d = _queue(multirun_proxy, "fleet-ab", b), _queue(multirun_proxy, "fleet-ab", d)
    with pytest.raises(QueueForbidden):
        fleet_d.claim("w", 1)

    def hup_until(ok) -> None:
        multirun_proxy.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 20
        while not ok():
            assert time.monotonic() < deadline, multirun_proxy.log.read_text()[-2000:]
            time.sleep(0.1)

    def refused(call) -> bool:
        try:
            call()
        except QueueForbidden:
            return True
        return False

    # a new run and its learner; the fleet token now names d and no longer b
    text = _tokens_text(a, b, c).replace(f'runs = ["{a}", "{b}"]', f'runs = ["{a}", "{d}"]')
    tokens.write_text(text + "[[tokens]]\n" + learner_d)
    hup_until(lambda: not refused(lambda: fleet_d.claim("w", 1)))
    learner = HttpQueue(multirun_proxy.url, "d" * 40, QueueConfig(run=d), verify=multirun_proxy.ca)
    learner.add_prompts([batch("new-run", prompts=1)])
    (lease,) = fleet_d.claim("w", 1)
    assert lease.batch.batch_id == "batch-new-run"
    assert refused(lambda: fleet_ab.claim("w", 1))  # b is gone for this token
    assert RedisQueue.from_url(redis_server.url, QueueConfig(run=d)).stats().prompts.pending == 1

    # a file that does not parse changes nothing
    tokens.write_text(text + "[[tokens]]\nname = 'broken'\n")
    hup_until(lambda: "still serving the tokens read before" in multirun_proxy.log.read_text())
    assert fleet_d.claim("w", 1) == [] and learner.whoami().runs == [d]
    for q in (fleet_ab, fleet_d, learner):
        q.close()


def test_metrics_describe_the_run_the_scrape_names(multirun_proxy: ProxyProcess, redis_server, runs) -> None:
    a, b, _ = runs
    for run, n in ((a, 3), (b, 1)):
        queue = RedisQueue.from_url(redis_server.url, QueueConfig(run=run))
        queue.add_prompts([batch(f"{run}-{i}") for i in range(n)])
        queue.close()
    headers = {"Authorization": f"Bearer {SECRETS['ops-ab']}"}
    with httpx.Client(base_url=multirun_proxy.url, verify=multirun_proxy.ssl(), timeout=15) as admin:
        for run, n in ((a, 3), (b, 1)):
            text = admin.get("/metrics", headers={**headers, "Spotgrpo-Run": run}).text
            assert f'spotgrpo_queue_entries{{state="waiting",stream="prompts"}} {n}.0' in text, text[-2000:]
        assert admin.get("/metrics", headers=headers).status_code == 403  # two runs: name one


def test_a_run_whose_learner_stopped_reading_holds_back_that_run_alone(
    redis_server, run_name: str, runs, tls_pair, tmp_path: Path
) -> None:
    """Backpressure is per run: run a's unread groups past --backlog-limit refuse a's
    submissions (503, the worker keeps them), and run b's go on being stored."""
    from protocol import QueueUnavailable

    a, b, c = runs
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(_tokens_text(a, b, c))
    store = (tmp_path / "store").as_uri() + "/{run}"
    proxy = ProxyProcess(redis_server.url, store, run_name, tls_pair, tokens, extra=("--backlog-limit", "0")).start()
    try:
        _queue(proxy, "learner-a", a).add_prompts([batch("a-1", prompts=1), batch("a-2", prompts=1)])
        _queue(proxy, "learner-b", b).add_prompts([batch("b-1", prompts=1)])
        fleet_a, fleet_b = _queue(proxy, "fleet-ab", a), _queue(proxy, "fleet-ab", b)
        fleet_a.retry_s = 1.5
        first, second = fleet_a.claim("w", 2)
        assert fleet_a.submit("w", first.lease_id, groups(first.batch)).stored == 1  # a's learner never reads it
        time.sleep(1.1)  # the proxy re-reads a run's backlog once a second
        with pytest.raises(QueueUnavailable, match="503"):
            fleet_a.submit("w", second.lease_id, groups(second.batch))
        (lease_b,) = fleet_b.claim("w", 1)
        assert fleet_b.submit("w", lease_b.lease_id, groups(lease_b.batch)).stored == 1
        direct_a = RedisQueue.from_url(redis_server.url, QueueConfig(run=a))
        assert direct_a.stats().rollouts.length == 1 and direct_a.stats().prompts.pending == 1  # kept, still leased
        direct_a.close()
    finally:
        proxy.kill()


def test_a_runs_share_is_set_by_its_learner_or_an_admin_and_reaches_workers_with_claims(
    multirun_proxy: ProxyProcess, runs
) -> None:
    from protocol import RunShare

    a, b, _ = runs
    fleet_b = _queue(multirun_proxy, "fleet-ab", b)
    fleet_b.claim("w", 1)
    assert fleet_b.run_share() == RunShare()  # nobody said: weight 1, no cap
    _queue(multirun_proxy, "learner-b", b).set_run_share(RunShare(weight=3.0, cap=0.5))
    fleet_b.claim("w", 1)
    assert fleet_b.run_share() == RunShare(weight=3.0, cap=0.5)  # the proxy forgot its copy when told
    _queue(multirun_proxy, "ops-ab", a).set_run_share(RunShare(weight=2.0))
    with pytest.raises(QueueForbidden):
        fleet_b.set_run_share(RunShare(weight=100.0))  # a worker cannot take more for its run
    with pytest.raises(QueueForbidden):
        _queue(multirun_proxy, "learner-a", b).set_run_share(RunShare(weight=100.0))  # nor another run's learner
    fleet_a = fleet_b.for_run(a)
    fleet_a.claim("w", 1)
    assert fleet_a.run_share() == RunShare(weight=2.0) and fleet_b.run_share().weight == 3.0
    fleet_a.close()
    assert fleet_b.claim("w", 1) == []  # closing the run's sibling left the connections alone
    fleet_b.close()


def test_an_actor_without_run_serves_every_run_its_token_names(
    multirun_proxy: ProxyProcess, redis_server, runs, tiny_model: Path
) -> None:
    """`actors run` with a token for runs A and B and no --run: one engine answers both runs'
    prompts, and each run's fleet view shows the worker with its share of the run."""
    a, b, _ = runs
    direct = {r: RedisQueue.from_url(redis_server.url, QueueConfig(run=r)) for r in (a, b)}
    for run in (a, b):
        direct[run].add_prompts([batch(f"{run}-{i}", prompts=1) for i in range(3)])
    cmd = multirun_proxy.actor_command(
        tiny_model, "spot", "--reward", "toy_rewards:digit_first", "--report-every-s", "1"
    )
    del cmd[cmd.index("--run") : cmd.index("--run") + 2]
    env = {**multirun_proxy.actor_env(), "SPOTGRPO_TOKEN": SECRETS["fleet-ab"]}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while any(direct[r].stats().rollouts.length < 3 for r in (a, b)):
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "both runs' prompts were never answered"
            time.sleep(0.2)
        shares = {}
        while len(shares) < 2:  # each run's view of the worker, reported on its own heartbeat
            shares = {r: w.share for r in (a, b) for w in direct[r].workers() if w.worker == "fleet-ab/spot"}
            shares = {r: s for r, s in shares.items() if s}
            assert time.monotonic() < deadline, "the worker's shares never showed"
            time.sleep(0.2)
        headers = {"Authorization": f"Bearer {SECRETS['ops-ab']}", "Spotgrpo-Run": a}
        with httpx.Client(base_url=multirun_proxy.url, verify=multirun_proxy.ssl(), timeout=15) as admin:
            text = admin.get("/metrics", headers=headers).text
        assert 'spotgrpo_worker_run_share{worker="fleet-ab/spot"}' in text, text[-2000:]
    finally:
        kill_process(proc)
    assert sum(shares.values()) == pytest.approx(1.0, abs=0.05)
    for run in (a, b):
        ids = {d.group.batch_id for d in direct[run].read_rollouts("l", 10)}
        assert ids == {f"batch-{run}-{i}" for i in range(3)}  # each run its own prompts, none of the other's
        direct[run].close()


def test_proxy_share_sets_a_runs_weight_in_one_line(multirun_proxy: ProxyProcess, runs) -> None:
    from protocol import RunShare

    a, _, _ = runs
    env = {**multirun_proxy.actor_env(), "SPOTGRPO_TOKEN": SECRETS["ops-ab"]}
    base = [sys.executable, "-m", "proxy.cli", "share", multirun_proxy.url, "--run", a]
    done = subprocess.run([*base, "--weight", "2.5", "--cap", "0.4"], env=env, capture_output=True, text=True)
    assert done.returncode == 0 and f"run {a}: weight 2.5, cap 0.4" in done.stdout, done.stderr
    fleet_a = _queue(multirun_proxy, "fleet-ab", a)
    fleet_a.claim("w", 1)
    assert fleet_a.run_share() == RunShare(weight=2.5, cap=0.4)
    for bad in (["--weight", "0"], ["--cap", "2"]):
        done = subprocess.run([*base, *bad], env=env, capture_output=True, text=True)
        assert done.returncode == 2 and done.stderr.startswith("proxy share: ") and len(done.stderr.splitlines()) == 1
    env["SPOTGRPO_TOKEN"] = SECRETS["fleet-ab"]  # a worker's token may not
    done = subprocess.run([*base, "--weight", "9"], env=env, capture_output=True, text=True)
    assert done.returncode == 2 and "proxy share: " in done.stderr
    assert fleet_a.claim("w", 1) == [] and fleet_a.run_share() == RunShare(weight=2.5, cap=0.4)
    fleet_a.close()


def test_a_run_whose_learner_stopped_reading_does_not_hold_up_a_workers_other_runs(
    redis_server, run_name: str, runs, tls_pair, tmp_path: Path
) -> None:
    """One worker loop serving runs a and b: a's learner reads nothing, so past
    --backlog-limit a's submissions are refused (503) and a backs off; b's prompts are all
    answered meanwhile, by the same engine."""
    import threading

    from scripted import ScriptedEngine

    from actors.runs import AdapterSlots, RunEngine, RunLink
    from actors.watcher import AdapterWatcher, ProxySource
    from actors.worker import Worker
    from learner.tiny import build_tokenizer
    from protocol.usercode.rewards import Scorer, load_reward

    a, b, c = runs
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(_tokens_text(a, b, c))
    store = (tmp_path / "store").as_uri() + "/{run}"
    proxy = ProxyProcess(redis_server.url, store, run_name, tls_pair, tokens, extra=("--backlog-limit", "0")).start()
    direct = {r: RedisQueue.from_url(redis_server.url, QueueConfig(run=r)) for r in (a, b)}
    direct[a].add_prompts([batch("a-unread", prompts=1)])
    (unread,) = direct[a].claim("before", 1)
    direct[a].submit("before", unread.lease_id, groups(unread.batch))  # a's backlog is past its limit
    direct[a].add_prompts([batch(f"a-{i}", prompts=1) for i in range(4)])
    direct[b].add_prompts([batch(f"b-{i}", prompts=1) for i in range(12)])
    engine = ScriptedEngine(build_tokenizer(), lambda text, j: "5")
    slots, links = AdapterSlots(), []
    for run in (a, b):
        queue = _queue(proxy, "fleet-ab", run)
        queue.retry_s = 1.0
        view = RunEngine(engine, run, slots)
        links.append(RunLink(run, queue, AdapterWatcher(queue, ProxySource(queue), view, tmp_path / run), view))
    worker = Worker(
        links[0].queue, engine, links[0].watcher, Scorer([load_reward("toy_rewards:digit_first")]), "w",
        claim_block_s=0.2, max_num_seqs=4, more_runs=links[1:],
    )  # fmt: skip
    loop = threading.Thread(target=worker.work)
    loop.start()
    try:
        deadline = time.monotonic() + 60
        while direct[b].stats().rollouts.length < 12:
            assert loop.is_alive() and time.monotonic() < deadline, "run b was held up"
            time.sleep(0.1)
        assert direct[a].stats().rollouts.length == 1  # a's learner never read: a waits, alone
        link_a, link_b = worker.links
        assert link_a.run == a and link_a.back_at > 0  # a is backing off
        assert link_b.back_at == 0.0  # and b never did
    finally:
        worker.stop()
        loop.join(timeout=30)
        proxy.kill()
    for q in (*direct.values(), *(k.queue for k in links)):
        q.close()


def _scorer(redis_url: str, run: str, reward: str, model: Path, log: Path) -> subprocess.Popen:
    """`learner score` for one run: its own trusted scoring tier, its own reward."""
    cmd = [sys.executable, "-m", "learner.cli", "score", "--queue", redis_url, "--run", run, "--reward", reward,
           "--model", str(model), "--name", f"scorer-{run}", "--maintenance-interval-s", "1",
           "--monitoring-interval-s", "1", "--abandon-after-s", "2"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'tests'}"}
    with log.open("wb") as out:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)


def _fleet_actor(proxy: ProxyProcess, model: Path, log: Path, engine: str = "transformers") -> subprocess.Popen:
    """`actors run` without --run on the fleet token of runs a and b."""
    cmd = proxy.actor_command(model, "shared", "--claim-block-s", "1", "--report-every-s", "1")
    del cmd[cmd.index("--run") : cmd.index("--run") + 2]
    cmd[cmd.index("--engine") + 1] = engine
    if engine == "vllm":
        cmd += ["--max-model-len", "256", "--max-lora-rank", "16"]
    env = {**proxy.actor_env(), "SPOTGRPO_TOKEN": SECRETS["fleet-ab"]}
    with log.open("wb") as out:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["transformers", pytest.param("vllm", marks=pytest.mark.vllm)])
def test_two_learners_train_at_once_on_one_fleet(
    redis_server, run_name: str, runs, tls_pair, tiny_model: Path, tmp_path: Path, engine: str
) -> None:
    """Two runs with their own data, rewards, learning rates and scoring tiers, one actor
    process serving both through one proxy, on either engine, SIGKILLed halfway and
    replaced: each learner completes its steps, and each run's ledger is exact (every
    issued prompt trained once, dropped with its reason, or still in the queue; none
    trained twice), its adapters' digests checked, no worker quarantined."""
    import importlib

    from factories import write_dataset

    if engine == "vllm":
        pytest.importorskip("vllm", reason="the vllm engine is tested in .venv-vllm (make test-vllm)")
    saved = sys.path[0]  # bench/chaos.py puts the repository first on the path when imported
    chaos = importlib.import_module("bench.chaos")
    sys.path[0] = saved
    a, b, c = runs
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(_tokens_text(a, b, c))
    store_root = (tmp_path / "store").as_uri()
    proxy = ProxyProcess(
        redis_server.url, store_root + "/{run}", run_name, tls_pair, tokens, extra=("--lease-timeout-s", "5")
    ).start()
    procs = [
        _scorer(redis_server.url, a, "toy_rewards:digit_first", tiny_model, tmp_path / "scorer-a.log"),
        _scorer(redis_server.url, b, "toy_rewards:length_bonus", tiny_model, tmp_path / "scorer-b.log"),
        _fleet_actor(proxy, tiny_model, tmp_path / "actor.log", engine),
    ]
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'tests'}"}
    learners = {}

    def steps(run: str) -> list[int]:
        metrics = tmp_path / run / "run" / "metrics.jsonl"
        lines = metrics.read_text().splitlines() if metrics.exists() else []
        return [row["step"] for row in map(json.loads, lines) if "wait_s" in row]

    try:
        for run, reward, lr, seed in ((a, "digit_first", "1e-2", 0), (b, "length_bonus", "3e-3", 1)):
            cmd = [sys.executable, "-m", "learner.cli", "run", "--run", run, "--queue", redis_server.url,
                   "--store", f"{store_root}/{run}", "--model", str(tiny_model),
                   "--dataset", str(write_dataset(tmp_path / f"data-{run}.jsonl", seed=seed)),
                   "--reward", f"toy_rewards:{reward}", "--learning-rate", lr,
                   "--run-dir", str(tmp_path / run / "run"),
                   "--steps", "6", "--groups-per-step", "2", "--prompts-per-batch", "2", "--max-inflight", "4",
                   "--num-generations", "4", "--max-tokens", "4", "--checkpoint-every", "2", "--no-tensorboard",
                   "--fleet-weight", "2" if run == b else "1", "--keep-queue"]  # fmt: skip
            learners[run] = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while min(len(steps(a)), len(steps(b))) < 2:  # halfway: the shared worker dies, another comes
            assert time.monotonic() < deadline and all(p.poll() is None for p in learners.values())
            time.sleep(0.2)
        procs[-1].kill()
        procs.append(_fleet_actor(proxy, tiny_model, tmp_path / "actor-2.log", engine))
        outputs = {run: proc.communicate(timeout=400)[0].decode()[-3000:] for run, proc in learners.items()}
    finally:
        for proc in [*procs, *learners.values()]:
            kill_process(proc)
        proxy.kill()
    logs = "".join(f"\n--- {p.name}\n" + p.read_text()[-2000:] for p in sorted(tmp_path.glob("*.log")))
    for run, proc in learners.items():
        assert proc.returncode == 0, outputs[run] + logs
        assert steps(run) == [1, 2, 3, 4, 5, 6], outputs[run]
        figures = chaos.ledger(tmp_path / run, redis_server.url, f"{store_root}/{run}", run=run)
        assert figures["exact"] and figures["trained"] > 0, figures["problems"]
        direct = RedisQueue.from_url(redis_server.url, QueueConfig(run=run))
        assert direct.latest_adapter() is not None and direct.quarantined() == {}
        direct.close()
    share = RedisQueue.from_url(redis_server.url, QueueConfig(run=b))
    assert share.run_share().weight == 2.0  # b's learner said so
    share.close()
    for log in ("actor.log", "actor-2.log"):  # one process served both, and then its replacement
        assert f"runs {a}, {b}" in (tmp_path / log).read_text()


def test_a_run_whose_reward_hangs_stops_alone(
    multirun_proxy: ProxyProcess, redis_server, runs, tiny_model: Path, tmp_path: Path
) -> None:
    """Run a's scoring tier hangs in its reward; the shared worker generates for both runs,
    and run b's groups are scored and reach its learner while a's wait."""
    from factories import trusted

    a, b, _ = runs
    direct = {r: RedisQueue.from_url(redis_server.url, QueueConfig(run=r)) for r in (a, b)}
    for run in (a, b):
        direct[run].add_prompts([trusted(batch(f"{run}-{i}", prompts=1), answer="5") for i in range(3)])
    procs = [
        _scorer(redis_server.url, a, "toy_rewards:hangs", tiny_model, tmp_path / "scorer-a.log"),
        _scorer(redis_server.url, b, "toy_rewards:digit_first", tiny_model, tmp_path / "scorer-b.log"),
        _fleet_actor(multirun_proxy, tiny_model, tmp_path / "actor.log"),
    ]
    try:
        deadline = time.monotonic() + 120
        while direct[b].stats().rollouts.length < 3:
            logs = "".join(p.read_text()[-1500:] for p in sorted(tmp_path.glob("*.log")))
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), logs
            time.sleep(0.2)
        while direct[a].stats().unscored.length < 3:  # generated by the same worker: a's tier holds them
            assert time.monotonic() < deadline, (tmp_path / "actor.log").read_text()[-2000:]
            time.sleep(0.2)
    finally:
        for proc in procs:
            kill_process(proc)
    assert direct[a].stats().rollouts.length == 0
    for q in direct.values():
        q.close()


def test_an_actor_without_run_serves_the_runs_its_token_is_given_later(
    multirun_proxy: ProxyProcess, redis_server, runs, tiny_model: Path, tmp_path: Path
) -> None:
    """`actors run` without --run on a token of one run serves it; the admin gives the token
    another run (SIGHUP) and the worker serves that one too, without a restart."""
    import signal

    a, b, c = runs
    direct = {r: RedisQueue.from_url(redis_server.url, QueueConfig(run=r)) for r in (a, c)}
    direct[c].add_prompts([batch("c-0", prompts=1)])
    cmd = multirun_proxy.actor_command(tiny_model, "one", "--reward", "toy_rewards:digit_first",
                                       "--find-runs-every-s", "0.5", "--claim-block-s", "0.5")  # fmt: skip
    del cmd[cmd.index("--run") : cmd.index("--run") + 2]
    env = {**multirun_proxy.actor_env(), "SPOTGRPO_TOKEN": SECRETS["fleet-c"]}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 90
        while direct[c].stats().rollouts.length < 1:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
            time.sleep(0.2)
        tokens = tmp_path / "tokens.toml"
        tokens.write_text(_tokens_text(a, b, c).replace(f'runs = ["{c}"]', f'runs = ["{c}", "{a}"]'))
        multirun_proxy.proc.send_signal(signal.SIGHUP)
        direct[a].add_prompts([batch("a-0", prompts=1)])
        while direct[a].stats().rollouts.length < 1:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
            time.sleep(0.2)
    finally:
        kill_process(proc)
    for q in direct.values():
        q.close()


def test_run_patterns_name_the_runs_their_learners_start(
    multirun_proxy: ProxyProcess, redis_server, run_name: str, tiny_model: Path
) -> None:
    """A fleet token of `<run>-p*`: a worker started before any such run waits; a run is
    served from its learner's start (`open_run`: registered on Redis), and the worker goes
    on to the next when one ends. A matching name nobody started is refused, as is any
    other run."""
    p1, p2 = f"{run_name}-p1", f"{run_name}-p2"
    sweep = _queue(multirun_proxy, "fleet-sweep", p1)
    with pytest.raises(QueueForbidden, match="is not started"):
        sweep.claim("w", 1)  # no context made for a run nobody started
    with pytest.raises(QueueForbidden, match="may not touch run"):
        sweep.for_run(f"{run_name}-a").claim("w", 1)
    cmd = multirun_proxy.actor_command(tiny_model, "sweeper", "--reward", "toy_rewards:digit_first",
                                       "--find-runs-every-s", "0.5", "--claim-block-s", "0.5")  # fmt: skip
    del cmd[cmd.index("--run") : cmd.index("--run") + 2]
    env = {**multirun_proxy.actor_env(), "SPOTGRPO_TOKEN": SECRETS["fleet-sweep"]}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    direct = {r: RedisQueue.from_url(redis_server.url, QueueConfig(run=r)) for r in (p1, p2)}
    try:
        deadline = time.monotonic() + 90
        for run in (p1, p2):
            direct[run].set_run_over("")  # its learner starts it (`learner.lifecycle.open_run`)
            direct[run].add_prompts([batch(f"{run}-0", prompts=1)])
            while direct[run].stats().rollouts.length < 1:
                assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
                time.sleep(0.2)
            who = sweep.for_run("default").whoami()  # naming no run: the runs it may touch now
            assert who.runs == [run] and who.patterns == [f"{run_name}-p*"]
            direct[run].set_run_over(f"run {run} is over")  # its learner finishes it: the worker waits on
        time.sleep(1.5)
        assert proc.poll() is None
    finally:
        kill_process(proc)
    deadline = time.monotonic() + 10  # the proxy reads the started runs again every 2 s
    while sweep.for_run("default").whoami().runs:  # both over: neither listed
        assert time.monotonic() < deadline, sweep.for_run("default").whoami().runs
        time.sleep(0.2)
    for q in (*direct.values(), sweep):
        q.close()
