"""A redis-py client for a `redis://` URL, whether it names a single server or any node
of a Redis Cluster: the node is asked (`INFO cluster`), and a cluster gets redis-py's
cluster client, which follows the slots to the right node. Every key of a run shares the
hash tag `{run}` (`protocol.wire.keys`), so a run's keys live in one slot, its Lua scripts stay
legal, and runs spread across the shards by their names.

RQ (the trusted scoring tier's job queue) needs a plain Redis: its transactions span
keys of several slots. `learner score --rq-redis` names one for it.
"""

from __future__ import annotations

import logging
from typing import Any
from urllib.parse import urlparse

import redis
import redis.asyncio
from redis.cluster import RedisCluster

from protocol.wire.errors import QueueUnavailable

log = logging.getLogger(__name__)


def is_cluster_node(url: str, connect_timeout_s: float = 5.0) -> bool:
    """The server at `url` runs with `cluster-enabled yes`."""
    parts = urlparse(url)
    if parts.scheme == "unix":
        return False
    # asked without a database: a cluster node refuses SELECT
    probe = redis.Redis.from_url(
        parts._replace(path="").geturl(), socket_timeout=connect_timeout_s, socket_connect_timeout=connect_timeout_s
    )
    try:
        return bool(probe.info("cluster").get("cluster_enabled"))
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as err:
        raise QueueUnavailable(f"redis unreachable: {err}") from err
    except redis.exceptions.ResponseError:
        return False  # a server or proxy that does not answer INFO cluster is not a cluster node
    finally:
        probe.close()


def connect(url: str, *, socket_timeout: float, max_connections: int = 100) -> Any:
    """`redis.Redis`, or `RedisCluster` where `url` names a cluster node (a database
    number other than 0 is refused there: a cluster has only database 0)."""
    options: dict[str, Any] = {
        "socket_timeout": socket_timeout,
        "socket_connect_timeout": 5.0,
        "max_connections": max_connections,
    }
    if not is_cluster_node(url):
        return redis.Redis.from_url(url, health_check_interval=30, **options)
    parts = urlparse(url)
    path = parts.path.strip("/")
    if path not in ("", "0"):
        raise ValueError(f"{url}: a Redis Cluster has only database 0 (drop /{path})")
    try:  # no database in the URL: redis-py would SELECT it, which a cluster refuses
        return RedisCluster.from_url(parts._replace(path="").geturl(), **options)
    except (
        redis.exceptions.ConnectionError,
        redis.exceptions.TimeoutError,
        redis.exceptions.RedisClusterException,
    ) as err:
        raise QueueUnavailable(f"redis cluster unreachable: {err}") from err


def connect_async(url: str, *, max_connections: int = 64, wait_s: float = 10.0) -> Any:
    """A `redis.asyncio` client of the plain Redis `url` names (not a cluster node), for an
    event loop's calls (`protocol.trusted.redis_calls.aio_transaction`). At most `max_connections`
    at once; a call past them waits up to `wait_s` for one. No socket timeout of its own
    (redis-py's, 5 s unless told, starts a task for every write and a timer for every
    reply read): its callers bound each exchange whole."""
    pool = redis.asyncio.BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=wait_s, socket_timeout=None, socket_connect_timeout=5.0
    )
    return redis.asyncio.Redis.from_pool(pool)


def cluster_client(client: Any) -> bool:
    return isinstance(client, RedisCluster)


def memory_redis(share_port: int | None = None) -> Any:
    """An in-process Redis (fakeredis) for the embedded default: no Redis to install. With
    `share_port`, the same data is served on loopback for the run's other processes."""
    import fakeredis

    server = fakeredis.FakeServer(version=(7, 0))
    if share_port is not None:
        share_memory_redis(server, share_port)
    return fakeredis.FakeRedis(server=server)


def share_memory_redis(server: Any, port: int) -> None:
    """Serve an in-process fakeredis server on loopback (fakeredis's own TCP server)."""
    import threading

    from fakeredis import TcpFakeServer
    from fakeredis._clients._tcp_server import TCPFakeRequestHandler

    class NoDelayHandler(TCPFakeRequestHandler):
        # replies go out one small write each: without TCP_NODELAY a pipelined
        # transaction waits ~40 ms on the client's delayed ACK (Nagle's algorithm)
        disable_nagle_algorithm = True

    tcp = TcpFakeServer(("127.0.0.1", port), server_type="redis", server_version=(7, 0))
    tcp.RequestHandlerClass = NoDelayHandler
    tcp.fake_server = server  # the proxy's own data, not a second, empty server
    tcp.daemon_threads = True
    threading.Thread(target=tcp.serve_forever, name="memory-redis", daemon=True).start()
    log.info("in-process redis also on redis://127.0.0.1:%d (loopback, for trusted local tools)", port)
