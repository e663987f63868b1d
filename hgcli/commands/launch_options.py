"""The flags of ``launch`` beyond the shared options: the command that takes everything after its
first non-option word, the checks of --env, --secret-env and --nnodes, the flags that rule each other
out, and the console the job's events go to.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import click

from ..errors import UsageError

if TYPE_CHECKING:
    from ..launch.events import Event
    from ..schema.stages import Cluster


class LaunchCommand(click.Command):
    """``launch``: everything from the first word that is not an option is the command. Click takes an
    unknown option there for that first word (``--restart 1 -- true`` would run ``--restart`` on
    every node), so a command whose first word starts with ``-`` must follow ``--``."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        raw = list(args)
        rest = super().parse_args(ctx, args)
        command = ctx.params.get("command") or ()
        if command and command[0].startswith("-") and command[0] != "-":
            after_separator = len(raw) > len(command) and raw[-len(command) - 1] == "--"
            if not after_separator:
                raise UsageError(unknown_option_message(self, ctx, command[0]))
        return rest


def unknown_option_message(command: click.Command, ctx: click.Context, word: str) -> str:
    import difflib

    names = sorted({n for p in command.get_params(ctx) if isinstance(p, click.Option) for n in p.opts + p.secondary_opts})
    close = difflib.get_close_matches(word.split("=", 1)[0], names, n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return (f"no such option: {word}{hint}; a command that starts with '-' goes after '--': "
            f"hgtrain {command.name} [OPTIONS] -- COMMAND [ARGS]...")


def env_entry(text: str) -> object:
    from ..launch.spec import env_flag

    return env_flag(text, {})


def secret_name(text: str) -> object:
    from ..launch.spec import check_env_name

    return check_env_name(text)


def nnodes_spec(text: str) -> object:
    from ..launch.elastic import parse_nnodes

    return parse_nnodes(text)


def check_launch_flags(cluster: Cluster, *, plan_file: Path | None, detach: bool, restarts: int,
                       nnodes: tuple[int, int] | None, tensorboard: Path | None) -> None:
    """The flags of ``launch`` that rule each other out, named as the user typed them (the request
    checks the same of its fields for callers that are not the command line)."""
    if detach and cluster.srun is not None:
        raise click.UsageError("--detach cannot be used with --transport srun: a job step ends with its "
                               "agent, so the job would end when hgtrain returns; run hgtrain launch in an "
                               "sbatch script instead (docs/slurm.md)")
    if restarts and detach:
        raise click.UsageError("--restarts needs hgtrain to stay attached: it cannot be used with --detach")
    if tensorboard is not None and detach:
        raise click.UsageError("--tensorboard needs hgtrain to stay attached (a detached job's metrics reach "
                               "no controller): it cannot be used with --detach")
    if nnodes is None:
        return
    low, high = nnodes
    if not 1 <= low <= high:
        raise click.BadParameter(f"{low}:{high}: expected 1 <= MIN <= MAX", param_hint="'--nnodes'")
    if low > len(cluster.nodes):
        raise click.BadParameter(f"{low}:{high}: the cluster has {len(cluster.nodes)} node(s)",
                                 param_hint="'--nnodes'")
    elastic = low < high or high < len(cluster.nodes)
    if elastic and plan_file is not None:
        raise click.UsageError("--nnodes MIN:MAX re-plans on the nodes left after a loss, which a plan file "
                               "(--plan) cannot: leave --plan out, so hgtrain plans from its stored bench")
    if elastic and not restarts:
        raise click.UsageError(f"--nnodes {low}:{high}: each re-plan after a lost node is a restart of the "
                               "job and counts against --restarts: give --restarts N (N >= 1)")


def launch_sink(*, as_json: bool, ranks: frozenset[int] | None, raw: bool = False) -> Callable[[Event], None]:
    """The console of ``launch``: JSON lines, plain lines (a pipe, ``--raw``), or the live view (a
    terminal; the only one that imports rich)."""
    from ..render.launch import JsonSink, PlainSink

    if as_json:
        return JsonSink(ranks)
    if sys.stdout.isatty() and not raw:
        from ..render.launch_live import RichSink

        # stderr redirected away from the terminal (2> file) gets the ranks' stderr lines, plain
        return RichSink(ranks, err=None if sys.stderr.isatty() else sys.stderr)
    return PlainSink(ranks, raw=raw)


activation_checkpointing_option = click.option(
    "--activation-checkpointing", is_flag=True,
    help="fsdp groups: recompute each sharded block's activations in backward instead of keeping them "
         "(less memory, about one more forward; HGTRAIN_ACTIVATION_CHECKPOINT=1 on every rank).")


def sharding_env(shard_modules: str | None, activation_checkpointing: bool) -> tuple[str, ...]:
    """The variables through which --shard-modules and --activation-checkpointing reach every rank."""
    from ..runtime.env import ACTIVATION_CHECKPOINT_ENV, SHARD_ENV

    return (((f"{SHARD_ENV}={shard_modules}",) if shard_modules else ())
            + ((f"{ACTIVATION_CHECKPOINT_ENV}=1",) if activation_checkpointing else ()))
