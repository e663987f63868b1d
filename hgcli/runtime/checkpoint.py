"""Parameter-server checkpoints: one file per shard and version, written atomically.

File ``shard{i}-v{version:010d}.pt`` holds shard i's parameters and optimizer state after exactly
``version`` applied pushes. It is written to a hidden temp file in the same directory, fsynced, renamed,
and the directory fsynced, so a kill at any moment leaves either the old set of files or the new one.
Every shard passes through the same version numbers (each push goes to every shard), so a *complete*
checkpoint is a version for which every shard's file exists; resume loads the newest complete one.
"""
from __future__ import annotations

import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

FORMAT = "hgtrain-ps-shard/1"
KEEP = 3                                   # own files kept per shard; older ones are removed
_NAME = re.compile(r"^shard(\d+)-v(\d{10})\.pt$")
# Fault injection for tests: seconds to pause after the temp file is written, before it is renamed.
PAUSE_ENV = "HGTRAIN_TEST_CHECKPOINT_PAUSE"


def shard_path(directory: Path, shard: int, version: int) -> Path:
    return directory / f"shard{shard}-v{version:010d}.pt"


def save(directory: Path, shard: int, version: int, state: dict[str, Any]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    final = shard_path(directory, shard, version)
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save({"format": FORMAT, "shard": shard, "version": version, **state}, fh)
            fh.flush()
            pause = float(os.environ.get(PAUSE_ENV) or 0)
            if pause:
                time.sleep(pause)
            os.fsync(fh.fileno())
        os.replace(tmp, final)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(directory)
    _prune(directory, shard)
    return final


def complete_versions(directory: Path, n_shards: int) -> list[int]:
    """Versions for which every shard 0..n_shards-1 has a file, newest first."""
    seen: dict[int, set[int]] = {}
    if not directory.is_dir():
        return []
    for entry in directory.iterdir():
        m = _NAME.match(entry.name)
        if m:
            seen.setdefault(int(m.group(2)), set()).add(int(m.group(1)))
    wanted = set(range(n_shards))
    return sorted((v for v, shards in seen.items() if shards >= wanted), reverse=True)


def load(directory: Path, shard: int, version: int) -> dict[str, Any]:
    path = shard_path(directory, shard, version)
    data = torch.load(path, map_location="cpu", weights_only=True)
    if data.get("format") != FORMAT or data.get("shard") != shard or data.get("version") != version:
        raise ValueError(f"{path}: not a {FORMAT} file for shard {shard} version {version}")
    return data


def remove_temp_files(directory: Path, shard: int) -> None:
    """Leftovers of a write that was killed; never part of a checkpoint."""
    if directory.is_dir():
        for entry in directory.glob(f".shard{shard}-v*.tmp"):
            entry.unlink(missing_ok=True)


def _prune(directory: Path, shard: int) -> None:
    mine = sorted(p for p in directory.glob(f"shard{shard}-v*.pt") if _NAME.match(p.name))
    for old in mine[:-KEEP]:
        old.unlink(missing_ok=True)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
