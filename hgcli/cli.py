"""The ``hgtrain`` command group and its entry point: flags -> build a request -> call one core
function -> render. The commands are grouped in ``hgcli/commands/`` (the stage commands, the job
commands, the options they share); ``launch`` is defined here.

Core modules are imported inside each command so that ``hgtrain --help``, ``probe`` and ``status``
never import torch (the controller may be a laptop without it). Nothing below this module calls
``sys.exit``: failures are ``HgError``s carrying their exit code, mapped to one line on stderr here.
"""
from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

import click

from . import __version__
from .commands import jobs, pipeline
from .commands.launch_options import (LaunchCommand, activation_checkpointing_option, check_launch_flags, env_entry,
                                      launch_sink, nnodes_spec, secret_name, sharding_env)
from .commands.options import checked, cluster_option, engine_of, engine_option, json_option, load_cluster_arg, nproc_option, ranks_option, raw_option, Seconds
from .errors import EXIT_ERROR, EXIT_INTERRUPTED, HgError
from .schema.stages import Strategy


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="hgtrain")
@click.option("--debug", is_flag=True, envvar="HGTRAIN_DEBUG", help="Show tracebacks on errors.")
@click.pass_context
def cli(ctx: click.Context, debug: bool) -> None:
    """hgtrain: train on a heterogeneous GPU cluster.

    Like GPUs form synchronous all-reduce groups; groups exchange updates asynchronously
    through parameter-server ranks; batch sizes follow measured speed.
    """
    ctx.obj = {"debug": debug}


# The commands are defined in their modules without the group (which imports them), and added here.
for command in (pipeline.probe, pipeline.bench, pipeline.plan, jobs.status, jobs.logs, jobs.metrics, jobs.report,
                jobs.stop):
    cli.add_command(command)


@cli.command(cls=LaunchCommand, context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@cluster_option
@nproc_option
@click.option("--plan", "plan_file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="A plan file from 'hgtrain plan -o'. Default: probe, bench and plan as needed.")
@click.option("--strategy", type=click.Choice([s.value for s in Strategy]), default="auto",
              show_default=True, help="Strategy to plan for (without --plan).")
@click.option("--global-batch", type=click.IntRange(min=1), default=None,
              help="Samples per step over all workers (without --plan).")
@click.option("--ps", "ps_ranks", type=click.IntRange(min=1), default=None,
              help="Number of parameter-server ranks of a hybrid or ps plan (without --plan). "
                   "Default: chosen by the cost model.")
@engine_option
@click.option("--shard-modules", default=None, metavar="PATTERN",
              help="fsdp groups: shard these modules (fnmatch on model.named_modules() names, e.g. "
                   "'layers.*'), then the root, instead of each child of every nn.ModuleList "
                   "(HGTRAIN_SHARD_MODULES on every rank).")
@activation_checkpointing_option
@click.option("--env", "env", multiple=True, metavar="NAME[=VALUE]", callback=checked(env_entry),
              help="Set a variable on every rank (repeatable; beats --env-file); a bare NAME forwards "
                   "this machine's value.")
@click.option("--env-file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="NAME=VALUE lines to set on every rank.")
@click.option("--secret-env", "secret_env", multiple=True, metavar="NAME", callback=checked(secret_name),
              help="This variable's value is secret: never written to a record or log (repeatable; "
                   "names like *TOKEN*, *PASSWORD*, *KEY* and URL passwords are already).")
@ranks_option("Show only these ranks' lines and metrics, e.g. 0,2-3 (all are saved).")
@click.option("--detach", is_flag=True, help="Start the job and return its id at once.")
@click.option("--grace", "grace_s", type=Seconds(min=0), default=10.0, show_default=True,
              help="Seconds between SIGTERM and SIGKILL when the job is stopped.")
@click.option("--heartbeat-timeout", "heartbeat_timeout_s", type=Seconds(min=1), default=30.0,
              show_default=True, help="A node silent this long is lost and the job fails.")
@click.option("--restarts", type=click.IntRange(min=0), default=0, show_default=True,
              help="Restart the whole job this many times after a failing rank or a lost node.")
@click.option("--nnodes", "nnodes", default=None, metavar="MIN:MAX", callback=checked(nnodes_spec),
              help="Elastic: after a lost node, restart on the nodes left if at least MIN are, taking "
                   "back lost nodes that answer, up to MAX (re-planned from the stored bench; each "
                   "counts against --restarts). N means N:N. Default: every node of the cluster.")
@click.option("--checkpoint-every", type=click.IntRange(min=0), default=0, show_default=True,
              help="PS ranks checkpoint (all-reduce jobs with --restarts snapshot) every N updates "
                   "(0: not on a count).")
@click.option("--checkpoint-seconds", type=Seconds(min=0), default=60.0, show_default=True,
              help="PS ranks checkpoint (all-reduce jobs with --restarts snapshot) every T seconds "
                   "(0: not on a clock).")
@click.option("--tensorboard", type=click.Path(file_okay=False, path_type=Path), default=None, metavar="DIR",
              help="Write TensorBoard event files of the metrics to DIR/JOB while the job runs "
                   "(pip install 'hgtrain[tensorboard]').")
@click.option("--adapt/--no-adapt", default=True, show_default=True,
              help="Re-split each synchronous group's batch as its members' measured speeds change, and "
                   "under a hybrid or ps plan the global batch across groups (ctx.sampler/ctx.loader/"
                   "ctx.shard hand out the new sizes; the global batch is kept); re-group a job whose "
                   "workers straggle.")
@json_option
@raw_option
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def launch(ctx: click.Context, cluster_file: Path | None, nproc_per_node: int | None, plan_file: Path | None,
           strategy: str, global_batch: int | None, ps_ranks: int | None, engine: str, shard_modules: str | None,
           activation_checkpointing: bool, env: tuple[str, ...],
           env_file: Path | None, secret_env: tuple[str, ...], ranks: str | None, detach: bool, grace_s: float,
           heartbeat_timeout_s: float, restarts: int, nnodes: str | None, checkpoint_every: int,
           checkpoint_seconds: float, tensorboard: Path | None, adapt: bool, as_json: bool, raw: bool,
           command: tuple[str, ...]) -> None:
    """Start the plan's ranks on the nodes and stream their logs and metrics.

    \b
    hgtrain launch -- python -m hgcli.examples.train
    hgtrain launch -c cluster.toml --plan plan.json -- python train.py --epochs 3
    Exit code: the first failing rank's (128+N for signal N); 130 on Ctrl-C. See docs/launch.md.
    """
    from .launch.elastic import parse_nnodes
    from .launch.launcher import launch as run_launch
    from .launch.request import LaunchRequest
    from .schema.stages import JobSpec, Strategy
    from .config.ranklist import parse_rank_list

    if not command:
        raise click.UsageError("no command to launch: hgtrain launch [OPTIONS] -- COMMAND [ARGS]...")
    shown = parse_rank_list(ranks) if ranks else None
    cluster = load_cluster_arg(cluster_file, nproc_per_node)
    node_range = parse_nnodes(nnodes) if nnodes is not None else None
    check_launch_flags(cluster, plan_file=plan_file, detach=detach, restarts=restarts, nnodes=node_range,
                       tensorboard=tensorboard)
    request = LaunchRequest(
        cluster=cluster, command=command, plan_file=plan_file,
        job=JobSpec(strategy=Strategy(strategy), global_batch=global_batch, ps_ranks=ps_ranks,
                    engine=engine_of(engine)),
        env=env + sharding_env(shard_modules, activation_checkpointing),
        env_file=env_file,
        secret_env=secret_env, detach=detach, grace_s=grace_s, heartbeat_timeout_s=heartbeat_timeout_s, restarts=restarts,
        checkpoint_every=checkpoint_every, checkpoint_seconds=checkpoint_seconds,
        console_may_skip=sys.stdout.isatty() and not as_json, tensorboard=tensorboard, adapt=adapt,
        nnodes=node_range)
    result = run_launch(request, launch_sink(as_json=as_json, ranks=shown, raw=raw))
    ctx.exit(result.exit_code)


def _visible(text: str) -> str:
    from .render.safe import visible

    return visible(text, keep_newlines=True)


def main(argv: list[str] | None = None) -> int:
    """Entry point: map every failure to one line on stderr and a documented exit code."""
    debug = os.environ.get("HGTRAIN_DEBUG") not in (None, "", "0") or "--debug" in (argv or sys.argv[1:])
    try:
        # Without standalone mode click returns ctx.exit(code)'s code instead of raising Exit.
        code = cli.main(args=argv, prog_name="hgtrain", standalone_mode=False)
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except click.exceptions.Abort:
        click.echo("hgtrain: interrupted", err=True)
        return EXIT_INTERRUPTED
    except KeyboardInterrupt:
        click.echo("hgtrain: interrupted", err=True)
        return EXIT_INTERRUPTED
    except HgError as exc:
        if debug:
            traceback.print_exc()
        # Errors quote values from files and nodes (a plan's node names): shown, never executed.
        click.echo(f"hgtrain: error: {_visible(str(exc))}", err=True)
        return exc.exit_code
    except Exception as exc:  # an internal bug: still one line unless --debug
        if debug:
            traceback.print_exc()
        click.echo(f"hgtrain: internal error: {type(exc).__name__}: {_visible(str(exc))} (rerun with --debug)",
                   err=True)
        return EXIT_ERROR
    return code if isinstance(code, int) else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
