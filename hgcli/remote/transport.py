"""The protocol every transport implements (SSH via paramiko, local subprocesses).

Stages talk to nodes only through this, so a node declared ``localhost`` and a remote node follow
the same code path, and the launcher's long-running agents fit the same shape as probe's one-shot
commands.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import BinaryIO, Mapping, Protocol, Sequence

from ..schema.stages import NodeSpec


@dataclass(frozen=True)
class Completed:
    """A bounded command's end: its exit code and all of its output."""

    exit_code: int
    stdout: str
    stderr: str


class RemoteProcess(Protocol):
    """A long-running command on a node (node agent, bench).

    ``stdout``/``stderr`` are binary streams read with ``readline`` (one reader thread each);
    closing ``stdin`` is how the controller tells a node agent to stop (it dies on EOF).
    """

    stdin: BinaryIO
    stdout: BinaryIO
    stderr: BinaryIO

    def wait(self, timeout: float | None = None) -> int:
        """Exit code; raises TimeoutError when ``timeout`` passes first."""
        ...

    def close(self) -> None:
        """Drop the process's connection (stdin EOF included); never blocks for long."""
        ...


class Transport(Protocol):
    """How every stage reaches a node: bounded commands, long-running ones, and the package's place there."""

    node: NodeSpec

    def run(self, argv: Sequence[str], *, stdin: bytes | None = None,
            env: Mapping[str, str] | None = None, timeout: float) -> Completed:
        """Run a bounded command. Every argv element is quoted for the remote shell.

        ``env`` travels on the remote command line (``env K=V ...``): never put secrets in it; the
        launcher sends secrets to its agent over stdin instead. Raises RemoteError (host named)
        on connection failure or when ``timeout`` passes.
        """
        ...

    def start(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None) -> RemoteProcess:
        ...

    def package_root(self) -> str:
        """A directory on the node from which ``import hgcli`` works (shipped there if needed)."""
        ...

    def close(self) -> None:
        ...

    def __enter__(self) -> "Transport":
        ...

    def __exit__(self, *exc: object) -> None:
        ...


def node_module_argv(transport: Transport, module: str, *args: str) -> tuple[list[str], dict[str, str]]:
    """argv and env that run ``python -m hgcli.node.<module>`` on the transport's node."""
    node = transport.node
    return [node.python, "-m", f"hgcli.node.{module}", *args], {"PYTHONPATH": transport.package_root()}
