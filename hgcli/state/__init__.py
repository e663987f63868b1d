"""The state directory: cached inventory and profiles, job records. Private (0700 dir, 0600 files).

Every write is atomic (temp file in the same directory, fsync, rename) so a crash or a full disk never
leaves a half-written record, and the previous version stays intact.

The package is the ground floor that every stage writes through (docs/architecture.md, "Layers"):
this module (the directory and atomic writes; also used on nodes, standard library only), the job
records that ``launch`` writes and ``jobs`` reads (``records``) and the files a user names with
``-o`` (``userfile``).
"""
from __future__ import annotations

import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any, BinaryIO, Callable

from ..errors import StateError
from ..schema.deepjson import loads_bounded


def state_dir() -> Path:
    """$HGTRAIN_STATE_DIR, else $XDG_STATE_HOME/hgtrain, else ~/.local/state/hgtrain; created 0700."""
    root = os.environ.get("HGTRAIN_STATE_DIR")
    if root:
        path = Path(root).expanduser()
    else:
        base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
        path = Path(base) / "hgtrain"
    return ensure_private_dir(path)


def ensure_private_dir(path: Path) -> Path:
    """``path``, with every directory this call creates on the way to it 0700. An existing directory
    keeps its mode (``HGTRAIN_STATE_DIR=/tmp`` must not take /tmp from everyone, nor ``$HOME`` from a
    web server), but one that another user owns or that group or others may write is refused: they
    could replace the records hgtrain reads (a record names the cluster status and stop contact)."""
    try:
        if not make_private_dirs(path):
            _check_not_shared(path)
    except OSError as exc:
        raise StateError(f"state directory {path}: {exc.strerror or exc}") from exc
    return path


def make_private_dirs(path: Path) -> int:
    """Create ``path`` and its missing parents, each 0700 whatever the umask; how many were created
    (0: it existed, and keeps its mode). OSError for the caller to word."""
    missing = []
    here = path
    while not here.is_dir():
        missing.append(here)
        here = here.parent
    # mkdir's mode is filtered by the umask (a umask of 000 would leave 0777 parents, as
    # mkdir(parents=True) and os.makedirs do) and ignored for existing dirs: set it explicitly.
    for directory in reversed(missing):
        directory.mkdir(mode=0o700, exist_ok=True)
        os.chmod(directory, 0o700)
    return len(missing)


def _check_not_shared(path: Path) -> None:
    st = path.stat()
    if st.st_uid != os.geteuid():
        raise StateError(f"state directory {path} belongs to another user (uid {st.st_uid}): hgtrain "
                         "keeps its records in a directory of its own user only")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise StateError(f"state directory {path} is writable by others (mode {stat.S_IMODE(st.st_mode):04o}): "
                         "hgtrain keeps its records in a private directory; point HGTRAIN_STATE_DIR "
                         "at a directory of your own (it is created 0700)")


def write_private(path: Path, text: str) -> None:
    """Atomically replace ``path`` with ``text``, mode 0600."""
    ensure_private_dir(path.parent)
    try:
        atomic_write(path, text, mode=0o600)
    except OSError as exc:
        raise StateError(f"cannot write {path}: {exc.strerror or exc}") from exc


def atomic_write(path: Path, content: str | Callable[[BinaryIO], None], *, mode: int,
                 owner: tuple[int, int] | None = None) -> None:
    """Replace ``path`` with ``content`` (text, or a function writing bytes to the file): a temp file in
    the same directory, fsync, rename, fsync of the directory; a reader never sees half a file and a
    crash at any moment leaves the old file or the new one. Raises OSError for the caller to word
    (state vs user file). Also used on nodes (PS checkpoints): imports nothing beyond the stdlib.
    ``owner`` (uid, gid): given to the new file where allowed (root replacing a user's file)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        if owner is not None:
            try:
                os.fchown(fd, *owner)
            except PermissionError:
                pass   # not ours to give away: the new file is the writer's, as any file it creates
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as fh:
            if isinstance(content, str):
                fh.write(content.encode("utf-8"))
            else:
                content(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:   # also a KeyboardInterrupt: never leave the temp file behind
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    """Makes the rename itself durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: Path, data: Any) -> None:
    write_private(path, json.dumps(data, indent=2) + "\n")


def read_json(path: Path) -> Any | None:
    """The stored JSON, or None when absent; a corrupt file is a StateError naming it. Opened without
    blocking and read only when it is a regular file (a named pipe put there would hang ``status``),
    its nesting bounded (schema/deepjson.py: a deep record would break every reader after it)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StateError(f"cannot read {path}: {exc.strerror or exc}") from exc
    try:
        with os.fdopen(fd, "rb") as fh:
            if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                raise StateError(f"cannot read {path}: not a regular file")
            return loads_bounded(fh.read())
    except OSError as exc:
        raise StateError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except ValueError as exc:
        raise StateError(f"cannot read {path}: {exc}") from exc


def cluster_dir(fingerprint: str) -> Path:
    """Per-cluster cache (inventory.json, profiles.json), keyed by Cluster.fingerprint()."""
    return ensure_private_dir(state_dir() / "clusters" / fingerprint)
