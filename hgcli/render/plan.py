"""Human output of `hgtrain plan`: where every rank runs, and why this strategy."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text
from rich.tree import Tree

from ..schema.stages import Engine, Ideal, Plan, Prediction, RankPlan, Role, Strategy
from .safe import cell, visible

# A plan may be a hand-edited file and names nodes and devices from the cluster file and the probe:
# its strings reach rich only as Text (never markup), control characters shown (render/safe.py).

STRATEGIES = tuple(s for s in Strategy if s is not Strategy.AUTO)


def render_plan(plan: Plan, console: Console | None = None) -> None:
    console = console or Console()
    console.print(plan_tree(plan))
    console.print(prediction_table(plan))
    console.print(Text.assemble(("why:", "bold"), " ", visible(plan.reason)))


def plan_tree(plan: Plan) -> Tree:
    model = f" · model {visible(plan.model.name)} ({plan.model.parameters:,} parameters)" if plan.model else ""
    root = Tree(Text.assemble(("plan", "bold"), f" {plan.strategy.value} · world size {plan.world_size} · "
                              f"global batch {plan.global_batch}{model}"))
    accumulate = {g.id: g.accumulate for g in plan.groups}
    engines = {g.id: g.engine for g in plan.groups}
    shard = {rank: i for i, rank in enumerate(plan.ps_shards)}
    nodes: dict[str, Tree] = {}
    for r in plan.ranks:
        if r.node not in nodes:
            nodes[r.node] = root.add(cell(r.node, style="bold cyan"))
        label = _rank_label(r, accumulate, shard)
        if r.memory is not None and r.group is not None:
            label.append(memory_label(r, engines[r.group]))
        nodes[r.node].add(label)
    for g in plan.groups:
        what = ("DDP: every rank holds the whole model" if g.engine is Engine.DDP
                else "FSDP2: parameters, gradients and optimizer state sharded over its ranks")
        root.add(Text(f"group {g.id} · {g.engine.value} · {len(g.ranks)} rank(s) · {what}"))
    if plan.ps_shards:
        root.add(Text(f"staleness bound {plan.staleness_bound} versions · parameters in "
                      f"{len(plan.ps_shards)} PS shard(s)"))
    return root


def _rank_label(r: RankPlan, accumulate: dict[int, int], shard: dict[int, int]) -> Text:
    device = visible(r.device)
    if r.role is Role.PS:
        return Text.assemble(f"{device}  rank {r.rank} · ", ("ps", "magenta"), f" · shard {shard.get(r.rank, '?')}")
    acc = accumulate.get(r.group, 1) if r.group is not None else 1
    text = Text(f"{device}  rank {r.rank} · group {r.group} · worker · batch {r.batch_size}")
    if acc > 1:
        text.append(f" x {acc} accumulated")
    if r.emulated:
        text.append(f" EMULATED (speed {r.speed:g})", style="yellow")
    return text


def memory_label(r: RankPlan, engine: Engine) -> str:
    """The worker's memory line: engine, state and activations, micro-batches, headroom (GiB)."""
    m = r.memory
    if m is None:
        return ""
    layout = engine.value + ("+offload" if m.offload else "")
    each = -(-(r.batch_size or 0) // r.micro_batches)
    micro = f" · {each} x {r.micro_batches} micro-batches" if r.micro_batches > 1 else ""
    return (f" · {layout} · state {m.state_gib:.2f} GiB · activations {m.activation_gib:.2f} GiB{micro}"
            f" · headroom {m.headroom_gib:.2f} of {m.usable_gib:.2f} GiB")


def prediction_table(plan: Plan) -> Table:
    table = Table(title="predicted throughput")
    table.add_column("strategy")
    table.add_column("samples/s", justify="right")
    table.add_column("of ideal", justify="right")
    ideal = plan.ideal_samples_per_s or 0.0
    keys: tuple[Prediction, ...] = (*STRATEGIES, Ideal.IDEAL)
    for key in keys:
        value = plan.predicted_samples_per_s.get(key)
        if value is None:
            continue
        ratio = f"{value / ideal:.2f}" if ideal > 0 else "-"
        chosen = key is plan.strategy
        style = "bold green" if chosen else None
        table.add_row(cell(key.value + (" (chosen)" if chosen else "")), f"{value:,.1f}", ratio, style=style)
    return table
