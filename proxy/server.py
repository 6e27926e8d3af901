"""uvicorn's server, stopping cleanly with event streams open."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import FrameType

import uvicorn


class ProxyServer(uvicorn.Server):
    """A stop signal (SIGTERM, Ctrl-C) first calls `on_exit`, which ends the adapter event
    streams: they never end on their own, so uvicorn's graceful shutdown would wait them
    out and then cancel them, logging a traceback for each."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]) -> None:
        super().__init__(config)
        self.on_exit = on_exit

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
