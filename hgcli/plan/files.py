"""The I/O around the pure planner: plan files users write and launch from (its stored inputs are
``plan/pipeline.py``'s job)."""
from __future__ import annotations

import json
from pathlib import Path

from ..state.trusted import read_trusted_text
from ..state.userfile import write_user_file
from ..errors import ConfigError
from ..schema.stages import SCHEMA_VERSION, Cluster, Plan, from_dict, to_json
from .check import PlanProblem, check_plan


def write_plan(path: Path, plan: Plan) -> None:
    """Write a plan file as any ``-o`` output (``userfile``: ``-`` is stdout, a new file 0644, an
    existing one keeps its mode, a device is written in place)."""
    try:
        write_user_file(path, to_json(plan) + "\n")
    except OSError as exc:
        raise ConfigError(f"cannot write plan file: {exc.strerror or exc}", source=str(path)) from exc


def load_plan(path: Path, cluster: Cluster) -> Plan:
    """A plan file made for this cluster; anything else is a ConfigError naming the file."""
    # A plan names the nodes and what each rank runs: trusted only when nobody else could have written it.
    text = read_trusted_text(Path(path), "plan file", "the nodes hgtrain starts ranks on")
    try:
        data = json.loads(text, parse_constant=_refuse_constant)
    except ValueError as exc:
        raise ConfigError(f"not a JSON plan file: {exc}", source=str(path)) from exc
    except RecursionError:
        raise ConfigError("not a JSON plan file: nested too deeply", source=str(path)) from None
    if isinstance(data, dict) and data.get("version", SCHEMA_VERSION) != SCHEMA_VERSION:
        raise ConfigError(f"plan format version {data.get('version')!r}, this hgtrain reads "
                          f"{SCHEMA_VERSION}; run 'hgtrain plan' again", source=str(path))
    try:
        plan = from_dict(Plan, data)
    except RecursionError:
        raise ConfigError("not a valid plan: nested too deeply", source=str(path)) from None
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"not a valid plan: {exc}", source=str(path)) from exc
    try:
        plan = check_plan(plan)
    except PlanProblem as exc:
        raise ConfigError(f"not a valid plan: {exc}; nothing was started", source=str(path)) from exc
    if plan.cluster != cluster.fingerprint():
        raise ConfigError(f"this plan was made for cluster {plan.cluster}, not this cluster "
                          f"({cluster.fingerprint()}); run 'hgtrain plan' for it", source=str(path))
    return plan


def _refuse_constant(name: str) -> float:
    """NaN and Infinity are no JSON (Python's parser takes them): a plan holding one would carry it
    into the job's record and ``launch --json``."""
    raise ValueError(f"{name} is not a number JSON allows")
