"""A node's devices benched together (hgcli/bench/together.py, hgcli/node/bench/together.py) on the
local node: real node processes, real torch, one process per emulated device stepping at once."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hgcli.bench.cluster import bench_cluster
from hgcli.bench.together import STEPS
from hgcli.config.cluster import load_cluster
from hgcli.plan.placement import make_plan
from hgcli.schema.stages import JobSpec
from tests.bench_inventory import inventory_of

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]

ONE_NODE = """
[[nodes]]
name = "a"
host = "localhost"
emulate = { devices = ["NVIDIA A100-SXM4-40GB", "NVIDIA A100-SXM4-40GB"], speed = [1.0, 1.0], memory_mib = [40960, 40960] }
"""


@pytest.fixture
def one_core():
    """This process and every process it starts (the node programs and their children) on one core."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(before)})
    yield
    os.sched_setaffinity(0, before)


def test_two_devices_sharing_one_core_step_about_half_as_fast_together_and_the_plan_says_so(tmp_path, one_core):
    path = tmp_path / "cluster.toml"
    path.write_text(ONE_NODE)
    cluster = load_cluster(path)
    inventory = inventory_of(cluster)
    profiles = bench_cluster(cluster, inventory, quick=True, model_spec="mlp@64,256")
    assert [d.error for d in profiles.devices] == [None, None]
    for d in profiles.devices:
        t = d.together
        assert t is not None and t.devices == 2
        alone = {s.batch_size: s.seconds.median for s in d.steps}
        # Two phases at the two benched sizes (the MLP's steps are under 0.1 s; a few ms: steps well
        # under the scheduler's time slice can run whole between the other's, and wait less).
        assert [s.batch_size for s in t.steps] == sorted(alone)[-2:]
        for s in t.steps:
            assert s.seconds.repeats >= STEPS[True]
            # Alone, a speed-1 device's step is its CPU time; two of them on one core wait for each
            # other: each step lasts about twice as long. The alone figure is timed earlier, and a
            # parallel test run can slow it too (CI measured 1.41x at batch 64): 1.3x still shows it.
            assert s.mean_s >= 1.3 * alone[s.batch_size], (d.device, s, alone)
    plan = make_plan(inventory, profiles, JobSpec(global_batch=64))
    assert plan.bench_together
    assert plan.predicted_samples_per_s["allreduce"] < plan.predicted_samples_per_s["ideal"] / 1.3


def test_a_device_that_cannot_step_leaves_a_note_and_no_together_figures():
    job = {"devices": [{"device": "cpu", "speed": 1.0, "batches": [4]},
                       {"device": "gpu7", "speed": None, "batches": [4]}],   # no CUDA device 7 here
           "steps": 2, "least_s": 0.1, "most_s": 5.0, "warmup": 1}
    out = subprocess.run([sys.executable, "-m", "hgcli.node.bench.together", "--node", "a", "--model", "example-mlp",
                          "--job", json.dumps(job)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 0, out.stderr
    frames = [json.loads(line[line.index("{"):]) for line in out.stdout.splitlines() if "{" in line]
    assert not any(f["type"] == "together" for f in frames)
    notes = [f["message"] for f in frames if f["type"] == "note"]
    assert len(notes) == 1 and notes[0].startswith("devices together not measured: gpu7 did not start: exit code")
