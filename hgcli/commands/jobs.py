"""The job commands: ``status``, ``logs``, ``metrics``, ``report`` and ``stop`` (each: flags -> request ->
one call -> render). Core modules are imported inside each command so that ``hgtrain --help`` never
imports torch.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from ..errors import NodesFailedError, UsageError
from .options import json_option, ranks_option, raw_option, transport_option

if TYPE_CHECKING:
    from ..jobs.status import JobStatus


@click.command()
@click.argument("job", required=False)
@json_option
@transport_option
def status(job: str | None, as_json: bool, transport: str) -> None:
    """What runs where: each rank's state, step, loss and throughput.

    Without JOB: every recorded job, newest first; running ones are asked live. With JOB: that job's
    ranks. A node that cannot be reached is shown as unknown (docs/cli.md).
    """
    import json

    from ..jobs.status import job_status, list_status, status_dict

    if job is not None:
        one = job_status(job, transport)
        _warn_unsaved([one])
        if as_json:
            click.echo(json.dumps(status_dict(one), indent=2))
        else:
            from ..render.status import render_job

            render_job(one)
        return
    statuses = list_status(transport)
    _warn_unsaved(statuses)
    if as_json:
        click.echo(json.dumps({"jobs": [status_dict(s) for s in statuses]}, indent=2))
    else:
        from ..render.status import render_status

        render_status(statuses)


def _warn_unsaved(statuses: list[JobStatus]) -> None:
    for s in statuses:
        if s.unsaved:
            click.echo(f"hgtrain: warning: job {s.record.id}: what its nodes said is shown but not saved "
                       f"({s.unsaved})", err=True)


@click.command()
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

    from ..state import records as jobs
    from ..jobs.logs import LogLine, NodeLogs, has_local_logs, local_lines, parse_ranks

    record = jobs.load(job)
    chosen = parse_ranks(ranks, record)
    if as_json:
        def show(item: LogLine) -> None:
            click.echo(json.dumps({"event": "log", "job_id": record.id, "node": item.node, "rank": item.rank,
                                   "stream": item.stream, "line": item.line, "partial": item.partial}))
    elif sys.stdout.isatty() and not raw:
        from ..render.logs import LogPrinter

        show = LogPrinter()   # control characters shown visibly
    else:
        from ..render.logs import PlainLogPrinter

        show = PlainLogPrinter()
    if not follow and has_local_logs(record, chosen):
        for item in local_lines(record, chosen):
            show(item)
        return
    with NodeLogs(record, chosen, follow=follow, transport=transport) as node_logs:
        for item in node_logs.lines(on_idle=sys.stdout.flush):
            show(item)
    if node_logs.failed:
        if not as_json:
            from ..render.logs import log_failures

            log_failures(node_logs.failed)
        names = ", ".join(node_logs.failed)
        raise NodesFailedError(f"logs of job {record.id} are incomplete: node(s) {names} could not be read")


@click.command()
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
    from ..state import records as jobs
    from ..jobs.logs import parse_ranks
    from ..state.userfile import write_user_file
    from ..jobs.export import MAX_COLUMNS, read_metrics, to_csv, to_jsonl

    if fmt == "tensorboard":
        from ..launch.tensorboard import require_writer

        require_writer()   # a missing extra says so before anything is read
        if output is None or str(output) == "-":
            raise UsageError("--format tensorboard writes a directory of event files: give it with -o DIR")
    record = jobs.load(job)
    rows = read_metrics(record, parse_ranks(ranks, record) if ranks else None)
    if fmt == "tensorboard":
        from ..launch.tensorboard import export

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


@click.command()
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
    from ..jobs.report import format_of, require_matplotlib, write_report

    fmt = format_of(output)
    require_matplotlib()
    from ..state import records as jobs
    from ..jobs.logs import parse_ranks
    from ..jobs.export import read_metrics

    record = jobs.load(job)
    rows = read_metrics(record, parse_ranks(ranks, record) if ranks else None)
    write_report(record, rows, output, fmt)
    click.echo(f"wrote {output}", err=True)


@click.command()
@click.argument("job")
@json_option
@transport_option
def stop(job: str, as_json: bool, transport: str) -> None:
    """Stop a running job on every node (only that job). Exit 4 names nodes that did not confirm."""
    from ..schema.stages import to_dict
    from ..jobs.stop import stop_job, unconfirmed_error

    result = stop_job(job, transport)
    if as_json:
        import json

        click.echo(json.dumps({"job_id": result.record.id, "state": result.record.state.value,
                               "nodes": to_dict(result.nodes), "record": to_dict(result.record)}, indent=2))
    else:
        from ..render.stop import render_stop

        render_stop(result)
    error = unconfirmed_error(result)
    if error is not None:
        raise error
