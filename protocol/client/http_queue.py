"""The queue over HTTPS, through `proxy serve`: the same `Queue` as Redis direct.

Every request goes through urllib3 (keep-alive, timeouts, the environment's HTTP proxy;
`protocol.client.transport`): the API's calls, the event stream
(`protocol.client.events`) and adapter files. Connection errors, 429 and 503
are retried with capped exponential backoff (honouring Retry-After) for up to `retry_s`;
after that the call raises `QueueUnavailable`, like the Redis transport, and the
caller's own backoff takes over. Every route is idempotent or safe to repeat (groups and batches are stored
by id; a claim whose answer was lost leaves a lease that expires and is claimed again),
except reading rollouts, whose lost answers are recovered from the pending list on the
next read, as the Redis transport does.

Refusals are not retried: a 4xx raises at once (401/403 as `QueueForbidden`, a
refused submission as what the proxy's queue raised, by the error's `code`), and so
does a certificate that does not verify (`QueueTLSError`): both are configuration
errors, not outages. `stop_retrying()` makes every later call fail fast and wakes a
call sleeping between attempts, so a worker on its way out exits in seconds.

Adapter announcements arrive as server-sent events (`subscribe_adapters`), resumed
with Last-Event-ID after a dropped connection; adapter files come from presigned URLs
(no bucket credentials needed) or the proxy itself (`adapter_download`, then
`fetch_adapter_file` per file).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import ssl
import threading
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

import urllib3
import urllib3.exceptions

from protocol.client import api
from protocol.client.api import Endpoint, Resp
from protocol.client.events import READ_TIMEOUT_S, SseSubscription
from protocol.client.http import (
    CHUNK_ITEMS,
    CONTENT_TYPE,
    RUN_HEADER,
    AckRequest,
    AdapterDownload,
    AddPromptsRequest,
    AnnounceRequest,
    ClaimRequest,
    ExpireRunRequest,
    ForgetLiftedRequest,
    HeartbeatRequest,
    LeaveRequest,
    LiftRequest,
    QuarantineRequest,
    ReadRolloutsRequest,
    RecordAuditsRequest,
    ReleaseRequest,
    ReportStatusRequest,
    RunOverRequest,
    RunRewardsRequest,
    RunShareRequest,
    SubmitRequest,
    WhoAmIResponse,
    WorkersResponse,
    decode_body,
    encode_body,
)
from protocol.client.queue import (
    AdapterEvent,
    AdapterSubscription,
    AuditTally,
    DeadLetter,
    Delivery,
    FinishedBatch,
    Lease,
    Queue,
    QueueConfig,
    QueueStats,
    SubmitResult,
)
from protocol.client.transport import (
    Transient,
    environment_proxy,
    error_text,
    pool_manager,
    retry_after,
    tls_context,
    tls_failure,
)
from protocol.util.retry import retry
from protocol.wire.errors import (
    QueueError,
    QueueForbidden,
    QueueNotFound,
    QueueTLSError,
    QueueUnavailable,
    from_response,
)
from protocol.wire.files import StoreError, StoreMissing
from protocol.wire.messages import AdapterManifest, PromptBatch, RolloutGroup, RunShare, WorkerStatus
from protocol.wire.text import printable

log = logging.getLogger(__name__)


__all__ = ["HttpQueue", "QueueForbidden", "QueueNotFound"]


class HttpQueue(Queue):
    def __init__(
        self,
        url: str,
        token: str,
        config: QueueConfig | None = None,
        *,
        verify: str | bool | ssl.SSLContext | None = None,
        retry_s: float = 30.0,
        timeout_s: float = 30.0,
        stop: threading.Event | None = None,
    ) -> None:
        """`stop`: an event that, once set, has every call fail fast (see `stop_retrying`);
        a process passes its shutdown event so that SIGTERM also ends a retrying call."""
        if not token:
            raise ValueError("an https:// queue needs a token (--token or SPOTGRPO_TOKEN)")
        self.config = config or QueueConfig()
        self.url = url.rstrip("/")
        self.retry_s = retry_s
        if verify is None:  # a private CA or a self-signed proxy certificate
            verify = os.environ.get("SPOTGRPO_CA_CERT") or True
        self._verify = tls_context(verify)
        self._auth_headers = {"Authorization": f"Bearer {token}", "Accept": CONTENT_TYPE}
        proxy = environment_proxy(self.url)
        self._pools = pool_manager(self._verify, proxy, read_s=timeout_s + self.config.max_block_s)
        self.pool = self._pools.connection_from_url(self.url)
        """Every byte of every API call (`_call`) goes through it (the manager's own `urlopen`
        would parse each call's URL again)."""
        self._absolute = proxy is not None and self.url.startswith("http://")
        """Plain HTTP through a proxy: it is sent the absolute URL (HTTPS goes through a tunnel)."""
        self._file_pools: dict[str | None, urllib3.PoolManager] = {}
        """For presigned adapter URLs (the store's host, not the proxy's), by the HTTP proxy
        the environment names for each."""
        self._headers: dict[str, str] = {}
        self._body_headers: dict[str, str] = {}
        self._name_run(self.config.run)
        self.retried = False
        """Whether the last call needed more than one attempt."""
        self._received: dict[str, set[str]] = {}
        self._resync: set[str] = set()
        self._subscriptions: list[SseSubscription] = []
        self._stopping = stop or threading.Event()
        self._share = RunShare()
        """The run's share as the last claim's answer carried it."""
        self._owns_pools = True
        self.identity: WhoAmIResponse | None = None
        """The last `whoami` answer (`connect_queue` asks first: `confirm_identity` reads it)."""

    def stop_retrying(self) -> None:
        self._stopping.set()

    def for_run(self, run: str) -> HttpQueue:
        """The same proxy, token and connections, for another run the token may touch (a
        worker serving several runs: `actors.runs`). Closing it leaves the connections to
        the queue it came from."""
        other = copy.copy(self)
        other.config = dataclasses.replace(self.config, run=run)
        other._name_run(run)
        other._received, other._resync, other._subscriptions = {}, set(), []
        other._share, other._owns_pools, other.identity = RunShare(), False, None
        return other

    def _name_run(self, run: str) -> None:
        """Every call names `run` (`RUN_HEADER`), but for the run named "default", the name a
        client that was told none has: it gets the token's run, as the proxy decides (a
        proxy's `--run`, where the token names no runs: what every client got before a
        proxy served several)."""
        named = {} if run == QueueConfig.run else {RUN_HEADER: run}
        self._headers = {**self._auth_headers, **named}
        self._body_headers = {**self._headers, "Content-Type": CONTENT_TYPE}

    # ------------------------------------------------------------------ plumbing
    def _call(
        self,
        endpoint: Endpoint[Any, Resp],
        body: Any = None,
        params: dict[str, Any] | None = None,
        **path_params: object,
    ) -> Resp:
        """One call of `endpoint` (`protocol.client.api`), retried through outages; its response body."""
        method, path, response = endpoint.method, endpoint.url(**path_params), endpoint.response
        content = encode_body(body) if body is not None else None
        headers = self._headers if content is None else self._body_headers
        self.retried = False

        target = (self.url if self._absolute else "") + path + (f"?{urllib.parse.urlencode(params)}" if params else "")

        def attempt() -> Any:
            # urllib3's pool, not httpx: httpx's request and response machinery cost an actor
            # ~0.4-0.5 ms of CPU a call on 2 cores, where the TLS socket alone takes 24 us
            # (bench/proxy.py's clients: 0.68-0.77 -> 0.41-0.47 ms a group with urllib3).
            try:
                r = self.pool.urlopen(
                    method, target, body=content, headers=headers, redirect=False, assert_same_host=False
                )
            except urllib3.exceptions.HTTPError as err:
                if (bad := tls_failure(err)) is not None:
                    raise QueueTLSError(
                        f"{self.url}: the certificate does not verify ({bad.verify_message}); "
                        "give the proxy's CA with SPOTGRPO_CA_CERT"
                    ) from None
                raise Transient(f"{type(err).__name__}: {err}") from None
            if r.status == 200:
                assert response is not None, f"{path} answers no MessagePack body"
                return decode_body(r.data, response)
            code, message = error_text(r.data)
            if r.status in (429, 502, 503, 504):
                raise Transient(f"{r.status} {message}", retry_after(r.headers.get("retry-after")))
            raise from_response(r.status, code, message, path)

        def before_wait(err: BaseException, delay: float) -> None:
            log.debug("%s %s: %s; retrying in %.2fs", method, path, err, delay)
            self.retried = True

        try:
            answer: Resp = retry(
                attempt,
                on=(Transient,),
                deadline_s=self.retry_s,
                first=0.25,
                cap=5.0,
                stop=self._stopping,
                delay_of=lambda err, delay: err.wait if err.wait is not None else delay,  # type: ignore[attr-defined]
                before_wait=before_wait,
            )
            return answer
        except Transient as err:
            raise QueueUnavailable(
                f"{self.url}{path}: {err}" + (" (stopping)" if self._stopping.is_set() else "")
            ) from None

    # -------------------------------------------------------------------- prompts
    def add_prompts(self, batches: Sequence[PromptBatch]) -> int:
        # a fleet's worth at once is several calls (each batch is stored once by its id)
        return sum(
            self._call(api.ADD_PROMPTS, AddPromptsRequest(batches=list(batches[i : i + CHUNK_ITEMS]))).added
            for i in range(0, len(batches), CHUNK_ITEMS)
        )

    def claim(self, worker: str, count: int = 1, block_s: float = 0.0) -> list[Lease]:
        answer = self._call(api.CLAIM, ClaimRequest(worker=worker, count=count, block_s=block_s))
        if answer.share is not None:
            self._share = answer.share
        return answer.leases

    def run_share(self) -> RunShare:
        return self._share

    def heartbeat(self, worker: str, lease_ids: Sequence[str]) -> list[str]:
        body = HeartbeatRequest(worker=worker, lease_ids=list(lease_ids))
        return self._call(api.HEARTBEAT, body).lease_ids

    def submit(self, worker: str, lease_id: str, groups: Sequence[RolloutGroup]) -> SubmitResult:
        body = SubmitRequest(worker=worker, lease_id=lease_id, groups=list(groups))
        return self._call(api.SUBMIT, body).result

    def release(self, worker: str, lease_id: str) -> bool:
        body = ReleaseRequest(worker=worker, lease_id=lease_id)
        return self._call(api.RELEASE, body).released

    # ------------------------------------------------------------------- rollouts
    def read_rollouts(self, consumer: str, count: int, block_s: float = 0.0) -> list[Delivery]:
        received = self._received.setdefault(consumer, set())
        if consumer in self._resync:  # an earlier answer may have been lost on the way
            missed, after = [], "0"
            while page := self._pending(consumer, CHUNK_ITEMS, after):  # all of it: the newest are the likeliest lost
                missed += [d for d in page if d.delivery_id not in received]
                after = page[-1].delivery_id
            if len(missed) <= count:
                self._resync.discard(consumer)
            if missed:
                received.update(d.delivery_id for d in missed[:count])
                return missed[:count]
        body = ReadRolloutsRequest(consumer=consumer, count=count, block_s=block_s)
        try:
            deliveries = self._call(api.READ_ROLLOUTS, body).deliveries
        except QueueUnavailable:
            self._resync.add(consumer)
            raise
        if self.retried:  # an earlier attempt may have been served and its answer lost
            self._resync.add(consumer)
        received.update(d.delivery_id for d in deliveries)
        return deliveries

    def pending_rollouts(self, consumer: str, count: int, after: str = "0") -> list[Delivery]:
        """The consumer's pending groups; from now on received here, so that a read that
        recovers a lost answer (`read_rollouts`) does not hand them out a second time."""
        deliveries = self._pending(consumer, count, after)
        self._received.setdefault(consumer, set()).update(d.delivery_id for d in deliveries)
        return deliveries

    def _pending(self, consumer: str, count: int, after: str) -> list[Delivery]:
        body = ReadRolloutsRequest(consumer=consumer, count=count, pending=True, after=after)
        return self._call(api.READ_ROLLOUTS, body).deliveries

    def ack_rollouts(self, delivery_ids: Sequence[str], finished: Sequence[FinishedBatch] = ()) -> int:
        ids, batches = list(delivery_ids), list(finished)
        acked = 0
        for i in range(0, max(len(ids), len(batches)), CHUNK_ITEMS):
            chunk = ids[i : i + CHUNK_ITEMS]
            body = AckRequest(delivery_ids=chunk, finished=batches[i : i + CHUNK_ITEMS])
            acked += self._call(api.ACK, body).acked
            for received in self._received.values():
                received.difference_update(chunk)
        return acked

    def dead_letters(self, after: str = "0", count: int = 100) -> list[DeadLetter]:
        return self._call(api.DEAD_LETTERS, params={"after": after, "count": count}).entries

    # ------------------------------------------------------------------- adapters
    def announce(self, manifest: AdapterManifest) -> str:
        return self._call(api.ANNOUNCE, AnnounceRequest(manifest=manifest)).event_id

    def latest_adapter(self) -> AdapterManifest | None:
        return self._call(api.LATEST_ADAPTER).manifest

    def adapter_events(self, after: str = "0", count: int = 100, block_s: float = 0.0) -> list[AdapterEvent]:
        params = {"after": after, "count": count, "block_ms": int(block_s * 1000)}
        return self._call(api.ADAPTER_HISTORY, params=params).events

    def subscribe_adapters(self) -> AdapterSubscription:
        target = (self.url if self._absolute else "") + api.ADAPTER_EVENTS.path

        def open_stream(headers: dict[str, str]) -> urllib3.BaseHTTPResponse:
            return self.pool.urlopen(
                "GET",
                target,
                headers={**self._headers, **headers},
                preload_content=False,
                redirect=False,
                assert_same_host=False,
                timeout=urllib3.Timeout(connect=10.0, read=READ_TIMEOUT_S),
            )

        sub = SseSubscription(open_stream)
        self._subscriptions.append(sub)
        return sub

    def adapter_download(self, version: int) -> AdapterDownload:
        """The manifest of adapter `version` and a URL per file (presigned, or the proxy's
        own). Raises StoreMissing for a version that does not exist, else StoreError."""
        try:
            return self._call(api.ADAPTER_DOWNLOAD, version=version)
        except QueueNotFound as err:
            raise StoreMissing(f"adapter v{version}: {err}") from None
        except QueueError as err:
            raise StoreError(f"adapter v{version}: {err}") from err

    def fetch_adapter_file(self, download: AdapterDownload, name: str) -> bytes:
        """One file of `download`'s adapter; no proxy token goes to a presigned URL."""
        version = download.manifest.version
        url = download.urls.get(name)
        if url is None:
            raise StoreMissing(f"adapter v{version} has no file {name}")
        try:
            if download.proxied and url.startswith("/"):
                target = (self.url if self._absolute else "") + url
                r = self.pool.urlopen("GET", target, headers=self._headers, redirect=False, assert_same_host=False)
            else:
                r = self._files_for(url).request("GET", url, redirect=False, timeout=60.0)
        except urllib3.exceptions.HTTPError as err:
            raise StoreError(f"adapter v{version}/{name}: {err}") from err
        if r.status == 404:
            raise StoreMissing(f"adapter v{version}/{name}: 404")
        if r.status != 200:
            raise StoreError(f"adapter v{version}/{name}: HTTP {r.status}")
        return r.data

    def _files_for(self, url: str) -> urllib3.PoolManager:
        """The pools for a presigned URL: no token goes there, and the environment's HTTP
        proxy for its host (NO_PROXY may name the store and not the proxy)."""
        proxy = environment_proxy(url)
        if proxy not in self._file_pools:
            self._file_pools[proxy] = pool_manager(self._verify, proxy, read_s=60.0)
        return self._file_pools[proxy]

    def expire_run(self, ttl_s: float) -> int:
        return self._call(api.EXPIRE_RUN, ExpireRunRequest(ttl_s=ttl_s)).keys

    def set_run_over(self, why: str) -> None:
        self._call(api.RUN_OVER, RunOverRequest(why=why))

    def set_run_rewards(self, specs: Sequence[str]) -> None:
        self._call(api.RUN_REWARDS, RunRewardsRequest(specs=list(specs)))

    def set_run_share(self, share: RunShare) -> None:
        self._call(api.RUN_SHARE, RunShareRequest(share=share))

    # ------------------------------------------------------------------- fleet
    def report_status(self, status: WorkerStatus) -> None:
        self._call(api.REPORT_STATUS, ReportStatusRequest(status=status))

    def leave(self, worker: str) -> bool:
        return self._call(api.LEAVE, LeaveRequest(worker=worker)).left

    def workers(self, max_age_s: float = 120.0) -> list[WorkerStatus]:
        """The proxy lists at most 500, those furthest behind first."""
        return self.fleet(max_age_s).workers

    def fleet(self, max_age_s: float = 120.0, limit: int = 500) -> WorkersResponse:
        """`GET /v1/workers` whole: the statuses, and the learner's verdicts (quarantine, audits)."""
        return self._call(api.WORKERS, params={"max_age_s": max(1, round(max_age_s)), "limit": limit})

    # ------------------------------------------------------------- quarantine
    def quarantine(self, worker: str, reason: str) -> None:
        self._call(api.QUARANTINE, QuarantineRequest(worker=worker, reason=printable(reason, 500) or "-"))

    def quarantined(self) -> dict[str, str]:
        return dict(self._call(api.QUARANTINED).workers)

    def lift_quarantine(self, worker: str) -> bool:
        return self._call(api.LIFT_QUARANTINE, LiftRequest(worker=worker)).lifted

    def forget_lifted(self, workers: Sequence[str]) -> None:
        if workers:
            self._call(api.FORGET_LIFTED, ForgetLiftedRequest(workers=list(workers)))

    def record_audits(self, tallies: Mapping[str, AuditTally]) -> None:
        items = list(tallies.items())
        for i in range(0, len(items), CHUNK_ITEMS):
            self._call(api.RECORD_AUDITS, RecordAuditsRequest(workers=dict(items[i : i + CHUNK_ITEMS])))

    def audits(self) -> dict[str, AuditTally]:
        return dict(self._call(api.AUDITS).workers)

    def whoami(self) -> WhoAmIResponse:
        """The token's name and role, and the run this queue's calls are for, which becomes
        `config.run` where the token may touch it (a queue of the run named "default" names
        none: it gets the token's; a token of several runs keeps naming none, and `for_run`
        gives a queue of each).
        Adopts the proxy's lease timeout into `config`: that one counts, so a heartbeat (a
        third of it) follows it."""
        who = self.identity = self._call(api.WHOAMI)
        changes: dict[str, Any] = {}
        if who.lease_timeout_s is not None and who.lease_timeout_s != self.config.lease_timeout_s:
            changes["lease_timeout_s"] = who.lease_timeout_s
        if who.run and who.run != self.config.run and (not who.runs or who.run in who.runs):
            changes["run"] = who.run
        if changes:
            self.config = dataclasses.replace(self.config, **changes)
            self._name_run(self.config.run)
        return who

    # ------------------------------------------------------------------- everyone
    def stats(self) -> QueueStats:
        return self._call(api.STATS).stats

    def close(self) -> None:
        for sub in self._subscriptions:
            sub.close()
        if not self._owns_pools:
            return
        self._pools.clear()
        for pools in self._file_pools.values():
            pools.clear()


def confirm_identity(queue: object, role: str, run: str | None, what: str) -> str:
    """Through a proxy, before anything costly: the token must have `role` and may touch
    `run` (None: the token's run, which the queue then names in every call; `what`: who
    needs it, for the message). Returns the run. Raises ValueError with what to change,
    or QueueForbidden. Any other queue is the caller's to trust."""
    if not isinstance(queue, HttpQueue):
        return run or "default"
    who = queue.identity or queue.whoami()  # QueueForbidden: a token that may not touch the run named
    if who.role != role:
        raise ValueError(
            f"the token {who.name!r} has role {who.role}; {what} needs a token with role {role} "
            "(--token or SPOTGRPO_TOKEN)"
        )
    if run is not None and run != who.run:
        raise ValueError(
            f"--run {run}: the proxy serves run {who.run!r}; give --run {who.run} (or leave --run out), "
            "or point --queue at the proxy of run " + repr(run)
        )
    return who.run
