"""Adapter files shared by the workers of one machine (`actors run --adapter-cache DIR`).

An 8-GPU spot machine runs eight workers; without this each downloads every adapter
version for itself, so a fleet reads a version from the store once per worker (a 34 MB
adapter, 1,000 workers: 34 GB a publish). With a shared folder the machine reads it once:
files are kept by their sha256 (the manifest's), a worker that needs one takes the file's
lock (`fcntl.flock`, so workers in other processes and threads wait on the one that
fetches), fetches and verifies it, and stores it under a temporary name renamed into
place, so nobody sees half a file. Each worker then hard-links it into its own version
folder (a copy where the folder is on another file system): no second copy on disk.

The folder holds at most `budget_mb` (the least recently used files go first). A file
removed while another worker was about to link it is fetched again. What the cache holds
is trusted no more than the network: the watcher compares the digest of the files it
loaded with the manifest's, and a damaged copy is dropped and fetched again.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import shutil
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from protocol.wire.files import verify
from protocol.wire.messages import AdapterFile

log = logging.getLogger(__name__)


class NodeCache:
    def __init__(self, root: Path, budget_mb: float = 4096.0) -> None:
        self.root = root
        self.budget = int(budget_mb * 2**20)
        root.mkdir(parents=True, exist_ok=True)
        self.fetched = 0
        """Files this process fetched from the store into the cache."""
        self.linked = 0
        """Files placed from the cache without a fetch."""

    def place(self, entry: AdapterFile, fetch: Callable[[], bytes], dest: Path) -> bool:
        """Put the file `entry` names at `dest`: from the cache when this machine has it,
        else fetched (once per machine), verified against `entry` (ProtocolError: nothing
        is stored) and kept. Returns whether it was fetched."""
        blob = self.root / entry.sha256
        if self._link(blob, entry, dest):
            return False
        with self._locked(entry.sha256):
            if self._link(blob, entry, dest):  # another worker fetched it while we waited
                return False
            data = fetch()
            verify(entry, data)
            part = self.root / f".{entry.sha256}.{os.getpid()}.{threading.get_ident()}.part"
            part.write_bytes(data)
            part.chmod(0o444)  # read-only: the links in the workers' folders are the same file
            os.replace(part, blob)
            self.fetched += 1
        if not self._link(blob, entry, dest):  # pruned at once by another worker: ours anyway
            dest.write_bytes(data)
        self.prune()
        return True

    def discard(self, entries: Iterable[AdapterFile]) -> None:
        """Drop the cached copies of `entries` (a worker found them damaged)."""
        for entry in entries:
            (self.root / entry.sha256).unlink(missing_ok=True)
        log.warning("adapter cache %s: dropped a damaged copy; fetching it again", self.root)

    def prune(self) -> None:
        """Delete the least recently used files past the budget."""
        blobs = []
        for path in self.root.iterdir():
            if path.name.startswith("."):
                continue
            with contextlib.suppress(FileNotFoundError):
                st = path.stat()
                blobs.append((st.st_mtime, st.st_size, path))
        total = sum(size for _, size, _ in blobs)
        for _, size, path in sorted(blobs):
            if total <= self.budget:
                break
            path.unlink(missing_ok=True)
            (self.root / f".{path.name}.lock").unlink(missing_ok=True)
            total -= size

    def _link(self, blob: Path, entry: AdapterFile, dest: Path) -> bool:
        try:
            if blob.stat().st_size != entry.size:  # never stored so: damaged since
                blob.unlink(missing_ok=True)
                return False
            dest.unlink(missing_ok=True)
            try:
                os.link(blob, dest)
            except OSError as err:
                if err.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
                    raise
                shutil.copyfile(blob, dest)
            os.utime(blob)  # recently used: pruned last
        except FileNotFoundError:  # not cached, or pruned meanwhile
            return False
        self.linked += 1
        return True

    @contextlib.contextmanager
    def _locked(self, digest: str) -> Iterator[None]:
        with (self.root / f".{digest}.lock").open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
