"""One short check of hgtrain's real-GPU paths, for a machine with NVIDIA GPUs (none here).

    OUT=/tmp/gpucheck python3 benchmarks/gpu_check.py

What it runs, each step with its own time limit, on the embedded local cluster (this machine; with
nvidia-smi on PATH its real GPUs, no emulation), a fresh state dir:
  1. nvidia-smi with the probe's own query (raw CSV kept: tests/fakes/nvidia-smi's `h200` scenario is
     such a capture);
  2. `hgtrain probe --json` (the node probe's parse of the real output, torch's CUDA version);
  3. `hgtrain bench --json` (matmul fp32/bf16/fp16, memory and host-to-device bandwidth, the
     example model's step time per batch on the GPU);
  4. `hgtrain plan --json` (it must reuse the stored profiles: its stderr is checked for a re-bench);
  5. `hgtrain launch` of the README's main job at global batch 32 (the default for one device) and
     2048, and with --strategy ps (a GPU worker pushing to CPU parameter servers over RPC): measured
     samples/s against the plan's prediction;
  6. tests/runtime/test_gpu.py: NCCL groups of real-GPU ranks with a PS, and the named error for a
     model left on the CPU (a two-GPU test runs where there are two);
  7. the peer: torchrun --standalone --nproc-per-node 1 running the same example (wall time).
A GPU machine of one card cannot host an NCCL group of two ranks: NCCL 2.28.9 answered "invalid
usage" (two ranks on one device) on an H200.

Writes $OUT/log.txt (everything), $OUT/smi.csv, $OUT/probe.json, $OUT/bench.json, $OUT/plan.json,
$OUT/summary.json (the figures). Exit 0 always: the log says which step failed.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

OUT = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="gpucheck-"))
LOG = OUT / "log.txt"
HG = [sys.executable, "-m", "hgcli"]
TRAIN = [sys.executable, "-m", "hgcli.examples.train"]
summary: dict[str, object] = {}


def say(text: str) -> None:
    print(text, flush=True)
    with open(LOG, "a") as fh:
        fh.write(text + "\n")


def step(name: str, argv: list[str], limit_s: float, save: str | None = None) -> tuple[int, str, str]:
    say(f"\n=== {name}: {' '.join(argv)}")
    t0 = time.monotonic()
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=limit_s,
                              stdin=subprocess.DEVNULL)
        rc, out, err = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as exc:
        rc, out, err = 124, str(exc.stdout or ""), str(exc.stderr or "")
    except OSError as exc:
        rc, out, err = 127, "", str(exc)
    wall = time.monotonic() - t0
    if save:
        (OUT / save).write_text(out)
    say(out[-6000:] if not save else f"(stdout in {save}, {len(out)} chars)")
    if err.strip():
        say("--- stderr:\n" + err[-4000:])
    say(f"=== {name}: exit {rc}, {wall:.1f} s")
    summary[f"{name}_exit"] = rc
    summary[f"{name}_wall_s"] = round(wall, 2)
    return rc, out, err


def environment() -> None:
    import torch
    say(f"python {sys.version.split()[0]}, torch {torch.__version__}, cuda {torch.version.cuda}, "
        f"available {torch.cuda.is_available()}, devices {torch.cuda.device_count()}, "
        f"nccl {torch.cuda.nccl.version() if torch.cuda.is_available() else None}")
    summary["torch"] = torch.__version__
    from hgcli.node.probe import QUERY_FIELDS
    fields = ",".join(QUERY_FIELDS)
    step("smi", ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"], 30,
         save="smi.csv")
    step("smi_units", ["nvidia-smi", f"--query-gpu={fields}", "--format=csv"], 30)


def figures_of_launch(name: str, out: str) -> None:
    # The launcher's --json summary holds the job's final metrics and the plan's prediction.
    try:
        doc = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return
    summary[f"{name}_result"] = doc


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    os.environ["HGTRAIN_STATE_DIR"] = tempfile.mkdtemp(prefix="hgstate-")
    os.environ["PYTHONUNBUFFERED"] = "1"
    environment()
    step("probe", HG + ["probe", "--json"], 60, save="probe.json")
    step("probe_table", HG + ["probe"], 60)
    step("bench", HG + ["bench", "--json"], 240, save="bench.json")
    _, _, err = step("plan", HG + ["plan", "--json"], 60, save="plan.json")
    summary["plan_rebenched"] = "benching" in err      # it must reuse the stored profiles
    for gb in (32, 2048):
        _, out, _ = step(f"launch_gb{gb}", HG + ["launch", "--json", "--global-batch", str(gb), "--"] + TRAIN, 150)
        figures_of_launch(f"launch_gb{gb}", out)
    _, out, _ = step("launch_ps", HG + ["launch", "--json", "--strategy", "ps", "--"] + TRAIN, 150)
    figures_of_launch("launch_ps", out)
    step("test_gpu", [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                      "tests/runtime/test_gpu.py"], 200)
    step("torchrun", [sys.executable, "-m", "torch.distributed.run", "--standalone",
                      "--nproc-per-node", "1", "-m", "hgcli.examples.train"], 150)
    (OUT / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    say(json.dumps(summary, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
