"""The SSH transport: the ``Transport`` protocol over paramiko, one connection per node reused by
every command of a stage.

Why paramiko rather than the ``ssh`` binary: one process, connections reused by every command of a
stage, and every wait bounded by us. The work is split by job: the connection and its hops
(``sshconnect``), host keys and authentication (``sshauth``), commands on the connection
(``sshexec``), and here the node's copy of the package (``NodePackage``) and the transport that
ties them together. paramiko itself is imported once, in ``sshlib``.
"""
from __future__ import annotations

import getpass
import threading
from typing import Mapping, Sequence

from . import ship
from .sshconnect import SshConnection
from .sshexec import SshProcess, drop, open_command, run_command
from .transport import Completed, Transport
from ..schema.stages import NodeSpec, SshSettings


class NodePackage:
    """Where this controller's ``hgcli`` package is on one node, and whether this session has seen
    it there: remembered from an earlier session (``ship.remembered_root``), a root is only trusted
    once a command run behind ``ship.GUARD_SCRIPT`` found it, else it is shipped again."""

    def __init__(self, node: NodeSpec) -> None:
        self.node = node
        self.root: str | None = None
        self.verified = False   # seen on the node during this session

    def target(self) -> str:
        """Who this connection reaches, as the key of the remembered package location."""
        via = f" via {self.node.proxy_jump}" if self.node.proxy_jump else ""
        return f"{self.node.user or getpass.getuser()}@{self.node.address}:{self.node.port}{via}"

    def locate(self, transport: Transport) -> str:
        """Remembered from an earlier session (checked when first used), else checked/shipped now."""
        if self.root is None:
            remembered = ship.remembered_root(self.target())
            if remembered is None:
                self.ship(transport)
            else:
                self.root, self.verified = remembered, False
        return str(self.root)

    def ship(self, transport: Transport) -> None:
        self.root = ship.ensure_package(transport)
        self.verified = True
        ship.remember_root(self.target(), self.root)

    def unverified(self, env: Mapping[str, str] | None) -> bool:
        """A command of the remembered package (PYTHONPATH is its root) before the root was seen."""
        return (not self.verified and self.root is not None
                and env is not None and env.get("PYTHONPATH") == self.root)

    def guarded(self, argv: Sequence[str]) -> list[str]:
        """``argv`` behind the guard: it answers "missing" instead of running when the root is gone."""
        return ["sh", "-c", ship.GUARD_SCRIPT, "sh", str(self.root), *argv]

    def env(self, env: Mapping[str, str] | None) -> dict[str, str]:
        """``env`` for a node program after a fresh ship (the root may have moved)."""
        return {**(env or {}), "PYTHONPATH": str(self.root)}


class SshTransport:
    """Connects on first use (through ``proxy_jump`` if set), then runs every command on that one
    connection. Close it (or use it as a context manager) to drop the connection."""

    def __init__(self, node: NodeSpec, ssh: SshSettings) -> None:
        self.node = node
        self.ssh = ssh
        self.connection = SshConnection(node, ssh)
        self.package = NodePackage(node)

    def run(self, argv: Sequence[str], *, stdin: bytes | None = None,
            env: Mapping[str, str] | None = None, timeout: float) -> Completed:
        if not self.package.unverified(env):
            return run_command(self.connection, argv, stdin, env, timeout)
        # The package root was remembered from an earlier session: check it in the same command.
        result = run_command(self.connection, self.package.guarded(argv), stdin, env, timeout)
        if not ship.says_missing(result):
            self.package.verified = True
            return result
        self.package.ship(self)
        return run_command(self.connection, argv, stdin, self.package.env(env), timeout)

    def start(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None) -> SshProcess:
        if not self.package.unverified(env):
            return SshProcess(open_command(self.connection, argv, env, None))
        # A package remembered from an earlier session: the guard's sh test checks it on a second
        # channel while the command starts, so the check adds no round trip. Such a command is a
        # node program (PYTHONPATH is the package): without its package it only fails to import
        # it, so when the check says the package is gone it is dropped, the package shipped, and
        # the command started again.
        self.connection.transport()   # connect once, before the two channels
        found: list[Completed | BaseException] = []

        def check() -> None:
            try:
                found.append(run_command(self.connection, self.package.guarded(["true"]), None, None,
                                         ship.SHIP_TIMEOUT_S))
            except BaseException as exc:   # noqa: BLE001 - raised below, on the caller's thread
                found.append(exc)

        checker = threading.Thread(target=check, name=f"package check {self.node.name}", daemon=True)
        checker.start()
        try:
            channel = open_command(self.connection, argv, env, None)
        finally:
            checker.join()
        result = found[0]
        if isinstance(result, BaseException) or ship.says_missing(result):
            drop(channel)
            if isinstance(result, BaseException):
                raise result
            self.package.ship(self)
            channel = open_command(self.connection, argv, self.package.env(env), None)
        self.package.verified = True
        return SshProcess(channel)

    def package_root(self) -> str:
        """Remembered from an earlier session (checked when first used), else checked/shipped now."""
        return self.package.locate(self)

    def close(self) -> None:
        self.connection.close()

    def __enter__(self) -> "SshTransport":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
