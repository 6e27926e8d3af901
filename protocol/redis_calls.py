"""Two ways of calling Redis that redis-py's own calls make slower than they need be: a Lua
script by its digest, and a MULTI/EXEC sent as one write. Both take any client
`protocol.redis_client.connect` returns (a cluster's and fakeredis included)."""

from __future__ import annotations

from typing import Any

import hiredis
import redis
import redis.exceptions
from redis.commands.core import Script

from protocol.errors import QueueError


def run_script(client: Any, script: Script, keys: list[str], args: list[Any]) -> Any:
    """`script` by its digest; a server that lost it (restarted, or its script cache
    flushed) is given it again. `execute_command` directly: redis-py's `Script` call
    reaches it through three more layers, a tenth of a cheap call's client time; a cluster
    client routes EVALSHA by its keys all the same."""
    try:
        return client.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
    except redis.exceptions.NoScriptError:
        client.script_load(script.script)
        return client.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)


def transaction(client: Any, commands: list[tuple[Any, ...]], script: Script | None = None) -> list[Any]:
    """`commands` in one MULTI/EXEC: EXEC's replies, an error among them as an exception
    instance, not raised. Where the first command runs `script` and the server does not
    have it, nothing of the transaction ran that used it: the script is loaded and the
    transaction sent again (so every script call in it must be that one script)."""
    replies = _exec(client, commands)
    if script is not None and isinstance(replies[0], redis.exceptions.NoScriptError):
        client.script_load(script.script)
        replies = _exec(client, commands)
    return replies


def _exec(client: Any, commands: list[tuple[Any, ...]]) -> list[Any]:
    """On a plain `redis.Redis` the commands go as one write on one pooled connection
    (redis-py's pipeline cost a 33 KB submission ~80 us more of its caller's time,
    measured); any other client (a cluster's, fakeredis) through its pipeline. A dropped
    connection is tried once more on a new one, as redis-py's own calls are: a transaction
    runs whole or not at all."""
    if type(client) is not redis.Redis:
        with client.pipeline(transaction=True) as pipe:
            for command in commands:
                pipe.execute_command(*command)
            return list(pipe.execute(raise_on_error=False))
    pool = client.connection_pool
    for attempt in (1, 2):
        conn = pool.get_connection()
        try:
            # one buffer, one send (redis-py's packer sends a large argument on its own,
            # and costs twice hiredis's own, which it calls)
            conn.send_packed_command([b"".join([hiredis.pack_command(c) for c in [("MULTI",), *commands, ("EXEC",)]])])
            refused: redis.exceptions.ResponseError | None = None
            for _ in range(len(commands) + 1):  # MULTI's +OK, then +QUEUED or a command's refusal
                try:
                    conn.read_response()
                except redis.exceptions.ResponseError as err:
                    refused = refused or err
            try:
                return list(conn.read_response())
            except redis.exceptions.ExecAbortError:
                raise refused or QueueError("redis: transaction aborted") from None
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
            conn.disconnect()
            if attempt == 2:
                raise
        except BaseException:
            conn.disconnect()
            raise
        finally:
            pool.release(conn)
    raise AssertionError("unreachable")
