"""A node whose Python lacks what its ranks import is refused before anything starts, with one line
naming node and module and exit 2: ``launch --plan`` (the stored inventory, confirmed by a fresh
probe), ``plan`` and ``launch`` through the pipeline (probe, bench, plan). The node's Python is a real
venv without numpy (tests/venvs.py), so probe, bench and refusal see what a user's node would show."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hgcli.config.cluster import load_cluster
from hgcli.node.frames import decode_lines
from tests.venvs import python_without

from .plans import make_plan, plan_file

pytestmark = pytest.mark.slow
PY = sys.executable


@pytest.fixture
def no_numpy(tmp_path):
    """(cluster file, the node's python): one local node, two emulated devices of unlike speed."""
    python = python_without(tmp_path / "venv", "numpy")
    path = tmp_path / "cluster.toml"
    path.write_text(f'[[nodes]]\nname = "gpuless"\nhost = "localhost"\npython = "{python}"\n'
                    'emulate = { devices = ["A100", "T4"], speed = [1.0, 0.25], memory_mib = [40960, 15360] }\n')
    return path, python


def hgtrain(hg, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "hgcli", *args], capture_output=True, text=True, stdin=subprocess.DEVNULL,
                          env=hg.env(COLUMNS="200"), cwd=hg.tmp_path, timeout=timeout)


def refusal(err: str, python) -> str:
    """The error line (stage lines may come before it), checked to name node, module and remedy."""
    line = err.strip().splitlines()[-1]
    assert line.startswith("hgtrain: error: the hybrid plan's ranks cannot run: node gpuless: its Python "
                           f"{python} lacks numpy, which torch.distributed.rpc needs"), err
    assert f"'{python} -m pip install numpy' on gpuless" in line and "Nothing was started" in line, line
    return line


def test_probe_shows_it_and_launch_of_a_ps_plan_file_refuses_it_starting_nothing(hg, tmp_path, no_numpy):
    path, python = no_numpy
    probe = hgtrain(hg, "probe", "-c", str(path), "--json")
    assert probe.returncode == 0, probe.stderr
    runtime = json.loads(probe.stdout)["nodes"][0]["runtime"]
    assert (runtime["executable"], runtime["torch"], runtime["rpc"], runtime["numpy"]) == (str(python), True, True,
                                                                                           False)
    table = hgtrain(hg, "probe", "-c", str(path)).stdout
    assert "plans: allreduce yes, hybrid/ps NO (numpy: ModuleNotFoundError: No module named 'numpy')" in \
        " ".join(table.replace("│", " ").split()), table

    cluster = load_cluster(path)
    hybrid = plan_file(tmp_path, make_plan(cluster, [["gpuless"], ["gpuless"]], ps=["gpuless"]))
    code, out, err = hg.run("-c", str(path), "--plan", str(hybrid), "--", str(python), "-c", "print('ran')")
    assert code == 2 and out == "", err
    refusal(err, python)
    assert hg.job_ids() == []                 # no job record, no agent: nothing started

    # Without PS ranks the same node's Python is enough.
    allreduce = plan_file(tmp_path, make_plan(cluster, [["gpuless", "gpuless"]]))
    code, out, err = hg.run("-c", str(path), "--plan", str(allreduce), "--", str(python), "-c", "print('ran')")
    assert code == 0 and out.count("| ran") == 2, err + out


def test_plan_and_launch_refuse_a_hybrid_plan_before_anything_starts(hg, no_numpy, monkeypatch):
    path, python = no_numpy
    monkeypatch.setenv("HGTRAIN_BENCH_MODEL", "example@8,32")    # the plan's bench: two sizes suffice here
    planned = hgtrain(hg, "plan", "-c", str(path), "--strategy", "hybrid", timeout=900)
    assert planned.returncode == 2 and planned.stdout == "", planned.stderr
    refusal(planned.stderr, python)
    assert "benching" not in planned.stderr      # no node can run it: refused before the bench
    code, out, err = hg.run("-c", str(path), "--strategy", "hybrid", "--", str(python), "-c", "print('ran')")
    assert code == 2, err
    refusal(err, python)
    assert hg.job_ids() == []
    allreduce = hgtrain(hg, "plan", "-c", str(path), "--strategy", "allreduce", "--json")
    assert allreduce.returncode == 0, allreduce.stderr


def test_unchecked_node_the_rank_itself_names_module_node_and_install_command(hg, tmp_path, no_numpy):
    """Nothing stored to refuse by (a plan file, never probed): the ranks start, and a rank of a PS plan
    says what RPC lacks before the rendezvous, instead of torch's "Numpy is not available"."""
    path, python = no_numpy
    hybrid = plan_file(tmp_path, make_plan(load_cluster(path), [["gpuless"], ["gpuless"]], ps=["gpuless"]))
    code, out, err = hg.run("-c", str(path), "--plan", str(hybrid), "--json", "--grace", "1", "--",
                            str(python), "-c", "import hgcli.runtime as hg; hg.init()")
    assert code == 1, err
    cause = json.loads(out.splitlines()[-1])["root_cause"]
    text = "\n".join(cause["last_lines"])
    assert (f"(node gpuless): torch.distributed.rpc, which the parameter-server ranks use, needs numpy, and in "
            f"{python} numpy cannot be imported (No module named 'numpy'): run '{python} -m pip install numpy' "
            "on node gpuless") in text, text


def test_a_node_without_torch_is_refused_before_the_bench(hg, tmp_path):
    python = python_without(tmp_path / "venv", "torch")
    path = tmp_path / "cluster.toml"
    path.write_text(f'[[nodes]]\nname = "bare"\nhost = "localhost"\npython = "{python}"\n'
                    'emulate = { devices = ["A100"], speed = [1.0], memory_mib = [40960] }\n')
    planned = hgtrain(hg, "plan", "-c", str(path))
    assert planned.returncode == 2 and planned.stdout == "", planned.stderr
    line = planned.stderr.strip().splitlines()[-1]
    assert line == (f"hgtrain: error: cannot bench: node bare: its Python {python} lacks torch: run '{python} -m pip "
                    "install torch' on bare (torch is not installed); or set the node's python in the cluster file "
                    "to one that has it"), planned.stderr
    assert "benching" not in planned.stderr
    bench = hgtrain(hg, "bench", "-c", str(path))          # the stored inventory says so: the same refusal
    assert bench.returncode == 2 and bench.stdout == "", bench.stderr
    assert bench.stderr.strip().splitlines()[-1] == line, bench.stderr

    # Without an inventory to refuse by, the node's bench program itself says it in the device's profile
    # and exits 0, its lifeline thread still reading the controller's open stdin (it used to abort: -6).
    node = subprocess.Popen([str(python), "-m", "hgcli.node.bench", "--node", "bare", "--device", "gpu0",
                             "--emulate-speed", "1", "--quick", "--lifeline"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    node.wait(timeout=60)                   # stdin still open: it exits by itself
    out, err = node.stdout.read(), node.stderr.read()
    node.stdin.close()
    assert node.returncode == 0 and "Fatal Python error" not in err, err
    [profile] = [f["profile"] for f in decode_lines(out) if f["type"] == "profile"]
    assert profile["error"].startswith(f"its Python {python} lacks torch: run '{python} -m pip install torch' on "
                                       "bare (ModuleNotFoundError"), profile
    assert profile["torch_version"] is None and profile["steps"] == []
