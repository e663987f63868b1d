"""OpenSSH known_hosts: look a server key up, and add one without losing the file's other lines.

Kept apart from ``sshauth.py`` (and free of paramiko) because it is the security decision of the
transport: it is small enough to read in one sitting and is tested on its own. It understands what
OpenSSH writes: plain and hashed (``|1|salt|hmac``) host names, ``[host]:port`` for non-22 ports,
comma-separated patterns with ``*``/``?`` wildcards and ``!`` negation, and ``@revoked`` keys.
``@cert-authority`` lines are ignored (host certificates are not supported).
"""
from __future__ import annotations

import base64
import binascii
import enum
import fcntl
import hashlib
import hmac
import os
import re
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path


def host_name(address: str, port: int) -> str:
    """The name OpenSSH files a host's key under: ``host`` on port 22, else ``[host]:port``."""
    return address if port == 22 else f"[{address}]:{port}"


def fingerprint(blob: bytes) -> str:
    """OpenSSH's SHA256 fingerprint of a public key blob, as ``ssh-keygen -l`` prints it."""
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


class Verdict(str, enum.Enum):
    """What known_hosts says of a server's key; only KNOWN (or the policy, for UNKNOWN) lets a connection on."""

    KNOWN = "known"
    UNKNOWN = "unknown"
    CHANGED = "changed"
    REVOKED = "revoked"


@dataclass(frozen=True)
class HostKey:
    """A server's public key as the SSH wire carries it, and its OpenSSH fingerprint for messages."""

    key_type: str      # "ssh-ed25519", "ssh-rsa", "ecdsa-sha2-nistp256", ...
    blob: bytes

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.blob)


@dataclass(frozen=True)
class Check:
    """The outcome of a host key look-up, with the keys on file to name when it CHANGED."""

    verdict: Verdict
    known: tuple[HostKey, ...] = ()   # the keys on file for this host (shown when CHANGED)


def _pattern_matches(pattern: str, name: str) -> bool:
    if pattern.startswith("|1|"):
        try:
            _, _, salt, digest = pattern.split("|", 3)
            mac = hmac.new(base64.b64decode(salt), name.encode(), hashlib.sha1).digest()
            return hmac.compare_digest(mac, base64.b64decode(digest))
        except (ValueError, binascii.Error):
            return False
    # OpenSSH's match_pattern: only * and ? are special (brackets of [host]:port are literal).
    regex = "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern.lower())
    return re.fullmatch(regex, name.lower()) is not None


def _line_matches(patterns: str, name: str) -> bool:
    matched = False
    for pattern in patterns.split(","):
        if pattern.startswith("!"):
            if _pattern_matches(pattern[1:], name):
                return False
        elif _pattern_matches(pattern, name):
            matched = True
    return matched


def _entries(path: Path, name: str) -> tuple[list[HostKey], list[HostKey]]:
    """(keys on file for ``name``, revoked keys) from ``path``; a missing file has none."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return [], []
    known: list[HostKey] = []
    revoked: list[HostKey] = []
    for line in text.splitlines():
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        marker = None
        if fields[0].startswith("@"):
            marker, fields = fields[0], fields[1:]
        if len(fields) < 3 or marker == "@cert-authority":
            continue
        if not _line_matches(fields[0], name):   # @revoked lines usually say "*"
            continue
        try:
            key = HostKey(fields[1], base64.b64decode(fields[2], validate=True))
        except (ValueError, binascii.Error):
            continue
        (revoked if marker == "@revoked" else known).append(key)
    return known, revoked


def known_key_types(path: Path, name: str) -> list[str]:
    """Key types on file for ``name``, so the handshake can ask the server for one we can check."""
    return list(dict.fromkeys(k.key_type for k in _entries(path, name)[0]))


def check(path: Path, name: str, key: HostKey) -> Check:
    """KNOWN when ``key`` is on file for ``name``; CHANGED when other keys are (of any type: a
    server that stops offering the type we know is treated like a changed key); UNKNOWN otherwise."""
    known, revoked = _entries(path, name)
    if key in revoked:
        return Check(Verdict.REVOKED)
    if key in known:
        return Check(Verdict.KNOWN, tuple(known))
    if known:
        return Check(Verdict.CHANGED, tuple(known))
    return Check(Verdict.UNKNOWN)


# One writer at a time within this process; flock on the directory serialises other processes
# (a lock on the file itself would not survive the atomic rename).
_write_lock = threading.Lock()


def add(path: Path, name: str, key: HostKey) -> None:
    """Append ``name key`` atomically: other lines are kept byte for byte, a concurrent writer
    cannot lose them, and a crash leaves the old file intact. A key already on file is not re-added."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with _write_lock:
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            fcntl.flock(dir_fd, fcntl.LOCK_EX)
            if check(path, name, key).verdict is Verdict.KNOWN:
                return
            try:
                old = path.read_bytes()
                mode = path.stat().st_mode & 0o777
            except FileNotFoundError:
                old, mode = b"", 0o600
            if old and not old.endswith(b"\n"):
                old += b"\n"
            line = f"{name} {key.key_type} {base64.b64encode(key.blob).decode()}\n".encode()
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
            try:
                with os.fdopen(fd, "wb") as fh:
                    fh.write(old + line)
                    fh.flush()
                    os.fsync(fh.fileno())
                os.chmod(tmp, mode)
                os.replace(tmp, path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        finally:
            os.close(dir_fd)   # releases the flock
