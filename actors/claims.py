"""How a worker claims (`actors.worker`): leases while the engine has room, from the run
furthest below its share when it serves several (`actors.runs`); each lease checked
against what the worker can serve and its groups queued on the engine; a run that ends,
is refused or whose queue is unavailable set aside alone."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from actors.engine import Engine, GroupRequest
from actors.episodes import EpisodeEngine, episode_request
from actors.flights import Flight
from actors.metrics import WorkerMetrics
from actors.rewards import Scoring
from actors.runs import EMPTY_PAUSE_S, RunLink, claim_order
from protocol import Lease, PromptBatch, QueueForbidden, QueueUnavailable, RunOver

log = logging.getLogger("actors.worker")


class WorkerRefused(RuntimeError):
    """The queue refuses this worker itself (token, role, TLS): the worker must stop."""


class WorkerEngineDead(RuntimeError):
    """The inference engine died; the worker handed its leases back and must stop."""


class Claims:
    """The claiming half of `actors.worker.Worker` (a mixin: the state is the worker's)."""

    links: list[RunLink]
    engine: Engine
    scorer: Scoring | None
    metrics: WorkerMetrics
    worker_id: str
    max_num_seqs: int
    claim_block_s: float
    flights: dict[tuple[str, str], Flight]
    batches_claimed: int
    stopping: threading.Event
    abort: threading.Event
    run_over: str | None
    fingerprint: str | None
    keep_serving: bool
    in_flight_updates: bool
    find_runs: Callable[[set[str]], list[RunLink]] | None
    find_runs_every_s: float
    _runs_found_at: float
    _rotation: int
    add_run: Callable[[RunLink], None]
    stop: Callable[[], None]
    _error: Callable[[str], None]
    _forget: Callable[[tuple[str, str]], None]

    def follows(self, batch: PromptBatch) -> bool:
        """Whether the batch's groups follow the newest adapter as they generate: unless
        it is pinned to a version (an evaluation), or in-flight updates are off."""
        return self.in_flight_updates and batch.pinned_version is None

    def _unavailable(self, link: RunLink, err: QueueUnavailable) -> None:
        self.metrics.connection_errors.inc()
        delay = link.backoff.failed()  # the engine generates on meanwhile: no sleep here
        named = f" (run {link.run})" if len(self.links) > 1 else ""
        log.warning("queue unavailable%s, retrying in %.1fs: %s", named, delay, err)
        self._error(f"queue unavailable: {err}")
        link.back_at = time.monotonic() + delay

    def _backing_off(self) -> bool:
        """Every run still served waits for its queue."""
        now = time.monotonic()
        return all(now < k.back_at for k in self.links if k.over is None)

    def _fill(self, max_batches: int | None) -> None:
        """Claim leases while the engine has room for one more; long-poll only when idle.
        Serving one run, a claim asks for as many leases as there is room for; serving
        several, one lease at a time from the run furthest below its share."""
        several = len(self.links) > 1
        while not self.stopping.is_set() and (max_batches is None or self.batches_claimed < max_batches):
            room = self.max_num_seqs - self.engine.in_flight
            idle = not self.flights
            link = next(
                (
                    k
                    for k in claim_order(self.links, time.monotonic(), self.max_num_seqs)
                    if idle or room >= (k.lease_size or 1)
                ),
                None,
            )
            if link is None:
                if several and idle and any(k.over is None for k in self.links):
                    self._long_poll()
                return
            size = link.lease_size
            count = 1 if size is None or several else max(1, room // size)
            if max_batches is not None:
                count = min(count, max_batches - self.batches_claimed)
            if not self._claim(link, count, self.claim_block_s if idle and not several else 0.0) or not several:
                return

    def _find_runs(self) -> None:
        """Serve the runs added since the last look (a token given a run, on SIGHUP)."""
        if self.find_runs is None or time.monotonic() - self._runs_found_at < self.find_runs_every_s:
            return
        self._runs_found_at = time.monotonic()
        for link in self.find_runs({k.run for k in self.links if k.over is None}):
            log.info("serving run %s too (%d runs)", link.run, len(self.links) + 1)
            self.add_run(link)

    def _long_poll(self) -> None:
        """Serving several runs with nothing in flight and no backlog anywhere: wait on
        each run in turn, for a share of `claim_block_s`."""
        live = [k for k in self.links if k.over is None and time.monotonic() >= k.back_at]
        if not live:
            return
        link = live[self._rotation % len(live)]
        self._rotation += 1
        self._claim(link, 1, self.claim_block_s / len(live))

    def _claim(self, link: RunLink, count: int, block_s: float) -> bool:
        """Claim up to `count` leases of `link`'s run and queue their groups; True if any came."""
        started = time.monotonic()
        try:
            leases = link.queue.claim(self.worker_id, count, block_s=block_s)
        except RunOver as err:  # the learner finished: what is in flight is of no use to it
            self._run_ended(link, str(err))
            return False
        except QueueForbidden as err:  # a run taken from the token (or finished: patterns): the others go on
            if not self._can_end_one_run():
                raise
            self._run_ended(link, f"run {link.run}: {err}")
            return False
        except QueueUnavailable as err:
            self._unavailable(link, err)
            return False
        link.backoff.reset()
        self.metrics.lease_wait.observe(time.monotonic() - started)
        if len(self.links) > 1:
            share = link.queue.run_share()
            link.weight, link.cap = share.weight, share.cap
        if not leases and len(self.links) > 1:  # one run alone is asked again at its next chance
            link.empty_until = time.monotonic() + EMPTY_PAUSE_S
        for lease in leases:
            self._start(link, lease)
        return bool(leases)

    def _can_end_one_run(self) -> bool:
        """Whether a refusal of one run may end that run alone: other runs are served, or
        runs yet to start will be (`keep_serving`); else it is the worker's refusal."""
        return self.keep_serving or sum(k.over is None for k in self.links) > 1

    def _run_ended(self, link: RunLink, why: str) -> None:
        """The run's learner finished it: drop its leases; stop once every run has ended."""
        link.over = why
        if all(k.over is not None for k in self.links) and not self.keep_serving:
            self.run_over = why
            log.info("%s; stopping", why)
            self.stop()
            self.abort.set()
            return
        log.info("%s; %s", why, "serving the other runs" if any(k.over is None for k in self.links) else "waiting")
        for key in [k for k, f in self.flights.items() if f.link is link]:
            self._forget(key)

    def _cannot_serve(self, link: RunLink, lease: Lease) -> str | None:
        """Why this worker cannot generate the lease's batch (None: it can)."""
        batch = lease.batch
        if self.fingerprint is not None and batch.model is not None and batch.model != self.fingerprint:
            return (
                f"run {link.run} trains another base model (fingerprint {batch.model}; this worker's --model has "
                f"{self.fingerprint}): start it with the learner's --model"
            )
        if batch.scoring == "actors" and self.scorer is None:
            return (
                f"batch {batch.batch_id} is to be scored by the actors (the learner runs --scoring actors): "
                "start this worker with --reward"
            )
        if batch.tools:
            box = self.engine.toolbox if isinstance(self.engine, EpisodeEngine) else None
            missing = [t for t in batch.tools if box is None or t not in box.names]
            has = box.environment_name if box is not None else None
            if missing or has != batch.environment:
                of = f" of the environment {batch.environment}" if batch.environment else ""
                lacks = f"lacks {', '.join(missing)}" if missing else f"has the environment {has}"
                return (
                    f"batch {batch.batch_id} runs episodes with the tools {', '.join(batch.tools)}{of}; "
                    f"this worker {lacks}: start it with the learner's --tools and --environment"
                )
        return None

    def _start(self, link: RunLink, lease: Lease) -> None:
        batch = lease.batch
        why = self._cannot_serve(link, lease)
        if why is not None:  # handed back at once, for a worker that can
            link.queue.release(self.worker_id, lease.lease_id)
            if self._can_end_one_run():  # this run alone: the others go on
                self._run_ended(link, f"run {link.run} not served: {why}")
                return
            raise WorkerRefused(why)
        prompts = [self.engine.prompt_ids(p) for p in batch.prompts]
        # from choosing the version until the engine's queue names it, the watcher neither
        # installs nor evicts (a newer version arriving meanwhile would evict a pinned one)
        watcher = link.watcher
        with watcher.holding():
            version = watcher.current if batch.pinned_version is None else batch.pinned_version
            if batch.pinned_version is not None and not watcher.ensure(version):
                # an evaluation of a version this worker cannot load: let the lease expire, so
                # that it is tried elsewhere and, failing that, dead-lettered and counted
                log.error("lease %s: cannot load adapter v%d for its evaluation; leaving it", lease.lease_id, version)
                self._error(f"cannot load adapter v{version} for an evaluation")
                self.batches_claimed += 1
                return
            seed = batch.sampling.seed
            groups = [
                GroupRequest(
                    (link.run, lease.lease_id, i),
                    prompt,
                    batch.num_generations,
                    batch.sampling,
                    version,
                    None if seed is None else seed + i * batch.num_generations,
                    columns=batch.prompts[i].columns if batch.tools else None,
                    follow=link.engine.newest_version if self.follows(batch) else None,
                )
                for i, prompt in enumerate(prompts)
            ]
            link.engine.add(
                [episode_request(g, batch.max_tool_calling_iterations) for g in groups] if batch.tools else groups
            )
        flight = Flight(lease, link, prompts, version, time.monotonic(), waiting=set(range(len(prompts))))
        self.flights[(link.run, lease.lease_id)] = flight
        assert link.heartbeat is not None
        link.heartbeat.hold(lease.lease_id)
        self.batches_claimed += 1
        link.lease_size = len(prompts) * batch.num_generations
        link.in_flight += link.lease_size
        link.claimed(link.lease_size, time.monotonic())
