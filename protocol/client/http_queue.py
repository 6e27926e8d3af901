"""The queue over HTTPS, through `proxy serve`: the same `Queue` as Redis direct.

The API's calls go through urllib3 (keep-alive, timeouts, the environment's HTTP proxy),
the event stream and proxied adapter files through httpx. Connection errors, 429 and 503
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

import base64
import contextlib
import logging
import os
import queue as stdqueue
import ssl
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import httpx
import urllib3
import urllib3.exceptions

from protocol.client import api
from protocol.client.api import Endpoint, Resp
from protocol.client.http import (
    CHUNK_ITEMS,
    CONTENT_TYPE,
    AckRequest,
    AdapterDownload,
    AddPromptsRequest,
    AnnounceRequest,
    ClaimRequest,
    ErrorResponse,
    ExpireRunRequest,
    ForgetLiftedRequest,
    HeartbeatRequest,
    LiftRequest,
    QuarantineRequest,
    ReadRolloutsRequest,
    RecordAuditsRequest,
    ReleaseRequest,
    ReportStatusRequest,
    RunOverRequest,
    RunRewardsRequest,
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
from protocol.util.retry import Backoff, retry
from protocol.wire.codec import decode
from protocol.wire.errors import (
    ProtocolError,
    QueueError,
    QueueForbidden,
    QueueNotFound,
    QueueTLSError,
    QueueUnavailable,
    from_response,
)
from protocol.wire.files import StoreError, StoreMissing
from protocol.wire.messages import AdapterManifest, PromptBatch, RolloutGroup, WorkerStatus
from protocol.wire.text import printable

log = logging.getLogger(__name__)


def wait_for_proxy(
    url: str, ca_file: str | None, proc: subprocess.Popen[bytes] | None = None, timeout_s: float = 60.0
) -> None:
    """Block until `proxy serve` at `url` answers /healthz with 200. Raises QueueUnavailable
    when it does not within `timeout_s`, or at once when its process `proc` has exited."""
    verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=ca_file) if ca_file else True
    deadline = time.monotonic() + timeout_s
    backoff = Backoff(first=0.05, cap=1.0)
    while True:
        try:
            if httpx.get(f"{url.rstrip('/')}/healthz", verify=verify, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if proc is not None and proc.poll() is not None:
            raise QueueUnavailable(f"the proxy for {url} exited with status {proc.returncode}")
        if time.monotonic() > deadline:
            raise QueueUnavailable(f"the proxy at {url} did not answer within {timeout_s:g}s")
        backoff.wait()


__all__ = ["HttpQueue", "QueueForbidden", "QueueNotFound", "SseSubscription", "wait_for_proxy"]


def _tls_failure(err: BaseException) -> ssl.SSLCertVerificationError | None:
    """The certificate-verification error somewhere behind an httpx or urllib3 error, if any."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, ssl.SSLCertVerificationError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


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
        if isinstance(verify, str):
            verify = _ca_context(verify)
        self._verify = verify if isinstance(verify, ssl.SSLContext) else httpx.create_ssl_context(verify=verify)
        headers = {"Authorization": f"Bearer {token}", "Accept": CONTENT_TYPE}
        proxy = environment_proxy(self.url)
        self._pools = _api_pool(self._verify, proxy, read_s=timeout_s + self.config.max_block_s)
        self.pool = self._pools.connection_from_url(self.url)
        """Every byte of every API call (`_call`) goes through it (the manager's own `urlopen`
        would parse each call's URL again)."""
        self._absolute = proxy is not None and self.url.startswith("http://")
        """Plain HTTP through a proxy: it is sent the absolute URL (HTTPS goes through a tunnel)."""
        self.client = httpx.Client(
            base_url=self.url,
            headers=headers,
            verify=self._verify,
            proxy=proxy,
            timeout=httpx.Timeout(timeout_s + self.config.max_block_s, connect=10.0),
            trust_env=False,
        )
        """For the event stream and proxied adapter files."""
        self._headers = headers
        self._body_headers = {**headers, "Content-Type": CONTENT_TYPE}
        self.retried = False
        """Whether the last call needed more than one attempt."""
        self._received: dict[str, set[str]] = {}
        self._resync: set[str] = set()
        self._subscriptions: list[SseSubscription] = []
        self._stopping = stop or threading.Event()

    def stop_retrying(self) -> None:
        self._stopping.set()

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
                if (bad := _tls_failure(err)) is not None:
                    raise QueueTLSError(
                        f"{self.url}: the certificate does not verify ({bad.verify_message}); "
                        "give the proxy's CA with SPOTGRPO_CA_CERT"
                    ) from None
                raise _Transient(f"{type(err).__name__}: {err}") from None
            if r.status == 200:
                assert response is not None, f"{path} answers no MessagePack body"
                return decode_body(r.data, response)
            code, message = _error_text(r.data)
            if r.status in (429, 502, 503, 504):
                raise _Transient(f"{r.status} {message}", _retry_after(r.headers.get("retry-after")))
            raise from_response(r.status, code, message, path)

        def before_wait(err: BaseException, delay: float) -> None:
            log.debug("%s %s: %s; retrying in %.2fs", method, path, err, delay)
            self.retried = True

        try:
            answer: Resp = retry(
                attempt,
                on=(_Transient,),
                deadline_s=self.retry_s,
                first=0.25,
                cap=5.0,
                stop=self._stopping,
                delay_of=lambda err, delay: err.wait if err.wait is not None else delay,  # type: ignore[attr-defined]
                before_wait=before_wait,
            )
            return answer
        except _Transient as err:
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
        return self._call(api.CLAIM, ClaimRequest(worker=worker, count=count, block_s=block_s)).leases

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
            missed = [d for d in self.pending_rollouts(consumer, count) if d.delivery_id not in received]
            self._resync.discard(consumer)
            if missed:
                received.update(d.delivery_id for d in missed)
                return missed
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
        sub = SseSubscription(self.client, api.ADAPTER_EVENTS.path)
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
                r = self.client.get(url)
            else:
                r = httpx.get(url, timeout=60.0, verify=self._verify)
        except httpx.TransportError as err:
            raise StoreError(f"adapter v{version}/{name}: {err}") from err
        if r.status_code == 404:
            raise StoreMissing(f"adapter v{version}/{name}: 404")
        if r.status_code != 200:
            raise StoreError(f"adapter v{version}/{name}: HTTP {r.status_code}")
        return r.content

    def expire_run(self, ttl_s: float) -> int:
        return self._call(api.EXPIRE_RUN, ExpireRunRequest(ttl_s=ttl_s)).keys

    def set_run_over(self, why: str) -> None:
        self._call(api.RUN_OVER, RunOverRequest(why=why))

    def set_run_rewards(self, specs: Sequence[str]) -> None:
        self._call(api.RUN_REWARDS, RunRewardsRequest(specs=list(specs)))

    # ------------------------------------------------------------------- fleet
    def report_status(self, status: WorkerStatus) -> None:
        self._call(api.REPORT_STATUS, ReportStatusRequest(status=status))

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
        """The token's name and role, and the run the proxy serves."""
        return self._call(api.WHOAMI)

    # ------------------------------------------------------------------- everyone
    def stats(self) -> QueueStats:
        return self._call(api.STATS).stats

    def close(self) -> None:
        for sub in self._subscriptions:
            sub.close()
        self._pools.clear()
        self.client.close()


def environment_proxy(url: str) -> str | None:
    """The HTTP proxy the environment names for `url` (HTTPS_PROXY, ALL_PROXY, less
    NO_PROXY), as httpx's client would follow it; None for none."""
    parts = urllib.parse.urlsplit(url)
    proxies = urllib.request.getproxies()
    proxy = proxies.get(parts.scheme) or proxies.get("all")
    if proxy and not urllib.request.proxy_bypass(parts.hostname or ""):
        return proxy
    return None


def _api_pool(context: ssl.SSLContext, proxy: str | None, read_s: float) -> urllib3.PoolManager:
    """Connections for the API's calls: kept alive (16 a host), never retried by urllib3
    (`_call` retries), through `proxy` where the environment names one (a CONNECT tunnel;
    credentials in its URL sent as Proxy-Authorization)."""
    options: dict[str, Any] = {
        "maxsize": 16,
        "retries": False,
        "ssl_context": context,
        "timeout": urllib3.Timeout(connect=10.0, read=read_s),
    }
    if proxy is None:
        return urllib3.PoolManager(**options)
    auth = urllib.parse.urlsplit(proxy)
    if auth.username is not None:
        credentials = f"{urllib.parse.unquote(auth.username)}:{urllib.parse.unquote(auth.password or '')}"
        options["proxy_headers"] = urllib3.make_headers(proxy_basic_auth=credentials)
    return urllib3.ProxyManager(proxy, **options)


def _error_text(data: bytes) -> tuple[str, str]:
    """(code, one-line message) of an error answer's body."""
    with contextlib.suppress(ProtocolError):
        body = decode_body(data, ErrorResponse)
        return body.code, body.error
    return "", data[:200].decode("utf-8", "replace")


def _ca_context(path: str) -> ssl.SSLContext:
    """A TLS context trusting the CA in `path`; a file that is missing or holds no
    certificate is a `QueueTLSError` naming it, not a traceback."""
    try:
        return ssl.create_default_context(cafile=path)
    except FileNotFoundError:
        raise QueueTLSError(f"CA file {path}: no such file (SPOTGRPO_CA_CERT or the CA flag)") from None
    except ssl.SSLError as err:
        raise QueueTLSError(f"CA file {path}: not a PEM certificate ({err.reason or err})") from None


class _Transient(Exception):
    """A call to try again: an outage, or the proxy's 429/502/503/504 (`wait`: its Retry-After)."""

    def __init__(self, problem: str, wait: float | None = None) -> None:
        super().__init__(problem)
        self.wait = wait


def _retry_after(value: str | None) -> float | None:
    """The proxy's Retry-After header in seconds (0.05 to 30), or None if it gave none."""
    try:
        return None if value is None else min(30.0, max(0.05, float(value)))
    except ValueError:
        return None


class SseSubscription(AdapterSubscription):
    """Adapter announcements from the proxy's event stream, read by a background thread
    that reconnects with Last-Event-ID, so a dropped connection loses nothing."""

    def __init__(self, client: httpx.Client, path: str) -> None:
        self.client, self.path = client, path
        self.last_event_id: str | None = None
        self._open = False
        self._items: stdqueue.Queue[AdapterManifest] = stdqueue.Queue(maxsize=1000)
        self._stop = threading.Event()
        self._response: httpx.Response | None = None
        self._thread = threading.Thread(target=self._run, name="adapter-events", daemon=True)
        self._thread.start()

    def get(self, timeout_s: float) -> AdapterManifest | None:
        try:
            return self._items.get(timeout=timeout_s)
        except stdqueue.Empty:
            return None

    @property
    def gapless(self) -> bool:
        """While the stream is open: a reconnection resumes from the last event id (and
        what was announced before the first connection is the watcher's first sync)."""
        return self._open

    def close(self) -> None:
        """Stop reading. A read blocked on a quiet stream is not woken by closing the
        response from here, so this does not wait for it: the thread is a daemon, and it
        ends at its next wake (an event, a keep-alive, or the read timeout) on `_stop`.
        Waiting cost a stopping worker 2 s of its SIGTERM grace."""
        self._stop.set()
        if self._response is not None:
            with contextlib.suppress(Exception):
                self._response.close()
        self._thread.join(timeout=0.1)

    def _run(self) -> None:
        backoff = Backoff(0.25, 5.0)
        while not self._stop.is_set():
            headers = {"Accept": "text/event-stream"}
            if self.last_event_id is not None:
                headers["Last-Event-ID"] = self.last_event_id
            try:
                with self.client.stream(
                    "GET", self.path, headers=headers, timeout=httpx.Timeout(60.0, connect=10.0)
                ) as r:
                    self._response = r
                    if r.status_code in (401, 403):
                        log.error("adapter events: the proxy refused the token (HTTP %d); not retrying", r.status_code)
                        return
                    if r.status_code != 200:
                        raise QueueError(f"events: HTTP {r.status_code}")
                    backoff.reset()
                    self._open = True
                    for event_id, data in _sse_events(r.iter_lines()):
                        manifest = decode(base64.b64decode(data))
                        if isinstance(manifest, AdapterManifest):
                            self._items.put(manifest)
                        self.last_event_id = event_id
                self._open = False
            except (httpx.HTTPError, QueueError, ProtocolError, ValueError) as err:
                self._open = False
                if self._stop.is_set():
                    return
                if _tls_failure(err) is not None:
                    log.error("adapter events: the proxy's certificate does not verify; not retrying")
                    return
                log.debug("adapter events: %s; reconnecting in %.2fs", err, backoff.next)
            backoff.wait(self._stop)


def _sse_events(lines: Iterator[str]) -> Iterator[tuple[str, str]]:
    """(id, data) of each event in a text/event-stream (comments and blank keep-alives skipped)."""
    event_id, data = "", list[str]()
    for line in lines:
        if not line:
            if data:
                yield event_id, "".join(data)
            event_id, data = "", []
        elif line.startswith(":"):
            continue
        elif line.startswith("id:"):
            event_id = line[3:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].strip())


def confirm_identity(queue: object, role: str, run: str | None, what: str) -> str:
    """Through a proxy, before anything costly: the token must have `role` and `run` (if
    given) must be the proxy's run (`what`: who needs it, for the message). Returns the
    run. Raises ValueError with what to change. Any other queue is the caller's to trust."""
    if not isinstance(queue, HttpQueue):
        return run or "default"
    who = queue.whoami()
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
