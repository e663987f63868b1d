"""Files a user names with ``-o`` (``plan -o``, ``metrics -o``): what is already there is respected.

- ``-`` is stdout.
- A new file is created with mode 0644 (it is the user's output, not state).
- An existing regular file is replaced atomically (temp file, fsync, rename) but keeps its mode
  and, where the writer may give it, its owner: a 0600 file stays 0600.
- A symlink is followed: the file it points to is replaced, the link stays a link.
- Anything that is not a regular file (``/dev/stdout``, a terminal, a named pipe) is written in
  place, as ``>`` would: replacing it would put a plain file where the device was (as root,
  ``metrics -o /dev/stdout`` used to replace the ``/dev/stdout`` symlink). Paths that lead into
  ``/proc`` or ``/dev`` (``/dev/stdout`` redirected to a file) count as such: they name an open
  descriptor, not a place to put a new file.
- A directory is refused.
"""
from __future__ import annotations

import os
import stat
import sys
from pathlib import Path
from typing import TextIO

from . import atomic_write

NEW_FILE_MODE = 0o644
IN_PLACE_ROOTS = ("/proc/", "/dev/")


def is_stdout(path: Path | str) -> bool:
    return str(path) == "-"


def write_user_file(path: Path | str, text: str, *, stdout: TextIO | None = None) -> None:
    """Write ``text`` where the user asked (rules above); OSError for the caller to word."""
    if is_stdout(path):
        out = stdout or sys.stdout
        out.write(text)
        out.flush()
        return
    target = Path(os.path.realpath(path))
    try:
        st = os.stat(target)
    except FileNotFoundError:
        st = None
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(21, "Is a directory")
    if st is not None and (not stat.S_ISREG(st.st_mode) or str(target).startswith(IN_PLACE_ROOTS)):
        with open(target, "w", encoding="utf-8") as fh:
            fh.write(text)
        return
    if st is None:
        atomic_write(target, text, mode=NEW_FILE_MODE)
    else:
        atomic_write(target, text, mode=stat.S_IMODE(st.st_mode), owner=(st.st_uid, st.st_gid))
