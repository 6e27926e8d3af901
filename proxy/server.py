"""uvicorn's server, stopping cleanly with event streams open."""

from __future__ import annotations

import asyncio
import functools
import resource
from collections.abc import Callable
from socket import socket
from types import FrameType

import uvicorn


class ProxyServer(uvicorn.Server):
    """A stop signal (SIGTERM, Ctrl-C) first calls `on_exit`, which ends the adapter event
    streams: they never end on their own, so uvicorn's graceful shutdown would wait them
    out and then cancel them, logging a traceback for each."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None], handshake_timeout_s: float = 10.0) -> None:
        super().__init__(config)
        self.on_exit = on_exit
        self.handshake_timeout_s = handshake_timeout_s

    async def startup(self, sockets: list[socket] | None = None) -> None:
        """uvicorn's, with asyncio's TLS handshake limited to `handshake_timeout_s`. uvicorn
        has no setting for it and asyncio's default is 60 s: a connection that never sends
        its ClientHello held a file descriptor for a minute, before the header timer (which
        starts when the handshake is done) could run; 1,100 of them blocked every honest
        call. The loop's `create_server` gets the argument for the duration of the call."""
        loop = asyncio.get_running_loop()
        if self.config.is_ssl:
            loop.create_server = functools.partial(  # type: ignore[method-assign]
                loop.create_server, ssl_handshake_timeout=self.handshake_timeout_s
            )
        try:
            await super().startup(sockets)
        finally:
            vars(loop).pop("create_server", None)  # the instance's wrapper: the class's method shows again

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.on_exit()
        super().handle_exit(sig, frame)

    async def _wait_tasks_to_complete(self) -> None:
        """uvicorn closes each connection with no response in flight, but closing a TLS
        connection waits for the client's close_notify, up to asyncio's 30 s
        `ssl_shutdown_timeout`; an idle client (a pooled keep-alive connection) never
        sends it, so the graceful shutdown ran out and logged "Cancel 0 running task(s)"
        at every stop. A connection already closing has nothing left to send: it is
        aborted instead; those with a response in flight finish it first."""
        while self.server_state.connections and not self.force_exit:
            for connection in list(self.server_state.connections):
                transport = getattr(connection, "transport", None)
                if transport is not None and transport.is_closing():
                    transport.abort()
            await asyncio.sleep(0.05)
        await super()._wait_tasks_to_complete()


def raise_open_files_limit() -> int:
    """The soft limit on open files raised to the hard one (often 1,024 against 1,048,576):
    every connection, idle or not, holds one. Returns the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):  # a container that forbids it: keep what there is
            pass
    return soft
