"""The node-side probe: real `python -m hgcli.node.probe` processes against the scripted nvidia-smi
(tests/fakes, real output formats) for every scenario, a node without nvidia-smi, and emulation;
plus the pure parsers on their own."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hgcli.schema.stages import PLAN_NEEDS, GpuInfo, NodeInfo, Strategy, from_dict
from hgcli.node import frames
from hgcli.node.gpus import NvidiaSmiError, describe_failure, parse_gpu_csv, select_gpus, QUERY_FIELDS, OLD_DRIVER_FIELDS
from hgcli.node.probe import (
    RuntimeCheck, installed, parse_cpuinfo, parse_meminfo, parse_os_release, runtime_from_output,
    torch_cuda_from_version, parse_torch_version_py,
)
from tests.venvs import add_package, python_without

ROOT = Path(__file__).resolve().parents[2]
FAKE = ROOT / "tests" / "fakes" / "nvidia-smi"
TIMEOUT_S = 120   # generous: several helpers share this machine's two cores


def node_bin(tmp_path: Path, scenario_file: str | None = None, with_fake: bool = True) -> Path:
    """A PATH directory holding python3 (for the fake's shebang) and, optionally, nvidia-smi."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "python3").symlink_to(sys.executable)
    if with_fake:
        (bindir / "nvidia-smi").symlink_to(FAKE)
    if scenario_file is not None:
        (bindir / "scenario").write_text(scenario_file + "\n")
    return bindir


def run_probe(bindir: Path, *args: str, scenario: str | None = None, python: Path | str = sys.executable,
              home: Path | None = None, environ: dict[str, str] | None = None
              ) -> tuple[NodeInfo, subprocess.CompletedProcess]:
    env = {"PATH": str(bindir), "PYTHONPATH": str(ROOT), "LANG": "C.UTF-8", **(environ or {})}
    if scenario is not None:
        env["FAKE_NVIDIA_SMI_SCENARIO"] = scenario
    if home is not None:
        env["HOME"] = str(home)
    done = subprocess.run([str(python), "-m", "hgcli.node.probe", "--name", "n1", "--host", "gpu-host", *args],
                          capture_output=True, text=True, env=env, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    # split("\n"), not splitlines(): the frame marker \x1e is a line boundary for splitlines().
    decoded = [frames.decode(line) for line in done.stdout.split("\n") if line]
    assert len(decoded) == 1 and decoded[0] is not None, done.stdout      # exactly one frame, no noise
    assert decoded[0]["type"] == "probe"
    return from_dict(NodeInfo, decoded[0]["node"]), done


def assert_host_facts(node: NodeInfo) -> None:
    """CPU, memory, OS, Python and torch are reported whatever the GPUs did."""
    assert node.name == "n1" and node.host == "gpu-host"
    assert node.cpu_cores and node.cpu_cores >= 1
    assert node.memory_total_mib and node.memory_total_mib > 0
    assert node.os and node.python_version == ".".join(map(str, sys.version_info[:3]))
    # What torch itself reports (torch.__version__, torch.version.cuda), which is what bench records:
    # a build's install metadata may lack the local label (an H200 image: 2.11.0 vs 2.11.0+cu130).
    import torch
    assert (node.torch_version, node.torch_cuda) == (torch.__version__, torch.version.cuda)


@pytest.fixture
def fake_bin(tmp_path):
    return node_bin(tmp_path)


def test_a100x2(fake_bin):
    node, _ = run_probe(fake_bin, scenario="a100x2")
    assert node.ok and node.error is None and not node.emulated
    assert [(g.index, g.name, g.memory_total_mib, g.compute_capability) for g in node.gpus] == [
        (0, "NVIDIA A100-SXM4-40GB", 40960, "8.0"), (1, "NVIDIA A100-SXM4-40GB", 40960, "8.0")]
    assert all(g.uuid.startswith("GPU-") and g.driver_version == "535.161.08" and not g.emulated
               for g in node.gpus)
    assert node.gpus[0].uuid != node.gpus[1].uuid
    assert_host_facts(node)


def test_h200_as_captured(fake_bin):
    node, _ = run_probe(fake_bin, scenario="h200")
    assert node.ok and [(g.index, g.name, g.memory_total_mib, g.memory_used_mib, g.compute_capability,
                         g.driver_version) for g in node.gpus] == [
        (0, "NVIDIA H200", 143771, 4, "9.0", "580.159.04")]


def test_mixed_models_on_one_node(fake_bin):
    node, _ = run_probe(fake_bin, scenario="mixed")
    assert node.ok
    assert [(g.name, g.compute_capability, g.memory_total_mib) for g in node.gpus] == [
        ("NVIDIA A100-SXM4-40GB", "8.0", 40960), ("Tesla V100-SXM2-16GB", "7.0", 16160),
        ("NVIDIA GeForce RTX 3090", "8.6", 24576), ("Tesla T4", "7.5", 15360)]
    assert node.gpus[2].memory_used_mib == 312


@pytest.mark.parametrize("environ, indices", [
    ({"CUDA_VISIBLE_DEVICES": "3,GPU-1b2c3d4e"}, [1, 3]),          # an index and a UUID prefix
    ({"SLURM_STEP_GPUS": "0,2"}, [0, 2]),                            # Slurm's binding alone
    ({"CUDA_VISIBLE_DEVICES": "2", "SLURM_STEP_GPUS": "0,2"}, [2]),   # CUDA's own variable first
    ({"CUDA_VISIBLE_DEVICES": "1,-1,2"}, [1]),                       # the list ends where CUDA's does
    ({"CUDA_VISIBLE_DEVICES": ""}, []),                              # none
])
def test_gpu_binding_is_respected(fake_bin, environ, indices):
    """Slurm's GPU binding (and a user's CUDA_VISIBLE_DEVICES): the probe reports only those GPUs."""
    node, _ = run_probe(fake_bin, scenario="mixed", environ=environ)
    assert node.ok and [g.index for g in node.gpus] == indices


def test_old_driver_without_compute_cap_field(fake_bin):
    node, _ = run_probe(fake_bin, scenario="old-driver")
    assert node.ok, node.error
    assert [g.name for g in node.gpus] == ["Tesla V100-SXM2-32GB", "Tesla P100-PCIE-16GB"]
    assert all(g.compute_capability is None and g.driver_version == "470.182.03" for g in node.gpus)
    assert node.gpus[0].memory_total_mib == 32510


def test_unavailable_fields_become_null(fake_bin):
    node, _ = run_probe(fake_bin, scenario="na-fields")
    assert node.ok
    healthy, partial = node.gpus
    assert (healthy.memory_used_mib, healthy.compute_capability) == (4, "8.0")
    assert (partial.memory_used_mib, partial.compute_capability) == (None, None)
    assert partial.memory_total_mib == 8114


@pytest.mark.parametrize("scenario,words", [
    ("exit9", ["cannot talk to the NVIDIA driver (exit 9)", "is the driver loaded?", "couldn't communicate"]),
    ("exit18", ["different versions (nvidia-smi exit 18)", "reboot the node", "Driver/library version mismatch"]),
    ("garbage", ["nvidia-smi printed output hgtrain cannot read", "GPU 0: NVIDIA A100"]),
])
def test_nvidia_smi_failure_is_the_nodes_error(fake_bin, scenario, words):
    node, done = run_probe(fake_bin, scenario=scenario)
    assert not node.ok and node.gpus == ()
    for word in words:
        assert word in node.error
    assert "Traceback" not in done.stderr
    assert_host_facts(node)


def test_scenario_file_beside_the_script_selects_without_env(tmp_path):
    node, _ = run_probe(node_bin(tmp_path, scenario_file="mixed"))
    assert len(node.gpus) == 4


def test_unknown_scenario_is_loud_not_a_silent_default(tmp_path):
    node, _ = run_probe(node_bin(tmp_path))
    assert not node.ok and "nvidia-smi failed (exit 99)" in node.error and "unknown scenario" in node.error


def test_no_nvidia_smi_is_a_cpu_node(tmp_path):
    node, _ = run_probe(node_bin(tmp_path, with_fake=False))
    assert node.ok and node.error is None and node.gpus == () and not node.emulated
    assert_host_facts(node)


def test_gpu_subset(fake_bin):
    node, _ = run_probe(fake_bin, "--gpus", "0,2", scenario="mixed")
    assert node.ok and [g.index for g in node.gpus] == [0, 2]


def test_gpu_subset_naming_a_missing_index(fake_bin):
    node, _ = run_probe(fake_bin, "--gpus", "1,5", scenario="a100x2")
    assert not node.ok and "GPU index 5" in node.error and "0, 1" in node.error


EMULATE = {"devices": ["NVIDIA A100-SXM4-40GB", "Tesla T4"], "speed": [1.0, 0.25], "memory_mib": [40960, 15360]}


def test_emulation_reports_declared_devices_and_real_host_facts(fake_bin):
    # The broken driver on PATH is never asked: emulated devices run on the CPU.
    node, _ = run_probe(fake_bin, "--emulate", json.dumps(EMULATE), scenario="exit9")
    assert node.ok and node.emulated
    assert node.gpus == (
        GpuInfo(index=0, name="NVIDIA A100-SXM4-40GB", memory_total_mib=40960, emulated=True, speed=1.0),
        GpuInfo(index=1, name="Tesla T4", memory_total_mib=15360, emulated=True, speed=0.25))
    assert_host_facts(node)


def test_emulation_with_gpu_subset(tmp_path):
    node, _ = run_probe(node_bin(tmp_path, with_fake=False), "--gpus", "1", "--emulate", json.dumps(EMULATE))
    assert [(g.index, g.name, g.speed) for g in node.gpus] == [(1, "Tesla T4", 0.25)]


@pytest.mark.parametrize("spec", ['{"devices": ["A"]}', '{"devices": ["A"], "speed": [0], "memory_mib": [1]}',
                                  '{"devices": ["A", "B"], "speed": [1], "memory_mib": [1, 2]}', "not json"])
def test_bad_emulation_spec_is_a_usage_error(tmp_path, spec):
    done = subprocess.run([sys.executable, "-m", "hgcli.node.probe", "--name", "n", "--host", "h",
                           "--emulate", spec], capture_output=True, text=True, timeout=TIMEOUT_S,
                          env={"PATH": str(node_bin(tmp_path)), "PYTHONPATH": str(ROOT)})
    assert done.returncode == 2 and "bad emulation spec" in done.stderr and done.stdout == ""


def test_probe_never_imports_torch(fake_bin):
    code = ("import sys; from hgcli.node import probe; probe.main(['--name', 'n', '--host', 'h']); "
            "print('torch' in sys.modules, file=sys.stderr)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT_S,
                          env={"PATH": str(fake_bin), "PYTHONPATH": str(ROOT), "FAKE_NVIDIA_SMI_SCENARIO": "a100x2"})
    assert done.returncode == 0 and done.stderr.strip() == "False"


# ---------------------------------------------------------------------------------------------
# What the node's Python can run (a child process imports what each plan's ranks import)
# ---------------------------------------------------------------------------------------------

def test_this_python_can_run_every_plan_and_the_answer_is_kept_on_the_node(tmp_path):
    import numpy

    node, _ = run_probe(node_bin(tmp_path, with_fake=False), home=tmp_path / "home")
    rt = node.runtime
    assert (rt.executable, rt.torch, rt.gloo, rt.rpc, rt.numpy) == (sys.executable, True, True, True, True)
    assert rt.numpy_version == numpy.__version__ and rt.why == {}
    assert all(not rt.lacking(needs) for needs in PLAN_NEEDS.values())
    # The next probe reads the kept answer instead of importing torch again.
    kept, = (tmp_path / "home" / ".cache" / "hgtrain" / "pycheck").iterdir()
    kept.write_text(kept.read_text().replace(numpy.__version__, "kept"))
    again, _ = run_probe(tmp_path / "bin", home=tmp_path / "home")
    assert again.runtime.numpy_version == "kept"


@pytest.mark.slow
def test_a_python_without_numpy_is_reported_and_checked_again_once_numpy_is_installed(tmp_path):
    python = python_without(tmp_path / "venv", "numpy")
    bindir = node_bin(tmp_path, with_fake=False)
    node, _ = run_probe(bindir, python=python, home=tmp_path / "home")
    rt = node.runtime
    assert (rt.executable, rt.torch, rt.gloo, rt.rpc, rt.numpy) == (str(python), True, True, True, False)
    assert "No module named 'numpy'" in rt.why["numpy"], rt.why
    assert rt.lacking(PLAN_NEEDS[Strategy.HYBRID]) == ("numpy",) and rt.lacking(PLAN_NEEDS[Strategy.ALLREDUCE]) == ()
    add_package(python, "numpy")      # a new install's metadata: the kept answer no longer applies
    node, _ = run_probe(bindir, python=python, home=tmp_path / "home")
    assert node.runtime.numpy is True and node.runtime.why == {}


def test_a_python_without_torch_can_run_no_plan_and_needs_no_child(tmp_path):
    python = python_without(tmp_path / "venv", "torch")
    node, _ = run_probe(node_bin(tmp_path, with_fake=False), python=python, home=tmp_path / "home")
    rt = node.runtime
    assert (rt.torch, rt.gloo, rt.rpc, rt.numpy) == (False, False, False, False)
    assert rt.why["torch"] == "torch is not installed" and node.torch_version is None
    assert not (tmp_path / "home" / ".cache").exists()     # nothing was imported, nothing kept


def test_a_check_that_does_not_finish_in_time_leaves_every_answer_unknown(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    rt = RuntimeCheck(installed(), timeout_s=0.01).result()     # importing torch takes longer
    assert (rt.torch, rt.gloo, rt.rpc, rt.numpy) == (None, None, None, None)
    assert "did not finish within 0.01 s" in rt.why["torch"]
    assert rt.lacking(PLAN_NEEDS[Strategy.HYBRID]) == ()             # unknown is never "missing"
    assert not (tmp_path / ".cache").exists()


def test_an_unreadable_answer_is_no_answer():
    assert runtime_from_output("py", "Segmentation fault") is None
    assert runtime_from_output("py", '{"found": {"torch": "yes"}, "why": {}}') is None
    rt = runtime_from_output("py", 'noise\n{"found": {"torch": true, "gloo": true, "rpc": false, "numpy": true}, '
                                   '"why": {"rpc": "not in this torch build"}, "numpy_version": "1.26.4"}')
    assert (rt.torch, rt.rpc, rt.why, rt.numpy_version) == (True, False, {"rpc": "not in this torch build"}, "1.26.4")


# ---------------------------------------------------------------------------------------------
# Pure parsers
# ---------------------------------------------------------------------------------------------

def test_parse_gpu_csv_sorts_and_strips():
    text = ("1, Tesla T4, GPU-b, 15360, 0, 7.5, 535.161.08\n"
            "0, NVIDIA A100-SXM4-40GB, GPU-a, 40960, [Unknown Error], [N/A], [Not Supported]\n\n")
    a, t = parse_gpu_csv(text, QUERY_FIELDS)
    assert (a.index, a.memory_used_mib, a.compute_capability, a.driver_version) == (0, None, None, None)
    assert (t.index, t.name, t.uuid, t.compute_capability) == (1, "Tesla T4", "GPU-b", "7.5")


def test_parse_gpu_csv_without_compute_cap():
    gpu, = parse_gpu_csv("0, Tesla K80, GPU-k, 11441, 0, 470.182.03\n", OLD_DRIVER_FIELDS)
    assert gpu.compute_capability is None and gpu.driver_version == "470.182.03"


@pytest.mark.parametrize("text,words", [
    ("", "listed no GPUs"),
    ("No devices were found\n", "cannot read"),
    ("0, A100, GPU-a, 40960 MiB, 0, 8.0, 535\n", "expected a number"),
    ("0, A100, GPU-a, 40960, 0, eight, 535\n", "compute capability"),
    ("[N/A], A100, GPU-a, 40960, 0, 8.0, 535\n", "without an index"),
    ("0, A100, GPU-a, 40960, 0, 8.0\n", "expected 7 values"),
])
def test_parse_gpu_csv_rejects_what_it_cannot_read(text, words):
    with pytest.raises(NvidiaSmiError, match=words):
        parse_gpu_csv(text, QUERY_FIELDS)


def test_describe_failure():
    assert describe_failure(9, "\nNVIDIA-SMI has failed ...\n").startswith(
        "nvidia-smi cannot talk to the NVIDIA driver (exit 9): is the driver loaded? [nvidia-smi: NVIDIA-SMI")
    assert "exit 18" in describe_failure(18, "Failed to initialize NVML: Driver/library version mismatch")
    assert describe_failure(42, "") == "nvidia-smi failed (exit 42)"
    assert len(describe_failure(1, "x" * 5000)) < 300


def test_select_gpus():
    gpus = parse_gpu_csv("0, A, u0, 1, 0, 8.0, d\n1, B, u1, 1, 0, 8.0, d\n", QUERY_FIELDS)
    assert select_gpus(gpus, None) == gpus
    assert [g.name for g in select_gpus(gpus, (1,))] == ["B"]
    assert select_gpus(gpus, ()) == ()
    with pytest.raises(NvidiaSmiError, match="GPU index 3"):
        select_gpus(gpus, (3,))


@pytest.mark.parametrize("version,cuda", [
    ("2.1.0+cu121", "12.1"), ("1.13.1+cu117", "11.7"), ("1.4.0+cu92", "9.2"), ("2.3.0+cu118", "11.8"),
    ("2.13.0+cpu", None), ("2.2.0+rocm5.7", None), ("2.1.0", None),
])
def test_torch_cuda_from_version(version, cuda):
    assert torch_cuda_from_version(version) == cuda


def test_torch_version_py_gives_the_version_and_cuda_torch_reports():
    import torch
    here = Path(torch.__file__).with_name("version.py").read_text()
    assert parse_torch_version_py(here) == (torch.__version__, torch.version.cuda)
    # A CUDA build's file, as torch's build writes it (tools/generate_torch_version.py's layout).
    cuda_build = ("from typing import Optional\n\n__all__ = ['__version__', 'debug', 'cuda']\n"
                  "__version__ = '2.11.0+cu130'\ndebug = False\ncuda: Optional[str] = '13.0'\n"
                  "git_version = 'abc'\nhip: Optional[str] = None\n")
    assert parse_torch_version_py(cuda_build) == ("2.11.0+cu130", "13.0")
    assert parse_torch_version_py("") == (None, None)


def test_host_file_parsers():
    x86 = "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Gold 6248 CPU @ 2.50GHz\n"
    arm = "processor\t: 0\nBogoMIPS\t: 50.00\nCPU part\t: 0xd0c\n\nHardware\t: NVIDIA Jetson\n"
    assert parse_cpuinfo(x86) == "Intel(R) Xeon(R) Gold 6248 CPU @ 2.50GHz"
    assert parse_cpuinfo(arm) == "NVIDIA Jetson"
    assert parse_cpuinfo("") is None
    assert parse_meminfo("MemTotal:       24684728 kB\nMemFree: 1 kB\n") == 24106
    assert parse_meminfo("garbage") is None
    assert parse_os_release('NAME="Ubuntu"\nPRETTY_NAME="Ubuntu 22.04.4 LTS"\n') == "Ubuntu 22.04.4 LTS"
    assert parse_os_release("PRETTY_NAME='Rocky Linux 9'\n") == "Rocky Linux 9"
    assert parse_os_release("ID=alpine\n") is None
