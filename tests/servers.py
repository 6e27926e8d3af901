"""The servers the tests talk to, each a real one started for the test session or the
test: a private redis-server (and a 3-master Redis Cluster), moto's S3 API over HTTP,
and `proxy serve` over TLS with its tokens. Process helpers beside them. conftest.py
makes the fixtures available to every test; helpers are imported from here."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from protocol import QueueConfig


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_pair(offset: int) -> int:
    """A free port whose partner `offset` above it is free too (and below 65536): a
    Redis Cluster node's bus port (+10000), the second worker's metrics of `--gpus`
    (+1)."""
    import random

    for _ in range(1000):
        port = random.randint(20000, 55000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + offset))
            return port
        except OSError:
            continue
    raise RuntimeError(f"no free port pair {offset} apart")


def kill_process(proc: subprocess.Popen | None) -> None:
    """SIGKILL by process id if it still runs, and reap it (draining its pipes, if any)."""
    if proc is None:
        return
    if proc.poll() is None:
        proc.kill()
    if proc.stdout is not None and not proc.stdout.closed:
        proc.communicate(timeout=30)
    else:
        proc.wait(timeout=10)


def stop_process(proc: subprocess.Popen[bytes] | None) -> None:
    """SIGTERM by process id; SIGKILL if it has not exited after 10 s."""
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            kill_process(proc)


class RedisServer:
    """One redis-server process on loopback, started and stopped by its process id."""

    def __init__(self, workdir: Path, port: int | None = None, persistent: bool = False, cluster: bool = False) -> None:
        self.workdir = workdir
        self.port = port or (free_port_pair(10000) if cluster else free_port())
        self.persistent = persistent
        self.cluster = cluster
        """A node of a Redis Cluster (`RedisClusterNodes` joins them)."""
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed; .ci/run installs it")
        persistence = ["--appendonly", "yes", "--appendfsync", "always"] if self.persistent else ["--appendonly", "no"]
        if self.cluster:
            persistence += ["--cluster-enabled", "yes", "--cluster-config-file", str(self.workdir / "nodes.conf")]
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [
                binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--dir",
                str(self.workdir),
                "--protected-mode",
                "no",
                *persistence,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(port=self.port)
        deadline = time.monotonic() + 10
        while True:
            try:
                if client.ping():
                    break
            except redis.exceptions.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server on port {self.port} did not start") from None
                time.sleep(0.02)
        client.close()

    def kill(self) -> None:
        """SIGKILL: no shutdown save, like a crash."""
        kill_process(self.proc)

    def stop(self) -> None:
        stop_process(self.proc)


def _running(server: Any) -> Iterator[Any]:
    """A fixture's body: the server started, yielded, stopped."""
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    yield from _running(RedisServer(tmp_path_factory.mktemp("redis")))


class RedisClusterNodes:
    """A Redis Cluster of three masters (no replicas) on loopback, as `redis-cli --cluster
    create` makes one."""

    def __init__(self, workdir: Path) -> None:
        self.nodes = [RedisServer(workdir / f"node-{i}", cluster=True) for i in range(3)]

    @property
    def url(self) -> str:
        """Any node names the cluster: the first."""
        return self.nodes[0].url

    def start(self) -> None:
        for node in self.nodes:
            node.start()
        subprocess.run(
            [
                shutil.which("redis-cli") or "redis-cli",
                "--cluster",
                "create",
                *[f"127.0.0.1:{n.port}" for n in self.nodes],
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
        client = redis.Redis(port=self.nodes[0].port)
        deadline = time.monotonic() + 30
        while client.cluster("info").get("cluster_state") != "ok":
            if time.monotonic() > deadline:
                raise RuntimeError("the test cluster never reached cluster_state:ok")
            time.sleep(0.05)
        client.close()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterNodes]:
    yield from _running(RedisClusterNodes(tmp_path_factory.mktemp("redis-cluster")))


@pytest.fixture
def make_server(tmp_path: Path) -> Iterator[type[RedisServer]]:
    """Private servers for tests that kill or restart Redis; all stopped afterwards."""
    started: list[RedisServer] = []

    def make(**kwargs: object) -> RedisServer:
        server = RedisServer(tmp_path / f"redis-{len(started)}", **kwargs)
        started.append(server)
        return server

    yield make
    for server in started:
        server.stop()


class MotoServer:
    """moto's S3 API over HTTP on loopback, in a thread of the test process."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self.port = free_port()
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """The standard AWS variables a user would set for a MinIO-like endpoint."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }


@pytest.fixture(scope="session")
def moto_server() -> Iterator[MotoServer]:
    server = MotoServer()
    server.server.start()
    yield server
    server.server.stop()


@pytest.fixture
def s3_bucket(moto_server: MotoServer, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh bucket; the AWS variables point boto3 at the moto server for this test."""
    import boto3

    for key, value in moto_server.env().items():
        monkeypatch.setenv(key, value)
    name = f"adapters-{uuid.uuid4().hex[:12]}"
    boto3.client("s3").create_bucket(Bucket=name)
    return name


# -------------------------------------------------------------------- proxy fixtures

TOKENS = {
    "actor": "actor-secret-for-tests-0123456789-abcdef",
    "learner": "learner-secret-for-tests-0123456789-abcd",
    "admin": "admin-secret-for-tests-0123456789-abcdefg",
}


def through_proxy(worker: str, role: str = "actor") -> str:
    """The name the proxy lists a worker under: its token's name, then the worker's own."""
    return f"{role}-token/{worker}"


@pytest.fixture(scope="session")
def tls_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from proxy.tls import write_self_signed

    folder = tmp_path_factory.mktemp("tls")
    write_self_signed(folder / "cert.pem", folder / "key.pem", ["localhost", "127.0.0.1"])
    return folder / "cert.pem", folder / "key.pem"


@pytest.fixture(scope="session")
def tokens_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tokens") / "tokens.toml"
    path.write_text(
        "".join(
            f'[[tokens]]\nname = "{role}-token"\nrole = "{role}"\nsecret = "{secret}"\n'
            for role, secret in TOKENS.items()
        )
    )
    return path


class ProxyProcess:
    """`proxy serve` as a user runs it, over real TLS on loopback; stopped by its pid."""

    def __init__(
        self,
        redis_url: str,
        store: str,
        run: str,
        tls: tuple[Path, Path],
        tokens: Path,
        env: dict[str, str] | None = None,
        extra: tuple[str, ...] = (),
    ) -> None:
        self.port = free_port()
        self.run = run
        self.cmd = [
            sys.executable,
            "-m",
            "proxy.cli",
            "serve",
            "--redis",
            redis_url,
            "--store",
            store,
            "--run",
            run,
            "--tokens",
            str(tokens),
            "--port",
            str(self.port),
            "--tls-cert",
            str(tls[0]),
            "--tls-key",
            str(tls[1]),
            *extra,
        ]
        self.env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), **(env or {})}
        self.ca = str(tls[0])
        self.log = Path(tls[0]).parent / f"proxy-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def start(self) -> ProxyProcess:
        from protocol import QueueUnavailable
        from protocol.client.transport import wait_for_proxy

        with self.log.open("ab") as log:  # a file, not a pipe nobody reads (it would fill and block)
            self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_for_proxy(self.url, self.ca, self.proc, timeout_s=30)
        except QueueUnavailable as err:
            raise RuntimeError(f"{err}: {self.log.read_text()[-2000:]}") from None
        return self

    def ssl(self):
        import ssl

        return ssl.create_default_context(cafile=self.ca)

    def kill(self) -> None:
        kill_process(self.proc)

    def stop(self) -> None:
        stop_process(self.proc)

    def actor_command(self, model: Path, worker: str, *flags: str) -> list[str]:
        """`actors run` as a user starts a worker on this proxy's run (with `actor_env`)."""
        return [sys.executable, "-m", "actors.cli", "run", "--queue", self.url, "--run", self.run, "--engine",
                "transformers", "--model", str(model), "--worker-id", worker, *flags]  # fmt: skip

    def actor_env(self) -> dict[str, str]:
        """A worker's environment: the actor token and the proxy's CA, the tests' modules on the path."""
        repo = Path(__file__).resolve().parents[1]
        path = os.pathsep.join([str(repo), str(repo / "tests")])
        return {**os.environ, "PYTHONPATH": path, "SPOTGRPO_TOKEN": TOKENS["actor"], "SPOTGRPO_CA_CERT": self.ca}

    def queue(self, role: str, **config: object):
        from protocol.client.http_queue import HttpQueue

        return HttpQueue(self.url, TOKENS[role], QueueConfig(run=self.run, **config), verify=self.ca)


@pytest.fixture
def make_proxy(redis_server: RedisServer, run_name: str, tls_pair, tokens_file, tmp_path: Path):
    """`make_proxy(store=..., extra=(...))` -> a started ProxyProcess on the session's Redis."""
    started: list[ProxyProcess] = []

    def make(
        store: str | None = None,
        extra: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        redis_url: str | None = None,
    ) -> ProxyProcess:
        proxy = ProxyProcess(
            redis_url or redis_server.url,
            store or (tmp_path / "store").as_uri(),
            run_name,
            tls_pair,
            tokens_file,
            env,
            extra,
        )
        started.append(proxy)
        return proxy.start()

    yield make
    for proxy in started:
        proxy.kill()  # nothing here depends on a graceful shutdown, which waits out keep-alives
