"""Die with the controller's connection: exit when stdin reaches EOF.

Without a PTY, sshd does not signal a remote command when the client goes away, so a benchmark left
running would hold a GPU for nobody. The controller keeps our stdin open for as long as it wants us
and closes it (or loses the connection) to stop us.
"""
from __future__ import annotations

import os
import sys
import threading

EXIT_LIFELINE = 143  # as if terminated: the controller stopped listening


def watch_stdin() -> None:
    def watch() -> None:
        # os.read on the descriptor, not sys.stdin.buffer: a daemon thread blocked inside the buffered
        # reader holds its lock, and an interpreter exiting on an uncaught error then aborts (SIGABRT,
        # "could not acquire lock ... at interpreter shutdown") instead of exiting with its own code.
        fd = sys.stdin.fileno()
        try:
            while os.read(fd, 4096):
                pass
        except (OSError, ValueError):
            pass
        os._exit(EXIT_LIFELINE)

    threading.Thread(target=watch, name="lifeline", daemon=True).start()
