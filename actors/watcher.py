"""The adapter watcher: follows announcements and keeps the engine on the newest adapter.

On start it reads the latest announced version; then it waits on the queue's push
notifications (Redis pub/sub) and, every `poll_s` or when a notification was missed
(pub/sub is at-most-once), reads the latest version again. Through a proxy, whose event
stream resumes from its last event id, it reads it again once the stream is open and
then every `quiet_poll_s` only: at 1,000 workers, a poll every 5 s each was 200 requests
a second at the door for nothing. Only the newest version
matters to an actor, so versions it never saw are skipped, not replayed.

A new version is downloaded file by file, each checked against the manifest's size
and sha256, written to `cache_dir/v<N>/`, and loaded next to the current one. With a
`node_cache` (`actors.node_cache`), the workers of one machine share the downloads: each
file is fetched once per machine and linked into each worker's folder; what the engine
loads is checked against the manifest's digest either way. A
corrupt or missing adapter is refused with a logged reason (and never retried: a
version names one adapter forever); the actor keeps generating with what it has. One
that could not be fetched (the store, the network or the disk failed: at 1,000 workers on
one machine, downloads time out) is tried again within `poll_s`.
The newest `keep_adapters` versions stay loaded for new groups; older ones are evicted,
and their files deleted once no queued or running request names them.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from actors.engine import Engine, EngineError
from actors.node_cache import NodeCache
from protocol import AdapterManifest, ProtocolError, Queue, QueueError
from protocol.client.adapters import AdapterSource
from protocol.util.retry import Backoff
from protocol.wire.files import StoreError, StoreMissing, adapter_digest, folder_digest, verify

log = logging.getLogger(__name__)


class ProxySource(AdapterSource):
    """Through the proxy: presigned URLs, so the worker holds no bucket credentials. The
    URLs of a version are asked for once, for all its files."""

    def __init__(self, queue: Queue) -> None:
        if not hasattr(queue, "adapter_download"):
            raise ValueError("adapter downloads through the queue need an https:// (proxy) queue")
        self.queue: Any = queue
        self._download: Any = None

    def fetch(self, manifest: AdapterManifest, name: str) -> bytes:
        if self._download is None or self._download.manifest.version != manifest.version:
            self._download = self.queue.adapter_download(manifest.version)
        data: bytes = self.queue.fetch_adapter_file(self._download, name)
        return data

    def manifest(self, version: int) -> AdapterManifest:
        self._download = self.queue.adapter_download(version)
        manifest: AdapterManifest = self._download.manifest
        return manifest

    def forget(self) -> None:
        self._download = None


class AdapterWatcher:
    def __init__(
        self,
        queue: Queue,
        source: AdapterSource,
        engine: Engine,
        cache_dir: Path,
        *,
        keep_adapters: int = 2,
        poll_s: float = 5.0,
        quiet_poll_s: float = 60.0,
        on_loaded: Callable[[AdapterManifest, float], None] | None = None,
        on_refused: Callable[[int, str], None] | None = None,
        node_cache: NodeCache | None = None,
    ) -> None:
        if keep_adapters < 1:
            raise ValueError("keep_adapters must be >= 1")
        self.queue, self.source, self.engine = queue, source, engine
        self.cache_dir = cache_dir
        self.keep_adapters = keep_adapters
        self.poll_s, self.quiet_poll_s = poll_s, quiet_poll_s
        self.on_loaded, self.on_refused = on_loaded, on_refused
        self.node_cache = node_cache
        self.current = 0
        """The newest loaded version (0: the base model)."""
        self.refused: dict[int, str] = {}
        self.retry_soon = False
        """A download failed for want of the store or the network: read the latest within `poll_s`."""
        self.digests: dict[int, str] = {}
        """`folder_digest` of each version's files, as the engine loaded them (equal to the
        manifest's): the proof each group carries of the adapters it was generated with. Kept
        after an eviction (a group in flight may have tokens of it): 64 characters a version."""
        self.load_s: dict[int, float] = {}
        """Seconds from the start of the download to loaded, per version."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.RLock()  # reentrant: `holding` wraps `ensure`

    # ------------------------------------------------------------------ control
    def start(self) -> AdapterWatcher:
        self._thread = threading.Thread(target=self._run, name="adapter-watcher", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _run(self) -> None:
        subscription = None
        synced = time.monotonic()
        backoff = Backoff(first=0.5, cap=10.0)  # an outage: 0.5, 1, 2 ... 10 s between tries
        gapless = False
        while not self._stop.is_set():
            try:
                if subscription is None:
                    subscription = self.queue.subscribe_adapters()
                    self.sync()  # whatever was announced before we listened
                    synced = time.monotonic()
                    backoff.reset()
                # short waits, so that close() is answered within a second
                manifest = subscription.get(timeout_s=min(self.poll_s, 1.0))
                opened, gapless = subscription.gapless and not gapless, subscription.gapless
                if manifest is not None:
                    self.install(manifest)
                elif opened or time.monotonic() - synced >= (
                    self.quiet_poll_s if gapless and not self.retry_soon else self.poll_s
                ):
                    self.retry_soon = False
                    self.sync()  # `opened`: what came between the first sync and the stream
                    synced = time.monotonic()
            except QueueError as err:
                log.warning("adapter announcements unavailable, retrying: %s", err)
                if subscription is not None:
                    subscription.close()
                subscription = None
                backoff.wait(self._stop)
        if subscription is not None:
            subscription.close()

    # ------------------------------------------------------------------ installing
    def sync(self) -> None:
        """Install the latest announced version if it is newer than ours."""
        latest = self.queue.latest_adapter()
        if latest is not None:
            self.install(latest)

    def install(self, manifest: AdapterManifest) -> bool:
        """Download, verify and load `manifest`'s adapter; False if refused or not newer."""
        with self._lock:
            version = manifest.version
            if version <= self.current or version in self.refused:
                return False
            started = time.monotonic()
            # already there when an evaluation pinned to it came first
            if version not in self.engine.loaded_versions() and not self._load(manifest):
                return False
            self.current = version
            self.load_s[version] = time.monotonic() - started
            log.info("adapter v%d loaded in %.2fs", version, self.load_s[version])
            if self.on_loaded is not None:
                self.on_loaded(manifest, self.load_s[version])
            self._evict()
            return True

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """No version is installed or evicted while inside: a version chosen here stays
        loaded at least until the requests naming it are queued in the engine (which
        then keeps it until they are done)."""
        with self._lock:
            yield

    def ensure(self, version: int) -> bool:
        """Make an older version generate again (an evaluation pinned to it): loaded beside
        the current one if it is not, without changing `current`. False if it cannot be."""
        with self._lock:
            if version == 0 or version in self.engine.loaded_versions():
                return True
            if version in self.refused:
                return False
            try:
                manifest = self.source.manifest(version)
            except (ProtocolError, StoreError, QueueError) as err:
                log.error("adapter v%d (pinned by an evaluation) is not available: %s", version, err)
                return False
            if not self._load(manifest):
                return False
            # make room among the others: this one is about to be named by queued groups,
            # and goes (once they are done) when a newer version arrives
            self._evict(spare=version)
            return True

    def _load(self, manifest: AdapterManifest) -> bool:
        """Download, verify and load one version into the engine; False if refused."""
        version = manifest.version
        folder = self.cache_dir / f"v{version}"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            for entry in manifest.files:
                fetch = functools.partial(self.source.fetch, manifest, entry.name)
                if self.node_cache is not None:
                    self.node_cache.place(entry, fetch, folder / entry.name)
                    continue
                data = fetch()
                verify(entry, data)
                (folder / entry.name).write_bytes(data)
            digest = folder_digest(folder)
            if digest != adapter_digest(manifest.files):  # a damaged copy on this machine's disk
                if self.node_cache is not None:
                    self.node_cache.discard(manifest.files)
                raise OSError(f"v{version}'s files on disk do not match its manifest")
            self.engine.load_adapter(version, folder)
            self.digests[version] = digest
        except (ProtocolError, EngineError, StoreMissing) as err:  # the adapter itself: never again
            reason = f"{type(err).__name__}: {err}"
            self.refused[version] = reason
            shutil.rmtree(folder, ignore_errors=True)
            log.error("adapter v%d refused, still generating with v%d: %s", version, self.current, reason)
            if self.on_refused is not None:
                self.on_refused(version, reason)
            return False
        except (StoreError, OSError) as err:  # the store, the network or the disk: try again soon
            shutil.rmtree(folder, ignore_errors=True)
            self.source.forget()
            self.retry_soon = True
            log.warning("adapter v%d could not be fetched, retrying within %gs: %s", version, self.poll_s, err)
            return False
        return True

    def _evict(self, spare: int | None = None) -> None:
        # by version, not by load order (an evaluation may load an old one last); never the
        # current one, nor `spare` (an evaluation's, just loaded)
        loaded = [v for v in sorted(self.engine.loaded_versions()) if v not in (self.current, spare)]
        kept = 1 + (spare is not None)
        for old in loaded[: max(0, len(loaded) + kept - self.keep_adapters)]:
            # the files go only when no queued or running request names the version any
            # more: vLLM loads a LoRA lazily, when its first request is scheduled
            folder = self.cache_dir / f"v{old}"
            self.engine.evict_adapter(old, on_released=functools.partial(shutil.rmtree, folder, ignore_errors=True))
