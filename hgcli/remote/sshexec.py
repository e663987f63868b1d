"""Commands on an SSH connection: a bounded one (``run_command``: output, exit code) and a
long-running one (``SshProcess``: streams, for node agents and benchmarks). Every wait is bounded
by us, never by the server: a stalled ``exec`` is dropped by a watchdog, a stalled command by its
timeout.
"""
from __future__ import annotations

import io
import re
import select
import shlex
import threading
import time
from typing import Any, BinaryIO, Callable, Mapping, Sequence, cast

from .sshconnect import SshConnection
from .sshlib import paramiko
from .transport import Completed

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
STREAM_BUFFER = 1 << 16


def command_line(argv: Sequence[str], env: Mapping[str, str] | None = None) -> str:
    """The remote shell command: ``env K=V ... argv`` with every element quoted."""
    words = []
    if env:
        for key, value in env.items():
            if not _ENV_NAME.match(key):
                raise ValueError(f"not an environment variable name: {key!r}")
            words.append(shlex.quote(f"{key}={value}"))
        words.insert(0, "env")
    words.extend(shlex.quote(str(a)) for a in argv)
    return " ".join(words)


def drop(channel: paramiko.Channel) -> None:
    """Close a channel; on a connection that is already gone that is not an error."""
    try:
        channel.close()
    except (EOFError, OSError, paramiko.SSHException):
        pass


class _ChannelStream(io.RawIOBase):
    """One of a channel's output streams as a raw stream, so ``io.BufferedReader`` splits its lines
    (in C). paramiko's own file object splits in Python and re-copies a long line for every 8 KiB
    it reads: a flood of log lines, or one frame of a batch of them, crawled through it."""

    def __init__(self, recv: Callable[[int], bytes]) -> None:
        super().__init__()
        self._recv = recv

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:   # a writable buffer (memoryview) of BufferedReader's
        data = self._recv(len(buffer))   # what has arrived (at least one byte); b"" at EOF
        buffer[:len(data)] = data
        return len(data)


class SshProcess:
    """A command started with ``SshTransport.start``; closing drops its channel (stdin EOF)."""

    def __init__(self, channel: paramiko.Channel) -> None:
        self._channel = channel
        # paramiko's file is not a BinaryIO, but does what RemoteProcess.stdin is used for (write,
        # flush, close).
        self.stdin: BinaryIO = cast(BinaryIO, channel.makefile_stdin("wb"))
        self.stdout: BinaryIO = io.BufferedReader(_ChannelStream(channel.recv), STREAM_BUFFER)
        self.stderr: BinaryIO = io.BufferedReader(_ChannelStream(channel.recv_stderr), STREAM_BUFFER)

    def wait(self, timeout: float | None = None) -> int:
        if not self._channel.status_event.wait(timeout):
            raise TimeoutError(f"still running after {timeout:g} s")
        return self._channel.recv_exit_status()

    def close(self) -> None:
        drop(self._channel)


def open_command(connection: SshConnection, argv: Sequence[str], env: Mapping[str, str] | None,
                 watchdog_s: float | None) -> paramiko.Channel:
    """A session channel running ``argv``. ``exec_command`` waits for the server's reply without
    a bound of its own, so a watchdog closes the channel if the server stalls."""
    line = command_line(argv, env)
    try:
        channel = connection.transport().open_session(timeout=connection.timeout)
    except (paramiko.SSHException, OSError, EOFError) as exc:
        raise connection.fail(f"cannot open a session: {exc or type(exc).__name__}") from None
    watchdog = threading.Timer(watchdog_s or connection.timeout, drop, args=(channel,))
    watchdog.daemon = True
    watchdog.start()
    try:
        channel.exec_command(line)
    except (paramiko.SSHException, OSError, EOFError) as exc:
        drop(channel)
        raise connection.fail(f"the server did not start {argv[0]}: {exc or type(exc).__name__}") from None
    finally:
        watchdog.cancel()
    return channel


def run_command(connection: SshConnection, argv: Sequence[str], stdin: bytes | None,
                env: Mapping[str, str] | None, timeout: float) -> Completed:
    """Run ``argv`` to its end within ``timeout``; RemoteError when it does not, or the connection dies."""
    deadline = time.monotonic() + timeout
    channel = open_command(connection, argv, env, timeout)
    out: list[bytes] = []
    err: list[bytes] = []
    writer = threading.Thread(target=_feed, args=(channel, stdin or b""), daemon=True)
    writer.start()
    try:
        while True:
            # Decide "finished" before draining: data that arrives between the checks is
            # still read below, because the server sends it before the exit status and EOF.
            finished = channel.closed or (channel.exit_status_ready() and channel.eof_received)
            while channel.recv_ready():
                out.append(channel.recv(65536))
            while channel.recv_stderr_ready():
                err.append(channel.recv_stderr(65536))
            if finished:
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise connection.fail(f"timed out after {timeout:g} s running {shlex.join(argv[:3])} "
                                      "(the command did not finish)")
            select.select([channel], [], [], min(remaining, 1.0))
        code = channel.recv_exit_status()   # -1: the server sent none (a signal, or a lost link)
        if code == -1 and connection.dropped(1.0):
            raise connection.fail(f"connection lost while running {shlex.join(argv[:3])}")
    finally:
        drop(channel)
        writer.join(1.0)
    return Completed(code, b"".join(out).decode("utf-8", "replace"),
                     b"".join(err).decode("utf-8", "replace"))


def _feed(channel: paramiko.Channel, data: bytes) -> None:
    """Send stdin from its own thread: a command may write output before it reads its input."""
    try:
        if data:
            channel.sendall(data)
        channel.shutdown_write()
    except (OSError, EOFError, paramiko.SSHException):
        pass   # the command exited or the channel closed; run_command reports what happened
