"""Human output of ``hgtrain status``: the job table, or one job's ranks with their live state."""
from __future__ import annotations

import time
from typing import Any, Mapping

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..schema.stages import JobRecord, RankState, Role
from ..schema.states import NodeJobState
from ..jobs.status import JobLive, JobStatus, LiveRank, NodeLive
from .safe import cell, visible

STATE_STYLE = {"running": "bold green", "starting": "green", "pending": "green", "succeeded": "blue",
               "failed": "bold red", "stopped": "yellow", "unknown": "bold magenta",
               "orphaned": "bold magenta", "lost": "bold red", "absent": "bold red"}
METRIC_KEYS = ("step", "loss", "samples_per_s")
EVENT = "event"
# Keys every record carries, which say nothing about it (schema/records.py, launch/record.py).
BOOKKEEPING = frozenset({EVENT, "time", "rank", "group", "node", "role", "kind"})


def _styled(state: str) -> Text:
    return cell(state, STATE_STYLE.get(state, ""))


def _when(t: float | None) -> str:
    return time.strftime("%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


def _duration(record: JobRecord) -> str:
    if not record.started_at:
        return "-"
    seconds = max(0.0, (record.ended_at or time.time()) - record.started_at)
    h, rest = divmod(int(seconds), 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def _live_summary(live: JobLive) -> str:
    ranks = [r for n in live.nodes for r in n.ranks]
    running = sum(1 for r in ranks if r.state.is_running())
    text = f"{running}/{len(ranks)} ranks running"
    odd = [f"{n.node} {n.state.value}" for n in live.nodes
           if not n.reachable or n.state in (NodeJobState.ORPHANED, NodeJobState.LOST, NodeJobState.ABSENT)]
    return text + (f"; {', '.join(odd)}" if odd else "")


def jobs_table(statuses: list[JobStatus]) -> Table:
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    live = any(s.live for s in statuses)
    for column in ("job", "state", "strategy", "ranks", "nodes", "started", "duration", "exit") + (("live",) if live else ()):
        # Ids and times are what a user copies: never wrapped or cut, the other columns give way.
        table.add_column(column, justify="right" if column in ("ranks", "exit") else "left",
                         no_wrap=column in ("job", "state", "strategy", "started", "duration"))
    for s in statuses:
        r = s.record
        nodes = list(dict.fromkeys(x.node for x in (r.ranks or r.plan.ranks)))
        # Every cell is Text: a record is a file and node names come from one; rich must not read
        # "[...]" in them as markup.
        table.add_row(cell(r.id), _styled(r.state.value), cell(r.plan.strategy.value), cell(r.plan.world_size),
                      cell(", ".join(nodes[:3]) + (f" +{len(nodes) - 3}" if len(nodes) > 3 else "")),
                      cell(_when(r.started_at)), cell(_duration(r)), cell("-" if r.exit_code is None else r.exit_code),
                      *((cell(_live_summary(s.live) if s.live else ""),) if live else ()))
    return table


def _metrics(metrics: Mapping[str, Any] | None) -> str:
    """A rank's last record in a few words: a step's step, loss and rate; another record (a finish,
    a rates report) its event and first fields, never the keys every record carries (the time, the
    rank, its group: "time 1.797e+09 · rank 0 · group 0" said nothing)."""
    if not metrics:
        return ""
    keys = [k for k in METRIC_KEYS if k in metrics]
    if not keys:
        keys = [k for k in metrics if k not in BOOKKEEPING][:3]
    parts = [str(metrics[EVENT])] if EVENT in metrics and EVENT not in keys else []
    for k in keys:
        v = metrics[k]
        parts.append(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}")
    return " · ".join(parts)


def _rank_row(rank: int, node: str, role: Role, live: LiveRank | None, fallback: RankState,
              exit_code: int | None, metrics: Mapping[str, Any] | None) -> list[Text]:
    state = live.state if live else fallback
    code = live.exit_code if live else exit_code
    signal = live.signal if live else None
    ended = "" if code is None and signal is None else (f"signal {signal}" if signal else str(code))
    # Metrics are whatever a rank logged ("[/oops]" included): Text cells, never markup.
    return [cell(rank), cell(node), cell(role.value), _styled(state.value), cell(live.pid if live and live.pid else ""),
            cell(ended), cell(_metrics((live.metrics if live else None) or metrics))]


def job_detail(status: JobStatus) -> list[Any]:
    """Renderables for one job: a header, its ranks, and a line per node that is not plainly fine."""
    r = status.record
    live = {x.rank: x for n in status.live.nodes for x in n.ranks} if status.live else {}
    header = Text.assemble((visible(r.id), "bold"), "  ", _styled(r.state.value),
                           f"  {r.plan.strategy.value} · {r.plan.world_size} ranks · started {_when(r.started_at)}"
                           f" · {_duration(r)}" + (f" · exit {r.exit_code}" if r.exit_code is not None else ""))
    out: list[Any] = [header, cell(f"command: {' '.join(r.command)}"),
                      cell(f"cluster: {r.cluster_source or 'embedded local cluster'}" + (" · detached" if r.detached else "")
                           + (f" · steps of Slurm job {r.slurm_job}" if r.slurm_job else ""))]
    if r.root_cause:
        out.append(cell(f"root cause: {r.root_cause}", style="red"))
    for number, reason in enumerate(r.restarts, 1):   # launch --restarts / --nnodes: one line per attempt
        out.append(cell(f"restart {number} after: {reason}", style="yellow"))
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for column in ("rank", "node", "role", "state", "pid", "exit", "last metrics"):
        table.add_column(column)
    records = {x.rank: x for x in r.ranks}
    for p in r.plan.ranks:
        rec = records.get(p.rank)
        table.add_row(*_rank_row(p.rank, p.node, p.role, live.get(p.rank),
                                 rec.state if rec else RankState.PENDING, rec.exit_code if rec else None,
                                 rec.last_metrics if rec else None))
    out.append(table)
    if status.live:
        out.extend(_node_note(n) for n in status.live.nodes if _node_note(n) is not None)
    return out


def _node_note(node: NodeLive) -> Text | None:
    if not node.reachable:
        return cell(f"{node.node}: unreachable ({node.error}); its ranks are shown as unknown", style="magenta")
    if node.state is NodeJobState.ORPHANED:
        return cell(f"{node.node}: the agent is gone but ranks still run; 'hgtrain stop' ends them",
                    style="magenta")
    if node.state in (NodeJobState.LOST, NodeJobState.ABSENT):
        return cell(f"{node.node}: {node.state.value}" + (f" ({node.error})" if node.error else ""), style="red")
    return None


def _console() -> Console:
    """A terminal's own width; piped output is not cut to rich's default 80 columns (ids would be)."""
    console = Console()
    return console if console.is_terminal else Console(width=160)


def render_status(statuses: list[JobStatus], console: Console | None = None) -> None:
    console = console or _console()
    if not statuses:
        console.print("no jobs recorded yet ('hgtrain launch' starts one)")
        return
    console.print(jobs_table(statuses))


def render_job(status: JobStatus, console: Console | None = None) -> None:
    console = console or _console()
    for item in job_detail(status):
        console.print(item)
