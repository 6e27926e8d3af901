"""What `HttpQueue` needs of HTTP, on urllib3 alone: TLS contexts, connection pools that
follow the environment's HTTP proxy, the retry signal and its Retry-After, error bodies,
and the wait for a proxy to answer.
"""

from __future__ import annotations

import contextlib
import ssl
import subprocess
import time
import urllib.parse
import urllib.request
from typing import Any

import urllib3
import urllib3.exceptions

from protocol.client.http import ErrorResponse, decode_body
from protocol.util.retry import Backoff
from protocol.wire.errors import ProtocolError, QueueTLSError, QueueUnavailable


def tls_context(verify: str | bool | ssl.SSLContext) -> ssl.SSLContext:
    """A context as `verify` says: a CA file's path (a private CA, the proxy's self-signed
    certificate), True for the system's CAs, False for no verification (tests only)."""
    if isinstance(verify, ssl.SSLContext):
        return verify
    if isinstance(verify, str):
        return ca_context(verify)
    context = ssl.create_default_context()
    if not verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


def ca_context(path: str) -> ssl.SSLContext:
    """A TLS context trusting the CA in `path`; a file that is missing or holds no
    certificate is a `QueueTLSError` naming it, not a traceback."""
    try:
        return ssl.create_default_context(cafile=path)
    except FileNotFoundError:
        raise QueueTLSError(f"CA file {path}: no such file (SPOTGRPO_CA_CERT or the CA flag)") from None
    except ssl.SSLError as err:
        raise QueueTLSError(f"CA file {path}: not a PEM certificate ({err.reason or err})") from None


def tls_failure(err: BaseException) -> ssl.SSLCertVerificationError | None:
    """The certificate-verification error somewhere behind a urllib3 error, if any."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, ssl.SSLCertVerificationError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def environment_proxy(url: str) -> str | None:
    """The HTTP proxy the environment names for `url` (HTTPS_PROXY, ALL_PROXY, less
    NO_PROXY); None for none."""
    parts = urllib.parse.urlsplit(url)
    proxies = urllib.request.getproxies()
    proxy = proxies.get(parts.scheme) or proxies.get("all")
    if proxy and not urllib.request.proxy_bypass(parts.hostname or ""):
        return proxy
    return None


def pool_manager(context: ssl.SSLContext, proxy: str | None, read_s: float) -> urllib3.PoolManager:
    """Connections kept alive (16 a host), never retried by urllib3 (the caller retries),
    through `proxy` where the environment names one (a CONNECT tunnel; credentials in its URL
    sent as Proxy-Authorization)."""
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


def error_text(data: bytes) -> tuple[str, str]:
    """(code, one-line message) of an error answer's body."""
    with contextlib.suppress(ProtocolError):
        body = decode_body(data, ErrorResponse)
        return body.code, body.error
    return "", data[:200].decode("utf-8", "replace")


class Transient(Exception):
    """A call to try again: an outage, or the proxy's 429/502/503/504 (`wait`: its Retry-After)."""

    def __init__(self, problem: str, wait: float | None = None) -> None:
        super().__init__(problem)
        self.wait = wait


def retry_after(value: str | None) -> float | None:
    """The proxy's Retry-After header in seconds (0.05 to 30), or None if it gave none."""
    try:
        return None if value is None else min(30.0, max(0.05, float(value)))
    except ValueError:
        return None


def wait_for_proxy(
    url: str, ca_file: str | None, proc: subprocess.Popen[bytes] | None = None, timeout_s: float = 60.0
) -> None:
    """Block until `proxy serve` at `url` answers /healthz with 200. Raises QueueUnavailable
    when it does not within `timeout_s`, or at once when its process `proc` has exited."""
    deadline = time.monotonic() + timeout_s
    backoff = Backoff(first=0.05, cap=1.0)
    with urllib3.PoolManager(ssl_context=tls_context(ca_file or True), retries=False, timeout=1.0) as pool:
        while True:
            with contextlib.suppress(urllib3.exceptions.HTTPError):
                if pool.request("GET", f"{url.rstrip('/')}/healthz", redirect=False).status == 200:
                    return
            if proc is not None and proc.poll() is not None:
                raise QueueUnavailable(f"the proxy for {url} exited with status {proc.returncode}")
            if time.monotonic() > deadline:
                raise QueueUnavailable(f"the proxy at {url} did not answer within {timeout_s:g}s")
            backoff.wait()
