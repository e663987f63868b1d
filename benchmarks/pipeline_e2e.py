"""The real pipeline against torchrun DDP on emulated heterogeneous clusters (issue 15, item 4).

For each scenario (a one-node cluster file declaring four emulated devices, a fresh
HGTRAIN_STATE_DIR):
  pipeline       ``hgtrain probe``, ``hgtrain bench --quick --model`` (the model the script trains),
                 then ``hgtrain launch -- python -m SCRIPT``: the planner's own plan (auto), made by
                 launch from the stored inventory and profiles, never a hand-built plan;
  ddp-uniform    ``python -m torch.distributed.run --standalone`` on the script's DDP twin
                 (plain DDP on the same model, data, optimizer and evaluation: benchmarks/ddp_emulated.py
                 for the MLP, benchmarks/ddp_resnet_emulated.py for the ResNet), the same batch on
                 every rank;
  ddp-prop       the same, batches proportional to speed (the careful DDP user).
Every rank of all three is emulated alike (hgcli/runtime/emulate.py: a step stretched to its CPU
time / speed; the DDP twins wrap their steps in the same Emulator: benchmarks/ddp_emulation.py).
Scenarios: ``static`` [1, 1, 0.25, 0.25], ``three`` [1, 0.5, 0.25, 0.25], ``homogeneous`` [1, 1, 1, 1],
``stragglers`` (static speeds, every step one pseudo-random worker --straggler x slower: HGTRAIN_EMULATE_STRAGGLER
and HGTRAIN_EMULATE_SEED, the same rule on both sides), ``slowdown`` (static speeds; one fast device
--slowdown x slower after a third of the run, its length estimated from the ideal: the cluster file's
``emulate.slowdown`` for the pipeline, E2E_SLOWDOWN for the DDP twin, from the same second of each
rank's life). The dynamic scenarios are where launch's rebalancing (on by default) has work.

Per run: the job's samples/s (every worker's samples over the time from the first step to the last;
beside it "running", the rate while every worker stepped, which a PS job whose groups finish apart
exceeds), its share of the ideal, time to the target
accuracy, final accuracy, the share of the ranks' time that was real compute, and for the pipeline
the plan's prediction against the measurement. The ideal is MEASURED: each distinct device alone
(one rank, no PS, ``hgcli.local`` on the same script, runtime and emulation) at a few batch sizes,
its best samples/s, summed over the cluster's devices (without stragglers).

Emulated speeds are the nominal ones x --time-scale: every device is then slower than this
machine's CPU, so each rank computes briefly and sleeps most of its step; the ranks' CPU demand is a
small share of the cores and contention between emulated ranks a small part of any step (the output
prints both shares). Readable table, then one JSON line with every figure and a ``goals`` object.

    PYTHONPATH=. .venv/bin/python benchmarks/pipeline_e2e.py --quick      (the MLP; several minutes)
    PYTHONPATH=. .venv/bin/python benchmarks/pipeline_e2e.py --script hgcli.examples.train --quick
                                                                           (the ResNet example)
    ... --script hgcli.examples.train --quick --scenarios homogeneous --pairs 3
                     (the runtime against torchrun DDP: the median of three interleaved pairs)
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

# The ratio and goal helpers of the benchmark this one extends (benchmarks/ is on sys.path[0] when a
# script in it runs).
from hybrid_vs_allreduce import _ge, _le, _ratio

REPO = Path(__file__).resolve().parent.parent

SCENARIOS: dict[str, tuple[list[float], bool]] = {     # name -> (nominal speeds, stragglers)
    "static": ([1.0, 1.0, 0.25, 0.25], False),
    "three": ([1.0, 0.5, 0.25, 0.25], False),
    "homogeneous": ([1.0, 1.0, 1.0, 1.0], False),
    "stragglers": ([1.0, 1.0, 0.25, 0.25], True),
    "slowdown": ([1.0, 1.0, 0.25, 0.25], False),
}
SLOWED = {"slowdown": 0}     # scenario -> the device (index, a fast one) that slows down
# What each nominal speed is declared as in the cluster file (model name, memory MiB).
DEVICES = {1.0: ("NVIDIA A100-SXM4-40GB", 40960), 0.5: ("Tesla V100-SXM2-16GB", 16384),
           0.25: ("Tesla T4", 15360)}
GOAL_IDEAL, GOAL_UNIFORM, GOAL_PROP, GOAL_STRAGGLERS, GOAL_SLOWDOWN = 0.85, 1.8, 1.0, 1.3, 1.5
GOAL_HOMOGENEOUS, GOAL_MEDIAN_ERROR, GOAL_WORST_ERROR, GOAL_ACCURACY_POINTS = 0.97, 0.10, 0.20, 1.0


@dataclass(frozen=True)
class Script:
    """How the benchmark drives one training script: its flags, its DDP twin, its bench model and
    the benchmark's defaults for it. The one place to change when a script's flags change."""

    module: str                                         # python -m MODULE under hgtrain launch
    ddp: Path                                           # the torchrun baseline, same flags
    flags: Callable[[argparse.Namespace], list[str]]    # training flags shared by both
    steps_flag: Callable[[int], list[str]]              # stop after N steps (the ideal's runs)
    no_eval: list[str]                                  # no costly evaluation (the ideal's runs)
    bench_model: Callable[[argparse.Namespace, Path], str]   # hgtrain bench --model SPEC
    describe: Callable[[argparse.Namespace], str]       # the model and data, for the report
    train_samples: Callable[[argparse.Namespace], int]  # samples of one epoch (the run's length)
    defaults: dict[str, Any]                            # this script's options: their defaults
    quick: dict[str, Any]                               # ... and those --quick changes


def _bench_sizes(a: argparse.Namespace) -> str:
    """Batch sizes the plan and baselines use at this global batch (4 devices), and a few small ones."""
    n = 4
    sizes = sorted({4, 16, 64, a.global_batch // (2 * n), a.global_batch // n, 2 * a.global_batch // n})
    return ",".join(str(s) for s in sizes if s >= 1)


def _mlp_flags(a: argparse.Namespace) -> list[str]:
    return ["--epochs", str(a.epochs), "--lr", str(a.lr), "--hidden", str(a.hidden), "--eval-every",
            str(a.eval_every), "--eval-samples", str(a.eval_samples), "--target", str(a.target)]


def _mlp_model(a: argparse.Namespace, workdir: Path) -> str:
    """The example's MLP at this run's width, benched at the sizes the plan and baselines use."""
    factory = workdir / f"example_h{a.hidden}.py"
    factory.write_text("from hgcli.examples.models import example\n\n\n"
                       f"def factory():\n    return example(hidden={a.hidden})\n")
    return f"{factory}:factory@{_bench_sizes(a)}"


def _resnet_flags(a: argparse.Namespace) -> list[str]:
    return ["--epochs", str(a.epochs), "--lr", str(a.lr), "--train-size", str(a.train_size),
            "--eval-samples", str(a.eval_samples), "--target", str(a.target), "--seed", str(a.seed)]


# The ResNet as hgcli.examples.train runs it: under its --amp auto (bf16 autocast where the device has
# it natively, on this machine's CPU too), about half the step time of float32, which is what the
# built-in spec times; the plan must be fitted to the step the job will make.
def _resnet_model(a: argparse.Namespace, workdir: Path) -> str:
    """The example's ResNet-8 as the example trains it (its spec times it under the example's
    autocast), benched at the sizes the plan and baselines use."""
    return f"hgcli.examples.resnet:spec@{_bench_sizes(a)}"


# Training scripts the benchmark runs, each against its DDP twin (benchmarks/ddp_emulation.py has
# what the twins share).
SCRIPTS = {
    # The small MLP (a step is mostly fixed overhead): quick, the benchmark's historical figures.
    "hgcli.examples.train_mlp": Script(
        module="hgcli.examples.train_mlp", ddp=REPO / "benchmarks" / "ddp_emulated.py", flags=_mlp_flags,
        steps_flag=lambda n: ["--max-steps", str(n)], no_eval=["--eval-every", "1000000000"],
        bench_model=_mlp_model, describe=lambda a: f"example MLP hidden {a.hidden}",
        train_samples=lambda a: 16384,
        defaults={"epochs": 4, "target": 0.92, "global_batch": 256, "lr": 0.05, "hidden": 4096,
                  "eval_every": 8, "eval_samples": 1024, "ideal_steps": 40},
        quick={"epochs": 2, "target": 0.90, "ideal_steps": 20}),
    # The bundled ResNet example, the README's main job (step time nearly proportional to the batch,
    # images drawn by DataLoader workers). Global batch 128: hgtrain launch's default for 4 devices.
    # --quick: 3 epochs of 4096 images (96 steps; one process at batch 128 reached 0.958), target 0.90;
    # it evaluates after each epoch only, so its time to target has an epoch's resolution.
    "hgcli.examples.train": Script(
        module="hgcli.examples.train", ddp=REPO / "benchmarks" / "ddp_resnet_emulated.py", flags=_resnet_flags,
        steps_flag=lambda n: ["--max-steps", str(n)], no_eval=["--test-size", "64", "--eval-samples", "64"],
        bench_model=_resnet_model, describe=lambda a: f"example ResNet-8, {a.train_size} training images",
        train_samples=lambda a: a.train_size,
        defaults={"epochs": 5, "target": 0.95, "global_batch": 128, "lr": 5e-3, "train_size": 4096,
                  "eval_samples": 512, "ideal_steps": 20},
        quick={"epochs": 3, "target": 0.90, "ideal_steps": 10}),
}
# Options that only some scripts take (None: not given).
SCRIPT_OPTIONS = ("epochs", "target", "global_batch", "lr", "hidden", "eval_every", "eval_samples",
                  "train_size", "ideal_steps")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--script", default="hgcli.examples.train_mlp", choices=sorted(SCRIPTS),
                   help="the training script (its flags, DDP twin, bench model and defaults: SCRIPTS)")
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help="which of: " + ", ".join(SCENARIOS))
    p.add_argument("--quick", action="store_true",
                   help="fewer epochs, a lower target, shorter ideal runs (SCRIPTS[...].quick)")
    p.add_argument("--epochs", type=int, help="MLP 4 (--quick 2); ResNet 5 (--quick 3)")
    p.add_argument("--target", type=float, help="target accuracy; MLP 0.92 (--quick 0.90); ResNet 0.95 (0.90)")
    p.add_argument("--global-batch", type=int, help="MLP 256, ResNet 128")
    p.add_argument("--lr", type=float, help="MLP 0.05 (SGD), ResNet 5e-3 (AdamW's peak)")
    p.add_argument("--hidden", type=int, help="MLP only: hidden width, 4096")
    p.add_argument("--eval-every", type=int, help="MLP only: steps between evaluations, 8")
    p.add_argument("--eval-samples", type=int, help="test samples of the periodic evaluations; MLP 1024, ResNet 512")
    p.add_argument("--train-size", type=int, help="ResNet only: training images, 4096")
    p.add_argument("--time-scale", type=float, default=0.1,
                   help="emulated speed = nominal x this: every device slower than the CPU, ranks mostly sleep")
    p.add_argument("--straggler", type=float, default=3.0, help="slowdown of the straggler of each step")
    p.add_argument("--straggler-seed", type=int, default=7)
    p.add_argument("--seed", type=int, default=0,
                   help="the ResNet's initial parameters and data order, both sides (its --seed)")
    p.add_argument("--slowdown", type=float, default=4.0, help="slowdown scenario: the device's factor")
    p.add_argument("--ideal-steps", type=int, help="steps of each ideal run; MLP 40 (--quick 20), ResNet 20 (10)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per command")
    p.add_argument("--pairs", type=int, default=1,
                   help="pipeline / proportional-DDP pairs per scenario, run alternately; the ratio to DDP is "
                        "their median (the first pair's runs fill the table)")
    args = p.parse_args(argv)
    script = SCRIPTS[args.script]
    given = {k for k in SCRIPT_OPTIONS if getattr(args, k) is not None}
    foreign = sorted(given - set(script.defaults))
    if foreign:
        p.error(f"{args.script} does not take " + ", ".join("--" + k.replace("_", "-") for k in foreign))
    for k in SCRIPT_OPTIONS:
        if getattr(args, k) is None:
            setattr(args, k, script.quick.get(k, script.defaults.get(k)) if args.quick else script.defaults.get(k))
    return args


# --- measuring a run ---------------------------------------------------------------------------

def time_to_target(metrics: list[dict[str, Any]], final: dict[str, Any]) -> float | None:
    """The script's own figure (from its first batch); for a job that restarted (a re-grouping),
    whose last attempt's script counts from its own first batch, from the job's first batch to the
    first evaluation at the target."""
    if not any(m.get("event") == "adapt" and m.get("kind") == "regroup" for m in metrics):
        return final.get("time_to_target_s")
    rank = final.get("rank", 0)
    begun = min((m["time"] for m in metrics if m.get("rank") == rank and "step" in m and "event" not in m),
                default=None)
    reached = [m["time"] for m in metrics if m.get("event") == "eval" and m.get("rank") == rank
               and m["accuracy"] >= final["target"]]
    return min(reached) - begun if reached and begun is not None else None


def measure(metrics: list[dict[str, Any]], cores: int, useful: int | None = None) -> dict[str, Any]:
    """The job's samples/s and the running one (while every worker stepped; each rank's first step
    left out as warm-up in both), accuracy, and where the ranks' time went."""
    steps = [m for m in metrics if "step" in m and "samples" in m and "event" not in m]
    by_rank: dict[int, list[float]] = {}
    for m in steps:
        by_rank.setdefault(m["rank"], []).append(m["time"])
    if not by_rank:
        raise SystemExit("no training steps in the metrics")
    t0 = max(min(ts) for ts in by_rank.values())
    t1 = min(max(ts) for ts in by_rank.values())
    if t1 <= t0:
        raise SystemExit("no window in which every worker was stepping")
    inside = sum(m["samples"] for m in steps if t0 < m["time"] <= t1)
    first = min(min(ts) for ts in by_rank.values())
    last = max(max(ts) for ts in by_rank.values())
    final = [m for m in metrics if m.get("event") == "final"]
    fins = [m for m in metrics if m.get("event") == "finish"]
    compute = sum(m["compute_s"] for m in fins)
    slept = sum(m["emulated_sleep_s"] for m in fins)
    # The job's rate: the samples it was to train (``useful``; else every step's) less each rank's
    # first step, over the time from the first rank's first step to the last rank's last; steps a
    # restarted attempt redid cost time, not samples. Not the window in which every worker stepped
    # ("running"): groups with a PS run the same steps each at its own pace, and that window leaves
    # out the time after the first group finished its share while the others still trained.
    opening = sum(min((m for m in steps if m["rank"] == r), key=lambda m: m["time"])["samples"] for r in by_rank)
    total = useful if useful is not None else sum(m["samples"] for m in steps)
    return {
        "samples_per_s": (total - opening) / (last - first),
        "running_samples_per_s": inside / (t1 - t0),
        "train_s": last - first,
        "time_to_target_s": time_to_target(metrics, final[0]) if final else None,
        "final_accuracy": final[0]["accuracy"] if final else None,
        # real compute against the emulated sleep: the device's step is mostly the emulator's pause
        "compute_share": compute / (compute + slept) if compute + slept else None,
        # CPU the workers' steps asked of the machine: small means little contention between ranks
        "cpu_load_share": compute / ((last - first) * cores) if last > first else None,
    }


def useful_samples(args: argparse.Namespace) -> int:
    """The samples a job trains: its epochs over the script's training set."""
    return args.epochs * SCRIPTS[args.script].train_samples(args)


def run(argv: list[str], env: dict[str, str], log: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    log.write_text(f"$ {shlex.join(argv)}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}\n",
                   encoding="utf-8")
    return proc


@dataclass(frozen=True)
class Dynamics:
    """What changes while a scenario's runs train: per-step stragglers, one device's slowdown."""

    stragglers: bool = False
    slowed: int | None = None          # device index (and RANK of the DDP twin)
    after_s: float = 0.0
    factor: float = 1.0


def _base_env(state: Path | None = None, stragglers: bool = False,
              args: argparse.Namespace | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HGTRAIN_")}
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if state is not None:
        env["HGTRAIN_STATE_DIR"] = str(state)
    if stragglers and args is not None:
        # hgtrain launch forwards HGTRAIN_* to every rank; torchrun passes its environment on
        env["HGTRAIN_EMULATE_STRAGGLER"] = str(args.straggler)
        env["HGTRAIN_EMULATE_SEED"] = str(args.straggler_seed)
    return env


# --- the ideal -----------------------------------------------------------------------------------

def ideal_batches(args: argparse.Namespace) -> list[int]:
    per = args.global_batch // 4
    return sorted({max(1, per // 2), per, 2 * per})


def device_alone(speed: float, args: argparse.Namespace, script: Script, workdir: Path,
                 cores: int) -> dict[str, Any]:
    """One emulated device alone through the runtime (hgcli.local, a one-rank plan, no PS) at a few
    batch sizes; its best samples/s."""
    from hgcli.local.plans import emulated_plan
    from hgcli.local.run import run_plan

    rates = {}
    for batch in ideal_batches(args):
        plan = emulated_plan([[speed * args.time_scale]], [[batch]])
        argv = [sys.executable, "-m", script.module, *script.flags(args), *script.steps_flag(args.ideal_steps),
                *script.no_eval]
        res = run_plan(plan, argv, workdir=workdir / f"ideal-{speed:g}-b{batch}", timeout_s=args.timeout,
                       extra_env={"PYTHONPATH": str(REPO)})
        if not res.ok:
            bad = res.first_failure or res.ranks[0]
            raise SystemExit(f"ideal run failed: speed {speed} batch {batch}\n{bad.output()[-3000:]}")
        rates[batch] = measure(res.metrics, cores)["samples_per_s"]
        print(f"... ideal: speed {speed:g} alone at batch {batch}: {rates[batch]:.0f} samples/s",
              file=sys.stderr, flush=True)
    best = max(rates, key=lambda b: rates[b])
    return {"best_batch": best, "samples_per_s": rates[best], "by_batch": rates}


# --- one scenario --------------------------------------------------------------------------------

def cluster_file(path: Path, speeds: list[float], time_scale: float, dyn: Dynamics = Dynamics()) -> None:
    names = ", ".join(json.dumps(DEVICES[s][0]) for s in speeds)
    emulated = ", ".join(f"{s * time_scale:g}" for s in speeds)
    memory = ", ".join(str(DEVICES[s][1]) for s in speeds)
    slowdown = (f", slowdown = [[{dyn.slowed}, {dyn.after_s:.1f}, {dyn.factor:g}]]"
                if dyn.slowed is not None else "")
    path.write_text(f'[[nodes]]\nhost = "localhost"\nname = "local"\npython = {json.dumps(sys.executable)}\n'
                    f"emulate = {{ devices = [{names}], speed = [{emulated}], memory_mib = [{memory}]{slowdown} }}\n",
                    encoding="utf-8")


def split(global_batch: int, weights: list[float]) -> list[int]:
    """``global_batch`` in proportion to ``weights``, largest remainders, at least 1 each."""
    total = sum(weights)
    real = [global_batch * w / total for w in weights]
    out = [max(1, int(r)) for r in real]
    order = sorted(range(len(real)), key=lambda i: real[i] - int(real[i]), reverse=True)
    k = 0
    while sum(out) < global_batch:
        out[order[k % len(order)]] += 1
        k += 1
    while sum(out) > global_batch:
        i = max(range(len(out)), key=lambda j: out[j])
        out[i] -= 1
    return out


def adapt_line(m: dict) -> str:
    """One adaptation of the run: a group's re-split (rebalance), the groups' shares of the global
    batch (shares) or the job re-grouped (regroup)."""
    if m.get("kind") == "regroup":
        return f"attempt {m.get('attempt')}: re-grouped to {m.get('strategy')} {m.get('groups')}"
    if m.get("kind") == "shares":
        return f"shares of groups {m.get('groups')} from data step {m.get('data_step')}: {m.get('before')} -> {m.get('batches')}"
    return f"group {m.get('group')} step {m.get('step')}: {m.get('before')} -> {m.get('batches')}"


def pipeline(name: str, speeds: list[float], dyn: Dynamics, args: argparse.Namespace, script: Script,
             workdir: Path, cores: int, attempt: int = 0) -> dict[str, Any]:
    """probe -> bench -> launch (which plans from the stored profiles) in this scenario's own state dir;
    a later ``attempt`` launches again on the stored probe and bench."""
    workdir.mkdir(parents=True, exist_ok=True)
    state = workdir / "state"
    cfg = workdir / "cluster.toml"
    cluster_file(cfg, speeds, args.time_scale, dyn)
    env = _base_env(state, dyn.stragglers, args)
    hg = [sys.executable, "-m", "hgcli"]
    t0 = time.monotonic()
    for stage, argv in () if attempt else (("probe", [*hg, "probe", "-c", str(cfg)]),
                                           ("bench", [*hg, "bench", "-c", str(cfg), "--quick", "--model",
                                                      script.bench_model(args, workdir)])):
        proc = run(argv, env, workdir / f"{stage}.log", args.timeout)
        if proc.returncode != 0:
            raise SystemExit(f"{name}: hgtrain {stage} exit {proc.returncode}: see {workdir / f'{stage}.log'}")
    bench_s = time.monotonic() - t0
    argv = [*hg, "launch", "-c", str(cfg), "--global-batch", str(args.global_batch), "--",
            sys.executable, "-m", script.module, *script.flags(args)]
    log = workdir / (f"launch-{attempt}.log" if attempt else "launch.log")
    proc = run(argv, env, log, args.timeout)
    if proc.returncode != 0:
        raise SystemExit(f"{name}: hgtrain launch exit {proc.returncode}: see {log}")
    jobs = sorted((state / "jobs").iterdir())
    job = jobs[-1]
    record = json.loads((job / "job.json").read_text(encoding="utf-8"))
    plan = record["plan"]
    metrics = [json.loads(line) for line in (job / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
               if line.strip()]
    out = measure(metrics, cores, useful_samples(args))
    adapts = [m for m in metrics if m.get("event") == "adapt"]
    out["adapts"] = [adapt_line(m) for m in adapts]
    strategy = plan["strategy"]
    predicted = plan["predicted_samples_per_s"]
    groups = plan["groups"]
    workers = [r for r in plan["ranks"] if r["role"] == "worker"]
    out.update({
        "strategy": strategy, "predicted": predicted.get(strategy),
        "error": predicted[strategy] / out["samples_per_s"] - 1 if predicted.get(strategy) else None,
        "predicted_allreduce": predicted.get("allreduce"), "predicted_ideal": predicted.get("ideal"),
        "layout": "+".join(f"{len(g['ranks'])}x{g.get('accumulate', 1)}" for g in groups),
        "batches": [r["batch_size"] for r in workers], "ps": len(plan.get("ps_shards") or []),
        "reason": plan.get("reason", ""), "bench_s": bench_s,
        # the launch's own end summary (item 5), as a user sees it
        "summary": [line[len("hgtrain: "):] for line in proc.stderr.splitlines()
                    if line.startswith("hgtrain: ") and not line.startswith(("hgtrain: [", "hgtrain: job "))],
    })
    return out


def ddp(speeds: list[float], batches: list[int], dyn: Dynamics, args: argparse.Namespace, script: Script,
        workdir: Path, cores: int) -> dict[str, Any]:
    """torchrun (standalone, one process per device) on the DDP twin, every rank emulated."""
    metrics_dir = workdir / "metrics"
    env = _base_env(None, dyn.stragglers, args)
    if dyn.slowed is not None:
        env["E2E_SLOWDOWN"] = f"{dyn.slowed}:{dyn.after_s:.1f}:{dyn.factor:g}"
    env.update({"E2E_SPEEDS": ",".join(f"{s * args.time_scale:g}" for s in speeds),
                "E2E_BATCHES": ",".join(map(str, batches)), "E2E_METRICS": str(metrics_dir)})
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(len(speeds)),
            str(script.ddp), *script.flags(args)]
    workdir.mkdir(parents=True, exist_ok=True)
    proc = run(argv, env, workdir / "torchrun.log", args.timeout)
    if proc.returncode != 0:
        raise SystemExit(f"torchrun exit {proc.returncode}: see {workdir / 'torchrun.log'}")
    metrics = [json.loads(line) for f in sorted(metrics_dir.glob("rank*.jsonl"))
               for line in f.read_text(encoding="utf-8").splitlines() if line.strip()]
    return {**measure(metrics, cores, useful_samples(args)), "batches": batches}


def scenario(name: str, args: argparse.Namespace, script: Script, workdir: Path, cores: int,
             alone: dict[float, dict[str, Any]]) -> dict[str, Any]:
    speeds, stragglers = SCENARIOS[name]
    for s in sorted(set(speeds), reverse=True):
        if s not in alone:
            alone[s] = device_alone(s, args, script, workdir / "ideal", cores)
    ideal = sum(alone[s]["samples_per_s"] for s in speeds)
    dyn = Dynamics(stragglers=stragglers)
    if name in SLOWED:
        # a third of the run, were it at the ideal's rate (the runs themselves take longer: the
        # device is slowed before a third of any of them, for a longer share of the slower ones)
        length = args.epochs * script.train_samples(args) / ideal
        dyn = Dynamics(slowed=SLOWED[name], after_s=length / 3, factor=args.slowdown)
    where = workdir / name
    where.mkdir(parents=True)
    n = len(speeds)
    runs = {"pipeline": pipeline(name, speeds, dyn, args, script, where / "pipeline", cores)}
    print(f"... {name}/pipeline: {runs['pipeline']}", file=sys.stderr, flush=True)
    for kind, weights in (("ddp-uniform", [1.0] * n), ("ddp-prop", speeds)):
        runs[kind] = ddp(speeds, split(args.global_batch, weights), dyn, args, script, where / kind, cores)
        print(f"... {name}/{kind}: {runs[kind]}", file=sys.stderr, flush=True)
    # More pairs (--pairs): the pipeline and proportional DDP again, alternately, so the machine's
    # drift falls on both; the ratio to DDP is then the median of the pairs'.
    pairs = [(runs["pipeline"]["samples_per_s"], runs["ddp-prop"]["samples_per_s"])]
    for k in range(1, args.pairs):
        again = pipeline(name, speeds, dyn, args, script, where / "pipeline", cores, attempt=k)
        peer = ddp(speeds, split(args.global_batch, speeds), dyn, args, script, where / f"ddp-prop-{k}", cores)
        pairs.append((again["samples_per_s"], peer["samples_per_s"]))
        print(f"... {name}/pair {k}: pipeline {pairs[-1][0]:.0f}, ddp-prop {pairs[-1][1]:.0f} samples/s "
              f"({pairs[-1][0] / pairs[-1][1]:.3f})", file=sys.stderr, flush=True)
    for r in runs.values():
        r["x_ideal"] = r["samples_per_s"] / ideal
    return {"speeds": speeds, "emulated_speeds": [s * args.time_scale for s in speeds],
            "stragglers": stragglers, "slowdown": ({"device": dyn.slowed, "after_s": dyn.after_s, "factor": dyn.factor}
                                                    if dyn.slowed is not None else None),
            "ideal_samples_per_s": ideal, "runs": runs, "pairs": pairs}


# --- goals and output ----------------------------------------------------------------------------

def ratios_and_goals(results: dict[str, Any]) -> tuple[dict[str, Any], dict[str, bool | None]]:
    ratios: dict[str, Any] = {}
    goals: dict[str, bool | None] = {}
    for name, r in results.items():
        p, u, q = (r["runs"][k] for k in ("pipeline", "ddp-uniform", "ddp-prop"))
        ratios[f"{name}_x_ideal"] = p["x_ideal"]
        ratios[f"{name}_vs_uniform"] = p["samples_per_s"] / u["samples_per_s"]
        ratios[f"{name}_vs_prop"] = p["samples_per_s"] / q["samples_per_s"]
        if len(r.get("pairs", [])) > 1:
            ratios[f"{name}_vs_prop_pairs"] = [a / b for a, b in r["pairs"]]
            ratios[f"{name}_vs_prop"] = statistics.median(a / b for a, b in r["pairs"])
        ratios[f"{name}_tta_vs_prop"] = _ratio(p["time_to_target_s"], q["time_to_target_s"])
        gap = (None if p["final_accuracy"] is None or q["final_accuracy"] is None
               else 100 * (q["final_accuracy"] - p["final_accuracy"]))
        ratios[f"{name}_acc_gap_vs_prop_points"] = gap
        best = max(x["samples_per_s"] for x in r["runs"].values())
        ratios[f"{name}_vs_best_measured"] = p["samples_per_s"] / best
        goals[f"{name}_acc_within_{GOAL_ACCURACY_POINTS:g}_point"] = _le(gap, GOAL_ACCURACY_POINTS)
        goals[f"{name}_within_5%_of_best_measured"] = _ge(p["samples_per_s"] / best, 0.95)
        if name in ("static", "three"):
            goals[f"{name}_x_ideal>={GOAL_IDEAL}"] = _ge(p["x_ideal"], GOAL_IDEAL)
            goals[f"{name}_vs_uniform>={GOAL_UNIFORM}"] = _ge(ratios[f"{name}_vs_uniform"], GOAL_UNIFORM)
            goals[f"{name}_vs_prop>={GOAL_PROP}"] = _ge(ratios[f"{name}_vs_prop"], GOAL_PROP)
        if name == "stragglers":
            goals[f"stragglers_vs_prop>={GOAL_STRAGGLERS}"] = _ge(ratios["stragglers_vs_prop"], GOAL_STRAGGLERS)
        if name == "slowdown":
            goals[f"slowdown_vs_prop>={GOAL_SLOWDOWN}"] = _ge(ratios["slowdown_vs_prop"], GOAL_SLOWDOWN)
        if name == "homogeneous":
            goals["homogeneous_auto_allreduce"] = p["strategy"] == "allreduce"
            goals[f"homogeneous_vs_ddp>={GOAL_HOMOGENEOUS}"] = _ge(ratios["homogeneous_vs_prop"], GOAL_HOMOGENEOUS)
    # The cost model is static: it does not see stragglers or slowdowns, so their runs are reported, not judged.
    errors = [abs(r["runs"]["pipeline"]["error"]) for r in results.values()
              if not r["stragglers"] and not r.get("slowdown") and r["runs"]["pipeline"]["error"] is not None]
    if errors:
        ratios["cost_model_median_abs_error"] = statistics.median(errors)
        ratios["cost_model_worst_abs_error"] = max(errors)
        goals[f"cost_model_median_error<={GOAL_MEDIAN_ERROR:.0%}"] = statistics.median(errors) <= GOAL_MEDIAN_ERROR
        goals[f"cost_model_worst_error<={GOAL_WORST_ERROR:.0%}"] = max(errors) <= GOAL_WORST_ERROR
    return ratios, goals


def _fmt(v: float | None, spec: str, missing: str = "-") -> str:
    return missing if v is None else format(v, spec)


def report(args: argparse.Namespace, results: dict[str, Any], alone: dict[float, dict[str, Any]],
           cores: int, workdir: Path, elapsed: float) -> None:
    print(f"{args.script} ({SCRIPTS[args.script].describe(args)}): global batch {args.global_batch}, "
          f"{args.epochs} epochs, target "
          f"accuracy {args.target}; emulated speed = nominal x time scale {args.time_scale} (every device slower "
          f"than this machine's CPU: ranks compute briefly and sleep the rest of each step); {cores} cores")
    print("ideal, each device alone through the runtime and its emulation (best batch): " + ", ".join(
        f"speed {s:g} {a['samples_per_s']:.0f} samples/s at batch {a['best_batch']}" for s, a in sorted(alone.items())))
    head = (f"{'scenario':12} {'run':12} {'samples/s':>9} {'running':>7} {'x ideal':>7} {'t->target':>9} {'final acc':>9} "
            f"{'predicted':>9} {'error':>7} {'compute':>7} {'cpu load':>8}  plan / batches")
    print(head)
    for name, r in results.items():
        for kind, x in r["runs"].items():
            plan = (f"{x['strategy']} {x['layout']} PS {x['ps']} batches {x['batches']}" if kind == "pipeline"
                    else f"batches {x['batches']}")
            print(f"{name:12} {kind:12} {x['samples_per_s']:9.0f} {x['running_samples_per_s']:7.0f} {x['x_ideal']:7.2f} "
                  f"{_fmt(x['time_to_target_s'], '9.1f', 'not reached'):>9} {_fmt(x['final_accuracy'], '9.4f'):>9} "
                  f"{_fmt(x.get('predicted'), '9.0f'):>9} {_fmt(x.get('error'), '+7.1%'):>7} "
                  f"{_fmt(x['compute_share'], '7.2f'):>7} {_fmt(x['cpu_load_share'], '8.2f'):>8}  {plan}")
        print(f"{'':12} ideal {r['ideal_samples_per_s']:.0f} samples/s; plan's reason: {r['runs']['pipeline']['reason']}")
        if r.get("slowdown"):
            d = r["slowdown"]
            print(f"{'':12} device {d['device']} {d['factor']:g}x slower from {d['after_s']:.1f} s after each rank started")
        for line in r["runs"]["pipeline"].get("adapts", []):
            print(f"{'':12} rebalanced | {line}")
        for line in r["runs"]["pipeline"]["summary"]:
            print(f"{'':12} launch summary | {line}")
    print("samples/s: the job's, every worker's samples over the time from the first step to the last; running: "
          "while every worker stepped (a PS job's groups run the same steps each at its own pace: the first to "
          "finish waits while the others train). "
          "compute: real compute / (compute + emulated sleep) of the workers; cpu load: the workers' compute "
          f"over the run's wall time x {cores} cores (small: emulated ranks barely contend for the CPU). "
          "Figures from a shared machine are noisy: one run per scenario.")
    ratios, goals = ratios_and_goals(results)
    for k, v in ratios.items():
        print(f"{k:40} {_fmt(v, '.3f') if isinstance(v, float) else v}")
    print("goals: " + ", ".join(f"{k} {'met' if v else 'MISSED' if v is not None else 'n/a'}"
                                for k, v in goals.items()))
    print(f"{elapsed:.0f} s; every command's output and metrics in {workdir}")
    print(json.dumps({"benchmark": "pipeline_e2e", "script": args.script, "flags": SCRIPTS[args.script].flags(args),
                      "hidden": args.hidden, "train_size": args.train_size,
                      "global_batch": args.global_batch, "epochs": args.epochs, "target": args.target,
                      "time_scale": args.time_scale, "quick": args.quick, "cores": cores,
                      "ideal_per_device": {f"{s:g}": a for s, a in sorted(alone.items())},
                      "scenarios": results, "ratios": ratios, "goals": goals, "elapsed_s": elapsed,
                      "workdir": str(workdir)}))


def main() -> int:
    args = parse_args()
    script = SCRIPTS[args.script]
    names = args.scenarios.split(",")
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise SystemExit(f"unknown scenario(s) {unknown}: choose from {', '.join(SCENARIOS)}")
    cores = os.cpu_count() or 1
    workdir = Path(tempfile.mkdtemp(prefix="hgtrain-e2e-"))
    started = time.monotonic()
    alone: dict[float, dict[str, Any]] = {}
    results = {name: scenario(name, args, script, workdir, cores, alone) for name in names}
    report(args, results, alone, cores, workdir, time.monotonic() - started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
