"""One exception root carrying its exit code, so the CLI maps any failure to a documented code.

Nothing below ``cli.py`` calls ``sys.exit``; it raises one of these instead.
"""
from __future__ import annotations

# The exit-code table (docs/cli.md repeats it; scripts depend on it, so never renumber).
EXIT_OK = 0
EXIT_ERROR = 1          # unexpected internal failure
EXIT_USAGE = 2          # bad flags or a bad input file (cluster, plan, hostfile); nothing contacted;
                        # or a plan whose ranks a node's Python cannot run (a module missing); nothing started
EXIT_NODES_FAILED = 4   # some nodes could not be reached or failed; healthy ones still reported
EXIT_STATE = 5          # the state directory cannot be read or written
EXIT_JOB = 6            # a job could not start (rendezvous, agent start) or a job id is unknown
EXIT_INTERRUPTED = 130  # Ctrl-C / SIGINT
EXIT_TERMINATED = 143   # SIGTERM to hgtrain, or the job stopped by `hgtrain stop` from elsewhere


class HgError(Exception):
    """Root of every error hgtrain reports to a user: one line, no traceback unless --debug."""

    exit_code: int = EXIT_ERROR

    def __init__(self, message: str, *, exit_code: int | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class UsageError(HgError):
    """Bad flags or arguments."""

    exit_code = EXIT_USAGE


class ConfigError(HgError):
    """A bad cluster file, hostfile, plan file or Slurm node list; the message names file:line."""

    exit_code = EXIT_USAGE

    def __init__(self, message: str, *, source: str | None = None) -> None:
        super().__init__(f"{source}: {message}" if source else message)
        self.source = source


class RemoteError(HgError):
    """A node failed (connect, auth, host key, timeout, remote command); the message names the host."""

    exit_code = EXIT_NODES_FAILED

    def __init__(self, host: str, message: str) -> None:
        super().__init__(f"{host}: {message}")
        self.host = host
        self.reason = message


class NodesFailedError(HgError):
    """Some nodes (or their devices) failed a stage; the message names them. The healthy ones were still
    reported."""

    exit_code = EXIT_NODES_FAILED


class NodePythonError(HgError):
    """A node's Python lacks a module that the plan's ranks (or the bench) import; the message names
    node and module and says how to install it. Nothing was started."""

    exit_code = EXIT_USAGE


class StateError(HgError):
    """The state directory (job records, cached inventory and profiles) is unusable."""

    exit_code = EXIT_STATE


class JobError(HgError):
    """A job could not start, or the job id is unknown."""

    exit_code = EXIT_JOB
