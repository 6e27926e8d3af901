"""The workers of one machine share adapter downloads (`actors run --adapter-cache`):
each file is read from the store once per machine, whatever the number of workers and
processes, and a damaged copy on the machine's disk is fetched again, never trusted."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from factories import stored_manifest
from scripted import ScriptedEngine

from actors.node_cache import NodeCache
from actors.watcher import AdapterWatcher, ProxySource
from protocol import AdapterManifest, ProtocolError
from protocol.trusted import open_store
from protocol.wire.files import adapter_digest, adapter_key, file_entry

REPO = Path(__file__).resolve().parents[1]


def publish(store, version: int, weights: bytes) -> AdapterManifest:
    return stored_manifest(store, version, weights, config=b'{"r": 4}')


class CountingSource(ProxySource):
    """The real presigned download, counted: each call is one read of the store."""

    reads: list[str]

    def fetch(self, manifest: AdapterManifest, name: str) -> bytes:
        self.reads.append(f"v{manifest.version}/{name}")
        return super().fetch(manifest, name)


def machine(proxy, root: Path, tmp_path: Path, workers: int, reads: list[str]) -> list[AdapterWatcher]:
    """`workers` workers of one machine through the proxy, sharing `root`."""
    watchers = []
    for j in range(workers):
        queue = proxy.queue("actor")
        source = CountingSource(queue)
        source.reads = reads
        engine = ScriptedEngine(None, lambda text, i: "")
        watchers.append(
            AdapterWatcher(queue, source, engine, tmp_path / f"w{j}", node_cache=NodeCache(root, budget_mb=64))
        )
    return watchers


@pytest.mark.s3
def test_the_workers_of_a_machine_read_each_file_from_the_store_once(
    make_proxy, s3_bucket, moto_server, tmp_path: Path
) -> None:
    proxy = make_proxy(store=f"s3://{s3_bucket}/run", env=moto_server.env())
    store = open_store(f"s3://{s3_bucket}/run")
    learner = proxy.queue("learner")
    reads: list[str] = []
    root = tmp_path / "node"
    watchers = machine(proxy, root, tmp_path, 8, reads)
    for version in (1, 2):
        learner.announce(publish(store, version, os.urandom(2**20)))
        with ThreadPoolExecutor(8) as pool:  # all at once, as a publish reaches a machine
            list(pool.map(lambda w: w.sync(), watchers))
        assert all(w.current == version for w in watchers)
    # each version's weights once, and the config (the same bytes both times) once in all
    assert sorted(reads) == ["v1/adapter_config.json", "v1/adapter_model.safetensors", "v2/adapter_model.safetensors"]
    blob = root / file_entry("adapter_config.json", b'{"r": 4}').sha256
    for j, w in enumerate(watchers):
        placed = tmp_path / f"w{j}" / "v2" / "adapter_config.json"
        assert placed.stat().st_ino == blob.stat().st_ino  # a link, not a copy
        assert w.digests[2] == adapter_digest(learner.latest_adapter().files)
    for w in watchers:
        w.queue.close()
    learner.close()


def test_a_damaged_copy_on_the_machine_is_fetched_again_not_refused(tmp_path: Path) -> None:
    from protocol.trusted.store import StoreSource

    store = open_store((tmp_path / "store").as_uri())
    manifest = publish(store, 1, b"weights" * 1000)
    reads: list[str] = []

    class Counting(StoreSource):
        def fetch(self, manifest: AdapterManifest, name: str) -> bytes:
            reads.append(name)
            return super().fetch(manifest, name)

    def worker(j: int) -> AdapterWatcher:
        queue = _Latest(manifest)
        cache = NodeCache(tmp_path / "node")
        engine = ScriptedEngine(None, lambda t, i: "")
        return AdapterWatcher(queue, Counting(store), engine, tmp_path / f"w{j}", node_cache=cache)

    first = worker(0)
    first.sync()
    assert first.current == 1 and len(reads) == 2
    weights = next(e for e in manifest.files if e.name == "adapter_model.safetensors")
    blob = tmp_path / "node" / weights.sha256
    damaged = bytearray(blob.read_bytes())
    damaged[10] ^= 0xFF  # the same size: only the content check can tell
    os.unlink(blob)  # the first worker's folder keeps its link to the good copy
    blob.write_bytes(bytes(damaged))

    second = worker(1)
    second.sync()  # the damaged copy is found and dropped: fetched again at the next try
    assert second.current == 0 and not second.refused and second.retry_soon
    second.sync()
    assert second.current == 1 and not second.refused
    assert blob.read_bytes() == store.get(adapter_key(1, "adapter_model.safetensors"))
    assert reads.count("adapter_model.safetensors") == 2


def test_a_corrupt_download_is_refused_and_never_cached(tmp_path: Path) -> None:
    cache = NodeCache(tmp_path / "node")
    entry = file_entry("adapter_model.safetensors", b"the real weights")
    with pytest.raises(ProtocolError, match="sha256"):
        cache.place(entry, lambda: b"the fake weights", tmp_path / "out")
    assert not (tmp_path / "node" / entry.sha256).exists() and not (tmp_path / "out").exists()
    assert cache.place(entry, lambda: b"the real weights", tmp_path / "out") is True
    assert (tmp_path / "out").read_bytes() == b"the real weights"


def test_the_least_recently_used_files_go_past_the_budget(tmp_path: Path) -> None:
    cache = NodeCache(tmp_path / "node", budget_mb=2.5)
    files = [os.urandom(2**20) for _ in range(4)]
    entries = [file_entry(f"f{i}", data) for i, data in enumerate(files)]
    for i in (0, 1):
        cache.place(entries[i], lambda i=i: files[i], tmp_path / f"out{i}")
        time.sleep(0.05)
    cache.place(entries[0], lambda: pytest.fail("f0 is cached"), tmp_path / "again0")  # f0 used again
    time.sleep(0.05)
    cache.place(entries[2], lambda: files[2], tmp_path / "out2")
    kept = {p.name for p in (tmp_path / "node").iterdir() if not p.name.startswith(".")}
    assert kept == {entries[0].sha256, entries[2].sha256}  # f1, the least recently used, went
    assert (tmp_path / "out1").read_bytes() == files[1]  # a worker's linked copy outlives the cache's


FETCH_ONCE = """
import sys, time
from pathlib import Path
from actors.node_cache import NodeCache
from protocol.wire.files import file_entry
data = b"x" * 100_000
def fetch():
    with open(sys.argv[2], "a") as log:
        log.write("fetch\\n")
    time.sleep(0.5)
    return data
NodeCache(Path(sys.argv[1])).place(file_entry("w", data), fetch, Path(sys.argv[3]))
"""


def test_workers_in_separate_processes_wait_on_the_one_fetching(tmp_path: Path) -> None:
    log = tmp_path / "fetches"
    log.touch()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", FETCH_ONCE, str(tmp_path / "node"), str(log), str(tmp_path / f"o{i}")], env=env
        )
        for i in range(4)
    ]
    assert [p.wait(60) for p in procs] == [0, 0, 0, 0]
    assert log.read_text() == "fetch\n"
    assert all((tmp_path / f"o{i}").read_bytes() == b"x" * 100_000 for i in range(4))


class _Latest:
    """The one queue call a watcher's `sync` makes."""

    def __init__(self, manifest: AdapterManifest) -> None:
        self.manifest = manifest
        self.lock = threading.Lock()

    def latest_adapter(self) -> AdapterManifest:
        return self.manifest
