"""Cluster file (TOML), hostfile or Slurm node list -> Cluster; every error names file:LINE and key.

Everything is checked before anything is contacted: a typo costs an exit code 2 and one line naming
the file, the line and the key (with the closest known key for a misspelling), never a half-run
probe. ``docs/cluster-file.md`` is the reference of every key and of the node sources. This module
picks the node source and sizes the embedded local cluster; ``clusterfile`` reads a cluster file or
hostfile and ``checks`` checks its values.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import sys
from pathlib import Path
from typing import Mapping

from ..errors import ConfigError
from ..schema.stages import Cluster, EmulateSpec, NodeSpec
from . import slurm
from .clusterfile import NodeDecl, finish, hostfile_decls, read_cluster_file, settings_only
from .nodelists import expand_nodelist
from .slurm import allocation_nodelist

# The emulated set the default local cluster uses on a machine without GPUs: two fast and two slow
# devices, the shape of the lab clusters hgtrain is for. Labelled emulated in every output.
DEFAULT_EMULATION = EmulateSpec(
    devices=("NVIDIA A100-SXM4-40GB", "NVIDIA A100-SXM4-40GB", "Tesla T4", "Tesla T4"),
    speed=(1.0, 1.0, 0.25, 0.25),
    memory_mib=(40960, 40960, 15360, 15360),
)

SLURM_SOURCE = "SLURM_JOB_NODELIST"


def default_cluster(nproc_per_node: int | None = None) -> Cluster:
    """This machine alone: its GPUs, or on a machine without nvidia-smi an emulated set. Its Python is
    the controller's own (where hgtrain and its dependencies are installed, a virtual environment
    say), not whichever ``python3`` comes first on PATH.

    ``nproc_per_node`` (``--nproc-per-node N``, as torchrun users type it): the first N GPUs, or on a
    machine without GPUs N identical emulated devices (the fast device of the default set), so a
    2-rank script needs no cluster file."""
    gpus, emulate = nproc_devices(nproc_per_node)
    node = NodeSpec(name="local", host="localhost", python=sys.executable, gpus=gpus, emulate=emulate)
    return Cluster(nodes=(node,), source=None)


def nproc_devices(nproc_per_node: int | None) -> tuple[tuple[int, ...] | None, EmulateSpec | None]:
    """A node's ``gpus`` and ``emulate`` for ``--nproc-per-node`` (None: all GPUs, or the default
    emulated set without them). GPUs or emulation is this machine's choice: with nvidia-smi here,
    the first N GPUs of every node, else N emulated devices."""
    has_gpus = bool(shutil.which("nvidia-smi"))
    if nproc_per_node is None:
        return None, None if has_gpus else sized_to_cores(DEFAULT_EMULATION)
    if nproc_per_node < 1:
        raise ConfigError(f"nproc_per_node must be at least 1, got {nproc_per_node}")
    if has_gpus:
        return tuple(range(nproc_per_node)), None
    return None, sized_to_cores(EmulateSpec(devices=DEFAULT_EMULATION.devices[:1] * nproc_per_node,
                                            speed=DEFAULT_EMULATION.speed[:1] * nproc_per_node,
                                            memory_mib=DEFAULT_EMULATION.memory_mib[:1] * nproc_per_node))


def sized_to_cores(spec: EmulateSpec, cores: int | None = None) -> EmulateSpec:
    """The embedded cluster's emulated devices, their speeds scaled (same ratios) so that together
    they ask at most half of this machine's ``cores``: an emulated device of speed s computes on
    the CPU for s of its step, and devices that together ask more CPU than the machine has measure
    how the machine shares its cores, not the plan. The other half runs what a real GPU node runs
    on its CPU: the script's data loaders, the PS, hgtrain. On 2 cores the default set's A100s run
    at 0.4 and its T4s at 0.1; on 5 cores or more it is as declared."""
    cores = cores or len(os.sched_getaffinity(0))
    scale = min(1.0, cores / 2 / sum(spec.speed))
    if scale >= 1.0:
        return spec
    return dataclasses.replace(spec, speed=tuple(round(s * scale, 4) for s in spec.speed))


def load_cluster(path: str | Path) -> Cluster:
    """A cluster file that declares its nodes ([[nodes]] and/or ``hostfile = "..."``)."""
    settings = read_cluster_file(Path(path))
    if not settings.nodes:
        raise settings.file.error((), "no nodes declared: add [[nodes]] tables or hostfile = \"...\"")
    return finish(settings.nodes, settings.ssh, source=str(settings.file.path))


def load_hostfile(path: str | Path, *, settings_from: str | Path | None = None) -> Cluster:
    """A DeepSpeed/MPI hostfile (``host slots=N``); [ssh] and [defaults] from ``settings_from``."""
    settings = settings_only(settings_from, "--hostfile")
    decls = hostfile_decls(Path(path), settings.defaults)
    return finish(decls, settings.ssh, source=str(path))


def cluster_from_slurm(nodelist: str, *, settings_from: str | Path | None = None,
                       nproc_per_node: int | None = None, python: str | None = None) -> Cluster:
    """The hosts of a Slurm allocation (``SLURM_JOB_NODELIST``, bracket ranges expanded).

    ``nproc_per_node``: every node's devices (``nproc_devices``), unless [defaults] declares them;
    ``python``: every node's Python unless [defaults] declares one (srun: the controller's own, on
    the file system the allocation shares)."""
    settings = settings_only(settings_from, SLURM_SOURCE)
    fields = dict(settings.defaults.fields)
    if nproc_per_node is not None and not {"gpus", "emulate"} & settings.defaults.explicit:
        gpus, emulate = nproc_devices(nproc_per_node)
        fields.update(gpus=gpus, emulate=emulate)
    if python is not None and "python" not in settings.defaults.explicit:
        fields["python"] = python
    decls = [NodeDecl(fields={**fields, "host": host}, explicit=settings.defaults.explicit,
                   source=f"{SLURM_SOURCE}:{host}")
             for host in expand_nodelist(nodelist, SLURM_SOURCE)]
    return finish(decls, settings.ssh, source=SLURM_SOURCE)


def load_node_source(cluster_file: str | Path | None = None, *, hostfile: str | Path | None = None,
                     environ: Mapping[str, str] | None = None, nproc_per_node: int | None = None,
                     transport: str = "ssh") -> Cluster:
    """The cluster a command works on. Nodes come from exactly one source, the first that applies:

    1. the cluster file, when it declares nodes (then ``hostfile`` must not be given as well);
    2. ``hostfile``; 3. ``SLURM_JOB_NODELIST`` in ``environ`` (inside a Slurm allocation);
    4. without a cluster file, the embedded local cluster.
    For 2 and 3 a cluster file that declares no nodes supplies [ssh] and [defaults].
    ``nproc_per_node`` sizes the embedded cluster and every node of a Slurm allocation: a declared
    node says its devices itself. ``transport`` (config/slurm.py): how the nodes are reached.
    """
    environ = os.environ if environ is None else environ
    srun = slurm.wanted(transport, environ)
    if nproc_per_node is not None and not nproc_applies(cluster_file, hostfile, environ):
        raise ConfigError("nproc_per_node sizes the embedded local cluster and a Slurm allocation's "
                          "nodes only; a declared node chooses its devices with gpus = [...] (or emulate) "
                          "in the cluster file", source=str(cluster_file or hostfile))
    cluster = _declared_nodes(cluster_file, hostfile, environ, nproc_per_node, srun is not None)
    if srun is None:
        return cluster
    return slurm.reach_by_srun(cluster, srun, environ, required=transport == "srun")


def nproc_applies(cluster_file: str | Path | None, hostfile: str | Path | None, environ: Mapping[str, str]) -> bool:
    """Whether ``nproc_per_node`` can size the nodes: those of the embedded local cluster or of a
    Slurm allocation (a cluster file without nodes may give their settings), not a file's own."""
    from_slurm = bool(allocation_nodelist(environ)) and hostfile is None
    return hostfile is None and (cluster_file is None or from_slurm)


def _declared_nodes(cluster_file: str | Path | None, hostfile: str | Path | None, environ: Mapping[str, str],
                    nproc_per_node: int | None, by_srun: bool) -> Cluster:
    if cluster_file is not None:
        settings = read_cluster_file(Path(cluster_file))
        if settings.nodes:
            if hostfile is not None:
                raise settings.file.error(
                    (), "declares nodes, so a hostfile cannot add more: use one or the other")
            if nproc_per_node is not None:
                raise settings.file.error(
                    (), "declares nodes, so nproc_per_node cannot size them: a declared node chooses "
                        "its devices with gpus = [...] (or emulate)")
            return finish(settings.nodes, settings.ssh, source=str(settings.file.path))
    if hostfile is not None:
        return load_hostfile(hostfile, settings_from=cluster_file)
    nodelist = allocation_nodelist(environ)
    if nodelist:
        return cluster_from_slurm(nodelist, settings_from=cluster_file, nproc_per_node=nproc_per_node,
                                  python=sys.executable if by_srun else None)
    if cluster_file is not None:
        raise ConfigError("no nodes declared: add [[nodes]] tables or hostfile = \"...\", or pass "
                          "--hostfile", source=str(cluster_file))
    return default_cluster(nproc_per_node)
