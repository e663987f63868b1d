"""Files a user names with ``-o`` (``plan -o``, ``metrics -o``): what is already there is respected.

- ``-`` is stdout.
- A new file is created with mode 0644 (it is the user's output, not state).
- An existing regular file is replaced atomically (temp file, fsync, rename) but keeps its mode
  and, where the writer may give it, its owner: a 0600 file stays 0600.
- A symlink is followed when the user or root owns it: the file it points to is replaced, the link
  stays a link. A link another user owns is refused, as the kernel's ``protected_symlinks`` refuses
  it in a sticky directory: in a shared ``/tmp`` it could aim the write at any file the user may
  write. Only the last component is resolved here; the directories on the way are the kernel's to
  follow, under its own rules (``os.path.realpath`` would follow them in user space, sidestepping
  those rules).
- Anything that is not a regular file (``/dev/stdout``, a terminal, a named pipe) is written in
  place, as ``>`` would: replacing it would put a plain file where the device was (as root,
  ``metrics -o /dev/stdout`` used to replace the ``/dev/stdout`` symlink). Paths that lead into
  ``/proc`` or ``/dev`` (``/dev/stdout`` redirected to a file) count as such: they name an open
  descriptor, not a place to put a new file.
- A directory is refused.
"""
from __future__ import annotations

import errno
import os
import stat
import sys
from pathlib import Path
from typing import TextIO

from . import atomic_write

NEW_FILE_MODE = 0o644
IN_PLACE_ROOTS = ("/proc/", "/dev/")
MAX_LINKS = 40                # the kernel's own limit on links in one lookup


def is_stdout(path: Path | str) -> bool:
    return str(path) == "-"


def write_user_file(path: Path | str, text: str, *, stdout: TextIO | None = None) -> None:
    """Write ``text`` where the user asked (rules above); OSError for the caller to word."""
    if is_stdout(path):
        out = stdout or sys.stdout
        out.write(text)
        out.flush()
        return
    target = _last_link_target(str(path))
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        st = None
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(errno.EISDIR, "Is a directory")
    if target.startswith(IN_PLACE_ROOTS) or (st is not None and not stat.S_ISREG(st.st_mode)):
        with open(target, "w", encoding="utf-8") as fh:
            fh.write(text)
        return
    if st is None:
        atomic_write(Path(target), text, mode=NEW_FILE_MODE)
    else:
        atomic_write(Path(target), text, mode=stat.S_IMODE(st.st_mode), owner=(st.st_uid, st.st_gid))


def _last_link_target(path: str) -> str:
    """``path`` with the symlinks at its last component followed, each owned by the user or root;
    PermissionError at one another user owns. Paths under IN_PLACE_ROOTS are left to the kernel
    (``/dev/stdout`` leads to a descriptor, not to a file name)."""
    for _ in range(MAX_LINKS):
        if path.startswith(IN_PLACE_ROOTS):
            return path
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return path
        if not stat.S_ISLNK(st.st_mode):
            return path
        if st.st_uid not in (os.geteuid(), 0):
            raise PermissionError(errno.EACCES, f"refusing to follow a symlink owned by another user "
                                                f"(uid {st.st_uid}): it chooses which file is written")
        path = os.path.join(os.path.dirname(path), os.readlink(path))
    raise OSError(errno.ELOOP, "Too many levels of symbolic links")
