"""Benchmark one device of this node; runs ON the node (stdlib + torch, imported lazily).

    python -m hgcli.node.bench --node NAME --device gpu0|cpu [--name MODEL] [--emulate-speed S]
        [--memory-mib M] [--quick] [--model SPEC] [--lifeline]

Frames on stdout (hgcli.node.frames): ``progress`` while it works, ``note`` for what the reader must
know (emulation), ``model`` (parameter count of the timed model) and one final ``profile``. A device
that fails (out of memory, driver error) still gets its profile, with ``error`` naming the failure
and whatever was measured before it; the exit code is 0 because the controller reads the profile.
One process per device, so a wedged CUDA context or an OOM cannot poison the next device.
"""
from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

from ...schema.stages import (
    DeviceProfile, ExchangeProfile, GroupSyncProfile, Measurement, MemoryProfile, StepSample, to_dict,
)
from ..remedy import OR_ANOTHER_PYTHON, module_problem
from . import exchange as exchangebench
from . import group as groupbench
from . import memory as memorybench
from . import micro as microbench
from . import modelspec
from . import step as stepbench
from .failure import first_line, is_oom
from ..frames import emit
from ..protocol import FrameType
from .lifeline import watch_stdin
from .timing import WALL, emulated_clock, scaled


@dataclass(frozen=True)
class Sizes:
    """How hard to push a device: big enough to saturate it, small enough to stay quick."""

    matmul_n: int
    matmul_inner: int
    copy_bytes: int
    h2d_bytes: int
    batch_sizes: tuple[int, ...]
    warmup: int
    repeats: int


MIB = 1 << 20
# The group benchmark's emulated step: the largest benched batch whose step is at most this
# (seconds), and its pairs of blocks (free, synchronous; hgcli/node/bench/group.py): the all-reduce's
# cost and the machine's speed swing from step to step, so more than a step bench's repeats.
GROUP_STEP_S = 0.2
GROUP_WARMUP, GROUP_REPEATS = 2, 12
SIZES = {
    ("cpu", True): Sizes(384, 1, 32 * MIB, 0, (4, 16, 64, 256), 2, 7),
    ("cpu", False): Sizes(1024, 1, 256 * MIB, 0, (16, 32, 64, 128, 256, 512), 2, 7),
    ("cuda", True): Sizes(4096, 5, 256 * MIB, 64 * MIB, (64, 256, 1024), 2, 5),
    ("cuda", False): Sizes(8192, 10, 1024 * MIB, 256 * MIB, (32, 64, 128, 256, 512, 1024, 2048), 3, 10),
}


@dataclass(frozen=True)
class Target:
    """The device as measured: where tensors live and what it reports as."""

    device: Any                    # torch.device
    name: str
    memory_total_mib: int | None
    driver_version: str | None
    emulated: bool
    speed: float
    dtypes: tuple[str, ...]


@dataclass
class Results:
    """What one device's benchmark has measured so far; a failure part-way still leaves a profile of it."""

    matmul: dict[str, Measurement] = field(default_factory=dict)
    mem_bw: Measurement | None = None
    h2d_bw: Measurement | None = None
    steps: list[StepSample] = field(default_factory=list)
    model_parameters: int | None = None
    exchange: ExchangeProfile | None = None
    group_sync: GroupSyncProfile | None = None
    memory: MemoryProfile | None = None     # the model's state and units; activations from ``steps``


class DeviceFailure(Exception):
    """The device cannot be used at all (no CUDA, no such GPU)."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hgcli.node.bench", description=__doc__.split("\n")[0])
    p.add_argument("--node", required=True, help="node name, recorded in the profile")
    p.add_argument("--device", required=True, help="gpuN or cpu")
    p.add_argument("--name", help="device model name (emulated devices, CPUs)")
    p.add_argument("--emulate-speed", type=float, help="emulate a GPU on the CPU at this relative speed")
    p.add_argument("--memory-mib", type=int, help="device memory; the cap of an emulated device")
    p.add_argument("--quick", action="store_true", help="smaller sizes, fewer repeats")
    p.add_argument("--model", default=modelspec.DEFAULT_SPEC, help="model spec to time (docs/bench.md)")
    p.add_argument("--lifeline", action="store_true", help="exit when stdin reaches EOF")
    p.add_argument("--no-exchange", action="store_true",
                   help="skip the parameter-server exchange (the node's, measured with another device)")
    p.add_argument("--group-ranks", type=int, default=0,
                   help="emulated devices on this node: also time their synchronous step (groupbench)")
    args = p.parse_args(argv)
    if args.device != "cpu" and not (args.device.startswith("gpu") and args.device[3:].isdigit()):
        p.error(f"--device must be gpuN or cpu, not {args.device!r}")
    if args.emulate_speed is not None and not args.emulate_speed > 0:
        p.error("--emulate-speed must be positive")
    try:
        args.model_ref = modelspec.parse_spec(args.model)
    except ValueError as exc:
        p.error(str(exc))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.lifeline:
        watch_stdin()
    profile, parameters = bench(args)
    if parameters is not None:
        emit({"type": FrameType.MODEL, "name": args.model, "parameters": parameters})
    emit({"type": FrameType.PROFILE, "profile": to_dict(profile)})
    return 0


def bench(args: argparse.Namespace) -> tuple[DeviceProfile, int | None]:
    try:
        import torch
    except ImportError as exc:       # the profile says so (the controller refuses earlier when it knows)
        missing = module_problem("torch", sys.executable, args.node, f"{type(exc).__name__}: {exc}")
        return build_profile(None, args, None, Results(), missing + OR_ANOTHER_PYTHON), None

    stage = "setup"

    def progress(what: str) -> None:
        nonlocal stage
        stage = what
        emit({"type": FrameType.PROGRESS, "node": args.node, "device": args.device, "stage": what})

    results, error, target = Results(), None, None
    try:
        target = resolve_target(torch, args)
        if target.emulated:
            emit({"type": FrameType.NOTE, "node": args.node, "device": args.device,
                  "message": f"emulated {target.name}: the CPU is measured, speed x{target.speed:g} applied"})
        measure(torch, args, target, results, progress)
    except (stepbench.OutOfMemory, DeviceFailure) as exc:
        error = str(exc)
    except Exception as exc:  # a driver error on this device must not lose what was measured
        error = f"out of memory at {stage}" if is_oom(exc) else f"{stage}: {first_line(exc)}"
    return build_profile(torch, args, target, results, error), results.model_parameters


def resolve_target(torch: Any, args: argparse.Namespace) -> Target:
    if args.emulate_speed is not None:
        return Target(device=torch.device("cpu"), name=args.name or f"emulated {args.device}",
                      memory_total_mib=args.memory_mib, driver_version=None, emulated=True,
                      speed=args.emulate_speed, dtypes=("fp32",))
    if args.device == "cpu":
        return Target(device=torch.device("cpu"), name=args.name or cpu_model(),
                      memory_total_mib=args.memory_mib or host_memory_mib(), driver_version=None,
                      emulated=False, speed=1.0, dtypes=("fp32",))
    index = int(args.device[3:])
    if not torch.cuda.is_available():
        raise DeviceFailure(f"CUDA is not available to torch {torch.__version__}")
    if index >= torch.cuda.device_count():
        raise DeviceFailure(f"no CUDA device {index} (torch sees {torch.cuda.device_count()})")
    props = torch.cuda.get_device_properties(index)
    dtypes = ("fp32", "bf16", "fp16") if torch.cuda.is_bf16_supported() else ("fp32", "fp16")
    return Target(device=torch.device("cuda", index), name=props.name,
                  memory_total_mib=props.total_memory // MIB, driver_version=nvidia_driver(index),
                  emulated=False, speed=1.0, dtypes=dtypes)


def measure(torch: Any, args: argparse.Namespace, target: Target, results: Results, progress: Any) -> None:
    """Fill ``results`` stage by stage, so a failure keeps everything measured before it."""
    on_gpu = target.device.type == "cuda"
    sizes = SIZES[(target.device.type, args.quick)]
    sync = (lambda: torch.cuda.synchronize(target.device)) if on_gpu else (lambda: None)
    reps: dict[str, Any] = {"warmup": sizes.warmup, "repeats": sizes.repeats, "sync": sync, "clock": WALL}
    if target.emulated:
        # Measure what the runtime's emulation stretches (hgcli/runtime/emulate.py): an emulated rank
        # runs torch on one thread and sleeps each step to (its thread's CPU time) / speed. Wall time
        # with all cores would instead measure how busy the node was (other ranks, other jobs) and,
        # on a loaded machine, thread oversubscription: medians off by 10x or more.
        torch.set_num_threads(1)
        reps["clock"] = emulated_clock(target.speed)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    if on_gpu:
        torch.cuda.set_device(target.device)
    for name in target.dtypes:
        progress(f"matmul {name}")
        results.matmul[name] = microbench.matmul_tflops(torch, target.device, dtypes[name], sizes.matmul_n,
                                                        inner=sizes.matmul_inner, **reps)
    progress("memory bandwidth")
    results.mem_bw = microbench.memory_bandwidth_gbs(torch, target.device, sizes.copy_bytes, **reps)
    if on_gpu:
        progress("host-to-device bandwidth")
        results.h2d_bw = microbench.h2d_bandwidth_gbs(torch, target.device, sizes.h2d_bytes, **reps)
    progress(f"model {args.model}")
    loaded = _load_model(args.model_ref)
    results.model_parameters = sum(p.numel() for p in loaded.model.parameters())
    results.memory = _model_memory(loaded.model, args)
    # The PS exchange is the node's (its CPU and RPC stack), not the device's: measured once per
    # node, with its first device (emulated devices of a node share one measurement, bench.py).
    if (target.emulated or args.device in ("cpu", "gpu0")) and not args.no_exchange:
        progress("parameter-server exchange")
        try:
            results.exchange = exchangebench.measure_exchange(
                torch, results.model_parameters, warmup=sizes.warmup, repeats=sizes.repeats)
        except Exception as exc:  # no RPC on this node: the planner falls back to link figures
            emit({"type": FrameType.NOTE, "node": args.node, "device": args.device,
                  "message": f"parameter-server exchange not measured: {first_line(exc)}"})
    cap = target.memory_total_mib if target.emulated else None
    batch_sizes = args.model_ref.batch_sizes or sizes.batch_sizes
    for sample in stepbench.step_samples(torch, loaded, target.device, batch_sizes, memory_cap_mib=cap,
                                         emulated_speed=target.speed if target.emulated else None,
                                         on_batch=lambda bs: progress(f"batch {bs}"), **reps):
        results.steps.append(sample)
    if target.emulated and args.group_ranks >= 2 and results.steps:
        progress(f"synchronous step of {args.group_ranks} ranks")
        batch = group_batch(results.steps, target.speed)
        try:
            results.group_sync = groupbench.measure_group_sync(
                torch, args.model, results.model_parameters, ranks=args.group_ranks, batch=batch,
                speed=target.speed, warmup=GROUP_WARMUP, repeats=max(GROUP_REPEATS, sizes.repeats))
        except Exception as exc:  # gloo unavailable or a child failed: the planner uses the link formula
            emit({"type": FrameType.NOTE, "node": args.node, "device": args.device,
                  "message": f"synchronous step not measured: {first_line(exc)}"})


def _model_memory(model: Any, args: argparse.Namespace) -> MemoryProfile | None:
    """The model's memory figures, or None with a note: without them the planner caps the device by
    its steps' memory, as for older profiles."""
    try:
        return memorybench.model_memory(model)
    except Exception as exc:  # the user's model: its structure is not ours to vouch for
        emit({"type": FrameType.NOTE, "node": args.node, "device": args.device,
              "message": f"memory figures not measured: {first_line(exc)}"})
        return None


def group_batch(steps: list[StepSample], speed: float) -> int:
    """The group bench's batch: the largest benched one whose emulated step fits GROUP_STEP_S (the
    bench's length is pairs x blocks of it), else the smallest."""
    fitting = [s.batch_size for s in steps if s.seconds.median / speed <= GROUP_STEP_S]
    return max(fitting) if fitting else min(s.batch_size for s in steps)


def _load_model(ref: modelspec.ModelRef) -> modelspec.LoadedModel:
    try:
        return modelspec.load(ref)
    except Exception as exc:  # the user's code: any failure is this run's error, named
        raise DeviceFailure(f"cannot load model {ref.spec}: {first_line(exc)}") from exc


def build_profile(torch: Any, args: argparse.Namespace, target: Target | None, r: Results,
                  error: str | None) -> DeviceProfile:
    """The profile; on an emulated device the speed factor is applied to every rate and time."""
    speed = target.speed if target else (args.emulate_speed or 1.0)
    steps = tuple(StepSample(s.batch_size, scaled(s.seconds, 1.0 / speed), s.memory_mib) for s in r.steps)
    return DeviceProfile(
        node=args.node, device=args.device,
        name=target.name if target else (args.name or args.device),
        emulated=args.emulate_speed is not None, speed=speed,
        memory_total_mib=target.memory_total_mib if target else args.memory_mib,
        matmul_tflops={k: scaled(v, speed) for k, v in r.matmul.items()},
        mem_bandwidth_gbs=scaled(r.mem_bw, speed) if r.mem_bw else None,
        h2d_bandwidth_gbs=r.h2d_bw, steps=steps, error=error,
        torch_version=torch.__version__ if torch else None,
        driver_version=target.driver_version if target else None,
        exchange=r.exchange, group_sync=r.group_sync,
        memory=memorybench.with_activations(r.memory, r.steps) if r.memory is not None else None,
    )


def nvidia_driver(index: int) -> str | None:
    """The driver version as nvidia-smi prints it: the same string the probe stores in the inventory,
    so the staleness check compares like with like."""
    try:
        out = subprocess.run(["nvidia-smi", f"--id={index}", "--query-gpu=driver_version",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    value = out.stdout.strip()
    return value if out.returncode == 0 and value and not value.startswith("[") else None


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def host_memory_mib() -> int | None:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // MIB
    except (ValueError, OSError):
        return None

