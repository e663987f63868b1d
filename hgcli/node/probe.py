"""What a node has: GPUs (nvidia-smi: ``gpus``), CPU, memory, OS, Python, torch, and what its Python can run.
Runs ON the node.

``python -m hgcli.node.probe --name NAME --host HOST [--gpus 0,2] [--emulate JSON]`` prints exactly
one ``probe`` frame and exits 0 whatever the node's state: a broken driver is reported as that
node's ``ok: false`` and ``error`` so the controller can show every node, healthy or not. Standard
library only, and torch is never imported in this process (importing it takes a second or more and
may itself fail on a node with a broken driver): its version comes from the installed package's
metadata, and what each kind of plan imports is tried in a child process (``RuntimeCheck``).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ..errors import StateError
from ..schema.stages import EmulateSpec, NodeInfo, PythonRuntime, from_dict, to_dict
from ..state import write_private
from . import frames
from .gpus import NvidiaSmiError, bound_gpus, emulated_gpus, query_gpus, select_gpus
from .protocol import FrameType

# ---------------------------------------------------------------------------------------------
# The host: pure parsers of /proc and /etc files, then the readers
# ---------------------------------------------------------------------------------------------

def parse_cpuinfo(text: str) -> str | None:
    """The CPU model from /proc/cpuinfo (x86 "model name"; ARM and others use other keys)."""
    found: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and value.strip():
            found.setdefault(key.strip().lower(), value.strip())
    for key in ("model name", "cpu model", "hardware", "model", "cpu"):
        if key in found:
            return found[key]
    return None


def parse_meminfo(text: str) -> int | None:
    """MemTotal from /proc/meminfo, in MiB."""
    m = re.search(r"^MemTotal:\s+(\d+)\s*kB", text, re.MULTILINE)
    return int(m.group(1)) // 1024 if m else None


def parse_os_release(text: str) -> str | None:
    """PRETTY_NAME from /etc/os-release (shell-style quoting)."""
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip() == "PRETTY_NAME":
            value = value.strip()
            if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
                value = value[1:-1]
            return value or None
    return None


def torch_cuda_from_version(version: str) -> str | None:
    """CUDA version of a torch build from its local label: "2.1.0+cu121" -> "12.1". Builds without
    a label (e.g. PyPI's default Linux wheels) do not say, so None."""
    m = re.search(r"\+cu(\d{2,3})\b", version)
    if not m:
        return None
    digits = m.group(1)
    return f"{int(digits[:-1])}.{digits[-1]}"


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read()
    except OSError:
        return ""


def _cpu_cores() -> int | None:
    """CPUs this process may use (a Slurm or container cpuset), else all of them."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count()


_DIST = re.compile(r"(torch|numpy)-([^-]+?)(?:-py[\d.]+)?\.(?:dist-info|egg-info)")
_VERSION_PY = re.compile(r"^(__version__|cuda)\s*(?::[^=]*)?=\s*['\"]([^'\"]+)['\"]", re.MULTILINE)


@dataclass(frozen=True)
class TorchBuild:
    """The node's torch, read from its files without importing it: version and CUDA build (None: CPU)."""

    version: str
    cuda: str | None


def parse_torch_version_py(text: str) -> tuple[str | None, str | None]:
    """(``__version__``, ``cuda``) from the text of torch/version.py (``cuda: Optional[str] = '13.0'``;
    None on a CPU build)."""
    found = {m[1]: m[2] for m in _VERSION_PY.finditer(text)}
    return found.get("__version__"), found.get("cuda")


def installed() -> dict[str, tuple[str, str]]:
    """{"torch" | "numpy": (path of its install metadata, ``torch-<version>.dist-info`` or an egg's
    ``.egg-info``; the version in that name)}, the first on sys.path. Found by listing sys.path rather
    than through importlib.metadata, whose import alone would be most of a probe's own time per node
    (benchmarks/probe_fanout.py measures a probe's fan-out)."""
    found: dict[str, tuple[str, str]] = {}
    for entry in sys.path:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        for name in names:
            m = _DIST.fullmatch(name)
            if m and m.group(1) not in found:
                found[m.group(1)] = (os.path.join(entry or ".", name), m.group(2))
    return found


def torch_build(metadata: tuple[str, str] | None) -> TorchBuild | None:
    """The version and CUDA that ``torch.__version__`` and ``torch.version.cuda`` will report, read from
    the package's version.py beside its metadata, because a build's metadata need not carry its local
    label: a CUDA wheel's dist-info can say 2.11.0 where torch.__version__ says 2.11.0+cu130, which
    is what bench records."""
    if metadata is None:
        return None
    path, named = metadata
    version, cuda = parse_torch_version_py(_read(os.path.join(os.path.dirname(path), "torch", "version.py")))
    version = version or named
    return TorchBuild(version, cuda or torch_cuda_from_version(version))


# ---------------------------------------------------------------------------------------------
# What the node's Python can run: each role's imports, tried in a child process
# ---------------------------------------------------------------------------------------------

RUNTIME_TIMEOUT_S = 60.0
# Run by the node's Python as ``python -c``; prints one JSON object: each check true or false, and
# why for the false ones. Each check is what a rank does: numpy counts only when torch converts a
# tensor with it, as RPC's set-up does (a numpy that torch cannot use, one built for another numpy
# ABI say, fails there with "Numpy is not available" although it is installed).
RUNTIME_CHECK = """
import json, warnings
warnings.simplefilter("ignore")   # torch warns on import when numpy is missing: reported below
found, why, version = {}, {}, None
def check(name, test):
    try:
        found[name] = bool(test())
        if not found[name]:
            why[name] = "not in this torch build"
    except BaseException as exc:
        found[name] = False
        why[name] = (type(exc).__name__ + ": " + str(exc)).splitlines()[0][:200]
def has_numpy():
    global version
    import numpy, torch
    version = numpy.__version__
    return torch.zeros(1).numpy() is not None
check("torch", lambda: __import__("torch"))
if found["torch"]:
    import torch
    check("gloo", lambda: __import__("torch.distributed").distributed.is_available()
          and torch.distributed.is_gloo_available())
    check("rpc", lambda: __import__("torch.distributed.rpc").distributed.rpc.is_available())
    check("numpy", has_numpy)
print(json.dumps({"found": found, "why": why, "numpy_version": version}))
"""


def runtime_from_output(executable: str, output: str) -> PythonRuntime | None:
    """The child's answer (its last line), or None when it printed something else."""
    try:
        answer = json.loads(output.strip().rsplit("\n", 1)[-1])
        found, why = answer["found"], answer["why"]
        if not all(isinstance(v, bool) for v in found.values()) or not isinstance(why, dict):
            return None
    except (ValueError, KeyError, TypeError, IndexError, AttributeError):
        return None
    if found.get("torch") is False:
        return without_torch(executable, str(why.get("torch", "")))
    return PythonRuntime(executable, torch=found.get("torch"), gloo=found.get("gloo"), rpc=found.get("rpc"),
                         numpy=found.get("numpy"), numpy_version=answer.get("numpy_version"),
                         why={str(k): str(v) for k, v in why.items()})


def without_torch(executable: str, why: str) -> PythonRuntime:
    return PythonRuntime(executable, torch=False, gloo=False, rpc=False, numpy=False,
                         why={"torch": why, "gloo": "needs torch", "rpc": "needs torch", "numpy": "needs torch"})


def _cache_path(metadata: dict[str, tuple[str, str]]) -> str | None:
    """Where the answer for this Python with these torch and numpy installs is kept on the node:
    ``~/.cache/hgtrain/pycheck/<hash of the interpreter, the check and each install's metadata path
    and mtime>.json``. Installing, upgrading or removing either changes the name."""
    import hashlib   # here: only a node with torch gets this far

    parts = [sys.executable, RUNTIME_CHECK]
    for name in ("torch", "numpy"):
        path = metadata[name][0] if name in metadata else ""
        try:
            parts += [path, str(os.stat(path).st_mtime_ns) if path else ""]
        except OSError:
            return None
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]
    return os.path.join(os.path.expanduser("~"), ".cache", "hgtrain", "pycheck", key + ".json")


class RuntimeCheck:
    """What this Python can run (``RUNTIME_CHECK``). Importing torch takes a second or more, so it is
    never done in the probe's own process (which must stay fast, and alive on a node whose driver
    crashes torch's import): a child process of this Python does it, started at once so that it runs
    while nvidia-smi does, bounded by ``timeout_s`` from its start (then the checks are unknown, which
    refuses nothing), so the probe as a whole stays within its own bound. Its answer is kept on the node per interpreter and torch/numpy install
    (``_cache_path``), so a later probe costs a file read. Without torch installed there is nothing to
    import and no child."""

    def __init__(self, metadata: dict[str, tuple[str, str]], timeout_s: float = RUNTIME_TIMEOUT_S) -> None:
        self._timeout_s = timeout_s
        self._deadline = time.monotonic() + timeout_s
        self._child: subprocess.Popen[str] | None = None
        self._answer: PythonRuntime | None = None
        self._cache = None
        if "torch" not in metadata:
            self._answer = without_torch(sys.executable, "torch is not installed")
            return
        self._cache = _cache_path(metadata)
        if self._cache is not None:
            self._answer = runtime_from_output(sys.executable, _read(self._cache))
            if self._answer is not None:
                return
        try:
            self._child = subprocess.Popen([sys.executable, "-c", RUNTIME_CHECK], stdin=subprocess.DEVNULL,
                                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                           errors="replace")
        except OSError as exc:
            self._answer = PythonRuntime(sys.executable, why={"torch": f"cannot start {sys.executable}: "
                                                                        f"{exc.strerror or exc}"})

    def result(self) -> PythonRuntime:
        if self._child is None:
            assert self._answer is not None
            return self._answer
        try:
            output, _ = self._child.communicate(timeout=max(0.0, self._deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self._child.kill()
            self._child.communicate()
            return PythonRuntime(sys.executable, why={"torch": f"import torch did not finish within "
                                                               f"{self._timeout_s:g} s"})
        answer = runtime_from_output(sys.executable, output)
        if answer is None:
            return PythonRuntime(sys.executable, why={"torch": f"the check printed {output.strip()[-200:]!r}"})
        if self._cache is not None:
            _keep(self._cache, output)
        return answer


def _keep(path: str, text: str) -> None:
    """Write atomically and privately (the directories it creates 0700, the file 0600, whatever the
    umask: hgtrain's files under ~/.cache are nobody else's); a node whose home is read-only just
    checks again next time."""
    try:
        write_private(Path(path), text)
    except StateError:
        pass


def probe(name: str, host: str, gpus: tuple[int, ...] | None, emulate: EmulateSpec | None) -> NodeInfo:
    metadata = installed()
    runtime = RuntimeCheck(metadata)   # a child importing torch, while nvidia-smi runs
    build = torch_build(metadata.get("torch"))
    torch_version = build.version if build else None
    error = None
    try:
        found = emulated_gpus(emulate) if emulate is not None else bound_gpus(query_gpus(), os.environ)
        devices = select_gpus(found, gpus)
    except NvidiaSmiError as exc:
        devices, error = (), str(exc)
    return NodeInfo(
        name=name,
        host=host,
        ok=error is None,
        error=error,
        emulated=emulate is not None,
        gpus=devices,
        cpu_model=parse_cpuinfo(_read("/proc/cpuinfo")) or platform.processor() or None,
        cpu_cores=_cpu_cores(),
        memory_total_mib=parse_meminfo(_read("/proc/meminfo")),
        os=parse_os_release(_read("/etc/os-release") or _read("/usr/lib/os-release")) or platform.platform(),
        python_version=platform.python_version(),
        torch_version=torch_version,
        torch_cuda=build.cuda if build else None,
        runtime=runtime.result(),
    )


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------

def _gpu_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected GPU indices like 0,2, got {text!r}") from None


def _emulate_spec(text: str) -> EmulateSpec:
    try:
        spec = from_dict(EmulateSpec, json.loads(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"bad emulation spec: {exc}") from None
    if not spec.devices or not len(spec.devices) == len(spec.speed) == len(spec.memory_mib):
        raise argparse.ArgumentTypeError("bad emulation spec: devices, speed and memory_mib need one "
                                         "entry per device")
    if min(spec.speed) <= 0:
        raise argparse.ArgumentTypeError("bad emulation spec: every speed must be greater than 0")
    return spec


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hgcli.node.probe", description=__doc__.split("\n")[0])
    parser.add_argument("--name", required=True)
    parser.add_argument("--host", required=True)
    parser.add_argument("--gpus", type=_gpu_list, default=None, help="visible subset, e.g. 0,2")
    parser.add_argument("--emulate", type=_emulate_spec, default=None, help="EmulateSpec as JSON")
    args = parser.parse_args(argv)
    frames.emit({"type": FrameType.PROBE, "node": to_dict(probe(args.name, args.host, args.gpus, args.emulate))})
    return 0


if __name__ == "__main__":
    sys.exit(main())
