"""The transport for a node declared ``localhost``/``local``: plain subprocesses, no SSH."""
from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path
from typing import BinaryIO, Mapping, Sequence, cast

from ..errors import RemoteError
from ..schema.stages import NodeSpec
from .transport import Completed


class LocalProcess:
    """A long-running command started by ``LocalTransport.start``: the ``RemoteProcess`` of a local node."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self._popen = popen
        # Started with all three as pipes (LocalTransport.start): buffered binary files, never None.
        self.stdin = cast(BinaryIO, popen.stdin)
        self.stdout = cast(BinaryIO, popen.stdout)
        self.stderr = cast(BinaryIO, popen.stderr)

    @property
    def pid(self) -> int:
        return self._popen.pid

    def wait(self, timeout: float | None = None) -> int:
        try:
            return self._popen.wait(timeout)
        except subprocess.TimeoutExpired as exc:
            raise TimeoutError(str(exc)) from None

    def close(self) -> None:
        # Like an SSH connection dropping: the process sees stdin EOF and its pipes close.
        for stream in (self.stdin, self.stdout, self.stderr):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass
        # The process (an agent) may still be finishing: reap it when it exits. Without this it
        # stayed a zombie child of the controller until some later Popen happened to collect it
        # (subprocess reaps dropped children only then): a stray child after the last job.
        if self._popen.poll() is None:
            threading.Thread(target=self._popen.wait, name=f"hgtrain-reap-{self._popen.pid}",
                             daemon=True).start()


class LocalTransport:
    """The ``Transport`` protocol over local subprocesses, for nodes declared ``localhost``/``local``."""

    def __init__(self, node: NodeSpec) -> None:
        self.node = node

    def _env(self, env: Mapping[str, str] | None) -> dict[str, str]:
        return {**os.environ, **(env or {})}

    def run(self, argv: Sequence[str], *, stdin: bytes | None = None,
            env: Mapping[str, str] | None = None, timeout: float) -> Completed:
        try:
            proc = subprocess.run(list(argv), input=stdin or b"", capture_output=True,
                                  env=self._env(env), timeout=timeout)
        except subprocess.TimeoutExpired:
            raise RemoteError(self.node.name, f"timed out after {timeout:g} s running {argv[0]}") from None
        except OSError as exc:
            raise RemoteError(self.node.name, f"cannot run {argv[0]}: {exc.strerror}") from exc
        return Completed(proc.returncode, proc.stdout.decode("utf-8", "replace"),
                         proc.stderr.decode("utf-8", "replace"))

    def start(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None) -> LocalProcess:
        try:
            popen = subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, env=self._env(env))
        except OSError as exc:
            raise RemoteError(self.node.name, f"cannot run {argv[0]}: {exc.strerror}") from exc
        return LocalProcess(popen)

    def package_root(self) -> str:
        # The controller's own copy: the same code, so nothing needs shipping.
        return str(Path(__file__).resolve().parents[2])

    def close(self) -> None:
        pass

    def __enter__(self) -> "LocalTransport":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
