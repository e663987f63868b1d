"""The placement planner: Inventory + Profiles + JobSpec -> Plan.

Pure (no I/O, no torch, no printing) so it can be tested exhaustively and run on huge synthetic
clusters. This module checks the inputs, runs the steps and builds the Plan value: the devices'
costs (``devices``, from the fits of ``fit`` and the kinds of ``kinds``), the batch sizes
(``batches``), the groups and the strategy (``strategy``); hgcli/plan/cost.py predicts throughput.
Every constant is documented in docs/planning.md (change both together). Work is per device, per
group or per node, never over all device pairs, so 4096 devices plan in well under a second.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import StateError, UsageError
from ..schema.stages import (
    CPU, SCHEMA_VERSION, Engine, ExchangeProfile, GroupPlan, GroupSyncProfile, Ideal, Inventory, JobSpec, ModelSpec, Plan,
    Prediction, Profiles, RankPlan, Role, ScriptRates, Strategy, Wire,
)
from .batches import assign_batches, below_knee_note, knee, summarise
from .cost import CostModel
from .costed import Device, Option, plan_overlap
from .engine_choice import engine_candidates, pick
from .engines import may_shard, micro_priced, priced_layout, with_engines
from .memory import REPLICA, fits_nowhere
from .devices import beside_neighbours, fit_to_rates, usable_devices
from .network import Network
from .script_use import ScriptUse
from .strategy import choose, hybrid_layouts, speed_classes, unported_choice

# Per-device batch when the job does not say.
DEFAULT_BATCH_PER_DEVICE = 32
# Model assumed when neither the job nor the profiles name one (the paper's ResNet-50).
DEFAULT_MODEL = ModelSpec(name="assumed ResNet-50 size (bench with --model to measure yours)",
                          parameters=25_557_032)


@dataclass(frozen=True)
class _Ground:
    """What every candidate set of devices (engine_choice.engine_candidates) is planned with."""

    inventory: Inventory
    profiles: Profiles
    job: JobSpec
    model: ModelSpec
    node_names: list[str]
    global_batch: int
    fitted_to: str | None
    keep_ps: tuple[str, ...]
    script: ScriptUse | None


def make_plan(inventory: Inventory, profiles: Profiles, job: JobSpec, rates: ScriptRates | None = None,
              keep_ps: tuple[str, ...] = (), script: ScriptUse | None = None) -> Plan:
    """Plan the ranks of one job; raises HgError for a request that cannot be planned. ``rates``: what
    a job of the same script measured (hgcli/bench/rates.py), to fit the devices' costs to.
    ``keep_ps``: the nodes of an earlier plan's PS shards, in shard order (``launch --nnodes`` after a
    lost node): when every one is still here, the plan keeps a PS on each, whose checkpoint holds
    the training state, and chooses among hybrid and ps around them. ``script``: whether the script
    to run can train under parameter servers (plan/script_use.py); when it cannot, ``auto`` plans
    allreduce; None: not known (``hgtrain plan`` without a script), auto chooses as ever."""
    _check_inputs(inventory, profiles, job)
    model = job.model or profiles.model or DEFAULT_MODEL
    node_names = [n.name for n in inventory.nodes]
    # A re-plan around kept PS shards has parameter servers whatever the strategy: no sharded groups.
    shardable = may_shard(job.strategy, job.engine) and not keep_ps
    alone, skipped, kinds = usable_devices(inventory, profiles, float(model.parameters * model.bytes_per_parameter),
                                           shardable)
    together = beside_neighbours(alone, kinds, node_names, profiles)
    devices = fit_to_rates(together, kinds, node_names, rates) if rates is not None else together
    if not devices:
        why = summarise(skipped) if skipped else "the profiles list no devices"
        raise UsageError(fits_nowhere(list(profiles.devices), shardable)
                         or f"no usable devices to plan on ({why}); run 'hgtrain bench' again")
    ground = _Ground(inventory, profiles, job, model, node_names,
                     job.global_batch if job.global_batch is not None else DEFAULT_BATCH_PER_DEVICE * len(devices),
                     rates.job_id if rates is not None and any(d.fitted for d in devices) else None, keep_ps,
                     script)
    plans: list[Plan] = []
    for members, engine in engine_candidates(devices, job.engine, shardable):
        out = [f"{d.device}@{node_names[d.node]} (holds no DDP replica; the plan without it was predicted faster)"
               for i, d in enumerate(devices) if i not in members]
        try:
            plans.append(_plan_on(ground, [alone[i] for i in members], [devices[i] for i in members],
                                  skipped + out, engine, shardable and engine is not Engine.DDP))
        except UsageError:
            if not plans:           # every device: its refusal is the plan's
                raise
    return pick(plans)


def _plan_on(ground: _Ground, alone: list[Device], devices: list[Device], skipped: list[str],
             engine: Engine | None, shardable: bool) -> Plan:
    """The plan of ``devices`` (their costs ``alone`` too, for the ideal) with every group on
    ``engine`` (None: each group's cheapest that fits)."""
    job, node_names, global_batch = ground.job, ground.node_names, ground.global_batch
    real, batches = assign_batches(devices, global_batch, node_names)
    layout = priced_layout(devices, engine, shardable)
    devices = micro_priced(devices, batches, layout)     # the split by speed stays
    cost = CostModel(devices, batches, Network(node_names, ground.profiles.links),
                     float(ground.model.parameters * ground.model.bytes_per_parameter), global_batch,
                     ground.inventory, job, _exchanges(ground.inventory, ground.profiles),
                     _group_syncs(ground.inventory, ground.profiles),
                     wire_bytes=float(ground.model.parameters * job.wire.bytes), layout=layout)
    classes = speed_classes(devices, real)
    kept = len(devices) > 1 and bool(ground.keep_ps) and all(n in node_names for n in ground.keep_ps)
    if kept:
        cost.fixed_ps = tuple(node_names.index(n) for n in ground.keep_ps)
    options = {Strategy.ALLREDUCE: cost.allreduce(),
               Strategy.HYBRID: cost.best_async(Strategy.HYBRID, hybrid_layouts(devices, classes)),
               Strategy.PS: cost.best_async(Strategy.PS, [tuple((i,) for i in range(len(devices)))])}
    chosen, reason = _choose(job, options, kept, ground.keep_ps, len(classes), devices)
    script = ground.script
    if script is not None and not script.runtime and job.strategy is Strategy.AUTO and chosen.ps_nodes and not kept:
        chosen, reason = unported_choice(options, chosen, script.why)
    reason += below_knee_note(batches, [knee(d) for d in devices], global_batch)
    if skipped:
        reason += "; not used: " + summarise(skipped)
    predicted: dict[Prediction, float] = {s: o.samples_per_s for s, o in options.items()}
    # The ideal stays each device's own speed, the bench's (alone): a fitted cost has the node's
    # contention in it, and an ideal that shrank with it would flatter every run against it.
    predicted[Ideal.IDEAL] = sum(b / d.time(b) for d, b in zip(alone, batches))
    bench_together = any(d.together for d in devices)
    if ground.fitted_to is not None:
        reason += f"; device costs fitted to this script's compute measured in job {ground.fitted_to}"
    elif bench_together:
        reason += "; device costs from each node's devices benched together, their contention included"
    plan = _build_plan(chosen, devices, batches, node_names, predicted, global_batch, ground.inventory.cluster,
                       reason, ground.model, overlap=plan_overlap(job), wire=job.wire, fitted_to=ground.fitted_to)
    needs = {(node_names[d.node], d.device): d.memory for d in devices if d.memory is not None}
    return with_engines(dataclasses.replace(plan, bench_together=bench_together), engine, needs)


def _choose(job: JobSpec, options: dict[Strategy, Option], kept: bool, keep_ps: tuple[str, ...], classes: int,
            devices: list[Device]) -> tuple[Option, str]:
    """The chosen option and why: around the kept PS shards (a re-plan), allreduce where auto's
    devices cannot all hold a replica (sharded groups are allreduce only), else strategy.choose."""
    if kept and job.strategy in (Strategy.AUTO, Strategy.HYBRID, Strategy.PS):
        pick = job.strategy if job.strategy is not Strategy.AUTO else max(
            (Strategy.HYBRID, Strategy.PS), key=lambda s: options[s].samples_per_s)
        chosen = options[pick]
        return chosen, (f"re-planned keeping the PS shards on {', '.join(dict.fromkeys(keep_ps))}, whose "
                        f"checkpoints hold the training state: {pick.value} ({chosen.summary})")
    unreplicated = sum(d.memory is not None and d.memory.cap(REPLICA) < 1 for d in devices)
    if unreplicated and job.strategy is Strategy.AUTO:
        ar = options[Strategy.ALLREDUCE]
        return ar, (f"{unreplicated} of {len(devices)} devices cannot hold a replica with its optimizer state, "
                    f"so their group shards it, and sharded groups train under allreduce only ({ar.summary})")
    return choose(job.strategy, options, classes, len(devices))


def _check_inputs(inventory: Inventory, profiles: Profiles, job: JobSpec) -> None:
    if inventory.cluster != profiles.cluster:
        raise StateError(f"the profiles were measured on cluster {profiles.cluster}, the inventory is of "
                         f"cluster {inventory.cluster}; run 'hgtrain bench' again")
    for what, version in (("inventory", inventory.version), ("profiles", profiles.version)):
        if version != SCHEMA_VERSION:
            raise StateError(f"the stored {what} has format version {version}, this hgtrain reads "
                             f"{SCHEMA_VERSION}; run 'hgtrain probe' and 'hgtrain bench' again")
    if job.global_batch is not None and job.global_batch < 1:
        raise UsageError(f"global batch must be at least 1, got {job.global_batch}")
    if job.ps_ranks is not None and job.ps_ranks < 1:
        raise UsageError(f"the number of PS ranks must be at least 1, got {job.ps_ranks}")
    if job.staleness is not None and job.staleness < 0:
        raise UsageError(f"the staleness bound must be 0 or more, got {job.staleness}")
    model = job.model or profiles.model
    if model is not None and (model.parameters < 1 or model.bytes_per_parameter < 1):
        raise UsageError(f"model {model.name!r} must have at least one parameter of at least one byte")


def _exchanges(inventory: Inventory, profiles: Profiles) -> dict[int, ExchangeProfile]:
    """The measured PS push of each node (node index -> profile), from any of its devices."""
    node_index = {n.name: i for i, n in enumerate(inventory.nodes)}
    out: dict[int, ExchangeProfile] = {}
    for p in profiles.devices:
        i = node_index.get(p.node)
        if i is not None and p.exchange is not None and p.exchange.bytes > 0 and i not in out:
            out[i] = p.exchange
    return out


def _group_syncs(inventory: Inventory, profiles: Profiles) -> dict[int, GroupSyncProfile]:
    """The measured synchronous step of each emulated node's devices (node index -> profile)."""
    node_index = {n.name: i for i, n in enumerate(inventory.nodes)}
    out: dict[int, GroupSyncProfile] = {}
    for p in profiles.devices:
        i = node_index.get(p.node)
        if i is not None and p.group_sync is not None and i not in out:
            out[i] = p.group_sync
    return out


def _build_plan(option: Option, devices: list[Device], batches: list[int], node_names: list[str],
                predicted: Mapping[Prediction, float], global_batch: int, cluster: str, reason: str,
                model: ModelSpec, overlap: bool = False, wire: Wire = Wire.FP32,
                fitted_to: str | None = None) -> Plan:
    """Workers first (groups in node order), then PS ranks in node order; local ranks per node."""
    order = sorted(range(len(option.groups)), key=lambda g: option.groups[g][0])
    ranks: list[RankPlan] = []
    groups: list[GroupPlan] = []
    local: dict[int, int] = {}

    def next_local(node: int) -> int:
        local[node] = local.get(node, 0) + 1
        return local[node] - 1

    for gid, g in enumerate(order):
        members = []
        for i in option.groups[g]:
            d = devices[i]
            ranks.append(RankPlan(rank=len(ranks), role=Role.WORKER, node=node_names[d.node], device=d.device,
                                  group=gid, batch_size=batches[i], local_rank=next_local(d.node),
                                  emulated=d.emulated, speed=d.speed,
                                  benched_samples_per_s=round(d.rate(batches[i]), 3)))
            members.append(ranks[-1].rank)
        groups.append(GroupPlan(id=gid, ranks=tuple(members), accumulate=option.accumulate[g]))
    shards = []
    for node in sorted(option.ps_nodes):
        ranks.append(RankPlan(rank=len(ranks), role=Role.PS, node=node_names[node], device=CPU,
                              local_rank=next_local(node)))
        shards.append(ranks[-1].rank)
    group_rates = {str(gid): option.group_rates[g] for gid, g in enumerate(order)} if option.group_rates else {}
    return Plan(strategy=option.strategy, world_size=len(ranks), groups=tuple(groups), ranks=tuple(ranks),
                predicted_samples_per_s=predicted, predicted_group_samples_per_s=group_rates,
                global_batch=global_batch, cluster=cluster, reason=reason,
                staleness_bound=option.staleness if shards else 0, ps_shards=tuple(shards), model=model,
                overlap=overlap and bool(shards), wire=wire if shards else Wire.FP32, fitted_to=fitted_to)
