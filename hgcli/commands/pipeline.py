"""The stage commands: ``probe``, ``bench`` and ``plan`` (each: flags -> request -> one call -> render).
Core modules are imported inside each command so that ``hgtrain --help`` never imports torch.
"""
from __future__ import annotations

from pathlib import Path

import click

from ..errors import NodesFailedError
from ..schema.stages import Strategy, Wire
from .options import cluster_option, engine_of, engine_option, json_option, load_cluster_arg, nproc_option


@click.command()
@cluster_option
@json_option
def probe(cluster_file: Path | None, as_json: bool) -> None:
    """Report every node's GPUs, CPU, memory, Python and torch.

    Exit code 0 when every node answered, 4 when any failed (the others are still reported).
    """
    from ..schema.stages import to_json
    from ..probe.inventory import probe_cluster
    from ..render.probe import probe_progress, render_inventory

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


@click.command()
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
    from ..bench.cluster import bench_cluster, failure_summary
    from ..schema.stages import to_json
    from ..plan.pipeline import ensure_inventory, refuse_unbenchable

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

        from ..render.bench import BenchProgress, render_profiles

        with BenchProgress() as progress:
            profiles = bench_cluster(cluster, inventory, quick=quick, model_spec=model_spec, on_event=progress)
        render_profiles(profiles, Console())
    failed = failure_summary(profiles)
    if failed:
        raise NodesFailedError(failed)


@click.command()
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
@engine_option
@json_option
@click.option("-o", "--output", type=click.Path(dir_okay=False, allow_dash=True, path_type=Path), default=None,
              help="Also write the plan as JSON to this file ('-': stdout; then the table goes to stderr). "
                   "A new file is 0644; an existing one keeps its mode.")
@click.option("--skip-failed", is_flag=True,
              help="Plan on the healthy nodes/devices when some fail to probe or bench (default: exit 4).")
def plan(cluster_file: Path | None, nproc_per_node: int | None, strategy: str, global_batch: int | None,
         ps_ranks: int | None, staleness: int | None, params: int | None, overlap: bool | None, wire: str,
         engine: str, as_json: bool, output: Path | None, skip_failed: bool) -> None:
    """Build a heterogeneous placement plan and predict its throughput.

    Uses the stored inventory and profiles; probes and benches (quick) first when they are missing,
    stale or old (docs/cli.md), showing each stage on stderr.
    """
    from ..schema.stages import JobSpec, ModelSpec, Strategy, to_json
    from ..plan.pipeline import prepare_plan
    from ..plan.files import write_plan

    cluster = load_cluster_arg(cluster_file, nproc_per_node)
    model = ModelSpec(name=f"{params:,} parameters", parameters=params) if params else None
    job = JobSpec(strategy=Strategy(strategy), global_batch=global_batch, ps_ranks=ps_ranks,
                  staleness=staleness, model=model, overlap=overlap, wire=Wire(wire), engine=engine_of(engine))
    on_stage = None
    if not as_json:
        from ..render.stages import stage_printer

        on_stage = stage_printer()
    result = prepare_plan(cluster, job, quick=True, skip_failed=skip_failed, on_stage=on_stage)
    if output is not None:
        write_plan(output, result)
    to_stdout = output is not None and str(output) == "-"
    if as_json and not to_stdout:
        click.echo(to_json(result))
    elif not as_json:
        from rich.console import Console

        from ..render.plan import render_plan

        render_plan(result, Console(stderr=to_stdout))   # stdout holds the plan file's JSON
