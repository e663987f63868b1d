"""probe -> bench -> plan in one call, reusing what is stored when it still describes the cluster.

``hgtrain plan`` and ``hgtrain launch`` (without ``--plan``) call ``prepare_plan`` so a fresh cluster
needs one command, and a second run costs no re-bench. What counts as reusable:

- inventory: stored for this cluster fingerprint, readable, this schema, probed less than
  ``INVENTORY_MAX_AGE_S`` ago, and (unless failed nodes are skipped) every node ok. A probe takes
  seconds, so it is repeated rather than trusted for long: it catches a node that went down.
- profiles: stored for this fingerprint, readable, not stale for the inventory
  (``profiles.profile_is_stale``: devices, drivers, torch) and, unless failures are skipped, no
  failed device. A bench takes minutes, so there is no age limit: the hardware check decides.

Failed nodes or devices stop the pipeline with exit 4 naming them, unless ``skip_failed``: then the
plan uses the healthy ones only and its ``reason`` names what it left out. Planning silently on
fewer devices than the user declared would hide a broken node until the job is slow.

A node whose Python lacks what its ranks import (``PLAN_NEEDS``: torch and gloo for every plan, also
torch.distributed.rpc and numpy with PS ranks), as its probe found, stops the pipeline with exit 2
naming node and module, before a bench that needs torch there and before anything starts. A stored
inventory with a node that lacked one is probed again, so what the user installed since counts; a
check that is not known (an inventory of an older hgtrain, a check that did not finish) never refuses.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, TypeVar

from ..errors import NodePythonError, NodesFailedError, StateError
from ..node.remedy import OR_ANOTHER_PYTHON, module_problem
from ..schema.stages import PLAN_NEEDS, Cluster, Inventory, JobSpec, Plan, Profiles, ScriptRates, Strategy
from .script_use import ScriptUse, script_use

# Inventories older than this are probed again (seconds).
INVENTORY_MAX_AGE_S = 3600.0

OnStage = Callable[[str, str], None]
T = TypeVar("T")




def _quiet(stage: str, message: str) -> None:
    del stage, message


def _ago(when: float) -> str:
    if not when:
        return "at an unknown time"
    seconds = time.time() - when
    if seconds < 90:
        return f"{seconds:.0f} s ago"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"


def inventory_unusable(inventory: Inventory | None, cluster: Cluster, *, skip_failed: bool,
                       now: float | None = None) -> str | None:
    """Why the stored inventory must be probed again, or None when it can be reused."""
    if inventory is None:
        return "no stored inventory"
    if inventory.cluster != cluster.fingerprint():
        return f"stored inventory is of cluster {inventory.cluster}"
    age = (time.time() if now is None else now) - inventory.probed_at
    if age > INVENTORY_MAX_AGE_S or age < 0:
        return f"stored inventory is {age / 3600:.1f} h old (limit {INVENTORY_MAX_AGE_S / 3600:g} h)"
    if inventory.failed and not skip_failed:
        return "stored inventory has failed nodes: " + ", ".join(n.name for n in inventory.failed)
    lacking = [n.name for n in inventory.succeeded if n.runtime and n.runtime.lacking(PLAN_NEEDS[Strategy.HYBRID])]
    if lacking:
        return "the Python of " + ", ".join(lacking) + " lacked modules (installed since?)"
    return None


def runtime_problems(inventory: Inventory, nodes: list[str], needs: tuple[str, ...]) -> list[str]:
    """One phrase per node of ``nodes`` whose probed Python lacks one of ``needs``, saying what to do.
    Nodes without the checks (or not in the inventory) are not refused: unknown is not missing."""
    info = {n.name: n for n in inventory.nodes}
    problems = []
    for name in dict.fromkeys(nodes):
        runtime = info[name].runtime if name in info else None
        if runtime is None:
            continue
        for module in runtime.lacking(needs):
            problems.append(f"node {name}: " + module_problem(module, runtime.executable, name,
                                                                runtime.why.get(module)))
    return problems


def refuse_unrunnable(plan: Plan, inventory: Inventory) -> None:
    """Raise NodePythonError when a rank's node lacks what the plan's ranks import."""
    needs = PLAN_NEEDS[Strategy.HYBRID if plan.ps_shards else Strategy.ALLREDUCE]
    problems = runtime_problems(inventory, [r.node for r in plan.ranks], needs)
    if problems:
        raise _cannot_run(plan.strategy, problems)


def _cannot_run(strategy: Strategy, problems: list[str]) -> NodePythonError:
    return NodePythonError(f"the {strategy.value} plan's ranks cannot run: {'; '.join(problems)}"
                           f"{OR_ANOTHER_PYTHON}. Nothing was started")


def refuse_before_bench(strategy: Strategy, inventory: Inventory) -> None:
    """``--strategy hybrid`` or ``ps`` where no node's Python can run a PS plan's ranks: refused before
    the bench, which would time every device for a plan that cannot start. Where some nodes can, the
    plan decides where its ranks go and refuse_unrunnable checks them."""
    if strategy not in (Strategy.HYBRID, Strategy.PS):
        return
    per_node = [runtime_problems(inventory, [n.name], PLAN_NEEDS[strategy]) for n in inventory.succeeded]
    if per_node and all(per_node):
        raise _cannot_run(strategy, [p for problems in per_node for p in problems])


def refuse_unrunnable_plan_file(plan: Plan, cluster: Cluster, on_stage: OnStage | None = None) -> None:
    """``launch --plan``: the stored inventory, when there is one, decides whether the plan's ranks can
    run; a refusal is checked by probing again first (the module may have been installed since)."""
    from ..probe.inventory import load_inventory, probe_cluster

    try:
        stored = load_inventory(cluster)
    except StateError:
        return
    if stored is None:
        return
    try:
        refuse_unrunnable(plan, stored)
    except NodePythonError:
        (on_stage or _quiet)("probe", f"probing {len(cluster.nodes)} node(s): the stored inventory says a "
                                      "node's Python lacks a module the plan needs")
        refuse_unrunnable(plan, probe_cluster(cluster))


def _stored_or_fresh(stage: str, what: str, load: Callable[[], T | None],
                     unusable: Callable[[T | None], str | None], measure: Callable[[str], T],
                     describe: Callable[[T], str], say: OnStage) -> T:
    """The stored value when ``unusable`` finds nothing wrong with it, else ``measure(why)``.
    An unreadable stored file is one more reason to measure again (the stage overwrites it)."""
    try:
        stored = load()
    except StateError as exc:
        return measure(f"stored {what} unreadable ({exc})")
    why = unusable(stored)
    if stored is None or why is not None:
        return measure(why or f"no stored {what}")
    say(stage, f"using stored {what} ({describe(stored)})")
    return stored


def _failures(stage: str, failed: list[str], kind: str, skip_failed: bool, say: OnStage) -> None:
    """Refuse (exit 4, names listed) unless failures are to be skipped, then say what is skipped."""
    if not failed:
        return
    if not skip_failed:
        raise NodesFailedError(f"{stage} failed on {len(failed)} {kind}(s): {'; '.join(failed)}; fix them "
                               f"or pass --skip-failed to plan on the healthy {kind}s")
    say(stage, f"skipping failed {kind}(s): {'; '.join(failed)}")


def ensure_inventory(cluster: Cluster, *, skip_failed: bool = False,
                     on_stage: OnStage | None = None) -> Inventory:
    """The stored inventory when reusable, else a fresh probe (stored by the probe stage)."""
    from ..probe.inventory import load_inventory, probe_cluster

    say = on_stage or _quiet

    def probe(why: str) -> Inventory:
        say("probe", f"probing {len(cluster.nodes)} node(s): {why}")
        fresh = probe_cluster(cluster)
        say("probe", f"{len(fresh.succeeded)} of {len(fresh.nodes)} node(s) ok")
        return fresh

    inventory = _stored_or_fresh("probe", "inventory", lambda: load_inventory(cluster),
                                 lambda stored: inventory_unusable(stored, cluster, skip_failed=skip_failed),
                                 probe, lambda stored: f"{len(stored.nodes)} node(s), probed "
                                                       f"{_ago(stored.probed_at)}", say)
    _failures("probe", [f"{n.name} ({n.error})" for n in inventory.failed], "node", skip_failed, say)
    return inventory


def profiles_unusable(profiles: Profiles | None, inventory: Inventory, *, skip_failed: bool) -> str | None:
    """Why the stored profiles must be benched again, or None when they can be reused."""
    from ..bench.profiles import profile_is_stale

    if profiles is None:
        return "no stored profiles"
    stale = profile_is_stale(profiles, inventory)
    if stale:
        return f"stored profiles are stale: {stale}"
    failed = _failed_devices(profiles, inventory)
    if failed and not skip_failed:
        return "stored profiles have failed devices: " + ", ".join(failed)
    return None


def _failed_devices(profiles: Profiles, inventory: Inventory) -> list[str]:
    """Failed devices of nodes that probed ok (a failed node is the probe's failure, named there)."""
    ok = {n.name for n in inventory.succeeded}
    return [f"{d.device}@{d.node} ({d.error})" for d in profiles.devices if d.error and d.node in ok]


def refuse_unbenchable(inventory: Inventory) -> None:
    """Raise NodePythonError when a probed node's Python lacks torch (its bench could measure nothing)."""
    problems = runtime_problems(inventory, [n.name for n in inventory.succeeded], PLAN_NEEDS[Strategy.ALLREDUCE])
    if problems:
        raise NodePythonError(f"cannot bench: {'; '.join(problems)}{OR_ANOTHER_PYTHON}")


def ensure_profiles(cluster: Cluster, inventory: Inventory, *, quick: bool = True, skip_failed: bool = False,
                    on_stage: OnStage | None = None) -> Profiles:
    """The stored profiles when reusable, else a fresh bench (stored by the bench stage)."""
    from ..bench.cluster import bench_cluster
    from ..bench.profiles import load_profiles

    say = on_stage or _quiet

    def bench(why: str) -> Profiles:
        refuse_unbenchable(inventory)
        say("bench", f"benching{' (quick)' if quick else ''}: {why}")
        fresh = bench_cluster(cluster, inventory, quick=quick)
        say("bench", f"measured {len(fresh.devices)} device(s) and {len(fresh.links)} link(s)")
        return fresh

    profiles = _stored_or_fresh("bench", "profiles", lambda: load_profiles(inventory.cluster),
                                lambda stored: profiles_unusable(stored, inventory, skip_failed=skip_failed),
                                bench, lambda stored: f"{len(stored.devices)} device(s), measured "
                                                      f"{_ago(stored.measured_at)}", say)
    _failures("bench", _failed_devices(profiles, inventory), "device", skip_failed, say)
    return profiles


def script_rates(fingerprint: str, profiles: Profiles, script: str, say: OnStage) -> ScriptRates | None:
    """What the last job of ``script`` measured on this cluster, when it planned from these profiles;
    otherwise None, saying why when there were rates (a stale or unreadable file is not an error:
    the bench alone still plans)."""
    from ..bench.rates import load_rates

    try:
        stored = load_rates(fingerprint, script)
    except StateError as exc:
        say("plan", f"planning from the bench alone: stored rates unreadable ({exc})")
        return None
    if stored is None:
        return None
    if stored.bench_measured_at != profiles.measured_at:
        say("plan", f"planning from the bench alone: the rates job {stored.job_id} measured for {script} "
                    "are of an earlier bench")
        return None
    say("plan", f"fitting the devices' costs to the compute job {stored.job_id} measured for {script} "
                f"({_ago(stored.measured_at)})")
    return stored


def _script_use(fingerprint: str, job: JobSpec, script: str | None, say: OnStage) -> ScriptUse | None:
    """Whether ``script`` calls hg.init() (plan/script_use.py; None without a script: ``hgtrain
    plan``); a requested hybrid or ps plan for one that does not is said before it starts."""
    if not script:
        return None
    use = script_use(fingerprint, script)
    if not use.runtime and job.strategy in (Strategy.HYBRID, Strategy.PS):
        say("plan", f"{use.why}: the workers of a {job.strategy.value} plan must call hg.init() (port it, "
                    f"docs/runtime.md), or --strategy allreduce runs it as it is")
    return use


def prepare_plan(cluster: Cluster, job: JobSpec, *, quick: bool = True, skip_failed: bool = False,
                 on_stage: OnStage | None = None, script: str | None = None) -> Plan:
    """Inventory (stored or probed), profiles (stored or benched), the rates the last job of
    ``script`` measured (``launch``: bench/rates.py), then the pure planner."""
    from .contention import contention_note
    from .engines import refuse_engine
    from .placement import make_plan

    say = on_stage or _quiet
    refuse_engine(job.strategy, job.engine)
    inventory = ensure_inventory(cluster, skip_failed=skip_failed, on_stage=say)
    refuse_before_bench(job.strategy, inventory)
    profiles = ensure_profiles(cluster, inventory, quick=quick, skip_failed=skip_failed, on_stage=say)
    rates = script_rates(cluster.fingerprint(), profiles, script, say) if script else None
    use = _script_use(cluster.fingerprint(), job, script, say)
    say("plan", f"planning ({job.strategy.value})")
    plan = make_plan(inventory, profiles, job, rates, script=use)
    refuse_unrunnable(plan, inventory)
    say("plan", f"{plan.strategy.value}: {plan.world_size} rank(s), {len(plan.groups)} group(s)")
    crowded = contention_note(plan, inventory)
    if crowded:
        say("plan", crowded)
    return plan


def replan_on(cluster: Cluster, job: JobSpec, nodes: list[str], *, on_stage: OnStage | None = None,
              script: str | None = None, keep_ps: tuple[str, ...] = (),
              rates: ScriptRates | None = None) -> Plan:
    """A plan on ``nodes`` only (``launch --nnodes``: the nodes left after a loss, and those back),
    from the stored inventory and profiles: no probe, no bench, so a re-plan takes no time of the
    devices. The plan is still of the whole cluster's fingerprint (its profiles and rates are).
    ``rates``: what the running job measured (a re-grouping, launch/adapt.py), instead of the
    script's stored rates."""
    from ..bench.profiles import load_profiles
    from ..probe.inventory import load_inventory
    from .placement import make_plan

    say = on_stage or _quiet
    inventory = load_inventory(cluster)
    profiles = load_profiles(inventory.cluster) if inventory is not None else None
    if inventory is None or profiles is None:
        raise StateError("no stored probe and bench of this cluster to re-plan from: the job planned "
                         "without them")
    keep = set(nodes)
    inventory = dataclasses.replace(inventory, nodes=tuple(n for n in inventory.nodes if n.name in keep))
    if rates is None and script:
        rates = script_rates(cluster.fingerprint(), profiles, script, say)
    profiles = dataclasses.replace(
        profiles, devices=tuple(d for d in profiles.devices if d.node in keep),
        links=tuple(link for link in profiles.links if link.a in keep and link.b in keep))
    use = _script_use(cluster.fingerprint(), job, script, say)
    say("plan", f"re-planning ({job.strategy.value}) on {len(nodes)} node(s): {', '.join(nodes)}")
    plan = make_plan(inventory, profiles, job, rates, keep_ps=keep_ps, script=use)
    refuse_unrunnable(plan, inventory)
    say("plan", f"{plan.strategy.value}: {plan.world_size} rank(s), {len(plan.groups)} group(s)")
    return plan
