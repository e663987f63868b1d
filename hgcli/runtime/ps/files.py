"""Parameter-server checkpoints: one file per shard and version, written atomically.

File ``shard{i}-v{version:010d}.pt`` holds shard i's range of the parameters and its optimizer state after exactly
``version`` applied pushes. It is written to a hidden temp file in the same directory, fsynced, renamed,
and the directory fsynced, so a kill at any moment leaves either the old set of files or the new one.
Every shard passes through the same version numbers (each push goes to every shard), so a *complete*
checkpoint is a version for which every shard's file exists; resume loads the newest complete one.
Shards on different nodes each write into their own node's directory: there the launcher combines
every node's ``versions_by_shard`` (``complete_versions_of``) and names the version to load.
"""
from __future__ import annotations

import os
import re
import time
import zipfile
from pathlib import Path
from typing import Any, BinaryIO, Iterable, Mapping

from ...state import atomic_write, make_private_dirs

FORMAT = "hgtrain-ps-shard/2"       # /2: a shard holds a flat range ("master", "segments"; ps/shards.py)
OLD_FORMATS = {"hgtrain-ps-shard/1": "shards of whole tensors"}
KEEP = 3                                   # own files kept per shard; older ones are removed
_NAME = re.compile(r"^shard(\d+)-v(\d{10})\.pt$")
# Fault injection for tests: seconds to pause after the temp file is written, before it is renamed.
PAUSE_ENV = "HGTRAIN_TEST_CHECKPOINT_PAUSE"


def shard_path(directory: Path, shard: int, version: int) -> Path:
    return directory / f"shard{shard}-v{version:010d}.pt"


def save(directory: Path, shard: int, version: int, state: dict[str, Any]) -> Path:
    import torch   # lazily: the launcher lists checkpoints (``versions_by_shard``) without torch

    def write(fh: BinaryIO) -> None:
        torch.save({"format": FORMAT, "shard": shard, "version": version, **state}, fh)
        pause = float(os.environ.get(PAUSE_ENV) or 0)
        if pause:
            fh.flush()
            time.sleep(pause)

    make_private_dirs(directory)      # 0700 whatever the umask: everything hgtrain writes is private
    final = shard_path(directory, shard, version)
    atomic_write(final, write, mode=0o600)
    _prune(directory, shard)
    return final


def versions_by_shard(directory: Path) -> dict[int, list[int]]:
    """The versions each shard has a (complete, renamed) file of in ``directory``, oldest first."""
    seen: dict[int, list[int]] = {}
    if directory.is_dir():
        for entry in directory.iterdir():
            m = _NAME.match(entry.name)
            if m:
                seen.setdefault(int(m.group(1)), []).append(int(m.group(2)))
    return {shard: sorted(versions) for shard, versions in seen.items()}


def complete_versions_of(listings: Iterable[Mapping[Any, Iterable[int]]], n_shards: int) -> list[int]:
    """Versions that every shard 0..n_shards-1 has, newest first, from the listings of several
    directories (one per node when the shards sit on different nodes). A shard is an int, or its
    string when the listing came as JSON from a node."""
    shards_of: dict[int, set[int]] = {}
    for listing in listings:
        for shard, versions in listing.items():
            for version in versions:
                shards_of.setdefault(int(version), set()).add(int(shard))
    wanted = set(range(n_shards))
    return sorted((v for v, shards in shards_of.items() if shards >= wanted), reverse=True)


def complete_versions(directory: Path, n_shards: int) -> list[int]:
    """Versions for which every shard 0..n_shards-1 has a file in ``directory``, newest first."""
    return complete_versions_of([versions_by_shard(directory)], n_shards)


def load(directory: Path, shard: int, version: int, map_only: bool = False) -> dict[str, Any]:
    """The file's contents; ValueError naming the file when it is not a readable checkpoint of
    this shard and version (garbage, empty, truncated, another object pickled). ``map_only``:
    the tensors memory-mapped, not read (a check of the file)."""
    import pickle

    import torch

    path = shard_path(directory, shard, version)
    try:
        data = torch.load(path, map_location="cpu", weights_only=True, mmap=map_only)
    except (pickle.UnpicklingError, EOFError, RuntimeError, ValueError, AttributeError, KeyError,
            TypeError, IndexError, zipfile.BadZipFile) as exc:
        # Not torch's own text: for a file that does not unpickle it is advice to load it with
        # weights_only=False, which would run whatever the file holds.
        why = ("its contents do not unpickle as a checkpoint" if isinstance(exc, pickle.UnpicklingError)
               else "it is empty or cut short" if isinstance(exc, EOFError)
               else f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:120]}")
        raise ValueError(f"{path}: not a readable checkpoint ({why})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a checkpoint (it holds a {type(data).__name__})")
    older = OLD_FORMATS.get(str(data.get("format")))
    if older:
        raise ValueError(f"{path}: written by an older hgtrain ({older}), which this one cannot resume; "
                         f"start the job without resuming")
    if data.get("format") != FORMAT or data.get("shard") != shard or data.get("version") != version:
        raise ValueError(f"{path}: not a {FORMAT} file for shard {shard} version {version}")
    return data


def intact(directory: Path, shard: int, version: int) -> str | None:
    """Why shard ``shard``'s file of ``version`` is not a readable checkpoint, or None: its zip
    container and every member's CRC, then what :func:`load` checks, with the tensors mapped, not
    read. How a shard checks the other shards' files of a version before choosing it."""
    path = shard_path(directory, shard, version)
    try:
        with zipfile.ZipFile(path) as zf:
            bad = zf.testzip()
    except (OSError, zipfile.BadZipFile, EOFError, ValueError) as exc:
        return f"{path}: {exc}"
    if bad:
        return f"{path}: member {bad} is corrupt"
    try:
        load(directory, shard, version, map_only=True)
    except (OSError, ValueError) as exc:
        return str(exc)
    return None


def remove_temp_files(directory: Path, shard: int) -> None:
    """Leftovers of a write that was killed; never part of a checkpoint."""
    if directory.is_dir():
        for entry in directory.glob(f".shard{shard}-v*.tmp"):
            entry.unlink(missing_ok=True)


def _prune(directory: Path, shard: int) -> None:
    mine = sorted(p for p in directory.glob(f"shard{shard}-v*.pt") if _NAME.match(p.name))
    for old in mine[:-KEEP]:
        old.unlink(missing_ok=True)
