"""Click commands only: parse flags -> build a request -> call one core function -> render.

Core modules are imported inside each command so that ``hgtrain --help``, ``probe`` and ``status``
never import torch (the controller may be a laptop without it). Nothing below this module calls
``sys.exit``: failures are ``HgError``s carrying their exit code, mapped to one line on stderr here.
"""
from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, TypeVar

import click

from . import __version__
from .errors import EXIT_ERROR, EXIT_INTERRUPTED, HgError, NodesFailedError, UsageError
from .schema.stages import Strategy, Wire

if TYPE_CHECKING:
    from .launch.events import Event
    from .schema.stages import Cluster

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
    from .config.slurm import TRANSPORTS

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


def json_option(f: F) -> F:
    return click.option("--json", "as_json", is_flag=True, help="Print only JSON on stdout.")(f)


def raw_option(f: F) -> F:
    return click.option("--raw", is_flag=True,
                        help="On a terminal, pass the ranks' control characters (colours, escape "
                             "sequences) through as they are; by default they are shown as ^[ etc.")(f)


def _checked(parse: Callable[[str], object]) -> Callable[[click.Context, click.Parameter, Any], Any]:
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
    from .config.ranklist import parse_rank_list

    return parse_rank_list(text)


def ranks_option(help: str) -> Callable[[F], F]:
    """``--ranks 0,2-3`` (parsed by config.ranklist): one declaration for launch, logs and metrics."""
    return click.option("--ranks", "ranks", default=None, metavar="LIST", callback=_checked(_rank_list), help=help)


def load_cluster_arg(cluster_file: Path | None, nproc_per_node: int | None = None) -> Cluster:
    """Nodes from -c, else --hostfile, else SLURM_JOB_NODELIST, else the embedded local cluster
    (``--nproc-per-node`` devices of it)."""
    from .config.cluster import load_node_source, nproc_applies

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


@cli.command()
@cluster_option
@json_option
def probe(cluster_file: Path | None, as_json: bool) -> None:
    """Report every node's GPUs, CPU, memory, Python and torch.

    Exit code 0 when every node answered, 4 when any failed (the others are still reported).
    """
    from .schema.stages import to_json
    from .probe.inventory import probe_cluster
    from .render.probe import probe_progress, render_inventory

    cluster = load_cluster_arg(cluster_file)
    with probe_progress([n.name for n in cluster.nodes]) as on_done:
        inventory = probe_cluster(cluster, on_done=on_done)
    if as_json:
        click.echo(to_json(inventory))
    else:
        render_inventory(inventory)
    if inventory.failed:
        names = ", ".join(n.name for n in inventory.failed)
        raise NodesFailedError(f"{len(inventory.failed)} of {len(inventory.nodes)} node(s) failed: {names}")


@cli.command()
@cluster_option
@json_option
@click.option("--quick", is_flag=True, help="Smaller sizes and fewer repeats: seconds per device.")
@click.option("--model", "model_spec", metavar="SPEC",
              help="Model whose training step is timed: MODULE:FACTORY, FILE.py:FACTORY or a built-in "
                   "name, optionally @BATCH,BATCH,... Default: $HGTRAIN_BENCH_MODEL (also what plan "
                   "and launch bench with), else the bundled example's ResNet (hgcli.examples.resnet:spec). "
                   "See docs/bench.md.")
def bench(cluster_file: Path | None, as_json: bool, quick: bool, model_spec: str | None) -> None:
    """Measure each device and the links between nodes; store the profiles."""
    from .bench.cluster import bench_cluster, failure_summary
    from .schema.stages import to_json
    from .plan.pipeline import ensure_inventory, refuse_unbenchable

    cluster = load_cluster_arg(cluster_file)
    # Failed nodes are kept: bench lists each one with its probe error instead of refusing. A node
    # that answered but whose Python lacks torch is refused, as plan and launch refuse it.
    inventory = ensure_inventory(cluster, skip_failed=True)
    refuse_unbenchable(inventory)
    if as_json:
        profiles = bench_cluster(cluster, inventory, quick=quick, model_spec=model_spec)
        click.echo(to_json(profiles))
    else:
        from rich.console import Console

        from .render.bench import BenchProgress, render_profiles

        with BenchProgress() as progress:
            profiles = bench_cluster(cluster, inventory, quick=quick, model_spec=model_spec, on_event=progress)
        render_profiles(profiles, Console())
    failed = failure_summary(profiles)
    if failed:
        raise NodesFailedError(failed)


@cli.command()
@cluster_option
@nproc_option
@click.option("--strategy", type=click.Choice([s.value for s in Strategy]), default="auto",
              show_default=True, help="auto predicts every strategy and takes hybrid when it beats allreduce by "
                                      "more than 5%; ps only when asked for (docs/planning.md).")
@click.option("--global-batch", type=click.IntRange(min=1), default=None,
              help="Samples per step over all workers. Default: 32 per device.")
@click.option("--ps", "ps_ranks", type=click.IntRange(min=1), default=None,
              help="Number of parameter-server ranks (hybrid, ps). Default: chosen by the cost model.")
@click.option("--staleness", type=click.IntRange(min=0), default=None,
              help="Staleness bound for asynchronous groups. Default: see docs/planning.md.")
@click.option("--params", type=click.IntRange(min=1), default=None,
              help="Model parameter count, when the profiles were benched without --model.")
@click.option("--overlap/--no-overlap", default=None,
              help="Hybrid/ps: run each group leader's PS exchange during the group's next step "
                   "(one version staler). Default: see docs/planning.md.")
@click.option("--wire", type=click.Choice(["fp32", "bf16"]), default="fp32", show_default=True,
              help="Hybrid/ps: number format of pushes and pulls (the PS keeps fp32).")
@json_option
@click.option("-o", "--output", type=click.Path(dir_okay=False, allow_dash=True, path_type=Path), default=None,
              help="Also write the plan as JSON to this file ('-': stdout; then the table goes to stderr). "
                   "A new file is 0644; an existing one keeps its mode.")
@click.option("--skip-failed", is_flag=True,
              help="Plan on the healthy nodes/devices when some fail to probe or bench (default: exit 4).")
def plan(cluster_file: Path | None, nproc_per_node: int | None, strategy: str, global_batch: int | None,
         ps_ranks: int | None, staleness: int | None, params: int | None, overlap: bool | None, wire: str,
         as_json: bool, output: Path | None, skip_failed: bool) -> None:
    """Build a heterogeneous placement plan and predict its throughput.

    Uses the stored inventory and profiles; probes and benches (quick) first when they are missing,
    stale or old (docs/cli.md), showing each stage on stderr.
    """
    from .schema.stages import JobSpec, ModelSpec, Strategy, to_json
    from .plan.pipeline import prepare_plan
    from .plan.files import write_plan

    cluster = load_cluster_arg(cluster_file, nproc_per_node)
    model = ModelSpec(name=f"{params:,} parameters", parameters=params) if params else None
    job = JobSpec(strategy=Strategy(strategy), global_batch=global_batch, ps_ranks=ps_ranks,
                  staleness=staleness, model=model, overlap=overlap, wire=Wire(wire))
    on_stage = None
    if not as_json:
        from .render.stages import stage_printer

        on_stage = stage_printer()
    result = prepare_plan(cluster, job, quick=True, skip_failed=skip_failed, on_stage=on_stage)
    if output is not None:
        write_plan(output, result)
    to_stdout = output is not None and str(output) == "-"
    if as_json and not to_stdout:
        click.echo(to_json(result))
    elif not as_json:
        from rich.console import Console

        from .render.plan import render_plan

        render_plan(result, Console(stderr=to_stdout))   # stdout holds the plan file's JSON


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


def _env_entry(text: str) -> object:
    from .launch.spec import env_flag

    return env_flag(text, {})


def _secret_name(text: str) -> object:
    from .launch.spec import check_env_name

    return check_env_name(text)


def _nnodes(text: str) -> object:
    from .launch.elastic import parse_nnodes

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
    from .render.launch import JsonSink, PlainSink

    if as_json:
        return JsonSink(ranks)
    if sys.stdout.isatty() and not raw:
        from .render.launch_live import RichSink

        # stderr redirected away from the terminal (2> file) gets the ranks' stderr lines, plain
        return RichSink(ranks, err=None if sys.stderr.isatty() else sys.stderr)
    return PlainSink(ranks, raw=raw)


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
@click.option("--env", "env", multiple=True, metavar="NAME[=VALUE]", callback=_checked(_env_entry),
              help="Set a variable on every rank (repeatable; beats --env-file); a bare NAME forwards "
                   "this machine's value.")
@click.option("--env-file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="NAME=VALUE lines to set on every rank.")
@click.option("--secret-env", "secret_env", multiple=True, metavar="NAME", callback=_checked(_secret_name),
              help="This variable's value is secret: never written to a record or log (repeatable; "
                   "names like *TOKEN*, *PASSWORD*, *KEY* and URL passwords are already).")
@ranks_option("Show only these ranks' lines and metrics, e.g. 0,2-3 (all are saved).")
@click.option("--detach", is_flag=True, help="Start the job and return its id at once.")
@click.option("--grace", "grace_s", type=click.FloatRange(min=0), default=10.0, show_default=True,
              help="Seconds between SIGTERM and SIGKILL when the job is stopped.")
@click.option("--heartbeat-timeout", "heartbeat_timeout_s", type=click.FloatRange(min=1), default=30.0,
              show_default=True, help="A node silent this long is lost and the job fails.")
@click.option("--restarts", type=click.IntRange(min=0), default=0, show_default=True,
              help="Restart the whole job this many times after a failing rank or a lost node.")
@click.option("--nnodes", "nnodes", default=None, metavar="MIN:MAX", callback=_checked(_nnodes),
              help="Elastic: after a lost node, restart on the nodes left if at least MIN are, taking "
                   "back lost nodes that answer, up to MAX (re-planned from the stored bench; each "
                   "counts against --restarts). N means N:N. Default: every node of the cluster.")
@click.option("--checkpoint-every", type=click.IntRange(min=0), default=0, show_default=True,
              help="PS ranks checkpoint (all-reduce jobs with --restarts snapshot) every N updates "
                   "(0: not on a count).")
@click.option("--checkpoint-seconds", type=click.FloatRange(min=0), default=60.0, show_default=True,
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
           strategy: str, global_batch: int | None, ps_ranks: int | None, env: tuple[str, ...],
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
        job=JobSpec(strategy=Strategy(strategy), global_batch=global_batch, ps_ranks=ps_ranks), env=env,
        env_file=env_file,
        secret_env=secret_env, detach=detach, grace_s=grace_s, heartbeat_timeout_s=heartbeat_timeout_s, restarts=restarts,
        checkpoint_every=checkpoint_every, checkpoint_seconds=checkpoint_seconds,
        console_may_skip=sys.stdout.isatty() and not as_json, tensorboard=tensorboard, adapt=adapt,
        nnodes=node_range)
    result = run_launch(request, launch_sink(as_json=as_json, ranks=shown, raw=raw))
    ctx.exit(result.exit_code)


@cli.command()
@click.argument("job", required=False)
@json_option
@transport_option
def status(job: str | None, as_json: bool, transport: str) -> None:
    """What runs where: each rank's state, step, loss and throughput.

    Without JOB: every recorded job, newest first; running ones are asked live. With JOB: that job's
    ranks. A node that cannot be reached is shown as unknown (docs/cli.md).
    """
    import json

    from .jobs.status import job_status, list_status, status_dict

    if job is not None:
        one = job_status(job, transport)
        if as_json:
            click.echo(json.dumps(status_dict(one), indent=2))
        else:
            from .render.status import render_job

            render_job(one)
        return
    statuses = list_status(transport)
    if as_json:
        click.echo(json.dumps({"jobs": [status_dict(s) for s in statuses]}, indent=2))
    else:
        from .render.status import render_status

        render_status(statuses)


@cli.command()
@click.argument("job")
@click.option("-f", "--follow", is_flag=True, help="Keep printing until the job ends (Ctrl-C: stop watching).")
@ranks_option("Only these ranks, e.g. 0,2-3.")
@json_option
@raw_option
@transport_option
def logs(job: str, follow: bool, ranks: str | None, as_json: bool, raw: bool, transport: str) -> None:
    """Print or follow a job's logs (also of a detached job), tagged node:rank.

    Ctrl-C while following exits 130 and leaves the job running.
    """
    import json

    from .state import records as jobs
    from .jobs.logs import LogLine, NodeLogs, has_local_logs, local_lines, parse_ranks

    record = jobs.load(job)
    chosen = parse_ranks(ranks, record)
    if as_json:
        def show(item: LogLine) -> None:
            click.echo(json.dumps({"event": "log", "job_id": record.id, "node": item.node, "rank": item.rank,
                                   "stream": item.stream, "line": item.line, "partial": item.partial}))
    elif sys.stdout.isatty() and not raw:
        from .render.logs import LogPrinter

        show = LogPrinter()   # control characters shown visibly
    else:
        from .render.logs import PlainLogPrinter

        show = PlainLogPrinter()
    if not follow and has_local_logs(record, chosen):
        for item in local_lines(record, chosen):
            show(item)
        return
    with NodeLogs(record, chosen, follow=follow, transport=transport) as node_logs:
        for item in node_logs.lines():
            show(item)
    if node_logs.failed:
        if not as_json:
            from .render.logs import log_failures

            log_failures(node_logs.failed)
        names = ", ".join(node_logs.failed)
        raise NodesFailedError(f"logs of job {record.id} are incomplete: node(s) {names} could not be read")


@cli.command()
@click.argument("job")
@click.option("--format", "fmt", type=click.Choice(["csv", "jsonl", "tensorboard"]), default="csv",
              show_default=True, help="CSV (one column per metric), JSON lines as the ranks logged them, or "
                                      "TensorBoard event files (a directory: -o DIR).")
@ranks_option("Only these ranks, e.g. 0,2-3.")
@click.option("-o", "--output", type=click.Path(allow_dash=True, path_type=Path), default=None,
              help="Write to this file instead of stdout ('-': stdout). A new file is 0644; an existing "
                   "one is replaced whole but keeps its mode; a device or pipe is written in place. With "
                   "--format tensorboard: the directory to write DIR/JOB/<run>/ event files in.")
def metrics(job: str, fmt: str, ranks: str | None, output: Path | None) -> None:
    """Export a job's metrics (ctx.log records) as CSV, JSON lines or TensorBoard event files.

    \b
    hgtrain metrics JOB > metrics.csv
    hgtrain metrics JOB --ranks 0 --format jsonl
    hgtrain metrics JOB --format tensorboard -o runs && tensorboard --logdir runs
    """
    from .state import records as jobs
    from .jobs.logs import parse_ranks
    from .state.userfile import write_user_file
    from .jobs.export import MAX_COLUMNS, read_metrics, to_csv, to_jsonl

    if fmt == "tensorboard":
        from .launch.tensorboard import require_writer

        require_writer()   # a missing extra says so before anything is read
        if output is None or str(output) == "-":
            raise UsageError("--format tensorboard writes a directory of event files: give it with -o DIR")
    record = jobs.load(job)
    rows = read_metrics(record, parse_ranks(ranks, record) if ranks else None)
    if fmt == "tensorboard":
        from .launch.tensorboard import export

        assert output is not None
        click.echo(f"wrote TensorBoard event files to {export(record, rows, output)}", err=True)
        return
    if fmt == "csv":
        text, dropped = to_csv(rows)
        if dropped:
            click.echo(f"hgtrain: {dropped} metric keys beyond the first {MAX_COLUMNS} left out of the CSV",
                       err=True)
    else:
        text = to_jsonl(rows)
    if output is None:
        click.echo(text, nl=False)
        return
    try:
        write_user_file(output, text)
    except OSError as exc:
        raise UsageError(f"cannot write {output}: {exc.strerror or exc}") from exc


@cli.command()
@click.argument("job")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="The picture: .png, .svg, .pdf, or .html (the PNG inside one page).")
@ranks_option("Only these ranks' metrics, e.g. 0,2-3.")
def report(job: str, output: Path, ranks: str | None) -> None:
    """Draw a job's run: throughput per group against the plan, loss, accuracy, staleness.

    \b
    hgtrain report JOB -o run.png
    Needs matplotlib: pip install 'hgtrain[report]'. See docs/cli.md.
    """
    from .jobs.report import format_of, require_matplotlib, write_report

    fmt = format_of(output)
    require_matplotlib()
    from .state import records as jobs
    from .jobs.logs import parse_ranks
    from .jobs.export import read_metrics

    record = jobs.load(job)
    rows = read_metrics(record, parse_ranks(ranks, record) if ranks else None)
    write_report(record, rows, output, fmt)
    click.echo(f"wrote {output}", err=True)


@cli.command()
@click.argument("job")
@json_option
@transport_option
def stop(job: str, as_json: bool, transport: str) -> None:
    """Stop a running job on every node (only that job). Exit 4 names nodes that did not confirm."""
    from .schema.stages import to_dict
    from .jobs.stop import stop_job, unconfirmed_error

    result = stop_job(job, transport)
    if as_json:
        import json

        click.echo(json.dumps({"job_id": result.record.id, "state": result.record.state.value,
                               "nodes": to_dict(result.nodes), "record": to_dict(result.record)}, indent=2))
    else:
        from .render.stop import render_stop

        render_stop(result)
    error = unconfirmed_error(result)
    if error is not None:
        raise error


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
        click.echo(f"hgtrain: error: {exc}", err=True)
        return exc.exit_code
    except Exception as exc:  # an internal bug: still one line unless --debug
        if debug:
            traceback.print_exc()
        click.echo(f"hgtrain: internal error: {type(exc).__name__}: {exc} (rerun with --debug)", err=True)
        return EXIT_ERROR
    return code if isinstance(code, int) else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
