"""The `proxy` command.

`proxy serve --redis redis://… --store s3://… --tokens tokens.toml [--tls-cert C --tls-key K]`
serves the queue and adapter downloads over HTTPS. `proxy selfsigned` writes a
certificate and key for local runs.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlparse

from protocol.util.config_file import apply_config_file, config_flag, subcommand
from protocol.util.logs import add_logging_flags, level_of, setup_logging

if TYPE_CHECKING:
    from protocol import Queue, QueueConfig
    from protocol.trusted import RedisQueue

log = logging.getLogger("proxy")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="proxy", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve = sub.add_parser(
        "serve",
        help="Serve the HTTPS API in front of Redis and the adapter store.",
        description="Serve the HTTPS API in front of Redis and the adapter store.",
    )
    config_flag(serve, "proxy")
    a = serve.add_argument
    a(
        "--redis",
        "--queue",
        dest="redis",
        required=True,
        metavar="URL",
        help="the run's Redis, redis://host:port/db (the learner's --queue; --queue is the same flag), or memory:// "
        "for an in-process Redis (fakeredis; gone when the proxy exits)",
    )
    a(
        "--memory-redis-port",
        type=int,
        default=None,
        help="with --redis memory://: also serve that in-process Redis on 127.0.0.1 at this port, for trusted local "
        "tools (the embedded default's scoring worker); loopback only, no auth: never for a deployment",
    )
    a(
        "--store",
        required=True,
        help="adapter store: s3://bucket/prefix (presigned downloads) or file:///dir (streamed); "
        "with {run} in it (s3://bucket/spotgrpo/{run}) each run has its own prefix, as serving several needs",
    )
    a("--tokens", type=Path, default=None, help="tokens TOML file (or the TOML text in SPOTGRPO_TOKENS)")
    a(
        "--run",
        default="default",
        help="run name (the learner's --run); the proxy also serves every run its tokens name (runs = [...])",
    )
    a("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    a("--port", type=int, default=8443, help="port (default 8443)")
    a("--tls-cert", type=Path, help="PEM certificate (chain)")
    a("--tls-key", type=Path, help="PEM private key")
    a("--insecure-http", action="store_true", help="serve plain HTTP (only behind a TLS-terminating proxy)")
    a("--lease-timeout-s", type=float, default=60.0, help="a lease not heartbeated for this long is taken over")
    a("--max-deliveries", type=int, default=3, help="a batch handed out this often goes to the dead letters")
    a("--max-body-bytes", type=int, default=16 * 1024 * 1024, help="413 above this")
    a("--max-messages", type=int, default=512, help="most groups, batches or ids per request")
    a("--max-long-poll-s", type=float, default=10.0, help="longest wait of a long-poll request")
    a(
        "--rate-per-s",
        type=float,
        default=500.0,
        help="requests per second per token (burst: twice that), shared by every proxy of the run through its Redis, "
        "which each proxy asks once per 50 ms worth of a token's requests",
    )
    a("--max-long-polls-per-token", type=int, default=64, help="claims and reads waiting at once per token; 429 above")
    a("--max-streams-per-token", type=int, default=256, help="adapter-event streams open at once per token; 429 above")
    a(
        "--header-timeout-s",
        type=float,
        default=10.0,
        help="close a connection whose request headers take longer than this",
    )
    a("--backlog-limit", type=int, default=100_000, help="503 for submissions while this many groups wait")
    a("--presign-s", type=int, default=300, help="lifetime of presigned adapter URLs")
    a(
        "--max-workers-per-token",
        type=int,
        default=256,
        help=(
            "live worker statuses one token may have in the fleet view (default 256); a new worker's report past "
            "it is refused"
        ),
    )
    a(
        "--startup-timeout-s",
        type=float,
        default=300.0,
        help="wait this long for Redis at start-up, as the learner and actors do (default 300); then exit 1",
    )
    a(
        "--presign-endpoint",
        default=os.environ.get("SPOTGRPO_PRESIGN_ENDPOINT"),
        help="s3:// store: the public address presigned URLs name, when workers reach the bucket elsewhere than "
        "AWS_ENDPOINT_URL (compose's http://minio:9000); or SPOTGRPO_PRESIGN_ENDPOINT",
    )
    a("--body-timeout-s", type=float, default=30.0, help="408 when a request body takes longer than this to arrive")
    a(
        "--max-body-bytes-per-token",
        type=int,
        default=64 * 1024 * 1024,
        help="request-body bytes one token may have in flight at once (default 64 MiB: four full bodies); 429 past it",
    )
    a(
        "--max-body-bytes-in-flight",
        type=int,
        default=512 * 1024 * 1024,
        help="request-body bytes in flight over every token (default 512 MiB); 503 past it",
    )
    a(
        "--handshake-timeout-s",
        type=float,
        default=10.0,
        help="close a connection whose TLS handshake takes longer than this (asyncio's own limit is 60 s)",
    )
    a(
        "--max-connections",
        type=int,
        default=4096,
        help="connections served at once; a request past it is answered 503 (uvicorn's limit_concurrency). The "
        "proxy raises its open-files limit to the hard limit at start",
    )
    add_logging_flags(serve)

    cert = sub.add_parser(
        "selfsigned",
        help="Write a self-signed certificate and key for local runs.",
        description="Write a self-signed certificate and its key for local runs and tests; workers "
        "trust it with SPOTGRPO_CA_CERT=<cert>. Prints where they are and when the "
        "certificate expires.",
    )
    cert.add_argument("--cert", type=Path, required=True, help="where to write the certificate (PEM)")
    cert.add_argument("--key", type=Path, required=True, help="where to write its private key (PEM, mode 0600)")
    cert.add_argument(
        "--host",
        action="append",
        default=None,
        help="name or IP it is valid for (repeatable; default localhost, 127.0.0.1)",
    )
    cert.add_argument(
        "--days",
        type=int,
        default=30,
        help="days it is valid for (default 30); a proxy serving it after that fails every TLS handshake",
    )
    quarantine = sub.add_parser(
        "quarantine",
        help="List the workers the learner quarantined, or lift one's quarantine (admin token).",
        description="List the workers the learner quarantined and why (a failed audit or adapter digest; "
        "docs/security.md), or with --lift let one claim again and its groups be trained. Asks the proxy with "
        "the admin token in SPOTGRPO_TOKEN (or --token); trusts SPOTGRPO_CA_CERT.",
    )
    quarantine.add_argument("url", help="the proxy, https://host:port")
    quarantine.add_argument("--lift", metavar="WORKER", help="the worker's full name (token/worker), as listed")
    quarantine.add_argument("--token", default=None, help="an admin token (default: $SPOTGRPO_TOKEN)")
    quarantine.add_argument(
        "--run", default=None, help="the run, where the proxy serves several (default: the token's run)"
    )
    add_logging_flags(quarantine)
    share = sub.add_parser(
        "share",
        help="Set a run's weight and cap on a fleet that serves several runs (admin or the run's learner token).",
        description="Set a run's weight (relative to the other runs a worker serves) and cap (the most of a "
        "worker's sequences it holds at once); workers follow within seconds, with their next claims. Asks the "
        "proxy with the token in SPOTGRPO_TOKEN (or --token); trusts SPOTGRPO_CA_CERT.",
    )
    share.add_argument("url", help="the proxy, https://host:port")
    share.add_argument("--run", default=None, help="the run (default: the token's run)")
    share.add_argument("--weight", type=float, default=1.0, help="the run's weight, above 0, at most 1000 (default 1)")
    share.add_argument("--cap", type=float, default=None, help="a fraction, above 0, at most 1 (default: no cap)")
    share.add_argument(
        "--token", default=None, help="an admin token, or the run's learner's (default: $SPOTGRPO_TOKEN)"
    )
    add_logging_flags(share)
    return parser


def share_command(args: argparse.Namespace) -> int:
    """`proxy share`: the run's new weight and cap, in one line."""
    import msgspec

    from protocol import QueueConfig, QueueRefused, RunShare
    from protocol.client.urls import open_queue

    try:
        share = msgspec.convert({"weight": args.weight, "cap": args.cap}, RunShare)  # checks its bounds
    except (msgspec.ValidationError, ValueError) as err:
        print(f"proxy share: {err}", file=sys.stderr)
        return 2
    config = QueueConfig(run=args.run) if args.run else None
    try:
        with open_queue(args.url, config, token=args.token, retry_s=10.0) as queue:
            queue.set_run_share(share)
            run = queue.config.run
    except QueueRefused as err:  # a token that is not an admin's, or not of this run
        print(f"proxy share: {err}", file=sys.stderr)
        return 2
    cap = "no cap" if share.cap is None else f"cap {share.cap:g}"
    print(f"run {run}: weight {share.weight:g}, {cap}; workers follow with their next claims")
    return 0


def quarantine_command(args: argparse.Namespace) -> int:
    """`proxy quarantine`: one line per quarantined worker, or the lift's outcome."""
    from protocol import QueueConfig, QueueRefused
    from protocol.client.urls import open_queue

    config = QueueConfig(run=args.run) if args.run else None
    try:
        with open_queue(args.url, config, token=args.token, retry_s=10.0) as queue:
            return _quarantine(queue, args.lift)
    except QueueRefused as err:  # a token that is not an admin's, or not of this run
        print(f"proxy quarantine: {err}", file=sys.stderr)
        return 2


def _quarantine(queue: Queue, lift: str | None) -> int:
    if lift:
        if not queue.lift_quarantine(lift):
            print(f"{lift} is not quarantined", file=sys.stderr)
            return 1
        print(f"lifted: {lift} may claim again; the learner trains its groups from its next fleet check")
        return 0
    listed = {w: why for w, why in queue.quarantined().items() if why}
    for worker, why in sorted(listed.items()):
        print(f"{worker}\t{why}")
    if not listed:
        print("no worker is quarantined", file=sys.stderr)
    return 0


def check_tls(cert: Path, key: Path) -> None:
    """Load the pair as uvicorn will, so a bad file is named in one line before serving."""
    import ssl

    for flag, path in (("--tls-cert", cert), ("--tls-key", key)):
        if not path.is_file():
            raise ValueError(f"{flag} {path}: no such file")
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key)
    except ssl.SSLError as err:
        raise ValueError(
            f"--tls-cert {cert} / --tls-key {key}: not a matching PEM certificate and key ({err.reason})"
        ) from None


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from protocol import QueueConfig, QueueUnavailable
    from protocol.client.http import CHUNK_ITEMS
    from protocol.trusted import RedisQueue, open_store
    from protocol.trusted.redis_client import connect_async, memory_redis
    from protocol.wire.files import StoreError
    from proxy.app import build_app
    from proxy.auth import TokenError, Tokens
    from proxy.context import Context, ProxyLimits
    from proxy.fairness import HeaderTimeoutProtocol
    from proxy.metrics import ProxyMetrics
    from proxy.server import ProxyServer, raise_open_files_limit
    from proxy.threads import THREADS

    if args.max_messages < CHUNK_ITEMS:
        print(
            f"proxy serve: --max-messages must be at least {CHUNK_ITEMS}, what clients send in one call",
            file=sys.stderr,
        )
        return 2
    if args.insecure_http == bool(args.tls_cert or args.tls_key):
        print("proxy serve: give --tls-cert and --tls-key, or --insecure-http (plain HTTP)", file=sys.stderr)
        return 2
    if not args.insecure_http and not (args.tls_cert and args.tls_key):
        print("proxy serve: --tls-cert and --tls-key go together", file=sys.stderr)
        return 2
    try:
        if args.tls_cert:
            check_tls(args.tls_cert, args.tls_key)
        if args.tokens is not None:
            tokens = Tokens.from_file(args.tokens)
        elif os.environ.get("SPOTGRPO_TOKENS"):
            tokens = Tokens.from_toml(os.environ["SPOTGRPO_TOKENS"], "SPOTGRPO_TOKENS")
        else:
            raise TokenError("give --tokens FILE or set SPOTGRPO_TOKENS")
        config = QueueConfig(run=args.run, lease_timeout_s=args.lease_timeout_s, max_deliveries=args.max_deliveries)
        if args.redis == "memory://":  # the embedded default: no Redis to install
            queue = RedisQueue(memory_redis(args.memory_redis_port), config)
            rate_storage = "async+memory://"
        elif args.memory_redis_port is not None:
            raise ValueError("--memory-redis-port: only with --redis memory://")
        else:
            # a connection for every worker thread, and some for the event hub and health checks
            queue = wait_for_redis(args.redis, config, THREADS + 16, args.startup_timeout_s)
            rate_storage = rate_storage_url(args.redis, queue.on_cluster)
        store = open_store(args.store.replace("{run}", args.run), presign_endpoint=args.presign_endpoint)
    except QueueUnavailable as err:  # before OSError, which it is (and StoreError too)
        print(f"proxy serve: --redis {args.redis}: {err}", file=sys.stderr)
        return 1
    except StoreError as err:
        print(f"proxy serve: --store {args.store}: {err}", file=sys.stderr)
        return 1
    except (TokenError, ValueError, OSError) as err:
        print(f"proxy serve: {err}", file=sys.stderr)
        return 2
    limits = ProxyLimits(
        max_body_bytes=args.max_body_bytes,
        max_messages=args.max_messages,
        max_long_poll_s=args.max_long_poll_s,
        rate_per_s=args.rate_per_s,
        burst=2 * args.rate_per_s,
        backlog_limit=args.backlog_limit,
        presign_s=args.presign_s,
        body_timeout_s=args.body_timeout_s,
        max_long_polls_per_token=args.max_long_polls_per_token,
        max_streams_per_token=args.max_streams_per_token,
        max_workers_per_token=args.max_workers_per_token,
        max_body_bytes_per_token=args.max_body_bytes_per_token,
        max_body_bytes_in_flight=args.max_body_bytes_in_flight,
    )
    try:
        ctx = Context(
            queue=queue,
            store=store,
            tokens=tokens,
            limits=limits,
            metrics=ProxyMetrics(),
            rate_storage=rate_storage,
            store_url=args.store if "{run}" in args.store else None,
            presign_endpoint=args.presign_endpoint,
            tokens_file=args.tokens,
        )
    except TokenError as err:
        print(f"proxy serve: {err}", file=sys.stderr)
        return 2
    if args.redis != "memory://" and not queue.on_cluster:  # submissions from the event loop (proxy.handlers)
        ctx.aredis = connect_async(args.redis)
        ctx.waits = connect_async(args.redis, max_connections=args.max_connections)
    HeaderTimeoutProtocol.header_timeout_s = args.header_timeout_s
    log.info(
        "proxy for run %s%s on %s://%s:%d (%d tokens)",
        args.run,
        f" (and {', '.join(sorted(tokens.runs() - {args.run}))})" if tokens.runs() - {args.run} else "",
        "http" if args.insecure_http else "https",
        args.host,
        args.port,
        len(tokens.tokens),
    )
    server_config = uvicorn.Config(
        build_app(ctx),
        host=args.host,
        port=args.port,
        log_level=level_of(args),
        access_log=False,
        ssl_certfile=str(args.tls_cert) if args.tls_cert else None,
        ssl_keyfile=str(args.tls_key) if args.tls_key else None,
        timeout_keep_alive=30,
        timeout_graceful_shutdown=2,
        http=HeaderTimeoutProtocol,
        limit_concurrency=args.max_connections,
    )
    files = raise_open_files_limit()
    # a socket for each connection, and one to Redis for each claim waiting (`ctx.waits`)
    if files < 2 * args.max_connections + THREADS + 64:
        log.warning(
            "open-files limit %d is below twice --max-connections %d and the Redis pool: connections past it fail "
            "at accept (raise the hard limit: ulimit -Hn, or the container's nofile)",
            files,
            args.max_connections,
        )
    # a port it cannot bind: uvicorn says so, exit 3
    ProxyServer(server_config, on_exit=ctx.close_soon, handshake_timeout_s=args.handshake_timeout_s).run()
    queue.close()
    return 0


def wait_for_redis(url: str, config: QueueConfig, max_connections: int, timeout_s: float) -> RedisQueue:
    """The run's Redis, waited for up to `timeout_s` (it may start after the proxy, as in
    compose): the learner and the actors wait the same way. Raises QueueUnavailable."""
    from protocol import QueueUnavailable
    from protocol.trusted import RedisQueue
    from protocol.util.retry import retry

    def connect() -> RedisQueue:
        queue = RedisQueue.from_url(url, config, max_connections=max_connections)
        queue.latest_adapter()
        return queue

    try:
        return retry(
            connect,
            on=(QueueUnavailable,),
            deadline_s=timeout_s,
            cap=10.0,
            before_wait=lambda err, delay: log.warning("redis unreachable, retrying in %.1fs: %s", delay, err),
        )
    except QueueUnavailable as err:
        raise QueueUnavailable(f"unreachable for {timeout_s:g}s: {err}") from None


def rate_storage_url(redis_url: str, cluster: bool) -> str:
    """`limits`' storage for the run's Redis: `async+redis://…`, or for a cluster
    `async+redis+cluster://host:port` (no database there)."""
    if not cluster:
        return "async+" + redis_url
    parts = urlparse(redis_url)
    return f"async+redis+cluster://{parts.netloc}"


def selfsigned(args: argparse.Namespace) -> int:
    from proxy.tls import write_self_signed

    if args.days < 1:
        print("proxy selfsigned: --days must be at least 1", file=sys.stderr)
        return 2
    hosts = args.host or ["localhost", "127.0.0.1"]
    write_self_signed(args.cert, args.key, hosts, args.days)
    expires = datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=args.days)
    print(
        f"wrote {args.cert} and {args.key} for {', '.join(hosts)}; the certificate expires on "
        f"{expires:%Y-%m-%d %H:%M} UTC ({args.days} days): make a new one before then (--days)"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    fill = (  # the run's config file: its Redis, store and run, and [proxy]
        apply_config_file(subcommand(parser, "serve"), argv[1:], "proxy") if argv[:1] == ["serve"] else None
    )
    args = parser.parse_args(argv)
    if fill is not None:
        fill(args)
    if args.command is None:
        parser.print_help()
        return 0
    setup_logging(args)
    from protocol.util.lifeline import follow_lifeline

    follow_lifeline()  # started by the embedded default: end with it
    if args.command == "quarantine":
        return quarantine_command(args)
    if args.command == "share":
        return share_command(args)
    return serve(args) if args.command == "serve" else selfsigned(args)


if __name__ == "__main__":
    sys.exit(main())
