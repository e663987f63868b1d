"""Frozen dataclasses and str-Enums passed between the stages: the one place their users import them from.

cluster.toml -> Cluster -> (probe) Inventory -> (bench) Profiles -> (plan) Plan -> (launch) Job.
Every value here serialises to plain JSON with ``to_dict`` and back with ``from_dict``; the ``--json``
output of a stage is exactly that, so scripts can chain stages. Standard library only: shipped to nodes
with the node-side code.

The values are defined one module per stage (``cluster``, ``inventory``, ``profiles``, ``plan``, ``job``,
on the common ground of ``base``) so that each stays small; this module only re-exports them. It is
kept, rather than having a hundred importers name the stage modules, because the pipeline is one
contract: a user of the types reads and imports it in one place, and a value can move between the
stage modules without touching them.
"""
from __future__ import annotations

# The generic JSON conversion, re-exported: stages import it from here with the classes. Its own
# module so node programs that parse only their own dataclasses need not create these.
from . import codec
from .base import CPU, SCHEMA_VERSION, Device, digest, frozen_map
from .cluster import Cluster, EmulateSpec, HostKeyPolicy, NodeSpec, Slowdown, SrunSettings, SshSettings
from .inventory import GpuInfo, Inventory, NodeInfo, PythonRuntime
from .job import JobRecord, RankRecord
from .plan import (
    PLAN_NEEDS, Engine, GroupPlan, Ideal, JobSpec, Plan, Prediction, RankMemory, RankPlan, Role, Strategy, Wire,
    prediction,
)
from .profiles import (
    GATHERED_UNITS, ActivationSample, DeviceProfile, ExchangeProfile, GroupSyncProfile, LinkProfile, MeasuredRate, Measurement,
    MemoryProfile, ModelSpec, Profiles, ScriptRates, StepSample, TogetherProfile, TogetherStep,
)
# The states, re-exported: a rank's state is the same member on the node and in the job record.
from .states import JobState, RankState

to_dict, to_json, from_dict = codec.to_dict, codec.to_json, codec.from_dict

__all__ = [
    "codec", "to_dict", "to_json", "from_dict", "JobState", "RankState",
    "CPU", "SCHEMA_VERSION", "Device", "digest", "frozen_map",
    "Cluster", "EmulateSpec", "HostKeyPolicy", "NodeSpec", "Slowdown", "SrunSettings", "SshSettings",
    "GpuInfo", "Inventory", "NodeInfo", "PythonRuntime",
    "GATHERED_UNITS", "ActivationSample", "MemoryProfile", "RankMemory",
    "DeviceProfile", "ExchangeProfile", "GroupSyncProfile", "LinkProfile", "MeasuredRate", "Measurement", "ModelSpec",
    "Profiles", "ScriptRates", "StepSample", "TogetherProfile", "TogetherStep",
    "PLAN_NEEDS", "Engine", "GroupPlan", "Ideal", "JobSpec", "Plan", "Prediction", "RankPlan", "Role", "Strategy", "Wire",
    "prediction",
    "JobRecord", "RankRecord",
]
