"""Synthetic inventories and profiles for planner tests.

Step times and peak memory are exactly linear in the batch (time = (a + c * b) / speed,
memory = static + per_sample * b), so tests can compute what the planner must respect independently.
"""
from __future__ import annotations

from dataclasses import dataclass

from hgcli.schema.stages import (
    DeviceProfile, GpuInfo, Inventory, LinkProfile, Measurement, ModelSpec, NodeInfo, Profiles, StepSample,
)

BENCH_BATCHES = (8, 32, 128)


def measured(x: float) -> Measurement:
    return Measurement(median=x, min=x, max=x, repeats=3)


@dataclass(frozen=True)
class Kind:
    """A device model: its relative speed and linear cost."""

    name: str
    speed: float
    memory_mib: int | None
    a: float = 0.004           # fixed seconds per step at speed 1
    c: float = 0.0005          # seconds per sample at speed 1
    static_mib: float = 600.0
    per_sample_mib: float = 40.0
    emulated: bool = True

    def seconds(self, batch: int) -> float:
        return (self.a + self.c * batch) / self.speed

    def memory(self, batch: int) -> float:
        return self.static_mib + self.per_sample_mib * batch


A100 = Kind("NVIDIA A100-SXM4-40GB", 1.0, 40960)
T4 = Kind("Tesla T4", 0.25, 15360)


def cluster(nodes: list[list[Kind]], *, links: tuple[LinkProfile, ...] = (), fingerprint: str = "fp",
            model: ModelSpec | None = ModelSpec("mlp", 1_000_000),
            names: list[str] | None = None) -> tuple[Inventory, Profiles]:
    """Node i is named n{i} unless named; its devices gpu0.. are of the given kinds."""
    infos, devices = [], []
    for i, kinds in enumerate(nodes):
        name = names[i] if names else f"n{i}"
        gpus = []
        for j, k in enumerate(kinds):
            gpus.append(GpuInfo(j, k.name, memory_total_mib=k.memory_mib, emulated=k.emulated, speed=k.speed))
            steps = tuple(StepSample(b, measured(k.seconds(b)), round(k.memory(b))) for b in BENCH_BATCHES)
            devices.append(DeviceProfile(name, f"gpu{j}", k.name, k.emulated, k.speed, k.memory_mib,
                                         steps=steps))
        infos.append(NodeInfo(name, f"host{i}", True, emulated=True, gpus=tuple(gpus), cpu_cores=8))
    return (Inventory(fingerprint, tuple(infos)),
            Profiles(fingerprint, tuple(devices), links=links, model=model))


def link(a: int | str, b: int | str, gbs: float, latency_s: float = 50e-6) -> LinkProfile:
    """A measured link between nodes given by index (n{i}) or by name."""
    a, b = (f"n{x}" if isinstance(x, int) else x for x in (a, b))
    return LinkProfile(a, b, "gloo", measured(gbs), measured(latency_s))
