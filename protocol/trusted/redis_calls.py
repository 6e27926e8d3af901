"""Three ways of calling Redis that redis-py's own calls make slower than they need be: a Lua
script by its digest, a MULTI/EXEC sent as one write (also from an event loop), and a
consumer group's read of one stream. `RedisCalls` makes them on any client
`protocol.trusted.redis_client.connect` returns (a cluster's and fakeredis included), and holds
the one connection it keeps checked out of that client's pool; `aio_transaction` is the
transaction on an asyncio client. This module is the only user of redis-py's internals."""

from __future__ import annotations

import asyncio
import os
import threading
import weakref
from typing import Any

import hiredis
import redis
import redis.exceptions
from redis.commands.core import Script

from protocol.wire.errors import QueueError


async def aio_transaction(
    aclient: Any, commands: list[tuple[Any, ...]], script: Script | None = None, *, timeout_s: float = 30.0
) -> list[Any]:
    """`transaction` on a `redis.asyncio.Redis` (`protocol.trusted.redis_client.connect_async`): the
    same one write, the same replies, a dropped connection tried once more; each exchange
    bounded by `timeout_s` (redis.exceptions.TimeoutError past it)."""
    replies = await _aio_exec(aclient, commands, timeout_s)
    if script is not None and isinstance(replies[0], redis.exceptions.NoScriptError):
        await aclient.script_load(script.script)
        replies = await _aio_exec(aclient, commands, timeout_s)
    return replies


async def _aio_exec(aclient: Any, commands: list[tuple[Any, ...]], timeout_s: float) -> list[Any]:
    pool = aclient.connection_pool
    data = _multi_exec(commands)
    for attempt in (1, 2):
        conn = None
        try:
            async with asyncio.timeout(timeout_s):  # a (re)connection too
                conn = await pool.get_connection()
                await conn.send_packed_command([data], check_health=False)
                return await _exec_replies(conn, len(commands))
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, TimeoutError) as err:
            if conn is not None:
                await conn.disconnect()
            if attempt == 2:
                if isinstance(err, redis.exceptions.RedisError):
                    raise
                raise redis.exceptions.TimeoutError(f"no reply from redis within {timeout_s:g}s") from None
        except BaseException:  # a refusal, or the caller cancelled: the reply may be half read
            if conn is not None:
                await conn.disconnect()
            raise
        finally:
            if conn is not None:
                await pool.release(conn)
    raise AssertionError("unreachable")


async def _exec_replies(conn: Any, n: int) -> list[Any]:
    replies = _ExecReplies(n)
    while not replies.done:
        try:
            replies.take(await conn.read_response())
        except redis.exceptions.ResponseError as err:
            replies.take(err)
    return replies.result()


class _ExecReplies:
    """What a MULTI/EXEC of `n` commands answers, however its replies are read (a blocking
    connection or an event loop's): MULTI's +OK, then +QUEUED or a command's refusal for
    each command, then EXEC's replies. `take` each as read (a refusal as its exception)
    until `done`; `result` is EXEC's replies, or the first refusal when EXEC aborted."""

    __slots__ = ("final", "left", "refused")

    def __init__(self, n: int) -> None:
        self.left = n + 2
        self.refused: redis.exceptions.ResponseError | None = None
        self.final: Any = None

    @property
    def done(self) -> bool:
        return self.left == 0

    def take(self, reply: Any) -> None:
        self.left -= 1
        if self.left == 0:
            self.final = reply
        elif isinstance(reply, redis.exceptions.ResponseError):
            self.refused = self.refused or reply

    def result(self) -> list[Any]:
        if isinstance(self.final, redis.exceptions.ExecAbortError):
            raise self.refused or QueueError("redis: transaction aborted")
        return list(self.final)


def _multi_exec(commands: list[tuple[Any, ...]]) -> bytes:
    """MULTI, `commands`, EXEC as one buffer for one send (redis-py's packer sends a large
    argument on its own, and costs twice hiredis's own, which it calls)."""
    return b"".join([hiredis.pack_command(c) for c in [("MULTI",), *commands, ("EXEC",)]])


Entry = tuple[bytes, dict[bytes, bytes] | None]
"""A stream entry as read: its id and its fields (None: deleted since it was delivered)."""


def _pairs(flat: list[bytes]) -> dict[bytes, bytes]:
    """[k1, v1, k2, v2, ...] as a dict (one iterator zipped with itself: half the cost of two slices)."""
    it = iter(flat)
    return dict(zip(it, it, strict=False))


class _Pinned:
    """One connection of a pool, kept checked out for the calls here and used by one thread
    at a time (another meanwhile takes one from the pool): redis-py's pool costs each call
    a lock, a poll of the socket, four metric updates and an event, ~9 us (measured), as
    much as a read of 16 groups spends on its bookkeeping. It is checked as the pool checks
    the connections it hands out (data left unread, or closed by the server: reconnected);
    a forked child takes a new one; closing the client (`pool.disconnect()`) closes it too,
    and a later call reconnects it."""

    __slots__ = ("conn", "lock", "pid")

    def __init__(self) -> None:
        self.conn: Any = None
        self.lock = threading.Lock()
        self.pid = 0


class RedisCalls:
    """The three calls on `client`. On a plain `redis.Redis` they go on one connection kept
    checked out of its pool (`_Pinned`), held here, by the object that makes the calls (the
    queue): it lives and goes with it."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self._direct = type(client) is redis.Redis  # a cluster's client and fakeredis: redis-py's calls
        self._pin = _Pinned()
        if self._direct:  # a queue dropped unclosed gives its connection back to the pool
            weakref.finalize(self, _unpin, client.connection_pool, self._pin)

    def close(self) -> None:
        """Give the pinned connection back to the pool (a later call takes one again)."""
        if self._direct:
            with self._pin.lock:
                _unpin(self.client.connection_pool, self._pin)

    def script(self, script: Script, keys: list[str], args: list[Any]) -> Any:
        """`script` by its digest; a server that lost it (restarted, or its script cache
        flushed) is given it again. `execute_command` directly: redis-py's `Script` call
        reaches it through three more layers, a tenth of a cheap call's client time; a
        cluster client routes EVALSHA by its keys all the same."""
        try:
            return self.client.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
        except redis.exceptions.NoScriptError:
            self.client.script_load(script.script)
            return self.client.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)

    def transaction(self, commands: list[tuple[Any, ...]], script: Script | None = None) -> list[Any]:
        """`commands` in one MULTI/EXEC: EXEC's replies, an error among them as an exception
        instance, not raised. Where the first command runs `script` and the server does not
        have it, nothing of the transaction ran that used it: the script is loaded and the
        transaction sent again (so every script call in it must be that one script)."""
        replies = self._exec(commands)
        if script is not None and isinstance(replies[0], redis.exceptions.NoScriptError):
            self.client.script_load(script.script)
            replies = self._exec(commands)
        return replies

    def read_group(
        self, group: str, consumer: str, stream: str, after: str, count: int, block_ms: int | None = None
    ) -> list[Entry]:
        """`XREADGROUP` of one stream from `after` (">": entries never delivered; an id: this
        consumer's pending entries past it). On a plain `redis.Redis` the command goes on the
        pinned connection and its reply is taken as hiredis gives it (RESP2 or RESP3):
        redis-py's layers and its parsing of each entry cost a read of 16 groups ~15% of its
        time (measured). A connection error is raised, not retried: the lost reply may have
        delivered entries the caller must find again among its pending ones."""
        if not self._direct:
            resp = self.client.xreadgroup(group, consumer, {stream: after}, count=count, block=block_ms)
            return [e for _stream, entries in resp or () for e in entries]
        args: tuple[Any, ...] = ("XREADGROUP", "GROUP", group, consumer, "COUNT", count)
        if block_ms is not None:
            args += ("BLOCK", block_ms)
        conn, pinned = self._take()
        try:
            conn.send_packed_command([hiredis.pack_command((*args, "STREAMS", stream, after))])
            resp = conn.read_response()
        except BaseException:
            conn.disconnect()
            raise
        finally:
            self._give(conn, pinned)
        if not resp:
            return []
        lists = resp.values() if isinstance(resp, dict) else [entries for _stream, entries in resp]
        return [(i, None if f is None else _pairs(f)) for entries in lists for i, f in entries]

    def _exec(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        """On a plain `redis.Redis` the commands go as one write on one connection (redis-py's
        pipeline cost a 33 KB submission ~80 us more of its caller's time, measured); any
        other client (a cluster's, fakeredis) through its pipeline. A dropped connection is
        tried once more on a new one, as redis-py's own calls are: a transaction runs whole
        or not at all."""
        if not self._direct:
            with self.client.pipeline(transaction=True) as pipe:
                for command in commands:
                    pipe.execute_command(*command)
                return list(pipe.execute(raise_on_error=False))
        for attempt in (1, 2):
            conn, pinned = self._take()
            try:
                conn.send_packed_command([_multi_exec(commands)])
                replies = _ExecReplies(len(commands))
                while not replies.done:
                    try:
                        replies.take(conn.read_response())
                    except redis.exceptions.ResponseError as err:
                        replies.take(err)
                return replies.result()
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
                conn.disconnect()
                if attempt == 2:
                    raise
            except BaseException:
                conn.disconnect()
                raise
            finally:
                self._give(conn, pinned)
        raise AssertionError("unreachable")

    def _take(self) -> tuple[Any, bool]:
        """A connection for one call, and whether it is the pinned one (else the pool's,
        because another thread holds the pin); `_give` both back."""
        pin, pool = self._pin, self.client.connection_pool
        if not pin.lock.acquire(blocking=False):
            return pool.get_connection(), False
        try:
            if pin.conn is None or pin.pid != os.getpid():
                pin.conn, pin.pid = pool.get_connection(), os.getpid()
            else:
                try:
                    if pin.conn.can_read():
                        raise redis.exceptions.ConnectionError("connection has data")
                except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError):
                    pin.conn.disconnect()  # the next send connects it again
        except BaseException:
            pin.lock.release()
            raise
        return pin.conn, True

    def _give(self, conn: Any, pinned: bool) -> None:
        if pinned:
            self._pin.lock.release()
        else:
            self.client.connection_pool.release(conn)


def _unpin(pool: Any, pin: _Pinned) -> None:
    if pin.conn is not None and pin.pid == os.getpid():
        pool.release(pin.conn)
    pin.conn = None
