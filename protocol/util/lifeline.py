"""Child processes that end with the process that started them, however it ends.

The embedded default (`learner run`) starts a proxy, actors and a scoring worker. When
the learner exits normally it stops them; when it is killed outright (SIGKILL, the OOM
killer) nothing of it runs, and they would go on without it. A lifeline is a pipe whose
only write end the parent holds: the kernel closes it when the parent dies, whatever
killed it, and each child, reading its end in a daemon thread, sees end-of-file and sends
itself SIGTERM, so it stops the way it always does (actors hand back their leases).

    lifeline = Lifeline()                                   # parent
    subprocess.Popen(cmd, env={**env, **lifeline.env()}, pass_fds=lifeline.pass_fds)

    follow_lifeline()                                       # child, first thing in main()
"""

from __future__ import annotations

import logging
import os
import signal
import threading

ENV = "SPOTGRPO_LIFELINE_FD"

log = logging.getLogger(__name__)


class Lifeline:
    """The parent's side: a pipe it never writes to (both ends close-on-exec; the read
    end is passed to children by `pass_fds`, which makes it theirs alone)."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()

    def env(self) -> dict[str, str]:
        return {ENV: str(self._read)}

    @property
    def pass_fds(self) -> tuple[int, ...]:
        return (self._read,)

    def close(self) -> None:
        """Cut it on purpose: every child that follows it is sent SIGTERM."""
        for fd in (self._write, self._read):
            try:
                os.close(fd)
            except OSError:
                pass


def follow_lifeline() -> None:
    """The child's side: SIGTERM to this process when the parent's end closes. Does
    nothing unless started with a lifeline; the variable is removed, so this process's
    own children (which are not passed the descriptor) do not read an unrelated one."""
    value = os.environ.pop(ENV, None)
    if value is None:
        return
    try:
        fd = int(value)
        os.fstat(fd)
    except (ValueError, OSError):
        log.warning("%s=%r names no open descriptor: not following the parent", ENV, value)
        return

    def wait() -> None:
        try:
            while os.read(fd, 1):
                pass
        except OSError:
            pass
        log.warning("the process that started this one is gone: stopping")
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=wait, name="lifeline", daemon=True).start()
