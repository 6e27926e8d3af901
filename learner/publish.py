"""Adapter publishing off the training thread.

The training thread hands over a snapshot of the adapter (a copy of its tensors) and
goes on training; one background thread serialises it, uploads the files, writes the
manifest last, and only then announces the version through the queue. A version
whose upload or announcement cannot complete after retries is never announced: the
announced version does not advance, the failure is counted, and training goes on
(the next version gets a new number; numbers are never reused).

Shutdown order: `close()` enqueues a sentinel, the worker finishes the upload in
hand, then exits; an unexpected error in the worker (a bug, not a store or queue
outage) is re-raised on the training thread at the next `submit`/`check`/`close`.
"""

from __future__ import annotations

import functools
import logging
import queue as stdqueue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from learner.config import LearnerConfig
from learner.lifecycle import LearnerError
from learner.policy import adapter_files
from protocol import AdapterManifest, ProtocolError, Queue, QueueError, QueueUnavailable, fingerprint_of_model, to_json
from protocol.trusted.store import Store, retrying
from protocol.wire.files import MANIFEST, StoreError, adapter_digest, adapter_key, file_entry

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PublishJob:
    version: int
    step: int
    state: dict[str, Tensor]
    config_json: bytes


class Publisher:
    def __init__(
        self,
        store: Store,
        queue: Queue,
        *,
        base_model: str,
        rank: int,
        fingerprint: str | None = None,
        keep_adapters: int = 0,
        protected: Callable[[], set[int]] | None = None,
        attempts: int = 5,
        backoff_s: float = 0.5,
        log_every: int = 1,
    ) -> None:
        """`keep_adapters`: versions kept in the store, newest first (0: all); older ones
        are deleted unless `protected()` names them (pinned evaluations, the versions of
        kept checkpoints). Publishes and prunes are logged at info every `log_every` steps
        (logging_steps), at debug between."""
        self.store = store
        self.queue = queue
        self.base_model = base_model
        self.fingerprint = fingerprint
        self.rank = rank
        self.keep_adapters = keep_adapters
        self.protected = protected or set
        self.attempts = attempts
        self.backoff_s = backoff_s
        self.log_every = max(1, log_every)
        self.failures = 0
        self.published: list[int] = []
        self.digests: dict[int, str | None] = {}
        """`adapter_digest` of each version, set before it is announced; None: one published
        before a restart whose manifest could not be read (`digest_of`)."""
        self.upload_s: list[float] = []
        self._jobs: stdqueue.Queue[PublishJob | None] = stdqueue.Queue(maxsize=1)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._work, name="adapter-publisher", daemon=True)
        self._thread.start()

    @classmethod
    def for_run(cls, cfg: LearnerConfig, store: Store, queue: Queue, protected: Callable[[], set[int]]) -> Publisher:
        """The run's publisher: its model, rank, kept versions and logging cadence."""
        return cls(
            store,
            queue,
            base_model=cfg.model,
            rank=cfg.lora_rank,
            keep_adapters=cfg.adapters_kept,
            fingerprint=fingerprint_of_model(cfg.model),
            protected=protected,
            log_every=cfg.log_every,
        )

    @property
    def last_published(self) -> int:
        return self.published[-1] if self.published else 0

    def submit(self, job: PublishJob) -> None:
        """Queue one version; blocks only while the previous upload is still waiting."""
        self.check()
        while True:
            try:
                self._jobs.put(job, timeout=1.0)
                return
            except stdqueue.Full:
                self.check()

    def flush(self) -> None:
        """Wait until every queued version is published (or has failed)."""
        self._jobs.join()
        self.check()

    def check(self) -> None:
        if self._error is not None:
            raise RuntimeError("the adapter publisher died") from self._error

    def close(self) -> None:
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()
        self.check()

    # ----------------------------------------------------------------- worker
    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                started = time.monotonic()
                self._publish(job)
                self.upload_s.append(time.monotonic() - started)
                self.published.append(job.version)
            except (StoreError, QueueError) as err:
                self.failures += 1
                log.error("adapter v%d not published (it will not be announced): %s", job.version, err)  # type: ignore[union-attr]
            except BaseException as err:  # a bug: take the training loop down with it
                self._error = err
                return
            finally:
                self._jobs.task_done()

    def _retry(self, what: str, fn: Callable[[], object]) -> object:
        """Store and queue outages are retried alike; a VersionConflict is not an outage."""
        return retrying(
            fn,
            what=what,
            retry_on=(StoreError, QueueUnavailable),
            attempts=self.attempts,
            base_s=self.backoff_s,
            on_retry=lambda n, err: log.warning("%s failed (attempt %d), retrying: %s", what, n, err),
        )

    def _publish(self, job: PublishJob) -> None:
        files = adapter_files(job.state, job.config_json)
        for name, data in files.items():
            key = adapter_key(job.version, name)
            self._retry(f"upload {key}", functools.partial(self.store.put, key, data))
        manifest = AdapterManifest(
            version=job.version,
            step=job.step,
            base_model=self.base_model,
            fingerprint=self.fingerprint,
            rank=self.rank,
            files=[file_entry(name, data) for name, data in files.items()],
            created_at=time.time(),
        )
        key = adapter_key(job.version, MANIFEST)
        self._retry(f"upload {key}", lambda: self.store.put(key, to_json(manifest)))
        self.digests[job.version] = adapter_digest(manifest.files)  # before any group can name it
        self._retry(f"announce v{job.version}", lambda: self.queue.announce(manifest))
        level = logging.INFO if job.step % self.log_every == 0 else logging.DEBUG
        log.log(level, "adapter v%d published (step %d)", job.version, job.step)
        self._prune(job.version, level)

    def digest_of(self, version: int) -> str | None:
        """The digest of adapter `version` as published: remembered, or read from its
        manifest in the store (a version published before a restart). None where it cannot
        be known now (pruned, or the store unreachable): its groups go unchecked."""
        if version in self.digests:
            return self.digests[version]
        try:
            digest: str | None = adapter_digest(self.store.read_manifest(version).files)
        except (StoreError, ProtocolError) as err:  # asked once: the store is not read again per group
            log.warning("adapter v%d: no manifest to check its groups' digests against: %s", version, err)
            digest = None
        self.digests[version] = digest
        return digest

    def _prune(self, newest: int, level: int = logging.INFO) -> None:
        """Delete every version older than the newest `keep_adapters` that nothing protects
        (a version skipped once is looked at again at the next publish)."""
        if not self.keep_adapters:
            return
        try:
            files = self.store.adapter_files()
            keep = set(range(newest - self.keep_adapters + 1, newest + 1)) | self.protected()
            old = set(files) - keep
            doomed = [k for v in old for k in files[v]]
            if doomed:
                self.store.delete(doomed)
                log.log(level, "pruned adapter versions %s", ", ".join(f"v{v}" for v in sorted(old)))
        except StoreError as err:  # a leftover old version costs only space
            log.warning("could not prune old adapter versions: %s", err)


def nonfinite(adapter: dict[str, Tensor]) -> str:
    """The tensors of `adapter` holding a NaN or an infinity, named ("" if none)."""
    bad = [name for name, t in adapter.items() if not bool(torch.isfinite(t).all())]
    return "" if not bad else bad[0] + (f" and {len(bad) - 1} more" if len(bad) > 1 else "")


def finite(adapter: dict[str, Tensor], step: int) -> dict[str, Tensor]:
    """`adapter`, or LearnerError if any value is NaN or infinite: such an adapter is never
    published (actors would generate garbage) nor checkpointed (the last good checkpoint
    stays the one to resume from)."""
    if bad := nonfinite(adapter):
        raise LearnerError(
            f"step {step}: the adapter has non-finite values ({bad}); not publishing or checkpointing it. "
            "Resume from the last checkpoint, with a lower --learning-rate or --max-grad-norm"
        )
    return adapter
