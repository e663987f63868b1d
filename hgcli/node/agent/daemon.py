"""Detach the agent from its connection (``hgtrain launch --detach``).

Classic double fork: the first child calls setsid (no controlling terminal, its own session, so the
sshd session ending sends it nothing) and forks the daemon, then exits at once so the original agent
can reap it and return. The daemon keeps the connection's stdout only until it has reported the
started ranks (``Supervisor._detach_output``), then writes to ``agent.log`` in the job directory.
Must run before any thread exists: fork copies only the calling thread.
"""
from __future__ import annotations

import os


def detach() -> bool:
    """True in the daemon; False in the original process, which should exit 0 right away."""
    pid = os.fork()
    if pid > 0:
        os.waitpid(pid, 0)   # the intermediate child exits immediately: no zombie, bounded
        return False
    try:
        os.setsid()
        if os.fork() > 0:
            os._exit(0)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
    except OSError:
        os._exit(1)
    return True
