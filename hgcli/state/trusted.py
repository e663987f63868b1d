"""Reading a file that changes what runs or where it runs (the cluster file, a hostfile, an env file,
a plan file, the ssh config): trusted only when nobody else could have written it.

The rule is OpenSSH's ``StrictModes``: the file is owned by the user or root and neither group nor
others may write it, and its directory is not one anyone may write without the sticky bit (where
anyone could replace it). The file is opened once and checked through that descriptor, so what is
checked is what is read; it must be a regular file (a named pipe would block the read forever).
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

from ..errors import ConfigError

# Larger than any plan or config a cluster needs; a bound so a mistaken path (a disk image) is refused
# rather than read into memory.
MAX_BYTES = 64 << 20


def read_trusted_text(path: Path, what: str, stake: str) -> str:
    """The file's UTF-8 text; a ConfigError naming the file and the fix where it cannot be trusted.
    ``what`` names the file ("env file"); ``stake`` says what its writer controls ("what runs in every
    rank"), for the refusal."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(f"cannot read {what}: {exc.strerror or exc}", source=str(path)) from exc
    try:
        st = os.fstat(fd)
        _check_trusted(path, st, what, stake)
        data = _read_bounded(fd, what, path)
    except OSError as exc:
        raise ConfigError(f"cannot read {what}: {exc.strerror or exc}", source=str(path)) from exc
    finally:
        os.close(fd)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what} is not UTF-8 text: {exc.reason}", source=str(path)) from exc


def _check_trusted(path: Path, st: os.stat_result, what: str, stake: str) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{what} is not a regular file", source=str(path))
    if st.st_uid not in (os.geteuid(), 0):
        raise ConfigError(f"refusing a {what} owned by another user (uid {st.st_uid}): whoever owns it "
                          f"chooses {stake}; use a copy of your own", source=str(path))
    if st.st_mode & (stat.S_IWOTH | stat.S_IWGRP):
        who = "world" if st.st_mode & stat.S_IWOTH else "group"
        raise ConfigError(f"refusing a {who}-writable {what}: others could choose {stake}; run: "
                          f"chmod go-w {path}", source=str(path))
    parent = path.resolve().parent
    mode = parent.stat().st_mode
    if mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
        raise ConfigError(f"refusing a {what} in a world-writable directory ({parent}) without the sticky "
                          f"bit: anyone could replace it", source=str(path))


def _read_bounded(fd: int, what: str, path: Path) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > MAX_BYTES:
            raise ConfigError(f"{what} is larger than {MAX_BYTES >> 20} MiB: not a {what}", source=str(path))
        chunks.append(chunk)
