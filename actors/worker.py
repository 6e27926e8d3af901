"""The work loop of one rollout worker, shaped like rq's `Worker.work()`: one loop, many
leases in flight.

    claim leases while the engine has room -> queue each prompt's group on the engine
    with the newest adapter -> step the engine -> score each finished group beside it ->
    submit each scored group at once (a lease's groups in several calls; the last one
    finishes the lease) -> one heartbeat call for every lease held

The engine is kept at its sequence limit (`Engine.max_num_seqs`, counting a lease as its
prompts x `num_generations`), whatever the batch size: a lease's groups are queued as
soon as it is claimed and new leases are claimed as groups finish. Each group is
started on the newest adapter version when the engine takes it up, and goes on with a
newer one loaded while it generates (in-flight updates, `actors.engine`): each token is
tagged with its version, and the group with the oldest. Rewards run beside the engine (`ScoringPool`).

Connection errors back off exponentially (capped) while the engine keeps generating
what it has; finished groups wait and are submitted when the queue is back. A
submission the queue refuses (the lease passed to another worker while this one was
away, or the groups do not answer it) is dropped with a warning: the lease's holder
does the batch, and the queue stores each group once whoever submits it. A refusal of
the worker itself (a bad token, a role without the right, a certificate that does not
verify) ends the loop with `WorkerRefused`, and an engine that dies ends it with
`WorkerEngineDead`, after handing back every lease held.

A run its learner finished refuses claims (`RunOver`): the worker stops at once, handing
back what it holds, and exits 0.

A worker may serve several runs on one engine (`actors.runs`): each run has its own queue,
adapter watcher and heartbeat (a `RunLink`), and leases are claimed from the run furthest
below its weighted share. A run that ends stops that run's claims alone; the worker
stops when every run it serves has ended.

Shutdown (SIGTERM, a spot notice): stop claiming; leases in hand may finish within
`grace_s`, after which generation is aborted and every unfinished lease is handed back,
so other workers take them at once; what is finished is submitted within the rest of
the grace period (at least a second); exit 0. Whatever ends the loop, the worker's last
call takes its status out of the fleet view (`Queue.leave`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import cast

from actors.claims import Claims, WorkerEngineDead, WorkerRefused
from actors.engine import Engine, EngineDead, Sample
from actors.flights import Flight, rollout_group
from actors.heartbeat import Heartbeat, heartbeat_period_s
from actors.metrics import WorkerMetrics
from actors.rewards import Scoring
from actors.runs import RunEngine, RunLink, shares
from actors.watcher import AdapterWatcher
from protocol import (
    Queue,
    QueueError,
    QueueForbidden,
    QueueRefused,
    QueueTLSError,
    QueueUnavailable,
    RolloutGroup,
    WorkerStatus,
)
from protocol.usercode.rewards import Scores, group_tool_mask, unscored
from protocol.util.retry import Backoff
from protocol.wire.text import printable

log = logging.getLogger(__name__)

STEP_S = 0.05
"""How long one turn of the work loop steps the engine (then submits and claims)."""
SCORING_STEP_S = 0.005
"""The turn while groups are being scored: one engine iteration (on vLLM about a token), so
that a group is submitted as soon as its score is in. Waiting out `STEP_S` instead kept a
lease's last group a median 71 ms from its submission in `bench/vs_trl.py`, against 27."""

__all__ = ["Scoring", "Worker", "WorkerEngineDead", "WorkerRefused"]  # the claiming half lives in actors.claims


class Worker(Claims):
    def __init__(
        self,
        queue: Queue,
        engine: Engine,
        watcher: AdapterWatcher,
        scorer: Scoring | None,
        worker_id: str,
        *,
        claim_block_s: float = 5.0,
        grace_s: float = 0.0,
        max_backoff_s: float = 30.0,
        max_num_seqs: int | None = None,
        metrics: WorkerMetrics | None = None,
        report_every_s: float = 10.0,
        more_runs: Sequence[RunLink] = (),
        fingerprint: str | None = None,
        find_runs: Callable[[set[str]], list[RunLink]] | None = None,
        find_runs_every_s: float = 60.0,
        keep_serving: bool = False,
        in_flight_updates: bool = True,
    ) -> None:
        """`queue`, `watcher`: the first run's; `more_runs`: the other runs served on the same
        `engine`. Each run's groups are queued where its watcher loads its adapters (its
        `RunEngine`, or `engine` itself for a worker of one run). `fingerprint`: the
        engine's base model (`model_fingerprint`); a batch for another is refused.
        `find_runs`: every `find_runs_every_s`, the runs to serve that are not among those
        named (runs added while the worker serves). `keep_serving`: when every run served
        has ended, wait for the next (a token whose run patterns match runs yet to start)
        rather than stop. `in_flight_updates`: unpinned groups follow the newest adapter
        (`GroupRequest.follow`); False: each on the version it started with."""
        self.queue, self.engine, self.watcher, self.scorer = queue, engine, watcher, scorer
        self.worker_id = worker_id
        self.claim_block_s = claim_block_s
        self.grace_s = grace_s
        self.max_backoff_s = max_backoff_s
        self.max_num_seqs = max_num_seqs or engine.max_num_seqs
        """Sequences kept in the engine; leases are claimed while there is room for one more."""
        self.metrics = metrics or WorkerMetrics()
        self.report_every_s = report_every_s
        self.in_flight_updates = in_flight_updates
        first = RunLink(queue.config.run, queue, watcher, watcher.engine)  # its RunEngine, or `engine` itself
        self.links: list[RunLink] = []
        self._beating = False
        for link in (first, *more_runs):
            self.add_run(link)
        self.last_error: str | None = None
        """The latest refusal or error, one line, for the status report."""
        self.tokens_generated = 0
        self.groups_submitted = 0
        self._refusal_seen: dict[str, int] = {}
        self.stopping = threading.Event()
        self.abort = threading.Event()
        """Set when the grace period is over: the engine drops what it generates."""
        self.flights: dict[tuple[str, str], Flight] = {}
        """By (run, lease id): lease ids are unique within a run only."""
        self.scoring: dict[tuple[str, str, int], Future[Scores]] = {}
        self.samples: dict[tuple[str, str, int], tuple[list[Sample], list[str]]] = {}
        """Generated groups being scored (by run, lease id, prompt): their samples and decoded texts."""
        self.batches_claimed = 0
        self.batches_done = 0
        self._rotation = 0
        """Serving several runs, idle: the run the next long-poll waits on, in turn."""
        self.run_over: str | None = None
        """The learner's last word once it finished the run, or every run served (`RunOver`):
        the worker stops, exit 0."""
        self.fingerprint = fingerprint
        self.find_runs, self.find_runs_every_s = find_runs, find_runs_every_s
        self.keep_serving = keep_serving
        self._runs_found_at = time.monotonic()

    def add_run(self, link: RunLink) -> None:
        """Serve one more run (its watcher loading through its `RunEngine` on this engine), or
        a run that ended here and is started again (a learner resuming it)."""
        for old in [k for k in self.links if k.run == link.run and k.over is not None]:
            self.links.remove(old)
            if old.heartbeat is not None:
                old.heartbeat.close()
            old.watcher.close()
        link.heartbeat = Heartbeat(
            link.queue,
            self.worker_id,
            heartbeat_period_s(link.queue.config.lease_timeout_s),
            status=lambda: self.status(link),
            report_every_s=self.report_every_s,
        )
        link.backoff = Backoff(0.5, self.max_backoff_s)
        self.links.append(link)
        if self._beating:
            link.heartbeat.start()

    @property
    def heartbeat(self) -> Heartbeat:
        """The first run's heartbeat."""
        beat = self.links[0].heartbeat
        assert beat is not None
        return beat

    # ----------------------------------------------------------------- status
    def status(self, link: RunLink | None = None) -> WorkerStatus:
        """What `link`'s run's fleet view shows of this worker (called from the heartbeat
        thread; None: the first run)."""
        link = link or self.links[0]
        now, tokens = time.monotonic(), link.tokens_generated
        then, before = link.rate_mark
        link.rate_mark = (now, tokens)
        refused = dict(link.watcher.refused)
        if refused and max(refused) > self._refusal_seen.get(link.run, 0):
            seen = self._refusal_seen[link.run] = max(refused)
            self._error(f"adapter v{seen} refused: {refused[seen]}")
        return WorkerStatus(
            worker=self.worker_id,
            engine=type(self.engine).__name__[:64],
            adapter_version=max(0, link.watcher.current),
            leases=sum(1 for f in list(self.flights.values()) if f.link is link),
            groups_done=link.groups_submitted,
            tokens_per_s=(tokens - before) / max(now - then, 1e-3),
            adapters_refused=len(link.watcher.refused),
            last_error=self.last_error,
            reported_at=time.time(),
            share=shares(self.links, now).get(link.run, 0.0) if len(self.links) > 1 else None,
        )

    def _error(self, text: str) -> None:
        self.last_error = printable(text, 500)

    # ----------------------------------------------------------------- control
    def stop(self) -> None:
        """Stop claiming; abort what is in flight once `grace_s` has passed. Queue calls
        stop retrying through outages, so the way out takes seconds, not minutes."""
        if self.stopping.is_set():
            return
        self.stopping.set()
        for link in self.links:
            link.queue.stop_retrying()
        timer = threading.Timer(self.grace_s, self.abort.set)
        timer.daemon = True
        timer.start()

    # -------------------------------------------------------------------- loop
    def work(self, max_batches: int | None = None) -> int:
        """Run until stopped (or `max_batches` leases are done); returns the exit status."""
        for link in self.links:
            assert link.heartbeat is not None
            link.heartbeat.start()
        self._beating = True
        try:
            while True:
                if self.abort.is_set():
                    self._abandon_in_flight()
                if not self.flights and (
                    self.stopping.is_set() or (max_batches is not None and self.batches_claimed >= max_batches)
                ):
                    break
                self._queue_calls(max_batches)
                if self.engine.in_flight:
                    self._advance(SCORING_STEP_S if self.scoring else STEP_S)
                elif self.scoring:  # nothing to generate: on as soon as a score is in
                    wait(list(self.scoring.values()), timeout=STEP_S, return_when=FIRST_COMPLETED)
                    self._advance(0.0)
                elif self.flights or self._backing_off():
                    self.abort.wait(STEP_S)  # groups wait for the queue: do not spin (abort ends the wait)
        except (QueueForbidden, QueueTLSError) as err:
            self._hand_back_all()
            raise WorkerRefused(str(err)) from None
        except WorkerRefused:
            self._hand_back_all()
            raise
        except EngineDead as err:
            self._hand_back_all()
            raise WorkerEngineDead(str(err)) from None
        finally:
            for link in self.links:
                assert link.heartbeat is not None
                link.heartbeat.close()
                self._leave(link)
        return 0

    def _leave(self, link: RunLink) -> None:
        """Leave the run's fleet view now: a departed worker would be listed (and count
        against its token's live workers) until its status aged out."""
        try:
            link.queue.leave(self.worker_id)
        except QueueError as err:
            log.info("could not say goodbye to run %s (the status ages out instead): %s", link.run, err)

    def _queue_calls(self, max_batches: int | None) -> None:
        """Submit what is ready, then claim while there is room. A run whose queue is
        unavailable (an outage; its backlog full) defers its own calls, not the others'."""
        self._find_runs()
        for link in self.links:
            if time.monotonic() < link.back_at:
                continue
            try:
                self._submit_ready(link)
            except QueueUnavailable as err:
                self._unavailable(link, err)
        if not self.stopping.is_set() and (max_batches is None or self.batches_claimed < max_batches):
            self._fill(max_batches)

    def _advance(self, timeout_s: float) -> None:
        """Step the engine; send finished groups to scoring; collect finished scores."""
        for key, samples in self.engine.step(timeout_s, self.abort):
            key = cast(tuple[str, str, int], key)  # the keys this worker gave the engine
            run, lease_id, i = key
            flight = self.flights.get((run, lease_id))
            if flight is None:
                continue
            if isinstance(flight.link.engine, RunEngine):
                samples = flight.link.engine.own(samples)  # versions in the run's own numbers
            prompt = flight.lease.batch.prompts[i]
            texts = [self.engine.decode(s.token_ids) for s in samples]
            self.samples[key] = samples, texts
            if flight.lease.batch.scoring == "trusted" or self.scorer is None:
                # scored on the trusted side; whatever reward this worker sent would be ignored
                self.scoring[key] = unscored(len(samples))
            else:
                ids = [s.token_ids for s in samples]
                prompt_text = self.engine.decode(flight.prompt_ids[i])
                mask = group_tool_mask([s.mask for s in samples], ids)
                self.scoring[key] = self.scorer.submit((prompt, prompt_text, texts, ids, mask))
        self._collect_scores()
        for link in self.links:
            assert link.heartbeat is not None
            for lease_id in link.heartbeat.take_lost():
                if (link.run, lease_id) in self.flights:
                    self.flights[(link.run, lease_id)].lost = True
                    log.warning("lease %s passed to another worker; its groups will not be sent", lease_id)

    def _collect_scores(self) -> None:
        """Scored groups become ready to submit."""
        for key in [k for k, f in self.scoring.items() if f.done()]:
            scores = self.scoring.pop(key).result()
            samples, texts = self.samples.pop(key)
            flight = self.flights.get(key[:2])
            if flight is not None:
                flight.ready.append(self._group(flight, key[2], samples, texts, scores))
                flight.waiting.discard(key[2])

    def _group(self, flight: Flight, i: int, samples: list[Sample], texts: list[str], scores: Scores) -> RolloutGroup:
        if scores.error is not None:
            batch = flight.lease.batch
            self.metrics.reward_errors.inc()
            log.warning("batch %s prompt %s: %s", batch.batch_id, batch.prompts[i].id, scores.error)
            self._error(f"reward: {scores.error}")
        model_tokens = sum(len(s.token_ids) if s.mask is None else sum(s.mask) for s in samples)
        self.metrics.tokens.inc(model_tokens)
        self.tokens_generated += model_tokens
        flight.link.tokens_generated += model_tokens
        return rollout_group(flight, i, samples, texts, scores, self.worker_id)

    def _ready_to_send(self) -> bool:
        return any(f.ready for f in self.flights.values())

    def _submit_ready(self, link: RunLink | None = None) -> None:
        """One call per lease with groups ready (of `link`'s run; None: every run's): a
        partial submission unless it is the last."""
        for key, flight in list(self.flights.items()):
            if link is not None and flight.link is not link:
                continue
            lease_id = key[1]
            if flight.lost and not flight.waiting:
                self._forget(key)
                continue
            if not flight.ready or flight.lost:
                continue
            groups = list(flight.ready)
            try:
                result = flight.link.queue.submit(self.worker_id, lease_id, groups)
            except (QueueForbidden, QueueTLSError):
                raise
            except QueueRefused as err:  # not ours any more, or not an answer: the holder redoes it
                self.metrics.submissions_refused.inc()
                log.warning("lease %s: submission refused, dropping %d groups: %s", lease_id, len(groups), err)
                self._error(f"submission refused: {err}")
                flight.lost, flight.ready = True, []
                continue
            del flight.ready[: len(groups)]
            flight.link.backoff.reset()
            self.metrics.groups.inc(result.stored)
            self.groups_submitted += result.stored
            flight.link.groups_submitted += result.stored
            if not result.lease_held:
                log.info("lease %s was already finished; its %d groups were stored before", lease_id, result.duplicates)
            if flight.done:
                if not result.finished:
                    log.warning(
                        "lease %s: %d prompts still lack a group; it will expire and be redone",
                        lease_id,
                        result.missing,
                    )
                self.batches_done += 1
                self._forget(key)

    def _forget(self, key: tuple[str, str]) -> None:
        flight = self.flights.pop(key, None)
        if flight is None:
            return
        link = flight.link
        link.in_flight -= len(flight.prompt_ids) * flight.lease.batch.num_generations
        assert link.heartbeat is not None
        link.heartbeat.drop(key[1])

    # -------------------------------------------------------------- shutdown
    def _abandon_in_flight(self) -> None:
        """The grace period is over: drop generation, submit what is scored, hand back the rest."""
        self.engine.step(0.0, self.abort)  # drops everything queued or running
        self._collect_scores()
        self.scoring.clear()
        self.samples.clear()
        deadline = time.monotonic() + max(self.grace_s, 1.0)
        backoff = Backoff(first=0.2, cap=2.0)
        while self._ready_to_send() and time.monotonic() < deadline:
            try:
                self._submit_ready()
            except QueueUnavailable:
                time.sleep(min(backoff.failed(), max(0.0, deadline - time.monotonic())))  # not past the deadline
            except (QueueForbidden, QueueTLSError):
                break
        self._hand_back_all()

    def _hand_back_all(self) -> None:
        for key, flight in list(self.flights.items()):
            try:
                flight.link.queue.release(self.worker_id, key[1])
                log.info("handed lease %s of run %s back unfinished", key[1], key[0])
            except QueueError as err:  # it will expire and be claimed again
                log.warning("could not hand lease %s back (it will expire): %s", key[1], err)
            self._forget(key)
