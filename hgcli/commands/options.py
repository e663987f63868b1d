"""The options the commands share (-c with --hostfile and --transport, --json, --raw, --ranks,
--nproc-per-node, the job commands' --transport), the callback that checks a flag's text with the
core's own parser, and the nodes a command's -c/--hostfile/--nproc-per-node name.
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, TypeVar

import click

from ..errors import UsageError

if TYPE_CHECKING:
    from ..schema.stages import Cluster, Engine

F = TypeVar("F", bound=Callable[..., Any])   # a command function, decorated with options

CLUSTER_HELP = ("Cluster file (TOML). Default: --hostfile, else $SLURM_JOB_NODELIST (the nodes of the "
                "Slurm allocation), else the embedded local cluster of this machine.")


def _remember_hostfile(ctx: click.Context, _param: click.Parameter, value: Path | None) -> None:
    # Kept in ctx.meta (not a parameter) so every command taking -c gets --hostfile for free.
    ctx.meta["hgtrain.hostfile"] = value


TRANSPORT_HELP = ("How nodes are reached: ssh, srun (job steps of the Slurm allocation hgtrain runs in, "
                  "no SSH) or auto: srun inside an allocation whose nodes the cluster's are, else ssh. "
                  "See docs/slurm.md.")


def _remember_transport(ctx: click.Context, _param: click.Parameter, value: str) -> None:
    ctx.meta["hgtrain.transport"] = value


def transport_choice() -> click.Choice:
    from ..config.slurm import TRANSPORTS

    return click.Choice(TRANSPORTS)


def transport_option(f: F) -> F:
    """``--transport`` for the job commands (status, logs, stop): auto reaches a job launched by srun
    as steps of its allocation again, any other job as it was declared."""
    return click.option("--transport", type=transport_choice(), default="auto", show_default=True,
                        envvar="HGTRAIN_TRANSPORT",
                        help="How the job's nodes are reached: auto (as the job was launched: a job "
                             "launched by srun as steps of its Slurm allocation, from any terminal), "
                             "ssh, or srun. See docs/slurm.md.")(f)


def cluster_option(f: F) -> F:
    f = click.option(
        "--transport", type=transport_choice(), default="auto", show_default=True, expose_value=False,
        envvar="HGTRAIN_TRANSPORT", callback=_remember_transport, help=TRANSPORT_HELP,
    )(f)
    f = click.option(
        "--hostfile", type=click.Path(dir_okay=False, path_type=Path), expose_value=False,
        callback=_remember_hostfile, help="DeepSpeed/MPI hostfile (host slots=N) as the node list.",
    )(f)
    return click.option(
        "-c", "--cluster", "cluster_file", type=click.Path(dir_okay=False, path_type=Path),
        envvar="HGTRAIN_CLUSTER", help=CLUSTER_HELP,
    )(f)


class Seconds(click.FloatRange):
    """A number of seconds from ``min`` up: click's FloatRange also takes ``nan`` (which compares
    false with every bound, so ``--heartbeat-timeout nan`` turned loss detection off) and ``inf``."""

    name = "seconds"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number of seconds", param, ctx)
        return number


def json_option(f: F) -> F:
    return click.option("--json", "as_json", is_flag=True, help="Print only JSON on stdout.")(f)


def raw_option(f: F) -> F:
    return click.option("--raw", is_flag=True,
                        help="On a terminal, pass the ranks' control characters (colours, escape "
                             "sequences) through as they are; by default they are shown as ^[ etc.")(f)


def checked(parse: Callable[[str], object]) -> Callable[[click.Context, click.Parameter, Any], Any]:
    """A click callback that checks a flag's text (or each of a repeated flag's) with the core's own
    parser and keeps it as given: a bad value is click's usage error, naming the flag."""
    def check(_ctx: click.Context, _param: click.Parameter, value: Any) -> Any:
        for text in (value if isinstance(value, tuple) else () if value is None else (value,)):
            try:
                parse(text)
            except UsageError as exc:
                raise click.BadParameter(str(exc)) from None
        return value

    return check


def _rank_list(text: str) -> object:
    from ..config.ranklist import parse_rank_list

    return parse_rank_list(text)


def ranks_option(help: str) -> Callable[[F], F]:
    """``--ranks 0,2-3`` (parsed by config.ranklist): one declaration for launch, logs and metrics."""
    return click.option("--ranks", "ranks", default=None, metavar="LIST", callback=checked(_rank_list), help=help)


def load_cluster_arg(cluster_file: Path | None, nproc_per_node: int | None = None) -> Cluster:
    """Nodes from -c, else --hostfile, else SLURM_JOB_NODELIST, else the embedded local cluster
    (``--nproc-per-node`` devices of it)."""
    from ..config.cluster import load_node_source, nproc_applies

    meta = click.get_current_context().meta
    hostfile = meta.get("hgtrain.hostfile")
    if nproc_per_node is not None and not nproc_applies(cluster_file, hostfile, os.environ):
        raise click.UsageError("--nproc-per-node sizes the embedded local cluster and a Slurm allocation's "
                               "nodes only; a declared node chooses its devices with gpus = [...] (or "
                               "emulate) in the cluster file")
    return load_node_source(cluster_file, hostfile=hostfile, nproc_per_node=nproc_per_node,
                            transport=meta.get("hgtrain.transport", "auto"))


def nproc_option(f: F) -> F:
    return click.option(
        "--nproc-per-node", "nproc_per_node", type=click.IntRange(min=1), default=None, metavar="N",
        help="The embedded local cluster, or every node of a Slurm allocation: the first N GPUs, or N "
             "identical emulated devices where this machine has no GPUs (as torchrun's --nproc-per-node).")(f)


def engine_option(f: F) -> F:
    """``--engine`` for plan and launch: how each synchronous group trains (GroupPlan.engine)."""
    return click.option("--engine", type=click.Choice(["auto", "ddp", "fsdp"]), default="auto", show_default=True,
                        help="How each synchronous group trains: ddp (every rank holds the whole model) or "
                             "fsdp (torch FSDP2: parameters, gradients and optimizer state sharded over "
                             "the group; allreduce plans only, for now). auto: each group's cheapest that "
                             "fits its devices' memory (ddp, else fsdp, else fsdp with the state offloaded). "
                             "See docs/planning.md.")(f)


def engine_of(value: str) -> "Engine | None":
    """The JobSpec engine of an ``--engine`` value (None: auto, the planner's choice)."""
    from ..schema.stages import Engine

    return None if value == "auto" else Engine(value)
