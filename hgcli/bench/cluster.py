"""The bench stage: Inventory -> Profiles. Every node at once, the devices of a node one at a time,
then together.

Nodes run concurrently (fan-out); on a node, devices are benched in turn, one node-side process each
(``hgcli.node.bench``), so emulated devices sharing one CPU do not slow each other down and a failed
device cannot poison the next: each device's own speed (the plan's ideal). Then a node's devices
step all at once, as they will train (``bench_together``): what the planner costs them from. Then
the links (``bench_links``). The result is stored in the state directory for ``plan``.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from typing import Callable

from .links import bench_links
from ..errors import RemoteError, UsageError
from ..schema.stages import (CPU, Cluster, Device, DeviceProfile, Inventory, ModelSpec, NodeInfo, NodeSpec, Profiles,
                    from_dict)
from ..node.bench import modelspec
from ..node.bench.timing import scaled
from ..node.protocol import FrameType, frame_type
from .profiles import store_profiles
from .together import bench_together
from ..remote.fanout import fanout, open_transport
from ..remote.node_program import NodeProgram
from ..remote.transport import Transport

# The model benched when no --model is given, for hgtrain bench and for the bench plan and launch run
# themselves (docs/bench.md).
MODEL_ENV = "HGTRAIN_BENCH_MODEL"
# Bounds per device, the torch import on a loaded node included.
DEVICE_TIMEOUT_S = {True: 300.0, False: 1800.0}
# A node with no profile of its own (unreachable, or failed in the inventory) is listed under this
# device name with its error, so the failure is in the profiles and not silently missing.
NODE_DEVICE = Device("node")
MIB = 1 << 20


@dataclass(frozen=True)
class BenchEvent:
    """Progress for the display: ``subject`` is a node name or "a<->b" for a link."""

    subject: str
    device: str
    stage: str


OnEvent = Callable[[BenchEvent], None]


@dataclass(frozen=True)
class DeviceTarget:
    """One device to bench, as the inventory describes it."""

    device: Device                  # "gpu0"... or "cpu"
    name: str | None
    emulated: bool
    speed: float | None
    memory_mib: int | None

    def args(self) -> list[str]:
        out = ["--device", self.device]
        if self.name:
            out += ["--name", self.name]
        if self.emulated:
            out += ["--emulate-speed", repr(self.speed if self.speed is not None else 1.0)]
        if self.memory_mib is not None:
            out += ["--memory-mib", str(self.memory_mib)]
        return out


def device_targets(node: NodeInfo) -> tuple[DeviceTarget, ...]:
    """Its GPUs (real or emulated); a node without GPUs benches its CPU as device "cpu"."""
    if node.gpus:
        return tuple(DeviceTarget(Device.gpu(g.index), g.name, g.emulated, g.speed, g.memory_total_mib)
                     for g in node.gpus)
    return (DeviceTarget(CPU, node.cpu_model, False, None, node.memory_total_mib),)


def bench_cluster(cluster: Cluster, inventory: Inventory, *, quick: bool,
                  model_spec: str | None = None, on_event: OnEvent | None = None) -> Profiles:
    """Profiles of every device and link of ``cluster``; stored, then returned.

    ``model_spec`` is the model whose step time is measured (docs/bench.md); without one
    $HGTRAIN_BENCH_MODEL's, else the bundled example's (so the bench that plan and launch run
    when profiles are missing times the user's model too). Raises UsageError for a malformed spec
    before contacting any node.
    """
    from_env = not model_spec and bool(os.environ.get(MODEL_ENV))
    model_spec = model_spec or os.environ.get(MODEL_ENV) or modelspec.DEFAULT_SPEC
    try:
        modelspec.parse_spec(model_spec)
    except ValueError as exc:
        raise UsageError(f"{MODEL_ENV}: {exc}" if from_env else str(exc)) from None
    emit = on_event or (lambda event: None)
    infos = {n.name: n for n in inventory.nodes}
    result = fanout(cluster.nodes, lambda node: _bench_node(cluster, node, infos.get(node.name),
                                                            quick, model_spec, emit))
    devices: list[DeviceProfile] = []
    model: ModelSpec | None = None
    for r in result.results:
        if r.value is None:
            devices.append(_node_failure(r.node, r.error or "failed"))
            continue
        node_devices, node_model = r.value
        devices.extend(node_devices)
        model = model or node_model
    links = bench_links(cluster, inventory, quick=quick,
                        on_event=lambda pair, stage: emit(BenchEvent(pair, "link", stage)))
    profiles = Profiles(cluster=inventory.cluster, devices=tuple(devices), links=links, model=model,
                        measured_at=time.time())
    store_profiles(profiles)
    return profiles


def failure_summary(profiles: Profiles) -> str | None:
    """One line saying how many devices and links failed, or None when none did."""
    bad_devices = sum(1 for d in profiles.devices if d.error)
    bad_links = sum(1 for link in profiles.links if link.error)
    if not bad_devices and not bad_links:
        return None
    return (f"{bad_devices} of {len(profiles.devices)} devices and {bad_links} of {len(profiles.links)} "
            "links failed; their errors are in the profiles")


def _bench_node(cluster: Cluster, node: NodeSpec, info: NodeInfo | None, quick: bool, spec: str,
                emit: OnEvent) -> tuple[list[DeviceProfile], ModelSpec | None]:
    if info is None or not info.ok:
        reason = info.error if info is not None else "not in the inventory"
        return [_node_failure(node, f"not probed: {reason}")], None
    profiles, model = [], None
    targets = device_targets(info)
    real = [t for t in targets if not t.emulated]
    emulated = [t for t in targets if t.emulated]
    with open_transport(node, cluster) as transport:
        measured = [_bench_device(transport, node, t, quick, spec, emit) for t in real]
        if emulated:
            # Emulated devices of a node share one CPU: it is measured once per distinct declared
            # speed (under the largest declared memory) and each device derived from the measurement
            # at its speed, so devices of one speed are identical instead of differing by whatever
            # load the CPU saw during each one's turn. Once per speed, not once per node: the node
            # bench pauses between timings as the emulator would at that speed (node/timing.py), and
            # how cold a step starts depends on that pause: measured at the slowest speed's long
            # pauses, the faster devices' steps took markedly more CPU than in training
            # (benchmarks/RESULTS.md, "Cost-model accuracy", fix 2).
            base_target = max(emulated, key=lambda t: t.memory_mib or 0)
            bases = {}
            speeds = sorted({t.speed if t.speed is not None else 1.0 for t in emulated})
            for speed in speeds:
                # The fastest speed's bench also times a synchronous step of all the node's emulated
                # devices (node/bench/group.py): with batches proportional to speed, every member's
                # step lasts about what the fastest one's does; the node's figure is on every profile.
                # The PS exchange is the node's CPU and RPC stack at any declared speed: timed once, with
                # the first speed, and given to every profile like the group's figure.
                group = len(emulated) if speed == speeds[-1] and len(emulated) > 1 else 0
                bases[speed] = _bench_device(transport, node, replace(base_target, speed=speed), quick,
                                             spec, emit, group_ranks=group, exchange=speed == speeds[0])
            node_group, node_exchange = bases[speeds[-1]][0].group_sync, bases[speeds[0]][0].exchange
            bases = {k: (replace(p, group_sync=node_group, exchange=node_exchange), n) for k, (p, n) in bases.items()}
            for t in emulated:
                base, parameters = bases[t.speed if t.speed is not None else 1.0]
                measured.append((emulated_profile(base, t), parameters))
        by_device = {p.device: (p, n) for p, n in measured}
        for target in targets:
            profile, parameters = by_device[target.device]
            profiles.append(profile)
            if parameters is not None:
                model = ModelSpec(name=spec, parameters=parameters)
        # Then all of them at once, as they will train (bench/together.py): the figures the planner
        # costs them from. Alone first, because the together job's batches come from those figures.
        profiles = bench_together(transport, node, profiles, quick, spec,
                                  lambda stage: emit(BenchEvent(node.name, "together", stage)))
    return profiles, model


def emulated_profile(base: DeviceProfile, target: DeviceTarget) -> DeviceProfile:
    """``target``'s profile from its node's CPU measured at ``base.speed``: rates x (speed / base
    speed), times / that; a batch whose measured memory exceeds the device's declared memory is its
    out-of-memory. With the model's memory profile (``base.memory``) that holds only where not even a
    sharded rank with its state offloaded holds one sample (``MemoryProfile.least_bytes``): below
    that, every step's time is kept (compute does not depend on memory) and the planner's memory
    model decides which engine and batch fit (docs/planning.md, "Memory")."""
    speed = target.speed if target.speed is not None else 1.0
    ratio = speed / base.speed
    cap = target.memory_mib
    shardable = base.memory is not None and cap is not None and base.memory.least_bytes() <= cap * MIB
    steps, error = [], base.error
    for s in base.steps:
        if cap is not None and s.memory_mib is not None and s.memory_mib > cap and not shardable:
            error = error or (f"out of memory at batch {s.batch_size}: a step needs {s.memory_mib} MiB, "
                              f"the emulated device has {cap} MiB")
            break
        steps.append(replace(s, seconds=scaled(s.seconds, 1.0 / ratio)))
    return replace(
        base, device=target.device, name=target.name or target.device, emulated=True, speed=speed,
        memory_total_mib=cap, steps=tuple(steps), error=error,
        matmul_tflops={k: scaled(v, ratio) for k, v in base.matmul_tflops.items()},
        mem_bandwidth_gbs=scaled(base.mem_bandwidth_gbs, ratio) if base.mem_bandwidth_gbs else None,
    )


def _bench_device(transport: Transport, node: NodeSpec, target: DeviceTarget, quick: bool, spec: str,
                  emit: OnEvent, group_ranks: int = 0, exchange: bool = True) -> tuple[DeviceProfile, int | None]:
    args = ["--node", node.name, *target.args(), "--model", spec, "--lifeline"] + (["--quick"] if quick else [])
    if not exchange:
        args.append("--no-exchange")
    if group_ranks:
        args += ["--group-ranks", str(group_ranks)]
    deadline = time.monotonic() + DEVICE_TIMEOUT_S[quick]
    emit(BenchEvent(node.name, target.device, "starting"))
    profile, parameters = None, None
    try:
        # PCI bus order makes torch's cuda:N the GPU nvidia-smi (and so the inventory) calls N.
        with NodeProgram(transport, "bench", args, env={"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}) as program:
            for frame in program.frames(deadline):
                match frame_type(frame):
                    case FrameType.PROGRESS:
                        emit(BenchEvent(node.name, target.device, str(frame.get("stage"))))
                    case FrameType.MODEL:
                        parameters = int(frame["parameters"])
                    case FrameType.PROFILE:
                        profile = from_dict(DeviceProfile, frame["profile"])
            code = program.finish(deadline)
            if profile is None:
                profile = _device_failure(node, target, program.failure(code))
    except RemoteError as exc:
        profile = _device_failure(node, target, exc.reason)
    except (ValueError, KeyError) as exc:  # a frame of the wrong shape: a version mismatch on the node
        profile = _device_failure(node, target, f"bad result from the node: {exc}")
    emit(BenchEvent(node.name, target.device, "failed" if profile.error else "done"))
    return profile, parameters


def _device_failure(node: NodeSpec, target: DeviceTarget, error: str) -> DeviceProfile:
    return DeviceProfile(node=node.name, device=target.device, name=target.name or target.device,
                         emulated=target.emulated, speed=target.speed or 1.0,
                         memory_total_mib=target.memory_mib, error=error)


def _node_failure(node: NodeSpec, error: str) -> DeviceProfile:
    return DeviceProfile(node=node.name, device=NODE_DEVICE, name=node.address, emulated=False, speed=1.0,
                         memory_total_mib=None, error=error)
