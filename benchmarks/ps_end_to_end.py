"""A 100M-parameter AdamW model on two emulated devices of equal speed: --strategy ps against --strategy allreduce.

The example MLP (``hgcli.examples.train_mlp``) at --hidden 2325581 (100.0M parameters) with AdamW
(torch's fused kernel, on the workers under allreduce and on the PS under ps), launched by
``hgtrain launch`` on a one-node cluster file declaring two emulated devices of the same speed, after
``hgtrain probe`` and ``hgtrain bench --quick --model`` (the model the script trains):

  ps         ``--strategy ps``: each device its own group, both pushing to the PS shards the planner
             chose, asynchronously;
  allreduce  ``--strategy allreduce``: one DDP group of the two devices (hgtrain's group engine).

The runs are interleaved in pairs (--pairs); per run the steady samples/s (every worker stepping, each
rank's first step left out) of the job's metrics. The two move about the same bytes per worker step (a
model's gradient out, a model's parameters or reduced gradient in), so the PS path must cost no more
than the ring all-reduce: goal ps >= 0.8 x allreduce (the median of the pairs' ratios). Readable
table, then one JSON line with the figures and a ``goals`` object.

    PYTHONPATH=. .venv/bin/python benchmarks/ps_end_to_end.py               (about 10 minutes)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline_e2e import REPO, _base_env, measure, run  # noqa: E402

GOAL = 0.8
HIDDEN = 2_325_581          # 43 x hidden + 10 = 100,000,000 parameters
DEVICE = ("NVIDIA A100-SXM4-40GB", 40960)


def cluster_file(path: Path, speed: float) -> None:
    path.write_text(f'[[nodes]]\nhost = "localhost"\nname = "local"\npython = {json.dumps(sys.executable)}\n'
                    f'emulate = {{ devices = ["{DEVICE[0]}", "{DEVICE[0]}"], speed = [{speed:g}, {speed:g}], '
                    f"memory_mib = [{DEVICE[1]}, {DEVICE[1]}] }}\n", encoding="utf-8")


def flags(args: argparse.Namespace) -> list[str]:
    return ["--hidden", str(args.hidden), "--optimizer", "adamw", "--lr", "1e-4", "--epochs", "1",
            "--max-steps", str(args.steps), "--train-samples", str(args.steps * args.global_batch),
            "--eval-every", "1000000000", "--eval-samples", "256", "--target", "0.5"]


def launch(strategy: str, args: argparse.Namespace, cfg: Path, env: dict[str, str], workdir: Path,
           k: int, cores: int) -> dict[str, Any]:
    log = workdir / f"launch-{strategy}-{k}.log"
    argv = [sys.executable, "-m", "hgcli", "launch", "-c", str(cfg), "--strategy", strategy,
            "--global-batch", str(args.global_batch), "--", sys.executable, "-m", "hgcli.examples.train_mlp",
            *flags(args)]
    t0 = time.monotonic()
    proc = run(argv, env, log, args.timeout)
    if proc.returncode != 0:
        raise SystemExit(f"ps_end_to_end: hgtrain launch --strategy {strategy} exit {proc.returncode}: see {log}")
    state = Path(env["HGTRAIN_STATE_DIR"])
    job = sorted((state / "jobs").iterdir(), key=lambda p: p.stat().st_mtime)[-1]
    record = json.loads((job / "job.json").read_text(encoding="utf-8"))
    metrics = [json.loads(line) for line in (job / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
               if line.strip()]
    out = measure(metrics, cores)
    plan = record["plan"]
    out.update({"strategy": plan["strategy"], "ps": len(plan.get("ps_shards") or []),
                "batches": [r["batch_size"] for r in plan["ranks"] if r["role"] == "worker"],
                "wall_s": time.monotonic() - t0})
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=HIDDEN)
    p.add_argument("--speed", type=float, default=0.5, help="emulated speed of both devices")
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=30, help="steps per worker")
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--timeout", type=float, default=1800)
    args = p.parse_args()
    cores = len(os.sched_getaffinity(0))
    workdir = Path(tempfile.mkdtemp(prefix="hgtrain-ps-e2e-"))
    cfg = workdir / "cluster.toml"
    cluster_file(cfg, args.speed)
    env = _base_env(workdir / "state")
    factory = workdir / "model.py"
    factory.write_text("from hgcli.examples.models import example\n\n\n"
                       f"def factory():\n    return example(hidden={args.hidden})\n")
    hg = [sys.executable, "-m", "hgcli"]
    for stage, argv in (("probe", [*hg, "probe", "-c", str(cfg)]),
                        ("bench", [*hg, "bench", "-c", str(cfg), "--quick", "--model",
                                   f"{factory}:factory@{args.global_batch // 2}"])):
        proc = run(argv, env, workdir / f"{stage}.log", args.timeout)
        if proc.returncode != 0:
            raise SystemExit(f"ps_end_to_end: hgtrain {stage} exit {proc.returncode}: see {workdir / f'{stage}.log'}")
    runs: dict[str, list[dict[str, Any]]] = {"ps": [], "allreduce": []}
    for k in range(args.pairs):
        for strategy in (("ps", "allreduce") if k % 2 == 0 else ("allreduce", "ps")):
            r = launch(strategy, args, cfg, env, workdir, k, cores)
            runs[strategy].append(r)
            print(f"... pair {k}: {strategy}: {r['samples_per_s']:.1f} samples/s ({r['ps']} PS shard(s), batches "
                  f"{r['batches']})", file=sys.stderr, flush=True)
    ratios = [a["samples_per_s"] / b["samples_per_s"] for a, b in zip(runs["ps"], runs["allreduce"])]
    ratio = statistics.median(ratios)
    params = 43 * args.hidden + 10
    print(f"\n{params / 1e6:.1f}M parameters, AdamW (fused), two emulated {DEVICE[0]} at speed {args.speed:g}, "
          f"global batch {args.global_batch}, {args.steps} steps per worker; work dir {workdir}")
    print(f"{'pair':>4} {'ps samples/s':>13} {'allreduce':>10} {'ratio':>6} {'PS shards':>9}")
    for k, (a, b) in enumerate(zip(runs["ps"], runs["allreduce"])):
        print(f"{k:>4} {a['samples_per_s']:>13.1f} {b['samples_per_s']:>10.1f} {ratios[k]:>6.2f} {a['ps']:>9}")
    print(f"median ratio ps / allreduce: {ratio:.2f} (goal >= {GOAL})")
    print(json.dumps({"benchmark": "ps_end_to_end", "parameters": params, "speed": args.speed,
                      "global_batch": args.global_batch, "runs": runs, "ratios": ratios,
                      "goals": {"ps_at_least_0.8x_allreduce": ratio >= GOAL}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
