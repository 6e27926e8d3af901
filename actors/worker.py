"""The work loop of one rollout worker, shaped like rq's `Worker.work()`.

    claim a lease -> heartbeat while working -> generate with the newest adapter ->
    score -> submit (groups tagged with the adapter version that produced them)

Connection errors back off exponentially (capped) and the loop continues; groups that
were finished but could not be submitted are kept and submitted first when the queue
is back. A submission the queue refuses (the lease passed to another worker while this
one was away, or the groups do not answer it) is dropped with a warning: the lease's
holder does the batch, and the queue stores each group once whoever submits it. A
refusal of the worker itself (a bad token, a role without the right, a certificate that
does not verify) ends the loop with `WorkerRefused`: retrying cannot help.

Shutdown (SIGTERM, a spot notice): stop claiming; the batch in hand may finish within
`grace_s`, after which generation is aborted and the lease handed back, so another
worker takes it at once; unsent groups get the rest of the grace period; exit 0.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from actors.engine import Engine
from actors.metrics import WorkerMetrics
from actors.rewards import Scorer
from actors.watcher import AdapterWatcher
from protocol import (
    Completion,
    Lease,
    Queue,
    QueueError,
    QueueForbidden,
    QueueRefused,
    QueueTLSError,
    QueueUnavailable,
    RolloutGroup,
    group_id_for,
    pack_i32,
    unpack_i32,
)

log = logging.getLogger(__name__)


class WorkerRefused(RuntimeError):
    """The queue refuses this worker itself (token, role, TLS): the worker must stop."""


@dataclass
class Unsent:
    lease_id: str
    groups: list[RolloutGroup] = field(default_factory=list)


class Heartbeat:
    """Keeps one lease alive from a background thread while the batch is worked on."""

    def __init__(self, queue: Queue, worker: str, lease_id: str, interval_s: float) -> None:
        self.queue, self.worker, self.lease_id, self.interval_s = queue, worker, lease_id, interval_s
        self.lost = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                if self.lease_id not in self.queue.heartbeat(self.worker, [self.lease_id]):
                    self.lost = True  # finish anyway: the groups are stored once whoever submits
                    log.warning("lease %s passed to another worker; finishing it anyway", self.lease_id)
                    return
            except QueueError as err:  # the work loop meets the same error and decides
                log.warning("heartbeat failed (will retry): %s", err)


class Worker:
    def __init__(
        self,
        queue: Queue,
        engine: Engine,
        watcher: AdapterWatcher,
        scorer: Scorer,
        worker_id: str,
        *,
        claim_block_s: float = 5.0,
        grace_s: float = 0.0,
        max_backoff_s: float = 30.0,
        metrics: WorkerMetrics | None = None,
    ) -> None:
        self.queue, self.engine, self.watcher, self.scorer = queue, engine, watcher, scorer
        self.worker_id = worker_id
        self.claim_block_s = claim_block_s
        self.grace_s = grace_s
        self.max_backoff_s = max_backoff_s
        self.metrics = metrics or WorkerMetrics()
        self.heartbeat_s = max(0.5, queue.config.lease_timeout_s / 3)
        self.stopping = threading.Event()
        self.abort = threading.Event()
        """Set when the grace period is over: the engine stops generating."""
        self.unsent: list[Unsent] = []
        self.batches_done = 0

    # ----------------------------------------------------------------- control
    def stop(self) -> None:
        """Stop claiming; abort the batch in hand once `grace_s` has passed. Queue calls
        stop retrying through outages, so the way out takes seconds, not minutes."""
        if self.stopping.is_set():
            return
        self.stopping.set()
        self.queue.stop_retrying()
        timer = threading.Timer(self.grace_s, self.abort.set)
        timer.daemon = True
        timer.start()

    # -------------------------------------------------------------------- loop
    def work(self, max_batches: int | None = None) -> int:
        backoff = 0.5
        while not self.stopping.is_set() and (max_batches is None or self.batches_done < max_batches):
            try:
                self.submit_unsent()
                started = time.monotonic()
                leases = self.queue.claim(self.worker_id, 1, block_s=self.claim_block_s)
                self.metrics.lease_wait.observe(time.monotonic() - started)
                if leases:
                    self.process(leases[0])
                backoff = 0.5
            except (QueueForbidden, QueueTLSError) as err:
                self._drain()
                raise WorkerRefused(str(err)) from None
            except QueueUnavailable as err:
                self.metrics.connection_errors.inc()
                log.warning("queue unavailable, retrying in %.1fs: %s", backoff, err)
                self.stopping.wait(backoff)
                backoff = min(backoff * 2, self.max_backoff_s)
        self._drain()
        return 0

    def _drain(self) -> None:
        """On the way out: submit what is finished, within the grace period."""
        deadline = time.monotonic() + max(self.grace_s, 1.0)
        while self.unsent and time.monotonic() < deadline:
            try:
                self.submit_unsent()
            except QueueUnavailable:
                time.sleep(0.5)
            except (QueueForbidden, QueueTLSError):
                break
        if self.unsent:
            log.error("exiting with %d unsent batches; their leases will expire and be redone", len(self.unsent))

    def process(self, lease: Lease) -> None:
        batch = lease.batch
        version = self.watcher.current
        with Heartbeat(self.queue, self.worker_id, lease.lease_id, self.heartbeat_s):
            started = time.monotonic()
            prompts = [unpack_i32(p.token_ids).tolist() if p.token_ids else [] for p in batch.prompts]
            samples = self.engine.generate(prompts, batch.num_generations, batch.sampling, version, abort=self.abort)
            generate_s = time.monotonic() - started
            if any(s.finish_reason == "abort" for group in samples for s in group):
                self._hand_back(lease)
                return
            groups = [self._group(lease, i, prompts[i], samples[i], version, generate_s) for i in range(len(prompts))]
        self.unsent.append(Unsent(lease.lease_id, groups))
        self.batches_done += 1
        self.submit_unsent()

    def _group(self, lease: Lease, i: int, prompt_ids: list[int], samples, version: int, generate_s: float) -> RolloutGroup:  # type: ignore[no-untyped-def]
        prompt = lease.batch.prompts[i]
        texts = [self.engine.decode(s.token_ids) for s in samples]
        started = time.monotonic()
        scores = self.scorer.score(prompt, self.engine.decode(prompt_ids), texts, [s.token_ids for s in samples])
        if scores.error is not None:
            self.metrics.reward_errors.inc()
            log.warning("batch %s prompt %s: %s", lease.batch.batch_id, prompt.id, scores.error)
        tokens = sum(len(s.token_ids) for s in samples)
        self.metrics.tokens.inc(tokens)
        return RolloutGroup(
            group_id=group_id_for(lease.batch.batch_id, prompt.id),
            batch_id=lease.batch.batch_id,
            prompt_id=prompt.id,
            adapter_version=version,
            actor_id=self.worker_id,
            prompt_token_ids=pack_i32(prompt_ids),
            completions=[
                Completion.of(s.token_ids, s.logprobs, finish_reason=s.finish_reason, text=t, reward=r,
                              reward_components=c, error=scores.error)
                for s, t, r, c in zip(samples, texts, scores.rewards, scores.components, strict=True)
            ],
            error=scores.error,
            timings={"generate_s": generate_s, "reward_s": time.monotonic() - started},
        )

    def submit_unsent(self) -> None:
        while self.unsent:
            item = self.unsent[0]
            try:
                result = self.queue.submit(self.worker_id, item.lease_id, item.groups)
            except (QueueForbidden, QueueTLSError):
                raise
            except QueueRefused as err:  # not ours any more, or not an answer: the holder redoes it
                self.unsent.pop(0)
                self.metrics.submissions_refused.inc()
                log.warning("lease %s: submission refused, dropping %d groups: %s", item.lease_id, len(item.groups), err)
                continue
            self.unsent.pop(0)
            self.metrics.groups.inc(result.stored)
            if not result.lease_held:
                log.info("lease %s was already finished; its %d groups were all stored before", item.lease_id, result.duplicates)
            elif not result.finished:
                log.warning("lease %s: %d prompts still lack a group; the lease will expire and be redone", item.lease_id, result.missing)

    def _hand_back(self, lease: Lease) -> None:
        try:
            self.queue.release(self.worker_id, lease.lease_id)
            log.info("handed lease %s back unfinished", lease.lease_id)
        except QueueError as err:  # it will expire and be claimed again
            log.warning("could not hand lease %s back (it will expire): %s", lease.lease_id, err)
