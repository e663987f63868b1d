"""Measured rates of a script (``clusters/<fingerprint>/scripts/<key>.json``): learnt from one run,
used by the next plan of the same script.

The bench times a model (the bundled ResNet unless ``--model`` names the user's), each node's devices
stepping together. A script's step is not that model's: its data loading, its layers, and on a node
whose devices share the CPU the contention those add. The runtime measures what each device computed (samples per second of
compute, waits for other members left out, at its mean batch), the launcher stores it at the job's
end under the script's identity, and ``prepare_plan`` fits the bench's per-device costs to it for the
next launch of that script (hgcli/plan/devices.py, ``fit_to_rates``).

A script is the module of ``python -m MODULE`` or the first ``*.py``/``*.sh`` path of the command,
not its arguments: ``train.py --epochs 3`` and ``train.py --epochs 30`` are one script. Rates are
tied to the bench the job planned from: a new bench (new hardware, drivers, torch) drops them.
"""
from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import Mapping, Sequence

from ..errors import StateError
from ..schema.stages import SCHEMA_VERSION, MeasuredRate, Plan, ScriptRates, from_dict, to_dict
from ..state import cluster_dir, read_json, write_json

_SCRIPT_SUFFIXES = (".py", ".sh")


def script_identity(command: Sequence[str]) -> str:
    """What a command runs, without its arguments: ``module pkg.train``, ``script path/train.py``,
    else the whole command (a binary whose arguments are all there is to tell runs apart)."""
    args = list(command)
    for i, arg in enumerate(args):
        if arg == "-m" and i + 1 < len(args):
            return f"module {args[i + 1]}"
        if arg.startswith("-m") and len(arg) > 2 and i > 0:
            return f"module {arg[2:]}"
        if arg.endswith(_SCRIPT_SUFFIXES) and not arg.startswith("-"):
            return f"script {os.path.normpath(arg)}"
    return "command " + " ".join(args)


def rates_path(fingerprint: str, script: str) -> Path:
    key = hashlib.sha256(script.encode("utf-8")).hexdigest()[:20]
    return cluster_dir(fingerprint) / "scripts" / f"{key}.json"


def store_rates(rates: ScriptRates) -> Path:
    path = rates_path(rates.cluster, rates.script)
    write_json(path, to_dict(rates))
    return path


def load_rates(fingerprint: str, script: str) -> ScriptRates | None:
    """The stored rates of that script on that cluster, or None; an unreadable file is a StateError
    naming it (the caller plans from the bench alone and says so)."""
    path = rates_path(fingerprint, script)
    data = read_json(path)
    if data is None:
        return None
    try:
        rates = from_dict(ScriptRates, data)
    except ValueError as exc:
        raise StateError(f"{path}: {exc}") from exc
    if rates.version != SCHEMA_VERSION or rates.script != script or rates.cluster != fingerprint:
        raise StateError(f"{path}: not the rates of {script} on cluster {fingerprint} in this format")
    return rates


def rates_of_job(plan: Plan, job_id: str, command: Sequence[str], bench_measured_at: float,
                 finished: Mapping[int, tuple[float, float, float | None]]) -> ScriptRates | None:
    """The rates a job measured: ``finished`` maps a worker rank to its finish record's (compute
    samples/s, mean batch, compute noise or None). Ranks under an emulated slowdown are left out
    (the slowdown is the cluster file's experiment, not the device). None when no worker reported."""
    measured = []
    for r in plan.workers:
        got = finished.get(r.rank)
        if got is None or r.slowdown:
            continue
        rate, batch, noise = got
        if rate > 0 and batch > 0:
            measured.append(MeasuredRate(node=r.node, device=r.device, batch_size=round(batch, 3),
                                         samples_per_s=round(rate, 3),
                                         noise=None if noise is None else round(noise, 4)))
    if not measured:
        return None
    return ScriptRates(cluster=plan.cluster, script=script_identity(command), job_id=job_id,
                       measured_at=time.time(), bench_measured_at=bench_measured_at, rates=tuple(measured))
