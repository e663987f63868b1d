"""--transport and the srun command line, without a running Slurm (tests/slurm has the real one).

Only ``srun``'s presence on PATH is arranged here (an executable file that is never run): what auto
chooses is decided before anything asks Slurm.
"""
from __future__ import annotations

import pytest

from hgcli.config.cluster import load_node_source
from hgcli.config.slurm import allocation_nodelist, members
from hgcli.errors import UsageError
from hgcli.remote.srun import step_argv
from hgcli.schema.stages import NodeSpec, SrunSettings


@pytest.fixture
def srun_path(tmp_path):
    srun = tmp_path / "srun"
    srun.write_text("#!/bin/sh\nexit 99\n")
    srun.chmod(0o755)
    return str(tmp_path)


def test_auto_keeps_ssh_for_nodes_outside_the_allocation_and_srun_refuses_them(tmp_path, srun_path):
    cluster_file = tmp_path / "c.toml"
    cluster_file.write_text('[[nodes]]\nhost = "elsewhere"\n')
    inside = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]", "PATH": srun_path}
    assert load_node_source(cluster_file, environ=inside, transport="auto").srun is None
    with pytest.raises(UsageError, match=r"node 'elsewhere' \(host elsewhere\) is not a node of Slurm job 7"):
        load_node_source(cluster_file, environ=inside, transport="srun")
    with pytest.raises(UsageError, match="srun is not on PATH"):
        load_node_source(cluster_file, environ={**inside, "PATH": str(tmp_path / "none")}, transport="srun")
    assert load_node_source(environ={"SLURM_JOB_NODELIST": "n1", "PATH": srun_path}, transport="auto").srun is None


def test_heterogeneous_job_components_and_their_steps():
    environ = {"SLURM_JOB_ID": "5", "SLURM_JOB_NODELIST_HET_GROUP_0": "a[1-2]",
               "SLURM_JOB_NODELIST_HET_GROUP_1": "t1"}
    assert allocation_nodelist(environ) == "a[1-2],t1"
    settings = SrunSettings(job_id="5", srun="/usr/bin/srun")
    assert members(settings, environ) == {"a1": 0, "a2": 0, "t1": 1}
    het = SrunSettings(job_id="5", srun="/usr/bin/srun", het_groups=(("a1", 0), ("t1", 1)))
    argv = step_argv(het, NodeSpec(name="t1", host="t1"), "hgtrain-x", ["python3", "-c", "print('a b')"],
                     {"PYTHONPATH": "/p q"})
    assert argv[:3] == ["/usr/bin/srun", "--jobid=5", "--het-group=1"] and "--nodelist=t1" in argv
    # No shell in between: every argument is one argv element, as given.
    assert argv[argv.index("--"):] == ["--", "env", "PYTHONPATH=/p q", "python3", "-c", "print('a b')"]
    plain = step_argv(settings, NodeSpec(name="a1", host="a1"), "hgtrain-y", ["true"])
    assert not any(a.startswith("--het-group") for a in plain) and "--overlap" in plain and "--exact" not in plain


def test_detach_is_refused_with_srun_before_anything_starts():
    from hgcli.launch.request import LaunchRequest
    from hgcli.schema.stages import Cluster

    cluster = Cluster(nodes=(NodeSpec(name="n1", host="n1"),), srun=SrunSettings(job_id="5"))
    with pytest.raises(UsageError, match=r"detach: a job of Slurm job steps \(cluster.srun\)"):
        LaunchRequest(cluster=cluster, command=("true",), detach=True)
    LaunchRequest(cluster=cluster, command=("true",))   # attached: fine
