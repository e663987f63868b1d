"""Convert device profiles to and from the profile files of Metis (Um et al., ATC'24).

Metis plans from one JSON file per (device type, tensor-parallel degree, batch size), named
``DeviceType.<TYPE>_tp<TP>_bs<BS>.json``, holding the model's size, the iteration time and the
memory. hgtrain measures one data-parallel device per batch size, so it maps onto the tp=1 files.
Pure functions over dicts: reading and writing the files is the caller's business. The mapping and
what it loses are documented in docs/bench.md ("Metis profiles").
"""
from __future__ import annotations

import re
import statistics
from dataclasses import dataclass
from typing import Any, Mapping

from ..schema.stages import Device, DeviceProfile, Measurement, ModelSpec, Profiles, StepSample

_FILE = re.compile(r"^DeviceType\.([A-Za-z0-9]+)_tp([0-9]+)_bs([0-9]+)\.json$")
# Vendor and product-line words carry no identity ("Tesla T4" and "T4" are one card).
_VENDOR_WORDS = {"NVIDIA", "TESLA", "GEFORCE", "QUADRO", "AMD", "RADEON", "INSTINCT"}
METIS_NODE = "metis"   # the node of devices read from Metis files, which know only device types


@dataclass(frozen=True)
class MetisImport:
    """What a set of Metis profile files gave: device profiles the planner can use, the model
    they were measured on, and the files left out, so the import says what it did not take."""

    devices: tuple[DeviceProfile, ...]   # one per device type, steps in batch-size order
    model: ModelSpec | None
    skipped: tuple[str, ...]             # files not imported (tensor parallel > 1), by name


def device_type(name: str) -> str:
    """The Metis device identifier of a device name: letters and digits only, because Metis finds
    the type in a file name with ``DeviceType.(\\w+?)_`` (an underscore would end it).

    "NVIDIA A100-SXM4-40GB" -> "A100SXM440GB", "Tesla T4" -> "T4".
    """
    words = [w for w in re.split(r"[^A-Za-z0-9]+", name) if w and w.upper() not in _VENDOR_WORDS]
    return "".join(words) or "UNKNOWN"


def file_name(dtype: str, batch_size: int, tp: int = 1) -> str:
    return f"DeviceType.{dtype}_tp{tp}_bs{batch_size}.json"


def to_metis(profiles: Profiles, *, include_emulated: bool = False) -> dict[str, dict[str, Any]]:
    """File name -> Metis profile JSON for every (device type, measured batch size).

    Devices of one type are merged: the median of their step times, the largest of their peak
    memories. Emulated devices are left out unless asked for: an external planner would take their
    figures for the real card's.
    """
    if profiles.model is None:
        raise ValueError("the profiles have no model (bench with --model) to describe to Metis")
    samples: dict[tuple[str, int], list[StepSample]] = {}
    for device in profiles.devices:
        if device.emulated and not include_emulated:
            continue
        for step in device.steps:
            samples.setdefault((device_type(device.name), step.batch_size), []).append(step)
    return {file_name(dtype, bs): _metis_file(profiles.model, steps)
            for (dtype, bs), steps in sorted(samples.items())}


def _metis_file(model: ModelSpec, steps: list[StepSample]) -> dict[str, Any]:
    ms = statistics.median(s.seconds.median for s in steps) * 1000.0
    memories = [s.memory_mib for s in steps if s.memory_mib is not None]
    memory = float(max(memories)) if memories else 0.0
    parameter_bytes = model.parameters * model.bytes_per_parameter
    # hgtrain times whole steps, not layers: the model is one "layer" holding all of it, and the
    # optimizer's share stays inside the step time (optimizer_time_ms 0, never counted twice).
    return {
        "model": {
            "model_name": model.name,
            "num_layers": 1,
            "parameters": {"total_parameters_bytes": parameter_bytes,
                           "parameters_per_layer_bytes": [parameter_bytes]},
        },
        "execution_time": {
            "total_time_ms": ms,
            "forward_backward_time_ms": ms,
            "batch_generator_time_ms": 0.0,
            "layernorm_grads_all_reduce_time_ms": 0.0,
            "embedding_grads_all_reduce_time_ms": 0.0,
            "optimizer_time_ms": 0.0,
            "layer_compute_total_ms": [ms],
        },
        "execution_memory": {"total_memory_mb": memory, "layer_memory_total_mb": [memory]},
    }


def from_metis(files: Mapping[str, Mapping[str, Any]]) -> MetisImport:
    """Device profiles from Metis files (name -> parsed JSON); ValueError names a bad file.

    Only tp=1 files describe a data-parallel device; others are listed in ``skipped``.
    """
    steps: dict[str, list[StepSample]] = {}
    model: ModelSpec | None = None
    skipped = []
    for name, data in sorted(files.items()):
        match = _FILE.match(name)
        if not match:
            raise ValueError(f"{name}: not a Metis profile name (DeviceType.<TYPE>_tp<N>_bs<N>.json)")
        dtype, tp, bs = match.group(1), int(match.group(2)), int(match.group(3))
        if tp != 1:
            skipped.append(name)
            continue
        try:
            seconds = float(data["execution_time"]["total_time_ms"]) / 1000.0
            memory = _memory_mib(data["execution_memory"])
            model = model or ModelSpec(name=str(data["model"]["model_name"]),
                                       parameters=int(data["model"]["parameters"]["total_parameters_bytes"]) // 4)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{name}: missing or bad field {exc}") from None
        steps.setdefault(dtype, []).append(
            StepSample(batch_size=bs, seconds=Measurement(seconds, seconds, seconds, 1), memory_mib=memory))
    devices = tuple(
        DeviceProfile(node=METIS_NODE, device=Device(dtype), name=dtype, emulated=False, speed=1.0, memory_total_mib=None,
                      steps=tuple(sorted(samples, key=lambda s: s.batch_size)))
        for dtype, samples in sorted(steps.items()))
    return MetisImport(devices=devices, model=model, skipped=tuple(skipped))


def _memory_mib(memory: Mapping[str, Any]) -> int | None:
    """Metis' README says ``total_memory_mb``, its sample files say ``total_memory``; the per-layer
    list is the fallback. Metis' "MB" are torch's MiB (max_memory_reserved / 2**20)."""
    for key in ("total_memory_mb", "total_memory"):
        if key in memory:
            return round(float(memory[key]))
    layers = memory.get("layer_memory_total_mb")
    return round(sum(float(v) for v in layers)) if layers else None
