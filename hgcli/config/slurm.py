"""``--transport ssh|srun|auto``: whether a cluster's nodes are reached over SSH or as job steps of
the Slurm allocation hgtrain runs in (``remote/srun.py``), and the allocation's nodes as srun reaches them.

auto chooses srun inside an allocation (``SLURM_JOB_ID`` set and srun on PATH) when every node of the
cluster is a node of that allocation, which is always so for nodes taken from ``SLURM_JOB_NODELIST``;
a cluster file naming other hosts keeps SSH. docs/slurm.md is the user's side of this.
"""
from __future__ import annotations

import dataclasses
import shutil
from typing import Mapping

from ..errors import UsageError
from ..schema.stages import Cluster, SrunSettings
from .nodelists import expand_nodelist

TRANSPORTS = ("auto", "ssh", "srun")
JOB_ID = "SLURM_JOB_ID"
NODELIST = "SLURM_JOB_NODELIST"
# A heterogeneous job (``#SBATCH hetjob``, ``salloc ... : ...``) has no SLURM_JOB_NODELIST: each
# component N has its own list, and a step on its nodes names the component (``--het-group=N``).
HET_NODELIST = "SLURM_JOB_NODELIST_HET_GROUP_{}"


def het_nodelists(environ: Mapping[str, str]) -> list[str]:
    """Each component's node list of a heterogeneous job, in component order ([] for any other job)."""
    found: list[str] = []
    while environ.get(HET_NODELIST.format(len(found))):
        found.append(environ[HET_NODELIST.format(len(found))])
    return found


def allocation_nodelist(environ: Mapping[str, str]) -> str | None:
    """The allocation's nodes in Slurm's compressed form: SLURM_JOB_NODELIST, or every component's
    list of a heterogeneous job; None outside an allocation."""
    return environ.get(NODELIST) or ",".join(het_nodelists(environ)) or None


def allocation(environ: Mapping[str, str], job_id: str | None = None) -> SrunSettings | None:
    """The allocation to start steps in: ``job_id`` (a recorded job's), else this environment's
    SLURM_JOB_ID; None without one or without srun on PATH."""
    job = job_id or environ.get(JOB_ID)
    srun = shutil.which("srun", path=environ.get("PATH"))
    return SrunSettings(job_id=job, srun=srun) if job and srun else None


def wanted(transport: str, environ: Mapping[str, str], job_id: str | None = None) -> SrunSettings | None:
    """The allocation ``transport`` asks for (None: SSH). ``srun`` outside an allocation is refused."""
    if transport not in TRANSPORTS:
        raise UsageError(f"transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
    if transport == "ssh":
        return None
    found = allocation(environ, job_id)
    if transport == "srun" and found is None:
        if not (job_id or environ.get(JOB_ID)):
            raise UsageError("transport srun: not inside a Slurm allocation (SLURM_JOB_ID is not set); "
                             "run hgtrain under sbatch or salloc, or use the ssh transport")
        raise UsageError("transport srun: srun is not on PATH; add Slurm's bin directory to PATH "
                         "or use the ssh transport")
    return found


def members(settings: SrunSettings, environ: Mapping[str, str]) -> dict[str, int | None]:
    """The allocation's node names, each with its component of a heterogeneous job (else None):
    from this environment when it is that job's, else Slurm's own answer (a recorded job reached
    from another terminal; squeue prints one line per component)."""
    from ..remote.srun import job_nodelists

    if environ.get(JOB_ID) == settings.job_id and allocation_nodelist(environ):
        lists = het_nodelists(environ) or [environ[NODELIST]]
    else:
        lists = job_nodelists(settings)
    if not lists:
        raise UsageError(f"Slurm job {settings.job_id} is not running (squeue does not know it): its "
                         "nodes cannot be reached as job steps; use the ssh transport")
    het = len(lists) > 1 or bool(het_nodelists(environ))
    return {host: (group if het else None) for group, nodelist in enumerate(lists)
            for host in expand_nodelist(nodelist)}


def reach_by_srun(cluster: Cluster, settings: SrunSettings, environ: Mapping[str, str], *,
                  required: bool) -> Cluster:
    """``cluster`` with its nodes reached as steps of ``settings``' job, each at the address Slurm
    gives it (NodeAddr). A node outside the allocation: UsageError when srun was asked for by name
    (``required``), else the cluster unchanged (SSH)."""
    from ..remote.srun import node_addresses

    groups = members(settings, environ)
    outside = [n for n in cluster.nodes if n.host not in groups]
    if outside:
        if not required:
            return cluster
        node = outside[0]
        raise UsageError(f"transport srun: node {node.name!r} (host {node.host}) is not a node of Slurm "
                         f"job {settings.job_id}; srun reaches only the allocation's nodes ({', '.join(sorted(groups))})")
    addresses = node_addresses(settings, [n.host for n in cluster.nodes])
    nodes = tuple(dataclasses.replace(n, hostname=addresses[n.host]) if addresses.get(n.host, n.host) != n.host
                  else n for n in cluster.nodes)
    het = tuple((host, group) for host, group in groups.items() if group is not None)
    return dataclasses.replace(cluster, nodes=nodes, srun=dataclasses.replace(settings, het_groups=het))
