"""uvicorn's server, stopping cleanly with event streams open."""

from __future__ import annotations

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
