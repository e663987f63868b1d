"""A node's GPUs as nvidia-smi lists them, narrowed to the ones this process may use (the cluster
file's list, CUDA_VISIBLE_DEVICES or Slurm's binding), or the emulated ones a cluster file declares.
Runs ON the node, for the node probe (``probe``). Standard library only.

Every failure of nvidia-smi (a missing driver, a hung one, a version mismatch) is one
``NvidiaSmiError`` whose message says what to do: the probe reports it as that node's error.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from typing import Mapping, Sequence

from ..schema.stages import EmulateSpec, GpuInfo

QUERY_FIELDS = ("index", "name", "uuid", "memory.total", "memory.used", "compute_cap", "driver_version")
# Drivers before ~510 do not know compute_cap; they are queried again without it.
OLD_DRIVER_FIELDS = tuple(f for f in QUERY_FIELDS if f != "compute_cap")
# What nvidia-smi prints for a value a device or driver cannot give.
UNAVAILABLE = frozenset({"[N/A]", "[Not Supported]", "[Unknown Error]", "[Insufficient Permissions]"})
NVIDIA_SMI_TIMEOUT_S = 30.0

# nvidia-smi's documented return codes, in the words a user needs to act on them.
_EXIT_MEANINGS = {
    2: "nvidia-smi rejected its arguments (exit 2)",
    3: "the requested information is not available on this GPU (nvidia-smi exit 3)",
    4: "nvidia-smi lacks the permission to query the GPUs (exit 4)",
    6: "nvidia-smi found no NVIDIA GPU (exit 6): is the GPU visible to this machine or container?",
    8: "a GPU's external power cables are not attached (nvidia-smi exit 8)",
    9: "nvidia-smi cannot talk to the NVIDIA driver (exit 9): is the driver loaded?",
    12: "the NVML shared library cannot be found or loaded (nvidia-smi exit 12): reinstall the driver",
    15: "a GPU has fallen off the bus or is otherwise inaccessible (nvidia-smi exit 15)",
    18: "the NVIDIA driver and its user-space library have different versions (nvidia-smi exit 18): "
        "reboot the node or reload the nvidia kernel module after the driver upgrade",
}


class NvidiaSmiError(Exception):
    """nvidia-smi exists but did not give a GPU list; the message is for the user."""


# ---------------------------------------------------------------------------------------------
# nvidia-smi: pure parsing, then the run
# ---------------------------------------------------------------------------------------------

def describe_failure(exit_code: int, output: str) -> str:
    """A failed nvidia-smi run in a user's words, with its own first line for the details."""
    meaning = _EXIT_MEANINGS.get(exit_code, f"nvidia-smi failed (exit {exit_code})")
    first = next((line.strip() for line in output.splitlines() if line.strip()), "")
    return f"{meaning} [nvidia-smi: {first[:200]}]" if first else meaning


def is_unknown_field(output: str, field: str) -> bool:
    """True when nvidia-smi refused ``field`` as unknown to this driver."""
    return f'Field "{field}" is not a valid field to query' in output


def _value(raw: str) -> str | None:
    raw = raw.strip()
    return None if raw in UNAVAILABLE else raw


def _int_value(raw: str, what: str, line: str) -> int | None:
    value = _value(raw)
    if value is None:
        return None
    if not value.isdigit():
        raise NvidiaSmiError(f"nvidia-smi printed {value!r} for {what}, expected a number: {line[:200]!r}")
    return int(value)


def parse_gpu_csv(text: str, fields: Sequence[str]) -> tuple[GpuInfo, ...]:
    """Rows of ``--query-gpu=<fields> --format=csv,noheader,nounits`` -> GpuInfo, in index order.

    Anything else (a table, a message, a different column count) raises NvidiaSmiError: a node must
    never be reported with GPUs guessed from output hgtrain does not understand.
    """
    gpus = []
    for line in text.splitlines():
        if not line.strip():
            continue
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != len(fields):
            raise NvidiaSmiError(f"nvidia-smi printed output hgtrain cannot read "
                                 f"(expected {len(fields)} values per line): {line.strip()[:200]!r}")
        row = dict(zip(fields, cells))
        index = _int_value(row["index"], "index", line)
        if index is None:
            raise NvidiaSmiError(f"nvidia-smi printed a GPU without an index: {line.strip()[:200]!r}")
        capability = _value(row.get("compute_cap", "[N/A]"))
        if capability is not None and not re.fullmatch(r"\d+\.\d+", capability):
            raise NvidiaSmiError(f"nvidia-smi printed {capability!r} as a compute capability: "
                                 f"{line.strip()[:200]!r}")
        gpus.append(GpuInfo(
            index=index,
            name=_value(row["name"]) or "unknown NVIDIA GPU",
            uuid=_value(row["uuid"]),
            memory_total_mib=_int_value(row["memory.total"], "memory.total", line),
            memory_used_mib=_int_value(row["memory.used"], "memory.used", line),
            compute_capability=capability,
            driver_version=_value(row["driver_version"]),
        ))
    if not gpus:
        raise NvidiaSmiError("nvidia-smi listed no GPUs and gave no reason")
    return tuple(sorted(gpus, key=lambda g: g.index))


def _run(exe: str, fields: Sequence[str]) -> tuple[int, str]:
    argv = [exe, f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, errors="replace",
                              timeout=NVIDIA_SMI_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise NvidiaSmiError(f"nvidia-smi did not answer within {NVIDIA_SMI_TIMEOUT_S:g} s: "
                             "the driver may be hung") from None
    except OSError as exc:
        raise NvidiaSmiError(f"cannot run {exe}: {exc.strerror or exc}") from None
    return done.returncode, done.stdout + done.stderr


def query_gpus(exe: str | None = None) -> tuple[GpuInfo, ...]:
    """The node's GPUs; () without nvidia-smi on PATH (a CPU node). Raises NvidiaSmiError."""
    exe = exe or shutil.which("nvidia-smi")
    if exe is None:
        return ()
    fields: Sequence[str] = QUERY_FIELDS
    code, output = _run(exe, fields)
    if code != 0 and is_unknown_field(output, "compute_cap"):
        fields = OLD_DRIVER_FIELDS
        code, output = _run(exe, fields)
    if code != 0:
        raise NvidiaSmiError(describe_failure(code, output))
    return parse_gpu_csv(output, fields)


def select_gpus(gpus: tuple[GpuInfo, ...], wanted: tuple[int, ...] | None) -> tuple[GpuInfo, ...]:
    """Only the indices the cluster file lists for this node; a listed index that is absent is an
    error rather than silently fewer devices."""
    if wanted is None:
        return gpus
    present = {g.index for g in gpus}
    missing = [i for i in wanted if i not in present]
    if missing:
        have = ", ".join(str(i) for i in sorted(present)) or "none"
        raise NvidiaSmiError(f"GPU index {missing[0]} is listed in gpus but not on this node "
                             f"(its GPU indices: {have})")
    return tuple(g for g in gpus if g.index in wanted)


# Where a node's scheduler says which GPUs a process may use, in the order they are read: CUDA's own
# variable (what the ranks will see), else Slurm's list of the step's GPUs (set beside it by Slurm's
# GPU binding, which a script may have cleared CUDA_VISIBLE_DEVICES of).
BINDING_VARIABLES = ("CUDA_VISIBLE_DEVICES", "SLURM_STEP_GPUS")


def bound_gpus(gpus: tuple[GpuInfo, ...], environ: Mapping[str, str]) -> tuple[GpuInfo, ...]:
    """Only the GPUs this process may use: those the first set variable of BINDING_VARIABLES names,
    by index or UUID (``GPU-...``, a unique prefix as CUDA accepts). As CUDA does, the list ends at
    the first entry that names no GPU (``-1``, ``NoDevFiles``), and an empty value means none."""
    for variable in BINDING_VARIABLES:
        value = environ.get(variable)
        if value is None:
            continue
        chosen: list[GpuInfo] = []
        for entry in (e.strip() for e in value.split(",")):
            gpu = _named_gpu(gpus, entry)
            if gpu is None:
                break
            if gpu not in chosen:
                chosen.append(gpu)
        return tuple(sorted(chosen, key=lambda g: g.index))
    return gpus


def _named_gpu(gpus: tuple[GpuInfo, ...], entry: str) -> GpuInfo | None:
    if entry.isdigit():
        return next((g for g in gpus if g.index == int(entry)), None)
    if entry.startswith("GPU-"):
        matches = [g for g in gpus if g.uuid is not None and g.uuid.startswith(entry)]
        return matches[0] if len(matches) == 1 else None
    return None


def emulated_gpus(spec: EmulateSpec) -> tuple[GpuInfo, ...]:
    return tuple(
        GpuInfo(index=i, name=name, memory_total_mib=memory, emulated=True, speed=speed)
        for i, (name, speed, memory) in enumerate(zip(spec.devices, spec.speed, spec.memory_mib))
    )
