"""Put this controller's ``hgcli`` package on a node, content-addressed, so node code never drifts.

The copy lives in ``~/.cache/hgtrain/pkg-<16 hex of sha256 over the package files>/hgcli`` on the
node. Because the name is the content hash, a present directory is the right code: one cheap
command checks for it and nothing is copied again. Otherwise a tar goes over stdin and the node's
own Python extracts it (no scp/sftp, nothing but Python needed) into a temporary directory that is
then renamed into place, so a reader never sees half a package and two controllers shipping at once
both end with the same complete copy. ``~`` is expanded by the node's Python: a quoted ``~`` on a
command line would not be.

The controller remembers where it found the package on each node (state dir, ``shipped/``), so a
later stage skips the check round trip: its node command runs behind ``GUARD_SCRIPT``, a tiny sh
test that the directory still exists, and the transport ships again and reruns only if it does not.
"""
from __future__ import annotations

import functools
import hashlib
import io
from pathlib import Path

from .. import state
from ..errors import RemoteError, StateError
from ..node import frames
from ..node.protocol import FrameType, first, frame_type
from .transport import Completed, Transport

PACKAGE_DIR = Path(__file__).resolve().parents[1]
SHIP_TIMEOUT_S = 120.0

# Both scripts run with ``python -c`` on the node and answer with one frame, so login-shell noise on
# stdout cannot be mistaken for the answer. Standard library only: the package is not there yet
# (so the frame is written out here: a ``ship`` frame, see hgcli.node.protocol).
#
# The code there is run by the agent, so it must be this user's alone: ``unsafe`` walks ~/.cache,
# ~/.cache/hgtrain (either may be a link), the package directory and every entry below it (the .py
# files and the __pycache__ that Python writes beside them), and refuses any that another user
# owns, that group or others may write, or (below the cache) that is a symbolic link. Both scripts
# answer "unsafe" with the first such path instead of using or extending it (the controller refuses
# the node in one line).
_PRELUDE = r"""
import json, os, stat, sys
cache = os.path.join(os.path.expanduser("~"), ".cache")
root = os.path.join(cache, "hgtrain", "pkg-" + sys.argv[1])
def answer(state, why=None):
    sys.stdout.write("\x1ehgtrain " + json.dumps({"type": "%s", "state": state, "root": root, "why": why}) + "\n")
def problem(path, follow=False):
    st = os.stat(path) if follow else os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return path + " is a symbolic link"
    if st.st_uid != os.geteuid():
        return "%%s belongs to another user (uid %%d)" %% (path, st.st_uid)
    if st.st_mode & 0o022:
        return "%%s is writable by others (mode %%04o)" %% (path, stat.S_IMODE(st.st_mode))
def unsafe():
    for path in (cache, os.path.dirname(root)):
        why = os.path.exists(path) and problem(path, follow=True)   # ~/.cache may be a link to a bigger disk
        if why:
            return why
    if not os.path.lexists(root):
        return None
    why = problem(root)
    if why:
        return why
    for top, dirs, files in os.walk(root):
        for name in dirs + files:
            why = problem(os.path.join(top, name))
            if why:
                return why
why = unsafe()
if why:
    answer("unsafe", why)
    sys.exit(0)
""" % FrameType.SHIP.value

CHECK_SCRIPT = _PRELUDE + r"""
answer("present" if os.path.isdir(os.path.join(root, "hgcli")) else "missing")
"""

EXTRACT_SCRIPT = _PRELUDE + r"""
import io, shutil, tarfile, tempfile
os.umask(0o077)   # private to this user whatever the session's umask (parents made on the way too)
if not os.path.isdir(root):
    cache = os.path.dirname(root)
    os.makedirs(cache, mode=0o700, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".incoming-", dir=cache)
    try:
        with tarfile.open(fileobj=io.BytesIO(sys.stdin.buffer.read()), mode="r:gz") as tar:
            if hasattr(tarfile, "data_filter"):
                tar.extractall(tmp, filter="data")
            else:
                tar.extractall(tmp)
        try:
            os.rename(tmp, root)
        except OSError:
            if not os.path.isdir(root):   # not "another shipper won the race": a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
answer("shipped")
"""


# ``sh -c GUARD_SCRIPT sh <root> <command...>``: run the command only if the package is still at
# <root> (someone may have cleared ~/.cache) and still this user's; else answer "missing" with
# MISSING_EXIT, and the transport checks (and refuses, or ships) again. No Python start-up and no
# process of its own, so a node command costs one round trip, as with a plain ssh; the full walk
# of ``unsafe`` runs whenever the package is checked or shipped.
GUARD_SCRIPT = ('{ [ -d "$1/hgcli" ] && [ -O "$1" ] && [ -O "$1/hgcli" ] && [ -O "$1/.." ]; } || '
                '{ printf \'\\036hgtrain {"type":"%s","state":"missing"}\\n\'; '
                'exit 97; }; shift; exec "$@"') % FrameType.SHIP.value
MISSING_EXIT = 97


@functools.lru_cache(maxsize=1)
def package_files() -> tuple[tuple[str, bytes], ...]:
    """(path inside the archive, content) of every .py file and py.typed, sorted; no caches."""
    files = []
    for path in sorted(PACKAGE_DIR.rglob("*")):
        if "__pycache__" in path.parts or not path.is_file():
            continue
        if path.suffix == ".py" or path.name == "py.typed":
            files.append((f"hgcli/{path.relative_to(PACKAGE_DIR).as_posix()}", path.read_bytes()))
    return tuple(files)


@functools.lru_cache(maxsize=1)
def package_digest() -> str:
    h = hashlib.sha256()
    for name, data in package_files():
        h.update(name.encode() + b"\0" + len(data).to_bytes(8, "big") + data)
    return h.hexdigest()[:16]


def package_tar() -> bytes:
    import tarfile   # only when the package is shipped, not on every launch that finds it there

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in package_files():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _answer(transport: Transport, script: str, stdin: bytes | None) -> dict:
    node = transport.node
    result = transport.run([node.python, "-c", script, package_digest()], stdin=stdin, timeout=SHIP_TIMEOUT_S)
    frame = first(frames.decode_lines(result.stdout), FrameType.SHIP)
    if frame is not None:
        return frame
    if result.exit_code == 127:
        raise RemoteError(node.name, f"Python interpreter {node.python!r} not found on the node (set "
                                     "`python` for this node in the cluster file)")
    last = (result.stderr.strip().splitlines() or ["no output"])[-1]
    raise RemoteError(node.name, f"cannot install hgtrain's node code under ~/.cache/hgtrain with "
                                 f"{node.python} (exit code {result.exit_code}): {last}")


def ensure_package(transport: Transport) -> str:
    """The directory to put on the node's PYTHONPATH; ships the package there if it is missing."""
    frame = _answer(transport, CHECK_SCRIPT, None)
    if frame["state"] == "missing":
        frame = _answer(transport, EXTRACT_SCRIPT, package_tar())
    if frame["state"] == "unsafe":
        raise RemoteError(transport.node.name, f"refusing to run hgtrain's node code from {frame['root']}: "
                                               f"{frame.get('why')}; only this user may write the package "
                                               "cache (remove it, or chmod go-w it)")
    return str(frame["root"])


def says_missing(result: Completed) -> bool:
    """True when a guarded command did not run because the package directory is gone."""
    if result.exit_code != MISSING_EXIT:
        return False
    return any(frame_type(f) is FrameType.SHIP and f.get("state") == "missing"
               for f in frames.decode_lines(result.stdout))


def _record_path(target: str) -> Path:
    name = hashlib.sha256(target.encode()).hexdigest()[:16]
    return state.ensure_private_dir(state.state_dir() / "shipped") / f"{name}.json"


def remembered_root(target: str) -> str | None:
    """Where this package was found on ``target`` (``user@host:port``) before, if it was."""
    try:
        record = state.read_json(_record_path(target))
    except StateError:
        return None    # a damaged record only costs a check
    if isinstance(record, dict) and record.get("target") == target and record.get("digest") == package_digest():
        root = record.get("root")
        return root if isinstance(root, str) else None
    return None


def remember_root(target: str, root: str) -> None:
    state.write_json(_record_path(target), {"target": target, "digest": package_digest(), "root": root})
